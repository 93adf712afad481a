"""The layering holds (pyproject.toml's import-linter contracts): steps/ and user_functions/
(what runs in the container) never import the driver, so the image needs nothing of
pipeline/; no package's modules import each other in a circle; the player never imports a
control plane, the settings or a stage; the container runtime imports nothing else of steps;
the driver imports of steps only what is meant to be shared. Each contract is shown to fail
when broken, in a copy of the tree. And the code passes its linter."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

BIN = Path(sys.executable).parent
CONTRACTS = {
    "driver": "steps and user functions never import the driver",
    "circles": "no import circles: the modules of each package import each other one way",
    "player": "the player plays jobs: it never imports a control plane, the settings or a stage",
    "runtime": "the container runtime imports nothing else of steps",
    "shared": "the driver imports of steps only the modules meant to be shared",
}


def lint_imports(root: Path) -> str:
    """What lint-imports says of the tree at `root`, a contract's name and KEPT or BROKEN
    apart even where it prints them together (a long name runs into its verdict)."""
    done = subprocess.run(
        [str(BIN / "lint-imports"), "--no-cache"], cwd=root, capture_output=True, text=True
    )
    said = done.stdout + done.stderr
    return said.replace("KEPT", " KEPT").replace("BROKEN", " BROKEN").replace("  ", " ")


def test_every_contract_holds():
    said = lint_imports(ROOT)
    for name in CONTRACTS.values():
        assert f"{name} KEPT" in said, said


# One import that breaks each contract, added to a copy of the tree.
BREAKS = {
    "driver": ("steps/runtime/names.py", "import pipeline.paths"),
    "circles": ("pipeline/paths.py", "import pipeline.driver"),
    "player": ("pipeline/player/exits.py", "import pipeline.config"),
    "runtime": ("steps/runtime/names.py", "import steps.hyperparameters"),
    "shared": ("pipeline/stages.py", "import steps.train"),
}


@pytest.mark.parametrize("contract", sorted(BREAKS))
def test_each_contract_fails_when_broken(contract, tmp_path):
    copy = tmp_path / "tree"
    for part in ("pipeline", "steps", "user_functions", "pyproject.toml"):
        source = ROOT / part
        if source.is_dir():
            shutil.copytree(source, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, copy / part)
    path, line = BREAKS[contract]
    target = copy / path
    text = target.read_text()
    # After the module's docstring and __future__ import, where an import may stand.
    anchor = "from __future__ import annotations\n"
    assert anchor in text, path
    target.write_text(text.replace(anchor, f"{anchor}{line}  # noqa\n", 1))
    said = lint_imports(copy)
    assert f"{CONTRACTS[contract]} BROKEN" in said, said


def test_ruff_is_clean():
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout
