"""The local backend plays each job's SageMaker request: the image's entrypoint in a job root
laid out as SageMaker lays out /opt/ml, the code shipped with the run, outputs to the store."""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

import pytest

from pipeline.backends.local import LocalBackend
from pipeline.jobs import ProcessingJob, TrainingJob
from pipeline.paths import ExperimentTree
from pipeline.player.environment import local_job_env
from pipeline.store import LocalStore, S3Store, is_complete, upload_dir
from tests.conftest import ship_code
from tests.reliability.figures import record

SECRETS = {
    "WANDB_API_KEY": "wandb-secret-0123456789",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-9876543210",
}
RUN = ExperimentTree("probe").run(1)


@pytest.fixture(params=["s3", "local"])
def store(request, tmp_path):
    if request.param == "s3":
        store = S3Store(f"s3://{request.getfixturevalue('bucket')}")
    else:
        store = LocalStore(tmp_path / "store")
    ship_code(store)
    return store


def probe_processing(name: str, *arguments: str) -> ProcessingJob:
    return ProcessingJob(name=name, step="tests.jobs.probe_processing", code="code/",
                         inputs={"things": "inputs/things/"}, outputs={"seen": "outputs/seen/"},
                         arguments=list(arguments))  # fmt: skip


def backend(store, tmp_path, echo=None) -> LocalBackend:
    """Jobs run in tmp_path/work; a failed one's folder is kept in tmp_path/kept (an S3 store's
    would go to the user's cache folder)."""
    return LocalBackend(
        store,
        RUN,
        echo=echo or io.StringIO(),
        work_root=str(tmp_path / "work"),
        kept_root=str(tmp_path / "kept"),
    )


def test_processing_job_sees_the_contract(store, tmp_path):
    (tmp_path / "in/deep").mkdir(parents=True)
    (tmp_path / "in/a.txt").write_text("hello")
    (tmp_path / "in/deep/b.txt").write_text("world")
    upload_dir(store, tmp_path / "in", "inputs/things/")
    echo = io.StringIO()
    result = backend(store, tmp_path, echo).run_processing(
        probe_processing("probe-1", "--flag", "1")
    )
    assert result.status == "Completed", result.failure_reason
    assert is_complete(store, "outputs/seen/")
    seen = json.loads(store.get_bytes("outputs/seen/seen.json"))
    assert seen["argv"] == ["--flag", "1"]
    # The input as SageMaker delivers a prefix: every object under it, the manifest included.
    assert seen["files"] == ["_MANIFEST.json", "a.txt", "deep/b.txt"] and seen["content"] == "hello"
    assert seen["env"]["SM_PROCESSING_INPUT_THINGS"].endswith("processing/input/things")
    assert seen["env"]["SM_PROCESSING_OUTPUT_SEEN"].endswith("processing/output/seen")
    # The code came from the store's code/ input, not from this checkout.
    assert seen["module_file"].endswith("processing/input/code/tests/jobs/probe_processing.py")
    assert "[probe-1] secret check" in echo.getvalue()  # streamed, prefixed with the job name
    assert b"secret check" in store.get_bytes(RUN.log("probe-1"))


