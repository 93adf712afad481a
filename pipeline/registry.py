"""The model registry: each completed run's winning model, registered once.

[registry] MODEL_PACKAGE_GROUP names a model package group. A run that tests its models ends
with the register step (pipeline/stages.py `Register`, after inference): its winner, the model
inference named best by test macro-F1 (metadata.winner), becomes one new version of the group:

- sagemaker, emulated: a SageMaker model package (CreateModelPackage): the image, the model's
  model.tar.gz, its test metrics as ModelMetrics, [registry] APPROVAL_STATUS; the group is
  created first when it does not exist. The request carries a ClientToken made from the
  experiment, run, model and group, so asking again (a resumed run) is answered with the
  package the first request made.
- local: a record `<experiment>/registry/<group>/<version>.json` (version, run, model, test
  metrics, data version and hash, approval status), created with the store's conditional write
  so two drivers never take the same version; a record of the same run and model is reused.

`smpipe registry` lists the group's versions (ListModelPackages on SageMaker), `smpipe approve
VERSION [--reject]` sets one's status (UpdateModelPackage). Every request is checked against
SageMaker's service model before it is sent (pipeline/service_model.py).
"""

from __future__ import annotations

import hashlib
import json
import tarfile
import tempfile
import time
import uuid
from pathlib import Path

from pipeline import metadata as md
from pipeline.config import ConfigError, Settings
from pipeline.errors import PipelineError, log
from pipeline.paths import ExperimentTree, RunTree, run_label
from pipeline.store import NotFound, Store, download_dir, read_manifest

STEP = "register"
# The statuses `smpipe approve` sets: SageMaker's ModelApprovalStatus (CreateModelPackage and
# UpdateModelPackage in botocore's sagemaker service-2.json).
APPROVED, REJECTED, PENDING = "Approved", "Rejected", "PendingManualApproval"
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
    folder = ExperimentTree(settings.experiment.name).registry(r.model_package_group)
    where = (
        f"a record in {store.uri_of(folder)}"
        if settings.experiment.backend == "local"
        else "a SageMaker model package (CreateModelPackage)"
    )
    return (
        f"register: the winner by test macro-F1 becomes a new version of model package group "
        f"{r.model_package_group!r}, {r.approval_status}: {where}"
    )


def client_token(experiment: str, run: str, model: str, group: str) -> str:
    """CreateModelPackage's ClientToken: 1 to 36 characters of [a-zA-Z0-9-] (the service model),
    "a unique token that guarantees that the call to this API is idempotent". A UUID made from
    what is registered, so every attempt of the same registration sends the same token."""
    return str(uuid.uuid5(TOKENS, f"{experiment}/{run}/{model}/{group}"))


# -- registering ------------------------------------------------------------------------------


def register(settings: Settings, store: Store, run: RunTree, record: dict, client) -> dict:
    """Register the winner of `run` (its merged Metadata `record`) and return what was
    registered. `client`: SageMaker's, None locally."""
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
        "model_artifact": f"{models}{model}/model/",  # a key of the store, as Metadata keeps them
        "token": client_token(settings.experiment.name, run.label, model, group),
    }
    if client is None:
        registered = register_locally(store, ExperimentTree(run.experiment), entry, settings)
        where = store.uri_of(ExperimentTree(run.experiment).registry(group))
    else:
        registered = register_package(client, store, run, entry, settings, record.get("git_sha"))
        where = registered["arn"]
    log.info(
        f"registered {model} of run {run.label} as version {registered['version']} of "
        f"{group!r} ({registered['approval_status']}): {where}"
    )
    return registered


def register_locally(store: Store, tree: ExperimentTree, entry: dict, settings: Settings):
    """A new version record, or the one this run and model made before (its driver stopped
    before Metadata said so). Versions count from 1; a version another driver took meanwhile
    (the conditional create fails) is skipped for the next."""
    group = entry["group"]
    records = local_versions(store, tree, group)
    for record in records:
        if record.get("token") == entry["token"]:
            return record
    version = max((r["version"] for r in records), default=0) + 1
    now = md.iso(time.time())
    status = settings.registry.approval_status
    while True:
        record = {
            "version": version,
            **entry,
            "approval_status": status,
            "registered_at": now,
            "history": [{"approval_status": status, "time": now}],
        }
        if store.create(
            tree.registry_version(group, version), json.dumps(record, indent=2).encode()
        ):
            return record
        version += 1


def local_versions(store: Store, tree: ExperimentTree, group: str) -> list[dict]:
    """Every version record of `group` in the local registry, oldest first."""
    records = [json.loads(store.get_bytes(k)) for k in store.list_keys(tree.registry(group))]
    return sorted(records, key=lambda r: r["version"])


