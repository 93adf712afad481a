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
  The record is never rewritten: each later approval change is an object of its own,
  `<version>/<change>.json`, created the same way, so changes made at once are all kept (a
  read, change and write back of the record would lose all but one). A file there that is no
  record or change (a note, a record truncated by hand) is named in a warning and skipped.

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
from pipeline.paths import (
    REGISTRY_CHANGE,
    REGISTRY_RECORD,
    ExperimentTree,
    RunTree,
    model_folder,
    run_label,
)
from pipeline.store import (
    NotFound,
    Store,
    artifact_key,
    download_dir,
    is_complete,
    key_of,
    read_manifest,
)

STEP = "register"
# The statuses `smpipe approve` sets: SageMaker's ModelApprovalStatus (CreateModelPackage and
# UpdateModelPackage in botocore's sagemaker service-2.json).
APPROVED, REJECTED, PENDING = "Approved", "Rejected", "PendingManualApproval"
STATUSES = (APPROVED, REJECTED, PENDING)
# The test metrics a registered version carries, as inference writes them (overall.json).
METRICS = ("accuracy", "macro_f1", "weighted_f1")
# Namespace of the deterministic client tokens (a fixed UUID of this project's own).
TOKENS = uuid.UUID("5b0e5a3c-3f4e-4d2a-9a51-1c0d3e7f6a21")
# What a record must hold to be listed, approved and kept from prune: what register writes.
RECORD_FIELDS = {"experiment": str, "run": str, "model": str, "model_artifact": str}
# How many change numbers an approval tries before giving up: each one refused was taken by
# another approval meanwhile, so this many at once on one version.
CHANGE_ATTEMPTS = 1000
# The model folder a SageMaker version was registered from, in its CustomerMetadataProperties.
ARTIFACT_PROPERTY = "smpipe:model-artifact"


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
        "model_artifact": model_folder(models, model),  # a key of the store, as Metadata keeps them
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
    """Every version record of `group` in the local registry, oldest first, with the approval
    changes made since folded in: approval_status is the newest change's, history holds them
    all. A file that is no record or change, or one that cannot be read as one, is named in a
    warning and skipped: it never fails `registry`, `approve` or a run's register step."""
    folder = tree.registry(group)
    records, changes = {}, {}
    for key in store.list_keys(folder):
        name = key[len(folder) :]
        record_name, change_name = REGISTRY_RECORD.fullmatch(name), REGISTRY_CHANGE.fullmatch(name)
        if not (record_name or change_name):
            skipped(store, key, "not a version (<version>.json) or a change (<version>/<n>.json)")
            continue
        try:
            document = json.loads(store.get_bytes(key))
        except NotFound:  # removed meanwhile
            continue
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
            skipped(store, key, f"not JSON ({e})")
            continue
        if record_name:
            why = record_problem(document, int(record_name.group(1)))
            if why:
                skipped(store, key, why)
            else:
                records[document["version"]] = document
        elif change_problem(document):
            skipped(store, key, change_problem(document))
        else:
            version, number = int(change_name.group(1)), int(change_name.group(2))
            changes.setdefault(version, {})[number] = document
    folded = []
    for version, record in sorted(records.items()):
        made = [changes.get(version, {})[n] for n in sorted(changes.get(version, {}))]
        history = [*record.get("history", []), *made]
        status = made[-1]["approval_status"] if made else record["approval_status"]
        folded.append({**record, "approval_status": status, "history": history})
    return folded


def record_problem(record, version: int) -> str | None:
    """Why a <version>.json is no version record to use, or None."""
    if not isinstance(record, dict):
        return "not a version record (a JSON object)"
    if record.get("version") != version:
        return f"its version is {record.get('version')!r}, not {version} as its name says"
    if record.get("approval_status") not in STATUSES:
        return f"its approval_status {record.get('approval_status')!r} is not SageMaker's"
    if not isinstance(record.get("history", []), list):
        return "its history is not a list"
    missing = [f for f, kind in RECORD_FIELDS.items() if not isinstance(record.get(f), kind)]
    if missing or not isinstance(record.get("test_metrics"), dict):
        return f"it lacks {', '.join(missing or ['test_metrics'])}"
    return None


def change_problem(change) -> str | None:
    """Why a <version>/<n>.json is no approval change, or None."""
    if not isinstance(change, dict) or change.get("approval_status") not in STATUSES:
        return "not an approval change (approval_status and time)"
    return None


def skipped(store: Store, key: str, why: str) -> None:
    log.warning(f"registry: skipped {store.uri_of(key)}: {why}")


def add_change(store: Store, tree: ExperimentTree, group: str, version: int, change: dict) -> int:
    """Change `change` appended to the version's changes: the next free number, taken with the
    store's conditional create (an exclusive link on a folder; PutObject's If-None-Match on S3,
    https://docs.aws.amazon.com/AmazonS3/latest/userguide/conditional-writes.html). A number
    another approval took meanwhile is refused, and the next one is tried: every change lands,
    in one order all readers see. Its number."""
    folder = tree.registry_changes(group, version)
    names = (REGISTRY_RECORD.fullmatch(key[len(folder) :]) for key in store.list_keys(folder))
    number = max((int(m.group(1)) for m in names if m), default=0) + 1
    document = json.dumps(change, indent=2).encode()
    for _ in range(CHANGE_ATTEMPTS):
        if store.create(tree.registry_change(group, version, number), document):
            return number
        number += 1
    raise PipelineError(
        f"registry: version {version} of {group!r}: {CHANGE_ATTEMPTS} change numbers were taken "
        f"meanwhile at {store.uri_of(folder)}; nothing was changed, try again"
    )


