"""The emulated AWS account: an embedded moto server this process and its jobs reach in place of
AWS, the clients the emulator calls it with, moto's records of the account's SageMaker jobs,
and the store the jobs see.
"""

from __future__ import annotations

import json
import os
import re
import threading
from datetime import UTC, datetime

from pipeline.backends import moto_server
from pipeline.errors import log
from pipeline.store import Store, aws_config

EMULATED_BUCKET = "smpipe-emulated"


def start_moto(region: str) -> str:
    """An embedded moto server on a free local port; this process reaches it (and nothing
    else: fake credentials, its endpoint for every AWS service). Jobs are given its address and
    credentials by the emulator (`job_plumbing`), nothing else of this process's environment."""
    _, endpoint = moto_server.serve()
    os.environ.update(
        {
            "AWS_ENDPOINT_URL": endpoint,
            # Credentials moto accepts, shaped as the IAM user guide's example keys: a secret
            # is masked wherever it appears in a job's output, so it must not be a word that
            # text holds ("emulated" was: metadata.json's backend came out "<redacted>").
            "AWS_ACCESS_KEY_ID": "AKIAEMULATEDDRIVER00",
            "AWS_SECRET_ACCESS_KEY": "smpipeEmulatedDriverSecretKey0000000000",
            "AWS_DEFAULT_REGION": region,
        }
    )
    os.environ.pop("AWS_SESSION_TOKEN", None)
    os.environ.pop("AWS_PROFILE", None)
    return endpoint


def job_plumbing(endpoint: str) -> dict[str, str]:
    """What a job is given to reach the embedded moto at `endpoint`: its address, and
    credentials as the job's role would give them (AWS delivers a role's temporary credentials
    through the container credentials provider, undocumented for SageMaker; any credentials
    reach moto). No region: SageMaker documents none, and a job finds its own from its ARN
    (steps/runtime/secrets.py)."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "ASIAEMULATEDJOBROLE0",
        "AWS_SECRET_ACCESS_KEY": "smpipeEmulatedJobRoleSecretKey000000000",
        "AWS_SESSION_TOKEN": "smpipeEmulatedJobRoleSessionToken0000000",
    }


def moto_records(region: str):
    """moto's records of the account's SageMaker resources in `region` (its backend)."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.sagemaker.models import sagemaker_backends

    return sagemaker_backends[DEFAULT_ACCOUNT_ID][region]


class Account:
    """The emulated account of `region`, as the emulator reaches it: SageMaker and CloudWatch
    Logs clients of the moto server (`client`, `logs`), and moto's own records of the
    account's SageMaker jobs (`jobs`: its processing_jobs, training_jobs,
    hyper_parameter_tuning_jobs and model_packages), which moto leaves as they were created
    and the emulator moves as SageMaker would."""

    def __init__(self, region: str) -> None:
        import boto3

        self.region = region
        self.client = boto3.client("sagemaker", region_name=region, config=aws_config())
        self.logs = boto3.client("logs", region_name=region, config=aws_config())
        self.jobs = moto_records(region)

    def secrets(self):
        """A Secrets Manager client of the account."""
        import boto3

        return boto3.client("secretsmanager", region_name=self.region, config=aws_config())

    def put_secret(self, secret_id: str, value: str) -> None:
        """The secret `secret_id`, made once: one already made is kept."""
        secrets = self.secrets()
        try:
            secrets.create_secret(Name=secret_id, SecretString=value)
        except secrets.exceptions.ResourceExistsException:
            pass


