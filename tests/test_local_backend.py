"""The local backend runs jobs as subprocesses under SageMaker's container contract."""

from __future__ import annotations

import io
import json

import pytest

from pipeline.jobs import ProcessingJob, TrainingJob
from pipeline.local_backend import LocalBackend
from pipeline.store import LocalStore, S3Store, is_complete, upload_dir

SECRETS = {
    "WANDB_API_KEY": "wandb-secret-0123456789",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-9876543210",
}


@pytest.fixture(params=["s3", "local"])
def store(request, tmp_path):
    if request.param == "s3":
        return S3Store(f"s3://{request.getfixturevalue('bucket')}")
    return LocalStore(tmp_path / "store")


def test_processing_job_sees_the_contract(store, tmp_path):
    (tmp_path / "in/deep").mkdir(parents=True)
    (tmp_path / "in/a.txt").write_text("hello")
    (tmp_path / "in/deep/b.txt").write_text("world")
    upload_dir(store, tmp_path / "in", "inputs/things/")
    echo = io.StringIO()
    backend = LocalBackend(store, "logs/", work_root=str(tmp_path / "work"), echo=echo)
    job = ProcessingJob(name="probe-1", step="tests.jobs.probe_processing", inputs={"things": "inputs/things/"},
                        outputs={"seen": "outputs/seen/"}, arguments=["--flag", "1"])  # fmt: skip
    result = backend.run_processing(job)
    assert result.status == "Completed", result.failure_reason
    assert is_complete(store, "outputs/seen/")
    seen = json.loads(store.get_bytes("outputs/seen/seen.json"))
    assert seen["argv"] == ["--flag", "1"]
    assert seen["files"] == ["a.txt", "deep/b.txt"] and seen["content"] == "hello"
    assert seen["env"]["SM_PROCESSING_INPUT_THINGS"].endswith("processing/input/things")
    assert seen["env"]["SM_PROCESSING_OUTPUT_SEEN"].endswith("processing/output/seen")
    assert "[probe-1] secret check" in echo.getvalue()  # streamed, prefixed with the job name
    assert b"secret check" in store.get_bytes("logs/probe-1.log")


def test_failed_processing_job_reports_its_reason_and_uploads_nothing(store, tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in/a.txt").write_text("x")
    upload_dir(store, tmp_path / "in", "inputs/things/")
    backend = LocalBackend(store, "logs/", work_root=str(tmp_path / "work"), echo=io.StringIO())
    job = ProcessingJob(name="probe-2", step="tests.jobs.probe_processing", inputs={"things": "inputs/things/"},
                        outputs={"seen": "outputs/seen/"}, arguments=["--fail"])  # fmt: skip
    result = backend.run_processing(job)
    assert result.status == "Failed"
    assert result.failure_reason == "probe: ValueError: asked to fail"
    assert not is_complete(store, "outputs/seen/")


def test_two_process_training_job(store, tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train/rows.txt").write_text("1\n2\n")
    upload_dir(store, tmp_path / "train", "data/train/")
    backend = LocalBackend(store, "logs/", work_root=str(tmp_path / "work"), echo=io.StringIO())
    job = TrainingJob(
        name="probe-train-1", step="tests.jobs.probe_training", channels={"train": "data/train/"},
        hyperparameters={"epochs": "3", "learning_rate": "0.001", "model_name": "minilm", "use_x": "true"},
        model_prefix="out/model/", output_prefix="out/output/", checkpoint_prefix="out/checkpoints/",
        processes_per_host=2, metric_definitions={"validation:f1": r"validation:f1=([0-9.]+)"},
    )  # fmt: skip
    result = backend.run_training(job)
    assert result.status == "Completed", result.failure_reason
    assert result.metrics == {"validation:f1": 0.75}
    assert result.peak_memory_mb and result.peak_memory_mb > 10
    seen = [json.loads(store.get_bytes(f"out/model/seen-rank{r}.json")) for r in (0, 1)]
    for r, s in enumerate(seen):
        assert s["rank"] == r and s["world"] == 2 and s["all_reduce"] == 3.0
        # Hyperparameters arrive as SageMaker's drivers deliver them: JSON-looking strings decoded.
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
        assert s["channels"] == {"train": ["rows.txt"]}
        assert s["hosts"] == ["algo-1"] and s["current_host"] == "algo-1" and s["num_gpus"] == 0
        assert s["job_name"] == "probe-train-1"
        for var in ("SM_MODEL_DIR", "SM_CHANNEL_TRAIN", "SM_OUTPUT_DATA_DIR", "SM_HPS", "SM_NUM_GPUS", "SM_NUM_CPUS",
                    "SM_HOSTS", "SM_CURRENT_HOST", "SM_TRAINING_ENV", "SM_HP_EPOCHS", "SM_CHECKPOINT_DIR"):  # fmt: skip
            assert var in s["sm_env"]
    assert json.loads(store.get_bytes("out/output/report.json")) == {"ok": True}
    assert is_complete(store, "out/model/") and is_complete(store, "out/output/")


def test_secrets_never_reach_the_store(store, tmp_path, monkeypatch):
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    (tmp_path / "in").mkdir()
    (tmp_path / "in/a.txt").write_text("x")
    upload_dir(store, tmp_path / "in", "inputs/things/")
    echo = io.StringIO()
    backend = LocalBackend(store, "logs/", work_root=str(tmp_path / "work"), echo=echo)
    job = ProcessingJob(name="probe-3", step="tests.jobs.probe_processing", inputs={"things": "inputs/things/"},
                        outputs={"seen": "outputs/seen/"})  # fmt: skip
    assert backend.run_processing(job).status == "Completed"
    log = store.get_bytes("logs/probe-3.log").decode()
    assert "secret check: <redacted> <redacted>" in log
    for value in SECRETS.values():
        assert value not in echo.getvalue()
        for key in store.list_keys(""):
            assert value.encode() not in store.get_bytes(key), key
