"""The SageMaker backend against moto's SageMaker and S3: what it asks SageMaker to run, and
how it maps a completed job's output onto the run tree. moto creates jobs that report
Completed at once and runs nothing, so where a container would have written output, the
tests write it at the moment the job is created."""

from __future__ import annotations

import io
import json
import sys
import tarfile

import pytest

from pipeline.config import load_settings
from pipeline.driver import PipelineError, parse_steps, run_pipeline
from pipeline.jobs import ProcessingJob, TrainingJob
from pipeline.paths import ExperimentTree
from pipeline.sagemaker_backend import SageMakerBackend
from pipeline.store import S3Store, is_complete, read_manifest
from tests.conftest import write_settings

ROLE = "arn:aws:iam::123456789012:role/smpipe"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/smpipe:latest"


@pytest.fixture
def setup(bucket, tmp_path):
    path = write_settings(
        tmp_path / "settings.ini", f"s3://{bucket}/root",
        experiment={"BACKEND": "sagemaker", "ROLE_ARN": ROLE, "IMAGE_URI": IMAGE},
        training={"USE_SPOT": "true", "USE_DISTRIBUTED": "true", "PROCESSES_PER_HOST": "4", "INSTANCE_COUNT": "2",
                  "INSTANCE_TYPE": "ml.g5.12xlarge"},
    )  # fmt: skip
    settings = load_settings(path, env={})
    store = S3Store(settings.store_uri())
    run = ExperimentTree("test-exp").run(1)
    # moto's DescribeProcessingJob has no ProcessingResources, which the SDK's log streaming reads.
    backend = SageMakerBackend(settings, store, run, echo=io.StringIO(), stream_logs=False)
    requests = {}

    def capture(params, model, **_):
        requests[model.name] = params

    # On the session's client and on the boto session: the SDK's resource classes make their
    # own clients from the latter.
    for events in (
        backend.session.sagemaker_client.meta.events,
        backend.session.boto_session.events,
    ):
        events.register("provide-client-params.sagemaker.*", capture)
    return settings, store, run, backend, requests


