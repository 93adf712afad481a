"""BACKEND = emulated: the SageMaker backend's real requests sent to moto, every job played
here through the image's entrypoint, end to end on a slice of the demo."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from pipeline.config import load_settings
from pipeline.driver import PipelineError, make_backend, parse_steps, run_pipeline
from pipeline.paths import ExperimentTree
from pipeline.stage import stage
from pipeline.store import S3Store, download_dir
from tests.conftest import ROOT, SigtermAt, write_settings

SECRET = "wandb-emulated-secret-0123456789"
pytestmark = pytest.mark.slow


@pytest.fixture
def staged(bucket, demo_raw):
    store = S3Store(f"s3://{bucket}/root")
    stage(store, ExperimentTree("test-exp"), demo_raw)
    return store


def emulated_settings(tmp_path, bucket, **overrides):
    training = {"USE_DISTRIBUTED": "true", "INSTANCE_COUNT": "2", "PROCESSES_PER_HOST": "1",
                **overrides.pop("training", {})}  # fmt: skip
    path = write_settings(tmp_path / "settings.ini", f"s3://{bucket}/root",
                          experiment={"BACKEND": "emulated", **overrides.pop("experiment", {})},
                          training=training, **overrides)  # fmt: skip
    return load_settings(path, env={})


class Recorder:
    """make_backend, keeping every request body the backend sends to moto."""

    def __init__(self):
        self.bodies: list[str] = []
        self.backend = None

    def __call__(self, settings, store, run, echo):
        self.backend = make_backend(settings, store, run, echo)
        self.backend.client.meta.events.register(
            "before-send.sagemaker", lambda request, **_: self.bodies.append(request.body.decode())
        )
        return self.backend


def test_train_on_two_emulated_hosts_agrees_with_local(staged, bucket, tmp_path, monkeypatch):
    # The baseline: torchrun across two emulated hosts is the same path for any model, and
    # MiniLM's two-model run is test_pipeline's (on two hosts it cost 80 s more here).
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    settings = emulated_settings(
        tmp_path, bucket, models={"MODEL_NAMES": "bow"},
        tracking={"WANDB_SECRET_ID": "smpipe/wandb", "WANDB_MODE": "disabled"},
    )  # fmt: skip
    recorder, echo = Recorder(), io.StringIO()
    record = run_pipeline(settings, staged, parse_steps(None), echo=echo, make_backend=recorder)
    log = echo.getvalue()
    assert record["status"] == "completed" and record["backend"] == "emulated"
    run1 = ExperimentTree("test-exp").run(1)
    # torchrun across the two emulated hosts: one world of 2 processes, gloo.
    assert "algo-2: " in log and "processes=2" in log
    assert "InProgress / Training" in log and "Completed / Completed" in log
    # The key reached the jobs through Secrets Manager, and never a request or the store.
    assert "wandb: key read from Secrets Manager secret 'smpipe/wandb'" in log
    sent = [json.loads(b) for b in recorder.bodies]
    assert {"CreateProcessingJob", "CreateTrainingJob"} <= {
        "CreateProcessingJob" if "ProcessingJobName" in b and "AppSpecification" in b else
        "CreateTrainingJob" if "AlgorithmSpecification" in b else "other" for b in sent}  # fmt: skip
    assert all(SECRET not in b for b in recorder.bodies)
    for key in staged.list_keys("test-exp/"):
        assert SECRET.encode() not in staged.get_bytes(key), key
    # SageMaker's output layout was adopted into the same run tree the local backend writes.
    for model in ("bow",):
        download_dir(staged, run1.model(model) + "model/", tmp_path / model)
        assert (tmp_path / model / "model.torchscript.pt").exists()
        assert staged.list_keys(run1.training_output)  # model.tar.gz, output.tar.gz per job
    assert staged.get_bytes(run1.log(record["steps"]["train"]["job_names"][0])).count(b"step=") > 3

    # The same job on the local backend, same data and seed: the same test metrics.
    local = emulated_settings(
        tmp_path, bucket, experiment={"BACKEND": "local"}, models={"MODEL_NAMES": "bow"}
    )
    local_record = run_pipeline(local, staged, parse_steps("train,inference"), echo=io.StringIO())
    assert local_record["data_version"] == record["data_version"] == 1
    assert local_record["holdout_performance"]["bow"] == record["holdout_performance"]["bow"]


def test_tune_emulated(staged, bucket, tmp_path):
    # One host per trial: two emulated hosts are the test above's.
    settings = emulated_settings(
        tmp_path, bucket, experiment={"JOB": "tune"}, models={"MODEL_NAMES": "bow"},
        training={"USE_DISTRIBUTED": "false", "INSTANCE_COUNT": "1"},
        tuning={"STRATEGY": "Random", "MAX_JOBS": "2", "MAX_PARALLEL_JOBS": "2", "EARLY_STOPPING": "Auto"},
        **{"tuning.hyperparameters": {"LEARNING_RATE": "1e-4->1e-2 log", "BATCH_SIZE": None}},
    )  # fmt: skip
    recorder, echo = Recorder(), io.StringIO()
    record = run_pipeline(settings, staged, parse_steps(None), echo=echo, make_backend=recorder)
    assert record["status"] == "completed"
    [request] = [json.loads(b) for b in recorder.bodies if "HyperParameterTuningJobConfig" in b]
    config = request["HyperParameterTuningJobConfig"]
    assert config["TrainingJobEarlyStoppingType"] == "Auto" and config["Strategy"] == "Random"
    assert {m["Name"] for m in request["TrainingJobDefinition"]["AlgorithmSpecification"]["MetricDefinitions"]} == {
        "train:loss", "validation:loss", "validation:accuracy", "validation:f1"}  # fmt: skip
    tune = record["steps"]["tune"]
    assert len(tune["job_names"]) == 1 and all(len(n) <= 32 for n in tune["job_names"])
    for model in ("bow",):
        details = tune["details"]["models"][model]
        best = details["best"]
        assert best["TrainingJobName"].startswith(details["tuning_job"] + "-")
        assert best["FinalHyperParameterTuningJobObjectiveMetric"]["MetricName"] == "validation:f1"
        assert details["counters"]["Completed"] == 2
        # The best trial's model is where a training job leaves one, and inference used it.
        assert record["model_artifacts"][model].endswith(f"runs/0001/models/{model}/model/")
        assert model in record["holdout_performance"]
    # Each trial checkpointed in a folder of its own under the tuning job's prefix.
    trials = {
        k.split("/")[5]
        for k in staged.list_keys(ExperimentTree("test-exp").run(1).checkpoints("bow"))
    }
    assert len(trials) == 2 and all(
        t.startswith(record["steps"]["tune"]["job_names"][0]) for t in trials
    )


def entrypoint_of_a_training_job(command: list[str]) -> bool:
    """PID 1 of a training job's container: SageMaker sends it SIGTERM on a spot reclaim."""
    return "steps.entrypoint" in command and command[-1] == "train"


