"""`smpipe predict settings.ini INPUT OUTPUT`: a run's exported model on new texts.

`predict` checks everything first (`checked`: every problem at once, before anything runs),
uploads INPUT as parquet parts with the job's code (`upload_and_run`), runs one processing job
(steps/predict.py) sharded across --instance-count instances, and writes OUTPUT and OUTPUT.json
whole, the record first; a predict that fails leaves only a log and a record (`left_behind`).
docs/predict.md says what a user sees.
"""

from __future__ import annotations

import json
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline import cost, interrupts
from pipeline import metadata as md
from pipeline.backend import running_backend
from pipeline.backends.choose import make_backend as default_backend
from pipeline.code_bundle import assemble, ship_run_code, shipped_modules
from pipeline.config import ConfigError, Settings
from pipeline.errors import PipelineError, log
from pipeline.jobs import ProcessingJob
from pipeline.paths import PredictionTree, RunTree
from pipeline.plan import check_requests, prices_for
from pipeline.predict.checks import Chosen, PredictError, check_columns, check_files, choose
from pipeline.predict.files import (
    check_targets,
    input_sha256,
    place,
    record_path,
)
from pipeline.predict.job import predict_job, remove_input, upload_texts, write_output
from pipeline.predict.raw import RAW, reconciled
from pipeline.raw_data import folder_digest
from pipeline.stages import job_label, launched
from pipeline.store import Store, StoreError


@dataclass(frozen=True)
class Predicting:
    """One predict under way: what its steps share once it is checked."""

    settings: Settings
    store: Store
    chosen: Chosen
    job: ProcessingJob
    prediction: PredictionTree
    source: Path
    kind: str  # INPUT's format (pipeline/predict/files.py), or raw data's
    output: Path


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
    p = Predicting(settings, store, chosen, job, prediction, source, kind, output)
    record = first_record(p, out_kind)
    written = None
    try:
        sizes, result = upload_and_run(p, echo, make_backend, record)
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
        interrupts.outcome_recorded()  # what it prints from now on is not worth a stop
    except BaseException as e:
        if written is not None:
            written.unlink(missing_ok=True)
        left_behind(store, chosen.run, prediction, job, record, e, started)
        raise
    if came:
        log.warning(f"interrupted while {output} was put in place: it and its record are whole")
    say_done(record)
    return record


def first_record(p: Predicting, out_kind: str) -> dict:
    """What the record says before the job runs: what predicts, and what it reads and writes."""
    chosen, source = p.chosen, p.source
    return {
        "status": "completed",
        "run": chosen.run.label,
        "experiment": p.settings.experiment.name,
        "model": chosen.model,
        "model_chosen": chosen.why,
        "model_artifact": chosen.model_key,
        "model_format": p.settings.inference.model_format,
        # The setting; what it resolved to on the job's CPU is in the job's log.
        "mixed_precision": p.settings.inference.mixed_precision,
        "data_version": chosen.data_version,
        "data_snapshot_hash": chosen.snapshot,
        "input": str(source.resolve()),
        "input_format": p.kind,
        "input_sha256": folder_digest(source) if p.kind == RAW else input_sha256(source),
        "output": str(p.output.resolve()),
        "output_format": out_kind,
    }


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
    (see check_files); PredictError with every problem. Checked: the run (the newest completed
    one that trained a model, or --run), its model (the winner by test macro-F1, or --model),
    INPUT's format, encoding and columns, and every file predict writes (OUTPUT, OUTPUT.json:
    not INPUT, not a file of the user's, their folder writable)."""
    chosen, problems = choose(settings, store, run_num, model)
    columns, kinds = (chosen.text_columns, chosen.kinds) if chosen else (None, None)
    kind, out_kind, file_problems, previous = check_files(source, output, columns, raw, kinds)
    if problems or file_problems:
        raise PredictError(problems + file_problems, "smpipe predict")
    return chosen, kind, out_kind, previous


