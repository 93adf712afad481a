"""Finding 7: settings and store problems end in one ConfigError (exit 2), listing every
problem, before anything is created; never a traceback or a silent surprise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import run_pipeline
from pipeline.config import ConfigError, load_settings
from pipeline.store import LocalStore
from tests.conftest import ROOT, write_settings


def cli(settings: Path, capsys, *extra: str) -> tuple[int, str]:
    code = run_pipeline.main([str(settings), "--dry-run", *extra])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return code, captured.err


def problems_of(path: Path, env: dict | None = None) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_settings(path, env or {})
    return e.value.problems


def test_a_byte_order_mark_is_read_as_utf8(tmp_path):
    path = write_settings(tmp_path / "s.ini", str(tmp_path / "store"))
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert load_settings(path, {}).experiment.name == "test-exp"


def test_a_folder_or_non_utf8_file_is_named(tmp_path, capsys):
    code, err = cli(tmp_path, capsys)
    assert code == 2 and "is a folder; name the settings .ini file in it" in err
    path = tmp_path / "latin1.ini"
    path.write_bytes("[experiment]\nNAME = caf\xe9\n".encode("latin-1"))
    [problem] = problems_of(path)
    assert problem.startswith("line 2: not UTF-8 text (byte 0xe9)")
    [problem] = problems_of(tmp_path)
    assert "is a folder" in problem


@pytest.mark.parametrize(
    "where, expected",
    [
        ("file", "is a file, not a folder"),
        ("under-file", "cannot be made: "),
        ("/proc/smpipe-store", "is not writable"),
    ],
)
def test_an_unusable_store_is_refused_before_anything_is_written(tmp_path, capsys, where, expected):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    store = {"file": blocker, "under-file": blocker / "store"}.get(where, where)
    settings = write_settings(tmp_path / "s.ini", str(store))
    before = sorted(p.name for p in tmp_path.iterdir())
    code, err = cli(settings, capsys)
    assert code == 2 and "[experiment] STORE" in err and expected in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_read_only_store_is_refused(tmp_path, capsys):
    """A folder its user may not write to. Root writes through permission bits (and CI runs
    as root), so there the check runs in a child that has become `nobody`, as any user who is
    not root meets the folder."""
    if os.geteuid() != 0:
        store = tmp_path / "ro"
        store.mkdir(mode=0o555)
        code, err = cli(write_settings(tmp_path / "s.ini", str(store)), capsys)
        assert code == 2 and "is not writable" in err
        return
    shared = Path(tempfile.mkdtemp(prefix="smpipe-ro-"))  # /tmp: a path nobody can walk
    try:
        shared.chmod(0o755)
        store = shared / "ro"
        store.mkdir(mode=0o555)
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # the child: nobody, asking the store what stops a write
            os.close(read)
            try:
                os.setgid(65534)
                os.setuid(65534)
                os.write(write, json.dumps(LocalStore(store).problems()).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as answer:
            problems = json.loads(answer.read() or "null")
        os.waitpid(child, 0)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert problems and f"{store} is not writable (Permission denied in {store})" in problems[0]


def test_a_store_on_a_read_only_mount_is_refused_even_to_root(tmp_path):
    """A store folder on a read-only file system: no user writes there, root included (open(2):
    EROFS, "pathname refers to a file on a read-only filesystem and write access was
    requested", is checked before permissions, which root's capabilities bypass). The folder
    gets a read-only tmpfs in a mount namespace of the dry run's own (unshare(1); as a user
    other than root, in a user namespace too), so nothing outside it sees the mount, and it
    goes with the process. Where namespaces cannot be made, the test fails saying so."""
    store = tmp_path / "store"
    store.mkdir()
    settings = write_settings(tmp_path / "s.ini", str(store))
    user_namespace = [] if os.geteuid() == 0 else ["--map-root-user"]
    script = 'mount -t tmpfs -o ro smpipe-read-only "$1" || exit 99; shift; exec "$@"'
    done = subprocess.run(
        ["unshare", "--mount", *user_namespace, "sh", "-c", script, "sh", str(store),
         sys.executable, str(ROOT / "run_pipeline.py"), str(settings), "--dry-run"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert done.returncode != 99, f"no read-only mount could be made here: {done.stderr}"
    assert done.returncode == 2, done.stdout + done.stderr
    assert (
        f"[experiment] STORE: {store} is not writable (Read-only file system in {store})"
        in done.stderr
    )
    assert "Traceback" not in done.stderr and not list(store.iterdir())


def test_a_dry_run_creates_no_store_folder(tmp_path, capsys, demo_raw):
    store = tmp_path / "not-yet"
    settings = write_settings(tmp_path / "s.ini", str(store), data={"RAW_DATA": str(demo_raw)})
    code, err = cli(settings, capsys)
    assert code == 0, err
    assert not store.exists()


@pytest.mark.skipif(
    any(Path("/dev").glob("nvidia[0-9]*")), reason="this machine's GPUs compute fp16"
)
@pytest.mark.parametrize(
    "backend, emulated, where",
    [
        pytest.param("local", {}, "the local backend runs its jobs on this machine", id="local"),
        pytest.param(
            "emulated",
            {},
            "the emulated backend plays its jobs as processes of this machine",
            id="emulated",
        ),
        pytest.param(
            "emulated",
            {"IMAGE": "smpipe:latest"},
            "the emulated backend runs its jobs in containers of smpipe:latest",
            id="emulated-image",
        ),
    ],
)
def test_fp16_on_hosts_without_a_gpu_is_refused_before_any_job(
    tmp_path, capsys, demo_raw, backend, emulated, where
):
    """The training job refuses fp16 on a CPU (steps/precision.py), but only once reconcile
    and prepare have run: the driver knows the hosts of these backends have no GPU, and says
    so first, per model, with the settings' other problems."""
    store = tmp_path / "store"
    settings = write_settings(
        tmp_path / "s.ini",
        str(store),
        experiment={"BACKEND": backend},
        emulated=emulated,
        data={"RAW_DATA": str(demo_raw)},
        training={"MIXED_PRECISION": "fp16"},
        **{"training.bow": {"MIXED_PRECISION": "bf16"}},
    )
    code, err = cli(settings, capsys)
    assert code == 2, err
    assert f"model minilm: MIXED_PRECISION = fp16 needs a GPU, and {where}, which has none" in err
    assert "model bow" not in err  # its own section asks for bf16
    # Not a dry run either: nothing is claimed or written.
    assert run_pipeline.main([str(settings)]) == 2
    assert not store.exists()


