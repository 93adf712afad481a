"""Finding 3: a driver that is stopped stops its jobs, keeps their logs and checkpoints,
marks the run `interrupted` and leaves no job folder; one that dies without a word is found
by the next driver (heartbeat) and its run marked `abandoned`, its jobs having died with it;
`--resume` continues either run in place; a training job killed by any signal is restarted
from its checkpoint."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime

import psutil
import pytest

from pipeline.paths import ExperimentTree
from pipeline.store import LocalStore
from tests.conftest import ROOT, write_settings
from tests.reliability import figures

RUN1 = ExperimentTree("test-exp").run(1)


def as_from_a_terminal() -> None:
    """SIGINT as a terminal's Ctrl-C finds it: with its default action. A shell without job
    control starts background commands with SIGINT ignored (POSIX, asynchronous lists), and
    the test runner may be one of them; Python leaves an inherited ignored SIGINT ignored, so
    the driver would never see the Ctrl-C the test sends (it did not, in a `make test` started
    in the background)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Driver:
    """`run_pipeline.py` in a process of its own, its temporary folder one of the test's."""

    def __init__(self, settings, tmp, *args: str):
        env = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "run_pipeline.py"), str(settings), *args],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            preexec_fn=as_from_a_terminal,
        )  # fmt: skip
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float = 240) -> None:
        end = time.time() + timeout
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None, "".join(self.lines)
            assert time.time() < end, "".join(self.lines)
            time.sleep(0.05)

    def finish(self, timeout: float = 300) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:  # what it said is the only clue: keep it
            self.proc.kill()
            self.proc.wait()
            self.reader.join(10)
            message = f"the driver still ran after {timeout} s:\n{self.output}"
            raise AssertionError(message) from None
        self.reader.join(10)
        return code

    @property
    def output(self) -> str:
        return "".join(self.lines)


def settings_for(tmp_path, demo_raw, **experiment: str):
    return write_settings(tmp_path / "s.ini", str(tmp_path / "store"), models={"MODEL_NAMES": "bow"},
                          data={"RAW_DATA": str(demo_raw)}, experiment=experiment,
                          training={"EPOCHS": "3", "CHECKPOINT_EVERY_STEPS": "0", "MAX_RESTARTS": "0"})  # fmt: skip


# The demo's user functions, their model made to wait in a step for the driver's stop
# (tests/jobs/gate.py, shipped beside them as stop_gate.py).
GATED_DEMO = """
from stop_gate import gate
from user_functions import encode, load_tokenizer, ordered_input_keys, reconcile  # noqa: F401
from user_functions import load_model as demo_load_model


def load_model(model_name, id2label, label2id):
    return gate(demo_load_model(model_name, id2label, label2id))
"""


def record(tmp_path, run=RUN1) -> dict:
    return json.loads((tmp_path / "store" / run.metadata).read_text())


def job_folders(tmp) -> list[str]:
    return [p.name for p in tmp.glob("smpipe-jobs-*")]


def driver_in_training(tmp_path, demo_raw, monkeypatch):
    """A driver whose training job waits in optimizer step 4 (until it gets SIGTERM: the
    step then finishes), its settings, its temporary folder, and every process it has
    started."""
    from tests.conftest import wait_at_gate
    from tests.jobs.gate import GATE_VARIABLE

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    (tmp_path / "demo_gated.py").write_text(GATED_DEMO)
    shutil.copy(ROOT / "tests/jobs/gate.py", tmp_path / "stop_gate.py")
    settings = settings_for(tmp_path, demo_raw, USER_FUNCTIONS="demo_gated")
    monkeypatch.setenv(GATE_VARIABLE, f"{tmp_path / 'gates'}:4")
    driver = Driver(settings, tmp)
    wait_at_gate(tmp_path / "gates", 4, lambda: driver.proc.poll() is None)
    return driver, settings, tmp, psutil.Process(driver.proc.pid).children(recursive=True)


