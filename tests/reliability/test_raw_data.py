"""Issue 29, cases 5-7: raw data by content. `smpipe upload` and a run compare what files hold
(size and sha256), never names alone; hidden files and folders are not data on either side;
names the store uses for itself are refused at the boundary; the experiment's raw/ is never
overwritten; and a local RAW_DATA on a backend whose jobs cannot read this machine becomes a
content-addressed raw version, so an edit is the next run's data."""

from __future__ import annotations

import io
import json
import logging
import shutil
import sys
from pathlib import Path

import pytest

from pipeline import cli
from pipeline.config import load_settings
from pipeline.driver import parse_steps, run_pipeline
from pipeline.paths import ExperimentTree
from pipeline.sources import upload_raw
from pipeline.store import MANIFEST, LocalStore, S3Store
from tests.conftest import write_settings

TREE = ExperimentTree("test-exp")


def small_raw(out: Path) -> Path:
    """Raw data as the demo's user keeps it, small: two articles and their labels."""
    (out / "articles").mkdir(parents=True)
    (out / "articles" / "a1.txt").write_text("Shares rose after the results.")
    (out / "articles" / "a2.txt").write_text("The striker scored twice.")
    (out / "labels.csv").write_text("id,label\na1,business\na2,sport\n")
    return out


def upload(settings: Path, folder: Path, capsys) -> tuple[int, str]:
    code = cli.main(["upload", str(settings), str(folder)])
    out, err = capsys.readouterr()
    return code, out + err


def stored(store, prefix: str) -> list[str]:
    """Every file under `prefix`, hidden ones included (a LocalStore's listing skips those)."""
    if isinstance(store, LocalStore):
        root = Path(store.uri_of(prefix))
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    return sorted(k[len(prefix) :] for k in store.list_keys(prefix))


def test_upload_after_an_edit_is_refused_naming_each_file_and_raw_is_kept(store, tmp_path, capsys):
    """Case 5: an edit that keeps every name and size is told by content, and refused: raw/
    is what earlier runs read, so it is never overwritten."""
    raw = small_raw(tmp_path / "raw")
    settings = write_settings(tmp_path / "s.ini", store.uri)
    assert upload(settings, raw, capsys)[0] == 0
    before = store.get_bytes(TREE.raw + "labels.csv")
    # The same names, the same sizes ("business" and "politics" are both 8 letters).
    (raw / "labels.csv").write_text("id,label\na1,politics\na2,sport\n")
    assert (raw / "labels.csv").stat().st_size == len(before)
    code, said = upload(settings, raw, capsys)
    assert code == 1, said
    assert "changed: labels.csv" in said and "never overwritten" in said
    assert "RAW_DATA" in said  # what to do instead
    assert store.get_bytes(TREE.raw + "labels.csv") == before
    # Added and removed files are named too, and nothing is uploaded.
    (raw / "notes.txt").write_text("added")
    (raw / "articles" / "a2.txt").unlink()
    code, said = upload(settings, raw, capsys)
    assert code == 1 and "added: notes.txt" in said and "removed: articles/a2.txt" in said
    assert stored(store, TREE.raw) == ["articles/a1.txt", "articles/a2.txt", "labels.csv"]
    # The folder as it was: raw/ holds it already.
    small_raw(tmp_path / "again")
    code, said = upload(settings, tmp_path / "again", capsys)
    assert code == 0 and "holds this folder's content already" in said


def test_an_unchanged_folder_is_recognized_without_downloading_raw(store, tmp_path, monkeypatch):
    """The record `smpipe upload` keeps beside raw/ (each file's sha256, and the store's own
    fingerprint of it: S3's ETag, not an MD5 for a multipart or SSE-KMS upload) tells an
    unchanged folder without reading raw/ back."""
    raw = small_raw(tmp_path / "raw")
    assert upload_raw(store, TREE, raw) == 3

    def no_download(*args, **kwargs):
        raise AssertionError("raw/ was downloaded to be compared")

    monkeypatch.setattr(type(store), "download_file", no_download)
    assert upload_raw(store, TREE, raw) == 0


