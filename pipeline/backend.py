"""What a backend is, to the modules that hold one: the protocols the driver, its stages and a
local tuner hold a backend by, and the image and role its requests name.

It sits below the stages, the registry and the backends themselves (pipeline/backends/), and
imports none of them: a stage is handed its backend, and the registry the image it registers,
so no lower module asks the chooser above it (pipeline/backends/choose.py) for anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pipeline.interrupts import undisturbed

if TYPE_CHECKING:
    from pipeline.config import Settings
    from pipeline.jobs import JobResult, ProcessingJob, TrainingJob, TuningJob

# What the requests name as image and role where nothing is sent to AWS: the local backend's
# are played on this machine, the emulated one's sent to moto, which checks only their shape.
LOCAL_IMAGE = "local:docker/Dockerfile"
LOCAL_ROLE = "arn:aws:iam::000000000000:role/local"
EMULATED_IMAGE = "smpipe:emulated"
EMULATED_ROLE = "arn:aws:iam::123456789012:role/smpipe-emulated"

# What sees each line a training job prints; True stops the job (a pruned trial).
Watch = Callable[[str], bool]


@dataclass(frozen=True)
class Earlier:
    """What a resumed run's record says of the drivers before this one (`Backend.resumed`)."""

    started: float  # when the run started (its Metadata start_time): its jobs were made after
    unbilled: list[dict] = field(default_factory=list)  # stopped with their driver, bill unread
    counted: set[str] = field(default_factory=set)  # the jobs the run holds a bill of
    pools: set[str] = field(default_factory=set)  # the jobs whose warm pool's time it holds


def identity(settings: Settings) -> tuple[str, str]:
    """The image and role a backend's requests name: the settings' on sagemaker, stand-ins
    where nothing is sent to AWS."""
    e = settings.experiment
    if e.backend == "local":
        return LOCAL_IMAGE, LOCAL_ROLE
    if e.backend == "emulated":
        return e.image_uri or EMULATED_IMAGE, e.role_arn or EMULATED_ROLE
    return e.image_uri, e.role_arn


class Backend(Protocol):
    """What the driver asks of a backend. Each run_* call blocks until its job has ended and
    returns how it ended: a jobs.JobResult whose status is SageMaker's word for it
    (player/exits.py `Status`: Completed, Failed or Stopped). A job that fails is a result, not
    an exception; an exception (Ctrl-C included) means the driver is stopping: it calls
    `stop()`, then `close(succeeded=False)`."""

    # SageMaker's client, for the run's requests that are no job (registering its winner:
    # pipeline/registry/); moto's when emulated, None where nothing is sent to SageMaker.
    client: object | None
    # The image the run's jobs run in, as its Metadata records it (pipeline/metadata.py
    # `image`): name, id, digest and lock where the backend resolved it before the first job
    # (the emulated backend's image), the request's image on sagemaker, None for processes.
    image_record: dict | None
    # The jobs whose bill it could not read (kind and name each): stopped with the driver
    # before SageMaker said it, or not readable by a resume. Local jobs bill nothing: none
    # (what one stopped so used is not measured).
    unbilled: list[dict]

    def run_processing(self, job: ProcessingJob) -> JobResult:
        """Run a processing job; its outputs land at job.outputs, each sealed with a manifest."""
        ...

    def run_training(self, job: TrainingJob) -> JobResult:
        """Run a training job; its model and output land at job.model_prefix and
        job.output_prefix, checkpoints synced with job.checkpoint_prefix."""
        ...

    def run_tuning(self, job: TuningJob) -> JobResult:
        """Run a tuning job; the best trial's model lands where job.trial's would, and the
        result's `details` are its tuning record (pipeline/tuning_record.py: one shape on
        every backend), which the tune stage saves."""
        ...

    def resumed(self, earlier: Earlier) -> list[dict]:
        """The run was resumed (`--resume`): before its first job, what the driver before
        this one left running is stopped and waited for. Returns the billing records the run
        lacks that can now be read: the `earlier.unbilled` jobs' (Metadata's unbilled_jobs),
        and those of the run's jobs it holds no record of (`earlier.counted`:
        metadata.accounted_jobs), which ended while no driver followed them. Those that cannot
        be read stay in `unbilled`."""
        ...

    def stop(self) -> None:
        """Stop every job still running (each may checkpoint); safe from any thread."""
        ...

    def close(self, succeeded: bool) -> None:
        """The run is over: give back what the backend holds (its work folders, the emulator)."""
        ...

    def say(self, job_name: str, text: str) -> None:
        """One line about a job to the user's terminal (`[job name] text`), as its log lines are."""
        ...


class TrialRunner(Protocol):
    """What a tuner that plays a tuning job here (backends/local_tuning.py) asks of the backend
    its trials run on: each trial is a training job, watched line by line."""

    def run_training(self, job: TrainingJob, watch: Watch | None = None) -> JobResult:
        """Run a training job as Backend.run_training does; `watch(line)` sees every line it
        prints, and when it returns True the job is stopped (it checkpoints) and not
        restarted."""
        ...

    def stop(self) -> None:
        """Stop every job still running (the driver is stopping)."""
        ...

    def say(self, job_name: str, text: str) -> None:
        """One line about a job to the user's terminal."""
        ...


@contextmanager
def running_backend(backend: Backend) -> Iterator[Backend]:
    """A backend while its jobs run, a run's or a predict's: when what runs them raises (a job
    that failed, the store, Ctrl-C) its jobs are stopped, then it is closed as failed, and the
    exception goes on to say how it ended; closed as succeeded when nothing was raised."""
    try:
        yield backend
    except BaseException:
        with undisturbed():
            backend.stop()
            backend.close(succeeded=False)
        raise
    backend.close(succeeded=True)
