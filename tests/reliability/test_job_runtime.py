"""Jobs end when their work ends, the driver's checks leave jobs alone, failed jobs' folders
have an owner, and a job that cannot start says why where SageMaker reads it (issue 29).

- A user module that starts a non-daemon thread at import: its jobs end (cold and warm), and
  a driver stopped mid-job ends too, instead of joining that thread forever.
- The driver's stop path waits for a job that ignores SIGTERM only until it kills it.
- What the user module does at import (a variable, a chdir) reaches neither the driver nor
  any job: the driver checks it in a process of its own.
- A failed local job's folder is kept in its run (or the user's cache folder for an S3 store),
  named in the failure paragraph, removed when the run completes or by prune; the system's
  temporary folder keeps nothing.
- An error before the step starts (a config file, a secret) is in output/failure or
  output/message."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from pipeline.backends.local import LocalBackend
from pipeline.errors import PipelineError
from pipeline.jobs import ProcessingJob
from pipeline.paths import ExperimentTree
from pipeline.player.job_root import WORK_PREFIX
from pipeline.store import LocalStore, S3Store, upload_dir
from steps.runtime.names import ENTRYPOINT, ML_ROOT_VARIABLE, WANDB_SECRET_VARIABLE
from tests.conftest import ROOT, ship_code, write_settings
from tests.reliability.test_lifecycle import Driver, job_folders, record
from tests.reliability.test_user_code import REST
from tests.test_contract import training_root
from tests.test_local_backend import probe_processing
from tests.test_warm_start import wait_gone

RUN = ExperimentTree("runtime").run(1)
# The demo's five functions, in a module of the test's own.
DEMO = (ROOT / "user_functions/__init__.py").read_text()
# What a logging or metrics client does at import: a worker thread that never ends, not a
# daemon (so the interpreter joins it at exit).
LOGGER_THREAD = """
import threading as _threading
import time as _time

_threading.Thread(target=_time.sleep, args=(3600,), name="user-logger").start()
"""


def ship(store: LocalStore, modules: dict[str, str]) -> None:
    """steps/ and `modules` (name -> source) as a run's code, and a one-file raw input."""
    with tempfile.TemporaryDirectory() as code:
        shutil.copytree(
            ROOT / "steps", Path(code) / "steps", ignore=shutil.ignore_patterns("__pycache__")
        )
        for name, source in modules.items():
            (Path(code) / f"{name}.py").write_text(source)
        upload_dir(store, code, "code/")
    with tempfile.TemporaryDirectory() as raw:
        (Path(raw) / "rows.txt").write_text("a\n")
        upload_dir(store, raw, "raw/")


def reconcile(name: str, module: str, max_run_seconds: int = 86400) -> ProcessingJob:
    return ProcessingJob(
        name=name,
        step="reconcile",
        code="code/",
        inputs={"raw": "raw/"},
        outputs={"snapshot": f"out/{name}/snapshot/", "report": f"out/{name}/report/"},
        env={"SMPIPE_USER_FUNCTIONS": module},
        max_run_seconds=max_run_seconds,
    )


# -- case 8: a thread left running ---------------------------------------------------------------


# No fork server an earlier backend of this process left: the backend's first job is cold.
@pytest.mark.usefixtures("no_idle_servers")
def test_a_job_whose_user_module_left_a_thread_ends_with_its_work_cold_and_warm(tmp_path):
    """reconcile's module starts a non-daemon thread at import. The step returns, and its
    process would join that thread forever: the job would run to its MaxRuntimeInSeconds (here
    120 s) and be Stopped. It completes instead, cold and forked warm, and its log names the
    thread it did not wait for."""
    seen = tmp_path / "seen.jsonl"
    source = (
        LOGGER_THREAD
        + textwrap.dedent(f"""
        import json
        import datasets
        import psutil

        def reconcile(raw_dir):
            # step -> entrypoint -> the fork server (warm) or the driver (cold)
            starter = psutil.Process().parent().parent().cmdline()
            with open({str(seen)!r}, "a") as f:
                f.write(json.dumps(starter) + "\\n")
            return datasets.Dataset.from_dict({{"text": ["u", "v"], "label": ["a", "b"]}}), {{}}
    """)
        + REST
    )
    store = LocalStore(tmp_path / "store")
    ship(store, {"threaded_functions": source})
    echo = io.StringIO()
    backend = LocalBackend(store, RUN, echo=echo, work_root=str(tmp_path / "work"))
    results = [
        backend.run_processing(reconcile(name, "threaded_functions", max_run_seconds=120))
        for name in ("cold", "warm")
    ]
    backend.close(succeeded=True)
    said = echo.getvalue()
    assert [r.status for r in results] == ["Completed", "Completed"], said
    starters = [json.loads(line) for line in seen.read_text().splitlines()]
    assert not any("fork_server.py" in part for part in starters[0])  # cold: a new interpreter
    assert any("fork_server.py" in part for part in starters[1]), starters  # forked warm
    assert said.count("thread(s) still running are not waited for: 'user-logger'") == 2, said


