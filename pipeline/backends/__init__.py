"""Where jobs run: the backends, and the protocols their callers hold them by.

    choose.py        the backend [experiment] BACKEND names, built for one run
    local.py         every job played on this machine, against the store directly
    local_tuning.py  the local backend's tuning jobs: Optuna's study, its trials local jobs
    sagemaker.py     every job sent to SageMaker, followed and adopted into the run tree
    emulated.py      the SageMaker backend talking to an embedded moto, which plays its jobs
    emulated_search.py  the emulated SageMaker's search: a tuning request's trials drawn

What the local and emulated backends share, SageMaker's data plane played on this machine (job
roots, processes, exits read as a status), is pipeline/player/.

Every backend runs the very requests pipeline/jobs.py builds (`request_for`, one per kind:
jobs.KINDS), and reports each job as a jobs.JobResult whose status is SageMaker's word for
how it ended (jobs.Status: Completed, Failed or Stopped).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pipeline.jobs import JobResult, ProcessingJob, TrainingJob, TuningJob

# What sees each line a training job prints; True stops the job (a pruned trial).
Watch = Callable[[str], bool]


class Backend(Protocol):
    """What the driver asks of a backend. Each run_* call blocks until its job has ended and
    returns how it ended; a job that fails is a result, not an exception. An exception (Ctrl-C
    included) means the driver is stopping: it calls `stop()`, then `close(succeeded=False)`."""

    # SageMaker's client, for the run's requests that are no job (registering its winner:
    # pipeline/registry.py); moto's when emulated, None where nothing is sent to SageMaker.
    client: object | None
    # The image the run's jobs run in, as its Metadata records it (pipeline/metadata.py
    # `image`): name, id, digest and lock where the backend resolved it before the first job
    # (the emulated backend's image), the request's image on sagemaker, None for processes.
    image_record: dict | None

    def run_processing(self, job: ProcessingJob) -> JobResult:
        """Run a processing job; its outputs land at job.outputs, each sealed with a manifest."""
        ...

    def run_training(self, job: TrainingJob) -> JobResult:
        """Run a training job; its model and output land at job.model_prefix and
        job.output_prefix, checkpoints synced with job.checkpoint_prefix."""
        ...

    def run_tuning(self, job: TuningJob) -> JobResult:
        """Run a tuning job; the best trial's model lands where job.trial's would, and what the
        trials did is in the result's `details` and the run's tuning record."""
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
