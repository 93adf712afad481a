"""The store on S3, or any S3 endpoint, and the one retry policy of every AWS client of the
driver (`aws_config`)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from pipeline.store.protocol import NotFound, StoreError, check_key


def aws_config(attempts: int = 10, **extra):
    """Every AWS client of the driver (S3, SageMaker, CloudWatch Logs) retries the same way:
    botocore's standard mode (exponential backoff with jitter on 5xx, throttling such as 503
    SlowDown, and dropped connections), 10 attempts. Permanent errors (403, 404) are not
    retried: they fail at once, naming what was asked for. `attempts`: fewer only for a
    question whose answer is optional (a plan's look at the store, `smpipe iam`'s at the
    bucket's encryption), where a lost connection must not cost minutes."""
    from botocore.config import Config

    return Config(retries={"max_attempts": attempts, "mode": "standard"}, **extra)


class S3Store:
    """S3 or any S3 endpoint (AWS_ENDPOINT_URL, e.g. moto's server). Large files go through
    boto3's transfer manager (multipart, concurrent parts). An error that retries did not
    cure becomes a StoreError naming the operation, bucket and key."""

    def __init__(self, uri: str, region: str | None = None, client=None):
        if not uri.startswith("s3://"):
            raise StoreError(f"not an s3 uri: {uri}")
        bucket, _, prefix = uri[5:].partition("/")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        if client is None:
            import boto3

            # Directories move with 8 threads, each file with up to 8 parts: room for all of them.
            client = boto3.client(
                "s3",
                region_name=region or os.environ.get("AWS_DEFAULT_REGION"),
                config=aws_config(max_pool_connections=64),
            )
        self.client = client
        from boto3.s3.transfer import TransferConfig

        self.transfer = TransferConfig(multipart_threshold=64 << 20, max_concurrency=8)

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    @contextmanager
    def _named(self, operation: str, key: str):
        """botocore's and boto3's errors as one StoreError: what, where, and S3's own words."""
        from boto3.exceptions import S3TransferFailedError, S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except ClientError as e:
            error = e.response.get("Error", {})
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if operation in ("get", "download") and error.get("Code") in ("NoSuchKey", "404"):
                raise NotFound(self.uri_of(key)) from None
            raise StoreError(
                f"S3 {operation} of {self.uri_of(key)} failed: {error.get('Code') or status} "
                f"({error.get('Message') or e})"
            ) from None
        except (BotoCoreError, S3UploadFailedError, S3TransferFailedError) as e:
            raise StoreError(f"S3 {operation} of {self.uri_of(key)} failed: {e}") from None

    def problems(self, writing: bool = True, quick: bool = False) -> list[str]:
        """A bucket that does not exist or cannot be reached, before anything is written (or
        read: `writing` asks nothing more of it here; a write it may not make is said by S3
        when made). `quick`: one attempt, 5 s to connect (a plan, which goes on without the
        store), not the retries a run's writes deserve (made-up keys with no route to AWS took
        22 s)."""
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.client
        if quick:
            import boto3

            client = boto3.session.Session().client(  # credentials found anew, not cached
                "s3",
                region_name=client.meta.region_name,
                config=aws_config(attempts=1, connect_timeout=5, read_timeout=10),
            )
        try:
            client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            why = {404: "no such bucket", 403: "access denied"}.get(status, str(e))
            return [f"[experiment] STORE: {self.uri}: {why}"]
        except BotoCoreError as e:
            return [f"[experiment] STORE: {self.uri} cannot be reached ({e})"]
        return []

    def uri_of(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"

    def folder_of(self, key: str) -> None:
        return None  # on S3, not on this machine

    def put_bytes(self, key: str, data: bytes) -> None:
        with self._named("put", key):
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def create(self, key: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        with self._named("conditional put", key):
            try:
                self.client.put_object(
                    Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*"
                )
                return True
            except ClientError as e:
                code = e.response.get("Error", {}).get("Code", "")
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                # 412: the key exists. 409: another conditional write to it is in flight.
                if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (
                    409,
                    412,
                ):
                    return False
                raise

    def get_bytes(self, key: str) -> bytes:
        with self._named("get", key):
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        with self._named("head", key):
            try:
                self.client.head_object(Bucket=self.bucket, Key=self._key(key))
                return True
            except ClientError as e:
                if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                    return False
                raise

    def list_keys(self, prefix: str) -> list[str]:
        keys = []
        with self._named("list", prefix):
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                for obj in page.get("Contents", []):
                    keys.append(obj["Key"][len(self.prefix) :])
        return sorted(keys)

    def list_sizes(self, prefix: str) -> dict[str, int]:
        """key -> its size in bytes, from the listing itself (ListObjectsV2 gives each
        object's Size): nothing is downloaded or asked per key."""
        sizes = {}
        with self._named("list", prefix):
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                for obj in page.get("Contents", []):
                    sizes[obj["Key"][len(self.prefix) :]] = obj["Size"]
        return dict(sorted(sizes.items()))

    def list_children(self, prefix: str) -> list[str]:
        prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        names = []
        with self._named("list", prefix):
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(
                Bucket=self.bucket, Prefix=self.prefix + prefix, Delimiter="/"
            ):
                for p in page.get("CommonPrefixes", []):
                    names.append(p["Prefix"][len(self.prefix + prefix) :].rstrip("/"))
        return sorted(names)

    def fingerprints(self, prefix: str) -> dict[str, str]:
        """key (relative to `prefix`) -> ETag and size: S3's own hash of the content (of
        each part, for a multipart upload), so nothing is downloaded to tell."""
        found = {}
        with self._named("list", prefix):
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                for obj in page.get("Contents", []):
                    found[obj["Key"][len(self.prefix + prefix) :]] = f"{obj['ETag']} {obj['Size']}"
        return found

    def upload_file(self, path: str | os.PathLike, key: str) -> None:
        with self._named("upload", key):
            self.client.upload_file(str(path), self.bucket, self._key(key), Config=self.transfer)

    def copy(self, source: str, key: str) -> None:
        """S3's own copy (CopyObject, in parts above the transfer threshold: a single
        CopyObject takes at most 5 GB, https://docs.aws.amazon.com/AmazonS3/latest/API/
        API_CopyObject.html); needs s3:GetObject on the source and s3:PutObject here."""
        with self._named("copy", key):
            self.client.copy(
                {"Bucket": self.bucket, "Key": self._key(source)},
                self.bucket,
                self._key(key),
                Config=self.transfer,
            )

    def download_file(self, key: str, path: str | os.PathLike) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with self._named("download", key):
            self.client.download_file(self.bucket, self._key(key), str(path), Config=self.transfer)

    def delete(self, key: str) -> None:
        with self._named("delete", key):
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
