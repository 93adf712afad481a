"""The code every job of a run runs: steps/ and the user's functions module with the modules
beside it that it imports, copied as they are when the run starts and uploaded to the run's
code/ (pipeline/paths.py). Jobs receive it as an input; the image holds none of it, so one
image runs every version of the code. The cache (pipeline/cache.py) hashes the same modules.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from pipeline.config import Settings
from pipeline.store import Store, upload_dir
from steps.user_code import local_modules

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def user_code(settings: Settings) -> dict[str, Path]:
    """The user's modules a run ships: USER_FUNCTIONS, found beside the settings file (or in
    this project: the demo's), and its local imports."""
    bases = [Path(settings.base_dir), PROJECT_ROOT]
    return local_modules(settings.experiment.user_functions, bases)


def ship_code(settings: Settings, store: Store, prefix: str) -> None:
    """The code every job of the run runs: steps/ and the user functions module with the
    modules beside it that it imports, as they are now. Jobs receive it as an input; the image
    holds none of it."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    with tempfile.TemporaryDirectory(prefix="smpipe-code-") as tmp:
        shutil.copytree(PROJECT_ROOT / "steps", Path(tmp, "steps"), ignore=ignore)
        for name, path in user_code(settings).items():
            if path.is_dir():
                shutil.copytree(path, Path(tmp, name), ignore=ignore)
            else:
                shutil.copy2(path, Path(tmp, path.name))
        upload_dir(store, tmp, prefix)
