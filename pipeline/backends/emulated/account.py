"""The emulated AWS account: an embedded moto server this process and its jobs reach in place of
AWS, the clients the emulator calls it with, moto's records of the account's SageMaker jobs,
and the store the jobs see.
"""

from __future__ import annotations

import os

from pipeline.backends import moto_server
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


class Account:
    """The emulated account of `region`, as the emulator reaches it: SageMaker and CloudWatch
    Logs clients of the moto server (`client`, `logs`), and moto's own records of the
    account's SageMaker jobs (`jobs`: its processing_jobs, training_jobs,
    hyper_parameter_tuning_jobs and model_packages), which moto leaves as they were created
    and the emulator moves as SageMaker would."""

    def __init__(self, region: str) -> None:
        import boto3
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.sagemaker.models import sagemaker_backends

        self.region = region
        self.client = boto3.client("sagemaker", region_name=region, config=aws_config())
        self.logs = boto3.client("logs", region_name=region, config=aws_config())
        self.jobs = sagemaker_backends[DEFAULT_ACCOUNT_ID][region]

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
    name (it lives as long as the driver does)."""
    from pipeline.store import S3Store, open_store

    start_moto(settings.experiment.region)
    uri = settings.store_uri()
    if not uri.startswith("s3://"):
        return S3View(open_store(uri))
    store = S3Store(uri, settings.experiment.region)
    try:
        store.client.create_bucket(Bucket=store.bucket)
    except store.client.exceptions.BucketAlreadyOwnedByYou:
        pass
    return store
