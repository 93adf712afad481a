"""A create whose answer is lost (pipeline/backends/lost_create.py `ours_after_all`).

SageMaker's Create* calls take no client token and botocore retries a call whose connection
dropped: SageMaker carries out the first attempt, its answer never arrives, the retry is
refused with ResourceInUse. The job runs and bills all the same, so it is adopted and
followed when Describe shows this very request, and refused, saying why, when it does not.

Played against moto's server through botocore's own retries: the first attempt reaches moto
(the job is made) and its answer is replaced by a dropped connection; the retry is answered
ResourceInUse, as SageMaker answers it (moto would overwrite the job)."""

from __future__ import annotations

import io
import json
import tarfile
import uuid

import boto3
import pytest
from botocore.awsrequest import AWSResponse
from botocore.config import Config
from botocore.exceptions import (
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
)
from botocore.httpsession import URLLib3Session

from pipeline.backends.sagemaker import SageMakerBackend
from pipeline.config import load_settings
from pipeline.paths import ExperimentTree
from pipeline.sources import Sources
from pipeline.stages import build_jobs
from pipeline.store import S3Store, aws_config
from tests.conftest import write_settings

ROLE = "arn:aws:iam::123456789012:role/smpipe"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/smpipe:latest"


class Body:
    def __init__(self, data: bytes):
        self.data = data

    def stream(self, **_):
        yield self.data


def resource_in_use(request, name: str) -> AWSResponse:
    """SageMaker's answer to a name used before (API_CreateTrainingJob.html, Errors)."""
    body = json.dumps(
        {
            "__type": "ResourceInUse",
            "message": "Training job names must be unique within an AWS account and region, "
            f"and a training job with this name already exists ({name})",
        }
    ).encode()
    return AWSResponse(request.url, 400, {"x-amzn-RequestId": "lost-answer"}, Body(body))


class LostAnswer:
    """The wire for CreateTrainingJob: `carried_out` says whether the first attempt reaches
    SageMaker; every attempt after it is answered ResourceInUse."""

    def __init__(self, carried_out: bool, always_drop: bool = False):
        self.carried_out, self.always_drop, self.attempts = carried_out, always_drop, 0

    def __call__(self, request, **_):
        self.attempts += 1
        if self.attempts == 1 or self.always_drop:
            if self.carried_out and self.attempts == 1:
                URLLib3Session().send(request)  # moto makes the job; the answer is dropped
            raise ConnectionClosedError(endpoint_url=request.url)
        name = json.loads(request.body)["TrainingJobName"]
        return resource_in_use(request, name)


@pytest.fixture
def training(tmp_path, bucket):
    path = write_settings(
        tmp_path / "settings.ini",
        f"s3://{bucket}/root",
        # A name of its own: SageMaker's (moto's) job names are the account's, and another
        # test on this worker may have made a job of the shared experiment's name.
        experiment={
            "BACKEND": "sagemaker",
            "ROLE_ARN": ROLE,
            "IMAGE_URI": IMAGE,
            "NAME": f"lost-{uuid.uuid4().hex[:8]}",
        },
        training={"INSTANCE_TYPE": "ml.g5.xlarge", "KEEP_ALIVE_SECONDS": "0"},
    )
    settings = load_settings(path, env={})
    store = S3Store(settings.store_uri())
    tree = ExperimentTree(settings.experiment.name)
    run = tree.run(1)
    steps = ["reconcile", "prepare", "train", "inference"]
    job = next(
        j for j in build_jobs(settings, steps, run, Sources(raw=tree.raw)) if j.kind == "training"
    )
    return store, run, job


def backend(store, run, wire, config=None) -> tuple[SageMakerBackend, io.StringIO]:
    """The backend on a client that retries as the driver's do (aws_config), on `wire`."""
    client = boto3.client("sagemaker", config=config or aws_config())
    client.meta.events.register("before-send.sagemaker.CreateTrainingJob", wire)
    echo = io.StringIO()
    made = SageMakerBackend(
        store,
        run,
        client=client,
        logs_client=boto3.client("logs"),
        image_uri=IMAGE,
        role_arn=ROLE,
        echo=echo,
        poll_seconds=0.01,
    )
    return made, echo