@pytest.mark.slow
def test_a_closed_terminal_stops_the_run_as_ctrl_c_does(tmp_path, demo_raw, monkeypatch):
    """SIGHUP (the terminal the driver ran in was closed) ends the run as SIGTERM and Ctrl-C
    do: its job stopped and its checkpoint kept, the run marked interrupted, nothing left in
    the temporary folder; not a driver killed outright with the run still `running`."""
    driver, settings, tmp, children = driver_in_training(tmp_path, demo_raw, monkeypatch)
    driver.proc.send_signal(signal.SIGHUP)
    assert driver.finish() == 130, driver.output
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    assert record(tmp_path)["status"] == "interrupted"
    assert list((tmp_path / "store" / RUN1.checkpoints("bow")).rglob("CURRENT"))
    assert job_folders(tmp) == []


@pytest.mark.slow
def test_a_second_stop_while_the_job_is_stopping_is_said_not_obeyed(
    tmp_path, demo_raw, monkeypatch
):
    """Ctrl-C again (nothing seemed to happen), then SIGTERM and SIGHUP, while the job is
    still saving its checkpoint. Obeyed, the second Ctrl-C cut the stop short: the driver
    exited at once, the job ran on, its folder stayed in the temporary folder and its
    checkpoint never reached the run."""
    from tests.jobs.gate import HOLD_VARIABLE

    monkeypatch.setenv(HOLD_VARIABLE, "1")
    driver, settings, tmp, children = driver_in_training(tmp_path, demo_raw, monkeypatch)
    driver.proc.send_signal(signal.SIGINT)
    stopping = tmp_path / "gates" / "stopping"
    while not stopping.exists():  # the job has its SIGTERM, and holds its stop
        assert driver.proc.poll() is None, driver.output
        time.sleep(0.02)
    for again in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        driver.proc.send_signal(again)
    driver.wait_for("still stopping: each job has up to 120 s to save")
    time.sleep(1)
    assert driver.proc.poll() is None, driver.output  # still waiting for its job
    (tmp_path / "gates" / "release").touch()
    assert driver.finish() == 130, driver.output
    assert "interrupted: stopped by the user (Ctrl-C); its jobs were stopped" in driver.output
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert record(tmp_path)["failure_reason"] == "stopped by the user (Ctrl-C)"
    assert list((tmp_path / "store" / RUN1.checkpoints("bow")).rglob("CURRENT"))
    assert job_folders(tmp) == []