@pytest.mark.parametrize("backend", ["local", "emulated"])
def test_a_bad_cpu_bf16_override_is_refused_before_any_job(
    tmp_path, capsys, demo_raw, monkeypatch, backend
):
    """SMPIPE_CPU_BF16 reaches the jobs this machine plays, whose training refuses a word it
    does not know (steps/precision.py), but only after reconcile and prepare ran: the driver
    says so first, and nothing is written."""
    monkeypatch.setenv("SMPIPE_CPU_BF16", "yes")
    store = tmp_path / "store"
    settings = write_settings(
        tmp_path / "s.ini", str(store), experiment={"BACKEND": backend},
        data={"RAW_DATA": str(demo_raw)},
    )  # fmt: skip
    code, err = cli(settings, capsys)
    assert code == 2, err
    assert "SMPIPE_CPU_BF16='yes' in the environment: use native or none, or unset it" in err
    assert not store.exists()


def test_a_misspelt_override_is_refused_not_ignored(tmp_path):
    path = write_settings(tmp_path / "s.ini", str(tmp_path / "store"))
    problems = problems_of(path, {"SMPIPE__TRAINNG__EPOCHS": "1", "SMPIPE__EPOCHS": "1"})
    assert any(
        p.startswith("environment SMPIPE__TRAINNG__EPOCHS: no section TRAINNG") for p in problems
    )
    assert any(p.startswith("environment SMPIPE__EPOCHS: write it as") for p in problems)


def test_an_indented_line_is_not_appended_to_the_value_above(tmp_path):
    path = write_settings(tmp_path / "s.ini", str(tmp_path / "store"))
    path.write_text(path.read_text().replace("EPOCHS = 1\n", "EPOCHS = 1\n    3\n"))
    [problem] = problems_of(path)
    assert "indented line '3' would continue the value above it" in problem


