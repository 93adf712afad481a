"""The figures of the "Runs you can trust" table (docs/trust.md), as the tests count them.

A test that measures a figure records it here as it runs: build/figures/<name>.json, one file
per figure (the suite's workers never write the same one), holding the values, the test and
when. `python docs/figures.py reliability` makes the table from these files; a figure no run
has recorded is said to be missing, never filled in.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

FIGURES = Path(__file__).resolve().parents[2] / "build/figures"


def record(name: str, **values) -> None:
    """build/figures/<name>.json: `values`, the test that counted them and when (written aside
    and renamed: a reader never sees half a file)."""
    path = FIGURES / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    figure = {**values, "test": test, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    aside = path.with_name(f".{path.name}.{os.getpid()}")
    aside.write_text(json.dumps(figure, indent=2) + "\n")
    os.replace(aside, path)
