"""The SageMaker requests: built once from the job description, accepted by botocore's service
model and by moto, named within SageMaker's limits, and adopted into a run tree that the
local backend reads as its own."""

from __future__ import annotations

import io
import json
import re
import tarfile
from pathlib import Path

import boto3
import pytest

from pipeline.backends.sagemaker import SageMakerBackend
from pipeline.config import load_settings
from pipeline.jobs import JOB_NAME_RE, job_name
from pipeline.paths import ExperimentTree
from pipeline.sources import Sources
from pipeline.stages import build_jobs
from pipeline.store import S3Store, download_dir, is_complete, read_manifest
from steps.runtime.names import ENTRYPOINT
from tests.conftest import write_settings

ROLE = "arn:aws:iam::123456789012:role/smpipe"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/smpipe:latest"
TOOLKIT_KEYS = ("sagemaker_program", "sagemaker_submit_directory", "sagemaker_region")


def sagemaker_settings(tmp_path, bucket, **overrides):
    path = write_settings(
        tmp_path / "settings.ini", f"s3://{bucket}/root",
        experiment={"BACKEND": "sagemaker", "ROLE_ARN": ROLE, "IMAGE_URI": IMAGE, **overrides.pop("experiment", {})},
        training={"USE_SPOT": "true", "USE_DISTRIBUTED": "true", "PROCESSES_PER_HOST": "1", "INSTANCE_COUNT": "2",
                  "INSTANCE_TYPE": "ml.g5.12xlarge", "EPOCHS": "1", **overrides.pop("training", {})},
        **overrides,
    )  # fmt: skip
    return load_settings(path, env={})


def jobs_of(settings, run_num=1):
    tree = ExperimentTree(settings.experiment.name)
    run = tree.run(run_num)
    sources = Sources(raw=tree.raw)
    return run, build_jobs(settings, ["reconcile", "prepare", "train", "inference"], run, sources)


@pytest.fixture
def sent(aws_env):
    """Every request body the SageMaker client sends, as it goes over the wire."""
    client = boto3.client("sagemaker")
    bodies: list[tuple[str, dict]] = []
    client.meta.events.register(
        "before-send.sagemaker",
        lambda request, **_: bodies.append(
            (request.headers["X-Amz-Target"].decode().split(".")[-1], json.loads(request.body))
        ),
    )
    return client, bodies


def backend_for(settings, store, run, client):
    return SageMakerBackend(store, run, client=client, logs_client=boto3.client("logs"), image_uri=IMAGE,
                            role_arn=ROLE, echo=io.StringIO(), poll_seconds=0.01)  # fmt: skip


