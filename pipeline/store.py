"""The object store: a local directory (the embedded default) or S3, behind one small interface.

Keys are '/'-separated and relative to the store's root. Directories are uploaded file by
file and a manifest (files, sizes, sha256) is written last, with a conditional create:
readers trust only manifested directories, so a half-written upload is never mistaken for
a whole one, and a second upload to the same versioned prefix is refused.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

MANIFEST = "_MANIFEST.json"
FILE_MODE = 0o644  # temporaries are created 0600; what lands in the store is readable like any file


class StoreError(RuntimeError):
    pass


class NotFound(StoreError):
    pass


class AlreadyExists(StoreError):
    pass


class Incomplete(StoreError):
    pass


class Store(Protocol):
    uri: str

    def put_bytes(self, key: str, data: bytes) -> None: ...
    def create(self, key: str, data: bytes) -> bool: ...
    def get_bytes(self, key: str) -> bytes: ...
    def exists(self, key: str) -> bool: ...
    def list_keys(self, prefix: str) -> list[str]: ...
    def list_sizes(self, prefix: str) -> dict[str, int]: ...
    def list_children(self, prefix: str) -> list[str]: ...
    def fingerprints(self, prefix: str) -> dict[str, str]: ...
    def upload_file(self, path: str | os.PathLike, key: str) -> None: ...
    def download_file(self, key: str, path: str | os.PathLike) -> None: ...
    # A key's object as another key, without its bytes passing through this machine.
    def copy(self, source: str, key: str) -> None: ...
    def delete(self, key: str) -> None: ...
    def uri_of(self, key: str) -> str: ...
    # Where `key` lies on this machine when uri_of names somewhere else (the emulated bucket
    # over a local folder: pipeline/backends/emulated.py S3View); None when it says it all.
    def folder_of(self, key: str) -> str | None: ...
    def problems(self) -> list[str]: ...


def _check_key(key: str) -> str:
    parts = key.split("/")
    if key.startswith("/") or any(p in ("..", ".") for p in parts):
        raise StoreError(f"refusing key {key!r}: no absolute keys, '.' or '..'")
    return key


class LocalStore:
    """A directory tree. Writes go to a temporary file and are renamed into place."""

    def __init__(self, root: str | os.PathLike):
        # Made by the first write, not here: a dry run or a refused run leaves no folder.
        self.root = Path(root).resolve()
        self.uri = str(self.root)

    def problems(self) -> list[str]:
        """Why nothing could be written here, found without leaving anything behind."""
        existing = self.root
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            if existing == self.root:
                return [f"[experiment] STORE: {self.root} is a file, not a folder"]
            return [f"[experiment] STORE: {self.root} cannot be made: {existing} is a file"]
        try:  # a real write: permissions, a read-only mount, /proc or /sys all answer it
            fd, probe = tempfile.mkstemp(dir=existing, prefix=".smpipe-probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            return [f"[experiment] STORE: {self.root} is not writable ({e.strerror} in {existing})"]
        return []

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def uri_of(self, key: str) -> str:
        return str(self._path(key))

    def folder_of(self, key: str) -> None:
        return None  # uri_of is the folder already

    def _write_aside(self, path: Path, data: bytes) -> str:
        """The body in a hidden temporary beside `path`, flushed to disk; readers skip it.
        A write that fails (a full disk) leaves no temporary behind."""
        with self._writing(path) as tmp:
            with open(tmp, "wb") as f:
                self._fill(f, data)
                f.flush()
                os.fsync(f.fileno())
        return tmp

    @contextmanager
    def _writing(self, path: Path):
        """A hidden temporary beside `path` to write; removed, and the error said naming the
        store and the key, when writing it fails."""
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            os.fchmod(fd, FILE_MODE)
            os.close(fd)
            yield tmp
        except OSError as e:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            full = " (the disk is full)" if e.errno == errno.ENOSPC else ""
            raise StoreError(
                f"cannot write {path} in the store {self.root}: {e.strerror or e}{full}"
            ) from None

    def _fill(self, f, data: bytes) -> None:
        f.write(data)

    def _copy(self, source, tmp: str) -> None:
        shutil.copyfile(source, tmp)

    def put_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        os.replace(self._write_aside(path, data), path)

    def create(self, key: str, data: bytes) -> bool:
        # Write the body aside, then link it in: O_EXCL semantics without a window in which
        # the key exists but is empty.
        path = self._path(key)
        tmp = self._write_aside(path, data)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFound(self.uri_of(key)) from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list_keys(self, prefix: str) -> list[str]:
        base = self._path(prefix.rstrip("/")) if prefix else self.root
        if not base.is_dir():
            return []
        keys = []
        for dirpath, _, files in os.walk(base):
            for name in files:
                if name.startswith("."):  # temporaries of writes in progress
                    continue
                keys.append(Path(dirpath, name).relative_to(self.root).as_posix())
        return sorted(keys)

    def list_sizes(self, prefix: str) -> dict[str, int]:
        """key -> its size in bytes, for every key list_keys gives (a file gone meanwhile, to a
        concurrent delete, is left out)."""
        sizes = {}
        for key in self.list_keys(prefix):
            try:
                sizes[key] = self._path(key).stat().st_size
            except FileNotFoundError:
                continue
        return sizes

    def list_children(self, prefix: str) -> list[str]:
        base = self._path(prefix.rstrip("/")) if prefix else self.root
        if not base.is_dir():
            return []
        return sorted(p.name for p in base.iterdir() if p.is_dir())

    def fingerprints(self, prefix: str) -> dict[str, str]:
        """key (relative to `prefix`) -> a hash of its content."""
        return {k[len(prefix) :]: file_sha256(self._path(k)) for k in self.list_keys(prefix)}

    def upload_file(self, path: str | os.PathLike, key: str) -> None:
        dest = self._path(key)
        with self._writing(dest) as tmp:
            self._copy(path, tmp)
        os.replace(tmp, dest)

    def copy(self, source: str, key: str) -> None:
        """A hard link where the folder allows one: no key's file is ever written in place
        (put_bytes renames a new file over it), so the two never change together."""
        src, path = self._path(source), self._path(key)
        if not src.is_file():
            raise NotFound(self.uri_of(source))
        with self._writing(path) as tmp:
            os.unlink(tmp)
            try:
                os.link(src, tmp)
            except OSError:  # another file system, or one without links
                shutil.copyfile(src, tmp)
            os.replace(tmp, path)

    def download_file(self, key: str, path: str | os.PathLike) -> None:
        src = self._path(key)
        if not src.is_file():
            raise NotFound(self.uri_of(key))
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, path)

    def delete(self, key: str) -> None:
        """The file, and the folders it leaves empty: a key prefix with no keys under it does
        not exist in S3, and a listing of this store must not show one either."""
        path = self._path(key)
        path.unlink(missing_ok=True)
        for folder in path.parents:
            if folder == self.root or not folder.is_relative_to(self.root):
                break
            try:
                folder.rmdir()
            except OSError:  # not empty (or gone): the folders above it are not empty either
                break


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
        return self.prefix + _check_key(key)

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

    def problems(self, quick: bool = False) -> list[str]:
        """A bucket that does not exist or cannot be reached, before anything is written.
        `quick`: one attempt, 5 s to connect (a plan, which goes on without the store), not
        the retries a run's writes deserve (made-up keys with no route to AWS took 22 s)."""
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


def key_of(store: Store, uri: str) -> str | None:
    """The key a URI of this store names (the inverse of uri_of); None for a URI elsewhere."""
    base = store.uri_of("x")[:-1]
    return uri[len(base) :] if uri.startswith(base) else None


def artifact_key(store: Store, recorded: str) -> str | None:
    """A place Metadata recorded, as a key of this store: Metadata records keys; records of
    older runs hold URIs, understood while the store has not moved."""
    return (
        recorded
        if "://" not in recorded and not recorded.startswith("/")
        else key_of(store, recorded)
    )


def source_uri(store: Store, source: str) -> str:
    """A store key as a URI; a URI or a local folder (raw data kept elsewhere) as it is."""
    return source if "://" in source or source.startswith("/") else store.uri_of(source)


class Unreached:
    """A store `smpipe plan` could not reach, read as an experiment with nothing in it yet (no
    raw data, data versions, runs or cache) and never written: the plan says so, and goes on
    (`unreached` tells the checks that would read it as empty that it is unknown)."""

    unreached = True

    def __init__(self, store: Store, why: str) -> None:
        self._store, self.uri, self.why = store, store.uri, why

    def uri_of(self, key: str) -> str:
        return self._store.uri_of(key)

    def folder_of(self, key: str) -> str | None:
        return self._store.folder_of(key)

    def problems(self) -> list[str]:
        return []

    def get_bytes(self, key: str) -> bytes:
        raise NotFound(self.uri_of(key))

    def download_file(self, key: str, path: str | os.PathLike) -> None:
        raise NotFound(self.uri_of(key))

    def exists(self, key: str) -> bool:
        return False

    def list_keys(self, prefix: str) -> list[str]:
        return []

    def list_sizes(self, prefix: str) -> dict[str, int]:
        return {}

    def list_children(self, prefix: str) -> list[str]:
        return []

    def fingerprints(self, prefix: str) -> dict[str, str]:
        return {}

    def _refused(self, *_args) -> None:
        raise StoreError(f"{self.uri} could not be reached: a plan writes nothing")

    put_bytes = upload_file = copy = delete = _refused

    def create(self, key: str, data: bytes) -> bool:
        self._refused()
        return False


