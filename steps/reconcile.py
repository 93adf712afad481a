"""Reconcile (processing job): the user's raw data -> one snapshot, with its content hash.

Inputs:  raw       the raw data, as the user keeps it
Outputs: snapshot  the reconciled rows (datasets save_to_disk) and snapshot.json: content
                   hash, row count, the labels in their ids' order, label counts and what
                   reconcile dropped
         report    step_metadata.json, this step's Metadata section
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import math
import os
import re
import sys
import tempfile
import traceback
from pathlib import Path

import datasets

from steps.arguments import RECONCILE, parse
from steps.runtime import names
from steps.runtime.environment import processing_input, processing_output
from steps.runtime.step import end_process, run_step, write_step_metadata
from steps.user_code import call, innermost_cause, load_user_functions


def content_hash(dataset: datasets.Dataset) -> str:
    """sha256 of the rows in order, as canonical JSON: the same data gives the same hash
    whatever the arrow file layout."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(dataset.column_names)).encode())
    for row in dataset:
        h.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()


def is_blank(label) -> bool:
    """No label: None, NaN (pandas' and numpy's missing value), or an empty string."""
    if label is None:
        return True
    if isinstance(label, float):
        return math.isnan(label)
    return isinstance(label, str) and not label.strip()


def drop_blank_labels(dataset: datasets.Dataset) -> tuple[datasets.Dataset, list[str]]:
    """Rows whose label is missing or blank are not a class named '' or 'nan': they are
    dropped, and reported by id (or row number) with the rest of what reconcile dropped."""
    labels = dataset["label"]
    blank = [i for i, label in enumerate(labels) if is_blank(label)]
    if not blank:
        return dataset, []
    ids = dataset["id"] if "id" in dataset.column_names else None
    names = [str(ids[i]) if ids is not None else f"row {i}" for i in blank]
    keep = sorted(set(range(len(labels))) - set(blank))
    return dataset.select(keep), names


def label_order(labels, declared: list[str] | None = None) -> list[str]:
    """The labels (strings) in the order of their class ids: a ClassLabel's own order (the
    names it has rows for), whole numbers by value (8 before 10, as a Hugging Face data set's
    integer labels are its class ids), other labels sorted."""
    present = set(labels)
    if declared:
        return [name for name in declared if name in present]
    if all(re.fullmatch(r"-?[0-9]+", label) for label in present):
        return sorted(present, key=lambda label: (int(label), label))  # "01" and "1" too
    return sorted(present)


def named_labels(dataset: datasets.Dataset) -> datasets.Dataset:
    """A ClassLabel column as its names (datasets' own cast would give the ids as strings);
    its missing value (-1) becomes None, a blank label."""
    feature = dataset.features["label"]
    if not isinstance(feature, datasets.ClassLabel):
        return dataset
    names = [feature.int2str(i) if i is not None and i >= 0 else None for i in dataset["label"]]
    return dataset.remove_columns("label").add_column("label", names)


def returned(dataset, result) -> str:
    """What reconcile returned instead, and the way to what it must."""
    if isinstance(result, list) and len(result) == 2:
        return "a list of two: return a tuple, `return dataset, dropped`"
    kind = type(dataset)
    if kind.__module__.startswith("pandas") and kind.__name__ == "DataFrame":
        return "a pandas DataFrame: datasets.Dataset.from_pandas(df, preserve_index=False)"
    return kind.__name__


def check_result(result, module: str, labelled: bool = True) -> tuple[datasets.Dataset, dict]:
    """reconcile's return value as the contract has it, or an error naming the function. Rows
    to predict (`labelled` False) need no label."""
    dataset, dropped = result if isinstance(result, tuple) and len(result) == 2 else (result, {})
    where = f"{module}.reconcile"
    # `load_dataset("csv", data_files=...)`, as the datasets docs load a file, returns a
    # DatasetDict of one split, "train" (https://huggingface.co/docs/datasets/loading): its
    # rows are the data. Several splits are the user's own, which the pipeline would not keep.
    if isinstance(dataset, datasets.DatasetDict) and len(dataset) == 1:
        (dataset,) = dataset.values()
    if isinstance(dataset, datasets.DatasetDict):
        raise TypeError(
            f"{where} returned a DatasetDict of splits {list(dataset)}: return one "
            "datasets.Dataset of every row (datasets.concatenate_datasets(list(d.values()))); "
            "the pipeline makes its own splits ([data] TRAIN_FRACTION, VALIDATION_FRACTION)"
        )
    if not isinstance(dataset, datasets.Dataset):
        wanted = "a datasets.Dataset, or (dataset, {reason: [ids dropped]})"
        raise TypeError(f"{where} must return {wanted}; got {returned(dataset, result)}")
    if labelled and "label" not in dataset.column_names:
        hint = (
            ": rename it, dataset.rename_column('labels', 'label')"
            if "labels" in dataset.column_names
            else ""
        )
        raise ValueError(
            f"{where} returned no 'label' column (columns: {dataset.column_names}){hint}"
        )
    label_type = dataset.features.get("label", datasets.Value("string"))
    if not isinstance(label_type, datasets.Value | datasets.ClassLabel):
        raise TypeError(
            f"{where} returned labels of type {label_type}: a label is one string (or number) "
            "per row"
        )
    if not isinstance(dropped, dict) or not all(
        isinstance(ids, list | tuple | set) for ids in dropped.values()
    ):
        raise TypeError(
            f"{where} must return (dataset, {{reason: [ids dropped]}}); its second value is "
            f"{type(dropped).__name__}"
            + (
                f" of {type(next(iter(dropped.values()))).__name__}"
                if isinstance(dropped, dict) and dropped
                else ""
            )
        )
    if len(dataset) == 0:
        said = [f"{len(ids)} as {reason}" for reason, ids in dropped.items() if len(ids)]
        raise ValueError(
            f"{where} returned no rows" + (f" (it dropped {', '.join(said)})" if said else "")
        )
    return dataset, dropped


@contextlib.contextmanager
def datasets_cache_of_the_job():
    """datasets' cache, for what the user's reconcile loads, in a folder of the job's removed
    with it: `load_dataset` writes an Arrow copy of the files it reads, named by their path,
    which on a local job is new each run, so in the user's ~/.cache/huggingface a copy would be
    added by every run and never read again (in a container it goes with the container). The
    job root where a player placed one (removed with it, a killed job's too), else the
    container's temporary folder. A Hub data set it loads is prepared anew each job, as each
    SageMaker job starts with an empty cache. A cache the user named (HF_DATASETS_CACHE, or
    HF_HOME, under which datasets keeps its own) is theirs."""
    if "HF_DATASETS_CACHE" in os.environ or "HF_HOME" in os.environ:
        yield
        return
    where = os.environ.get(names.ML_ROOT_VARIABLE)  # None in a container: its own /tmp
    with tempfile.TemporaryDirectory(prefix="datasets-cache-", dir=where) as folder:
        before, datasets.config.HF_DATASETS_CACHE = datasets.config.HF_DATASETS_CACHE, Path(folder)
        try:
            yield
        finally:
            datasets.config.HF_DATASETS_CACHE = before


def main() -> None:
    with datasets_cache_of_the_job():
        reconcile_snapshot()


def reconcile_snapshot() -> None:
    parse(RECONCILE)  # none: a stray argument is refused, not ignored
    raw_dir = processing_input("raw")
    snapshot_dir = processing_output("snapshot")
    functions = load_user_functions(os.environ[names.USER_FUNCTIONS_VARIABLE])

    files = [p for p in raw_dir.rglob("*") if p.is_file() and p.name != "_MANIFEST.json"]
    if not files:
        raise RuntimeError(f"the raw data folder is empty: {raw_dir}")
    result, outside = called(functions, raw_dir)
    dataset, dropped = check_result(result, functions.module)
    feature = dataset.features["label"]
    declared = feature.names if isinstance(feature, datasets.ClassLabel) else None
    dataset = named_labels(dataset)
    dataset, blank = drop_blank_labels(dataset)
    dataset = (
        dataset.cast_column("label", datasets.Value("string"))
        if dataset.features["label"].dtype != "string"
        else dataset
    )
    if blank:
        dropped = {**dropped, "blank_label": blank}
    if len(dataset) == 0:
        raise ValueError(f"{functions.module}.reconcile returned no row with a label")

    counts = collections.Counter(dataset["label"])
    labels = label_order(counts, declared)
    label_counts = {label: counts[label] for label in labels}
    dropped_counts = {reason: len(ids) for reason, ids in dropped.items()}
    info = {
        "snapshot_hash": content_hash(dataset),
        "rows": len(dataset),
        "columns": dataset.column_names,
        "labels": labels,  # in the order of their class ids (prepare's id2label)
        "label_counts": label_counts,
        "dropped": {reason: sorted(map(str, ids)) for reason, ids in dropped.items()},
    }
    dataset.save_to_disk(str(snapshot_dir / "dataset"))
    (snapshot_dir / "snapshot.json").write_text(json.dumps(info, indent=2))

    print(f"reconciled {len(dataset)} rows, labels {label_counts}")
    integers = not declared and getattr(feature, "dtype", "").startswith(("int", "uint"))
    for line in unmeant(dataset, labels, integers):
        print(f"warning: {line}")
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
            "raw_format": formats_of(files),
            "read_outside_raw_data": outside[:SHOWN_OUTSIDE],  # the driver indexes no such
        },
    )