def model_archive(store, job) -> None:
    """What the container leaves where SageMaker puts it (moto completes a job at once)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("model.safetensors")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"bytes"))
    store.put_bytes(f"{job.sagemaker_output}{job.name}/output/model.tar.gz", buffer.getvalue())


def test_a_create_whose_answer_was_lost_is_adopted_and_followed(training):
    store, run, job = training
    model_archive(store, job)
    wire = LostAnswer(carried_out=True)
    sagemaker, echo = backend(store, run, wire)
    result = sagemaker.run_training(job)
    assert wire.attempts == 2  # botocore retried the create itself
    assert result.status == "Completed", result.failure_reason
    assert (
        "its retry was refused; DescribeTrainingJob shows this very request: adopted"
        in echo.getvalue()
    )
    assert result.billing and result.billing[0]["job"] == job.name  # what it bills is counted
    assert store.exists(job.model_prefix + "model.safetensors")


def request_of(store, run, job) -> dict:
    """The request the backend sends for `job`."""
    made = SageMakerBackend(
        store, run, client=None, logs_client=None, image_uri=IMAGE, role_arn=ROLE
    )
    return made.request(job)


def created_before(store, run, job, **changes) -> None:
    """A job of `job`'s name made before this call, from its request with `changes`."""
    boto3.client("sagemaker").create_training_job(**(request_of(store, run, job) | changes))


def test_a_job_of_that_name_that_is_not_this_request_is_refused_saying_why(training):
    """The first attempt is lost before SageMaker saw it; its retry meets another's job."""
    store, run, job = training
    channels = request_of(store, run, job)["InputDataConfig"]
    channels[1]["DataSource"]["S3DataSource"]["S3Uri"] = "s3://elsewhere/train/"
    created_before(
        store,
        run,
        job,
        RoleArn="arn:aws:iam::123456789012:role/someone-else",
        InputDataConfig=channels,
    )
    wire = LostAnswer(carried_out=False)
    sagemaker, echo = backend(store, run, wire)
    result = sagemaker.run_training(job)
    assert wire.attempts == 2
    assert result.status == "Failed"
    reason = result.failure_reason
    assert "SageMaker refused the job" in reason and "ResourceInUse" in reason
    assert f"the training job {job.name} that exists is not this request" in reason
    assert 'RoleArn is "arn:aws:iam::123456789012:role/someone-else"' in reason
    assert "InputDataConfig is" in reason
    assert "adopted" not in echo.getvalue()


def test_a_create_that_never_arrived_is_refused(training):
    store, run, job = training
    wire = LostAnswer(carried_out=False, always_drop=True)
    two = Config(retries={"total_max_attempts": 2, "mode": "standard"})
    sagemaker, _ = backend(store, run, wire, two)
    result = sagemaker.run_training(job)
    assert wire.attempts == 2
    assert result.status == "Failed" and "SageMaker refused the job" in result.failure_reason
    assert "not this request" not in result.failure_reason


def test_a_name_taken_before_this_call_is_refused_even_by_the_same_request(training):
    """ResourceInUse to the first attempt (botocore's RetryAttempts 0): whatever holds the
    name was there before this call, so it is not this call's job, however alike."""
    store, run, job = training
    created_before(store, run, job)
    wire = LostAnswer(carried_out=False)
    wire.attempts = 1  # every attempt from the first is answered ResourceInUse
    sagemaker, echo = backend(store, run, wire)
    result = sagemaker.run_training(job)
    assert wire.attempts == 2  # one attempt: ResourceInUse is not retried
    assert result.status == "Failed" and "ResourceInUse" in result.failure_reason
    assert "adopted" not in echo.getvalue()


