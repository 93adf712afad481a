"""What every backend shares: the protocol the driver holds them by, SageMaker's status words,
one reading of a container's exit as a job's status, one table of each kind's operations."""

from __future__ import annotations

import inspect

import boto3
import pytest
from botocore import xform_name

from pipeline.backend import Backend
from pipeline.backends.local import LocalBackend
from pipeline.backends.sagemaker import SageMakerBackend
from pipeline.jobs import KINDS
from pipeline.player.exits import ENDED, ContainerExit, status_after
from pipeline.service_model import service_model
from steps.runtime.names import EXIT_INTERRUPTED


@pytest.mark.parametrize("backend", [LocalBackend, SageMakerBackend])
def test_every_backend_answers_the_protocol(backend):
    """Each method of Backend is there and takes the protocol's arguments (extras have
    defaults: the local backend's run_training also takes a tuner's `watch`)."""
    methods = [
        name
        for name, member in vars(Backend).items()
        if inspect.isfunction(member) and not name.startswith("_")
    ]
    assert {"run_processing", "run_training", "run_tuning", "stop", "close", "say"} <= set(methods)
    for name in methods:
        wanted = list(inspect.signature(getattr(Backend, name)).parameters.values())
        given = list(inspect.signature(getattr(backend, name)).parameters.values())
        assert [p.name for p in given[: len(wanted)]] == [p.name for p in wanted], name
        assert all(p.default is not inspect.Parameter.empty for p in given[len(wanted) :]), name


def test_a_jobs_end_is_one_of_sagemakers_statuses():
    """botocore's service model: every status a JobResult carries is a value of each job
    kind's status enum; Interrupted is a SecondaryStatus (a spot job about to restart), not
    one of them."""
    model = service_model()
    for api in KINDS.values():
        status = model.operation_model(api.describe).output_shape.members[api.status_member]
        assert set(ENDED) <= set(status.enum), api.resource
        assert "Interrupted" not in status.enum
    assert "Interrupted" in model.shape_for("SecondaryStatus").enum


def test_each_kind_names_operations_and_members_sagemaker_has():
    model, client = service_model(), boto3.client("sagemaker", region_name="us-east-1")
    for api in KINDS.values():
        for operation in (api.create, api.describe, api.stop):
            assert operation in model.operation_names
            assert callable(getattr(client, xform_name(operation)))
            assert api.name_member in model.operation_model(operation).input_shape.members


def exit_(code: int, *, interrupted=False, reason=None, timed_out=False, start=0.0, end=5.0):
    return ContainerExit(code, interrupted, reason, start, end, None, timed_out=timed_out)


INTERRUPTED = exit_(EXIT_INTERRUPTED, interrupted=True)
RAN_OUT = "MaxRuntimeExceeded: the job was stopped after 3 s, its MaxRuntimeInSeconds"
WAITED = "MaxWaitTimeExceeded: the job lost its spot capacity and its MaxWaitTimeInSeconds ran out"
NOT_RESTARTED = "exit status 75: it was interrupted, saved a checkpoint and was not restarted"
UNREADABLE = "ClientError: input 'train' cannot be read"
# A container killed by a signal no stop sent: who did, as far as the run can tell.
KILLED_15 = (
    "killed by SIGTERM, which neither the job's stop nor its limits sent: something outside the "
    "run stopped it (`docker stop` or `kill` on its container or process)"
)
KILLED_9 = KILLED_15.replace("SIGTERM", "SIGKILL").replace(
    "process)", "process, or the kernel's out-of-memory killer)"
)


@pytest.mark.parametrize(
    "exits,stop_requested,capacity_lost,expected",
    [
        ([exit_(0), exit_(0)], False, False, ("Completed", None)),
        # Asked to stop, a job is Stopped whatever its containers exit with ("After SageMaker
        # stops the job, it sets the status to Stopped": StopTrainingJob); and so at its limit.
        ([exit_(0)], True, False, ("Stopped", None)),
        ([exit_(0, timed_out=True, end=3.2)], False, False, ("Stopped", RAN_OUT)),
        ([exit_(1, reason="train: no")], False, False, ("Failed", "train: no")),
        ([exit_(0), exit_(-9)], False, False, ("Failed", f"exit status -9: {KILLED_9}")),
        ([exit_(143)], False, False, ("Failed", f"exit status 143: {KILLED_15}")),
        ([INTERRUPTED], True, False, ("Stopped", None)),  # Stop*, the driver, a pruned trial
        ([INTERRUPTED], False, True, ("Stopped", WAITED)),
        ([exit_(143, timed_out=True, end=3.2)], False, False, ("Stopped", RAN_OUT)),
        ([INTERRUPTED], False, False, ("Failed", NOT_RESTARTED)),
        ([ContainerExit.before_start(UNREADABLE)], False, False, ("Failed", UNREADABLE)),
    ],
)
def test_a_containers_exit_becomes_the_status_sagemaker_reports(
    exits, stop_requested, capacity_lost, expected
):
    """One reading for the local and the emulated backends (which once said Interrupted and
    Failed for the same exit): DescribeTrainingJob's TrainingJobStatus and SecondaryStatus."""
    assert status_after(exits, stop_requested=stop_requested, capacity_lost=capacity_lost) == (
        expected
    )
