"""`smpipe predict settings.ini INPUT OUTPUT`: a run's exported model on new texts.

check   the run (the newest completed one that trained a model, or --run), its model (the
        winner by test macro-F1, or --model), INPUT's format, encoding and columns, every file
        predict writes (OUTPUT, OUTPUT.json: not INPUT, not a file of the user's, their folder
        writable), the request as SageMaker checks it: every problem at once, before anything
        runs
upload  INPUT read a part at a time into parquet parts under the run's
        predictions/<label>/input/ (pipeline/predict_files.py), with the job's code: this
        project's steps/ and the run's own user functions
job     one processing job on the configured backend (steps/predict.py), its input sharded
        across --instance-count instances by S3 key; each writes a part per part it gets
output  OUTPUT written from the parts in the input's order, and beside it OUTPUT.json:
        the run, model, data, the input's and the output's sha256, counts and the malformed
        rows; the same record in the run tree (predictions/<label>/record.json). Both are
        written beside themselves and renamed into place, the record first
        (predict_files.place). A predict that fails or is interrupted changes neither, and
        leaves in the run tree only its job's log and a record saying so (`left_behind`)
"""

from __future__ import annotations

import configparser
import dataclasses
import json
import secrets
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pipeline import cost
from pipeline import metadata as md
from pipeline.backends.choose import make_backend as default_backend
from pipeline.code_bundle import PROJECT_ROOT
from pipeline.config import ConfigError, Settings
from pipeline.errors import PipelineError, log
from pipeline.jobs import ProcessingJob
from pipeline.paths import DataTree, ExperimentTree, PredictionTree, RunTree, run_label
from pipeline.plan import check_requests, prices_for
from pipeline.predict_files import (
    FOLDER,
    PART,
    SAID,
    TEXT,
    OutputWriter,
    check_targets,
    format_of,
    input_columns,
    input_sha256,
    interrupts_held,
    parquet_rows,
    place,
    read_rows,
    record_path,
    unreadable,
    write_parts,
)
from pipeline.predict_raw import RAW, raw_problems, reconciled
from pipeline.raw_data import folder_digest
from pipeline.runs import existing_run_nums
from pipeline.stages import job_label, launched, processing_job
from pipeline.store import (
    MANIFEST,
    NotFound,
    Store,
    StoreError,
    artifact_key,
    download_dir,
    file_sha256,
    is_complete,
    upload_dir,
)
from steps.model_files import EXPORTS
from steps.runtime.names import USER_FUNCTIONS_VARIABLE

LISTED = 100  # malformed rows named in the record (the output's `error` column has them all)


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


def snapshot_columns(store: Store, data: DataTree) -> list[str] | None:
    """The columns reconcile returned for the data a model was trained on (snapshot.json of
    the reconciled version its prepared data was made from)."""
    made_from = read_json(store, data.prepared_from) or {}
    for tree in filter(None, [made_from.get("reconciled") and DataTree(made_from["reconciled"])]):
        info = read_json(store, tree.snapshot_info) or {}
        if info.get("columns"):
            return list(info["columns"])
    return None


def run_user_functions(store: Store, run: RunTree, default: str) -> str:
    """USER_FUNCTIONS as the run applied it (its settings.ini): the module its code holds."""
    parser = configparser.ConfigParser(interpolation=None)
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
        problems.append(f"model {name!r} of run {run.label} is no longer complete at {model_key}")
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
    # Data whose snapshot is not found: `text`, the column the contract's encode reads.
    columns = (snapshot_columns(store, data) if data else None) or [TEXT]
    text_columns = [c for c in columns if c not in ("label", "id")]
    if not text_columns:
        problems.append(f"the data of run {run.label} has no column but label and id: {columns}")
    functions = run_user_functions(store, run, settings.experiment.user_functions)
    snapshot = lineage.get("data_snapshot_hash", record.get("data_snapshot_hash"))
    chosen = Chosen(run, name, why, model_key, version, data, snapshot, text_columns, functions)
    return chosen, problems


