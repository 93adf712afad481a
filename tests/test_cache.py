"""Content-addressed data steps: unchanged inputs reuse the earlier output, any change to what
a data step reads computes it again, and two drivers with the same key end with one indexed,
complete output."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from pipeline import cache
from pipeline.config import load_settings
from pipeline.driver import consult_cache, parse_steps, run_pipeline
from pipeline.paths import ExperimentTree
from pipeline.sources import resolve_sources
from pipeline.store import LocalStore, is_complete
from pipeline.user_check import check_user_functions
from tests.conftest import write_settings
from tests.test_user_functions import REVIEWS, write_module, write_reviews

TREE = ExperimentTree("reviews")


def data_run(tmp_path, module="reviews_cache", steps="reconcile,prepare", use_cache=True, **data):
    path = write_settings(
        tmp_path / "settings.ini", str(tmp_path / "store"),
        experiment={"USER_FUNCTIONS": module, "NAME": "reviews"},
        data={"RAW_DATA": str(tmp_path / "raw"), "MAX_SEQUENCE_LENGTH": "12", **data},
        models={"MODEL_NAMES": "tiny"},
    )  # fmt: skip
    settings = load_settings(path, env={})
    store = LocalStore(settings.store_uri())
    record = run_pipeline(settings, store, parse_steps(steps), echo=sys.stdout, use_cache=use_cache)
    return record, store


def planned(tmp_path, **data) -> dict[str, str]:
    """What the driver would do with each data step of a run with these [data] settings."""
    path = write_settings(
        tmp_path / "planned.ini", str(tmp_path / "store"),
        experiment={"USER_FUNCTIONS": "reviews_cache", "NAME": "reviews"},
        data={"RAW_DATA": str(tmp_path / "raw"), "MAX_SEQUENCE_LENGTH": "12", **data},
        models={"MODEL_NAMES": "tiny"},
    )  # fmt: skip
    settings = load_settings(path, env={})
    store, steps = LocalStore(settings.store_uri()), parse_steps("reconcile,prepare")
    sources = resolve_sources(settings, store, TREE, steps)
    reaches = check_user_functions(settings)
    entries = consult_cache(settings, store, TREE, steps, sources, reaches, use_cache=True)
    return {step: entry.status for step, entry in entries.items()}


def verdicts(record) -> dict[str, tuple[str, int | None]]:
    """step -> (computed | reused | skipped, the data version reused)."""
    return {s: (e["status"], e["data_version"]) for s, e in record["data_steps"].items()}


def test_unchanged_inputs_reuse_and_each_change_recomputes(tmp_path, caplog, monkeypatch):
    caplog.set_level("INFO", logger="smpipe")
    write_module(tmp_path, "reviews_cache", REVIEWS)
    write_reviews(tmp_path / "raw")
    first, store = data_run(tmp_path)
    assert verdicts(first) == {"reconcile": ("computed", None), "prepare": ("computed", None)}
    assert len(store.list_keys("reviews/cache/reconcile/")) == 1

    # The key holds each step's own code, read through what it imports, and prepare's split
    # fractions and seed: a change to any of them computes again (asked of the driver; no job).
    assert planned(tmp_path) == {"reconcile": "reused", "prepare": "reused"}
    assert planned(tmp_path, SEED="7") == {"reconcile": "reused", "prepare": "computed"}
    fractions = {"TRAIN_FRACTION": "0.7", "TEST_FRACTION": "0.2"}
    assert planned(tmp_path, **fractions) == {"reconcile": "reused", "prepare": "computed"}
    code = tmp_path / "steps"
    shutil.copytree(cache.STEPS_DIR, code, ignore=shutil.ignore_patterns("__pycache__"))
    with monkeypatch.context() as patch:
        patch.setattr(cache, "STEPS_DIR", code)
        assert planned(tmp_path) == {"reconcile": "reused", "prepare": "reused"}
        with open(code / "prepared_files.py", "a") as f:  # imported by prepare alone
            f.write("\n# one line more\n")
        assert planned(tmp_path) == {"reconcile": "reused", "prepare": "computed"}
        with open(code / "runtime/step.py", "a") as f:  # imported by both
            f.write("\n# one line more\n")
        assert planned(tmp_path) == {"reconcile": "computed", "prepare": "computed"}

    # Nothing the data steps read changed (load_model did): both reused, no new data
    # version, the run says where from.
    write_module(
        tmp_path, "reviews_cache", REVIEWS.replace("Tiny(len(id2label))", "Tiny(len(label2id))")
    )
    second, _ = data_run(tmp_path)
    assert verdicts(second) == {"reconcile": ("reused", 1), "prepare": ("reused", 1)}
    assert second["data_version"] == 1 and "reconcile" not in second["steps"]
    assert store.list_children("reviews/data/") == ["0001"]
    assert "reusing prepared" in caplog.text and "(cache: same inputs" in caplog.text

    # Another change to a function the data steps do not call (load_model): still reused.
    other = REVIEWS.replace("Tiny(len(id2label))", "Tiny(len(id2label) or 1)")
    write_module(tmp_path, "reviews_cache", other)
    assert verdicts(data_run(tmp_path)[0]) == {"reconcile": ("reused", 1), "prepare": ("reused", 1)}

    # One character of encode: reconcile reused, prepare computed into this run's version.
    write_module(
        tmp_path, "reviews_cache", REVIEWS.replace("[0] * (max_length", "[0]*(max_length", 1)
    )
    third, _ = data_run(tmp_path)
    assert verdicts(third) == {"reconcile": ("reused", 1), "prepare": ("computed", None)}
    assert third["data_version"] == third["model_version"]
    # ...and its prepared data records the snapshot it was made from (data 0001's).
    made_from = json.loads(store.get_bytes(TREE.data(third["model_version"]).prepared_from))
    assert made_from["snapshot_hash"] == first["data_snapshot_hash"] == third["data_snapshot_hash"]

    # MAX_SEQUENCE_LENGTH (prepare's argument): prepare computed, reconcile reused.
    fourth, _ = data_run(tmp_path, MAX_SEQUENCE_LENGTH="10")
    assert verdicts(fourth) == {"reconcile": ("reused", 1), "prepare": ("computed", None)}

    # One character of the raw data: both computed.
    raw = tmp_path / "raw/reviews.jsonl"
    raw.write_text(raw.read_text().replace("great", "greet", 1))
    fifth, _ = data_run(tmp_path)
    assert verdicts(fifth) == {"reconcile": ("computed", None), "prepare": ("computed", None)}

    # --no-cache: computed although the inputs are those of the fifth run.
    sixth, _ = data_run(tmp_path, use_cache=False)
    assert verdicts(sixth) == {"reconcile": ("computed", None), "prepare": ("computed", None)}
    assert "--no-cache" in sixth["data_steps"]["prepare"]["note"]


def test_a_prepare_is_found_whether_its_run_made_its_snapshot_or_reused_one(tmp_path):
    """A whole run keys prepare by the reconcile that makes its snapshot in the same run;
    `--steps prepare,...` (and --steps train, which adds prepare when the newest prepared data
    is cut otherwise) by the snapshot it reuses. Each missed the other's identical prepare and
    computed it again."""
    write_module(tmp_path, "reviews_cache", REVIEWS)
    write_reviews(tmp_path / "raw")
    whole, store = data_run(tmp_path)
    data_run(tmp_path, MAX_SEQUENCE_LENGTH="10")  # the newest prepared data: another length
    alone, _ = data_run(tmp_path, steps="prepare")
    assert verdicts(alone) == {"prepare": ("reused", whole["data_version"])}

    partial, _ = data_run(tmp_path, steps="prepare", MAX_SEQUENCE_LENGTH="11")
    assert verdicts(partial) == {"prepare": ("computed", None)}
    assert planned(tmp_path, MAX_SEQUENCE_LENGTH="11") == {
        "reconcile": "reused",
        "prepare": "reused",
    }


@pytest.mark.slow
def test_two_drivers_with_the_same_key_end_with_one_indexed_complete_output(tmp_path):
    from tests.reliability.test_lifecycle import Driver

    write_module(tmp_path, "reviews_race", REVIEWS)
    write_reviews(tmp_path / "raw")
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "store"),
                          experiment={"USER_FUNCTIONS": "reviews_race", "NAME": "reviews"},
                          data={"RAW_DATA": str(tmp_path / "raw"), "MAX_SEQUENCE_LENGTH": "12"},
                          models={"MODEL_NAMES": "tiny"})  # fmt: skip
    (tmp_path / "tmp").mkdir()
    drivers = [Driver(path, tmp_path / "tmp", "--steps", "reconcile,prepare") for _ in range(2)]
    assert [d.finish() for d in drivers] == [0, 0], [d.output for d in drivers]
    store = LocalStore(tmp_path / "store")
    records = [json.loads(store.get_bytes(TREE.run(n).metadata)) for n in (1, 2)]
    assert all(r["status"] == "completed" for r in records)
    # Both computed (neither could see the other's output), into their own versions...
    assert [r["data_steps"]["prepare"]["status"] for r in records] == ["computed", "computed"]
    for n in (1, 2):
        assert all(is_complete(store, TREE.data(n).split(s)) for s in ("train", "test", "labels"))
    # ...the index names exactly one of them, and a third run reuses that one.
    (index,) = store.list_keys("reviews/cache/prepare/")
    indexed = json.loads(store.get_bytes(index))["data_version"]
    assert indexed in (1, 2)
    loser = records[2 - indexed]  # the other run says whose output was indexed
    assert "another run indexed the same inputs first" in loser["data_steps"]["prepare"]["note"]
    third = Driver(path, tmp_path / "tmp", "--steps", "reconcile,prepare")
    assert third.finish() == 0 and "(cache: same inputs" in third.output
    record = json.loads(store.get_bytes(TREE.run(3).metadata))
    assert record["data_steps"]["prepare"]["data_version"] == indexed


def test_a_reconcile_that_reads_files_outside_its_raw_data_is_never_reused(tmp_path, capfd):
    """A reconcile that loads an absolute path of its own (not under raw_dir): the cache key
    never saw that file, and the next run reused the snapshot after it was edited, training
    and testing on the rows it no longer held. Said, and neither its snapshot nor its prepare
    is indexed for reuse."""
    outside = tmp_path / "elsewhere"
    write_reviews(outside)
    source = REVIEWS.replace(
        '(Path(raw_dir) / "reviews.jsonl")', f"Path({str(outside / 'reviews.jsonl')!r})"
    )
    write_module(tmp_path, "reads_outside", source)
    write_reviews(tmp_path / "raw")
    first, _ = data_run(tmp_path, module="reads_outside")
    said = " ".join(capfd.readouterr().out.split())
    assert (
        f"reads_outside.reconcile read files outside the raw data it was given ({outside}" in said
    )
    lines = (outside / "reviews.jsonl").read_text().splitlines()
    (outside / "reviews.jsonl").write_text("\n".join(lines[:60]) + "\n")  # an edit: 30 rows gone
    second, _ = data_run(tmp_path, module="reads_outside")
    assert verdicts(second) == {"reconcile": ("computed", None), "prepare": ("computed", None)}
    rows = [r["steps"]["reconcile"]["details"]["rows"] for r in (first, second)]
    assert rows == [90, 60]
    assert "not reused later" in second["data_steps"]["reconcile"]["note"]


def test_files_the_reconcile_made_or_wrote_are_not_read_outside(tmp_path, monkeypatch):
    """An archive of the raw data unpacked to a temporary folder and read from there is the
    job's own making, not an input the cache misses; a file written is not read; nor is the
    user's configuration (~/.aws/config, which boto3 reads). A "/" on sys.path (`python -m`
    in a container working in "/") does not hide everything."""
    import tarfile
    import tempfile

    from steps.reconcile import files_read_outside

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home/.aws").mkdir(parents=True)
    (tmp_path / "home/.aws/config").write_text("[default]\n")
    monkeypatch.syspath_prepend("/")
    raw, old = tmp_path / "raw", tmp_path / "old.csv"
    raw.mkdir()
    (raw / "rows.csv").write_text("id,text\n")
    old.write_text("id,text\n")
    with tarfile.open(raw / "rows.tar", "w") as tar:
        tar.add(raw / "rows.csv", arcname="unpacked.csv")  # its mtime kept on extraction
    with files_read_outside(raw) as outside:
        with tempfile.TemporaryDirectory() as unpacked:
            with tarfile.open(raw / "rows.tar") as tar:
                tar.extractall(unpacked, filter="data")
            (Path(unpacked) / "unpacked.csv").read_text()
        (tmp_path / "written.txt").write_text("out")
        (raw / "rows.csv").read_text()
        (tmp_path / "home/.aws/config").read_text()
        old.read_text()
    assert outside == [str(old.resolve())]
    old.read_text()  # after the block: not listened to
    assert outside == [str(old.resolve())]
