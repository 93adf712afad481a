"""The layering holds: steps/ and user_functions/ (what runs in the container) never import
the driver, so the image needs nothing of pipeline/. And the code passes its linter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

BIN = Path(sys.executable).parent


def test_container_code_never_imports_the_driver():
    done = subprocess.run([str(BIN / "lint-imports")], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "steps and user functions never import the driver KEPT" in done.stdout


def test_ruff_is_clean():
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout
