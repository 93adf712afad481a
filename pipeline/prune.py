"""What a run keeps once it has ended, and what `smpipe prune` removes from older runs.

A completed run needs no resume state: when it completes, its checkpoints (every model's and
every tuning trial's, under runs/<run_num>/checkpoints/) are removed, unless [training]
KEEP_CHECKPOINTS_AFTER_RUN keeps them. A failed, interrupted or abandoned run keeps them, so
`--resume` continues it.

`smpipe prune --keep N` goes further for the runs older than the newest N completed ones: their
bulky files go (checkpoints, the weights and exports of their models, tuning trial folders,
SageMaker's model archives). What says what a run was and did stays: metadata.json and its
step sections, settings.ini, logs, inference results, report.html, and each model's records
(history, curves, smpipe.json). Data versions (data/) and the cache are never touched, and
neither is a run that may still be running (its driver alive, or no Metadata yet).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from pipeline.errors import log
from pipeline.history import human_bytes, run_rows
from pipeline.paths import ExperimentTree, RunTree
from pipeline.store import MANIFEST, Store, StoreError
from steps.model_files import EXPORTS

# A model folder's weights (safetensors, or a Hugging Face save's .bin) and its exports
# (steps/model_files.py). Its small records stay: the report draws the curves from them.
WEIGHTS = (".safetensors", ".bin", *EXPORTS.values())
# Runs that may still be written to: a live driver's, or one claimed whose Metadata is not
# written yet (pipeline/history.py's statuses).
LIVE = ("running", "claimed")


class PruneError(ValueError):
    """A prune that cannot be asked for, said in one sentence."""


def remove_checkpoints(store: Store, run: RunTree) -> int | None:
    """Remove every checkpoint of a run that completed: the bytes freed, or None when the store
    refused (said in a warning: the run is completed all the same)."""
    removed = 0
    try:
        sizes = store.list_sizes(run.checkpoints_root)
        for key, size in sizes.items():
            store.delete(key)
            removed += size
    except StoreError as e:
        log.warning(
            f"the checkpoints of run {run.label} could not be removed ({human_bytes(removed)} "
            f"were): {e}. The run is completed all the same; `smpipe prune` removes them later."
        )
        return None
    if sizes:
        log.info(
            f"removed the checkpoints of run {run.label}: {human_bytes(removed)} freed "
            f"({len(sizes)} files; [training] KEEP_CHECKPOINTS_AFTER_RUN = true keeps them)"
        )
    return removed


@dataclass
class Removal:
    """What prune removes from one run: key -> bytes, and the same grouped by folder."""

    run: RunTree
    status: str
    run_bytes: int  # the whole run on the store, before
    files: dict[str, int] = field(default_factory=dict)
    groups: dict[str, int] = field(default_factory=dict)  # a folder of the run -> bytes

    @property
    def bytes(self) -> int:
        return sum(self.files.values())


def bulky_files(store: Store, run: RunTree, status: str) -> Removal:
    """The files of `run` that prune removes, each counted under the folder it goes with."""
    sizes = store.list_sizes(run.prefix)
    folders = [run.checkpoints_root, run.training_output] + [
        f"{run.tuning(model)}{trial}/"
        for model in store.list_children(run.tuning_root)
        for trial in store.list_children(run.tuning(model))
    ]
    # A study's best model waiting for its export (a run that stopped between the two).
    folders += [run.best_trial_model(model) for model in store.list_children(run.models)]
    models = [f"{run.model(model)}model/" for model in store.list_children(run.models)]
    removal = Removal(run, status, sum(sizes.values()))
    for key, size in sizes.items():
        folder = next((f for f in folders if key.startswith(f)), None)
        model = next((m for m in models if key.startswith(m)), None)
        # A model folder loses its manifest with its weights: it is no longer complete, so
        # no later run mistakes it for a model it can test (pipeline/sources.py).
        if folder is None and model and (key.endswith(WEIGHTS) or key == model + MANIFEST):
            folder = model
        if folder is not None:
            removal.files[key] = size
            where = folder[len(run.prefix) :]
            removal.groups[where] = removal.groups.get(where, 0) + size
    return removal


def prune_plan(store: Store, tree: ExperimentTree, keep: int) -> list[Removal]:
    """What pruning all but the newest `keep` completed runs removes, run by run (runs with
    nothing left to remove are left out)."""
    if keep < 1:
        raise PruneError(
            f"--keep {keep}: keep at least 1 completed run (the newest N completed runs and "
            "every run after them are left whole)"
        )
    rows = run_rows(store, tree)
    completed = [int(r["run"]) for r in rows if r["status"] == "completed"]
    if len(completed) <= keep:
        return []
    oldest_kept = completed[-keep]
    removals = []
    for row in rows:
        if int(row["run"]) >= oldest_kept or row["status"] in LIVE:
            continue
        removal = bulky_files(store, tree.run(int(row["run"])), row["status"])
        if removal.files:
            removals.append(removal)
    return removals


def prune_run(store: Store, removal: Removal, keep: int) -> None:
    """Remove what `removal` names, manifests first (a model folder stops being complete
    before its weights go), then record it in the run's metadata.json."""
    run = removal.run
    for key in sorted(removal.files, key=lambda k: not k.endswith(MANIFEST)):
        store.delete(key)
    record = json.loads(store.get_bytes(run.metadata))
    before = record.get("pruned") or {}
    removed = dict(before.get("removed") or {})
    for where, size in removal.groups.items():
        removed[where] = removed.get(where, 0) + size
    record["pruned"] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "keep": keep,
        "removed_files": before.get("removed_files", 0) + len(removal.files),
        "removed_bytes": before.get("removed_bytes", 0) + removal.bytes,
        "removed": removed,
    }
    store.put_bytes(run.metadata, json.dumps(record, indent=2).encode())