def blocking_demo(gate: Path) -> str:
    """The demo's functions with a logger thread started at import, and a load_tokenizer that
    says where its step runs (in `gate`) and waits there: in a processing job only (its
    inputs' variables), not where the driver's check builds a model that asks for it."""
    return (
        DEMO
        + LOGGER_THREAD
        + textwrap.dedent(f"""

        _demo_load_tokenizer = load_tokenizer


        def load_tokenizer(model_name):
            import json
            import os

            import psutil

            if not any(k.startswith("SM_PROCESSING_INPUT_") for k in os.environ):
                return _demo_load_tokenizer(model_name)
            starter = psutil.Process().parent().parent().cmdline()
            partial = Path({str(gate) + ".part"!r})  # whole or absent: the test reads it
            partial.write_text(json.dumps(starter))
            partial.replace({str(gate)!r})
            _time.sleep(600)
    """)
    )


@pytest.mark.slow
@pytest.mark.parametrize("start", ["cold", "warm"])
def test_a_driver_stopped_mid_job_ends_though_the_user_module_left_a_thread(
    tmp_path, demo_raw, monkeypatch, start
):
    """SIGTERM to a driver whose prepare job waits (forked warm, or cold with warm start off):
    the job is stopped, the run marked interrupted, and the driver exits 130. Before, the
    driver had imported the user module itself to check it, and joined its thread at exit:
    it hung until SIGKILL."""
    gate = tmp_path / "gate.json"
    (tmp_path / "threaded_demo.py").write_text(blocking_demo(gate))
    settings = write_settings(tmp_path / "s.ini", str(tmp_path / "store"),
                              experiment={"USER_FUNCTIONS": "threaded_demo"},
                              models={"MODEL_NAMES": "bow"}, data={"RAW_DATA": str(demo_raw)})  # fmt: skip
    monkeypatch.setenv("SMPIPE_WARM_START", "1" if start == "warm" else "0")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    driver = Driver(settings, tmp, "--steps", "reconcile,prepare")
    try:  # a driver that never reaches the gate is not left running (its jobs follow it)
        deadline = time.monotonic() + 300
        while not gate.exists():
            assert driver.proc.poll() is None, driver.output
            assert time.monotonic() < deadline, driver.output
            time.sleep(0.1)
    except AssertionError:
        driver.proc.kill()
        driver.finish()
        raise
    starter = json.loads(gate.read_text())
    children = psutil.Process(driver.proc.pid).children(recursive=True)
    driver.proc.send_signal(signal.SIGTERM)
    assert driver.finish(timeout=120) == 130, driver.output
    assert any("fork_server.py" in part for part in starter) == (start == "warm"), starter
    assert "run 0001 interrupted" in driver.output
    assert record(tmp_path)["status"] == "interrupted"
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    assert job_folders(tmp) == []


PLAIN = (
    textwrap.dedent("""
        import datasets


        def reconcile(raw_dir):
            return datasets.Dataset.from_dict({"text": ["u"], "label": ["a"]}), {}
    """)
    + REST
)
STUBBORN = """
import signal
import time

from steps.runtime.step import run_step


def main():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a step that never stops on request
    print("stubborn: waiting", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    run_step("stubborn", main)
"""


