"""The object store: S3 (moto's server) and a local directory behind one interface."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.store import (
    MANIFEST,
    AlreadyExists,
    Incomplete,
    LocalStore,
    NotFound,
    S3Store,
    StoreError,
    download_dir,
    is_complete,
    read_manifest,
    upload_dir,
)
from tests.conftest import ROOT


@pytest.fixture(params=["s3", "local"])
def store(request, tmp_path):
    if request.param == "s3":
        bucket = request.getfixturevalue("bucket")
        return S3Store(f"s3://{bucket}/prefix")
    return LocalStore(tmp_path / "store")


def make_tree(root: Path, files: int = 5, size: int = 1000) -> dict[str, bytes]:
    content = {}
    for i in range(files):
        rel = f"sub{i % 2}/file-{i}.bin"
        data = os.urandom(size + i)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        content[rel] = data
    return content


def test_bytes_round_trip_and_conditional_create(store):
    store.put_bytes("a/b.txt", b"one")
    assert store.get_bytes("a/b.txt") == b"one"
    assert store.exists("a/b.txt") and not store.exists("a/c.txt")
    assert store.create("a/new.txt", b"first") is True
    assert store.create("a/new.txt", b"second") is False
    assert store.get_bytes("a/new.txt") == b"first"
    with pytest.raises(NotFound):
        store.get_bytes("a/missing.txt")
    assert store.list_keys("a/") == ["a/b.txt", "a/new.txt"]
    assert store.list_children("") == ["a"]


def test_sizes_come_with_the_listing(store):
    store.put_bytes("run/a.bin", bytes(1234))
    store.put_bytes("run/deep/b.bin", bytes(5))
    store.put_bytes("run/empty", b"")
    store.put_bytes("other/c.bin", bytes(7))
    if isinstance(store, LocalStore):  # a write in progress is no key, and has no size
        (store.root / "run/.a.bin.tmp").write_bytes(bytes(99))
    assert store.list_sizes("run/") == {"run/a.bin": 1234, "run/deep/b.bin": 5, "run/empty": 0}
    assert list(store.list_sizes("run/")) == store.list_keys("run/")
    assert store.list_sizes("nothing/") == {}


def test_directory_round_trip_with_manifest(store, tmp_path):
    content = make_tree(tmp_path / "src")
    manifest = upload_dir(store, tmp_path / "src", "data/v1/", {"rows": 5})
    assert manifest["rows"] == 5 and set(manifest["files"]) == set(content)
    assert is_complete(store, "data/v1/")
    download_dir(store, "data/v1/", tmp_path / "dst")
    for rel, data in content.items():
        assert (tmp_path / "dst" / rel).read_bytes() == data
    assert read_manifest(store, "data/v1")["files"]["sub0/file-0.bin"]["size"] == 1000


def test_versioned_directory_is_never_overwritten(store, tmp_path):
    make_tree(tmp_path / "src")
    upload_dir(store, tmp_path / "src", "data/v1/")
    before = store.get_bytes("data/v1/sub0/file-0.bin")
    (tmp_path / "src/sub0/file-0.bin").write_bytes(b"changed")
    with pytest.raises(AlreadyExists, match="never overwritten"):
        upload_dir(store, tmp_path / "src", "data/v1/")
    assert store.get_bytes("data/v1/sub0/file-0.bin") == before


def test_a_directory_without_manifest_is_not_read(store, tmp_path):
    make_tree(tmp_path / "src", files=2)
    store.upload_file(tmp_path / "src/sub0/file-0.bin", "half/sub0/file-0.bin")
    assert not is_complete(store, "half/")
    with pytest.raises(Incomplete, match="upload never finished"):
        download_dir(store, "half/", tmp_path / "dst")


def test_a_file_that_does_not_match_its_manifest_is_refused(tmp_path):
    store = LocalStore(tmp_path / "store")
    make_tree(tmp_path / "src", files=2)
    upload_dir(store, tmp_path / "src", "v/")
    (tmp_path / "store/v/sub0/file-0.bin").write_bytes(b"tampered")
    with pytest.raises(StoreError, match="does not match its manifest"):
        download_dir(store, "v/", tmp_path / "dst")


def test_keys_cannot_escape_the_store(tmp_path):
    store = LocalStore(tmp_path / "store")
    for key in ("../x", "a/../../x", "/etc/passwd"):
        with pytest.raises(StoreError):
            store.put_bytes(key, b"x")


UPLOADER = """
import sys, time
from pipeline.store import S3Store, upload_dir

class SlowStore(S3Store):  # a slow network: every file takes a while
    def upload_file(self, path, key):
        time.sleep(0.05)
        super().upload_file(path, key)

