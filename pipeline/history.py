"""An experiment's runs as data: what `smpipe runs` lists and `smpipe compare` sets side by side.

Everything is read from the store (each run's metadata.json, settings.ini and inference
results), so it works for any backend and for a store copied elsewhere.
"""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime

from pipeline.paths import ExperimentTree, run_label
from pipeline.runs import existing_run_nums, silent_driver
from pipeline.store import NotFound, Store
from steps.runtime.names import PER_LABEL_FILE

METRICS = ("accuracy", "macro_f1", "weighted_f1")


class HistoryError(RuntimeError):
    """A run that cannot be listed or compared, said in one sentence."""


def read_record(store: Store, tree: ExperimentTree, run_num: int) -> dict:
    try:
        return json.loads(store.get_bytes(tree.run(run_num).metadata))
    except NotFound:
        raise HistoryError(
            f"run {run_label(run_num)} of {tree.experiment!r} has no Metadata at "
            f"{store.uri_of(tree.run(run_num).metadata)}"
        ) from None


def run_rows(store: Store, tree: ExperimentTree) -> list[dict]:
    """One row per run, oldest first: status, models, each model's test macro-F1, the data
    it was tested on, how long it took, when it started and its size on the store."""
    rows = []
    for run_num in existing_run_nums(store, tree):
        size = sum(store.list_sizes(tree.run(run_num).prefix).values())
        try:
            record = read_record(store, tree, run_num)
        except HistoryError:  # claimed, Metadata not written yet (or lost)
            rows.append(
                {
                    "run": run_label(run_num),
                    "status": "claimed",
                    "models": [],
                    "macro_f1": {},
                    "data_version": None,
                    "snapshot": None,
                    "seconds": None,
                    "started": None,
                    "bytes": size,
                }
            )
            continue
        performance = record.get("holdout_performance") or {}
        models = list(record.get("model_artifacts") or {}) or sorted(performance)
        status = record.get("status")
        if status == "running" and silent_driver(store, tree.run(run_num).heartbeat):
            status = "abandoned"  # the rule the next run applies (pipeline/runs.py)
        rows.append(
            {
                "run": run_label(run_num),
                "status": status,
                "models": models,
                "macro_f1": {m: p["macro_f1"] for m, p in performance.items()},
                "data_version": record.get("data_version"),
                "snapshot": record.get("data_snapshot_hash"),
                "seconds": record.get("time_taken"),
                "started": record.get("start_time"),
                "bytes": size,
                "cost": record.get("cost"),  # pipeline/cost.py run_cost
            }
        )
    return rows


def per_label(store: Store, tree: ExperimentTree, run_num: int, model: str) -> dict[str, float]:
    """label -> test F1 of `model` in that run (empty when the run tested nothing)."""
    try:
        text = store.get_bytes(f"{tree.run(run_num).inference}{model}/{PER_LABEL_FILE}").decode()
    except NotFound:
        return {}
    return {row["label"]: float(row["f1"]) for row in csv.DictReader(io.StringIO(text))}


def settings_changes(before: str, now: str) -> list[str]:
    """`[section] KEY: old -> new` for every key that differs between two settings files."""
    import configparser

    def read(text: str) -> dict[tuple[str, str], str]:
        parser = configparser.ConfigParser(interpolation=None, delimiters=("=",))
        parser.read_string(text)
        return {(s, k): v for s in parser.sections() for k, v in parser.items(s)}

    old, new = read(before), read(now)
    return [
        f"[{s}] {k.upper()}: {old.get((s, k), '(unset)')} -> {new.get((s, k), '(unset)')}"
        for s, k in sorted(set(old) | set(new))
        if old.get((s, k)) != new.get((s, k))
    ]


def compare_runs(store: Store, tree: ExperimentTree, a: int, b: int) -> dict:
    """Two runs side by side: each model's test metrics and per-label F1 in both, and the
    settings that differ. Metrics are only set against each other when both runs were tested
    on the same data snapshot; otherwise `comparable` is False and `why` says so."""
    first, second = read_record(store, tree, a), read_record(store, tree, b)
    snapshots = [r.get("data_snapshot_hash") for r in (first, second)]
    why = None
    if not all(r.get("holdout_performance") for r in (first, second)):
        untested = [
            run_label(n) for n, r in ((a, first), (b, second)) if not r.get("holdout_performance")
        ]
        statuses = ", ".join(str(r.get("status")) for r in (first, second))
        why = f"run {' and '.join(untested)} tested no model (status {statuses})"
    elif snapshots[0] != snapshots[1] or None in snapshots:
        why = (
            f"run {run_label(a)} was tested on data {_data(first)} and run {run_label(b)} on "
            f"data {_data(second)}: their test sets differ, so a difference in their metrics says "
            "nothing about the models"
        )
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
    changes = settings_changes(_settings(store, tree, a, first), _settings(store, tree, b, second))
    return {
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