def test_every_job_becomes_a_request_sagemaker_accepts(tmp_path, bucket, sent):
    client, bodies = sent
    settings = sagemaker_settings(tmp_path, bucket, tracking={"WANDB_SECRET_ID": "smpipe/wandb"})
    store = S3Store(settings.store_uri())
    run, jobs = jobs_of(settings)
    backend = backend_for(settings, store, run, client)
    for job in jobs:
        request = backend.request(job)
        {"processing": client.create_processing_job, "training": client.create_training_job,
         "tuning": client.create_hyper_parameter_tuning_job}[job.kind](**request)  # fmt: skip
    kinds = [target for target, _ in bodies]
    assert kinds == ["CreateProcessingJob"] * 2 + ["CreateTrainingJob"] * 2 + [
        "CreateProcessingJob"
    ]

    reconcile, prepare, minilm, bow, inference = [body for _, body in bodies]
    code = store.uri_of(run.code)
    for body in (reconcile, prepare, inference):
        app = body["AppSpecification"]
        assert app["ContainerEntrypoint"] == ENTRYPOINT and app["ImageUri"] == IMAGE
        assert app["ContainerArguments"][0] == "process"
        inputs = {i["InputName"]: i["S3Input"] for i in body["ProcessingInputs"]}
        assert inputs["code"]["S3Uri"] == code
        assert inputs["code"]["LocalPath"] == "/opt/ml/processing/input/code"
        assert body["Environment"]["SMPIPE_WANDB_SECRET_ID"] == "smpipe/wandb"
    assert reconcile["AppSpecification"]["ContainerArguments"] == ["process", "reconcile"]
    # Inference reads every model from one input: any number of models fits SageMaker's 10.
    names = {i["InputName"] for i in inference["ProcessingInputs"]}
    assert names == {"code", "test", "labels", "models"}

    assert minilm["AlgorithmSpecification"] == {
        "TrainingImage": IMAGE, "TrainingInputMode": "File",
        "MetricDefinitions": [{"Name": k, "Regex": v} for k, v in settings.metric_definitions.items()],
    }  # fmt: skip
    channels = {
        c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"]
        for c in minilm["InputDataConfig"]
    }
    assert channels["code"] == code and set(channels) == {"code", "train", "validation", "labels"}
    assert minilm["ResourceConfig"]["InstanceCount"] == 2
    assert minilm["Environment"]["SMPIPE_PROCESSES_PER_HOST"] == "1"
    assert minilm["Environment"]["SMPIPE_STEP"] == "train"
    assert minilm["EnableManagedSpotTraining"] is True
    stopping = minilm["StoppingCondition"]
    assert stopping["MaxWaitTimeInSeconds"] >= stopping["MaxRuntimeInSeconds"]
    assert minilm["CheckpointConfig"] == {"S3Uri": store.uri_of(run.checkpoints("minilm")),
                                          "LocalPath": "/opt/ml/checkpoints"}  # fmt: skip
    assert minilm["OutputDataConfig"]["S3OutputPath"].startswith(store.uri_of(run.prefix))
    assert minilm["HyperParameters"]["model_name"] == "minilm"
    assert not set(TOOLKIT_KEYS) & set(minilm["HyperParameters"])
    # Everything a job reads or writes lies in the run's tree (or the experiment's data).
    for _, body in bodies:
        text = json.dumps(body)
        for uri in [w for w in text.split('"') if w.startswith("s3://")]:
            assert uri.startswith(store.uri_of("test-exp/")), uri


def test_tuning_request(tmp_path, bucket, sent):
    client, bodies = sent
    settings = sagemaker_settings(tmp_path, bucket, experiment={"JOB": "tune"})
    store = S3Store(settings.store_uri())
    run, jobs = jobs_of(settings)
    tuning = [j for j in jobs if j.kind == "tuning"]
    assert len(tuning) == 2
    backend = backend_for(settings, store, run, client)
    client.create_hyper_parameter_tuning_job(**backend.request(tuning[0]))
    target, body = bodies[-1]
    assert target == "CreateHyperParameterTuningJob"
    name = body["HyperParameterTuningJobName"]
    assert len(name) <= 32 and "minilm" in name and "tune" in name
    config = body["HyperParameterTuningJobConfig"]
    assert config["Strategy"] == "Bayesian"
    assert config["HyperParameterTuningJobObjective"] == {
        "Type": "Maximize",
        "MetricName": "validation:f1",
    }
    assert config["ResourceLimits"] == {"MaxParallelTrainingJobs": 2, "MaxNumberOfTrainingJobs": 4}
    assert config["TrainingJobEarlyStoppingType"] == "Auto"  # [tuning] EARLY_STOPPING
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
    definition = body["TrainingJobDefinition"]
    static = definition["StaticHyperParameters"]
    assert (
        "learning_rate" not in static
        and "batch_size" not in static
        and static["exports"] == "none"  # a trial writes no program
    )
    assert not set(TOOLKIT_KEYS) & set(static)
    # Every trial gets the code, and checkpoints in a folder of its own.
    assert "code" in {c["ChannelName"] for c in definition["InputDataConfig"]}
    assert definition["Environment"]["SMPIPE_CHECKPOINT_PER_TRIAL"] == "1"


