"""What `smpipe plan` reads in place of a store it could not reach: nothing, and nothing written."""

from __future__ import annotations

import os

from pipeline.store.protocol import NotFound, Store, StoreError


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

    def problems(self, writing: bool = True) -> list[str]:
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