def open_store(uri: str, region: str | None = None) -> Store:
    return S3Store(uri, region) if uri.startswith("s3://") else LocalStore(uri)


# -- directories with manifests -------------------------------------------------------------


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _prefix(prefix: str) -> str:
    return prefix if not prefix or prefix.endswith("/") else prefix + "/"


def upload_dir(
    store: Store, local_dir: str | os.PathLike, prefix: str, extra: dict | None = None
) -> dict:
    """Upload every file under local_dir, then the manifest, last. Refuses an existing one."""
    prefix = _prefix(prefix)
    if store.exists(prefix + MANIFEST):
        raise AlreadyExists(
            f"{store.uri_of(prefix)} is complete already; versioned data is never overwritten"
        )
    local_dir = Path(local_dir)
    files = sorted(p for p in local_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries: dict[str, dict] = {}

    def send(path: Path) -> None:
        rel = path.relative_to(local_dir).as_posix()
        entries[rel] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
        store.upload_file(path, prefix + rel)

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(send, files))
    manifest = {
        "files": dict(sorted(entries.items())),
        "total_bytes": sum(e["size"] for e in entries.values()),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **(extra or {}),
    }
    if not store.create(prefix + MANIFEST, json.dumps(manifest, indent=2).encode()):
        raise AlreadyExists(f"{store.uri_of(prefix)} was completed by another writer meanwhile")
    return manifest


def seal_prefix(store: Store, prefix: str, extra: dict | None = None) -> dict | None:
    """Write the manifest of files someone else uploaded (a SageMaker job's outputs): each
    one is read back and hashed, so the manifest says the same whoever wrote the files.
    None when nothing is there."""
    prefix = _prefix(prefix)
    if is_complete(store, prefix):
        return read_manifest(store, prefix)
    keys = [k for k in store.list_keys(prefix) if k != prefix + MANIFEST]
    if not keys:
        return None
    entries = {}
    with tempfile.TemporaryDirectory(prefix="smpipe-seal-") as tmp:
        for i, key in enumerate(keys):
            path = Path(tmp) / str(i)
            store.download_file(key, path)
            entries[key[len(prefix) :]] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
            path.unlink()
    manifest = {
        "files": dict(sorted(entries.items())),
        "total_bytes": sum(e["size"] for e in entries.values()),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **(extra or {}),
    }
    store.create(prefix + MANIFEST, json.dumps(manifest, indent=2).encode())
    return manifest


def read_manifest(store: Store, prefix: str) -> dict:
    prefix = _prefix(prefix)
    try:
        return json.loads(store.get_bytes(prefix + MANIFEST))
    except NotFound:
        raise Incomplete(
            f"{store.uri_of(prefix)} has no {MANIFEST}: it is missing or its upload never finished"
        ) from None


def is_complete(store: Store, prefix: str) -> bool:
    return store.exists(_prefix(prefix) + MANIFEST)


def verify_dir(local_dir: str | os.PathLike) -> None:
    """Check every manifested directory inside a downloaded folder against its manifest."""
    for manifest_path in Path(local_dir).rglob(MANIFEST):
        manifest = json.loads(manifest_path.read_text())
        for rel, entry in manifest["files"].items():
            path = manifest_path.parent / rel
            if not path.is_file() or path.stat().st_size != entry["size"]:
                raise StoreError(f"{path} is missing or does not match its manifest")
            if file_sha256(path) != entry["sha256"]:
                raise StoreError(f"{path} does not match its manifest's sha256")


def download_dir(
    store: Store, prefix: str, local_dir: str | os.PathLike, verify: bool = True
) -> dict:
    """Download a manifested directory; every file is checked against the manifest."""
    prefix = _prefix(prefix)
    manifest = read_manifest(store, prefix)
    local_dir = Path(local_dir)
    local_dir.mkdir(parents=True, exist_ok=True)

    def fetch(item: tuple[str, dict]) -> None:
        rel, entry = item
        dest = local_dir / rel
        store.download_file(prefix + rel, dest)
        if dest.stat().st_size != entry["size"] or (
            verify and file_sha256(dest) != entry["sha256"]
        ):
            raise StoreError(f"{store.uri_of(prefix + rel)} does not match its manifest")

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(fetch, manifest["files"].items()))
    return manifest