def error_answer(request, status: int, code: str) -> AWSResponse:
    """SageMaker's JSON error answer (awsJson1_1: `__type` and `message`)."""
    body = json.dumps({"__type": code, "message": f"{code} (played)"}).encode()
    return AWSResponse(request.url, status, {"x-amzn-RequestId": "played"}, Body(body))


class TimedOutThen:
    """The wire for CreateTrainingJob: the first attempt reaches SageMaker (the job is made)
    and its answer times out; every attempt after it ends in `then` (an exception to raise,
    or an error answer's status and code)."""

    def __init__(self, then):
        self.then, self.attempts = then, 0

    def __call__(self, request, **_):
        self.attempts += 1
        if self.attempts == 1:
            URLLib3Session().send(request)
            raise ReadTimeoutError(endpoint_url=request.url)
        if isinstance(self.then, Exception):
            raise self.then
        return error_answer(request, *self.then)


TWO_ATTEMPTS = Config(retries={"total_max_attempts": 2, "mode": "standard"})


@pytest.mark.parametrize(
    "then",
    [
        EndpointConnectionError(endpoint_url="https://sagemaker.us-east-1.amazonaws.com"),
        ConnectTimeoutError(endpoint_url="https://sagemaker.us-east-1.amazonaws.com"),
        (503, "ServiceUnavailable"),
        (500, "InternalFailure"),
        (400, "ThrottlingException"),
    ],
    ids=["endpoint-connection", "connect-timeout", "503", "500", "throttling"],
)
def test_a_timed_out_create_whose_retry_ended_otherwise_is_adopted(training, then):
    """botocore retries a timed-out create and the retry meets a dropped connection, a 5xx or
    throttling instead of ResourceInUse: the job SageMaker made of the first attempt runs all
    the same, and is found by Describe and followed."""
    store, run, job = training
    model_archive(store, job)
    wire = TimedOutThen(then)
    sagemaker, echo = backend(store, run, wire, TWO_ATTEMPTS)
    result = sagemaker.run_training(job)
    assert wire.attempts == 2
    assert result.status == "Completed", result.failure_reason
    assert (
        "its answer was lost; DescribeTrainingJob shows this very request: adopted"
        in echo.getvalue()
    )


def test_a_create_that_never_connected_is_still_described(training):
    """An EndpointConnectionError to the only attempt: nothing was sent, and a Describe (one
    call) finds no job, so the job is refused as SageMaker never saw it."""
    store, run, job = training
    described = []
    wire = TimedOutThen(None)
    wire.attempts = 1  # no attempt reaches SageMaker
    wire.then = EndpointConnectionError(endpoint_url="https://sagemaker.us-east-1.amazonaws.com")
    one = Config(retries={"total_max_attempts": 1, "mode": "standard"})
    sagemaker, _ = backend(store, run, wire, one)
    sagemaker.client.meta.events.register(
        "before-call.sagemaker.DescribeTrainingJob", lambda **_: described.append(1)
    )
    result = sagemaker.run_training(job)
    assert described, "the create was not checked with a Describe"
    assert result.status == "Failed" and "SageMaker refused the job" in result.failure_reason
    assert "could not be read" not in result.failure_reason


def test_a_describe_that_cannot_be_read_leaves_the_question_open(training):
    """The Describe after a lost create is throttled: that is no evidence the job was not
    made, so the reason says how to look it up instead of calling it refused outright."""
    store, run, job = training
    wire = LostAnswer(carried_out=True)
    sagemaker, _ = backend(store, run, wire, TWO_ATTEMPTS)
    sagemaker.client.meta.events.register(
        "before-send.sagemaker.DescribeTrainingJob",
        lambda request, **_: error_answer(request, 400, "ThrottlingException"),
    )
    result = sagemaker.run_training(job)
    assert result.status == "Failed"
    assert "whether SageMaker created it could not be read" in result.failure_reason
    assert f"aws sagemaker describe-training-job --training-job-name {job.name}" in (
        result.failure_reason
    )
