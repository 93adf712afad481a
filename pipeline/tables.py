"""The tables `smpipe runs`, `smpipe compare` and `smpipe registry` print (rich): what the
history (pipeline/history.py) and the registry (pipeline/registry/) read, laid out.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from pipeline import cost
from pipeline.history import age, human_bytes


def console() -> Console:
    # A pipe or a log file gets plain text at a width that keeps rows on one line. No markup:
    # labels, model names and paths are the user's, and "[bold]" or "[/x]" in one is text.
    return Console(width=None if sys.stdout.isatty() else 160, markup=False)


def fit(console: Console, table: Table):
    """`table` as it is where the console is wide enough for every word of every cell (rich
    wraps a long cell between its words); else each of its rows as a block of lines, a cell a
    line under its column's name. Squeezed further, rich cut cells short (`0.91…`, `comp…`)
    and dropped some columns' text entirely: what it would cut is what tells."""
    from rich.console import Group
    from rich.text import Text

    cells = [list(column.cells) for column in table.columns]
    with console.capture() as drawn:
        console.print(table)
    said = [table.title, *(c.header for c in table.columns), *(x for col in cells for x in col)]
    cut = drawn.get().count("…") > sum(str(text or "").count("…") for text in said)
    # A column squeezed to a character or two (its padding aside) shows nothing of its text,
    # not even a "…". The widths are rich's own layout, from its private method: the public
    # Measurement gives a folded column's longest word as its least width, and so took
    # `registry`'s table, whose paths fold whole, for one cut short (the pinned rich range
    # and tests/test_history.py hold it).
    widths = table._calculate_column_widths(console, console.options)
    if not cut and min(widths, default=3) - 2 >= 3:
        return table
    blocks = [Text(str(table.title), style="bold")] if table.title else []
    for row in range(table.row_count):
        block = Table.grid(padding=(0, 2))
        block.add_column(style="dim", no_wrap=True)
        block.add_column(overflow="fold")
        first, *rest = [(column.header, cells[i][row]) for i, column in enumerate(table.columns)]
        blocks.append(Text.assemble((f"{first[0]} ", "dim"), (str(first[1]), "bold")))
        for header, cell in rest:
            if str(cell):
                block.add_row(str(header), cell)
        blocks.append(block)
    return Group(*blocks)


def runs_table(title: str, rows: list[dict]) -> Table:
    """One row per run (history.run_rows), newest last: the settings column holds only those
    that differ between the runs."""
    table = Table(title=title)
    columns = ("run", "status", "settings", "test macro-F1", "test accuracy", "data", "took")
    for column in (*columns, "cost", "started", "size"):
        table.add_column(column, justify="right" if column in ("took", "cost", "size") else "left")
    for row in rows:
        ranked = sorted(row["macro_f1"], key=lambda m: -row["macro_f1"][m])
        data = (
            f"{row['data_version']:04d} {row['snapshot'][:8]}"
            if row["snapshot"] and row["data_version"]
            else ""
        )
        took = f"{row['seconds']:.0f}s" if row["seconds"] is not None else ""
        table.add_row(
            row["run"],
            (row["status"] or "") + pruned_note(row),
            "\n".join(f"{key} {value}" for key, value in row["settings"].items()),
            "\n".join(f"{m} {row['macro_f1'][m]:.4f}" for m in ranked) or ", ".join(row["models"]),
            "\n".join(
                f"{m} {row['accuracy'][m]:.4f}"
                for m in ranked
                if row["accuracy"].get(m) is not None
            ),
            data,
            took,
            cost.short(row.get("cost")),  # USD from SageMaker's billing; locally CPU-seconds
            age(row["started"]),
            human_bytes(row["bytes"]),
        )
    return table


def pruned_note(row: dict) -> str:
    if row.get("half_pruned"):
        return ", half pruned (`smpipe prune` finishes it)"
    return ", pruned" if row.get("pruned") else ""


def versions_table(title: str, rows: list[dict]) -> Table:
    """One row per version of a model package group (registry.versions)."""
    table = Table(title=title)
    for column in ("version", "status", "registered", "what"):
        # What a version is may name a long path: folded, whole, rather than cut short.
        table.add_column(
            column,
            justify="right" if column == "version" else "left",
            overflow="fold" if column == "what" else "ellipsis",
        )
    for row in rows:
        when = age(row["registered_at"])
        table.add_row(str(row["version"]), row["approval_status"], when, row["description"])
    return table


def comparison_tables(result: dict) -> list[Table]:
    """Two runs' test metrics and per-label F1, one table per model (history.compare_runs)."""
    a, b = result["runs"]
    tables = []
    for model, metrics in result["models"].items():
        table = Table(title=f"{model}: test metrics, run {a} vs {b}")
        for column in ("metric", a, b, "difference"):
            table.add_column(column, justify="left" if column == "metric" else "right")
        for metric, (x, y) in metrics.items():
            table.add_row(metric, f"{x:.4f}", f"{y:.4f}", f"{y - x:+.4f}")
        for label, (x, y) in result["per_label"][model].items():
            diff = f"{y - x:+.4f}" if x is not None and y is not None else ""
            table.add_row(f"F1 {label}", _num(x), _num(y), diff)
        tables.append(table)
    return tables


def _num(x: float | None) -> str:
    return "" if x is None else f"{x:.4f}"
