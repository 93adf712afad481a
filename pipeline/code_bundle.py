"""The code every job of a run runs: steps/ and the user's functions module with the modules
beside it that it imports, copied as they are when the run starts and uploaded to the run's
code/ (pipeline/paths.py). Jobs receive it as an input; the image holds none of it, so one
image runs every version of the code. The cache (pipeline/cache.py) hashes the same modules.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from pipeline.config import Settings
from pipeline.store import MANIFEST, Store, download_dir, upload_dir
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


def assemble(folder: Path, modules: Iterable[Path]) -> None:
    """This project's steps/ and the user's `modules` (files, or packages' folders) in `folder`."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(PROJECT_ROOT / "steps", folder / "steps", ignore=ignore)
    for path in modules:
        if path.is_dir():
            shutil.copytree(path, folder / path.name, ignore=ignore)
        else:
            shutil.copy2(path, folder / path.name)


def shipped_modules(store: Store, run_code: str, into: Path) -> list[Path]:
    """The user's modules a run shipped (its code/ at `run_code` but steps/), downloaded into
    `into`."""
    download_dir(store, run_code, into)
    return [p for p in sorted(into.iterdir()) if p.name not in ("steps", MANIFEST)]
