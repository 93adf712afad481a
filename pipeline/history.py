"""An experiment's runs as data: what `smpipe runs` lists and `smpipe compare` sets side by side.

Everything is read from the store (each run's metadata.json, settings.ini and inference
results), so it works for any backend and for a store copied elsewhere.
"""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime

from pipeline.code_bundle import files_that_differ, shipped_files
from pipeline.paths import ExperimentTree, run_label
from pipeline.runs import existing_run_nums, never_started, silent_driver
from pipeline.store import NotFound, Store
from steps.runtime.names import PER_LABEL_FILE

METRICS = ("accuracy", "macro_f1", "weighted_f1")
UNSET = "(unset)"


class HistoryError(RuntimeError):
    """A run that cannot be listed or compared, said in one sentence."""


def read_record(store: Store, tree: ExperimentTree, run_num: int) -> dict:
    """A run's Metadata; HistoryError naming the run where there is none or it cannot be read
    (cut short by a partial copy or sync of the store, say): named, never a traceback."""
    key = tree.run(run_num).metadata
    try:
        return json.loads(store.get_bytes(key))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise HistoryError(
            f"run {run_label(run_num)} of {tree.experiment!r}: its Metadata "
            f"{store.uri_of(key)} cannot be read ({e})"
        ) from None
    except NotFound:
        runs = existing_run_nums(store, tree)
        if run_num not in runs:
            there = f"runs {run_label(runs[0])}-{run_label(runs[-1])}" if runs else "no runs"
            raise HistoryError(
                f"no run {run_label(run_num)} of {tree.experiment!r} in {store.uri} ({there})"
            ) from None
        raise HistoryError(
            f"run {run_label(run_num)} of {tree.experiment!r} has no Metadata at "
            f"{store.uri_of(tree.run(run_num).metadata)}"
        ) from None


def run_rows(store: Store, tree: ExperimentTree) -> list[dict]:
    """One row per run, oldest first: status, models, each model's test metrics and validation
    history, the data it was tested on, the settings that tell it from the other runs, how long
    it took, when it started and its size on the store."""
    rows, texts = [], []
    for run_num in existing_run_nums(store, tree):
        size = sum(store.list_sizes(tree.run(run_num).prefix).values())
        try:
            record = read_record(store, tree, run_num)
        except HistoryError:  # claimed, Metadata not written yet (or lost); or cut short
            there = store.exists(tree.run(run_num).metadata)
            record = {"status": "unreadable"} if there else None
        rows.append(_row(store, tree, run_num, record) | {"bytes": size})
        texts.append(_settings(store, tree, run_num, record) if record else "")
    values = [_readable(text) for text in texts]
    differing = iter(differing_settings([v for v in values if v is not None]))
    for row, read in zip(rows, values, strict=True):
        row["settings"] = next(differing) if read is not None else {}
    return rows


def _readable(text: str) -> dict[tuple[str, str], str] | None:
    """A run's settings, or None where it has none to read (claimed, or a file not in INI)."""
    import configparser

    try:
        return settings_values(text) if text else None
    except configparser.Error:
        return None


def _row(store: Store, tree: ExperimentTree, run_num: int, record: dict | None) -> dict:
    record = record or {"status": "claimed"}
    performance = record.get("holdout_performance") or {}
    status = record.get("status")
    if status == "running" and silent_driver(store, tree.run(run_num)):
        status = "abandoned"  # the rule the next run applies (pipeline/runs.py)
    elif status == "claimed" and never_started(store, tree.run(run_num)):
        status = "abandoned"  # its driver ended before the run had a record: nothing ran
    steps = record.get("steps") or {}
    trained = ((steps.get("train") or steps.get("tune") or {}).get("details") or {}).get("models")
    return {
        "run": run_label(run_num),
        "run_num": run_num,
        "status": status,
        "models": list(record.get("model_artifacts") or {}) or sorted(performance),
        "macro_f1": {m: p["macro_f1"] for m, p in performance.items()},
        "accuracy": {m: p.get("accuracy") for m, p in performance.items()},
        "validation": {m: d.get("history") or [] for m, d in (trained or {}).items()},
        "data_version": record.get("data_version"),
        "snapshot": record.get("data_snapshot_hash"),
        "seconds": record.get("time_taken"),
        "started": record.get("start_time"),
        "cost": record.get("cost"),  # pipeline/cost.py run_cost
        # its weights and checkpoints gone (prune.py), or going: a prune was stopped half way
        "pruned": bool(record.get("pruned")),
        "half_pruned": bool((record.get("pruned") or {}).get("unfinished")),
    }


