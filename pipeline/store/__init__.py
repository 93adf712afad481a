"""The object store: a local directory (the embedded default) or S3, behind one small interface.
Everything a holder of a store needs is imported from here; by concern:

    protocol.py   what a store is (`Store`), its errors, its keys and their URIs
    local.py      `LocalStore`: a folder on this machine, every write renamed into place
    s3.py         `S3Store`: S3 or any S3 endpoint; `aws_config`, every AWS client's retries
    manifests.py  folders whole or not there: uploaded, then a manifest written last
    unreached.py  `Unreached`: a store `smpipe plan` could not reach, read as empty
"""

from __future__ import annotations

from pipeline.store.local import FILE_MODE, LocalStore
from pipeline.store.manifests import (
    MANIFEST,
    download_dir,
    file_sha256,
    files_gone,
    is_complete,
    read_manifest,
    seal_prefix,
    upload_dir,
    verify_dir,
)
from pipeline.store.protocol import (
    AlreadyExists,
    Incomplete,
    NotFound,
    Store,
    StoreError,
    artifact_key,
    key_of,
    source_uri,
)
from pipeline.store.s3 import S3Store, aws_config
from pipeline.store.unreached import Unreached

__all__ = [
    "FILE_MODE",
    "MANIFEST",
    "AlreadyExists",
    "Incomplete",
    "LocalStore",
    "NotFound",
    "S3Store",
    "Store",
    "StoreError",
    "Unreached",
    "artifact_key",
    "aws_config",
    "download_dir",
    "file_sha256",
    "files_gone",
    "is_complete",
    "key_of",
    "open_store",
    "read_manifest",
    "seal_prefix",
    "source_uri",
    "upload_dir",
    "verify_dir",
]


def open_store(uri: str, region: str | None = None) -> Store:
    """The store a URI names: S3 for s3://, a folder otherwise."""
    return S3Store(uri, region) if uri.startswith("s3://") else LocalStore(uri)
