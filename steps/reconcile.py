"""Reconcile (processing job): the user's raw data -> one snapshot, with its content hash.

Inputs:  raw       the raw data, as the user keeps it
Outputs: snapshot  the reconciled rows (datasets save_to_disk) and snapshot.json: content
                   hash, row count, label counts and what reconcile dropped
         report    step_metadata.json, this step's Metadata section
"""

from __future__ import annotations

import collections
import hashlib
import json
import os

import datasets

from steps.contract import processing_input, processing_output, run_step, write_step_metadata
from steps.user_code import call, load_user_functions


def content_hash(dataset: datasets.Dataset) -> str:
    """sha256 of the rows in order, as canonical JSON: the same data gives the same hash
    whatever the arrow file layout."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(dataset.column_names)).encode())
    for row in dataset:
        h.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()


def drop_blank_labels(dataset: datasets.Dataset) -> tuple[datasets.Dataset, list[str]]:
    """Rows whose label is missing or blank are not a class named '': they are dropped, and
    reported by id (or row number) with the rest of what reconcile dropped."""
    labels = dataset["label"]
    blank = [i for i, label in enumerate(labels) if label is None or not label.strip()]
    if not blank:
        return dataset, []
    ids = dataset["id"] if "id" in dataset.column_names else None
    names = [str(ids[i]) if ids is not None else f"row {i}" for i in blank]
    keep = sorted(set(range(len(labels))) - set(blank))
    return dataset.select(keep), names


def main() -> None:
    raw_dir = processing_input("raw")
    snapshot_dir = processing_output("snapshot")
    functions = load_user_functions(os.environ["SMPIPE_USER_FUNCTIONS"])

    files = [p for p in raw_dir.rglob("*") if p.is_file() and p.name != "_MANIFEST.json"]
    if not files:
        raise RuntimeError(f"the raw data folder is empty: {raw_dir}")
    formats = collections.Counter(p.suffix.lstrip(".") or "none" for p in files)

    result = call(functions, "reconcile", raw_dir)
    dataset, dropped = result if isinstance(result, tuple) else (result, {})
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(
            f"{functions.module}.reconcile must return a datasets.Dataset, got {type(dataset).__name__}"
        )
    if "label" not in dataset.column_names:
        raise ValueError(
            f"{functions.module}.reconcile returned no 'label' column (columns: {dataset.column_names})"
        )
    if len(dataset) == 0:
        raise ValueError(f"{functions.module}.reconcile returned no rows")
    dataset = (
        dataset.cast_column("label", datasets.Value("string"))
        if dataset.features["label"].dtype != "string"
        else dataset
    )
    dataset, blank = drop_blank_labels(dataset)
    if blank:
        dropped = {**dropped, "blank_label": blank}
    if len(dataset) == 0:
        raise ValueError(f"{functions.module}.reconcile returned no row with a label")

    label_counts = dict(sorted(collections.Counter(dataset["label"]).items()))
    dropped_counts = {reason: len(ids) for reason, ids in dropped.items()}
    info = {
        "snapshot_hash": content_hash(dataset),
        "rows": len(dataset),
        "columns": dataset.column_names,
        "label_counts": label_counts,
        "dropped": {reason: sorted(map(str, ids)) for reason, ids in dropped.items()},
    }
    dataset.save_to_disk(str(snapshot_dir / "dataset"))
    (snapshot_dir / "snapshot.json").write_text(json.dumps(info, indent=2))

    print(f"reconciled {len(dataset)} rows, labels {label_counts}")
    for reason, count in dropped_counts.items():
        if count:
            print(f"dropped {count} ({reason}): {', '.join(info['dropped'][reason][:10])}")
    write_step_metadata(
        processing_output("report"),
        {
            "snapshot_hash": info["snapshot_hash"],
            "rows": len(dataset),
            "label_counts": label_counts,
            "dropped": dropped_counts,
            "raw_file_size": sum(p.stat().st_size for p in files),
            "raw_files": len(files),
            "raw_format": ",".join(f"{ext}:{n}" for ext, n in sorted(formats.items())),
        },
    )


if __name__ == "__main__":
    run_step("reconcile", main)
