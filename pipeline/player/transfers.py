"""What SageMaker moves between S3 and a job's instances: inputs in, checkpoints both ways,
outputs up (a folder as it is, or a training job's model.tar.gz and output.tar.gz), and what a
container prints to CloudWatch Logs."""

from __future__ import annotations

import io
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline.raw_data import is_hidden
from pipeline.store import (
    NotFound,
    Store,
    StoreError,
    key_of,
    open_store,
    verify_dir,
)


def fetch_input(store: Store, uri: str, local: Path, shard: tuple[int, int] = (0, 1)) -> None:
    """An S3Prefix input as SageMaker downloads it: every object whose key begins with the
    prefix ("SageMaker uses all objects that match the specified key name prefix",
    API_S3DataSource.html, S3DataType; "all objects with the specified key name prefix",
    API_ProcessingS3Input.html), a manifested folder's `_MANIFEST.json` included, to the same
    path under `local`. Then any manifest among them
    is checked against the files it lists (the driver's own check: a folder that does not
    match its manifest is refused, not SageMaker's). Raw data the user keeps elsewhere
    (another bucket or folder) is read there.

    `shard` (this host's index, the hosts) is a ShardedByS3Key input on several instances:
    "sharded by Amazon S3 key, downloading one shard of data to each processing instance"
    (API_ProcessingS3Input). Which objects make a shard is not documented; here the keys in
    order, dealt out in turn (the i-th to host i mod n). A shard is not the whole folder its
    manifest lists, so it is not checked against it; it may be empty."""
    key = key_of(store, uri)
    elsewhere = key is None
    if elsewhere:
        store, key = open_store(uri), ""
    index, count = shard
    keys = store.list_keys(key)
    if elsewhere and "://" not in uri:
        # A folder on this machine (the local backend's RAW_DATA): its hidden files and
        # folders are not data, as everywhere (pipeline/raw_data.py).
        keys = [k for k in keys if not is_hidden(k)]
    if not keys:
        raise NotFound(f"nothing at {store.uri_of(key) if key else store.uri}")
    local.mkdir(parents=True, exist_ok=True)

    def fetch(k: str) -> None:
        store.download_file(k, local / k[len(key) :].lstrip("/"))

    with ThreadPoolExecutor(max_workers=8) as pool:  # as download_dir moves a folder
        list(pool.map(fetch, sorted(keys)[index::count]))
    if count == 1:
        verify_dir(local)


class CheckpointSync:
    """/opt/ml/checkpoints kept in step with CheckpointConfig.S3Uri as SageMaker keeps it
    (https://docs.aws.amazon.com/sagemaker/latest/dg/model-checkpoints.html): when the job
    starts, everything under the URI is copied into every host's folder; what a host writes
    there is uploaded, and what it deletes of what it had is deleted in S3. Nothing else is
    touched: the files of other jobs under the same URI (every trial of a tuning job shares
    one) stay as they are. Played when the container exits, where SageMaker also syncs while it
    runs; temporary files of a checkpoint cut short are not uploaded."""

    def __init__(self, store: Store, prefix: str | None, folders: list[Path]) -> None:
        self.store, self.prefix, self.folders = store, prefix, folders  # None: no checkpoints
        self.had: dict[Path, dict[str, tuple[int, int]]] = {}

    def _files(self, folder: Path) -> dict[str, tuple[int, int]]:
        found = {}
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(folder).as_posix()
            if path.is_file() and ".tmp" not in rel and not path.name.startswith("."):
                stat = path.stat()
                found[rel] = (stat.st_size, stat.st_mtime_ns)
        return found

    def down(self) -> None:
        keys = self.store.list_keys(self.prefix) if self.prefix is not None else []
        for folder in self.folders:
            for key in keys:
                self.store.download_file(key, folder / key[len(self.prefix) :])
            self.had[folder] = self._files(folder)

    def up(self) -> None:
        if self.prefix is None:
            return
        # A file several hosts wrote: the first host's (which one SageMaker's sync keeps is
        # undocumented).
        written: dict[str, Path] = {}
        deleted: set[str] = set()
        for folder in self.folders:
            now, had = self._files(folder), self.had.get(folder, {})
            for rel, stamp in now.items():
                if had.get(rel) != stamp:
                    written.setdefault(rel, folder / rel)
            deleted |= set(had) - set(now)
        pointers = [rel for rel in written if rel.rsplit("/", 1)[-1] == "CURRENT"]
        for rel in [r for r in written if r not in pointers] + pointers:  # pointers last
            self.store.upload_file(written[rel], self.prefix + rel)
        for rel in sorted(deleted - set(written)):
            self.store.delete(self.prefix + rel)
        for folder in self.folders:
            self.had[folder] = self._files(folder)


def checkpoint_prefix(request: dict, store: Store) -> str | None:
    """Where CheckpointConfig keeps the job's checkpoints in the store; None without one
    (CheckpointConfig is optional in CreateTrainingJob: nothing is synced)."""
    if not request.get("CheckpointConfig"):
        return None
    uri = request["CheckpointConfig"]["S3Uri"]
    base = key_of(store, uri)
    if base is None:
        raise StoreError(f"checkpoints outside the store: {uri}")
    return base.rstrip("/") + "/"


def _prefix(store: Store, uri: str) -> str:
    key = key_of(store, uri)
    if key is None:
        raise ValueError(f"{uri} is outside the store {store.uri}")
    return key.rstrip("/") + "/"


def upload_folder(store: Store, local: Path, uri: str) -> None:
    """A processing output: every file under `local` to the same path under `uri`."""
    prefix = _prefix(store, uri)
    for path in sorted(local.rglob("*")):
        if path.is_file():
            store.upload_file(path, prefix + path.relative_to(local).as_posix())


def upload_tarball(store: Store, local: Path, uri: str) -> None:
    """A training job's model/ or output/data/ as one gzipped tarball at `uri`
    (<S3OutputPath>/<job>/output/model.tar.gz and output.tar.gz). gzip at level 0 (stored
    blocks, still gzip): a model's weights barely compress at any level, and deflating them
    is most of the time writing and reading such a tarball takes (docs/performance.md); any
    level reads back the same files."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=0) as tar:
        for path in sorted(local.rglob("*")):
            if path.is_file():
                tar.add(path, arcname=path.relative_to(local).as_posix())
    store.put_bytes(_prefix(store, uri).rstrip("/"), buffer.getvalue())


class LogStream:
    """What one host of a job prints, as SageMaker sends it to CloudWatch Logs."""

    def __init__(self, logs, group: str, stream: str):
        self.logs, self.group, self.stream = logs, group, stream
        try:
            logs.create_log_group(logGroupName=group)
        except logs.exceptions.ResourceAlreadyExistsException:
            pass
        logs.create_log_stream(logGroupName=group, logStreamName=stream)

    def write(self, text: str) -> None:
        events = [
            {"timestamp": int(time.time() * 1000), "message": line}
            for line in text.splitlines()
            if line
        ]
        if events:
            self.logs.put_log_events(
                logGroupName=self.group, logStreamName=self.stream, logEvents=events
            )
