"""The model registry: each completed run's winning model, registered once.

With [registry] MODEL_PACKAGE_GROUP set, a run that tests its models ends with the register step
(`register`): its winner becomes one new version of the group, in the registry its backend keeps
(`registry_for`, behind protocol.py `Registry`): packages.py on sagemaker and emulated (a
SageMaker model package), records.py locally (a record in the store). `versions` and `set_status`
are `smpipe registry` and `smpipe approve`.
"""

from __future__ import annotations

import uuid

from pipeline import metadata as md
from pipeline.config import ConfigError, Settings
from pipeline.errors import RESULT, PipelineError, Refused, log
from pipeline.paths import ExperimentTree, RunTree, model_folder
from pipeline.registry.packages import ModelPackages
from pipeline.registry.protocol import APPROVED, PENDING, REJECTED, Registry
from pipeline.registry.records import LocalRegistry
from pipeline.store import Store

# What the driver, the plan, `smpipe registry` and `smpipe approve` use.
__all__ = [
    "APPROVED",
    "PENDING",
    "REJECTED",
    "STEP",
    "plan_line",
    "register",
    "registry_for",
    "set_status",
    "versions",
    "with_registration",
]

STEP = "register"
# The test metrics a registered version carries, as inference writes them (overall.json).
METRICS = ("accuracy", "macro_f1", "weighted_f1")
# Namespace of the deterministic client tokens (a fixed UUID of this project's own).
TOKENS = uuid.UUID("5b0e5a3c-3f4e-4d2a-9a51-1c0d3e7f6a21")


def with_registration(settings: Settings, steps: list[str]) -> list[str]:
    """`steps`, and registration after inference when [registry] names a group."""
    if settings.registry.model_package_group and "inference" in steps:
        return [*steps, STEP]
    return steps


def plan_line(settings: Settings, store: Store) -> str:
    """What the plan says of the register step."""
    r = settings.registry
    return (
        f"register: the winner by test macro-F1 becomes a new version of model package group "
        f"{r.model_package_group!r}, {r.approval_status}: {registry_for(settings, store).planned()}"
    )


def client_token(experiment: str, run: str, model: str, group: str) -> str:
    """CreateModelPackage's ClientToken: 1 to 36 characters of [a-zA-Z0-9-] (the service model),
    "a unique token that guarantees that the call to this API is idempotent". A UUID made from
    what is registered, so every attempt of the same registration sends the same token."""
    return str(uuid.uuid5(TOKENS, f"{experiment}/{run}/{model}/{group}"))


# -- registering ------------------------------------------------------------------------------


def registry_for(
    settings: Settings, store: Store, client=None, image: str | None = None
) -> Registry:
    """The registry of [registry] MODEL_PACKAGE_GROUP that [experiment] BACKEND keeps: records
    in the store on local, SageMaker's model packages otherwise. `client`: SageMaker's (moto's
    when emulated; made when first needed where None); `image`: what a version registered now
    serves with, handed down by whoever knows the run's backend."""
    group, e = group_of(settings), settings.experiment
    status = settings.registry.approval_status
    if e.backend == "local":
        return LocalRegistry(store, ExperimentTree(e.name), group, status)
    return ModelPackages(store, e.name, group, status, e.region, client=client, image=image)


def register(
    settings: Settings, store: Store, run: RunTree, record: dict, client, image: str
) -> dict:
    """Register the winner of `run` (its merged Metadata `record`: the model inference named
    best by test macro-F1, metadata.winner; pipeline/stages.py `Register` runs this after
    inference) and return what was
    registered. `client`: the backend's SageMaker client, None locally; `image`: the image the
    run's jobs ran, which the version serves with."""
    model = md.winner(record)
    if model is None:
        raise PipelineError(f"register: run {run.label} tested no model; nothing to register")
    # The models inference tested: this run's, or an earlier run's (--steps inference).
    models = record["steps"]["inference"]["details"]["models_from"]
    lineage = (record.get("model_lineage") or {}).get(model) or {}
    group = settings.registry.model_package_group
    entry = {
        "group": group,
        "experiment": settings.experiment.name,
        "run": run.label,
        "model": model,
        "test_metrics": {k: record["holdout_performance"][model].get(k) for k in METRICS},
        "data_version": lineage.get("data_version", record.get("data_version")),
        "data_snapshot_hash": lineage.get("data_snapshot_hash", record.get("data_snapshot_hash")),
        "model_artifact": model_folder(models, model),  # a key of the store, as Metadata keeps them
        "token": client_token(settings.experiment.name, run.label, model, group),
    }
    registry = registry_for(settings, store, client, image)
    registered = registry.register(entry, run, record.get("git_sha"))
    log.info(
        f"registered {model} of run {run.label} as version {registered['version']} of "
        f"{group!r} ({registered['approval_status']}): {registry.where(registered)}",
        extra=RESULT,
    )
    return registered


# -- listing and approving --------------------------------------------------------------------


def group_of(settings: Settings) -> str:
    group = settings.registry.model_package_group
    if not group:
        raise ConfigError(
            ["[registry] MODEL_PACKAGE_GROUP is empty: this experiment registers no models"],
            settings.source,
        )
    return group


def versions(settings: Settings, store: Store, client=None) -> list[dict]:
    """The group's versions, oldest first: version, approval status, when, and what."""
    return registry_for(settings, store, client).versions()


def set_status(settings: Settings, store: Store, version: int, status: str, client=None) -> dict:
    """Version `version` of the group approved, rejected or pending again; the row it now is,
    `changed` False where it had that status already (then nothing is written). Approving a
    version with no model that can be served (gone, or none named) is refused."""
    group = group_of(settings)
    registry = registry_for(settings, store, client)
    rows = registry.versions()
    row = next((r for r in rows if r["version"] == version), None)
    if row is None:
        there = f"versions 1-{rows[-1]['version']}" if rows else "no versions yet"
        raise Refused(f"registry: no version {version} in model package group {group!r} ({there})")
    if row["approval_status"] == status:  # nothing to change: no record, no call
        return {**row, "changed": False}
    gone = registry.missing_model(row) if status == APPROVED else None
    if gone is not None:
        raise Refused(
            f"approve: version {version} of {group!r} has no model that can be served "
            f"({gone}): approving it would approve what cannot be deployed. --reject it; a run "
            "that trains the model again registers a new version"
        )
    return {**registry.set_status(row, status), "changed": True}