@pytest.mark.slow
def test_a_closed_output_stops_the_run_as_its_sigpipe_would_and_resume_completes_it(
    tmp_path, demo_raw
):
    """`smpipe run S | head -3`, or `less` quit early: the driver ended with status 1 and no
    word, leaving a run claimed for good, with no record. Now the run stops as Ctrl-C stops
    it, its reason recorded, and --resume completes it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    settings = settings_for(tmp_path, demo_raw)
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "run_pipeline.py"), str(settings)], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen = []
    while not any(line.startswith("run 0001 of") for line in seen):
        seen.append(proc.stdout.readline())
        assert seen[-1], "".join(seen)
    proc.stdout.close()  # the reader goes: the driver's next line finds its pipe closed
    err = proc.stderr.read()
    assert proc.wait(300) == 130, err
    assert "interrupted: the reader of its output went away; its jobs were stopped" in err
    assert err.rstrip().endswith("(run 0001: --resume 1 continues it)"), err  # stdout is gone
    assert "Traceback" not in err and "Exception ignored" not in err, err
    first = record(tmp_path)
    assert first["status"] == "interrupted", first
    assert first["failure_reason"] == "the reader of its output went away"
    assert job_folders(tmp) == []

    again = Driver(settings, tmp, "--resume", "1")
    assert again.finish() == 0, again.output
    assert record(tmp_path)["status"] == "completed"


@pytest.mark.slow
def test_a_stopped_driver_stops_its_job_and_resume_continues_the_run(
    tmp_path, demo_raw, monkeypatch
):
    driver, settings, tmp, children = driver_in_training(tmp_path, demo_raw, monkeypatch)
    driver.proc.send_signal(signal.SIGTERM)
    assert driver.finish() == 130, driver.output
    assert "run 0001 interrupted" in driver.output and "--resume 1 continues it" in driver.output
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    first = record(tmp_path)
    assert first["status"] == "interrupted"
    logs = list((tmp_path / "store" / RUN1.logs).glob("*train-bow*.log"))
    assert logs and "step=4/" in logs[0].read_text()
    assert list((tmp_path / "store" / RUN1.checkpoints("bow")).rglob("CURRENT"))
    assert job_folders(tmp) == []

    again = Driver(settings, tmp, "--resume", "1")
    assert again.finish() == 0, again.output
    done = record(tmp_path)
    assert done["status"] == "completed" and done["model_version"] == 1 and done["resumed_at"]
    assert "reconcile, prepare" not in again.output.split("left")[0]  # only what was left ran
    assert "resumed from" in again.output
    assert done["steps"]["reconcile"] == first["steps"]["reconcile"]  # kept, not rerun
    # Its time is both parts' (`smpipe runs` shows it): the first, and the resumed one.
    # (Metadata's times are whole seconds.)
    seconds = [datetime.fromisoformat(done[k][-1] if k == "resumed_at" else done[k]).timestamp()
               for k in ("resumed_at", "end_time")]  # fmt: skip
    resumed = seconds[1] - seconds[0]
    assert done["time_taken"] == pytest.approx(first["time_taken"] + resumed, abs=3.0)

    assert not (tmp_path / "store" / ExperimentTree("test-exp").run(2).prefix).exists()
    assert job_folders(tmp) == []


@pytest.mark.slow
def test_a_killed_driver_takes_its_job_along_and_its_run_is_marked_abandoned(
    tmp_path, demo_raw, monkeypatch
):
    driver, settings, tmp, children = driver_in_training(tmp_path, demo_raw, monkeypatch)
    driver.proc.kill()
    driver.finish()
    gone, alive = psutil.wait_procs(children, timeout=60)
    assert not alive, [p.cmdline() for p in alive]
    assert record(tmp_path)["status"] == "running"  # nobody could say otherwise yet
    assert job_folders(tmp)  # left behind by the dead driver

    # The next driver, whatever it runs, finds the run orphaned and its folders.
    other = Driver(settings, tmp, "--steps", "reconcile")
    assert other.finish() == 0, other.output
    assert record(tmp_path)["status"] == "abandoned"
    assert "is gone" in record(tmp_path)["failure_reason"]
    assert "run 0001 was left running" in other.output
    assert job_folders(tmp) == []  # (--resume of such a run: the test above)


def test_a_training_job_killed_by_a_signal_is_restarted_from_its_checkpoint(tmp_path, channels):
    import re

    from pipeline.backends.local import LocalBackend
    from pipeline.jobs import TrainingJob
    from pipeline.store import LocalStore, upload_dir
    from tests.conftest import SignalAtStep, ship_code
    from tests.jobs.training_job import HPS

    store = LocalStore(tmp_path / "store")
    for name, path in channels.items():
        upload_dir(store, path, f"data/{name}/")
    ship_code(store)
    echo = io.StringIO()
    backend = LocalBackend(
        store, ExperimentTree("t").run(1), work_root=str(tmp_path / "work"), echo=echo
    )
    job = TrainingJob(name="killed", step="train", code="code/", channels={c: f"data/{c}/" for c in channels},
                      hyperparameters=HPS, model_prefix="out/model/", output_prefix="out/output/",
                      checkpoint_prefix="out/checkpoints/", sagemaker_output="out/sm/", max_restarts=1)  # fmt: skip
    # SIGKILL in step 5, as the out-of-memory killer sends it: no checkpoint on the way out.
    steps_train = lambda p: "steps.train" in p.cmdline()  # noqa: E731
    with SignalAtStep(tmp_path / "gates", 5, steps_train, signal.SIGKILL) as killer:
        job.env = killer.env
        outcome = backend.run_training(job)
    log = echo.getvalue()
    assert killer.sent and outcome.status == "Completed", outcome.failure_reason
    assert outcome.restarts == 1 and "interrupted or killed; restart 1 of 1" in log
    assert re.search(r"resumed from \S+ckpt-0*3 at step 3 ", log), log  # CHECKPOINT_EVERY_STEPS=3


KILLED_MID_UPLOAD = """
import os, signal, sys

from pipeline import store

real = store.LocalStore.create


def create(self, key, data):  # SIGKILL to this driver as it completes prepare's second output
    if key.endswith("prepared/validation/_MANIFEST.json"):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, key, data)


store.LocalStore.create = create
import run_pipeline

