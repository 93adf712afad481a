"""Raw data by content: which files of a folder are data, what they hold, and how they reach the
store. Nothing here decides by names alone.

A file's content is its size and sha256. The store holds raw data in two places: raw/ (the
user's, from `smpipe upload`, never written over; raw.json records it) and
raw-versions/<digest>/ (a local RAW_DATA folder for jobs that cannot read this machine).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import NOT_UTF8, PipelineError, as_bytes, counted, log, not_utf8
from pipeline.paths import ExperimentTree, RawVersion
from pipeline.runs import held
from pipeline.store import MANIFEST, NotFound, Store, file_sha256, is_complete

# Names the store gives its own files inside a folder it reads (store.verify_dir and
# download_dir take any of them for a manifest). Its temporaries are hidden, so never data.
RESERVED = (MANIFEST,)
SHOWN = 10  # files named in one message; the rest are counted


@dataclass(frozen=True)
class Content:
    """What a file holds. sha256 is "" where it was not read: a file of the store that differs
    from the folder's by its size already, or that the folder does not have."""

    size: int
    sha256: str


def is_hidden(rel: str) -> bool:
    """A relative, '/'-separated path with a name on it that starts with a dot: not data
    (`.DS_Store`, `.git/`, an editor's swap file, the store's own temporaries `.<name>.<random>`).

    Hugging Face `datasets` resolves data files the same way: "Hidden files and directories
    (i.e. whose names start with a dot) are ignored, unless they are explicitly requested"
    (datasets 5.2.0, src/datasets/data_files.py: `resolve_pattern`'s docstring, and
    `_is_unrequested_hidden_file_or_is_inside_unrequested_hidden_dir`, applied to every match),
    so a `reconcile` that calls `load_dataset(..., data_dir=raw_dir)` never reads them either.
    The rule holds on every side of every comparison: the folder, the store's raw/, a raw
    version, the local job's copy of a folder (pipeline/player/transfers.py `fetch_input`), the
    cache key (pipeline/cache.py `raw_digest`) and `smpipe predict` (pipeline/predict/files.py)."""
    return any(part.startswith(".") for part in rel.split("/"))


def data_files(folder: Path) -> tuple[dict[str, Path], list[str]]:
    """The data files of `folder` (path relative to it -> file, in order), and what keeps it
    from being raw data, each naming the file.

    A data file is every file not hidden (`is_hidden`), a link to a file read as that file.
    Refused by name, before anything is written: a file named as the store names its own
    (`_MANIFEST.json`: a reader would take it for its folder's manifest), a link to a folder
    (no side follows one), anything that is not a readable file (a broken link)."""
    files: dict[str, Path] = {}
    problems: list[str] = []

    def unreadable(error: OSError) -> None:  # os.walk skips such a folder without a word
        rel = Path(error.filename).relative_to(folder).as_posix()
        if rel == "." or not is_hidden(rel):  # "." is the folder itself
            problems.append(f"{rel}: its folder cannot be read ({error.strerror})")

    # Links to folders: listed, not entered.
    for dirpath, dirnames, filenames in os.walk(folder, onerror=unreadable):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in dirnames:
            if (here / name).is_symlink():
                rel = (here / name).relative_to(folder).as_posix()
                problems.append(f"{rel} is a link to a folder, which is not followed (copy it in)")
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            path = here / name
            rel = path.relative_to(folder).as_posix()
            if not_utf8(rel):
                problems.append(f"{as_bytes(rel)} {NOT_UTF8}")
            elif name in RESERVED:
                problems.append(
                    f"{rel}: the store names its own manifests {name} and would take this file "
                    "for one; rename it"
                )
            elif not path.is_file():
                what = "a link that leads nowhere" if path.is_symlink() else "a pipe or device"
                problems.append(f"{rel} is not a file that can be read ({what})")
            else:
                files[rel] = path
    return dict(sorted(files.items())), problems


def folder_problems(folder: Path) -> list[str]:
    """Why `folder` cannot be raw data, each problem naming the folder or its file."""
    if not folder.exists():
        return [f"{folder}: no such folder"]
    if not folder.is_dir():
        return [f"{folder} is a file: raw data is a folder of files"]
    files, problems = data_files(folder)
    if not files and not problems:
        return [f"{folder} is not a folder with files in it (hidden files are not data)"]
    return [f"{folder}/{problem}" for problem in problems]


def checked_files(folder: Path, where: str) -> dict[str, Path]:
    problems = folder_problems(folder)
    if problems:
        raise PipelineError(f"{where}: " + "; ".join(problems))
    return data_files(folder)[0]