class CtrlC(io.StringIO):
    """A backend's echo: Ctrl-C (KeyboardInterrupt) as the job says it waits."""

    def write(self, text):
        super().write(text)
        if "stubborn: waiting" in text:
            raise KeyboardInterrupt


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_a_stopped_driver_waits_for_a_job_that_ignores_sigterm_only_until_it_kills_it(
    tmp_path, start, request
):
    """Ctrl-C while a job that ignores SIGTERM runs: the job gets SIGTERM, then SIGKILL with
    everything under it once the stop grace (here 2 s) is over, and the driver's Ctrl-C goes
    on. Before, the driver waited for it forever."""
    if start == "cold":  # no fork server an earlier backend of this process left
        request.getfixturevalue("no_idle_servers")
    store = LocalStore(tmp_path / "store")
    ship(store, {"steps/stubborn": STUBBORN, "plain_functions": PLAIN})
    echo = CtrlC()
    backend = LocalBackend(store, RUN, echo=echo, work_root=str(tmp_path / "work"))
    backend.containers.grace_seconds = 2
    if start == "warm":  # where no earlier backend left a server, this one is cold
        assert backend.run_processing(reconcile("first", "plain_functions")).status == "Completed"
    job = ProcessingJob(name="stubborn", step="stubborn", code="code/", inputs={"raw": "raw/"},
                        outputs={"out": "out/stubborn/"})  # fmt: skip
    outcome: list[BaseException] = []
    pids: list[int] = []

    def stop_it() -> None:
        try:
            backend.run_processing(job)
        except BaseException as e:  # noqa: BLE001 - what the driver would see
            outcome.append(e)

    def stubborn_steps() -> list[int]:
        found = []
        for process in psutil.Process().children(recursive=True):
            try:
                if "stubborn" in " ".join(process.cmdline()):
                    found.append(process.pid)
            except psutil.Error:
                pass
        return found

    stopper = threading.Thread(target=stop_it, daemon=True)
    stopper.start()
    deadline = time.monotonic() + 120  # the server's preload, on a busy machine
    while stopper.is_alive() and time.monotonic() < deadline:
        pids[:] = stubborn_steps() or pids
        stopper.join(0.2)
    try:
        assert not stopper.is_alive(), f"the driver still waits for the job:\n{echo.getvalue()}"
        assert outcome and isinstance(outcome[0], KeyboardInterrupt)
        assert wait_gone(pids, 10) == []
    finally:
        for pid in stubborn_steps():  # what an old driver left: not this test's to keep
            os.kill(pid, signal.SIGKILL)
        backend.close(succeeded=False)
    assert pids, echo.getvalue()  # the job did start
    assert not (tmp_path / "work").exists()


# -- case 13: the driver's check leaves the jobs alone ----------------------------------------


