"""What a store is to those that hold one: the `Store` protocol, its errors, and keys.

Keys are '/'-separated and relative to the store's root; `check_key` refuses any other. A key
and the URI a store gives it convert both ways on any store (`key_of`, `artifact_key`,
`source_uri`).
"""

from __future__ import annotations

import os
from typing import Protocol


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
    # over a local folder: pipeline/backends/emulated/account.py S3View); None when it says it all.
    def folder_of(self, key: str) -> str | None: ...
    # Why the store cannot be used, before anything is done; `writing`: to be written to (a
    # command that only lists reads a store it may not write).
    def problems(self, writing: bool = True) -> list[str]: ...


def check_key(key: str) -> str:
    """`key`, refused unless it stays under the store's root."""
    parts = key.split("/")
    if key.startswith("/") or any(p in ("..", ".") for p in parts):
        raise StoreError(f"refusing key {key!r}: no absolute keys, '.' or '..'")
    return key


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