def contents(files: dict[str, Path]) -> dict[str, Content]:
    """Each file's size and sha256; a file gone or unreadable since the folder was listed (an
    edit while the driver hashes it) is named, never a traceback."""
    found = {}
    for rel, path in files.items():
        try:
            found[rel] = Content(path.stat().st_size, file_sha256(path))
        except OSError as e:
            raise PipelineError(
                f"{path}: could not be read while the raw data was hashed ({e.strerror or e}): "
                "the folder changed while it was read; run again once it holds what it should"
            ) from None
    return found


def stamps(files: dict[str, Path]) -> dict[str, tuple[int, int]]:
    """Each file's size and modification time: an edit while it is read or uploaded shows."""
    found = {}
    for rel, path in files.items():
        try:
            stat = path.stat()
        except OSError:
            found[rel] = (-1, -1)
            continue
        found[rel] = (stat.st_size, stat.st_mtime_ns)
    return found


def content_digest(found: dict[str, Content]) -> str:
    """sha256 of the sorted (path, size, sha256) of every data file: the same files with the
    same bytes give the same digest wherever the folder is."""
    listing = [[rel, c.size, c.sha256] for rel, c in sorted(found.items())]
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()


def folder_digest(folder: Path) -> str:
    return content_digest(contents(data_files(folder)[0]))


def differences(stored: dict[str, Content], found: dict[str, Content]) -> dict[str, list[str]]:
    """The files that differ between the store (`stored`) and the folder (`found`), by how:
    changed, added (only in the folder), removed (only in the store)."""
    kinds: dict[str, list[str]] = {"changed": [], "added": [], "removed": []}
    for rel in sorted(set(stored) | set(found)):
        if rel not in stored:
            kinds["added"].append(rel)
        elif rel not in found:
            kinds["removed"].append(rel)
        elif stored[rel] != found[rel]:
            kinds["changed"].append(rel)
    return {kind: names for kind, names in kinds.items() if names}