class S3View:
    """A local-folder store seen as a bucket, so the requests name s3:// URIs (botocore
    insists) while the files stay in the user's folder."""

    def __init__(self, store: Store, bucket: str = EMULATED_BUCKET):
        self._store, self.bucket = store, bucket
        self.uri = f"s3://{bucket}"

    def uri_of(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def folder_of(self, key: str) -> str:
        """Where the emulated bucket's `key` really is."""
        return self._store.uri_of(key)

    def __getattr__(self, name):
        return getattr(self._store, name)


def open_emulated_store(settings) -> Store:
    """Start the embedded moto and open the store the emulated jobs see: a local STORE as a
    bucket of its own (the files stay in the folder), an s3:// STORE as moto's bucket of that
    name (it lives as long as the driver does). With a local STORE the account's model
    registry outlives the command (`AccountRegistry`)."""
    from pipeline.store import S3Store, open_store

    region = settings.experiment.region
    start_moto(region)
    uri = settings.store_uri()
    if not uri.startswith("s3://"):
        store = S3View(open_store(uri))
        AccountRegistry(store, region).restore_and_keep()
        return store
    KEEPER.clear()  # moto's bucket ends with the process, the registry with it
    store = S3Store(uri, settings.experiment.region)
    try:
        store.client.create_bucket(Bucket=store.bucket)
    except store.client.exceptions.BucketAlreadyOwnedByYou:
        pass
    return store


# Where the emulated account's model registry is kept between commands: in the store's folder,
# beside the experiments, as the account's own (not any experiment's); no experiment's name
# starts with "_" (config_sections.NAME_RE). A group's record and each version's are objects of
# their own (`<group>/group.json`, `<group>/0001.json`), so two commands at once (a run that
# registers, an `approve`) each keep what they changed.
REGISTRY = "_emulated-account/model-registry/"
VERSION_FILE = re.compile(r"^\d{4,}\.json$")
# The calls that change a registry (moto's SageMaker handlers of the same names), and who keeps
# this process's account's: the store opened last (a command opens one).
CHANGES = ("create_model_package_group", "create_model_package", "update_model_package")
KEEPER: list[AccountRegistry] = []


class AccountRegistry:
    """The emulated account's model package groups and versions, kept in the store between
    commands: a SageMaker account keeps its registry, and `smpipe registry` and `approve` after
    an emulated run must find what the run registered, though its moto ended with it. Each
    group and package is kept as the Create* request its Describe* answer repeats
    (CreateModelPackage's members in botocore's sagemaker service-2.json), with what no
    request holds: its CreationTime, its ClientToken and when it last changed; restored in the
    order they were made, so each keeps its version. Kept after every call that changes the
    registry, whoever makes it (the run's register step, `smpipe approve`): only what this
    command changed is written, and a new version is created only where no other command took
    its number meanwhile (each command's account is its own: that one is said, not kept)."""

    def __init__(self, store: Store, region: str) -> None:
        self.store, self.region = store, region
        self.known: dict[str, bytes] = {}  # key -> what this command read or wrote there
        self.lost: set[str] = set()  # keys another command took first
        # moto's server answers each request in a thread of its own: two calls that change the
        # registry at once (a run's register beside an approve) keep it one after the other,
        # else each would take the other's first write of a version for another command's.
        self._keeping = threading.Lock()

    def restore_and_keep(self) -> None:
        KEEPER.clear()  # restoring changes the registry: no other store's is kept with it
        self.restore()
        KEEPER.append(self)
        _observe_changes()

    def restore(self) -> None:
        account = Account(self.region)
        keys = self.store.list_keys(REGISTRY)
        for name in sorted({key[len(REGISTRY) :].split("/")[0] for key in keys}):
            if name in account.jobs.model_package_groups:
                continue  # restored already by this process
            group = self._read(f"{REGISTRY}{name}/group.json")
            if group is None:
                continue
            account.client.create_model_package_group(**group["request"])
            self.known[f"{REGISTRY}{name}/group.json"] = _text(self._group(account.jobs, name))
            files = [k.rsplit("/", 1)[-1] for k in keys if k.startswith(f"{REGISTRY}{name}/")]
            numbers = [int(f.split(".")[0]) for f in files if VERSION_FILE.match(f)]
            for number in range(1, max(numbers, default=0) + 1):  # moto numbers them in order
                self._restore_version(account, name, f"{REGISTRY}{name}/{number:04d}.json")

    def _restore_version(self, account: Account, group: str, key: str) -> None:
        """One version from its record; where that cannot be read, a Rejected stand-in that
        says so, so that every later version keeps its number (and the record is left as it
        is, never written over)."""
        kept = self._read(key)
        if kept is None:
            why = f"its record {self.store.folder_of(key)} could not be read"
            stand_in = {"ModelPackageDescription": why, "ModelApprovalStatus": "Rejected"}
            account.client.create_model_package(ModelPackageGroupName=group, **stand_in)
            self.lost.add(key)
            return
        arn = account.client.create_model_package(**kept["request"])["ModelPackageArn"]
        package = account.jobs.model_packages[arn]
        changed = kept["last_modified_time"]
        package.creation_time = moto_time(kept["creation_time"])
        package.last_modified_time = moto_time(changed) if changed else None
        package.client_token = kept["client_token"]
        self.known[key] = _text(self._package(package))

    def _read(self, key: str) -> dict | None:
        """A record the registry's folder holds; one that is missing or cannot be read (a
        stray file, a truncated record) is named and skipped."""
        from pipeline.store import NotFound

        try:
            record = json.loads(self.store.get_bytes(key))
            if not isinstance(record, dict) or not isinstance(record.get("request"), dict):
                raise ValueError("it holds no request")
            return record
        except (NotFound, ValueError) as e:
            why = "missing" if isinstance(e, NotFound) else str(e)
            log.warning(
                f"{self.store.folder_of(key)}: not a record of the registry ({why}); skipped"
            )
            return None

    def keep(self) -> None:
        with self._keeping:
            jobs = moto_records(self.region)
            # What moto holds, copied first: a call moto answers meanwhile, in its own thread,
            # adds to these dicts (its change is kept by its own keep, after this one).
            packages = list(jobs.model_packages.values())
            for name in sorted(list(jobs.model_package_groups)):
                self._write(f"{REGISTRY}{name}/group.json", _text(self._group(jobs, name)))
                made = [p for p in packages if p.model_package_group_name == name]
                for package in made:
                    key = f"{REGISTRY}{name}/{package.model_package_version:04d}.json"
                    self._write(key, _text(self._package(package)))

    def _write(self, key: str, data: bytes) -> None:
        if self.known.get(key) == data or key in self.lost:
            return  # not changed by this command, or another command's (said once)
        if key in self.known:  # this command's own version, changed (an approval)
            self.store.put_bytes(key, data)
        elif not self.store.create(key, data) and self.store.get_bytes(key) != data:
            log.warning(
                f"{self.store.folder_of(key)}: another command kept this version of the emulated "
                "account's registry meanwhile (each command's account is its own); this "
                "command's is not kept"
            )
            self.lost.add(key)  # never written over, however this command changes it
            return
        self.known[key] = data

    @staticmethod
    def _group(jobs, name: str) -> dict:
        described = jobs.model_package_groups[name].gen_response_object()
        return {"request": as_request("CreateModelPackageGroup", described)}

    @staticmethod
    def _package(package) -> dict:
        changed = package.last_modified_time
        return {
            "request": as_request("CreateModelPackage", package.gen_response_object()),
            "creation_time": package.creation_time.isoformat(),
            "last_modified_time": changed.isoformat() if changed else None,
            "client_token": package.client_token,
        }


def moto_time(text: str) -> datetime:
    """An ISO time as moto keeps its records' times: UTC, with no zone (moto's utcnow)."""
    time = datetime.fromisoformat(text)
    return time.astimezone(UTC).replace(tzinfo=None) if time.tzinfo else time


def _text(record: dict) -> bytes:
    return json.dumps(record, indent=2, sort_keys=True).encode()


def _observe_changes() -> None:
    """After each of moto's SageMaker calls in CHANGES that succeeds, the registry of the
    store opened last is kept (once per process: moto's handlers are wrapped in place)."""
    import functools
    import sys

    from moto.sagemaker.responses import SageMakerResponse

    for name in CHANGES:
        handler = getattr(SageMakerResponse, name)
        if getattr(handler, "smpipe_kept", False):
            continue

        @functools.wraps(handler)
        def kept(self, *args, _handler=handler, **kwargs):
            answer = _handler(self, *args, **kwargs)
            for keeper in list(KEEPER):
                try:
                    keeper.keep()
                except Exception as e:  # noqa: BLE001 - the call succeeded; say what was not kept
                    where = keeper.store.folder_of(REGISTRY)
                    said = f"the emulated account's registry could not be kept at {where}: {e}"
                    print(f"warning: {said}", file=sys.stderr)
            return answer

        kept.smpipe_kept = True
        setattr(SageMakerResponse, name, kept)


def as_request(operation: str, described: dict) -> dict:
    """The members of a Describe* answer that `operation`'s request takes."""
    from pipeline.service_model import service_model

    members = service_model().operation_model(operation).input_shape.members
    kept = {k: v for k, v in described.items() if k in members and v is not None}
    kept.pop("ModelPackageName", None)  # a version is made in its group, by the group's name
    return kept
