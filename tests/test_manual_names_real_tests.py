"""The manual names the tests that hold its promises: the hostile-use table of docs/trust.md
for each case, and tests/README.md for each promise. Every name there is a test that exists, so
a renamed or removed test cannot leave a promise unheld."""

from __future__ import annotations

import re

from tests.conftest import ROOT

HOSTILE_USE = "## Hostile use of the newest commands"
NAME = re.compile(r"`((?:[\w/]+\.py)?(?:::\w+)?)`")


def named_tests(table: str) -> list[tuple[str, str | None]]:
    """(file under tests/, test name or None for the whole file) for every name in the last
    column of the table's rows (header rows left out); `::name` belongs to the file named
    before it in the same cell."""
    rows = [r for r in table.splitlines() if r.startswith("| ") and not r.startswith("| ---")]
    named = []
    for row in rows:
        if row.endswith("| test |"):  # a header
            continue
        last, file = row.rstrip(" |").rsplit(" | ", 1)[-1], None
        for name in NAME.findall(last):
            path, _, test = name.partition("::")
            file = path or file
            named.append((file, test or None))
    return named


def missing(named: list[tuple[str, str | None]]) -> list[str]:
    gone = []
    for file, test in named:
        path = ROOT / "tests" / file
        if not path.is_file():
            gone.append(file)
        elif test and not re.search(rf"^def {test}\(", path.read_text(), re.M):
            gone.append(f"{file}::{test}")
    return gone


def test_every_test_the_hostile_use_table_names_exists():
    text = (ROOT / "docs/trust.md").read_text()
    after = text[text.index(HOSTILE_USE) :].split("\n\n")
    table = next(block for block in after if block.startswith("| "))
    named = named_tests(table)
    assert len(named) > 20
    assert missing(named) == []


def test_every_test_the_promise_list_names_exists():
    named = named_tests((ROOT / "tests/README.md").read_text())
    assert len(named) > 100
    assert missing(named) == []
