"""Where jobs run: the backends, and the one protocol the driver holds them by.

    local.py         every job played on this machine, against the store directly
    local_tuning.py  the local backend's tuning jobs: Optuna's study, its trials local jobs
    sagemaker.py     every job sent to SageMaker, followed and adopted into the run tree
    emulated.py      the SageMaker backend talking to an embedded moto, which plays its jobs
    container.py     what the local and emulated backends share: a job root laid out from the
                     request, the image's entrypoint started in it, its exit read as a status

Every backend runs the very requests pipeline/jobs.py builds (`request_for`, one per kind:
jobs.KINDS), and reports each job as a jobs.JobResult whose status is SageMaker's word for
how it ended (jobs.Status: Completed, Failed or Stopped).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pipeline.config import Settings
    from pipeline.jobs import JobResult, ProcessingJob, TrainingJob, TuningJob
    from pipeline.paths import RunTree
    from pipeline.store import Store


class Backend(Protocol):
    """What the driver asks of a backend. Each run_* call blocks until its job has ended and
    returns how it ended; a job that fails is a result, not an exception. An exception (Ctrl-C
    included) means the driver is stopping: it calls `stop()`, then `close(succeeded=False)`."""

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


def identity(settings: Settings) -> tuple[str, str]:
    """The image and role a backend's requests name: the settings' on sagemaker, stand-ins
    where nothing is sent to AWS (a local backend's requests are played here; emulated ones go
    to moto)."""
    from pipeline.backends.emulated import EMULATED_IMAGE, EMULATED_ROLE
    from pipeline.backends.local import LOCAL_IMAGE, LOCAL_ROLE

    e = settings.experiment
    if e.backend == "local":
        return LOCAL_IMAGE, LOCAL_ROLE
    if e.backend == "emulated":
        return e.image_uri or EMULATED_IMAGE, e.role_arn or EMULATED_ROLE
    return e.image_uri, e.role_arn


def make_backend(settings: Settings, store: Store, run: RunTree, echo) -> Backend:
    """The backend [experiment] BACKEND names, for one run; `echo` is where it speaks."""
    backend = settings.experiment.backend
    if backend == "local":
        from pipeline.backends.local import LocalBackend

        return LocalBackend(store, run, echo=echo)
    if backend == "emulated":
        from pipeline.backends.emulated import emulated_backend

        return emulated_backend(settings, store, run, echo)
    import boto3

    from pipeline.backends.sagemaker import SageMakerBackend
    from pipeline.store import aws_config

    session = boto3.Session(region_name=settings.experiment.region)
    clients = {name: session.client(name, config=aws_config()) for name in ("sagemaker", "logs")}
    image, role = identity(settings)
    return SageMakerBackend(
        store,
        run,
        client=clients["sagemaker"],
        logs_client=clients["logs"],
        image_uri=image,
        role_arn=role,
        echo=echo,
    )