def test_a_local_jobs_compile_cache_is_the_users_own_never_the_temporary_folder(
    tmp_path, monkeypatch
):
    """torch keeps what COMPILE compiles in the system's temporary folder unless told, where
    nothing would remove it: a local job is told the user's cache folder (kept between runs,
    as a cache), and a folder the user named stays theirs."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in/a.txt").write_text("x")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    told = {}
    for name, theirs in (("default", None), ("theirs", tmp_path / "their-cache")):
        if theirs is not None:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(theirs))
        store = LocalStore(tmp_path / name / "store")
        ship_code(store)
        upload_dir(store, tmp_path / "in", "inputs/things/")
        result = backend(store, tmp_path / name).run_processing(probe_processing(name))
        assert result.status == "Completed", result.failure_reason
        told[name] = json.loads(store.get_bytes("outputs/seen/seen.json"))["env"]
    cache = tmp_path / "cache/smpipe/torchinductor"
    assert told["default"]["TORCHINDUCTOR_CACHE_DIR"] == str(cache)
    assert told["theirs"]["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "their-cache")
    assert not cache.exists()  # made by torch when a job compiles, not for every job
    # A cache folder that cannot be made (its place is a file): torch's default, which a
    # compiling job can write, rather than a cache it would fail on.
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))
    assert "TORCHINDUCTOR_CACHE_DIR" not in local_job_env()


def test_failed_processing_job_reports_its_reason_and_uploads_nothing(store, tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in/a.txt").write_text("x")
    upload_dir(store, tmp_path / "in", "inputs/things/")
    result = backend(store, tmp_path).run_processing(probe_processing("probe-2", "--fail"))
    assert result.status == "Failed"
    assert result.failure_reason == "probe: ValueError: asked to fail"
    assert not is_complete(store, "outputs/seen/")


@pytest.mark.parametrize("hosts,per_host", [(1, 2), (2, 1)])
def test_training_job_across_processes_and_hosts(store, tmp_path, hosts, per_host):
    (tmp_path / "train").mkdir()
    (tmp_path / "train/rows.txt").write_text("1\n2\n")
    upload_dir(store, tmp_path / "train", "data/train/")
    job = TrainingJob(
        name="probe-train-1", step="tests.jobs.probe_training", code="code/", channels={"train": "data/train/"},
        hyperparameters={"epochs": "3", "learning_rate": "0.001", "model_name": "minilm", "use_x": "true"},
        model_prefix="out/model/", output_prefix="out/output/", checkpoint_prefix="out/checkpoints/",
        sagemaker_output="out/sagemaker/", instance_count=hosts, processes_per_host=per_host,
        metric_definitions={"validation:f1": r"validation:f1=([0-9.]+)"},
    )  # fmt: skip
    left = set(Path(tempfile.gettempdir()).glob("torchelastic_*"))
    result = backend(store, tmp_path).run_training(job)
    assert result.status == "Completed", result.failure_reason
    assert result.metrics == {"validation:f1": 0.75}
    # torchrun's log folder (a new one in the temporary folder, never removed) is not made.
    assert set(Path(tempfile.gettempdir()).glob("torchelastic_*")) <= left
    assert result.peak_memory_mb and result.peak_memory_mb > 10
    # Every host's model folder is the job's, as SageMaker gathers them into model.tar.gz.
    ranks = range(hosts * per_host)
    seen = [json.loads(store.get_bytes(f"out/model/seen-rank{r}.json")) for r in ranks]
    for r, s in enumerate(seen):
        assert s["rank"] == r and s["world"] == 2 and s["all_reduce"] == 3.0
        # Hyperparameters arrive as SageMaker's containers deliver them: JSON-looking strings decoded.
        assert s["hyperparameters"] == {
            "epochs": 3,
            "learning_rate": 0.001,
            "model_name": "minilm",
            "use_x": True,
        }
        assert s["hp_types"] == {
            "epochs": "int",
            "learning_rate": "float",
            "model_name": "str",
            "use_x": "bool",
        }
        assert s["channels"]["train"] == ["_MANIFEST.json", "rows.txt"] and "code" in s["channels"]
        assert s["hosts"] == [f"algo-{i}" for i in range(1, hosts + 1)] and s["num_gpus"] == 0
        assert s["current_host"] == f"algo-{r // per_host + 1}"
        assert s["job_name"] == "probe-train-1"
        for var in (
            "SM_MODEL_DIR",
            "SM_CHANNEL_TRAIN",
            "SM_OUTPUT_DATA_DIR",
            "SM_HPS",
            "SM_NUM_GPUS",
            "SM_NUM_CPUS",
            "SM_HOSTS",
            "SM_CURRENT_HOST",
            "SM_TRAINING_ENV",
            "SM_HP_EPOCHS",
            "SM_CHECKPOINT_DIR",
        ):
            assert var in s["sm_env"]
    assert json.loads(store.get_bytes("out/output/report.json")) == {"ok": True}
    assert is_complete(store, "out/model/") and is_complete(store, "out/output/")
    # Every rank's checkpoint file reached the store, from whichever host wrote it.
    assert {f"out/checkpoints/ckpt-rank{r}.txt" for r in range(2)} <= set(
        store.list_keys("out/checkpoints/")
    )


def test_secrets_never_reach_the_store(store, tmp_path, monkeypatch):
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # a name with TOKEN in it, no secret
    (tmp_path / "in").mkdir()
    (tmp_path / "in/a.txt").write_text("x")
    upload_dir(store, tmp_path / "in", "inputs/things/")
    echo = io.StringIO()
    assert (
        backend(store, tmp_path, echo).run_processing(probe_processing("probe-3")).status
        == "Completed"
    )
    log = store.get_bytes(RUN.log("probe-3")).decode()
    assert "secret check: <redacted> <redacted> false" in log
    for value in SECRETS.values():
        assert value not in echo.getvalue()
        for key in store.list_keys(""):
            assert value.encode() not in store.get_bytes(key), key


def test_an_input_that_cannot_be_read_fails_the_job_naming_it(store, tmp_path):
    """A reused split deleted while a run uses it: the job fails naming its input and where it
    was looked for; no container starts."""
    result = backend(store, tmp_path).run_processing(probe_processing("probe-missing"))
    assert result.status == "Failed"
    assert result.failure_reason.startswith("ClientError: input 'things' (")
    assert (
        "inputs/things" in result.failure_reason
        and "cannot be read: nothing at" in result.failure_reason
    )
    training = TrainingJob(name="train-missing", step="tests.jobs.probe_training", code="code/",
                           channels={"train": "data/gone/"}, hyperparameters={}, model_prefix="out/m/",
                           output_prefix="out/o/", checkpoint_prefix="out/c/", sagemaker_output="out/s/")  # fmt: skip
    result = backend(store, tmp_path).run_training(training)
    assert result.status == "Failed" and "input 'train' (" in result.failure_reason


def test_a_job_that_runs_past_its_max_runtime_is_stopped(store, tmp_path):
    """[training] MAX_RUN_SECONDS is MaxRuntimeInSeconds, and the local backend keeps it as
    SageMaker does: SIGTERM at the limit, then SIGKILL after the grace; the job is Stopped."""
    (tmp_path / "train").mkdir()
    (tmp_path / "train/rows.txt").write_text("1\n")
    upload_dir(store, tmp_path / "train", "data/train/")
    job = TrainingJob(name="too-long", step="tests.jobs.probe_training", code="code/",
                      channels={"train": "data/train/"}, hyperparameters={"hang": "1"}, model_prefix="out/m/",
                      output_prefix="out/o/", checkpoint_prefix="out/c/", sagemaker_output="out/s/",
                      max_run_seconds=3)  # fmt: skip
    local = backend(store, tmp_path)
    local.containers.grace_seconds = 2
    result = local.run_training(job)  # the probe would sleep 600 s
    record("max-run-seconds", limit=job.max_run_seconds, status=result.status,
           reason=(result.failure_reason or "").split(":")[0], seconds=result.seconds)  # fmt: skip
    assert result.status == "Stopped"
    assert result.failure_reason.startswith("MaxRuntimeExceeded: the job was stopped after")
    assert not is_complete(store, "out/m/")


def test_a_job_stopped_with_the_driver_is_named_as_not_measured(store, tmp_path):
    """Ctrl-C while a local job runs: the job is stopped with the driver and no result holds
    what it used. It is named (`unbilled`, kept by a --resume), and the run's CPU-seconds are
    said to be a lower bound that names it."""
    import _thread
    import threading

    from pipeline import cost
    from pipeline.backend import Earlier

    (tmp_path / "train").mkdir()
    (tmp_path / "train/rows.txt").write_text("1\n")
    upload_dir(store, tmp_path / "train", "data/train/")
    job = TrainingJob(name="stopped", step="tests.jobs.probe_training", code="code/",
                      channels={"train": "data/train/"}, hyperparameters={"hang": "1"}, model_prefix="out/m/",
                      output_prefix="out/o/", checkpoint_prefix="out/c/", sagemaker_output="out/s/")  # fmt: skip
    local = backend(store, tmp_path)
    local.containers.grace_seconds = 2

    # Ctrl-C to the driver while the job hangs (the probe's load_model never returns).
    threading.Timer(3, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        local.run_training(job)
    assert local.unbilled == [{"kind": "training", "job": "stopped"}]
    ran = [{"job": "earlier", "use": "local", "cpu_seconds": 4.25, "peak_memory_mb": 300.0}]
    used = cost.run_cost(ran, None, "local", local.unbilled)
    assert cost.as_text(used) == (
        "used: at least 4.2 CPU-seconds, peak memory 300 MB (local backend: this machine, "
        "nothing billed); not measured: stopped, stopped with the run"
    )
    assert cost.short(used) == "≥4 CPU-s"
    alone = cost.run_cost([], None, "local", local.unbilled)  # nothing else ran
    assert cost.short(alone) == "not measured"
    resumed = backend(store, tmp_path)  # a --resume of the run: still not measured, still named
    assert resumed.resumed(Earlier(0.0, local.unbilled)) == []
    assert resumed.unbilled == local.unbilled
