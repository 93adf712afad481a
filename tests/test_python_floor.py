"""pyproject.toml's requires-python admits no Python that lacks what the code uses: each
feature newer than the floor's minor release is found by its spelling in the code, and the
floor is at least the release that brought it."""

from __future__ import annotations

import re
import tomllib

from tests.conftest import ROOT

# What the code may use, as it is spelt, and the first release that has it.
FEATURES = {
    # What's New in Python 3.11: tomllib, datetime.UTC.
    "import tomllib": (3, 11),
    "from datetime import UTC": (3, 11),
    # What's New in Python 3.11, "Notable changes in 3.11.4": tarfile's extraction filters
    # (PEP 706); 3.11.0 to 3.11.3 refuse the argument.
    'filter="data"': (3, 11, 4),
}
FOLDERS = ("pipeline", "steps", "user_functions", "tests", "bench", "docs")


def test_requires_python_admits_no_python_the_code_cannot_run_on():
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    floor = tuple(int(p) for p in re.fullmatch(r">=(\d+(?:\.\d+)*)", spec)[1].split("."))
    sources = [p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")]
    sources.append(ROOT / "run_pipeline.py")
    used = {
        feature: version
        for feature, version in FEATURES.items()
        if any(feature in p.read_text() for p in sources if p.name != "test_python_floor.py")
    }
    assert all(floor >= version for version in used.values()), (spec, used)