def upload_and_run(p: Predicting, echo, make_backend, record: dict):
    """INPUT's parts (read a part at a time into predictions/<label>/input/: files.py) and the
    job's code (this project's steps/ and the run's own user functions) uploaded, the job run;
    the parts removed however it
    ended (even before the job started). The rows of each part, and the job's result; raw
    data's reconcile said in `record`."""
    try:
        with tempfile.TemporaryDirectory(prefix="smpipe-predict-raw-") as tmp:
            rows, read_as = p.source, p.kind
            if p.kind == RAW:
                rows, record["reconcile"] = raw_rows(p.store, p.chosen, p.source, Path(tmp))
                read_as = "parquet"
            chosen = p.chosen
            sizes = upload_texts(
                p.store, rows, read_as, chosen.text_columns, p.prediction, chosen.kinds
            )
        if not sizes:
            raise PredictError([f"INPUT {p.source} holds no rows"], "smpipe predict")
        log.info(f"{sum(sizes):,} rows in {len(sizes)} part(s)")
        ship_run_code(p.store, p.chosen.run.code, p.prediction.code)
        return sizes, run_job(p, echo, make_backend)
    finally:
        remove_input(p.store, p.prediction)


def raw_rows(store: Store, chosen: Chosen, source: Path, tmp: Path) -> tuple[Path, dict]:
    """Raw data's rows as the run's reconcile returns them (pipeline/predict/raw.py), checked
    as INPUT's columns are; and what reconcile dropped."""
    assemble(tmp / "code", shipped_modules(store, chosen.run.code, tmp / "run"))
    log.info(f"reconciling {source} with the run's {chosen.user_functions}.reconcile")
    rows, said = reconciled(tmp / "code", chosen.user_functions, source, tmp)
    whose = f"the rows {chosen.user_functions}.reconcile returned for {source}"
    problems = [
        p.replace(f"INPUT {rows}", whose)
        for p in check_columns(rows, "parquet", chosen.text_columns, chosen.kinds)
    ]
    if problems:
        raise PredictError(problems, "smpipe predict --raw")
    for reason, count in said["dropped"].items():
        shown = ", ".join(said["dropped_ids"][reason][:10])
        log.warning(f"reconcile dropped {count:,} rows of {source} ({reason}): {shown}")
    return rows, said


def run_job(p: Predicting, echo, make_backend):
    """The job on the configured backend, stopped if the driver is (Ctrl-C, SIGTERM); one that
    did not complete fails the command, naming its log."""
    plan = {"event": ("plan", [job_label(p.job)])}  # the live display's list of jobs
    log.info(f"predict on the {p.settings.experiment.backend} backend:", extra=plan)
    with running_backend(make_backend(p.settings, p.store, p.chosen.run, echo)) as backend:
        result = launched(p.job, backend.run_processing)
        if result.status != "Completed":  # the backend closes as a run's does when a job fails
            where = p.store.uri_of(result.log_key) if result.log_key else "the backend"
            raise PipelineError(
                f"predict failed in job {result.name}: {result.failure_reason}. The job's log "
                f"is at {where}; {p.output} was not written."
            )
    return result


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
    """OUTPUT and OUTPUT.json put in place (files.place), a failure one line naming
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
        reason = f"{interrupts.why_stopped(error)}: the job was stopped"
    elif isinstance(error, PipelineError | ConfigError):
        reason = str(error)
    else:
        reason = f"{type(error).__name__}: {error}"
    with interrupts.held():
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


def say_done(record: dict) -> None:
    bad = record["malformed_rows"]
    log.info(
        f"{record['predicted']:,} of {record['rows']:,} rows predicted by {record['model']} of "
        f"run {record['run']} in {record['seconds']:.0f}s: {record['output']} (what they came "
        f"from: {record['output']}.json)"
    )
    log.info(cost.as_text(record["cost"]))
    if not record["predicted"]:
        log.error(f"no row of {record['input']} could be predicted; each one's reason is below")
    if record["malformed"]:
        shown = "; ".join(f"{r['id']}: {r['error']}" for r in bad[:5])
        more = f"; {record['malformed'] - 5:,} more" if record["malformed"] > 5 else ""
        log.warning(
            f"{record['malformed']:,} malformed rows have no prediction (the `error` column "
            f"says why): {shown}{more}"
        )
