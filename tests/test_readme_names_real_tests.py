"""The README's table of hostile uses names, for each case, the tests that hold it: every name
there is a test that exists, so a renamed or removed test cannot leave a promise unheld."""

from __future__ import annotations

import re

from tests.conftest import ROOT

TABLE = "**Hostile use of the newest commands**"
NAME = re.compile(r"`((?:[\w/]+\.py)?(?:::\w+)?)`")


def named_tests(text: str) -> list[tuple[str, str | None]]:
    """(file under tests/, test name or None for the whole file) for every name in the
    table's last column; `::name` belongs to the file named before it in the same cell."""
    start = text.index(TABLE)
    lines = text[start:].split("\n\n")[1].splitlines()
    rows = [r for r in lines if r.startswith("| ")][1:]  # the header row left out
    named = []
    for row in rows:
        last, file = row.rstrip(" |").rsplit(" | ", 1)[-1], None
        for name in NAME.findall(last):
            path, _, test = name.partition("::")
            file = path or file
            named.append((file, test or None))
    return named


def test_every_test_the_hostile_use_table_names_exists():
    named = named_tests((ROOT / "README.md").read_text())
    assert len(named) > 20
    missing = []
    for file, test in named:
        path = ROOT / "tests" / file
        if not path.is_file():
            missing.append(file)
        elif test and not re.search(rf"^def {test}\(", path.read_text(), re.M):
            missing.append(f"{file}::{test}")
    assert missing == []