def check_files(
    source: Path, output: Path, columns: list[str] | None, raw: bool = False
) -> tuple[str | None, str | None, list[str], bytes | None]:
    """INPUT's and OUTPUT's formats, every problem with either (INPUT's columns checked
    against `columns`, the text columns of the run's data, when they are known; raw data's
    once reconcile has made its rows) and with the files predict writes
    (predict_files.check_targets), and the record of an earlier predict into OUTPUT that this
    one replaces."""
    problems = []
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
        problems += check_columns(source, kind, columns)
    out_kind = format_of(output) if not output.is_dir() else None
    previous = None
    if output.is_dir() or out_kind is None or out_kind == FOLDER:
        problems.append(f"OUTPUT {output}: predict writes {SAID}, told by the suffix")
    else:
        targets, previous = check_targets(source, output)
        problems += targets
    return kind, out_kind, problems, previous


def check_columns(source: Path, kind: str, columns: list[str]) -> list[str]:
    """INPUT has every text column the run's encode was given, each able to hold text."""
    rule = (
        f"predict gives the run's encode the columns reconcile returned for its data, label "
        f"and id aside ({', '.join(columns)}); an `id` column, if there, names the rows"
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
        if c in not_text
    ]
    return problems


# -- the job ----------------------------------------------------------------------------------


def predict_job(
    settings: Settings, chosen: Chosen, prediction: PredictionTree, instance_count: int
) -> ProcessingJob:
    """The processing job: [inference]'s instance type, batch size and MODEL_FORMAT; the
    run's own user functions; the texts split across the instances by S3 key."""
    inputs = {
        "texts": prediction.input,
        "model": chosen.model_key,
        "labels": chosen.data.split("labels"),
    }
    given = {"model_name": chosen.model, "text_columns": chosen.text_columns}
    job = processing_job(
        settings,
        chosen.run,
        "predict",
        inputs,
        {"predictions": prediction.output},
        given,
        settings.inference.instance_type,
        chosen.model,
    )
    env = {**job.env, USER_FUNCTIONS_VARIABLE: chosen.user_functions}
    return dataclasses.replace(
        job,
        code=prediction.code,
        env=env,
        instance_count=instance_count,
        sharded_inputs=("texts",),
    )


def assemble_code(store: Store, chosen: Chosen, folder: Path) -> None:
    """Predict's code in `folder`: this project's steps/ (the predict step is newer than most
    runs) with the user functions the run shipped, which reconciled and encoded its data."""
    download_dir(store, chosen.run.code, folder)
    Path(folder, MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(Path(folder, "steps"), ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(PROJECT_ROOT / "steps", Path(folder, "steps"), ignore=ignore)


def ship_code(store: Store, chosen: Chosen, prediction: PredictionTree) -> None:
    """The job's code (assemble_code), in the store where the job reads it."""
    with tempfile.TemporaryDirectory(prefix="smpipe-predict-code-") as tmp:
        assemble_code(store, chosen, Path(tmp))
        upload_dir(store, tmp, prediction.code)


def upload_texts(
    store: Store, source: Path, kind: str, columns: list[str], prediction: PredictionTree
) -> list[int]:
    """INPUT as parquet parts in the store; the rows of each part."""

    told = [0]  # parts end at PART_ROWS rows or PART_CHARS characters: a line per 100,000 rows

    def said(rows: int) -> None:
        if rows // 100_000 > told[0]:
            told[0] = rows // 100_000
            log.info(f"read {rows:,} rows of {source}")

    with tempfile.TemporaryDirectory(prefix="smpipe-predict-input-") as tmp:
        sizes = write_parts(read_rows(source, kind, columns), Path(tmp), columns, said)
        if sizes:
            upload_dir(store, tmp, prediction.input)
    return sizes


def run_job(settings: Settings, store: Store, job: ProcessingJob, run: RunTree, echo, backend):
    """The job on the configured backend, stopped if the driver is (Ctrl-C, SIGTERM)."""
    plan = {"event": ("plan", [job_label(job)])}  # the live display's list of jobs
    log.info(f"predict on the {settings.experiment.backend} backend:", extra=plan)
    backend = backend(settings, store, run, echo)
    try:
        result = launched(job, backend.run_processing)
    except BaseException:
        backend.stop()
        backend.close(succeeded=False)
        raise
    backend.close(succeeded=result.status == "Completed")
    return result


# -- OUTPUT -----------------------------------------------------------------------------------


def write_output(
    store: Store, prediction: PredictionTree, sizes: list[int], output: Path, kind: str
) -> tuple[dict, Path]:
    """OUTPUT from the job's parts, in the input's order, written whole to a hidden file beside
    it (`place` renames it into place); the counts and the first LISTED malformed rows, and
    that file. A write that fails (a full disk) is one PipelineError naming OUTPUT."""
    keys = set(store.list_keys(prediction.output))
    counts = {"rows": 0, "predicted": 0, "malformed": 0}
    listed: list[dict] = []
    columns: list[str] = []
    with writing(output):
        writer = OutputWriter(output, kind)
    try:
        with tempfile.TemporaryDirectory(prefix="smpipe-predict-output-") as tmp:
            for number, size in enumerate(sizes):
                table = read_part(store, prediction.output + PART.format(number), keys, tmp)
                if table.num_rows != size:
                    raise PipelineError(
                        f"part {number} of the predictions has {table.num_rows} rows where its "
                        f"input had {size}: {store.uri_of(prediction.output)}"
                    )
                with writing(output):
                    writer.write(table)
                columns = [c for c in table.column_names if c != "row"]
                errors = table.column("error").to_pylist()
                ids = table.column("id").to_pylist()
                bad = [(i, e) for i, e in zip(ids, errors, strict=True) if e]
                listed += [{"id": i, "error": e} for i, e in bad[: LISTED - len(listed)]]
                counts["rows"] += size
                counts["malformed"] += len(bad)
                counts["predicted"] += size - len(bad)
        with writing(output):
            written = writer.finish()
            digest = file_sha256(written)
    except BaseException:
        writer.discard()
        raise
    return {
        "columns": columns,
        **counts,
        "malformed_rows": listed,
        "output_sha256": digest,
    }, written


@contextmanager
def writing(path: Path):
    """An OSError while writing `path` (beside it: a full disk, a folder made read-only
    since the check) as one line naming it; the traceback says nothing the user can act on."""
    import pyarrow as pa

    try:
        yield
    except (OSError, pa.ArrowException) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise PipelineError(f"cannot write {path} ({why}): it was not written") from None


def read_part(store: Store, key: str, keys: set[str], tmp: str):
    import pyarrow.parquet as pq

    if key not in keys:  # every instance writes a part for each part it was given
        raise PipelineError(f"the job wrote no predictions for {store.uri_of(key)}")
    path = Path(tmp, "part.parquet")
    store.download_file(key, path)
    table = pq.read_table(path)
    path.unlink()
    return table


def remove_input(store: Store, prediction: PredictionTree) -> None:
    """The parts of INPUT are a copy of the user's texts, only the job's to read: once it
    has ended they go (the record keeps INPUT's sha256)."""
    for key in store.list_keys(prediction.input):
        store.delete(key)


# -- the command ------------------------------------------------------------------------------


def predict(
    settings: Settings,
    store: Store,
    source: Path,
    output: Path,
    run_num: int | None = None,
    model: str | None = None,
    instance_count: int = 1,
    echo=None,
    make_backend=default_backend,
    raw: bool = False,
) -> dict:
    """Predict INPUT's rows with a run's model into OUTPUT; the record of what was done
    (also OUTPUT.json and the run's predictions/<label>/record.json). A predict that fails or
    is interrupted leaves OUTPUT and OUTPUT.json as they were, and in the run's tree only the
    job's log with a record saying so (`left_behind`)."""
    started = time.time()
    chosen, kind, out_kind, previous = checked(settings, store, source, output, run_num, model, raw)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started))
    prediction = chosen.run.prediction(f"{chosen.model}-{stamp}-{secrets.token_hex(3)}")
    job = predict_job(settings, chosen, prediction, instance_count)
    check_requests([job], settings, store)
    backend = settings.experiment.backend
    basis = None if backend == "local" else prices_for([job], settings, store)
    log.info(
        f"predicting {source} with model {chosen.model!r} of run {chosen.run.label} "
        f"({chosen.why}), into {output}"
    )
    record = {
        "status": "completed",
        "run": chosen.run.label,
        "experiment": settings.experiment.name,
        "model": chosen.model,
        "model_chosen": chosen.why,
        "model_artifact": chosen.model_key,
        "model_format": settings.inference.model_format,
        # The setting; what it resolved to on the job's CPU is in the job's log.
        "mixed_precision": settings.inference.mixed_precision,
        "data_version": chosen.data_version,
        "data_snapshot_hash": chosen.snapshot,
        "input": str(source.resolve()),
        "input_format": kind,
        "input_sha256": folder_digest(source) if raw else input_sha256(source),
        "output": str(output.resolve()),
        "output_format": out_kind,
    }
    written = None
    try:
        sizes, result = upload_and_run(
            settings, store, chosen, job, prediction, source, kind, echo, make_backend, record
        )
        completed_or_said(store, result, output)
        facts, written = write_output(store, prediction, sizes, output, out_kind)
        previous = checked_again(source, output)
        record |= {
            **facts,
            **job_facts(result, backend, instance_count, basis),
            "seconds": round(time.time() - started, 1),
            "predictions": store.uri_of(prediction.prefix),
            "created": md.iso(started),
        }
        text = json.dumps(record, indent=2, ensure_ascii=False)
        store.put_bytes(prediction.record, text.encode())
        came = placed(output, written, text + "\n", previous)
    except BaseException as e:
        if written is not None:
            written.unlink(missing_ok=True)
        left_behind(store, chosen.run, prediction, job, record, e, started)
        raise
    if came:
        log.warning(f"interrupted while {output} was put in place: it and its record are whole")
    say_done(record)
    return record


def checked_again(source: Path, output: Path) -> bytes | None:
    """The files predict writes, checked again once the job has ended, just before they are put
    in place: a file the user made there meanwhile is theirs. The record OUTPUT.json holds
    now (a predict that ended meanwhile may have written it)."""
    problems, previous = check_targets(source, output)
    if problems:
        said = "; ".join(problems)
        raise PipelineError(f"{output} was not written, since the job began: {said}")
    return previous


def placed(output: Path, written: Path, text: str, previous: bytes | None) -> list[int]:
    """OUTPUT and OUTPUT.json put in place (predict_files.place), a failure one line naming
    the file; the signals that came meanwhile."""
    try:
        return place(output, written, text, previous)
    except OSError as e:
        what = e.filename2 or e.filename or record_path(output)
        raise PipelineError(
            f"cannot put {what} in place ({e.strerror or e}): {output} and {record_path(output)} "
            "are as they were before"
        ) from None


def left_behind(
    store: Store,
    run: RunTree,
    prediction: PredictionTree,
    job: ProcessingJob,
    record: dict,
    error: BaseException,
    started: float,
) -> None:
    """What a predict that failed or was interrupted leaves in the run's tree: its job's log
    (where the run keeps every job's) and, beside the log, a record saying what happened and
    where the log is; nothing else (the code, the texts and any parts of predictions go).
    A predict that ended before its job started leaves nothing. No model is named by key in
    this record: it made nothing that needs one. Held from Ctrl-C: a second one would leave
    half of it; a store that fails here is said, and the first error stands."""
    status = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
    if status == "interrupted":
        reason = "Ctrl-C or SIGTERM: the job was stopped"
    elif isinstance(error, PipelineError | ConfigError):
        reason = str(error)
    else:
        reason = f"{type(error).__name__}: {error}"
    with interrupts_held():
        try:
            for key in store.list_keys(prediction.prefix):
                store.delete(key)
            if not store.exists(run.log(job.name)):
                return
            kept = {k: v for k, v in record.items() if k != "model_artifact"}
            failed = {
                **kept,
                "status": status,
                "reason": reason,
                "job_name": job.name,
                "job_log": store.uri_of(run.log(job.name)),
                "seconds": round(time.time() - started, 1),
                "created": md.iso(started),
            }
            text = json.dumps(failed, indent=2, ensure_ascii=False)
            store.put_bytes(prediction.record, text.encode())
        except (StoreError, OSError) as e:
            where = store.uri_of(prediction.prefix)
            log.warning(f"predict {status}, and {where} could not be tidied: {e}")


def job_facts(result, backend: str, instance_count: int, basis: dict | None) -> dict:
    """The job's part of the record, and what it cost as a run's jobs are priced
    (pipeline/cost.py): billed instance-seconds x the price on sagemaker and emulated,
    CPU-seconds locally."""
    return {
        "backend": backend,
        "job_name": result.name,
        "instance_count": instance_count,
        "job_seconds": result.seconds,
        "job_peak_memory_mb": result.peak_memory_mb,
        "cost": cost.run_cost(result.billing, basis, backend),
        "prices": basis,
    }


def completed_or_said(store: Store, result, output: Path) -> None:
    """A job that did not complete fails the command, naming its log; OUTPUT is not written."""
    if result.status != "Completed":
        where = store.uri_of(result.log_key) if result.log_key else "the backend"
        raise PipelineError(
            f"predict failed in job {result.name}: {result.failure_reason}. The job's log is at "
            f"{where}; {output} was not written."
        )


def upload_and_run(
    settings: Settings,
    store: Store,
    chosen: Chosen,
    job: ProcessingJob,
    prediction: PredictionTree,
    source: Path,
    kind: str,
    echo,
    make_backend,
    record: dict,
):
    """INPUT's parts and the job's code uploaded, the job run; the parts removed however it
    ended (even before the job started). The rows of each part, and the job's result; raw
    data's reconcile said in `record`."""
    try:
        with tempfile.TemporaryDirectory(prefix="smpipe-predict-raw-") as tmp:
            rows, read_as = source, kind
            if kind == RAW:
                rows, record["reconcile"] = raw_rows(store, chosen, source, Path(tmp))
                read_as = "parquet"
            sizes = upload_texts(store, rows, read_as, chosen.text_columns, prediction)
        if not sizes:
            raise PredictError([f"INPUT {source} holds no rows"], "smpipe predict")
        log.info(f"{sum(sizes):,} rows in {len(sizes)} part(s)")
        ship_code(store, chosen, prediction)
        return sizes, run_job(settings, store, job, chosen.run, echo, make_backend)
    finally:
        remove_input(store, prediction)


def raw_rows(store: Store, chosen: Chosen, source: Path, tmp: Path) -> tuple[Path, dict]:
    """Raw data's rows as the run's reconcile returns them (pipeline/predict_raw.py), checked
    as INPUT's columns are; and what reconcile dropped."""
    assemble_code(store, chosen, tmp / "code")
    log.info(f"reconciling {source} with the run's {chosen.user_functions}.reconcile")
    rows, said = reconciled(tmp / "code", chosen.user_functions, source, tmp)
    whose = f"the rows {chosen.user_functions}.reconcile returned for {source}"
    problems = [
        p.replace(f"INPUT {rows}", whose)
        for p in check_columns(rows, "parquet", chosen.text_columns)
    ]
    if problems:
        raise PredictError(problems, "smpipe predict --raw")
    for reason, count in said["dropped"].items():
        shown = ", ".join(said["dropped_ids"][reason][:10])
        log.warning(f"reconcile dropped {count:,} rows of {source} ({reason}): {shown}")
    return rows, said


def checked(
    settings: Settings,
    store: Store,
    source: Path,
    output: Path,
    run_num: int | None,
    model: str | None,
    raw: bool,
) -> tuple[Chosen, str, str, bytes | None]:
    """What predicts, INPUT's format and OUTPUT's, and the earlier record OUTPUT.json holds
    (see check_files); PredictError with every problem."""
    chosen, problems = choose(settings, store, run_num, model)
    columns = chosen.text_columns if chosen else None
    kind, out_kind, file_problems, previous = check_files(source, output, columns, raw)
    if problems or file_problems:
        raise PredictError(problems + file_problems, "smpipe predict")
    return chosen, kind, out_kind, previous


def say_done(record: dict) -> None:
    bad = record["malformed_rows"]
    log.info(
        f"{record['predicted']:,} of {record['rows']:,} rows predicted by {record['model']} of "
        f"run {record['run']} in {record['seconds']:.0f}s: {record['output']} (what they came "
        f"from: {record['output']}.json)"
    )
    log.info(cost.said(record["cost"]))
    if record["malformed"]:
        shown = "; ".join(f"{r['id']}: {r['error']}" for r in bad[:5])
        more = f"; {record['malformed'] - 5:,} more" if record["malformed"] > 5 else ""
        log.warning(
            f"{record['malformed']:,} malformed rows have no prediction (the `error` column "
            f"says why): {shown}{more}"
        )