@pytest.mark.parametrize("length", [62, 63, 64, 120])
def test_job_names_are_valid_and_traceable_at_the_limits(length):
    experiment = ("e" * (length - 1) + "x")[:length]
    for parts in [
        ("0001", "reconcile"),
        ("0001", "train", "minilm"),
        ("0001", "tune", "my-model", "007"),
    ]:
        name = job_name(experiment, *parts)
        assert JOB_NAME_RE.match(name) and len(name) <= 63, name
        for part in parts:
            assert part in name, (part, name)
    tuning = job_name(experiment, "0001", "tune", "my_long-model-name", limit=32)
    assert len(tuning) <= 32 and JOB_NAME_RE.match(tuning)
    assert "0001-tune" in tuning and "my" in tuning
    # SageMaker names each trial <tuning job>-NNN-<8 hex>: still a valid training job name.
    assert JOB_NAME_RE.match(f"{tuning}-001-0123abcd")


def test_model_names_with_dashes_and_ten_models(tmp_path, bucket, sent):
    client, bodies = sent
    models = [f"model-{i}" for i in range(10)]
    settings = sagemaker_settings(tmp_path, bucket, models={"MODEL_NAMES": ",".join(models)})
    store = S3Store(settings.store_uri())
    run, jobs = jobs_of(settings)
    backend = backend_for(settings, store, run, client)
    for job in jobs:
        if job.kind == "training":
            client.create_training_job(**backend.request(job))
        else:
            client.create_processing_job(**backend.request(job))
    assert len([t for t, _ in bodies if t == "CreateTrainingJob"]) == 10
    for _, body in bodies:
        assert all(key.replace("_", "a").isalnum() for key in body.get("Environment", {})), body
        name = body.get("TrainingJobName") or body["ProcessingJobName"]
        assert JOB_NAME_RE.match(name)
    trained = {b["HyperParameters"]["model_name"] for t, b in bodies if t == "CreateTrainingJob"}
    assert trained == set(models)


def test_model_names_that_meet_as_environment_keys_are_refused(tmp_path, bucket):
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match="differ only in case, '-' and '_'"):
        sagemaker_settings(tmp_path, bucket, models={"MODEL_NAMES": "my-model,my_model"})
    with pytest.raises(
        ConfigError, match=r"differ only in case, '-' and '_': \[\['bert', 'BERT'\]\]"
    ):
        sagemaker_settings(tmp_path, bucket, models={"MODEL_NAMES": "bert,BERT"})
    # In job names a trailing '-' goes: "0" and "0-" would name one job (found by Hypothesis).
    with pytest.raises(ConfigError, match=r"differ only in case, '-' and '_': \[\['0', '0-'\]\]"):
        sagemaker_settings(tmp_path, bucket, models={"MODEL_NAMES": "0,0-"})
    with pytest.raises(ConfigError, match="MAX_WAIT_SECONDS .* must be at least MAX_RUN_SECONDS"):
        sagemaker_settings(
            tmp_path, bucket, training={"MAX_RUN_SECONDS": "7200", "MAX_WAIT_SECONDS": "3600"}
        )


