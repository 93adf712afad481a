"""The store as a folder on this machine: the embedded default, and what the emulated S3
serves. Every write lands whole: its body goes to a hidden temporary beside the key, is
flushed to disk, then renamed (or linked) into place."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from pipeline.store.manifests import file_sha256
from pipeline.store.protocol import NotFound, StoreError, check_key

FILE_MODE = 0o644  # temporaries are created 0600; what lands in the store is readable like any file


class LocalStore:
    """A directory tree. Writes go to a temporary file and are renamed into place."""

    def __init__(self, root: str | os.PathLike):
        # Made by the first write, not here: a dry run or a refused run leaves no folder.
        self.root = Path(root).resolve()
        self.uri = str(self.root)

    def problems(self, writing: bool = True) -> list[str]:
        """Why nothing could be written here (or, not `writing`, read), found without leaving
        anything behind."""
        existing = self.root
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            if existing == self.root:
                return [f"[experiment] STORE: {self.root} is a file, not a folder"]
            return [f"[experiment] STORE: {self.root} cannot be made: {existing} is a file"]
        if not writing:  # one that lists: the folder read as a listing reads it
            if existing == self.root and not os.access(self.root, os.R_OK | os.X_OK):
                return [f"[experiment] STORE: {self.root} cannot be read (Permission denied)"]
            return []
        try:  # a real write: permissions, a read-only mount, /proc or /sys all answer it
            fd, probe = tempfile.mkstemp(dir=existing, prefix=".smpipe-probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            return [f"[experiment] STORE: {self.root} is not writable ({e.strerror} in {existing})"]
        return []

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def uri_of(self, key: str) -> str:
        return str(self._path(key))

    def folder_of(self, key: str) -> None:
        return None  # uri_of is the folder already

    def _write_body(self, tmp: str, data: bytes) -> None:
        """The body in the temporary `_writing` gave, flushed to disk before it is renamed."""
        with open(tmp, "wb") as f:
            self._fill(f, data)
            f.flush()
            os.fsync(f.fileno())

    @contextmanager
    def _writing(self, path: Path):
        """A hidden temporary beside `path` to write and rename into place within the block;
        removed when anything in the block fails or is stopped (Ctrl-C, SIGTERM), the rename
        included, and a failure said naming the store and the key. Its name
        holds at most the first 64 bytes of `path`'s, so that a name near the file system's
        limit (255 bytes) still has one."""
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            short = os.fsdecode(os.fsencode(path.name)[:64])  # bytes: a character may be 4
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{short}.")
            os.fchmod(fd, FILE_MODE)
            os.close(fd)
            yield tmp
        except BaseException as e:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            if not isinstance(e, OSError):
                raise
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
        with self._writing(path) as tmp:
            self._write_body(tmp, data)
            os.replace(tmp, path)

    def create(self, key: str, data: bytes) -> bool:
        # Write the body aside, then link it in: O_EXCL semantics without a window in which
        # the key exists but is empty.
        path = self._path(key)
        with self._writing(path) as tmp:
            self._write_body(tmp, data)
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