def register_package(client, store, run, entry, settings, git_sha) -> dict:
    """A model package version in the group (created first when missing), with the model's
    archive and its test metrics; the package's version and status as SageMaker reports them."""
    from pipeline.backends.choose import identity

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
    if group_exists(client, group):
        return
    request = {
        "ModelPackageGroupName": group,
        "ModelPackageGroupDescription": f"The winning models of smpipe experiment {experiment}",
    }
    call(client, "CreateModelPackageGroup", request)
    log.info(f"created model package group {group!r}")


def group_exists(client, group: str) -> bool:
    """Whether the model package group exists (DescribeModelPackageGroup)."""
    from botocore.exceptions import ClientError

    try:
        client.describe_model_package_group(ModelPackageGroupName=group)
        return True
    except ClientError as e:
        if "does not exist" not in str(e):
            raise PipelineError(
                f"registry: DescribeModelPackageGroup {group} failed: {e}"
            ) from None
    return False


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
    f1, data = entry["test_metrics"].get("macro_f1"), entry.get("data_version")
    snapshot = (entry.get("data_snapshot_hash") or "")[:8]
    score = f"test macro-F1 {f1:.4f}" if isinstance(f1, int | float) else "no test macro-F1"
    return f"{entry['experiment']} run {entry['run']}: {entry['model']}, {score}" + (
        f"; data {run_label(data)} {snapshot}".rstrip() if isinstance(data, int) else ""
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
        # The model folder registered (another run's, for a --steps inference run): what
        # `smpipe prune` keeps for the version. Left out past the value's 256 characters.
        ARTIFACT_PROPERTY: entry["model_artifact"] if len(entry["model_artifact"]) <= 256 else "",
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
        client = client or sagemaker_client(settings)
        if status == APPROVED:
            described = call(client, "DescribeModelPackage", {"ModelPackageName": row["arn"]})
            archives = [key_of(store, url) for url in model_data_urls(described)]
            gone = [key for key in archives if key and not store.exists(key)]
            if gone:
                raise PipelineError(model_gone(group, version, store.uri_of(gone[0])))
        update = {"ModelPackageArn": row["arn"], "ModelApprovalStatus": status}
        call(client, "UpdateModelPackage", update)
        return {**row, "approval_status": status}
    tree = ExperimentTree(settings.experiment.name)
    model = artifact_key(store, row["model_artifact"])
    if status == APPROVED and not (model and is_complete(store, model)):
        raise PipelineError(model_gone(group, version, store.uri_of(model or "")))
    change = {"approval_status": status, "time": md.iso(time.time())}
    add_change(store, tree, group, version, change)
    return {**row, "approval_status": status, "history": [*row["history"], change]}


def model_gone(group: str, version: int, where: str) -> str:
    return (
        f"approve: version {version} of {group!r} points at a model that is no longer complete "
        f"({where}): approving it would approve a model that cannot be served. --reject it, "
        "or register the model again"
    )


# -- what the versions point at (smpipe prune keeps it) --------------------------------------


def model_data_urls(described: dict) -> list[str]:
    """The model archives a model package serves (DescribeModelPackage's
    InferenceSpecification.Containers[].ModelDataUrl, where register_package puts them)."""
    containers = (described.get("InferenceSpecification") or {}).get("Containers") or []
    return [c["ModelDataUrl"] for c in containers if c.get("ModelDataUrl")]


def registered_models(store: Store, tree: ExperimentTree) -> list[tuple[str, str]]:
    """(key, why) for the model folder of every version in the local registry, every group of
    the experiment (a group the settings named before counts too)."""
    found = []
    for group in store.list_children(tree.registry_root):
        for record in local_versions(store, tree, group):
            key = artifact_key(store, record["model_artifact"])
            if key:
                found.append((key, version_said(group, record)))
    return found


def package_models(settings: Settings, store: Store, client=None) -> list[tuple[str, str]]:
    """(key, why) for what each version of [registry] MODEL_PACKAGE_GROUP on SageMaker points
    at in this store: its model archive (ModelDataUrl) and the model folder it was registered
    from (CustomerMetadataProperties). None locally, or when no group is named. A group that
    cannot be listed is a PipelineError: what it points at cannot be known."""
    group = settings.registry.model_package_group
    if settings.experiment.backend == "local" or not group:
        return []
    client = client or sagemaker_client(settings)
    if not group_exists(client, group):
        return []
    found = []
    for package in packages(client, group):
        described = call(
            client, "DescribeModelPackage", {"ModelPackageName": package["ModelPackageArn"]}
        )
        why = version_said(
            group,
            {
                "version": described.get("ModelPackageVersion"),
                "approval_status": described.get("ModelApprovalStatus"),
            },
        )
        folder = (described.get("CustomerMetadataProperties") or {}).get(ARTIFACT_PROPERTY)
        keys = [key_of(store, url) for url in model_data_urls(described)] + [folder]
        found += [(key, why) for key in keys if key]
    return found


def version_said(group: str, record: dict) -> str:
    status = record["approval_status"]
    return f"version {record['version']} of model package group {group!r} ({status}) points at it"