@pytest.mark.parametrize(
    "section, key, value, expected",
    [
        ("training", "EPOCHS", "1e29", "[training] EPOCHS: must be a valid integer"),
        ("training", "EPOCHS", "100000", "[training] EPOCHS: must be less than or equal to 10000"),
        ("data", "SEED", "-5", "[data] SEED: must be greater than or equal to 0"),
        ("data", "MAX_SEQUENCE_LENGTH", "100000000000000", "[data] MAX_SEQUENCE_LENGTH: must be less"),
        ("training", "LEARNING_RATE", "1e400", "[training] LEARNING_RATE: must be a finite number"),
        ("training", "WEIGHT_DECAY", "inf", "[training] WEIGHT_DECAY: must be a finite number"),
        ("training", "LEARNING_RATE", "nan", "[training] LEARNING_RATE: must be a finite number"),
        ("tuning.hyperparameters", "BATCH_SIZE", "0", "[tuning.hyperparameters] BATCH_SIZE: '0' must be greater"),
        ("tuning.hyperparameters", "BATCH_SIZE", "0,8", "[tuning.hyperparameters] BATCH_SIZE: '0' must be greater"),
        ("tuning.hyperparameters", "EPOCHS", "1->100000", "[tuning.hyperparameters] EPOCHS: 100000.0 must be less"),
        ("tuning.metric_definitions", "f1", "(f1)=([0-9.]+)", "has 2 groups; it must capture the value in exactly one"),
    ],
)  # fmt: skip
def test_numbers_out_of_bounds_and_bad_regexes_are_refused(tmp_path, section, key, value, expected):
    path = write_settings(tmp_path / "s.ini", str(tmp_path / "store"), **{section: {key: value}})
    assert any(p.startswith(expected) or expected in p for p in problems_of(path))


def test_every_syntax_problem_is_listed_with_the_rest(tmp_path, capsys):
    path = write_settings(tmp_path / "s.ini", str(tmp_path / "store"))
    text = "stray = before any section\n" + path.read_text()
    text = text.replace("[data]\n", "[data]\nnot a key value line\nSEED = 1\nSEED = 2\n")
    path.write_text(text.replace("EPOCHS = 1\n", "EPOCHS = 0\n") + "\n[training]\nEPOCHS = 5\n")
    problems = problems_of(path)
    assert problems[0].startswith("line 1: 'stray = before any section' comes before any [section]")
    assert any("section [training] appears twice" in p for p in problems)
    assert any("[data] SEED is set twice" in p for p in problems)
    assert any("not KEY = value" in p for p in problems)
    assert any(
        p.startswith("[training] EPOCHS: must be greater") for p in problems
    )  # still checked
    code, err = cli(path, capsys)
    assert code == 2 and f"{len(problems)} problem(s)" in err


def test_the_shipped_settings_still_validate():
    """The bounds and checks above refuse nothing of the shipped file, and take nothing from
    it: every key is applied as written (the secrets' names are redacted in the copy a run
    keeps)."""
    from pipeline.config_file import SECRET_KEY_RE
    from pipeline.history import settings_changes

    settings = load_settings(ROOT / "settings.ini", {})
    changed = settings_changes((ROOT / "settings.ini").read_text(), settings.applied_ini)
    assert all(
        SECRET_KEY_RE.search(line.split(":")[0]) and line.endswith("-> <redacted>")
        for line in changed
    ), changed


def test_a_store_this_user_may_read_and_not_write_is_theirs_to_list(tmp_path):
    """A teammate's store, read-only to this user: `runs` and `registry` were refused ("is not
    writable") though they only read. The same read-only mount as above."""
    store = tmp_path / "store"
    store.mkdir()
    settings = write_settings(tmp_path / "s.ini", str(store),
                              registry={"MODEL_PACKAGE_GROUP": "news"})  # fmt: skip
    user_namespace = [] if os.geteuid() == 0 else ["--map-root-user"]
    script = 'mount -t tmpfs -o ro smpipe-read-only "$1" || exit 99; shift; exec "$@"'
    for command, status in (("runs", 0), ("registry", 0), ("report", 2)):
        done = subprocess.run(
            ["unshare", "--mount", *user_namespace, "sh", "-c", script, "sh", str(store),
             sys.executable, "-m", "pipeline.cli", command, str(settings)],
            capture_output=True, text=True, cwd=ROOT, timeout=120,
        )  # fmt: skip
        assert done.returncode != 99, f"no read-only mount could be made here: {done.stderr}"
        assert done.returncode == status, (command, done.stdout + done.stderr)
        assert ("is not writable" in done.stderr) == (command == "report"), done.stderr