SHOWN_OUTSIDE = 5  # files named of those reconcile read outside its raw data

# What Python and its libraries read on their own: system folders, below the installs and the
# caches (sys.prefix and sys.path are added where the job runs).
SYSTEM = ("/proc/", "/sys/", "/dev/", "/etc/", "/usr/", "/lib/", "/lib64/", "/bin/", "/opt/ml/")


@contextlib.contextmanager
def files_read_outside(raw_dir: Path):
    """The files the block opens to read that were there before it, outside `raw_dir`, the
    job's own folder, Python's installs and paths, the caches and the user's configuration
    (a list, filled as they are opened): Python's "open" audit event, which io.open and
    os.open raise (sys.addaudithook, PEP 578) and datasets' readers go through (fsspec's local
    files). Such a file is no input the driver keys a reconcile by: on this machine its edits
    went unseen by the next run, which reused the snapshot; on SageMaker the job cannot read
    it. Readers that open files in native code (pyarrow's, pandas' read_parquet, sqlite) and
    worker processes (`num_proc`) raise no event here: they go unseen."""
    here, home = os.getcwd(), os.path.join(os.path.realpath(Path.home()), "")
    within = [raw_dir, datasets.config.HF_DATASETS_CACHE, os.environ.get("HF_HOME"), here]
    within += [Path.home() / "nltk_data", sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path]
    # "/" (a container's working folder, and so on sys.path under `python -m`) would hold all.
    roots = {os.path.join(os.path.realpath(p), "") for p in within if p} - {os.sep}
    skipped = (*SYSTEM, *roots)
    found: list[str] = []
    made: set[str] = set()  # what the block wrote: its own, not an input
    active, started = [True], reference_time()

    def opened(event: str, args: tuple) -> None:
        if event == "open" and active[0] and isinstance(args[0], str | bytes | os.PathLike):
            with contextlib.suppress(Exception):  # never the user's open's error
                noted(*args)

    def noted(file, mode, flags) -> None:
        if isinstance(mode, str):  # io.open's mode; os.open's flags
            writes = any(c in mode for c in "wax+")
        else:
            writes = bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        path = os.path.realpath(os.fsdecode(file))
        if writes:
            made.add(path)
            return
        config = path.startswith(home) and path[len(home) :].startswith(".")  # ~/.aws, ~/.config
        if path.startswith(skipped) or config or path in made or path in found:
            return
        # One the block made otherwise (an archive unpacked by a native tool) changed since it
        # started: its ctime, which no tool sets back, is not older than the block.
        if os.path.isfile(path) and os.stat(path).st_ctime < started:
            found.append(path)

    sys.addaudithook(opened)  # for good (PEP 578): it stops listening when the block ends
    try:
        yield found
    finally:
        active[0] = False


def reference_time() -> float:
    """Now, on the clock the file system stamps ctimes with (a coarse one: a file made this
    instant can read a few milliseconds before time.time())."""
    with tempfile.NamedTemporaryFile() as probe:
        return os.fstat(probe.fileno()).st_ctime


def formats_of(files: list[Path]) -> str:
    """The raw files' kinds by extension, counted: `csv:2,txt:2225`."""
    formats = collections.Counter(p.suffix.lstrip(".") or "none" for p in files)
    return ",".join(f"{ext}:{n}" for ext, n in sorted(formats.items()))