sys.exit(run_pipeline.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_resume_after_a_driver_killed_between_two_uploads_completes(tmp_path, demo_raw):
    """The driver dies after prepare's train split is complete and before its validation
    split is: `smpipe runs` shows the run abandoned (the heartbeat rule), and --resume runs
    prepare again over its own partial output and completes."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    settings = settings_for(tmp_path, demo_raw)
    (tmp_path / "killed.py").write_text(KILLED_MID_UPLOAD)
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(tmp_path / "killed.py"), str(settings), "--steps", "reconcile,prepare"],
                          cwd=ROOT, env=env, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    data = tmp_path / "store/test-exp/data/0001/prepared"
    assert (data / "train/_MANIFEST.json").exists() and not (
        data / "validation/_MANIFEST.json"
    ).exists()

    rows = [line for line in cli_runs(settings).splitlines() if "0001" in line]
    assert rows and "abandoned" in rows[0], cli_runs(settings)

    again = Driver(settings, tmp, "--resume", "1")
    assert again.finish() == 0, again.output
    assert "prepare: removed what its unfinished attempt left at" in again.output
    figures.record("driver-killed-mid-upload", listed_abandoned="abandoned" in rows[0],
                   resumed=record(tmp_path)["status"])  # fmt: skip
    assert record(tmp_path)["status"] == "completed"
    assert (data / "validation/_MANIFEST.json").exists() and (data / "test/_MANIFEST.json").exists()


def cli_runs(settings) -> str:
    import contextlib
    import io

    from pipeline import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["runs", str(settings)]) == 0
    return out.getvalue()


class FullDisk(LocalStore):
    """A store whose disk fills: writing a checkpoint runs out of space part of the way in,
    and with `everything` every write after that does too. (A full disk cannot be made here;
    the real write path, its cleanup and the driver's handling run.)"""

    def __init__(self, root, everything: bool = False):
        super().__init__(root)
        self.everything, self.full = everything, False

    def _out_of_space(self, f) -> None:
        f.write(b"x" * 1000)  # part of it, as a filling disk leaves it
        self.full = True
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def _fill(self, f, data: bytes) -> None:
        if self.full and self.everything:
            self._out_of_space(f)
        super()._fill(f, data)

    def _copy(self, source, tmp: str) -> None:
        if "/checkpoints/" in tmp or (self.full and self.everything):
            with open(tmp, "wb") as f:
                self._out_of_space(f)
        super()._copy(source, tmp)


def hidden_files(folder) -> list[str]:
    return [str(p) for p in folder.rglob(".*")]


@pytest.mark.parametrize("everything", [False, True], ids=["checkpoint", "every write"])
def test_a_store_that_fills_fails_the_run_in_one_paragraph_and_leaves_no_temporaries(
    tmp_path, demo_raw, everything
):
    from pipeline.config import load_settings
    from pipeline.driver import PipelineError, parse_steps, run_pipeline

    path = write_settings(tmp_path / "s.ini", str(tmp_path / "store"), models={"MODEL_NAMES": "bow"},
                          data={"RAW_DATA": str(demo_raw)}, training={"CHECKPOINT_EVERY_STEPS": "2"})  # fmt: skip
    settings = load_settings(path, env={})
    store = FullDisk(tmp_path / "store", everything)
    with pytest.raises(PipelineError) as failed:
        run_pipeline(settings, store, parse_steps(None), echo=io.StringIO())
    said = str(failed.value)
    figures.record(f"store-fills/{'every write' if everything else 'checkpoint'}",
                   paragraph="\n" not in said, status=record(tmp_path)["status"],
                   temporaries=len(hidden_files(tmp_path / "store")))  # fmt: skip
    assert "\n" not in said and said.startswith("run 0001 failed: cannot write ")
    assert f"in the store {tmp_path / 'store'}: No space left on device (the disk is full)" in said
    assert hidden_files(tmp_path / "store") == []
    if everything:
        assert (
            "could not be marked failed either" in said and record(tmp_path)["status"] == "running"
        )
        return
    assert record(tmp_path)["status"] == "failed" and "--resume 1 continues it" in said
    # Space freed: the run continues where it stopped, and still no temporaries.
    resumed = run_pipeline(
        settings, LocalStore(tmp_path / "store"), parse_steps(None), echo=io.StringIO(), resume=1
    )
    figures.record("store-fills/resumed", status=resumed["status"],
                   temporaries=len(hidden_files(tmp_path / "store")))  # fmt: skip
    assert resumed["status"] == "completed"
    assert hidden_files(tmp_path / "store") == []


class FullAtInference(LocalStore):
    """A store whose disk fills as the inference step's outputs are written: training has
    completed, only inference is left."""

    def _copy(self, source, tmp: str) -> None:
        if "/inference/" in tmp:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        super()._copy(source, tmp)


def test_a_run_stopped_with_only_inference_left_resumes_to_the_end(tmp_path, demo_raw):
    """--resume of a run that failed after training, in inference: inference tests the
    models this run trained (its record's sources name none: they were to come from its own
    training), and the run completes. It ended in a TypeError in jobs.py before (issue 45)."""
    from pipeline.config import load_settings
    from pipeline.driver import PipelineError, parse_steps, run_pipeline

    path = write_settings(tmp_path / "s.ini", str(tmp_path / "store"), models={"MODEL_NAMES": "bow"},
                          data={"RAW_DATA": str(demo_raw)}, training={"EPOCHS": "1"})  # fmt: skip
    settings = load_settings(path, env={})
    with pytest.raises(PipelineError, match="--resume 1 continues it"):
        run_pipeline(settings, FullAtInference(tmp_path / "store"), parse_steps(None),
                     echo=io.StringIO())  # fmt: skip
    stopped = record(tmp_path)
    assert stopped["steps"]["train"]["status"] == "completed", stopped["steps"]
    resumed = run_pipeline(
        settings, LocalStore(tmp_path / "store"), parse_steps(None), echo=io.StringIO(), resume=1
    )
    assert resumed["status"] == "completed"
    assert resumed["holdout_performance"]["bow"]["macro_f1"] >= 0


# The demo's bow twice over, the second failing its first step while FLAG is there.
FAILS_WHILE_FLAGGED = """
import os

from user_functions import encode, load_tokenizer, ordered_input_keys, reconcile  # noqa: F401
from user_functions.baseline import BagOfEmbeddings


class Flagged(BagOfEmbeddings):
    def forward(self, input_ids, attention_mask):
        if os.path.exists(FLAG):
            raise RuntimeError("bow2 fails while FLAG is there")
        return super().forward(input_ids, attention_mask)


def load_model(model_name, id2label, label2id):
    kind = Flagged if model_name == "bow2" else BagOfEmbeddings
    return kind(load_tokenizer(model_name).vocab_size, len(id2label))
"""


def test_a_resumed_runs_cost_counts_the_jobs_of_its_parts_before(tmp_path, demo_raw, caplog):
    """bow trains and bow2 fails; the resume trains bow2 alone and writes the train step's
    section again: what the first part's training jobs used is counted all the same. bow's
    checkpoints, kept while the run had not completed, are not said to be gone on from."""
    from pipeline.config import load_settings
    from pipeline.driver import PipelineError, parse_steps, run_pipeline

    flag = tmp_path / "flag"
    flag.write_text("")
    (tmp_path / "flagged.py").write_text(f"FLAG = {str(flag)!r}\n" + FAILS_WHILE_FLAGGED)
    path = write_settings(tmp_path / "s.ini", str(tmp_path / "store"),
                          experiment={"USER_FUNCTIONS": "flagged"}, models={"MODEL_NAMES": "bow, bow2"},
                          data={"RAW_DATA": str(demo_raw)},
                          training={"CHECKPOINT_EVERY_STEPS": "2", "EPOCHS": "2"})  # fmt: skip
    settings = load_settings(path, env={})
    store = LocalStore(tmp_path / "store")
    with pytest.raises(PipelineError, match="bow2 fails while FLAG is there"):
        run_pipeline(settings, store, parse_steps(None), echo=io.StringIO())
    paid = [b["job"] for b in record(tmp_path)["cost"]["jobs"]]
    assert [any(f"-train-{m}-" in job for job in paid) for m in ("bow", "bow2")] == [True, True]
    assert record(tmp_path)["checkpoints_left"]["bow"] > 0
    flag.unlink()
    caplog.set_level("INFO", logger="smpipe")
    resumed = run_pipeline(settings, store, parse_steps(None), echo=io.StringIO(), resume=1)
    assert resumed["status"] == "completed"
    assert "bow: trained before this run was resumed" in caplog.text
    assert "bow goes on from its checkpoints" not in caplog.text
    assert set(paid) < {b["job"] for b in resumed["cost"]["jobs"]}