def named(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def differences_text(differ: dict[str, list[str]]) -> str:
    return "; ".join(f"{kind}: {named(names)}" for kind, names in differ.items())


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def send(store: Store, files: dict[str, Path], prefix: str) -> None:
    """Each file to `prefix` + its path, 8 at a time. Ctrl-C waits only for those in flight
    (a pool's own exit would send every file still queued first)."""
    pool = ThreadPoolExecutor(max_workers=8)
    try:
        list(pool.map(lambda item: store.upload_file(item[1], prefix + item[0]), files.items()))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# -- the experiment's raw/ -----------------------------------------------------------------------


def stored_sizes(store: Store, prefix: str) -> dict[str, int]:
    """Path (relative to `prefix`) -> size of every data file the store holds there."""
    sizes = store.list_sizes(prefix)
    return {k[len(prefix) :]: n for k, n in sizes.items() if not is_hidden(k[len(prefix) :])}


def read_record(store: Store, tree: ExperimentTree) -> dict | None:
    """raw.json, or None; one that cannot be read is said and compared without."""
    try:
        record = json.loads(store.get_bytes(tree.raw_record))
    except NotFound:
        return None
    except ValueError as e:
        log.warning(
            f"{store.uri_of(tree.raw_record)} cannot be read ({e}): raw/ is compared file by file"
        )
        return {}
    return record if isinstance(record, dict) else {}


def recorded(record: dict | None) -> dict[str, Content]:
    files = (record or {}).get("files") or {}
    return {rel: Content(e["size"], e["sha256"]) for rel, e in files.items()}


def stored_contents(
    store: Store,
    tree: ExperimentTree,
    sizes: dict[str, int],
    found: dict[str, Content],
    record: dict | None,
) -> dict[str, Content]:
    """What raw/'s files hold, read only where it matters: a file the folder has, of the same
    size, that the record does not vouch for (its fingerprint changed, or no record).

    raw.json keeps the store's own fingerprint of each object (on S3 its ETag and size): an
    object whose fingerprint is unchanged is known without reading it back. The ETag itself is
    no hash to compare a local file with: "If an object is created by either the Multipart
    Upload or Part Copy operation, the ETag is not an MD5 digest, regardless of the method of
    encryption", nor is it for SSE-C or SSE-KMS
    (https://docs.aws.amazon.com/AmazonS3/latest/API/API_Object.html, ETag). So a file no record
    vouches for is downloaded once and hashed."""
    record = record or {}
    vouched = (record.get("files") or {}) if record.get("status") == "complete" else {}
    prints = store.fingerprints(tree.raw) if vouched else {}
    held: dict[str, Content] = {}
    with tempfile.TemporaryDirectory(prefix="smpipe-raw-") as tmp:
        for rel, size in sizes.items():
            mine = found.get(rel)
            if mine is None or mine.size != size:
                held[rel] = Content(size, "")
                continue
            entry = vouched.get(rel) or {}
            if entry.get("size") == size and entry.get("fingerprint") == prints.get(rel):
                held[rel] = Content(size, entry["sha256"])
                continue
            copy = Path(tmp) / "object"
            store.download_file(tree.raw + rel, copy)
            held[rel] = Content(size, file_sha256(copy))
            copy.unlink()
    return held


def unfinished_upload(store: Store, tree: ExperimentTree) -> str | None:
    """Why raw/ cannot be read yet: an upload into it that has not finished; or None."""
    record = read_record(store, tree)
    if not record or record.get("status") != "uploading":
        return None
    return (
        f"{store.uri_of(tree.raw)} is not complete: `smpipe upload` from {record.get('from')}, "
        f"started {record.get('started')}, has not finished (or is running); run it again to "
        "finish it"
    )


def upload_raw(store: Store, tree: ExperimentTree, folder: Path) -> int:
    """`smpipe upload`: the data files of `folder`, as they are, into the experiment's raw/,
    once. A raw/ that holds this very content (sizes and sha256) is left as it is (0 files
    uploaded); one that holds other content is refused, naming each file that differs: it is
    what earlier runs read. Returns how many files were uploaded."""
    files = checked_files(folder, "upload")
    before = stamps(files)
    found = contents(files)
    where = store.uri_of(tree.raw)
    for _ in range(2):  # a second look when another upload claimed raw/ in between
        record = read_record(store, tree)
        if record and record.get("status") == "uploading":
            if record.get("from") == str(folder.resolve()) or recorded(record) == found:
                # Never complete, so never read by a run (check_raw_data refuses it): this
                # folder's upload goes on, or the same content finishes it; what the unfinished
                # one left of files this folder no longer has goes.
                for rel in stored_sizes(store, tree.raw).keys() - files.keys():
                    store.delete(tree.raw + rel)
                return fill(store, tree, folder, files, found, before)
            raise PipelineError(
                f"upload: {unfinished_upload(store, tree)}; {folder} is other content "
                f"({differences_text(differences(recorded(record), found))})"
            )
        sizes = stored_sizes(store, tree.raw)
        if sizes:
            differ = differences(stored_contents(store, tree, sizes, found, record), found)
            if differ:
                raise PipelineError(
                    f"upload: {where} holds other content than {folder} "
                    f"({differences_text(differ)}); "
                    "raw/ is never overwritten, since earlier runs read it: set [data] RAW_DATA "
                    f"= {folder.resolve()} to run on this folder (each run records the content "
                    "it read), or use another experiment NAME"
                )
            if record is None:  # copied there by hand: vouched for from now on
                store.create(tree.raw_record, record_of(store, tree, folder, found, "complete"))
            return 0
        claim = record_of(store, tree, folder, found, "uploading")
        if record is not None:  # raw/ was emptied since: its record no longer says anything
            store.put_bytes(tree.raw_record, claim)
        elif not store.create(tree.raw_record, claim):
            continue
        return fill(store, tree, folder, files, found, before)
    raise PipelineError(f"upload: another upload into {where} is running; try again when it ends")


def record_of(
    store: Store, tree: ExperimentTree, folder: Path, found: dict[str, Content], status: str
) -> bytes:
    prints = store.fingerprints(tree.raw) if status == "complete" else {}
    files = {
        rel: {"size": c.size, "sha256": c.sha256, "fingerprint": prints.get(rel)}
        for rel, c in found.items()
    }
    when = "started" if status == "uploading" else "uploaded"
    record = {"status": status, "from": str(folder.resolve()), when: now(), "files": files}
    return json.dumps(record, indent=2).encode()


def fill(
    store: Store,
    tree: ExperimentTree,
    folder: Path,
    files: dict[str, Path],
    found: dict[str, Content],
    before: dict[str, tuple[int, int]],
) -> int:
    """Upload the files into raw/, then the record that says raw/ is complete."""
    send(store, files, tree.raw)
    moved = [rel for rel, stamp in stamps(files).items() if stamp != before[rel]]
    if moved:
        raise PipelineError(
            f"upload: {folder} changed while it was uploaded ({named(moved)}); no run reads "
            f"{store.uri_of(tree.raw)} until an upload finishes: run `smpipe upload` again"
        )
    store.put_bytes(tree.raw_record, record_of(store, tree, folder, found, "complete"))
    return len(files)


# -- raw versions: a local RAW_DATA for jobs that run elsewhere ---------------------------------


@dataclass
class LocalRaw:
    """A local RAW_DATA folder as the raw version that holds its content, for jobs that cannot
    read this machine (SageMaker, emulated). The version is named by the digest of its files'
    paths, sizes and sha256 (`content_digest`): an unchanged folder is the version already
    there and nothing is uploaded; an edited one is a new version, which the next run reads and
    names (Metadata raw_path); earlier versions stay as the runs that read them left them."""

    folder: Path
    files: dict[str, Path]
    found: dict[str, Content]
    stamps: dict[str, tuple[int, int]]
    version: RawVersion


def local_version(tree: ExperimentTree, folder: Path) -> LocalRaw:
    """The raw version of `folder` as it is now (read and hashed here; nothing is written).
    `folder_problems` said first that it is raw data."""
    files = checked_files(folder, "[data] RAW_DATA")
    before = stamps(files)
    found = contents(files)
    return LocalRaw(folder, files, found, before, tree.raw_version(content_digest(found)))


@contextmanager
def raw_version_held(store: Store, raw: LocalRaw | None):
    """While the block runs, this process alone writes or removes `raw`'s version (its LEASE,
    held as a run is: pipeline/runs.py `held`): a second driver uploading the same content
    waits its turn, and prune leaves it alone."""
    if raw is None:
        yield
        return
    with held(store, raw.version.lease, f"raw version {raw.version.digest[:12]}", "uploaded"):
        yield


def upload_version(store: Store, raw: LocalRaw) -> int:
    """The raw version into the store, once: nothing when it is complete there already (an
    unchanged folder). A file whose content an earlier version holds is copied from it inside
    the store; only new content crosses the network. The manifest is written last, once every
    file is there at its size, so only a whole version is ever read; an upload refused or
    interrupted removes what it sent (prune removes what a killed one left). Returns how many
    files were uploaded."""
    version = raw.version
    if is_complete(store, version.prefix):
        return 0
    held = known_files(store, version)
    copied = {rel: held[c.sha256] for rel, c in raw.found.items() if c.sha256 in held}
    sent = {rel: path for rel, path in raw.files.items() if rel not in copied}
    try:
        send(store, sent, version.files)
        copy_within(store, copied, version.files)
        moved = [rel for rel, stamp in stamps(raw.files).items() if stamp != raw.stamps[rel]]
        if moved:
            raise PipelineError(
                f"[data] RAW_DATA: {raw.folder} changed while it was uploaded ({named(moved)}); "
                "nothing was run: run again once it has stopped changing"
            )
        wanted = {rel: c.size for rel, c in raw.found.items()}
        if stored_sizes(store, version.files) != wanted:
            raise PipelineError(
                f"[data] RAW_DATA: {store.uri_of(version.files)} does not hold the files of "
                f"{raw.folder} after its upload (another upload of it was cut short there?); "
                "nothing was run: run again"
            )
    except BaseException:
        remove_unfinished(store, version)
        raise
    manifest = {
        "files": {
            f"files/{rel}": {"size": c.size, "sha256": c.sha256} for rel, c in raw.found.items()
        },
        "total_bytes": sum(c.size for c in raw.found.values()),
        "created": now(),
        "digest": version.digest,
        "from": str(raw.folder),
    }
    # False: another driver completed this very content meanwhile, which is as good.
    store.create(version.prefix + MANIFEST, json.dumps(manifest, indent=2).encode())
    size = sum(raw.found[rel].size for rel in sent)
    log.info(
        f"uploaded {counted(len(sent), 'raw file')} ({size:,} bytes) from {raw.folder} as raw "
        f"version {version.digest[:12]}"
        + (f", {len(copied)} unchanged ones copied from earlier versions" if copied else "")
        + f": {store.uri_of(version.files)}"
    )
    return len(sent)


def known_files(store: Store, version: RawVersion) -> dict[str, str]:
    """sha256 -> the key of a file holding it, in any complete raw version beside `version`."""
    root = version.prefix.rstrip("/").rsplit("/", 1)[0] + "/"
    found = {}
    for digest in store.list_children(root):
        try:
            manifest = json.loads(store.get_bytes(f"{root}{digest}/{MANIFEST}"))
        except (NotFound, ValueError):
            continue  # an upload that did not finish: nothing of it is trusted
        for rel, entry in manifest.get("files", {}).items():
            found.setdefault(entry["sha256"], f"{root}{digest}/{rel}")
    return found


def copy_within(store: Store, copies: dict[str, str], prefix: str) -> None:
    """Each `prefix` + path as a copy of the key it maps to, 8 at a time."""
    pool = ThreadPoolExecutor(max_workers=8)
    try:
        list(pool.map(lambda item: store.copy(item[1], prefix + item[0]), copies.items()))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def remove_unfinished(store: Store, version: RawVersion) -> None:
    """What an upload that did not finish sent, unless another one completed the version."""
    if is_complete(store, version.prefix):
        return
    for key in store.list_keys(version.files):
        store.delete(key)
