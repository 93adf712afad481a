"""SageMaker's model registry: a model package group's versions as model packages, on the
sagemaker and emulated backends (moto's registry when emulated).

A version is a model package (CreateModelPackage): the image, the model's model.tar.gz, its
test metrics as ModelMetrics, [registry] APPROVAL_STATUS; the group is created first when it
does not exist. The request carries a ClientToken made from the experiment, run, model and
group, so asking again (a resumed run) is answered with the package the first request made.
Listing is ListModelPackages, approving UpdateModelPackage; every request is checked against
SageMaker's service model before it is sent (pipeline/service_model.py).
"""

from __future__ import annotations

import hashlib
import json
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline import metadata as md
from pipeline.config import Settings
from pipeline.errors import PipelineError, log
from pipeline.paths import RunTree, run_label
from pipeline.registry.protocol import description, version_line
from pipeline.store import Store, download_dir, key_of, read_manifest

# The model folder a SageMaker version was registered from, in its CustomerMetadataProperties.
ARTIFACT_PROPERTY = "smpipe:model-artifact"


@dataclass
class ModelPackages:
    """The `Registry` of the sagemaker and emulated backends: group `group`'s model packages.
    `client`: SageMaker's (moto's when emulated), made for `region` when first needed where
    none is given; `image`: what a version registered now serves with, the image every job of
    the run ran (only registering needs it)."""

    store: Store
    experiment: str
    group: str
    approval_status: str  # what a new version starts as: [registry] APPROVAL_STATUS
    region: str
    client: object | None = None
    image: str | None = None

    def sagemaker(self):
        if self.client is None:
            self.client = sagemaker_client(self.region)
        return self.client

    def planned(self) -> str:
        return "a SageMaker model package (CreateModelPackage)"

    def register(self, entry: dict, run: RunTree, commit: str | None) -> dict:
        if not self.image:
            raise PipelineError(f"register: no image to register {entry['model']} with")
        ensure_group(self.sagemaker(), self.group, self.experiment)
        archive = model_archive(self.sagemaker(), self.store, run, entry)
        request = self.package_request(entry, run, archive, commit)
        return create_package(self.sagemaker(), entry, request)

    def package_request(self, entry: dict, run: RunTree, archive: str, commit: str | None) -> dict:
        """CreateModelPackage's request for `entry`: the image and the model's archive, its
        test metrics written beside the run as ModelMetrics."""
        metrics = run.model_quality(entry["model"])
        document = json.dumps(model_quality(entry["test_metrics"]), indent=2).encode()
        self.store.put_bytes(metrics, document)
        return {
            "ModelPackageGroupName": entry["group"],
            "ModelPackageDescription": description(entry),
            # The image every job of the run ran, and the model as its training job left it.
            "InferenceSpecification": {
                "Containers": [{"Image": self.image, "ModelDataUrl": self.store.uri_of(archive)}]
            },
            # ModelMetrics.ModelQuality.Statistics: a MetricsSource (ContentType, S3Uri and an
            # optional "sha256:<hex>" ContentDigest: the service model).
            "ModelMetrics": {
                "ModelQuality": {
                    "Statistics": {
                        "ContentType": "application/json",
                        "S3Uri": self.store.uri_of(metrics),
                        "ContentDigest": f"sha256:{hashlib.sha256(document).hexdigest()}",
                    }
                }
            },
            "ModelApprovalStatus": self.approval_status,
            "CustomerMetadataProperties": customer_metadata(entry),
            "MetadataProperties": {"GeneratedBy": "smpipe", "ProjectId": entry["experiment"]}
            | ({"CommitId": commit} if commit else {}),
            "ClientToken": entry["token"],
        }

    def where(self, registered: dict) -> str:
        return registered["arn"]

    def versions(self) -> list[dict]:
        return [
            {
                "version": p.get("ModelPackageVersion"),
                "approval_status": p.get("ModelApprovalStatus"),
                "registered_at": md.iso(p["CreationTime"].timestamp()),
                "description": p.get("ModelPackageDescription", ""),
                "arn": p["ModelPackageArn"],
            }
            for p in packages(self.sagemaker(), self.group)
        ]

    def missing_model(self, row: dict) -> str | None:
        request = {"ModelPackageName": row["arn"]}
        described = call(self.sagemaker(), "DescribeModelPackage", request)
        archives = [key_of(self.store, url) for url in model_data_urls(described)]
        containers = (described.get("InferenceSpecification") or {}).get("Containers") or []
        # One made elsewhere may name an uncompressed model instead (ModelDataSource, in
        # botocore's sagemaker service-2.json ModelPackageContainerDefinition): not checked.
        if not archives and not any(c.get("ModelDataSource") for c in containers):
            # As the emulated account's stand-in for a record it could not read.
            said = described.get("ModelPackageDescription")
            return "it names no model (no ModelDataUrl)" + (f": {said}" if said else "")
        gone = [key for key in archives if key and not self.store.exists(key)]
        return f"{self.store.uri_of(gone[0])} is gone" if gone else None

    def set_status(self, row: dict, status: str) -> dict:
        update = {"ModelPackageArn": row["arn"], "ModelApprovalStatus": status}
        call(self.sagemaker(), "UpdateModelPackage", update)
        return {**row, "approval_status": status}


def create_package(client, entry: dict, request: dict) -> dict:
    """The model package `request` makes (or made: its ClientToken); its version and status as
    SageMaker reports them."""
    arn = call(client, "CreateModelPackage", request)["ModelPackageArn"]
    described = call(client, "DescribeModelPackage", {"ModelPackageName": arn})
    return {
        "version": described.get("ModelPackageVersion"),
        "arn": arn,
        **entry,
        "approval_status": described.get("ModelApprovalStatus"),
        "registered_at": md.iso(time.time()),
        "model_data_url": request["InferenceSpecification"]["Containers"][0]["ModelDataUrl"],
        "model_metrics_uri": request["ModelMetrics"]["ModelQuality"]["Statistics"]["S3Uri"],
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


def sagemaker_client(region: str):
    """The client `smpipe registry`, `smpipe approve` and prune ask (moto's on emulated: the
    store's opening started it and pointed AWS_ENDPOINT_URL there)."""
    import boto3

    from pipeline.store import aws_config

    return boto3.Session(region_name=region).client("sagemaker", config=aws_config())


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


def model_data_urls(described: dict) -> list[str]:
    """The model archives a model package serves (DescribeModelPackage's
    InferenceSpecification.Containers[].ModelDataUrl, where register_package puts them)."""
    containers = (described.get("InferenceSpecification") or {}).get("Containers") or []
    return [c["ModelDataUrl"] for c in containers if c.get("ModelDataUrl")]


def package_models(settings: Settings, store: Store, client=None) -> list[tuple[str, str]]:
    """(key, why) for what each version of [registry] MODEL_PACKAGE_GROUP on SageMaker points
    at in this store: its model archive (ModelDataUrl) and the model folder it was registered
    from (CustomerMetadataProperties). None locally, or when no group is named. A group that
    cannot be listed is a PipelineError: what it points at cannot be known."""
    group = settings.registry.model_package_group
    if settings.experiment.backend == "local" or not group:
        return []
    client = client or sagemaker_client(settings.experiment.region)
    if not group_exists(client, group):
        return []
    found = []
    for package in packages(client, group):
        described = call(
            client, "DescribeModelPackage", {"ModelPackageName": package["ModelPackageArn"]}
        )
        why = version_line(
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