def test_sigterm_to_an_emulated_spot_job_checkpoints_and_resumes(staged, bucket, tmp_path):
    settings = emulated_settings(
        tmp_path, bucket, models={"MODEL_NAMES": "bow"},
        training={"USE_DISTRIBUTED": "false", "INSTANCE_COUNT": "1", "USE_SPOT": "true", "EPOCHS": "6"},
    )  # fmt: skip
    # Step lines reach the driver through CloudWatch polling, seconds late: enough steps are
    # left after step 5 for the signal to land while the job still trains.
    echo = SigtermAt(step=5, target=entrypoint_of_a_training_job)
    record = run_pipeline(settings, staged, parse_steps(None), echo=echo)
    log = echo.getvalue()
    assert echo.sent and record["status"] == "completed"
    assert "SIGTERM: checkpoint written at step" in log
    assert "spot capacity interrupted the job; restart 1" in log
    assert "resumed from" in log
    report = record["steps"]["train"]["details"]["models"]["bow"]
    assert report["resumed_from"]["step"] >= 5
    assert [h["epoch"] for h in report["history"]] == [1, 2, 3, 4, 5, 6]


FAILING = """
from user_functions import reconcile, load_tokenizer, load_model, ordered_input_keys

def encode(batch, tokenizer, model_name, max_length):
    raise ValueError("this encode is broken on purpose")
"""


def test_a_failing_step_ends_in_one_paragraph(tmp_path, demo_raw):
    """From the command line, with its own embedded moto: the step's own message comes back
    as SageMaker's ExitMessage, the failed step has its Metadata section, nothing runs after."""
    (tmp_path / "broken_functions.py").write_text(FAILING)
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "store"), models={"MODEL_NAMES": "bow"},
                          experiment={"BACKEND": "emulated", "USER_FUNCTIONS": "broken_functions"},
                          data={"RAW_DATA": str(demo_raw)})  # fmt: skip
    done = subprocess.run([sys.executable, str(ROOT / "run_pipeline.py"), str(path)],
                          capture_output=True, text=True, cwd=ROOT, env={**__import__("os").environ,
                          "PYTHONPATH": str(tmp_path)})  # fmt: skip
    assert done.returncode == 1, done.stderr
    error = done.stderr.strip()
    assert "Traceback" not in error and len(error.splitlines()) == 1
    assert "step 'prepare' failed" in error
    assert "ExitMessage: prepare: RuntimeError: user function broken_functions.encode raised ValueError: " \
           "this encode is broken on purpose" in error  # fmt: skip
    runs = tmp_path / "store/test-exp/runs/0001"
    record = json.loads((runs / "metadata.json").read_text())
    assert record["status"] == "failed" and set(record["steps"]) == {"reconcile", "prepare"}
    assert record["steps"]["prepare"]["status"] == "failed"
    assert "this encode is broken" in record["steps"]["prepare"]["failure_reason"]
    # The raw data went to the experiment's raw/ before the run was claimed.
    assert (tmp_path / "store/test-exp/raw/labels.csv").exists()


def test_stop_ends_the_emulated_job(staged, bucket, tmp_path):
    settings = emulated_settings(tmp_path, bucket, models={"MODEL_NAMES": "bow"},
                                 training={"USE_DISTRIBUTED": "false", "INSTANCE_COUNT": "1", "EPOCHS": "3"})  # fmt: skip

    class StopAt(io.StringIO):
        backend = None

        def write(self, text):
            if "] step=2/" in text and self.backend is not None:
                self.backend.stop()
                self.backend = None
            return super().write(text)

    echo = StopAt()

    def build(settings, store, run, echo_):
        echo.backend = make_backend(settings, store, run, echo_)
        return echo.backend

    with pytest.raises(PipelineError, match=r"step 'train' failed .* ended Stopped"):
        run_pipeline(settings, staged, parse_steps(None), echo=echo, make_backend=build)
    assert "stop requested" in echo.getvalue()
