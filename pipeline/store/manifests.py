"""Folders in a store, each whole or not there: its files are uploaded one by one and a
manifest (files, sizes, sha256) is written last, with a conditional create. Readers trust only
manifested folders, so a half-written upload is never mistaken for a whole one, and a second
upload to the same versioned prefix is refused."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline.store.protocol import AlreadyExists, Incomplete, NotFound, Store, StoreError

MANIFEST = "_MANIFEST.json"


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _prefix(prefix: str) -> str:
    return prefix if not prefix or prefix.endswith("/") else prefix + "/"


def _manifest(entries: dict[str, dict], extra: dict | None) -> dict:
    """What a manifest records: each file's size and sha256, their total, when, and `extra`."""
    return {
        "files": dict(sorted(entries.items())),
        "total_bytes": sum(e["size"] for e in entries.values()),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **(extra or {}),
    }


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
    manifest = _manifest(entries, extra)
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
    manifest = _manifest(entries, extra)
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


def files_gone(store: Store, prefix: str) -> list[str]:
    """The files a complete prefix's manifest lists that are no longer there (removed by hand,
    or by a lifecycle rule); none where it is not complete (made again by whoever makes it)."""
    prefix = _prefix(prefix)
    if not is_complete(store, prefix):
        return []
    try:
        listed = read_manifest(store, prefix)["files"]
    except (ValueError, UnicodeDecodeError, KeyError, TypeError):
        return []  # a manifest that cannot be read: named by whatever reads the folder
    there = {key[len(prefix) :] for key in store.list_keys(prefix)}
    return sorted(set(listed) - there)


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
