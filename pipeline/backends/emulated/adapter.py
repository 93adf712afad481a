"""BACKEND = emulated, as the driver holds it: the SageMaker backend, its requests sent to the
emulated account's moto and its jobs played by the `Emulator`.
"""

from __future__ import annotations

import os

from pipeline.backend import Earlier
from pipeline.backends.emulated.control_plane import Emulator
from pipeline.backends.sagemaker import SageMakerBackend
from pipeline.jobs import JobResult, ProcessingJob, TrainingJob, TuningJob
from pipeline.paths import RunTree
from pipeline.store import Store


class EmulatedBackend:
    """BACKEND = emulated, as the driver holds it: the SageMaker backend (`sagemaker`), its
    requests sent to moto, and the Emulator that plays them (`emulator`: tests take a spot
    instance back through it); closing it closes both. `client` is the SageMaker client the
    backend calls, for hooks on its calls."""

    def __init__(self, sagemaker: SageMakerBackend, emulator: Emulator) -> None:
        self.sagemaker, self.emulator = sagemaker, emulator
        self.client = sagemaker.client
        ref = emulator.image_ref  # jobs played as processes: none
        self.image_record = ref.record() if ref else None

    def run_processing(self, job: ProcessingJob) -> JobResult:
        return self.sagemaker.run_processing(job)

    def run_training(self, job: TrainingJob) -> JobResult:
        return self.sagemaker.run_training(job)

    def run_tuning(self, job: TuningJob) -> JobResult:
        return self.sagemaker.run_tuning(job)

    def resumed(self, earlier: Earlier) -> list[dict]:
        return self.sagemaker.resumed(earlier)

    @property
    def unbilled(self) -> list[dict]:
        return self.sagemaker.unbilled

    def stop(self) -> None:
        self.sagemaker.stop()

    def close(self, succeeded: bool) -> None:
        self.sagemaker.close(succeeded)
        self.emulator.close()

    def say(self, job_name: str, text: str) -> None:
        self.sagemaker.say(job_name, text)


def emulated_backend(settings, store: Store, run: RunTree, echo=None) -> EmulatedBackend:
    """The SageMaker backend, its requests sent to moto and its jobs played by an Emulator."""
    emulator = Emulator(
        store,
        settings.experiment.region,
        image=settings.emulated.image,
        engine=settings.emulated.engine,
    )
    for secret_id, key in (
        (settings.tracking.wandb_secret_id, "WANDB_API_KEY"),
        (settings.hub.token_secret_id, "HF_TOKEN"),
    ):
        if secret_id and os.environ.get(key):
            # The secret the jobs would read on AWS, made from this machine's key: the jobs
            # themselves never see this machine's environment.
            emulator.account.put_secret(secret_id, os.environ[key])
    sagemaker = emulator.backend(
        run, settings.experiment.image_uri, settings.experiment.role_arn, echo
    )
    return EmulatedBackend(sagemaker, emulator)