def tarball(files: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return buf.getvalue()


def test_outputs_adopted_from_sagemaker_are_read_like_local_ones(tmp_path, bucket, sent):
    """moto completes a job at once and runs nothing: what the container would write is
    written here as the job is created; the backend's adoption does the rest."""
    client, _ = sent
    settings = sagemaker_settings(tmp_path, bucket)
    store = S3Store(settings.store_uri())
    run, jobs = jobs_of(settings)
    reconcile, training = jobs[0], jobs[2]
    store.put_bytes(reconcile.outputs["snapshot"] + "dataset/data.arrow", b"rows")
    store.put_bytes(reconcile.outputs["report"] + "step_metadata.json", b"{}")

    def container_writes_model(http_response, parsed, **_):
        name = parsed["TrainingJobArn"].rsplit("/", 1)[-1]
        base = f"{training.sagemaker_output}{name}/output/"
        store.put_bytes(
            base + "model.tar.gz", tarball({"model.torchscript.pt": b"ts", "sub/a.json": b"{}"})
        )
        # wandb's offline run folder links its debug log to an absolute container path.
        output = tarball(
            {"step_metadata.json": b'{"best_epoch": 1}'},
            links={"wandb/run/logs/debug-core.log": "/root/.cache/wandb/logs/core-debug.log"},
        )
        store.put_bytes(base + "output.tar.gz", output)

    client.meta.events.register("after-call.sagemaker.CreateTrainingJob", container_writes_model)
    backend = backend_for(settings, store, run, client)
    assert backend.run_processing(reconcile).status == "Completed"
    result = backend.run_training(training)
    assert result.status == "Completed", result.failure_reason
    for prefix in (reconcile.outputs["snapshot"], training.model_prefix, training.output_prefix):
        manifest = read_manifest(store, prefix)
        assert all(len(entry["sha256"]) == 64 for entry in manifest["files"].values())
        download_dir(store, prefix, tmp_path / prefix)  # verified file by file, as local reads do
    assert (tmp_path / training.model_prefix / "sub/a.json").read_text() == "{}"
    assert json.loads(store.get_bytes(training.output_prefix + "step_metadata.json")) == {
        "best_epoch": 1
    }
    assert list(read_manifest(store, training.output_prefix)["files"]) == ["step_metadata.json"]
    # A processing job that completed but wrote nothing is a failure, and nothing is sealed.
    prepare = jobs[1]
    result = backend.run_processing(prepare)
    assert result.status == "Failed" and "wrote nothing to" in result.failure_reason
    assert not is_complete(store, prepare.outputs["train"])


def within(version: str, bounds: str) -> bool:
    """Whether `version` meets every clause of a range such as ">=2.4,<2.15" (numeric parts
    compared as numbers, as PEP 440 orders release versions)."""
    number = tuple(int(p) for p in version.split("."))
    compare = {">=": tuple.__ge__, "<": tuple.__lt__, "<=": tuple.__le__, ">": tuple.__gt__}
    clauses = [re.fullmatch(r"(>=|<=|<|>)([\d.]+)", c.strip()) for c in bounds.split(",")]
    return all(compare[c[1]](number, tuple(int(p) for p in c[2].split("."))) for c in clauses)


def test_dockerfile_is_dependencies_and_the_entrypoint_only():
    import tomllib

    from pipeline.player.environment import DOCKERFILE, dockerfile_instructions

    instructions = dockerfile_instructions()
    entrypoints = [args for kind, args in instructions if kind == "ENTRYPOINT"]
    assert [json.loads(e) for e in entrypoints] == [
        ENTRYPOINT
    ]  # exec form: PID 1 is the entrypoint
    copies = [args.split() for kind, args in instructions if kind in ("COPY", "ADD")]
    lock = "requirements.lock"
    assert copies == [[lock, f"/tmp/smpipe/{lock}"], [lock, f"/etc/smpipe/{lock}"]], copies
    # No code to shadow: the lock is all the build sees of the project (its .dockerignore).
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()
    assert [line for line in ignore if not line.startswith("#")] == ["*", f"!{lock}"]
    # Exactly the lock's versions and hashes, nothing else (tests/test_lock.py: the lock holds
    # what pyproject.toml asks for).
    run = " ".join(args for kind, args in instructions if kind == "RUN")
    assert f"pip install --no-deps --require-hashes -r /tmp/smpipe/{lock}" in run
    project = tomllib.loads((DOCKERFILE.parent.parent / "pyproject.toml").read_text())["project"]
    # The base image's torch is within the project's range, so pip keeps it (docs/sagemaker.md,
    # "The image"): the image's tag names its version.
    base = dict(a.split("=", 1) for kind, a in instructions if kind == "ARG" and "=" in a)["BASE"]
    version = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-.*", base)[1]
    (torch,) = [d for d in project["dependencies"] if re.match(r"torch[<>=]", d)]
    assert within(version, torch.removeprefix("torch")), (version, torch)
    # Where the image looks for code is where both job kinds get it.
    env = dict(
        a.split("=", 1) for kind, args in instructions if kind == "ENV" for a in args.split()
    )
    assert env["PYTHONPATH"].split(":") == [
        "/opt/ml/input/data/code",
        "/opt/ml/processing/input/code",
    ]
    assert Path("/opt/ml/processing/input/code").as_posix() in env["PYTHONPATH"]