def per_label(store: Store, tree: ExperimentTree, run_num: int, model: str) -> dict[str, float]:
    """label -> test F1 of `model` in that run (empty when the run tested nothing)."""
    try:
        text = store.get_bytes(f"{tree.run(run_num).inference}{model}/{PER_LABEL_FILE}").decode()
    except NotFound:
        return {}
    return {row["label"]: float(row["f1"]) for row in csv.DictReader(io.StringIO(text))}


def settings_values(text: str) -> dict[tuple[str, str], str]:
    """(section, key) -> value of a run's settings.ini, keys lower-cased as configparser reads."""
    from pipeline.config_file import ini_parser

    parser = ini_parser()
    parser.read_string(text)
    return {(s, k): v for s in parser.sections() for k, v in parser.items(s)}


# The words pydantic reads as a bool (its `bool` type's strings), by their truth.
TRUTH = {w: True for w in ("1", "on", "t", "true", "y", "yes")} | {
    w: False for w in ("0", "off", "f", "false", "n", "no")
}


def as_read(value: str | None) -> object:
    """A value as the settings read it, so that two spellings of it are one: a number by its
    value (`0.1` and `.10`, `3e-4` and `0.0003`), a truth by its truth (`true`, `yes`), a list
    without the spaces around its commas; anything else as written."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    if value.strip().lower() in TRUTH:
        return TRUTH[value.strip().lower()]
    return ",".join(part.strip() for part in value.split(","))


def settings_changes(before: str, now: str) -> list[str]:
    """`[section] KEY: old -> new` for every key whose value differs between two settings
    files, as the settings read it (`as_read`)."""
    old, new = settings_values(before), settings_values(now)
    return [
        f"[{s}] {k.upper()}: {old.get((s, k), UNSET)} -> {new.get((s, k), UNSET)}"
        for s, k in sorted(set(old) | set(new))
        if as_read(old.get((s, k))) != as_read(new.get((s, k)))
    ]


def differing_settings(values: list[dict[tuple[str, str], str]]) -> list[dict[str, str]]:
    """For each run's settings (settings_values), those whose value is not the same in all runs,
    named `KEY` (or `[section] KEY` where two sections hold the same key): what tells the runs
    apart."""
    keys = sorted({key for v in values for key in v})
    differ = [key for key in keys if len({as_read(v.get(key)) for v in values}) > 1]
    names = {k for _, k in differ}
    clash = {k for k in names if sum(k == other for _, other in differ) > 1}
    label = {(s, k): f"[{s}] {k.upper()}" if k in clash else k.upper() for s, k in differ}
    return [{label[key]: v.get(key, UNSET) for key in differ} for v in values]


SPLIT_SETTINGS = tuple(
    f"[data] {key}: " for key in ("SEED", "TRAIN_FRACTION", "VALIDATION_FRACTION", "TEST_FRACTION")
)


def compare_runs(store: Store, tree: ExperimentTree, a: int, b: int) -> dict:
    """Two runs side by side: each model's test metrics and per-label F1 in both, and the
    settings that differ. Metrics are only set against each other when both runs were tested
    on the same data snapshot; otherwise `comparable` is False and `why` says so."""
    runs = existing_run_nums(store, tree)
    if a not in runs and b not in runs and a != b:  # both said at once
        there = f"runs {run_label(runs[0])}-{run_label(runs[-1])}" if runs else "no runs"
        raise HistoryError(
            f"no runs {run_label(a)} and {run_label(b)} of {tree.experiment!r} in {store.uri} "
            f"({there})"
        )
    first, second = read_record(store, tree, a), read_record(store, tree, b)
    changes = settings_changes(_settings(store, tree, a, first), _settings(store, tree, b, second))
    why = why_not_comparable((a, first), (b, second), changes)
    models: dict[str, dict] = {}
    labels: dict[str, dict] = {}
    if why is None:
        shared = [m for m in first["holdout_performance"] if m in second["holdout_performance"]]
        for model in shared:
            models[model] = {
                metric: (
                    first["holdout_performance"][model][metric],
                    second["holdout_performance"][model][metric],
                )
                for metric in METRICS
            }
            f1a, f1b = per_label(store, tree, a, model), per_label(store, tree, b, model)
            labels[model] = {
                label: (f1a.get(label), f1b.get(label)) for label in sorted(set(f1a) | set(f1b))
            }
    return {
        "code": code_changes(store, tree, a, b),
        "runs": [run_label(a), run_label(b)],
        "comparable": why is None,
        "why": why,
        "models": models,
        "per_label": labels,
        "settings": changes,
        "only_in": {
            run_label(n): sorted(
                set(r.get("holdout_performance") or {}) - set(o.get("holdout_performance") or {})
            )
            for n, r, o in ((a, first, second), (b, second, first))
        },
    }


def why_not_comparable(a: tuple[int, dict], b: tuple[int, dict], changes: list[str]) -> str | None:
    """Why two runs' (number, Metadata) metrics say nothing against each other, or None: a
    run that tested no model, or test sets that differ. The test rows are the snapshot's,
    split by the SPLIT_SETTINGS (steps/splits.py `stratified_split`): one snapshot split
    otherwise is other rows."""
    (n, first), (m, second) = a, b
    untested = [(k, r) for k, r in (a, b) if not r.get("holdout_performance")]
    if untested:
        runs = " and ".join(run_label(k) for k, _ in untested)
        statuses = " and ".join(str(r.get("status")) for _, r in untested)
        said = ("run", "it is") if len(untested) == 1 else ("runs", "they are")
        return f"{said[0]} {runs} tested no model ({said[1]} {statuses})"
    tested = [sorted(r["holdout_performance"]) for r in (first, second)]
    if not set(tested[0]) & set(tested[1]):
        return (
            f"runs {run_label(n)} and {run_label(m)} tested no model in common (run "
            f"{run_label(n)}: {', '.join(tested[0])}; run {run_label(m)}: {', '.join(tested[1])})"
        )
    snapshots = [r.get("data_snapshot_hash") for r in (first, second)]
    split = [c for c in changes if c.startswith(SPLIT_SETTINGS)]
    if snapshots[0] != snapshots[1] or None in snapshots:
        how = ""
    elif split and first.get("data_version") != second.get("data_version"):
        how = f", split otherwise ({'; '.join(split)})"
    else:
        return None
    return (
        f"run {run_label(n)} was tested on data {_data(first)} and run {run_label(m)} on "
        f"data {_data(second)}{how}: their test sets differ, so a difference in their metrics "
        "says nothing about the models"
    )


def code_changes(store: Store, tree: ExperimentTree, a: int, b: int) -> list[str] | str:
    """The files of the two runs' code/ that differ (the user's modules by name, this
    project's steps/ as one), by the sha256 each run's manifest holds; or why they cannot be
    told: a run whose code is not in the store."""
    first, second = (shipped_files(store, tree.run(n).code) for n in (a, b))
    if first is None or second is None:
        gone = [run_label(n) for n, files in ((a, first), (b, second)) if files is None]
        return f"the code of run {' and '.join(gone)} is not in the store"
    return files_that_differ(first, second, f"run {run_label(a)}", f"run {run_label(b)}")


def _data(record: dict) -> str:
    version, snapshot = record.get("data_version"), record.get("data_snapshot_hash")
    label = run_label(version) if isinstance(version, int) else "?"
    return f"{label} (snapshot {snapshot[:12] if snapshot else 'unknown'})"


def _settings(store: Store, tree: ExperimentTree, run_num: int, record: dict) -> str:
    try:
        return store.get_bytes(tree.run(run_num).settings).decode()
    except NotFound:
        return record.get("settings") or ""


def age(iso: str | None) -> str:
    """'2026-11-22 14:03' from Metadata's ISO time."""
    if not iso:
        return ""
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).strftime("%Y-%m-%d %H:%M")


def human_bytes(size: float) -> str:
    """'347.2 MB': decimal units, as S3's console and the AWS bill count them."""
    unit = "B"
    for larger in ("kB", "MB", "GB", "TB"):
        if size < 999.95:  # what would print as 1000.0 is the next unit's 1.0
            break
        size, unit = size / 1000, larger
    return f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"
