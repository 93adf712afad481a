"""The backend [experiment] BACKEND names, built for one run, and the image and role its
requests name. The backends are imported where they are chosen: sagemaker's needs boto3's
clients, emulated's moto (an optional dependency), and a run uses one."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.backends import Backend
    from pipeline.config import Settings
    from pipeline.paths import RunTree
    from pipeline.store import Store


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
