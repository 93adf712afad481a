"""The locks (tools/lock.py) agree with pyproject.toml, with the venv, and with both torch
releases the project runs on, offline: from the lock files and the installed packages' metadata.

torch is in neither lock (tools/lock-excludes.txt): the venv's comes first from this disk, the
image's with its base. So what each locked package asks of torch is checked here against both.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.conftest import ROOT

RUNTIME_LOCK = ROOT / "requirements.lock"
DEV_LOCK = ROOT / "requirements-dev.lock"
_spec = importlib.util.spec_from_file_location("lock", ROOT / "tools" / "lock.py")
_lock_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_lock_tool)
TORCH_RELEASES = _lock_tool.TORCH_RELEASES  # the venv's and the base image's
REMAKE = "`make lock`, then `make install`"


def pins(lock: Path) -> dict[str, str]:
    """The lock's `name==version` lines, by canonical name."""
    text = lock.read_text()
    return {
        canonicalize_name(n): v for n, v in re.findall(r"^([A-Za-z0-9][\w.-]*)==(\S+)", text, re.M)
    }


def project_requirements(extras: list[str]) -> list[Requirement]:
    """[project].dependencies and the extras named, with the project's own extras
    (`smpipe[emulated]` in dev) opened in place."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found, todo, opened = [], [Requirement(r) for r in project["dependencies"]], set()
    todo += [Requirement(r) for extra in extras for r in project["optional-dependencies"][extra]]
    while todo:
        requirement = todo.pop(0)
        if canonicalize_name(requirement.name) != project["name"]:
            found.append(requirement)
            continue
        for extra in sorted(requirement.extras - opened):
            opened.add(extra)
            todo += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return found


def closure(roots: list[Requirement]) -> list[tuple[str, Requirement]]:
    """Every requirement the roots bring into play, as (who asks, requirement), walked through
    the installed packages' metadata. A requirement under an extra counts only where something
    asks for that extra (datasets' `torch==2.0.1; extra == "benchmarks"` does not); torch's own
    requirements are its installer's business, not the lock's."""
    found = [("pyproject.toml", r) for r in roots if r.marker is None or r.marker.evaluate()]
    opened: set[tuple[str, str]] = set()
    i = 0
    while i < len(found):
        requirement = found[i][1]
        i += 1
        name = canonicalize_name(requirement.name)
        if name == "torch":
            continue
        for extra in ["", *sorted(requirement.extras)]:
            if (name, extra) in opened:
                continue
            opened.add((name, extra))
            for line in importlib.metadata.distribution(name).requires or []:
                needed = Requirement(line)
                if needed.marker is None or needed.marker.evaluate({"extra": extra}):
                    found.append((name, needed))
    return found


def stale(lock: Path, extras: list[str]) -> list[str]:
    held = pins(lock)
    problems = []
    for who, requirement in closure(project_requirements(extras)):
        name = canonicalize_name(requirement.name)
        if name == "torch":
            continue
        if name not in held:
            problems.append(f"{who} asks for {requirement}; {lock.name} does not hold {name}")
        elif not requirement.specifier.contains(held[name], prereleases=True):
            problems.append(f"{who} asks for {requirement}; {lock.name} holds {held[name]}")
    return sorted(set(problems))


def test_the_runtime_lock_holds_what_pyproject_asks_for():
    assert stale(RUNTIME_LOCK, []) == [], f"requirements.lock is stale: {REMAKE}"


def test_the_dev_lock_holds_what_pyproject_and_its_dev_extra_ask_for():
    assert stale(DEV_LOCK, ["dev"]) == [], f"requirements-dev.lock is stale: {REMAKE}"


def test_both_locks_agree_on_every_package_they_share():
    runtime, dev = pins(RUNTIME_LOCK), pins(DEV_LOCK)
    differ = [
        f"{name}: {version} in requirements.lock, {dev.get(name)} in requirements-dev.lock"
        for name, version in runtime.items()
        if dev.get(name) != version
    ]
    assert differ == []


def test_every_locked_package_admits_both_torch_releases():
    refused = [
        f"{who} asks for {requirement}, which torch {release} does not meet"
        for who, requirement in closure(project_requirements(["dev"]))
        if canonicalize_name(requirement.name) == "torch"
        for release in TORCH_RELEASES
        if not requirement.specifier.contains(release, prereleases=True)
    ]
    assert refused == []
    # The check saw the requirements it is for: accelerate's `torch>=2.0.0`, and our own range.
    askers = {who for who, r in closure(project_requirements([])) if r.name == "torch"}
    assert {"pyproject.toml", "accelerate"} <= askers


def drifted(lock: Path) -> list[str]:
    """Each locked package whose installed version is another, and a torch the locks were not
    checked with."""
    differ = []
    for name, version in pins(lock).items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = "nothing"
        if installed != version:
            differ.append(f"{name}: {installed} installed, {version} locked")
    torch = Version(importlib.metadata.version("torch")).public  # 2.13.0+cpu is a 2.13.0 build
    if torch not in TORCH_RELEASES:
        differ.append(f"torch: {torch} installed, the locks are checked with {TORCH_RELEASES}")
    return differ


def test_the_venv_holds_exactly_the_locked_versions():
    assert drifted(DEV_LOCK) == [], (
        "`make install`, or `pip install --no-deps --require-hashes -r requirements-dev.lock`"
    )


def test_a_stale_lock_and_a_drifted_venv_are_named_by_package(tmp_path):
    lock = tmp_path / "requirements.lock"
    text = re.sub(r"(?m)^boto3==\S+", "boto3==1.35.0", RUNTIME_LOCK.read_text())
    lock.write_text(text.replace("\npyarrow==", "\nnot-pyarrow=="))
    problems = stale(lock, [])
    assert "pyproject.toml asks for boto3<2,>=1.44; requirements.lock holds 1.35.0" in problems
    assert (
        "pyproject.toml asks for pyarrow<27,>=15; requirements.lock does not hold pyarrow"
        in problems
    )
    installed = importlib.metadata.version("boto3")
    assert f"boto3: {installed} installed, 1.35.0 locked" in drifted(lock)
