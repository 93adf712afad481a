"""BACKEND = emulated: the SageMaker backend's real requests sent to moto, every job played
here through the image's entrypoint, end to end on a slice of the demo."""

from __future__ import annotations

import io
import json
import re
import shutil
import signal
import subprocess
import sys

import pytest

from pipeline.backends.choose import make_backend
from pipeline.config import load_settings
from pipeline.driver import PipelineError, parse_steps, run_pipeline
from pipeline.paths import ExperimentTree
from pipeline.store import S3Store, download_dir
from tests.conftest import ROOT, SigtermAt, raw_data_bucket, write_settings
from tests.test_tuning_record import assert_the_report_reads_the_record

SECRET = "wandb-emulated-secret-0123456789"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prepared_bucket(moto_endpoint, demo_raw, tmp_path_factory) -> str:
    """A bucket whose raw data an emulated run (run 1) reconciled and prepared: the runs of
    this module's tests reuse that output (the data steps' cache: the same inputs), as a user's
    next run does, and run the steps each test is about."""
    with raw_data_bucket(moto_endpoint, demo_raw, "smpipe-emulated") as (bucket, store):
        settings = emulated_settings(
            tmp_path_factory.mktemp("prepared"), bucket, models={"MODEL_NAMES": "bow"}
        )
        record = run_pipeline(settings, store, parse_steps("reconcile,prepare"), echo=io.StringIO())
    assert record["status"] == "completed" and record["data_version"] == 1
    return bucket


@pytest.fixture
def bucket(prepared_bucket, aws_env):
    """This module's one bucket (conftest's `bucket` is a new one per test)."""
    return prepared_bucket


@pytest.fixture
def staged(bucket):
    return S3Store(f"s3://{bucket}/root")


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
    assert record["data_steps"]["prepare"]["status"] == "reused"  # the module's prepared data
    run1 = ExperimentTree("test-exp").run(record["model_version"])
    # torchrun across the two emulated hosts: one world of 2 processes, gloo.
    assert "algo-2: " in log and "processes=2" in log
    assert "InProgress / Training" in log and "Completed / Completed" in log
    # The key reached the jobs through Secrets Manager, and never a request or the store.
    assert "WANDB_API_KEY: read from Secrets Manager secret 'smpipe/wandb'" in log
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


def test_lora_on_an_emulated_host_agrees_with_local(staged, bucket, tmp_path):
    """FINETUNING = lora through SageMaker's request, job root and model.tar.gz: the adapter
    reaches the run tree beside the merged model, and the test metrics are the local
    backend's for the same data and seed."""
    lora = {"USE_DISTRIBUTED": "false", "INSTANCE_COUNT": "1", "FINETUNING": "lora",
            "LORA_TARGET_MODULES": "embedding", "LEARNING_RATE": "1e-2"}  # fmt: skip
    records = {}
    for backend in ("emulated", "local"):
        (tmp_path / backend).mkdir()
        settings = emulated_settings(
            tmp_path / backend, bucket, experiment={"BACKEND": backend},
            models={"MODEL_NAMES": "bow"}, training=lora,
        )  # fmt: skip
        records[backend] = run_pipeline(
            settings, staged, parse_steps("train,inference"), echo=io.StringIO()
        )
        assert records[backend]["status"] == "completed"
    model = records["emulated"]["model_artifacts"]["bow"]
    adapter = json.loads(staged.get_bytes(model + "adapter/adapter_config.json"))
    assert adapter["target_modules"] == ["embedding"] and adapter["modules_to_save"] == [
        "classifier"
    ]
    assert staged.exists(model + "adapter/adapter_model.safetensors")
    assert json.loads(staged.get_bytes(model + "smpipe.json"))["finetuning"] == "lora"
    performance = {b: r["holdout_performance"]["bow"] for b, r in records.items()}
    assert performance["emulated"] == performance["local"]


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
    run1 = ExperimentTree("test-exp").run(record["model_version"])
    # The tuning job (a name of at most 32 characters), then the export of its best model.
    tuning_name, export_name = tune["job_names"]
    assert len(tuning_name) <= 32 and "-export-bow-" in export_name
    for model in ("bow",):
        details = tune["details"]["models"][model]
        best = details["best"]
        assert best["job_name"].startswith(details["tuning_job"] + "-")
        assert details["objective_metric"] == "validation:f1" and best["objective"] is not None
        assert details["counters"]["Completed"] == 2
        # The best trial's model is where a training job leaves one, and inference used it.
        assert record["model_artifacts"][model].endswith(f"{run1.model(model)}model/")
        assert model in record["holdout_performance"]
    # Every trial got SageMaker's reserved hyperparameter, as AWS writes it: the objective's
    # name, not JSON-quoted (and train.py accepted and recorded it).
    trials = [
        json.loads(b)
        for b in recorder.bodies
        if '"TrainingJobName"' in b and "AlgorithmSpecification" in b
    ]
    assert len(trials) == 2
    assert all(t["HyperParameters"]["_tuning_objective_metric"] == "validation:f1" for t in trials)
    best = tune["details"]["models"]["bow"]
    assert best["sagemaker_hyperparameters"] == {"_tuning_objective_metric": "validation:f1"}
    assert {t["status"] for t in best["trials"]} == {"Completed"} and len(best["trials"]) == 2
    # Each trial checkpointed in a folder of its own under the tuning job's one S3Uri, and the
    # folder went once the trial ended; no archive stays: the best trial's model is kept
    # once, exported, in the run tree.
    assert staged.list_keys(run1.checkpoints("bow")) == []
    assert staged.list_keys(run1.training_output) == []
    assert staged.list_keys(run1.best_trial_model("bow")) == []
    kept = json.loads(staged.get_bytes(run1.final_model("bow") + "smpipe.json"))
    assert kept["exports"]["torchscript"]["passed"] and best["exports"] == kept["exports"]
    assert "could not" not in echo.getvalue()  # no error said while following the job
    # The report reads the tuning record in the one shape a local study's and SageMaker's have.
    tree = ExperimentTree("test-exp")
    saved = assert_the_report_reads_the_record(staged, tree, record["model_version"], "bow")
    assert all(t["seconds"] is not None for t in saved["trials"])


def entrypoint_of_a_training_job(command: list[str]) -> bool:
    """PID 1 of a training job's container: SageMaker sends it SIGTERM on a spot reclaim."""
    return "steps.entrypoint" in command and command[-1] == "train"


class ReclaimAt(io.StringIO):
    """The echo of an emulated run: once the job reports step `step`, AWS takes the spot
    instance back (the emulator's reclaim: SIGTERM, then a restart from the checkpoints)."""

    def __init__(self, step: int):
        super().__init__()
        self.step, self.backend, self.reclaimed = step, None, []

    def write(self, text):
        # "[job] step=N/..." from one host, "[job] algo-1: step=N/..." from several.
        said = re.search(rf"[\]:] step={self.step}/", text)
        if not self.reclaimed and self.backend is not None and said:
            self.reclaimed = self.backend.emulator.reclaim()
        return super().write(text)

    def make_backend(self, settings, store, run, echo):
        self.backend = make_backend(settings, store, run, echo)
        return self.backend


def test_a_reclaimed_spot_job_checkpoints_and_resumes(staged, bucket, tmp_path):
    settings = emulated_settings(
        tmp_path, bucket, models={"MODEL_NAMES": "bow"},
        training={"USE_DISTRIBUTED": "false", "INSTANCE_COUNT": "1", "USE_SPOT": "true", "EPOCHS": "6"},
    )  # fmt: skip
    # Step lines reach the driver through CloudWatch polling, seconds late: enough steps are
    # left after step 5 for the signal to land while the job still trains.
    echo = ReclaimAt(step=5)
    record = run_pipeline(
        settings, staged, parse_steps(None), echo=echo, make_backend=echo.make_backend
    )
    log = echo.getvalue()
    assert echo.reclaimed and record["status"] == "completed"
    assert "SIGTERM: checkpoint written at step" in log
    assert "spot capacity interrupted the job; restart 1" in log
    assert "resumed from" in log
    report = record["steps"]["train"]["details"]["models"]["bow"]
    assert report["resumed_from"]["step"] >= 5
    assert [h["epoch"] for h in report["history"]] == [1, 2, 3, 4, 5, 6]


# The demo's user functions with a BERT of two small layers from its config (random weights):
# layers to shard and to adapt, as quick to train as the bag of embeddings.
FSDP_FUNCTIONS = """
from user_functions import encode, load_tokenizer, ordered_input_keys, reconcile  # noqa: F401


def load_model(model_name, id2label, label2id):
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=len(id2label), id2label=id2label, label2id=label2id,
    ))
"""


