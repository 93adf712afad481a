"""Nothing in the venv hides what the image lacks.

What runs in the image (steps/, the user functions) may import the standard library, its own
packages, torch (the base image's) and the distributions of requirements.lock, which the image
installs. The venv holds more, the dev extra (moto, pytest, hypothesis...), so an import of one
of those passes every test here and fails only in a job. Each module is read with ast, imports
inside functions included, and each imported top-level name is mapped to the distribution that
installed it (importlib.metadata.packages_distributions)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from collections.abc import Iterable

from packaging.utils import canonicalize_name

from tests.conftest import ROOT

# What the image runs: the job side of the code, and the user functions a run ships with it
# (the demo's, and the template `smpipe init` copies).
IMAGE_CODE = ["steps", "user_functions", "pipeline/project_template/user_functions"]
# Shipped with the code (PYTHONPATH in docker/Dockerfile), not installed: importing each other
# needs no distribution. `pipeline` is not among them: the image does not carry the driver.
OWN_PACKAGES = {"steps", "user_functions"}
FROM_THE_BASE = {"torch"}  # docker/Dockerfile's base image installs it (tools/lock-excludes.txt)


def runtime_lock() -> set[str]:
    """The distributions requirements.lock pins, by canonical name."""
    text = (ROOT / "requirements.lock").read_text()
    return {canonicalize_name(m) for m in re.findall(r"^([A-Za-z0-9][\w.-]*)==", text, re.M)}


def imported(source: str, filename: str) -> list[tuple[str, int]]:
    """Every absolute import's top-level module with its line, at any depth of the module."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [(alias.name.split(".")[0], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.split(".")[0], node.lineno))
    return found


def missing_from_image(files: Iterable[tuple[str, str]], locked: set[str]) -> list[str]:
    """For (name, source) pairs: each import the image could not satisfy, named by file and line."""
    providers = importlib.metadata.packages_distributions()
    problems = []
    for filename, source in files:
        for module, line in imported(source, filename):
            if module in sys.stdlib_module_names or module in OWN_PACKAGES:
                continue
            # A namespace package (google) may come from several distributions: one locked is
            # enough for the import to find something.
            dists = {canonicalize_name(d) for d in providers.get(module, [])}
            if not dists:
                problems.append(
                    f"{filename}:{line}: imports {module}, which nothing installed provides"
                )
            elif not dists & (locked | FROM_THE_BASE):
                names = ", ".join(sorted(dists))
                problems.append(
                    f"{filename}:{line}: imports {module} (from {names}), which requirements.lock "
                    "does not hold: the image lacks it (add it to [project].dependencies, `make lock`)"
                )
    return problems


def image_code() -> list[tuple[str, str]]:
    files = []
    for folder in IMAGE_CODE:
        for path in sorted((ROOT / folder).rglob("*.py")):
            files.append((str(path.relative_to(ROOT)), path.read_text()))
    return files


def test_what_the_image_runs_imports_only_what_the_image_holds():
    files = image_code()
    assert any(name.startswith("steps/runtime/") for name, _ in files)  # the walk is recursive
    assert missing_from_image(files, runtime_lock()) == []


def test_an_import_of_a_dev_only_distribution_is_named_with_its_file():
    source = (
        "import json\n\n\ndef handler():\n    import moto.server\n    from steps import names\n"
    )
    [problem] = missing_from_image([("steps/new_step.py", source)], runtime_lock())
    assert problem.startswith(
        "steps/new_step.py:5: imports moto (from moto), which requirements.lock"
    )


def test_an_import_nothing_provides_is_named():
    source = "from no_such_module_anywhere import thing\n"
    assert missing_from_image([("user_functions/x.py", source)], runtime_lock()) == [
        "user_functions/x.py:1: imports no_such_module_anywhere, which nothing installed provides"
    ]


def test_torch_comes_from_the_base_and_relative_imports_are_the_package_s_own():
    source = "import torch.nn\nfrom . import sibling\nfrom .names import X\n"
    assert missing_from_image([("steps/x.py", source)], runtime_lock()) == []
