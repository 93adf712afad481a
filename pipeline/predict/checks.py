"""What predicts and what it reads and writes, checked before anything runs: the run and
its model, INPUT's format and columns, the files predict writes (every problem at once)."""

from __future__ import annotations

import configparser
import json
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import ConfigError, Settings
from pipeline.config_file import ini_parser
from pipeline.errors import NOT_UTF8, as_bytes, not_utf8
from pipeline.paths import DataTree, ExperimentTree, RunTree, run_label
from pipeline.predict.files import (
    FOLDER,
    SAID,
    TEXT,
    check_targets,
    format_of,
    input_columns,
    parquet_rows,
    unreadable,
)
from pipeline.predict.raw import RAW, raw_problems
from pipeline.runs import existing_run_nums
from pipeline.store import (
    NotFound,
    Store,
    artifact_key,
    is_complete,
)
from steps.model_files import EXPORTS
from steps.prepared_files import (
    ENCODING,
    GIVEN_KINDS,
    parse_encoding,
    recorded_kinds,
    recorded_reads,
)


class PredictError(ConfigError):
    """What `smpipe predict` was asked for cannot be done: every problem, nothing run."""


@dataclass(frozen=True)
class Chosen:
    """The run and model that predict, and what they were trained on."""

    run: RunTree
    model: str
    why: str  # how the model was chosen
    model_key: str  # its folder in the store
    data_version: int
    data: DataTree  # that data version (its labels/: how its texts were encoded)
    snapshot: str | None  # that data's snapshot hash
    text_columns: list[str]  # what its encode was given of each row, id and label aside
    user_functions: str  # the run's USER_FUNCTIONS
    kinds: dict[str, str] = field(default_factory=dict)  # those not text -> int, float, bool


def read_json(store: Store, key: str) -> dict | None:
    try:
        return json.loads(store.get_bytes(key))
    except (NotFound, ValueError):
        return None


def choose_run(store: Store, tree: ExperimentTree, run_num: int | None) -> tuple[int, dict]:
    """The run asked for, completed; else the newest completed run that trained a model."""
    runs = existing_run_nums(store, tree)
    where = f"of {tree.experiment!r} in {store.uri}"
    if run_num is None:
        for number in reversed(runs):
            record = read_json(store, tree.run(number).metadata) or {}
            if record.get("status") == "completed" and record.get("model_artifacts"):
                return number, record
        raise PredictError([f"no completed run {where} has trained a model (smpipe runs)"])
    if run_num not in runs:
        there = f"runs {run_label(runs[0])}-{run_label(runs[-1])}" if runs else "no runs"
        raise PredictError([f"--run {run_num}: no run {run_label(run_num)} {where} ({there})"])
    record = read_json(store, tree.run(run_num).metadata) or {}
    status = record.get("status") or "unrecorded"
    if status != "completed":
        why = f"run {run_label(run_num)} is {status}, not completed: predict uses its models"
        raise PredictError([f"--run {run_num}: {why}"])
    return run_num, record


def choose_model(record: dict, model: str | None, run: RunTree) -> tuple[str, str]:
    """The model named, trained in the run; else the run's winner by test macro-F1, as its
    inference step recorded it (steps/inference.py `compare`), or its one model."""
    trained = sorted(record.get("model_artifacts") or {})
    if not trained:  # an inference-only run (--steps inference) tests another run's models
        raise PredictError([f"--run {run.run_num}: {trained_none(record, run)}"])
    if model is not None:
        if model not in trained:
            models = ", ".join(trained) or "none"
            why = f"run {run.label} trained no model {model!r} (its models: {models})"
            raise PredictError([f"--model {model}: {why}"])
        return model, "named with --model"
    inference = ((record.get("steps") or {}).get("inference") or {}).get("details") or {}
    winner = (inference.get("comparison") or {}).get("winner")
    if winner in trained:
        return winner, "the winner by test macro-F1"
    if len(trained) == 1:
        return trained[0], "the run's one model"
    why = f"its inference step did not compare {', '.join(trained)}"
    raise PredictError([f"run {run.label} records no winner ({why}): name one with --model"])


def trained_none(record: dict, run: RunTree) -> str:
    """Why a run has no model of its own to predict with, and which run has."""
    tree = ExperimentTree(record.get("experiment_name") or "")
    tested = sorted(record.get("holdout_performance") or {})
    # A key of the store, as a run records it; or a URI (an older record, a copied store)
    folder = ((record.get("sources") or {}).get("models") or "").rstrip("/") + "/"
    owner = tree.owner_of_models(folder[folder.find(tree.runs_root) :]) if tested else None
    if owner is None:
        return f"run {run.label} trained no model"
    them = "it" if len(tested) == 1 else "them"
    return (
        f"run {run.label} trained no model: it tested {', '.join(tested)} of run "
        f"{owner.label} (--run {owner.run_num} predicts with {them})"
    )


def snapshot_columns(store: Store, data: DataTree) -> list[str] | None:
    """The columns reconcile returned for the data a model was trained on (snapshot.json of
    the reconciled version its prepared data was made from)."""
    made_from = read_json(store, data.prepared_from) or {}
    for tree in filter(None, [made_from.get("reconciled") and DataTree(made_from["reconciled"])]):
        info = read_json(store, tree.snapshot_info) or {}
        if info.get("columns"):
            return list(info["columns"])
    return None


def columns_given(
    store: Store, data: DataTree | None, model: str
) -> tuple[list[str], dict[str, str]]:
    """The columns predict gives the model's encode, and the kind of those that are not text:
    those prepare found it reads (steps/prepare.py `columns_read`); for data prepared before
    that was recorded, every column reconcile returned, label and id aside, as text; for data
    whose snapshot is not found, `text`, the column the contract's encode reads."""
    if data is None:
        return [TEXT], {}
    where = data.split("labels") + ENCODING
    try:
        record = parse_encoding(store.get_bytes(where))
    except (NotFound, ValueError):
        record = {}
    reads = recorded_reads(record, model)
    if reads is not None:
        return reads, recorded_kinds(record, model)
    columns = snapshot_columns(store, data) or [TEXT]
    return [c for c in columns if c not in ("label", "id")], {}


def run_user_functions(store: Store, run: RunTree, default: str) -> str:
    """USER_FUNCTIONS as the run applied it (its settings.ini): the module its code holds."""
    parser = ini_parser()
    try:
        parser.read_string(store.get_bytes(run.settings).decode())
    except (NotFound, configparser.Error, UnicodeDecodeError):
        return default
    return parser.get("experiment", "user_functions", fallback=default)


def choose(
    settings: Settings, store: Store, run_num: int | None, model: str | None
) -> tuple[Chosen | None, list[str]]:
    """What predicts, checked in the store; or every reason it cannot."""
    tree = ExperimentTree(settings.experiment.name)
    try:
        number, record = choose_run(store, tree, run_num)
        run = tree.run(number)
        name, why = choose_model(record, model, run)
    except PredictError as e:
        return None, e.problems
    problems = []
    model_key = artifact_key(store, record["model_artifacts"][name]) or ""
    export = EXPORTS[settings.inference.model_format]
    if not is_complete(store, model_key):
        pruned = (record.get("pruned") or {}).get("time")
        why = f" (the run was pruned at {pruned}: smpipe prune)" if pruned else ""
        problems.append(
            f"model {name!r} of run {run.label} is no longer complete at {model_key}{why}"
        )
    elif not store.exists(model_key + export):
        problems.append(
            f"model {name!r} of run {run.label} has no {export} ([inference] MODEL_FORMAT = "
            f"{settings.inference.model_format}; the other format may have one)"
        )
    lineage = (record.get("model_lineage") or {}).get(name) or {}
    version = lineage.get("data_version", record.get("data_version"))
    data = tree.data(version) if isinstance(version, int) else None
    if data is None or not is_complete(store, data.split("labels")):
        problems.append(
            f"model {name!r} of run {run.label} was trained on data {version}, whose labels/ "
            "(how its texts were encoded) is no longer complete"
        )
    text_columns, kinds = columns_given(store, data, name)
    if not text_columns:
        problems.append(f"model {name!r} of run {run.label} was trained on encoding no column")
    problems += [
        f"model {name!r} of run {run.label}: its encode reads column {c!r}, which holds {kind}; "
        "predict gives encode text, numbers and true or false"
        for c, kind in kinds.items()
        if kind not in GIVEN_KINDS
    ]
    functions = run_user_functions(store, run, settings.experiment.user_functions)
    snapshot = lineage.get("data_snapshot_hash", record.get("data_snapshot_hash"))
    chosen = Chosen(
        run, name, why, model_key, version, data, snapshot, text_columns, functions, kinds
    )
    return chosen, problems


def check_files(
    source: Path, output: Path, columns: list[str] | None, raw: bool = False, kinds=None
) -> tuple[str | None, str | None, list[str], bytes | None]:
    """INPUT's and OUTPUT's formats, every problem with either (INPUT's columns checked
    against `columns`, those the run's encode read, of `kinds` where not text, when they are
    known; raw data's
    once reconcile has made its rows) and with the files predict writes
    (files.check_targets), and the record of an earlier predict into OUTPUT that this
    one replaces."""
    problems = [
        f"{name} {as_bytes(str(path.absolute()))} {NOT_UTF8}"
        for name, path in (("INPUT", source), ("OUTPUT", output))
        if not_utf8(str(path.absolute()))
    ]
    kind = RAW if raw else format_of(source) if source.exists() else None
    if raw:
        problems += raw_problems(source)
    elif not source.exists():
        problems.append(f"INPUT {source} does not exist")
    elif kind is None:
        problems.append(f"INPUT {source}: predict reads {SAID} or a folder of .txt files")
    elif kind in ("csv", "tsv", "jsonl") and (why := unreadable(source, kind)):
        problems.append(why)
    elif columns is not None:
        problems += check_columns(source, kind, columns, kinds)
    out_kind = format_of(output) if not output.is_dir() else None
    previous = None
    if output.is_dir():
        problems.append(f"OUTPUT {output} is a folder: predict writes one file, {SAID}")
    elif out_kind is None or out_kind == FOLDER:
        problems.append(f"OUTPUT {output}: predict writes {SAID}, told by the suffix")
    else:
        targets, previous = check_targets(source, output)
        problems += targets
    return kind, out_kind, problems, previous


def check_columns(source: Path, kind: str, columns: list[str], kinds=None) -> list[str]:
    """INPUT has every column the run's encode read, each able to hold what it held: text, or
    the kind `kinds` gives (a number: a Parquet column of numbers or of text, read row by row)."""
    kinds = kinds or {}
    said = [f"{c} ({kinds[c]})" if c in kinds else c for c in columns]
    rule = (
        f"predict gives the run's encode the columns it read of the run's data "
        f"({', '.join(said)}); an `id` column, if there, names the rows"
    )
    try:
        found, not_text = input_columns(source, kind)
    except (ValueError, OSError) as e:
        return [f"INPUT {source} cannot be read as {kind}: {e}"]
    if kind == "parquet" and parquet_rows(source) == 0:
        return [f"INPUT {source} is empty: it holds no rows"]
    if kind == FOLDER and not found:
        return [
            f"INPUT {source} is a folder without .txt files (each file is one text); with --raw, "
            "a folder of new data as RAW_DATA holds it, which the run's reconcile reads"
        ]
    if kind == FOLDER and columns != [TEXT]:
        return [f"INPUT {source} is a folder, whose files give one column, {TEXT}: {rule}"]
    missing = [c for c in columns if c not in found]
    raw = (
        "; new data in RAW_DATA's shape goes in a folder, with --raw: the run's reconcile reads it"
    )
    problems = [
        f"INPUT {source} has no column {c!r} (it has {found}): {rule}{raw}" for c in missing
    ]
    problems += [
        f"INPUT {source}: column {c!r} holds {not_text[c]}, not text"
        for c in columns
        if c in not_text and c not in kinds
    ]
    problems += [
        f"INPUT {source}: column {c!r} holds {not_text[c]}, where the run's data held {kinds[c]}"
        for c in columns
        if c in not_text and c in kinds and not holds(not_text[c], kinds[c])
    ]
    return problems


def holds(parquet_type: str, kind: str) -> bool:
    """Whether a Parquet column of `parquet_type` (not text) can give values of `kind`."""
    if kind == "bool":
        return parquet_type == "bool"
    return parquet_type.startswith(("int", "uint", "float", "double", "halffloat"))
