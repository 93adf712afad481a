"""The code every job of a run runs: steps/ and the user's functions module with the modules
beside it that it imports, copied as they are when the run starts and uploaded to the run's
code/ (pipeline/paths.py). Jobs receive it as an input; the image holds none of it, so one
image runs every version of the code. The cache (pipeline/cache.py) hashes the same modules.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from pipeline.config import Settings
from pipeline.store import (
    MANIFEST,
    Incomplete,
    Store,
    download_dir,
    file_sha256,
    read_manifest,
    upload_dir,
)
from steps.user_code import local_modules

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def user_code(settings: Settings) -> dict[str, Path]:
    """The user's modules a run ships: USER_FUNCTIONS, found beside the settings file (or in
    this project: the demo's), and its local imports."""
    bases = [Path(settings.base_dir), PROJECT_ROOT]
    return local_modules(settings.experiment.user_functions, bases)


def ship_code(settings: Settings, store: Store, prefix: str) -> None:
    """The code every job of the run runs: steps/ and the user functions module with the
    modules beside it that it imports, as they are now."""
    with tempfile.TemporaryDirectory(prefix="smpipe-code-") as tmp:
        assemble(Path(tmp), user_code(settings).values())
        upload_dir(store, tmp, prefix)


def ship_run_code(store: Store, run_code: str, prefix: str) -> None:
    """A run's user modules (its code/ at `run_code`) with this project's steps/, which may be
    newer than the run's: predict's job code, in the store at `prefix`."""
    with tempfile.TemporaryDirectory(prefix="smpipe-code-") as tmp:
        assemble(Path(tmp, "code"), shipped_modules(store, run_code, Path(tmp, "run")))
        upload_dir(store, Path(tmp, "code"), prefix)


# Never shipped, nor told apart by a resume: bytecode, and what editors and file browsers
# leave beside code (backups, swap files, notebook checkpoints, Finder's records).
IGNORED = shutil.ignore_patterns(
    "__pycache__", "*.pyc", "*~", ".*.swp", ".*.swo", ".ipynb_checkpoints", ".DS_Store"
)
STEPS = "steps/"  # this project's own code, in every run's code/


def assemble(folder: Path, modules: Iterable[Path]) -> None:
    """This project's steps/ and the user's `modules` (files, or packages' folders) in `folder`."""
    shutil.copytree(PROJECT_ROOT / "steps", folder / "steps", ignore=IGNORED)
    copy_modules(folder, modules)


def copy_modules(folder: Path, modules: Iterable[Path]) -> None:
    """The user's `modules` (files, or packages' folders) in `folder`, but for IGNORED."""
    for path in modules:
        if path.is_dir():
            shutil.copytree(path, folder / path.name, ignore=IGNORED)
        else:
            shutil.copy2(path, folder / path.name)


def shipped_modules(store: Store, run_code: str, into: Path) -> list[Path]:
    """The user's modules a run shipped (its code/ at `run_code` but steps/), downloaded into
    `into`."""
    download_dir(store, run_code, into)
    return [p for p in sorted(into.iterdir()) if p.name not in ("steps", MANIFEST)]


def shipped_files(store: Store, run_code: str) -> dict[str, str] | None:
    """What a run's code/ holds, by its manifest: each of the user's files -> its sha256, and
    this project's steps/ as one entry (STEPS); None when the code is not complete there (a
    run that never started a job)."""
    try:
        files = read_manifest(store, run_code)["files"]
    except Incomplete:
        return None
    steps = sorted((k, e["sha256"]) for k, e in files.items() if k.startswith(STEPS))
    user = {k: e["sha256"] for k, e in files.items() if not k.startswith(STEPS)}
    return {**user, STEPS: hashlib.sha256(json.dumps(steps).encode()).hexdigest()}


def user_files(settings: Settings) -> dict[str, str]:
    """The user's files a run would ship now -> their sha256, as shipped_files has them."""
    with tempfile.TemporaryDirectory(prefix="smpipe-code-") as tmp:
        copy_modules(Path(tmp), user_code(settings).values())
        return {
            p.relative_to(tmp).as_posix(): file_sha256(p)
            for p in sorted(Path(tmp).rglob("*"))
            if p.is_file()
        }


def files_that_differ(before: dict[str, str], after: dict[str, str], a: str, b: str) -> list[str]:
    """Each file the two sets of files (shipped_files, user_files) hold otherwise: 'changed',
    or 'only in `a`' / 'only in `b`'."""
    differ = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
    only = {(True, False): f"only in {a}", (False, True): f"only in {b}"}
    return [f"{n}: {only.get((n in before, n in after), 'changed')}" for n in differ]
