"""The backend [experiment] BACKEND names, built for one run, the store as it sees it, and
what its hosts cannot run (said before any job starts). The backends are imported where they
are chosen: sagemaker's needs boto3's clients, emulated's moto (an optional dependency), and a
run uses one."""

from __future__ import annotations

import glob
import os
from typing import TYPE_CHECKING

from pipeline.backend import identity
from steps.runtime.names import CPU_BF16_CHOICES, CPU_BF16_VARIABLE, GPU_DEVICE_FILES

if TYPE_CHECKING:
    from pipeline.backend import Backend
    from pipeline.config import Settings
    from pipeline.paths import RunTree
    from pipeline.stages import Job
    from pipeline.store import Store


def host_gpus(settings: Settings) -> tuple[int, str] | None:
    """How many GPUs each host of the backend's jobs has, and where those hosts are; None on
    SageMaker, where the instance type decides and no table of those is kept here."""
    here = len(glob.glob(GPU_DEVICE_FILES))  # as the entrypoint counts them
    e = settings.experiment
    if e.backend == "local":
        return here, "the local backend runs its jobs on this machine"
    if e.backend == "emulated" and settings.emulated.image:
        # The engine is given no GPU (images.py passes no device): docs/sagemaker.md.
        return 0, f"the emulated backend runs its jobs in containers of {settings.emulated.image}"
    if e.backend == "emulated":
        return here, "the emulated backend plays its jobs as processes of this machine"
    return None


def hosts_refuse(settings: Settings, jobs: list[Job]) -> list[str]:
    """What the planned jobs ask of their hosts that those hosts cannot do, before any job
    starts: fp16 without a GPU, or an SMPIPE_CPU_BF16 this machine's jobs are given (the
    players pass it on: pipeline/player/environment.py) that is not one of its words; each of
    which the training job itself refuses (steps/precision.py), but only after reconcile and
    prepare have run."""
    from pipeline.jobs import TrainingJob, TuningJob

    hosts = host_gpus(settings)
    if hosts is None:
        return []
    problems = []
    forced = os.environ.get(CPU_BF16_VARIABLE, "")
    if forced and forced not in CPU_BF16_CHOICES:
        problems.append(
            f"{CPU_BF16_VARIABLE}={forced!r} in the environment: use "
            f"{' or '.join(CPU_BF16_CHOICES)}, or unset it ({hosts[1]}, with this variable)"
        )
    if hosts[0] > 0:
        return problems
    for job in jobs:
        trial = job.trial if isinstance(job, TuningJob) else job
        if not isinstance(trial, TrainingJob):
            continue
        # A tuning job's trials all run with it: MIXED_PRECISION is not searched (its row in
        # steps/hyperparameters.py is not tunable), but a tuning section may set it.
        if trial.hyperparameters["mixed_precision"] == "fp16":
            problems.append(
                f"model {trial.hyperparameters['model_name']}: MIXED_PRECISION = fp16 needs a "
                f"GPU, and {hosts[1]}, which has none (auto, bf16 and no compute on a CPU)"
            )
    return problems


def open_backend_store(settings: Settings) -> Store:
    """The store as the backend sees it: STORE itself, or on the emulated backend the embedded
    S3 over it (never a real AWS endpoint), its image, engine and lock checked before a run is
    claimed."""
    if settings.experiment.backend != "emulated":
        from pipeline.store import open_store

        return open_store(settings.store_uri(), settings.experiment.region)
    from pipeline.backends.emulated import open_emulated_store
    from pipeline.code_bundle import PROJECT_ROOT
    from pipeline.config import ConfigError
    from pipeline.player.images import ImageUnavailable, find_engine, resolve_image

    if settings.emulated.image:
        try:
            engine = find_engine(settings.emulated.engine)
            resolve_image(engine, settings.emulated.image, PROJECT_ROOT / "requirements.lock")
        except ImageUnavailable as e:
            raise ConfigError([str(e)], settings.source) from None
    return open_emulated_store(settings)


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
