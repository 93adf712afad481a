"""The manual's figures, made from what recorded them.

    python docs/figures.py reliability [--write docs/trust.md]
        the "Runs you can trust" table, from what the tests counted as they ran
        (build/figures/, tests/reliability/figures.py; `make figures` runs those tests);
        --write writes it over the table in that file
    python docs/figures.py demo [settings.ini] [--run N]
        the demo's figures (docs/performance.md, "The demo"), from the newest completed run's
        Metadata

A figure nothing recorded is said to be missing, never made up.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "build/figures"
HEADER = "| what was tried | measured (this machine, `make figures`) |"
MISSING = "not measured: run `make figures`"


def figure(name: str) -> dict:
    path = FIGURES / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def figures(folder: str) -> dict[str, dict]:
    """build/figures/<folder>/*.json, by name (a parametrized test's cases)."""
    paths = sorted((FIGURES / folder).glob("*.json"))
    return {p.stem: json.loads(p.read_text()) for p in paths}


def faults() -> str:
    f = figure("s3-faults")
    if not f:
        return MISSING
    kinds = f["faults"]
    said = ", ".join(f"{kinds.get(k, 0)} {k}" for k in ("500", "503", "dropped"))
    return f"{sum(kinds.values())} faults ({said}) in {f['requests']} requests of one pipeline run"


def completed() -> str:
    f = figure("s3-faults")
    return f"{f['completed']} of {f['runs']}" if f else MISSING


def lost() -> str:
    f = figure("s3-faults")
    return f"{f['lost']} of {f['files']} files ({f['manifests']} manifests)" if f else MISSING


# The property tests of tests/reliability/test_settings_properties.py, by what they generate.
PROPERTY_TESTS = {
    "test_any_settings_file_is_valid_or_one_config_error": "mutated files and overrides",
    "test_any_bytes_are_valid_or_one_config_error": "raw bytes",
    "test_a_dry_run_of_any_settings_exits_cleanly_and_writes_nothing": "dry runs",
}


def settings_cases() -> tuple[str, str]:
    """(cases generated, tracebacks among them), summed over the property tests."""
    tests = figures("settings-cases")
    if set(tests) != set(PROPERTY_TESTS):
        return MISSING, MISSING
    cases = sum(t["cases"] for t in tests.values())
    each = ", ".join(f"{what} {tests[name]['cases']}" for name, what in PROPERTY_TESTS.items())
    tracebacks = sum(t["tracebacks"] for t in tests.values())
    return f"{cases} per test run ({each})", str(tracebacks)


def secrets() -> str:
    tests = figures("secrets")
    if len(tests) < 2:
        return MISSING
    files = sum(t["files"] for t in tests.values())
    return f"{sum(t['found'] for t in tests.values())} in {files} files"


def cache() -> str:
    modules = figures("cache-mutations")
    if len(modules) < 2:
        return MISSING
    demo, other = modules["user_functions"], modules["mutant_functions"]
    stale = demo["stale"] + other["stale"]
    return (
        f"{stale} stale reuses in {demo['mutants'] + other['mutants']} changes "
        f"({demo['mutants']} of the demo's functions, {other['mutants']} of the other module)"
    )


def thousand() -> str:
    f = figure("thousand-labels")
    if not f:
        return MISSING
    return (
        f"inference job {f['inference_seconds']:.1f} s, peak {f['inference_peak_mb']:.0f} MB, "
        f"confusion figure {f['confusion_png_bytes'] / 1000:.0f} KB; the whole pipeline "
        f"{f['pipeline_seconds']:.0f} s"
    )


def exits() -> str:
    cases = figures("user-exit")
    inside = [c for name, c in cases.items() if name != "on-import"]
    if "on-import" not in cases or len(inside) < 3:
        return MISSING
    good = sum(c["failed"] and c["named"] and not c["kept"] for c in inside)
    refused = "refused up front" if cases["on-import"]["refused"] else "not refused"
    return f"{refused}; {good} of {len(inside)} jobs failed naming the function, nothing kept"


def max_run() -> str:
    f = figure("max-run-seconds")
    if not f:
        return MISSING
    return f"`{f['status']}` after {f['seconds']:.1f} s (`{f['reason']}`)"


def helper() -> str:
    f = figure("helper-process")
    if not f:
        return MISSING
    ended = "finished its sleep" if f["helper_finished"] else "is ended"
    return f"the job ends with the step ({f['job_seconds']:.1f} s), the helper {ended}"


def fills() -> str:
    cases = figures("store-fills")
    if set(cases) != {"checkpoint", "every write", "resumed"}:
        return MISSING
    first, resumed = cases["checkpoint"], cases["resumed"]
    temporaries = sum(c["temporaries"] for c in cases.values())
    return (
        f"one paragraph naming the store and key, run marked {first['status']}, "
        f"{temporaries} temporary files; resumed: {resumed['status']}"
    )


def killed() -> str:
    f = figure("driver-killed-mid-upload")
    if not f:
        return MISSING
    listed = "abandoned" if f["listed_abandoned"] else "not abandoned"
    return f"`smpipe runs`: {listed}; `--resume 1`: {f['resumed']}"


def reliability_rows() -> list[tuple[str, str]]:
    cases, tracebacks = settings_cases()
    return [
        ("S3 faults injected (500, 503 SlowDown, dropped connection on 5% of requests)", faults()),
        ("runs completed under those faults", completed()),
        ("artifacts lost or corrupt (every manifest's files, size and sha256 checked)", lost()),
        ("settings cases generated (hypothesis: mutated files, environment overrides, raw "
         "bytes, dry runs), counted as they ran", cases),
        ("tracebacks among them", tracebacks),
        ("secrets found in what a run leaves (a failed job's kept folder, its outputs, the "
         "store; a wandb run's files and model)", secrets()),
        ("cache mutations: every top-level definition of the demo's functions and of a module "
         "with a compiled pattern, a set, a 3,000-entry dict, a helper imported inside "
         "`encode`, changed one at a time", cache()),
        ("a left-truncating tokenizer, the first long text in a column `encode` never reads",
         "texts encoded whole"),
        ("1,000 labels of 10 rows", thousand()),
        ("`sys.exit()` on import; `sys.exit(0)`, `sys.exit(3)`, `os._exit(0)` inside "
         "`reconcile`", exits()),
        ("NaN and None labels; list or dict labels; a list of dropped ids",
         'dropped as blank (no class `"nan"`); refused naming `reconcile`'),
        ("`MAX_RUN_SECONDS = 3` and a job that never returns (local backend)", max_run()),
        ("`reconcile` leaves `sleep 90` running", helper()),
        ("the store fills while a checkpoint is written (and at every write)", fills()),
        ("the driver killed (SIGKILL) between two of prepare's uploads", killed()),
    ]  # fmt: skip


def reliability_table() -> str:
    rows = [HEADER, "|---|---|"] + [
        f"| {what} | {measured} |" for what, measured in reliability_rows()
    ]
    return "\n".join(rows) + "\n"


def write_table(page: Path, table: str) -> None:
    """The table that starts with `| what was tried |` replaced, up to its last row."""
    text = page.read_text()
    found = re.search(r"^\| what was tried \|.*\n(?:\|.*\n)*", text, re.M)
    if found is None:
        raise SystemExit(f"{page}: no table starting with '| what was tried |'")
    page.write_text(text[: found.start()] + table + text[found.end() :])


def demo(settings_path: str, run: int | None) -> str:
    from pipeline.cli import open_experiment
    from pipeline.history import read_record
    from pipeline.paths import ExperimentTree
    from pipeline.runs import existing_run_nums

    settings, store = open_experiment(settings_path)
    tree = ExperimentTree(settings.experiment.name)
    if run is None:
        done = [n for n in existing_run_nums(store, tree)
                if read_record(store, tree, n).get("status") == "completed"]  # fmt: skip
        if not done:
            raise SystemExit(f"no completed run of {tree.experiment!r} in {store.uri}")
        run = done[-1]
    return demo_figures(read_record(store, tree, run))


def demo_figures(record: dict) -> str:
    """What docs/performance.md, "The demo", says of a run, from its Metadata."""
    data = ", ".join(f"{s} {d['status']}" for s, d in (record.get("data_steps") or {}).items())
    steps = record["steps"]
    models = (steps.get("train") or steps["tune"])["details"]["models"]
    epochs = ", ".join(f"{m} {len(d.get('history') or [])} epochs" for m, d in models.items())
    length = re.search(r"^MAX_SEQUENCE_LENGTH = (\d+)", record.get("settings") or "", re.M)
    tested = record["holdout_performance"]
    f1 = ", ".join(f"{m} {p['macro_f1']:.3f}" for m, p in tested.items())
    lines = [
        f"run {record['run_id']} ({record['status']}, {record['backend']} backend): "
        f"{record['time_taken']:.0f} s ({record['time_taken'] / 60:.1f} minutes; {data}); "
        f"{epochs} at {length.group(1) if length else '?'} tokens; "
        f"peak memory {record['memory_usage'] / 1024:.1f} GB",
        f"test macro-F1: {f1}",
    ]
    comparison = record["steps"]["inference"]["details"].get("comparison") or {}
    rows = next(iter(tested.values()))["rows"]
    for pair in comparison.get("pairs", []):
        p = pair["mcnemar"]["p_value"]
        lines.append(
            f"{' vs '.join(pair['models'])}: McNemar's exact test p = {p:.2g} on the {rows} "
            f"test rows (they disagree on {pair['disagree']}); winner {comparison['winner']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    table = commands.add_parser("reliability", help='the "Runs you can trust" table')
    table.add_argument("--write", type=Path, metavar="PAGE", help="write it over the one in PAGE")
    shown = commands.add_parser("demo", help="the demo's figures, from a run's Metadata")
    shown.add_argument("settings", nargs="?", default=str(ROOT / "settings.ini"))
    shown.add_argument("--run", type=int, help="this run, not the newest completed one")
    args = parser.parse_args(argv)
    if args.command == "demo":
        print(demo(args.settings, args.run))
        return 0
    made = reliability_table()
    print(made, end="")
    if MISSING in made:
        print(f"some figures are missing ({FIGURES}): nothing written", file=sys.stderr)
        return 1
    if args.write:
        write_table(args.write, made)
    return 0


if __name__ == "__main__":
    sys.exit(main())