upload_dir(SlowStore(sys.argv[1]), sys.argv[2], "big/")
print("finished")
"""


def test_killed_upload_leaves_no_manifest(bucket, tmp_path):
    store = S3Store(f"s3://{bucket}")
    make_tree(tmp_path / "src", files=300, size=2000)
    proc = subprocess.Popen([sys.executable, "-c", UPLOADER, f"s3://{bucket}", str(tmp_path / "src")], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.time() + 60
    while len(store.list_keys("big/")) < 20 and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    out, err = proc.communicate()
    uploaded = store.list_keys("big/")
    assert b"finished" not in out, "the upload finished before it could be killed"
    assert 20 <= len(uploaded) < 300
    assert f"big/{MANIFEST}" not in uploaded
    with pytest.raises(Incomplete):
        download_dir(store, "big/", tmp_path / "dst")


def test_stored_files_are_not_private_temporaries(tmp_path):
    store = LocalStore(tmp_path / "store")
    store.put_bytes("a.txt", b"x")
    (tmp_path / "f.bin").write_bytes(b"y")
    store.upload_file(tmp_path / "f.bin", "b/f.bin")
    assert store.create("c.txt", b"z")
    for key in ("a.txt", "b/f.bin", "c.txt"):
        assert (tmp_path / "store" / key).stat().st_mode & 0o777 == 0o644


def test_a_local_store_leaves_no_empty_folders_behind(tmp_path):
    """As in S3, a prefix with no keys under it is gone: deleting a folder's last file removes
    the folders it leaves empty (a tuning job's tidied trials leave no empty trees)."""
    from pipeline.store import LocalStore

    store = LocalStore(tmp_path / "store")
    store.put_bytes("a/b/c/one.txt", b"1")
    store.put_bytes("a/keep.txt", b"2")
    store.delete("a/b/c/one.txt")
    assert not (tmp_path / "store/a/b").exists() and (tmp_path / "store/a/keep.txt").exists()
    store.delete("a/keep.txt")
    assert (tmp_path / "store").is_dir() and not (tmp_path / "store/a").exists()


def test_a_name_near_the_file_systems_limit_is_stored_and_a_stopped_write_leaves_nothing(
    tmp_path, monkeypatch
):
    """The hidden temporary was `.<name>.<random>`: a name of 247 bytes or more, which the file
    system allows, could not be stored ("File name too long") and failed every retry. And a
    write stopped by Ctrl-C or SIGTERM left its temporary in the store for good."""
    store = LocalStore(tmp_path / "store")
    long = "a" * 251 + ".csv"
    source = tmp_path / long
    source.write_bytes(b"id,text\n")
    store.upload_file(source, f"raw/{long}")
    assert store.get_bytes(f"raw/{long}") == b"id,text\n"

    def stopped(self, source, tmp):
        Path(tmp).write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(LocalStore, "_copy", stopped)
    with pytest.raises(KeyboardInterrupt):
        store.upload_file(source, "raw/other.csv")
    assert sorted(p.name for p in (tmp_path / "store/raw").iterdir()) == [long]


@pytest.mark.parametrize("write", ["put_bytes", "create", "upload_file", "copy"])
def test_a_write_stopped_just_before_its_rename_leaves_no_temporary(tmp_path, monkeypatch, write):
    """The rename into place came after the temporary's cleanup: a Ctrl-C between the two left
    `.<name>.<random>` in the store for good."""
    store = LocalStore(tmp_path / "store")
    store.put_bytes("raw/a.csv", b"id,text\n")
    (tmp_path / "b.csv").write_bytes(b"id,text\n1,x\n")

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", stopped)
    monkeypatch.setattr(os, "link", stopped)
    with pytest.raises(KeyboardInterrupt):
        {
            "put_bytes": lambda: store.put_bytes("raw/b.csv", b"x"),
            "create": lambda: store.create("raw/b.csv", b"x"),
            "upload_file": lambda: store.upload_file(tmp_path / "b.csv", "raw/b.csv"),
            "copy": lambda: store.copy("raw/a.csv", "raw/b.csv"),
        }[write]()
    assert sorted(p.name for p in (tmp_path / "store/raw").iterdir()) == ["a.csv"]


def test_a_store_read_only_to_this_user_lists_and_one_it_cannot_read_is_named(
    tmp_path, monkeypatch
):
    """`runs` on a store this user may not read failed with a PermissionError traceback once
    listing no longer asked for a write. (Root reads any folder: os.access answers as a user
    whose mode bits forbid it would be answered.)"""
    store = LocalStore(tmp_path / "store")
    store.put_bytes("exp/runs/0001/CLAIM", b"{}")
    assert store.problems(writing=False) == []
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert store.problems(writing=False) == [
        f"[experiment] STORE: {store.root} cannot be read (Permission denied)"
    ]
    emoji = "\U0001f600" * 62  # 248 bytes: a name the file system allows
    store.put_bytes(f"raw/{emoji}", b"x")
    assert store.get_bytes(f"raw/{emoji}") == b"x"