def tarball(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_processing_job_request_and_manifested_output(setup):
    settings, store, run, backend, requests = setup
    store.put_bytes("test-exp/raw/a.txt", b"raw")
    store.put_bytes("out/snap/dataset/data.arrow", b"as if the container wrote it")
    job = ProcessingJob(name="test-exp-0001-reconcile-1", step="reconcile", inputs={"raw": "test-exp/raw/"},
                        outputs={"snapshot": "out/snap/"}, arguments=["--x", "1"], env={"SMPIPE_USER_FUNCTIONS": "user_functions"})  # fmt: skip
    result = backend.run_processing(job)
    assert result.status == "Completed", result.failure_reason
    sent = requests["CreateProcessingJob"]
    assert sent["AppSpecification"] == {"ImageUri": IMAGE, "ContainerEntrypoint": ["python3", "-m", "steps.reconcile"],
                                        "ContainerArguments": ["--x", "1"]}  # fmt: skip
    assert sent["RoleArn"] == ROLE
    env = sent["Environment"]
    assert env["SM_PROCESSING_INPUT_RAW"] == "/opt/ml/processing/input/raw"
    assert env["SM_PROCESSING_OUTPUT_SNAPSHOT"] == "/opt/ml/processing/output/snapshot"
    assert (
        env["PYTHONPATH"] == "/opt/ml/processing/input/code"
        and env["SMPIPE_USER_FUNCTIONS"] == "user_functions"
    )
    inputs = {i["InputName"]: i["S3Input"]["S3Uri"] for i in sent["ProcessingInputs"]}
    assert inputs["raw"] == store.uri_of("test-exp/raw/")
    assert inputs["code"] == store.uri_of(run.prefix + "code/")
    assert is_complete(store, run.prefix + "code/")
    assert {"steps/train.py", "user_functions/__init__.py"} <= set(
        read_manifest(store, run.prefix + "code/")["files"]
    )
    manifest = read_manifest(store, "out/snap/")
    assert manifest["job_name"] == job.name and list(manifest["files"]) == ["dataset/data.arrow"]


def test_a_completed_job_that_wrote_nothing_is_a_failure(setup):
    settings, store, run, backend, requests = setup
    store.put_bytes("test-exp/raw/a.txt", b"raw")
    job = ProcessingJob(name="test-exp-0001-reconcile-2", step="reconcile", inputs={"raw": "test-exp/raw/"},
                        outputs={"snapshot": "out/empty/"})  # fmt: skip
    result = backend.run_processing(job)
    assert result.status == "Failed" and "wrote nothing to" in result.failure_reason
    assert not is_complete(store, "out/empty/")


def test_training_job_request_spot_checkpoints_distributed(setup):
    settings, store, run, backend, requests = setup
    report = json.dumps({"best_epoch": 2}).encode()
    written = set()

    def container_writes_output(http_response, parsed, model, **_):
        name = parsed.get("TrainingJobArn", "").rsplit("/", 1)[-1]
        if not name or name in written:
            return
        written.add(name)
        described = backend.session.sagemaker_client.describe_training_job(TrainingJobName=name)
        key = described["ModelArtifacts"]["S3ModelArtifacts"].split(f"s3://{store.bucket}/")[1]
        store.client.put_object(
            Bucket=store.bucket, Key=key, Body=tarball({"model.torchscript.pt": b"ts"})
        )
        store.client.put_object(Bucket=store.bucket, Key=key.replace("model.tar.gz", "output.tar.gz"),
                                Body=tarball({"step_metadata.json": report}))  # fmt: skip

    for events in (
        backend.session.sagemaker_client.meta.events,
        backend.session.boto_session.events,
    ):
        events.register("after-call.sagemaker.CreateTrainingJob", container_writes_output)
    t = settings.training
    job = TrainingJob(
        name="test-exp-0001-train-minilm", step="train", channels={"train": "data/train/", "labels": "data/labels/"},
        hyperparameters=settings.training_hyperparameters("minilm", "training"), model_prefix=run.model("minilm") + "model/",
        output_prefix=run.model("minilm") + "output/", checkpoint_prefix=run.checkpoints("minilm"),
        env={"SMPIPE_USER_FUNCTIONS": "user_functions"}, instance_type=t.instance_type, instance_count=t.instance_count,
        processes_per_host=t.processes_per_host, use_spot=True, metric_definitions=settings.metric_definitions,
    )  # fmt: skip
    result = backend.run_training(job)
    assert result.status == "Completed", result.failure_reason
    sent = requests["CreateTrainingJob"]
    assert sent["EnableManagedSpotTraining"] is True
    assert (
        sent["StoppingCondition"]["MaxWaitTimeInSeconds"]
        >= sent["StoppingCondition"]["MaxRuntimeInSeconds"]
    )
    assert sent["CheckpointConfig"] == {
        "S3Uri": store.uri_of(run.checkpoints("minilm")),
        "LocalPath": "/opt/ml/checkpoints",
    }
    assert (
        sent["ResourceConfig"]["InstanceCount"] == 2
        and sent["ResourceConfig"]["InstanceType"] == "ml.g5.12xlarge"
    )
    assert (
        sent["HyperParameters"]["model_name"] == "minilm"
        and sent["HyperParameters"]["epochs"] == "1"
    )
    assert sent["Environment"]["SM_CHECKPOINT_DIR"] == "/opt/ml/checkpoints"
    assert sent["Environment"]["PYTHONPATH"] == "/opt/ml/input/data/code"
    channels = {
        c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in sent["InputDataConfig"]
    }
    assert channels["train"] == store.uri_of("data/train/") and channels["labels"] == store.uri_of(
        "data/labels/"
    )
    assert {"code", "sm_drivers"} <= set(
        channels
    )  # SageMaker's drivers run steps/train.py under torchrun
    assert all(
        uri.startswith(store.uri_of(run.prefix))
        for c, uri in channels.items()
        if c in ("code", "sm_drivers")
    )
    assert {m["Name"] for m in sent["AlgorithmSpecification"]["MetricDefinitions"]} == set(
        settings.metric_definitions
    )
    # The completed job's output, adopted into the run tree with manifests.
    assert read_manifest(store, job.model_prefix)["files"].keys() == {"model.tar.gz"}
    assert json.loads(store.get_bytes(job.output_prefix + "step_metadata.json")) == {
        "best_epoch": 2
    }


def test_tuning_job_request(setup):
    settings, store, run, backend, requests = setup
    job = TrainingJob(
        name="test-exp-0001-tune-minilm", step="train", channels={"train": "data/train/"},
        hyperparameters=settings.training_hyperparameters("minilm", "tuning"), model_prefix="t/model/",
        output_prefix="t/output/", checkpoint_prefix="t/ck/", metric_definitions=settings.metric_definitions,
    )  # fmt: skip
    result, details = backend.run_tuning(job)
    sent = requests["CreateHyperParameterTuningJob"]
    config = sent["HyperParameterTuningJobConfig"]
    assert config["Strategy"] == "Bayesian"
    assert config["HyperParameterTuningJobObjective"] == {
        "Type": "Maximize",
        "MetricName": "validation:f1",
    }
    assert config["ResourceLimits"]["MaxNumberOfTrainingJobs"] == 4
    ranges = config["ParameterRanges"]
    assert ranges["ContinuousParameterRanges"] == [
        {
            "Name": "learning_rate",
            "MinValue": "2e-05",
            "MaxValue": "0.0002",
            "ScalingType": "Logarithmic",
        }
    ]
    assert ranges["CategoricalParameterRanges"] == [{"Name": "batch_size", "Values": ["16", "32"]}]
    static = sent["TrainingJobDefinition"]["StaticHyperParameters"]
    assert (
        "learning_rate" not in static
        and "batch_size" not in static
        and static["job_kind"] == "tuning"
    )
    # moto runs no trials and names a best training job that does not exist: reported, not papered over.
    assert result.status == "Failed"
    assert (
        "no best training job" in result.failure_reason or "cannot be read" in result.failure_reason
    )


def test_pipeline_on_sagemaker_stops_at_the_first_empty_step(setup, demo_raw):
    settings, store, run, backend, requests = setup
    from pipeline.stage import stage

    stage(store, ExperimentTree("test-exp"), demo_raw)
    with pytest.raises(PipelineError, match="step 'reconcile' failed .* wrote nothing to"):
        run_pipeline(settings, store, parse_steps(None), echo=sys.stdout,
                     make_backend=lambda s, st, r, echo: SageMakerBackend(s, st, r, echo, stream_logs=False))  # fmt: skip
    record = json.loads(store.get_bytes(run.metadata))
    assert record["status"] == "failed" and record["backend"] == "sagemaker"
    assert record["steps"]["reconcile"]["job_names"][0].startswith("test-exp-0001-reconcile")
