"""The layering holds (pyproject.toml's import-linter contracts): steps/ and user_functions/
(what runs in the container) never import the driver, so the image needs nothing of
pipeline/; no package's modules import each other in a circle; a lower floor never asks a
higher one (the backends above the stages, the registry, what a backend is, jobs, the
player); the player never imports a control plane, the settings or a stage; the container
runtime imports nothing else of steps; the driver imports of steps only what is meant to be
shared. Each contract is shown to fail when broken, in a copy of the tree, a type-only
import included. No module of pipeline/ or steps/ is in a circle counting every import, at
module level, under TYPE_CHECKING or inside a function, read from the source itself. And the
code passes its linter."""

from __future__ import annotations

import ast
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
    "layers": "a lower floor never asks a higher one",
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
    "layers": ("pipeline/registry/packages.py", "import pipeline.backends.choose"),
    "player": ("pipeline/player/exits.py", "import pipeline.config"),
    "runtime": ("steps/runtime/names.py", "import steps.hyperparameters"),
    "shared": ("pipeline/stages.py", "import steps.train"),
}


def broken_copy(tmp_path: Path, path: str, lines: str) -> Path:
    """A copy of the tree with `lines` added to `path`."""
    copy = tmp_path / "tree"
    for part in ("pipeline", "steps", "user_functions", "pyproject.toml"):
        source = ROOT / part
        if source.is_dir():
            shutil.copytree(source, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, copy / part)
    target = copy / path
    text = target.read_text()
    # After the module's docstring and __future__ import, where an import may stand.
    anchor = "from __future__ import annotations\n"
    assert anchor in text, path
    target.write_text(text.replace(anchor, f"{anchor}{lines}\n", 1))
    return copy


@pytest.mark.parametrize("contract", sorted(BREAKS))
def test_each_contract_fails_when_broken(contract, tmp_path):
    path, line = BREAKS[contract]
    said = lint_imports(broken_copy(tmp_path, path, line))
    assert f"{CONTRACTS[contract]} BROKEN" in said, said


def test_a_type_only_import_back_up_breaks_the_layers(tmp_path):
    """A type named from a higher floor ties the modules all the same: the registry naming a
    stage's type makes a circle with the stage that calls it."""
    only_a_type = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pipeline.stages"
    said = lint_imports(broken_copy(tmp_path, "pipeline/registry/protocol.py", only_a_type))
    assert f"{CONTRACTS['circles']} BROKEN" in said, said
    assert f"{CONTRACTS['layers']} BROKEN" in said, said


# -- every import, read from the source -------------------------------------------------------


def imports_of(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Each module of `packages` under `root`, and the modules of them it imports: at module
    level, under TYPE_CHECKING and inside functions alike (ast.walk visits every statement)."""
    paths = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            paths[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            for target in imported_names(node, package):
                while target and target not in paths:  # a name of a module: that module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def imported_names(node: ast.AST, package: str) -> list[str]:
    """The dotted names an import statement in `package` imports: modules, or names in them."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: `from .x import y` in package a.b is a.b.x
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*parts, base] if base else parts)
    return [f"{base}.{alias.name}" for alias in node.names]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    order, low, stack, found = {}, {}, [], []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for other in graph[module]:
            if other not in order:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], order[other])
        if low[module] == order[module]:
            component = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return found


def test_no_module_is_in_an_import_circle_counting_every_import():
    graph = imports_of(ROOT, ("pipeline", "steps"))
    assert len(graph) > 50 and graph["pipeline.stages"]
    said = [" -> ".join(circle) for circle in circles(graph)]
    assert not said, said


def test_the_scan_counts_type_only_and_function_level_imports(tmp_path):
    """A circle whose arrows back are a TYPE_CHECKING import and an import inside a function
    is found: the one a backend chooser, a stage and a registry once made."""
    package = tmp_path / "pkg"
    (package / "backends").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "backends" / "__init__.py").write_text("")
    (package / "backends" / "choose.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.stages import Job\n"
    )
    (package / "stages.py").write_text("from pkg import registry\n")
    (package / "registry.py").write_text(
        "def register():\n    from .backends.choose import identity\n"
    )
    graph = imports_of(tmp_path, ("pkg",))
    assert circles(graph) == [["pkg.backends.choose", "pkg.registry", "pkg.stages"]]


def test_ruff_is_clean():
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout


def test_every_package_is_among_those_a_wheel_holds():
    """A package folder missing from [tool.setuptools] packages is left out of a built wheel:
    an install from one fails at its first import, while an editable install works."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("pipeline", "steps", "user_functions")
        for init in (ROOT / top).rglob("__init__.py")
        if "project_template" not in init.parts
    }
    assert found - listed == set()