def register_package(client, store, run, entry, settings, git_sha) -> dict:
    """A model package version in the group (created first when missing), with the model's
    archive and its test metrics; the package's version and status as SageMaker reports them."""
    from pipeline.backends import identity

    ensure_group(client, entry["group"], settings.experiment.name)
    archive = model_archive(client, store, run, entry)
    metrics = run.model_quality(entry["model"])
    document = json.dumps(model_quality(entry["test_metrics"]), indent=2).encode()
    store.put_bytes(metrics, document)
    request = {
        "ModelPackageGroupName": entry["group"],
        "ModelPackageDescription": description(entry),
        # The image every job of the run ran, and the model as its training job left it.
        "InferenceSpecification": {
            "Containers": [{"Image": identity(settings)[0], "ModelDataUrl": store.uri_of(archive)}]
        },
        # ModelMetrics.ModelQuality.Statistics: a MetricsSource (ContentType, S3Uri and an
        # optional "sha256:<hex>" ContentDigest: the service model).
        "ModelMetrics": {
            "ModelQuality": {
                "Statistics": {
                    "ContentType": "application/json",
                    "S3Uri": store.uri_of(metrics),
                    "ContentDigest": f"sha256:{hashlib.sha256(document).hexdigest()}",
                }
            }
        },
        "ModelApprovalStatus": settings.registry.approval_status,
        "CustomerMetadataProperties": customer_metadata(entry),
        "MetadataProperties": {"GeneratedBy": "smpipe", "ProjectId": entry["experiment"]}
        | ({"CommitId": git_sha} if git_sha else {}),
        "ClientToken": entry["token"],
    }
    arn = call(client, "CreateModelPackage", request)["ModelPackageArn"]
    described = call(client, "DescribeModelPackage", {"ModelPackageName": arn})
    return {
        "version": described.get("ModelPackageVersion"),
        "arn": arn,
        **entry,
        "approval_status": described.get("ModelApprovalStatus"),
        "registered_at": md.iso(time.time()),
        "model_data_url": store.uri_of(archive),
        "model_metrics_uri": store.uri_of(metrics),
    }


def call(client, operation: str, request: dict) -> dict:
    """One SageMaker request, checked against the service model first; what it refuses, or
    what SageMaker answers with an error, is one PipelineError naming the operation."""
    from botocore import xform_name
    from botocore.exceptions import BotoCoreError, ClientError

    from pipeline.service_model import check

    problems = check(operation, request)
    if problems:
        said = "; ".join(str(p) for p in problems)
        raise PipelineError(f"register: SageMaker would refuse {operation}: {said}")
    try:
        return getattr(client, xform_name(operation))(**request)
    except (ClientError, BotoCoreError) as e:
        raise PipelineError(f"register: {operation} failed: {e}") from None


def ensure_group(client, group: str, experiment: str) -> None:
    """The model package group, created when it does not exist: a version can only be created
    in an existing group (CreateModelPackageGroup, then CreateModelPackage), and the group is
    named in the settings, as the experiment is, which the first run creates too."""
    from botocore.exceptions import ClientError

    try:
        client.describe_model_package_group(ModelPackageGroupName=group)
        return
    except ClientError as e:
        if "does not exist" not in str(e):
            raise PipelineError(
                f"register: DescribeModelPackageGroup {group} failed: {e}"
            ) from None
    request = {
        "ModelPackageGroupName": group,
        "ModelPackageGroupDescription": f"The winning models of smpipe experiment {experiment}",
    }
    call(client, "CreateModelPackageGroup", request)
    log.info(f"created model package group {group!r}")


def model_archive(client, store: Store, run: RunTree, entry: dict) -> str:
    """The key of the model's model.tar.gz: its training job's (DescribeTrainingJob's
    ModelArtifacts.S3ModelArtifacts; the job named in the model folder's manifest), or, for a
    model no training job left whole (a tuned one, exported after its study), its folder
    packed once under the run's registry/."""
    from botocore.exceptions import ClientError

    from pipeline.store import key_of

    folder = entry["model_artifact"]
    job = read_manifest(store, folder).get("job_name")
    try:
        described = client.describe_training_job(TrainingJobName=job) if job else {}
    except ClientError:  # an export job's folder: no training job of that name
        described = {}
    uri = (described.get("ModelArtifacts") or {}).get("S3ModelArtifacts", "")
    key = key_of(store, uri) if uri else None
    if key and store.exists(key):
        return key
    packed = run.registry_archive(entry["model"])
    if not store.exists(packed):
        with tempfile.TemporaryDirectory(prefix="smpipe-register-") as tmp:
            download_dir(store, folder, Path(tmp) / "model")
            with tarfile.open(Path(tmp) / "model.tar.gz", "w:gz") as tar:
                for path in sorted((Path(tmp) / "model").rglob("*")):
                    if path.is_file():
                        tar.add(path, arcname=path.relative_to(Path(tmp) / "model").as_posix())
            store.upload_file(Path(tmp) / "model.tar.gz", packed)
    return packed


def model_quality(metrics: dict) -> dict:
    """The test metrics as SageMaker Model Monitor writes a multiclass model's quality
    (model-monitor-model-quality-metrics.html): each {"value", "standard_deviation"}, the
    deviation "NaN" as Model Monitor writes it where it computed none (it resamples 200 rows or
    more; inference does not). macro_f1, by which the winner was chosen, beside its two."""
    return {
        "multiclass_classification_metrics": {
            name: {"value": value, "standard_deviation": "NaN"}
            for name, value in metrics.items()
            if value is not None
        }
    }


def description(entry: dict) -> str:
    """ModelPackageDescription: what ListModelPackages shows of a version (`smpipe registry`)."""
    f1, data = entry["test_metrics"].get("macro_f1"), entry["data_version"]
    snapshot = (entry["data_snapshot_hash"] or "")[:8]
    return f"{entry['experiment']} run {entry['run']}: {entry['model']}, test macro-F1 {f1:.4f}" + (
        f"; data {run_label(data)} {snapshot}".rstrip() if data else ""
    )


def customer_metadata(entry: dict) -> dict[str, str]:
    """CustomerMetadataProperties: 1 to 256 characters of letters, digits, spaces and
    _.:/=+-@ each (the service model's CustomerMetadataKey and Value)."""
    values = {
        "smpipe:experiment": entry["experiment"],
        "smpipe:run": entry["run"],
        "smpipe:model": entry["model"],
        "smpipe:data-version": run_label(entry["data_version"]) if entry["data_version"] else "",
        "smpipe:data-snapshot-hash": entry["data_snapshot_hash"] or "",
        **{
            f"smpipe:test-{k.replace('_', '-')}": f"{v:.6f}"
            for k, v in entry["test_metrics"].items()
            if v is not None
        },
    }
    return {k: v for k, v in values.items() if v}


# -- listing and approving --------------------------------------------------------------------


def group_of(settings: Settings) -> str:
    group = settings.registry.model_package_group
    if not group:
        raise ConfigError(
            ["[registry] MODEL_PACKAGE_GROUP is empty: this experiment registers no models"],
            settings.source,
        )
    return group


def sagemaker_client(settings: Settings):
    """The client `smpipe registry` and `smpipe approve` ask (moto's on emulated: the store's
    opening started it and pointed AWS_ENDPOINT_URL there)."""
    import boto3

    from pipeline.store import aws_config

    session = boto3.Session(region_name=settings.experiment.region)
    return session.client("sagemaker", config=aws_config())


def versions(settings: Settings, store: Store, client=None) -> list[dict]:
    """The group's versions, oldest first: version, approval status, when, and what."""
    group = group_of(settings)
    if settings.experiment.backend == "local":
        return [
            {**r, "description": description(r)}
            for r in local_versions(store, ExperimentTree(settings.experiment.name), group)
        ]
    return [
        {
            "version": p.get("ModelPackageVersion"),
            "approval_status": p.get("ModelApprovalStatus"),
            "registered_at": md.iso(p["CreationTime"].timestamp()),
            "description": p.get("ModelPackageDescription", ""),
            "arn": p["ModelPackageArn"],
        }
        for p in packages(client or sagemaker_client(settings), group)
    ]


def packages(client, group: str) -> list[dict]:
    """ListModelPackages of the group, every page, oldest first."""
    found, token = [], None
    while True:
        request = {"ModelPackageGroupName": group, "SortBy": "CreationTime", "MaxResults": 100}
        page = call(client, "ListModelPackages", request | ({"NextToken": token} if token else {}))
        found += page.get("ModelPackageSummaryList", [])
        token = page.get("NextToken")
        if not token:
            return found


def set_status(settings: Settings, store: Store, version: int, status: str, client=None) -> dict:
    """Version `version` of the group approved, rejected or pending again; the row it now is."""
    group = group_of(settings)
    rows = versions(settings, store, client)
    row = next((r for r in rows if r["version"] == version), None)
    if row is None:
        there = f"versions 1-{rows[-1]['version']}" if rows else "no versions yet"
        raise PipelineError(
            f"registry: no version {version} in model package group {group!r} ({there})"
        )
    if settings.experiment.backend != "local":
        update = {"ModelPackageArn": row["arn"], "ModelApprovalStatus": status}
        call(client or sagemaker_client(settings), "UpdateModelPackage", update)
        return {**row, "approval_status": status}
    tree = ExperimentTree(settings.experiment.name)
    try:
        record = json.loads(store.get_bytes(tree.registry_version(group, version)))
    except NotFound:
        raise PipelineError(f"registry: version {version} of {group!r} is gone") from None
    now = md.iso(time.time())
    record["approval_status"] = status
    record["history"] = [*record.get("history", []), {"approval_status": status, "time": now}]
    store.put_bytes(tree.registry_version(group, version), json.dumps(record, indent=2).encode())
    return {**record, "description": description(record)}