def test_hidden_files_are_not_data_on_either_side(store, tmp_path, capsys):
    """Case 7, `upload`: .DS_Store and .git/ are neither uploaded nor compared, whichever side
    holds them (`aws s3 sync` copies hidden files into S3; a LocalStore's listing skips them)."""
    raw = small_raw(tmp_path / "raw")
    (raw / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (raw / ".git").mkdir()
    (raw / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    settings = write_settings(tmp_path / "s.ini", store.uri)
    assert upload(settings, raw, capsys)[0] == 0
    assert stored(store, TREE.raw) == ["articles/a1.txt", "articles/a2.txt", "labels.csv"]
    (raw / ".DS_Store").write_bytes(b"Finder moved a window")
    store.put_bytes(TREE.raw + ".DS_Store", b"put there by hand")
    code, said = upload(settings, raw, capsys)
    assert code == 0 and "holds this folder's content already" in said, said


def test_a_file_named_as_the_store_names_its_own_is_refused(store, tmp_path, capsys):
    """A user's _MANIFEST.json would be read as the store's own manifest of the folder (and
    checked against files it does not list): refused by name, before anything is written."""
    raw = small_raw(tmp_path / "raw")
    (raw / "articles" / MANIFEST).write_text("{}")
    settings = write_settings(tmp_path / "s.ini", store.uri, data={"RAW_DATA": str(raw)})
    code, said = upload(settings, raw, capsys)
    assert code == 1 and f"articles/{MANIFEST}" in said and "rename" in said, said
    assert stored(store, TREE.raw) == []
    # A run pointed at the folder is refused before anything too (a problem of the settings).
    assert cli.main(["plan", str(settings)]) == 2
    assert f"articles/{MANIFEST}" in capsys.readouterr().err


def test_a_name_that_is_not_utf8_or_a_folder_that_cannot_be_read_is_refused(
    store, tmp_path, capsys, monkeypatch
):
    """`caf\xe9.csv` (latin-1, as old zips name files) was uploaded, and every plan and run of
    the experiment then failed with a traceback, and an upload without it was refused. A
    subfolder that cannot be read was left out without a word, the upload recorded
    complete. Both refused by name, before anything is written."""
    import os

    raw = small_raw(tmp_path / "raw")
    (raw / os.fsdecode(b"caf\xe9.csv")).write_text("id,label\n")
    settings = write_settings(tmp_path / "s.ini", store.uri)
    code, said = upload(settings, raw, capsys)
    assert code == 1 and "caf\\xe9.csv holds bytes that are not UTF-8" in said, said
    assert "Traceback" not in said and stored(store, TREE.raw) == []

    (raw / os.fsdecode(b"caf\xe9.csv")).unlink()
    (raw / "more").mkdir()
    scandir = os.scandir

    def denied(path="."):  # root reads any folder: what a user's mode-000 folder does to them
        if Path(path).name == "more":
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", denied)
    code, said = upload(settings, raw, capsys)
    assert code == 1 and "more: its folder cannot be read (Permission denied)" in said, said
    assert stored(store, TREE.raw) == []


def test_an_upload_the_settings_do_not_read_says_so(store, tmp_path, capsys):
    """A new project's settings name RAW_DATA = data: `upload` said "uploaded", and no run read
    what it sent."""
    raw = small_raw(tmp_path / "raw")
    settings = write_settings(tmp_path / "s.ini", store.uri, data={"RAW_DATA": str(raw)})
    code, said = upload(settings, raw, capsys)
    assert code == 0 and "uploaded 3 files" in said, said
    assert f"warning: [data] RAW_DATA = {raw} in {settings}: runs read that, not " in said


def retitled(folder: Path, ids: list[str], label: str) -> None:
    """labels.csv with the articles `ids` given `label`."""
    lines = (folder / "labels.csv").read_text().splitlines()
    out = [lines[0]] + [
        f"{line.split(',')[0]},{label}" if line.split(",")[0] in ids else line for line in lines[1:]
    ]
    (folder / "labels.csv").write_text("\n".join(out) + "\n")


def label_counts(store, version: int) -> dict[str, int]:
    return json.loads(store.get_bytes(TREE.data(version).snapshot_info))["label_counts"]


def emulated(tmp_path, raw: Path, store_uri: str):
    path = write_settings(tmp_path / "s.ini", store_uri, models={"MODEL_NAMES": "bow"},
                          experiment={"BACKEND": "emulated"}, data={"RAW_DATA": str(raw)})  # fmt: skip
    return load_settings(path, env={})


@pytest.mark.slow
def test_an_edited_raw_data_folder_is_the_next_emulated_run_s_data(bucket, demo_raw, tmp_path):
    """Case 6: jobs on SageMaker (emulated here) cannot read this machine's folder, so it
    becomes a raw version named by its content; an edit is a new version, which the next run
    reads (and the cache computes again), and the earlier one stays as the first run read it."""
    raw = shutil.copytree(demo_raw, tmp_path / "raw")
    store = S3Store(f"s3://{bucket}/root")
    settings = emulated(tmp_path, raw, store.uri)
    first = run_pipeline(settings, store, parse_steps("reconcile"), echo=io.StringIO())
    assert first["status"] == "completed"
    ids = [line.split(",")[0] for line in (raw / "labels.csv").read_text().splitlines()[1:]]
    retitled(raw, ids[1:4], "weather")
    second = run_pipeline(settings, store, parse_steps("reconcile"), echo=io.StringIO())
    # Not the first run's output again: reconcile read the edited labels.
    assert second["data_steps"]["reconcile"]["status"] == "computed", second["data_steps"]
    assert label_counts(store, 2)["weather"] == 3 and "weather" not in label_counts(store, 1)
    # Each run names the raw version it read.
    assert first["raw_path"].startswith(TREE.root + "raw-versions/")
    assert second["raw_path"].startswith(TREE.root + "raw-versions/")
    assert second["raw_path"] != first["raw_path"]
    # The first version is kept whole: what run 1 read is still there to read.
    assert store.list_keys(first["raw_path"]) and store.list_keys(second["raw_path"])


@pytest.mark.slow
def test_a_ds_store_does_not_refuse_the_next_emulated_run(aws_env, demo_raw, tmp_path, caplog):
    """Case 7, a run, with a local STORE as `smpipe run --backend emulated` opens it: the
    folder with a .DS_Store, unchanged otherwise, is the same raw version: not refused,
    nothing uploaded, reconcile reused."""
    from pipeline.backends.emulated import S3View

    raw = shutil.copytree(demo_raw, tmp_path / "raw")
    (raw / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    settings = emulated(tmp_path, raw, str(tmp_path / "store"))
    store = S3View(LocalStore(tmp_path / "store"))
    first = run_pipeline(settings, store, parse_steps("reconcile"), echo=io.StringIO())
    assert first["status"] == "completed"
    (raw / ".DS_Store").write_bytes(b"Finder moved a window")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="smpipe"):
        second = run_pipeline(settings, store, parse_steps("reconcile"), echo=io.StringIO())
    assert second["raw_path"] == first["raw_path"]
    assert second["data_steps"]["reconcile"]["status"] == "reused"
    assert "uploaded" not in caplog.text
    assert not list((tmp_path / "store").rglob(".DS_Store"))


@pytest.mark.slow
def test_the_local_backend_reads_the_folder_without_its_hidden_files(demo_raw, tmp_path):
    """The local backend reads RAW_DATA where it is (no raw version), and its job sees what a
    raw version holds: no hidden files or folders; an edit of one computes nothing again."""
    raw = shutil.copytree(demo_raw, tmp_path / "raw")
    (raw / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (raw / ".git").mkdir()
    (raw / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    path = write_settings(tmp_path / "s.ini", str(tmp_path / "store"), models={"MODEL_NAMES": "bow"},
                          data={"RAW_DATA": str(raw)})  # fmt: skip
    settings = load_settings(path, env={})
    store = LocalStore(settings.store_uri())
    first = run_pipeline(settings, store, parse_steps("reconcile"), echo=sys.stdout)
    assert first["raw_path"] == str(raw)
    data_files = [p for p in raw.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert first["steps"]["reconcile"]["details"]["raw_files"] == len(data_files) - 1  # .git/HEAD
    (raw / ".git" / "HEAD").write_text("ref: refs/heads/other\n")
    second = run_pipeline(settings, store, parse_steps("reconcile"), echo=sys.stdout)
    assert second["data_steps"]["reconcile"]["status"] == "reused"


def test_an_unfinished_upload_is_read_by_no_run_and_finished_by_its_folder(
    tmp_path, monkeypatch, capsys
):
    """An upload cut short (Ctrl-C, a lost connection) leaves raw/ claimed but not complete: no
    run reads it, an upload of other files is refused, the same folder's upload finishes it."""
    from pipeline import raw_data

    raw = small_raw(tmp_path / "raw")
    settings = write_settings(tmp_path / "s.ini", str(tmp_path / "store"))
    sent = raw_data.send

    def cut_short(store, files, prefix):
        sent(store, dict(list(files.items())[:1]), prefix)
        raise KeyboardInterrupt

    monkeypatch.setattr(raw_data, "send", cut_short)
    code, said = upload(settings, raw, capsys)
    assert code == 130 and "is not complete" in said, said
    monkeypatch.setattr(raw_data, "send", sent)
    assert cli.main(["plan", str(settings)]) == 2
    assert "has not finished" in capsys.readouterr().err
    other = small_raw(tmp_path / "other")
    (other / "labels.csv").write_text("id,label\na1,tech\na2,sport\n")
    code, said = upload(settings, other, capsys)
    assert code == 1 and "has not finished" in said and "changed: labels.csv" in said, said
    (raw / "articles" / "a2.txt").unlink()  # edited meanwhile: its own upload goes on as it is now
    assert upload(settings, raw, capsys)[0] == 0
    assert stored(LocalStore(tmp_path / "store"), TREE.raw) == ["articles/a1.txt", "labels.csv"]
    assert cli.main(["plan", str(settings), "--steps", "reconcile"]) == 0


def test_raw_data_in_a_bucket_is_read_where_it_is(tmp_path):
    """RAW_DATA = s3://...: the jobs read it there, on every backend (a backend other than
    local read the experiment's raw/ in its place)."""
    from pipeline.sources import resolve_sources

    path = write_settings(tmp_path / "s.ini", str(tmp_path / "store"), experiment={"BACKEND": "emulated"},
                          data={"RAW_DATA": "s3://their-bucket/raw/"})  # fmt: skip
    settings = load_settings(path, env={})
    sources = resolve_sources(settings, LocalStore(settings.store_uri()), TREE, ["reconcile"])
    assert sources.raw == "s3://their-bucket/raw/" and sources.local_raw is None


def test_a_file_deleted_while_the_driver_hashes_the_folder_is_named(tmp_path, monkeypatch):
    """A raw file removed between the folder's listing and its hashing (the user tidying up
    while a run starts): one line naming the file, not a FileNotFoundError traceback."""
    from pipeline import raw_data
    from pipeline.errors import PipelineError

    folder = tmp_path / "raw"
    folder.mkdir()
    for name in ("a.csv", "b.csv"):
        (folder / name).write_text("id,text,label\n1,x,y\n")
    listed = raw_data.checked_files

    def listed_then_deleted(path, where):
        files = listed(path, where)
        (folder / "b.csv").unlink()  # gone once listed, before it is read
        return files

    monkeypatch.setattr(raw_data, "checked_files", listed_then_deleted)
    with pytest.raises(
        PipelineError, match=r"b\.csv: could not be read while the raw data was hashed"
    ):
        raw_data.local_version(ExperimentTree("test-exp"), folder)


# -- raw versions: what crosses the network, what a refused upload leaves, what prune removes ------


@pytest.fixture(params=["local", "s3"])
def version_store(request, tmp_path):
    if request.param == "s3":
        return S3Store(f"s3://{request.getfixturevalue('bucket')}/root")
    return LocalStore(tmp_path / "store")


def uploaded_version(store, folder: Path):
    from pipeline.raw_data import local_version, raw_version_held, upload_version

    raw = local_version(TREE, folder)
    with raw_version_held(store, raw):
        return raw, upload_version(store, raw)


def test_an_edited_folder_sends_only_what_changed(version_store, tmp_path, caplog):
    """An edit of one file of a folder sends that file; the unchanged ones are copied inside the
    store from the version that holds them (a hard link in a local folder)."""
    folder = small_raw(tmp_path / "raw")
    (folder / "big.bin").write_bytes(bytes(range(256)) * 4096)
    first, sent = uploaded_version(version_store, folder)
    assert sent == 4
    (folder / "labels.csv").write_text("id,label\na1,business\na2,tech\n")
    with caplog.at_level(logging.INFO, logger="smpipe"):
        second, sent = uploaded_version(version_store, folder)
    assert sent == 1 and second.version != first.version
    assert "3 unchanged ones copied from earlier versions" in caplog.text
    files = second.version.files
    assert version_store.get_bytes(files + "big.bin") == (folder / "big.bin").read_bytes()
    assert version_store.get_bytes(files + "labels.csv") == (folder / "labels.csv").read_bytes()
    assert (
        version_store.get_bytes(first.version.files + "labels.csv")
        != (folder / "labels.csv").read_bytes()
    )  # the first version is as it was
    if isinstance(version_store, LocalStore):  # one file on disk for both versions
        one, two = (
            Path(version_store.uri_of(v.files + "big.bin")) for v in (first.version, second.version)
        )
        assert one.stat().st_ino == two.stat().st_ino


def test_a_refused_or_interrupted_upload_leaves_nothing(version_store, tmp_path, monkeypatch):
    from pipeline import raw_data
    from pipeline.errors import PipelineError

    folder = small_raw(tmp_path / "raw")
    moving = raw_data.stamps
    calls = []

    def edited_during_upload(files):
        calls.append(1)
        found = moving(files)
        return found if len(calls) == 1 else {k: (0, 0) for k in found}

    monkeypatch.setattr(raw_data, "stamps", edited_during_upload)
    with pytest.raises(PipelineError, match="changed while it was uploaded"):
        uploaded_version(version_store, folder)
    assert version_store.list_keys(TREE.raw_versions_root) == []
    monkeypatch.setattr(raw_data, "stamps", moving)
    sent = raw_data.send

    def cut_short(store, files, prefix):
        sent(store, dict(list(files.items())[:1]), prefix)
        raise KeyboardInterrupt

    monkeypatch.setattr(raw_data, "send", cut_short)
    with pytest.raises(KeyboardInterrupt):
        uploaded_version(version_store, folder)
    assert version_store.list_keys(TREE.raw_versions_root) == []


def test_prune_removes_the_raw_versions_nothing_reads(tmp_path, capsys):
    """A version that only a pruned run read, and an upload a killed driver left, go (and the
    dry run says so first); the one a kept run reads, the newest, and one a live driver is
    uploading stay."""
    import json
    import os
    import socket
    import time as clock

    from tests.test_prune import write_run

    store = LocalStore(tmp_path / "store")
    path = write_settings(tmp_path / "s.ini", str(store.root))
    folder = small_raw(tmp_path / "raw")
    versions = []
    for label in ("tech", "sport", "weather"):
        (folder / "labels.csv").write_text(f"id,label\na1,{label}\na2,sport\n")
        versions.append(uploaded_version(store, folder)[0].version)
    old, read, newest = versions
    for day, version in enumerate(versions, 1):  # uploaded on three days, not in one second
        manifest = json.loads(store.get_bytes(version.prefix + MANIFEST))
        manifest["created"] = f"2026-11-0{day}T12:00:00Z"
        store.put_bytes(version.prefix + MANIFEST, json.dumps(manifest).encode())
    for run_num, version, status in (
        (1, old, "completed"),
        (2, read, "completed"),
        (3, read, "completed"),
    ):
        run = write_run(store, run_num, status)
        record = json.loads(store.get_bytes(run.metadata))
        store.put_bytes(run.metadata, json.dumps({**record, "raw_path": version.files}).encode())
    killed = TREE.raw_version("0" * 64)  # a killed driver's upload: files, no manifest, no holder
    store.put_bytes(killed.files + "labels.csv", b"id,label\n")
    uploading = TREE.raw_version("1" * 64)  # a live driver's: held by this process
    store.put_bytes(uploading.files + "labels.csv", b"id,label\n")
    holder = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "doing": "uploaded",
        "time": clock.time(),
    }
    store.create(uploading.lease, json.dumps(holder).encode())

    assert cli.main(["prune", str(path), "--keep", "2"]) == 0
    out = capsys.readouterr().out
    assert (
        f"raw version {old.digest[:12]} (no run that is not pruned reads it): would remove" in out
    )
    assert f"raw version {'0' * 12} (an upload that did not finish): would remove" in out
    # What stays is said too, with why (a dry run lists what it keeps, not only what goes).
    assert f"kept raw version {read.digest[:12]} (" in out and "): runs 0002, 0003 read it" in out
    assert f"kept raw version {newest.digest[:12]} (" in out and "): the newest version" in out
    assert f"kept raw version {'1' * 12} (" in out and "): a driver holds it (uploading" in out
    assert store.list_keys(old.prefix)
    assert cli.main(["prune", str(path), "--keep", "2", "--yes"]) == 0
    out = capsys.readouterr().out
    assert f"raw version {old.digest[:12]} (no run that is not pruned reads it): removed" in out
    assert "and 2 raw versions" in out
    assert not store.list_keys(old.prefix) and not store.list_keys(killed.prefix)
    for kept in (read, newest):
        assert store.list_keys(kept.files)
    assert store.list_keys(uploading.files)


def test_a_resume_after_the_raw_folder_was_edited_is_refused(tmp_path):
    """Reconcile failed on the data; the user fixes the folder and resumes. The local backend
    reads the folder in place, so the resumed reconcile would read the edited data and cache
    its snapshot under the key of what the run started with (a later run of the original
    data would then reuse the edited one). Refused, as edited code is; a new run reconciles."""
    from pipeline.errors import PipelineError
    from tests.test_user_functions import REVIEWS, reviews_run, write_module, write_reviews

    kept = '    kept = [r for r in rows if r.get("stars") is not None]'
    assert kept in REVIEWS
    strict = REVIEWS.replace(
        kept,
        "    if any(r['review'] == 'broken' for r in rows):\n"
        "        raise ValueError('a broken review')\n" + kept,
    )
    write_module(tmp_path, "strict_reviews", strict)
    write_reviews(tmp_path / "raw")
    reviews = tmp_path / "raw/reviews.jsonl"
    original = reviews.read_text()
    reviews.write_text(original + json.dumps({"id": "x", "review": "broken", "stars": 5}) + "\n")
    settings, store = reviews_run(tmp_path, "strict_reviews")
    with pytest.raises(PipelineError, match="a broken review"):
        run_pipeline(settings, store, parse_steps(None), echo=io.StringIO())
    reviews.write_text(original)  # the fix
    with pytest.raises(PipelineError) as info:
        run_pipeline(settings, store, parse_steps(None), echo=io.StringIO(), resume=1)
    said = str(info.value)
    assert f"--resume 1: the raw data at {tmp_path / 'raw'} differs from what run 0001 " in said
    assert "put it back to resume, or start a new run" in said
    assert not store.exists("reviews/cache/reconcile")  # nothing indexed under the old key


def test_a_resume_whose_code_or_completed_model_lost_a_file_is_refused_naming_it(
    tmp_path, monkeypatch
):
    """A run failed in its second model's training; its code/, then its first model,
    completed, lost a file (removed by hand, a lifecycle rule). The resume takes both as they
    are, so a job would fail on every resume: it is refused before any job, naming the file."""
    from pipeline.errors import PipelineError
    from tests.test_user_functions import REVIEWS, reviews_run, write_module, write_reviews

    breaking = REVIEWS.replace(
        "def load_model(model_name, id2label, label2id):\n",
        "def load_model(model_name, id2label, label2id):\n"
        "    import os\n"  # in its job (a job root), not in the driver's check
        "    if model_name == 'bad' and os.environ.get('SMPIPE_ML_ROOT'):\n"
        "        raise RuntimeError('bad fails in its job')\n",
    )
    assert breaking != REVIEWS
    write_module(tmp_path, "breaking_reviews", breaking)
    write_reviews(tmp_path / "raw")
    settings, store = reviews_run(tmp_path, "breaking_reviews", models="tiny, bad")
    with pytest.raises(PipelineError, match="bad fails in its job"):
        run_pipeline(settings, store, parse_steps(None), echo=io.StringIO())
    run = ExperimentTree("reviews").run(1)
    # The run's code/ lost the user module: the jobs would fail on it on every resume.
    module = next(k for k in store.list_keys(run.code) if k.endswith("breaking_reviews.py"))
    kept = store.get_bytes(module)
    store.delete(module)
    with pytest.raises(PipelineError) as info:
        run_pipeline(settings, store, parse_steps(None), echo=io.StringIO(), resume=1)
    said = str(info.value)
    assert "--resume 1: the code run 0001 started with lost files its manifest lists" in said
    assert "breaking_reviews.py); put them back to resume" in said
    store.put_bytes(module, kept)
    model = run.final_model("tiny")
    weights = next(k for k in store.list_keys(model) if not k.endswith(MANIFEST))
    store.delete(weights)
    with pytest.raises(PipelineError) as info:
        run_pipeline(settings, store, parse_steps(None), echo=io.StringIO(), resume=1)
    said = str(info.value)
    assert "--resume 1: a model run 0001 completed lost files its manifest lists" in said
    assert weights.rsplit("/", 1)[-1] in said and "put them back to resume" in said


def test_a_link_to_nothing_and_a_pipe_are_each_named_for_what_they_are(tmp_path):
    """Both were "not a file that can be read (a broken link?)", a named pipe too."""
    import os

    from pipeline.raw_data import folder_problems

    raw = small_raw(tmp_path / "raw")
    (raw / "gone.csv").symlink_to(tmp_path / "nowhere.csv")
    os.mkfifo(raw / "feed.csv")
    assert folder_problems(raw) == [
        f"{raw}/feed.csv is not a file that can be read (a pipe or device)",
        f"{raw}/gone.csv is not a file that can be read (a link that leads nowhere)",
    ]