def test_fsdp_with_lora_on_two_spot_hosts_resumes_from_shards_synced_through_s3(
    staged, bucket, tmp_path
):
    """DISTRIBUTED_STRATEGY = fsdp across two emulated hosts (one process each), LoRA, spot: each
    host writes its own process's shards to its own checkpoint folder, which SageMaker syncs to
    the one S3 prefix; reclaimed, both hosts start again from that prefix, whole, and resume."""
    (tmp_path / "fsdp_functions.py").write_text(FSDP_FUNCTIONS)
    # The demo's package beside it, as a project's own modules are (the code a run ships).
    shutil.copytree(ROOT / "user_functions", tmp_path / "user_functions")
    settings = emulated_settings(
        tmp_path, bucket, models={"MODEL_NAMES": "bow"},
        experiment={"USER_FUNCTIONS": "fsdp_functions"},
        training={"DISTRIBUTED_STRATEGY": "fsdp", "FINETUNING": "lora", "USE_SPOT": "true",
                  "EPOCHS": "12", "LEARNING_RATE": "1e-3", "CHECKPOINT_EVERY_STEPS": "2"},
    )  # fmt: skip
    # Step lines reach the driver through CloudWatch polling, seconds late: 72 steps in all.
    echo = ReclaimAt(step=3)
    try:
        record = run_pipeline(
            settings, staged, parse_steps(None), echo=echo, make_backend=echo.make_backend
        )
    except PipelineError as e:  # the jobs' own lines, which moto's logs lose at teardown:
        log = echo.getvalue()  # from the first error on, before torchrun's summary of it
        first = min((log.find(w) for w in ("Error", "Traceback") if w in log), default=0)
        raise AssertionError(log[max(0, first - 3000) : first + 9000]) from e
    log = echo.getvalue()
    assert echo.reclaimed and record["status"] == "completed", log[-3000:]
    assert "spot capacity interrupted the job; restart 1" in log and "resumed from" in log
    report = record["steps"]["train"]["details"]["models"]["bow"]
    assert report["distributed_strategy"] == "fsdp" and report["processes"] == 2
    assert report["resumed_from"]["step"] >= 3 and report["lora_merge"]["passed"]
    assert [h["epoch"] for h in report["history"]] == list(range(1, 13))
    model = record["model_artifacts"]["bow"]
    assert staged.exists(model + "adapter/adapter_model.safetensors")
    assert json.loads(staged.get_bytes(model + "smpipe.json"))["exports"]["torchscript"]["passed"]


def test_an_emulated_spot_job_killed_otherwise_is_not_restarted(staged, bucket, tmp_path):
    """SageMaker restarts a spot job only when its instance is taken back: one killed for its
    memory (SIGKILL) ends Failed, whatever the local backend's MAX_RESTARTS would do."""
    settings = emulated_settings(
        tmp_path, bucket, models={"MODEL_NAMES": "bow"},
        training={"USE_DISTRIBUTED": "false", "INSTANCE_COUNT": "1", "USE_SPOT": "true", "EPOCHS": "6",
                  "MAX_RESTARTS": "3"},
    )  # fmt: skip
    echo = SigtermAt(step=3, target=lambda command: "steps.train" in command, sig=signal.SIGKILL)
    with pytest.raises(
        PipelineError,
        match=r"ended Failed; FailureReason: AlgorithmError: the training step exited with status -9",
    ):
        run_pipeline(settings, staged, parse_steps("reconcile,prepare,train"), echo=echo)
    assert echo.sent and "restart" not in echo.getvalue()


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
    # The emulator's placeholder credentials are masked as secrets: never a word text holds.
    assert record["backend"] == "emulated" and "<redacted>" not in json.dumps(record)
    assert record["steps"]["prepare"]["status"] == "failed"
    assert "this encode is broken" in record["steps"]["prepare"]["failure_reason"]
    # The raw data went to the store, as the raw version the run names, before it was claimed.
    assert (tmp_path / "store" / record["raw_path"] / "labels.csv").exists()


def test_stop_ends_the_emulated_job(staged, bucket, tmp_path):
    # Enough epochs that the stop, asked once the driver has read step 2 off the log (it
    # polls), lands while the job trains: three took about a second, and sometimes ended first.
    settings = emulated_settings(tmp_path, bucket, models={"MODEL_NAMES": "bow"},
                                 training={"USE_DISTRIBUTED": "false", "INSTANCE_COUNT": "1", "EPOCHS": "40"})  # fmt: skip

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