def called(functions, raw_dir: Path) -> tuple[object, list[str]]:
    """The user's reconcile on `raw_dir`: what it returned, and the files it read outside it
    (said); a failure that looked for a file in the job's own folder says so."""
    try:
        with files_read_outside(raw_dir) as outside:
            result = call(functions, "reconcile", raw_dir)
    except RuntimeError as e:  # the user's error (steps/user_code.py `call`)
        raise RuntimeError(f"{e}{read_elsewhere(e, raw_dir)}") from e
    if outside:
        shown = ", ".join(outside[:SHOWN_OUTSIDE]) + " ..." * (len(outside) > SHOWN_OUTSIDE)
        print(
            f"warning: {functions.module}.reconcile read files outside the raw data it was "
            f"given ({shown}): a SageMaker job cannot read them, and no later run reuses this "
            "snapshot, since their changes are not seen: read everything under the folder "
            "reconcile is given (raw_dir: the job's copy of RAW_DATA)"
        )
    return result, outside


def read_elsewhere(error: RuntimeError, raw_dir) -> str:
    """Where reconcile looked for a file in the job's own folder (a relative path: the
    project's folder on this machine, `data/news.csv`, is no job's), the way to the raw data."""
    missing, here = innermost_cause(error), os.getcwd()
    if not isinstance(missing, FileNotFoundError):
        return ""
    name = missing.filename if isinstance(missing.filename, str) else None
    # pandas and open() name the path as given; datasets says it absolute, within the job's.
    relative = name is not None and not os.path.isabs(name)
    inside = here != os.sep and here in str(missing) and str(raw_dir) not in str(missing)
    if not (relative or (name is None and inside)):
        return ""
    return (
        f"; a relative path is read from the job's own folder ({here}), not your project's: "
        f"read the raw data under the folder reconcile is given ({raw_dir}, a SageMaker "
        "job's copy of RAW_DATA)"
    )


def unmeant(dataset: datasets.Dataset, labels: list[str], integers: bool = False) -> list[str]:
    """What the snapshot keeps as reconcile returned it, which a user may not mean: ids that
    name more than one row, labels with spaces around them (a class of their own, and a
    column of predict's output named so), and an integer label -1: a class here, but "no
    label" to datasets (a ClassLabel's -1, which is dropped here as blank: "You can use -1 to
    represent unknown/missing labels", datasets' ClassLabel docstring; the GLUE data sets'
    unlabelled test rows carry it)."""
    said = []
    if integers and "-1" in labels:
        rows = collections.Counter(dataset["label"])["-1"]
        said.append(
            f"label -1 ({rows} rows) is a class of its own; datasets marks a row with no label "
            "-1: if these rows have none, reconcile may drop them"
        )
    if "id" in dataset.column_names:
        ids = collections.Counter(str(i) for i in dataset["id"] if i is not None)
        twice = [i for i, n in ids.items() if n > 1]
        if twice:
            said.append(
                f"{len(twice)} id(s) name more than one row each ({', '.join(twice[:10])}): "
                "inference's predictions.csv and predict's output tell rows apart by id"
            )
    spaced = [label for label in labels if label != label.strip()]
    if spaced:
        said.append(
            f"labels with spaces around them, each a class of its own: {spaced} (reconcile "
            "may strip them)"
        )
    return said


def reconcile_new(raw_dir: str, module: str, out: str) -> None:
    """New data as RAW_DATA holds it, for `smpipe predict --raw`: the user's reconcile over it,
    labels or none, in a process of its own; its rows to `out` (parquet), and what it dropped
    to `out`.json. A label it returns is ignored: the model predicts one."""
    functions = load_user_functions(module)
    with datasets_cache_of_the_job():
        returned = call(functions, "reconcile", Path(raw_dir))
        dataset, dropped = check_result(returned, functions.module, labelled=False)
        dataset = dataset.remove_columns([c for c in ("label",) if c in dataset.column_names])
        dataset.to_parquet(out)
    counts = {reason: len(ids) for reason, ids in dropped.items() if ids}
    listed = {reason: sorted(map(str, ids))[:100] for reason, ids in dropped.items() if ids}
    Path(f"{out}.json").write_text(json.dumps({"dropped": counts, "dropped_ids": listed}))


def reconcile_new_process(argv: list[str]) -> None:
    """`smpipe predict --raw`'s process (pipeline/predict/raw.py): reconcile_new, then the
    process ends as a step's does, never waiting for a thread the user's module left."""
    try:
        reconcile_new(*argv)
    except BaseException:
        traceback.print_exc()
        end_process(1)
    end_process(0)


if __name__ == "__main__":
    run_step("reconcile", main)