def test_what_the_user_module_does_at_import_reaches_no_job(tmp_path, monkeypatch):
    """The module sets a variable and changes the working directory when imported. The job
    imports it too (and so sets it for itself): it records what it had before that. Neither
    the job nor the driver ever sees the driver's import."""
    from pipeline.config import load_settings
    from pipeline.driver import parse_steps, run_pipeline

    monkeypatch.chdir(tmp_path)  # put back after the test, whatever the import did
    monkeypatch.delenv("SET_AT_IMPORT", raising=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    seen = tmp_path / "seen.json"
    (tmp_path / "meddling_functions.py").write_text(
        textwrap.dedent(f"""
        import json
        import os

        INHERITED = os.environ.get("SET_AT_IMPORT")  # from whoever started this process
        CWD = os.getcwd()
        os.environ["SET_AT_IMPORT"] = "by the import in pid " + str(os.getpid())
        os.chdir({str(elsewhere)!r})


        def reconcile(raw_dir):
            import datasets

            with open({str(seen)!r}, "w") as f:
                json.dump({{"inherited": INHERITED, "cwd": CWD}}, f)
            return datasets.Dataset.from_dict({{"text": ["u", "v"], "label": ["a", "b"]}}), {{}}
    """)
        + REST
    )
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw/rows.txt").write_text("a\n")
    path = write_settings(tmp_path / "s.ini", str(tmp_path / "store"),
                          experiment={"USER_FUNCTIONS": "meddling_functions"},
                          data={"RAW_DATA": str(tmp_path / "raw")})  # fmt: skip
    before = os.getcwd()
    done = run_pipeline(load_settings(path, env={}), LocalStore(tmp_path / "store"),
                        parse_steps("reconcile"), echo=io.StringIO())  # fmt: skip
    assert done["status"] == "completed"
    job = json.loads(seen.read_text())
    assert job["inherited"] is None, job  # not the driver's import's variable
    assert "SET_AT_IMPORT" not in os.environ and os.getcwd() == before
    assert Path(job["cwd"]).parent.name.startswith(WORK_PREFIX)  # its own job root
    assert "meddling_functions" not in sys.modules


# -- case 14: a failed job's folder has an owner ----------------------------------------------


def test_a_failed_local_jobs_folder_is_kept_in_its_run_and_goes_with_it(tmp_path, monkeypatch):
    """reconcile fails: its folder is kept under the run's folder in the store, named in the
    failure paragraph and at the end of its log, and the system's temporary folder keeps
    nothing. prune's helper removes it; a failed run that is resumed and completes removes
    its own."""
    from pipeline.config import load_settings
    from pipeline.driver import parse_steps, run_pipeline

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # what gettempdir() answers
    missing = tmp_path / "labels-missing"
    missing.write_text("")
    (tmp_path / "failing_functions.py").write_text(
        textwrap.dedent(f"""
        import os


        def reconcile(raw_dir):
            import datasets

            if os.path.exists({str(missing)!r}):
                raise ValueError("labels.csv is missing")
            return datasets.Dataset.from_dict({{"text": ["u", "v"], "label": ["a", "b"]}}), {{}}
    """)
        + REST
    )
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw/rows.txt").write_text("a\n")
    path = write_settings(tmp_path / "s.ini", str(tmp_path / "store"),
                          experiment={"USER_FUNCTIONS": "failing_functions"},
                          data={"RAW_DATA": str(tmp_path / "raw")})  # fmt: skip
    store, tree = LocalStore(tmp_path / "store"), ExperimentTree("test-exp")

    def run(**how):
        return run_pipeline(load_settings(path, env={}), store, parse_steps("reconcile"),
                            echo=io.StringIO(), **how)  # fmt: skip

    def kept_after_failing(run_num: int) -> Path:
        with pytest.raises(PipelineError) as failed:
            run()
        message = str(failed.value)
        assert "labels.csv is missing" in message
        assert list(tmp.iterdir()) == []  # no smpipe-* folder, nothing at all
        kept = tmp_path / f"store/test-exp/runs/{run_num:04d}/failed-jobs"
        (folder,) = kept.iterdir()
        assert f"its folder is kept at {folder} until the run completes" in message, message
        assert "labels.csv is missing" in (folder / "output/message").read_text()
        log = store.get_bytes(tree.run(run_num).log(folder.name)).decode()
        assert log.rstrip().endswith(f"job folder kept for inspection: {folder}"), log
        return kept

    first = kept_after_failing(1)
    from pipeline.prune import remove_kept_jobs

    assert remove_kept_jobs(store, tree.run(1)) > 0  # what prune calls for a pruned run
    assert not first.exists()

    second = kept_after_failing(2)
    missing.unlink()  # the user mends what failed, and resumes
    assert run(resume=2)["status"] == "completed"
    assert not second.exists()
    assert list(tmp.iterdir()) == []


def test_with_an_s3_store_a_failed_jobs_folder_is_kept_in_the_users_cache(
    bucket, tmp_path, monkeypatch
):
    """An S3 store: the folder is kept on this machine, in the user's cache folder under the
    bucket and the run's prefix; prune's helper removes it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    store = S3Store(f"s3://{bucket}")
    ship_code(store)
    (tmp_path / "in").mkdir()
    (tmp_path / "in/a.txt").write_text("x")
    upload_dir(store, tmp_path / "in", "inputs/things/")
    backend = LocalBackend(store, RUN, echo=io.StringIO(), work_root=str(tmp_path / "work"))
    failed = backend.run_processing(probe_processing("probe-fail", "--fail"))
    backend.close(succeeded=False)
    where = tmp_path / f"cache/smpipe/failed-jobs/{bucket}/{RUN.prefix}probe-fail"
    assert failed.status == "Failed" and (where / "output/message").exists()
    assert failed.kept_folder == str(where) and not (tmp_path / "work").exists()
    from pipeline.prune import remove_kept_jobs

    assert remove_kept_jobs(store, RUN) > 0 and not where.exists()


# -- an error before the step starts ------------------------------------------------------------


def start_entrypoint(root: Path, *arguments: str, **env: str) -> subprocess.CompletedProcess:
    """The image's entrypoint, started as SageMaker starts it, in job root `root`."""
    env = {**os.environ, ML_ROOT_VARIABLE: str(root), "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, *ENTRYPOINT[1:], *arguments], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.parametrize(
    ("broken", "said"),
    [
        ("hyperparameters.json", "hyperparameters.json is not valid JSON"),
        ("inputdataconfig.json", "inputdataconfig.json is not valid JSON"),
        ("resourceconfig.json", "resourceconfig.json cannot be read"),
    ],
)
def test_a_training_job_that_cannot_read_its_config_says_so_in_output_failure(
    tmp_path, broken, said
):
    root = training_root(
        tmp_path, "resourceconfig.c5-topology.json", "hyperparameters.sdk-trial.json"
    )
    config = root / "input/config" / broken
    if "cannot be read" in said:
        config.unlink()
    else:
        config.write_text('{"epochs": "3",')  # cut short
    done = start_entrypoint(root, "train", TRAINING_JOB_NAME="broken-config")
    failure = root / "output/failure"
    assert done.returncode == 1, done.stderr
    assert failure.exists(), done.stderr
    reason = failure.read_text()
    assert reason.startswith("the job could not start its step: ") and said in reason, reason
    assert str(config) in reason and reason in done.stderr


def test_a_processing_job_that_cannot_read_its_config_says_so_in_output_message(tmp_path):
    (tmp_path / "config").mkdir()
    (tmp_path / "config/processingjobconfig.json").write_text("{")
    done = start_entrypoint(tmp_path, "process", "reconcile")
    assert done.returncode == 1, done.stderr
    reason = (tmp_path / "output/message").read_text()
    assert "processingjobconfig.json is not valid JSON" in reason, reason


def test_a_secret_that_cannot_be_fetched_is_named_in_output_failure(tmp_path, aws_env):
    """SMPIPE_WANDB_SECRET_ID names a secret Secrets Manager (moto) does not have."""
    root = training_root(
        tmp_path, "resourceconfig.c5-topology.json", "hyperparameters.sdk-trial.json"
    )
    done = start_entrypoint(root, "train", TRAINING_JOB_NAME="no-secret",
                            **{WANDB_SECRET_VARIABLE: "smpipe/no-such-secret"})  # fmt: skip
    assert done.returncode == 1, done.stderr
    reason = (root / "output/failure").read_text()
    assert (
        f"secret 'smpipe/no-such-secret' ({WANDB_SECRET_VARIABLE}) cannot be read from Secrets "
        "Manager in us-east-1: ResourceNotFoundException" in reason
    ), reason


def test_a_training_job_missing_a_hyperparameter_or_channel_names_each_in_output_failure(
    tmp_path,
):
    """hyperparameters.json `{}` (the driver always sets model_name) and no `labels` channel:
    one line naming both, and the channels the job has; a channel inputdataconfig.json names
    whose folder is not there: named with its folder. Never a bare KeyError."""
    root = training_root(
        tmp_path / "a", "resourceconfig.c5-topology.json", "hyperparameters.empty.json"
    )
    done = start_entrypoint(root, "train", TRAINING_JOB_NAME="no-labels")
    assert done.returncode == 1, done.stderr
    assert (root / "output/failure").read_text() == (
        "train: ValueError: required hyperparameter 'model_name' is missing from "
        "hyperparameters.json; channel 'labels' is missing from inputdataconfig.json (the job's "
        "channels: evaluation, train, validation)"
    )
    root = training_root(
        tmp_path / "b", "resourceconfig.c5-topology.json", "hyperparameters.empty.json"
    )
    (root / "input/config/hyperparameters.json").write_text('{"model_name": "bow"}')
    config = json.loads((root / "input/config/inputdataconfig.json").read_text())
    config["labels"] = config["validation"]
    (root / "input/config/inputdataconfig.json").write_text(json.dumps(config))
    (root / "input/data/labels").mkdir()
    shutil.rmtree(root / "input/data/validation")
    done = start_entrypoint(root, "train", TRAINING_JOB_NAME="no-validation-folder")
    assert done.returncode == 1, done.stderr
    assert (root / "output/failure").read_text() == (
        f"train: ValueError: channel 'validation' has no folder {root / 'input/data/validation'}"
    )


@pytest.mark.parametrize(
    ("resource", "said"),
    [
        ({"current_host": "algo-2", "hosts": ["algo-1"]},
         "current_host 'algo-2' is not one of its hosts (algo-1)"),
        ({"current_host": "algo-1"}, "it has no hosts"),
        ({"hosts": "algo-1"}, 'hosts is "algo-1", not a list of host names; it has no current_host'),
    ],
)  # fmt: skip
def test_a_training_job_whose_host_is_not_among_its_hosts_says_so_in_output_failure(
    tmp_path, resource, said
):
    """resourceconfig.json's current_host is one of its hosts, as SageMaker writes it: a file
    that says otherwise is named, with every key that is wrong, before any step starts."""
    root = training_root(tmp_path, "resourceconfig.c5-topology.json", "hyperparameters.empty.json")
    config = root / "input/config/resourceconfig.json"
    config.write_text(json.dumps(resource))
    done = start_entrypoint(root, "train", TRAINING_JOB_NAME="wrong-host")
    assert done.returncode == 1, done.stderr
    reason = (root / "output/failure").read_text()
    assert reason == f"the job could not start its step: {config}: {said}", reason
