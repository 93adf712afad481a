"""The pipeline's stages, each declared once: its jobs, the arguments its cache key holds, the
lines the plan prints for it, and what Metadata keeps of it once its jobs end.

    reconcile -> prepare (processing jobs) -> train | tune (training) -> inference (processing)

The driver loops over `STAGES`: it builds every planned stage's jobs once (`build_jobs`),
prints them (`plan_lines`), and hands each stage its jobs and the backend (`Stage.run`).
What a step computes lives in steps/<step>.py, inside the job; a stage is what the driver
knows of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pipeline import cache, registry, tuning_record
from pipeline import metadata as md
from pipeline.backend import identity
from pipeline.config import Settings
from pipeline.errors import log
from pipeline.jobs import (
    TUNING_JOB_NAME_LIMIT,
    JobFailed,
    JobResult,
    ProcessingJob,
    TrainingJob,
    TuningJob,
    job_name,
)
from pipeline.paths import SPLITS, ExperimentTree, RunTree, run_label, step_report
from pipeline.sources import Sources, lineage, snapshot_hash
from pipeline.store import NotFound, Store, is_complete, source_uri
from steps.arguments import TABLES, command_line
from steps.model_files import RECORD
from steps.runtime.names import (
    EXTRA_SECRETS_VARIABLE,
    HF_TOKEN_SECRET_VARIABLE,
    TRAINING_CHANNELS,
    USER_FUNCTIONS_VARIABLE,
    WANDB_SECRET_VARIABLE,
)

if TYPE_CHECKING:
    from pipeline.backend import Backend

Job = ProcessingJob | TrainingJob | TuningJob


@dataclass
class RunContext:
    """What a stage's jobs run against: the run, where its steps read, its Metadata so far."""

    settings: Settings
    store: Store
    run: RunTree
    sources: Sources
    base: md.Metadata
    backend: Backend | None  # set once the run is claimed

    @property
    def tree(self) -> ExperimentTree:
        return ExperimentTree(self.run.experiment)


class Stage(Protocol):
    name: str  # as --steps and the run's Metadata name it

    def jobs(self, settings: Settings, run: RunTree, sources: Sources) -> list[Job]:
        """The stage's jobs in `run`, reading from `sources` (this run's outputs included)."""

    def run(self, ctx: RunContext, jobs: list[Job]) -> None:
        """Launch the jobs on ctx.backend and record them; raise JobFailed when one fails."""


# [hub] OFFLINE: the Hugging Face libraries' own switches (huggingface_hub's HF_HUB_OFFLINE,
# transformers' TRANSFORMERS_OFFLINE, datasets' HF_DATASETS_OFFLINE), set per run in the
# request's Environment, never baked into the image.
HUB_OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def job_env(settings: Settings) -> dict[str, str]:
    """The Environment of every job's request: the user functions, the secrets' names, the Hub."""
    env = {USER_FUNCTIONS_VARIABLE: settings.experiment.user_functions}
    if settings.tracking.secret_variables:
        env[EXTRA_SECRETS_VARIABLE] = ",".join(settings.tracking.secret_variables)
    if settings.experiment.backend != "local":  # a local job has this machine's keys
        if settings.tracking.wandb_secret_id:
            env[WANDB_SECRET_VARIABLE] = settings.tracking.wandb_secret_id
        if settings.hub.token_secret_id:
            env[HF_TOKEN_SECRET_VARIABLE] = settings.hub.token_secret_id
    if settings.hub.offline:
        env.update(dict.fromkeys(HUB_OFFLINE, "1"))
    return env


def step_arguments(settings: Settings, step: str, given: dict[str, object]) -> list[str]:
    """A `step` job's command line from the step's one table (steps/arguments.py): each
    argument read from the settings where the table says, the others `given` by the job."""
    values = dict(given)
    for argument in TABLES[step]:
        if argument.setting:
            section, field = argument.setting.split(".")
            values[argument.dest] = getattr(getattr(settings, section), field)
    return command_line(step, values)


def processing_job(
    settings: Settings,
    run: RunTree,
    step: str,
    inputs: dict[str, str],
    outputs: dict[str, str],
    given: dict[str, object] | None = None,
    instance_type: str | None = None,
    model: str = "",
) -> ProcessingJob:
    """The processing job of `step` in `run` (of one `model`, for a per-model step); `given`:
    the arguments of its command line the settings do not hold (`step_arguments`)."""
    return ProcessingJob(
        name=job_name(settings.experiment.name, run.label, step, *filter(None, [model])),
        step=step,
        code=run.code,
        inputs=inputs,
        outputs=outputs,
        arguments=step_arguments(settings, step, given or {}),
        env=job_env(settings),
        instance_type=instance_type or settings.data.instance_type,
        model=model,
    )


# -- the stages ---------------------------------------------------------------------------------


class Reconcile:
    """Raw data -> one snapshot: the user's rows, deduplicated, with their labels."""

    name = "reconcile"

    def jobs(self, settings: Settings, run: RunTree, sources: Sources) -> list[Job]:
        outputs = {"snapshot": sources.reconciled.reconciled, "report": run.report(self.name)}
        return [processing_job(settings, run, self.name, {"raw": sources.raw}, outputs)]

    def run(self, ctx: RunContext, jobs: list[Job]) -> None:
        (job,) = jobs
        details = {"raw_path": ctx.base.raw_path, "snapshot": job.outputs["snapshot"]}
        details = run_processing(ctx, job, details)
        ctx.base.data_snapshot_hash = snapshot_hash(ctx.store, ctx.sources.reconciled)
        if details.get("read_outside_raw_data"):
            # Files the cache key never saw: neither this snapshot nor the prepare of it (keyed
            # by this reconcile's key) is reused by a later run.
            for step in ("reconcile", "prepare"):
                if entry := ctx.base.data_steps.get(step):
                    entry["key"] = None
                    said = "not reused later: reconcile read files outside the raw data"
                    entry["note"] = "; ".join(filter(None, [entry.get("note"), said]))
        index_in_cache(ctx, self.name)


class Prepare:
    """The snapshot -> stratified train, validation and test splits, encoded for every model."""

    name = "prepare"

    def jobs(self, settings: Settings, run: RunTree, sources: Sources) -> list[Job]:
        inputs = {"snapshot": sources.reconciled.reconciled}
        outputs = {s: sources.prepared.split(s) for s in SPLITS} | {"report": run.report(self.name)}
        return [processing_job(settings, run, self.name, inputs, outputs)]

    def run(self, ctx: RunContext, jobs: list[Job]) -> None:
        (job,) = jobs
        run_processing(ctx, job, {})
        ctx.base.data_snapshot_hash = snapshot_hash(ctx.store, ctx.sources.reconciled)
        made_from = {
            "reconciled": ctx.sources.reconciled.prefix,
            "snapshot_hash": ctx.base.data_snapshot_hash,
        }
        ctx.store.put_bytes(ctx.sources.prepared.prepared_from, json.dumps(made_from).encode())
        index_in_cache(ctx, self.name)


class Train:
    """One training job per model ([experiment] JOB = train), or one tuning job per model
    (JOB = tune) followed by the export of its best model; every model lands at
    models/<model>/model/ with the data it was trained on."""

    name = "train"

    def jobs(self, settings: Settings, run: RunTree, sources: Sources) -> list[Job]:
        channels = {c: sources.prepared.split(c) for c in TRAINING_CHANNELS}
        models = settings.models.model_names
        if settings.experiment.job == "train":
            jobs = [training_job(settings, run, m, channels, "training") for m in models]
            # A warm pool waits for the run's next training job; the last one has none (a
            # pool after it would only be billed).
            jobs[-1] = dataclasses.replace(jobs[-1], keep_alive_seconds=0)
            return jobs
        return [
            job
            for m in models
            for job in (
                tuning_job(settings, run, m, channels),
                export_job(settings, run, m, channels),
            )
        ]

    def run(self, ctx: RunContext, jobs: list[Job]) -> None:
        store, run = ctx.store, ctx.run
        step = job_step(jobs[0])
        trained_on = lineage(store, ctx.sources.prepared, ctx.sources.data_version)
        results, details = [], {"models": {}, "model_artifacts": {}, "lineage": {}}
        before = md.read_sections(store, run).get(step)  # a resumed run's models that are done
        for job in jobs:
            model = job_model(job)
            if job.kind == "processing":  # a tuned model's export
                if is_complete(store, run.final_model(model)):  # before this run was resumed
                    details["models"].setdefault(model, {}).update(exported(store, job, None))
                    continue
            elif trained_before(store, run, job):
                for name, value in done_before(store, run, job, before, trained_on).items():
                    details[name][model] = value
                log.info(f"{model}: trained before this run was resumed")
                continue
            runs = {
                "tuning": ctx.backend.run_tuning,
                "training": ctx.backend.run_training,
                "processing": ctx.backend.run_processing,
            }[job.kind]
            result = launched(job, runs)
            results.append(result)
            if job.kind == "tuning" and result.details:  # one record, whoever ran the study
                tuning_record.save(store, run, model, result.details)
            if result.status != "Completed":
                md.write_section(store, run, section(step, results, details))
                raise JobFailed(result, step)
            if job.kind == "processing":
                details["models"].setdefault(model, {}).update(exported(store, job, result))
            else:
                report = read_report(store, trial_of(job).output_prefix)
                took = round(result.seconds, 1)
                details["models"][model] = {**report, **result.details, "job_seconds": took}
                details["model_artifacts"][model] = run.final_model(model)
                details["lineage"][model] = trained_on
            md.write_section(store, run, section(step, results, details, status="running"))
        md.write_section(store, run, section(step, results, details))


def trained_before(store: Store, run: RunTree, job: TrainingJob | TuningJob) -> bool:
    """A resumed run's model that is done: trained (a tuned one may still await its export)."""
    waiting = trial_of(job).model_prefix  # a tuning job's best trial, before its export
    return is_complete(store, run.final_model(job_model(job))) or is_complete(store, waiting)


def done_before(
    store: Store, run: RunTree, job: TrainingJob | TuningJob, before, trained_on: dict
) -> dict:
    """What Metadata keeps of a model trained before this run was resumed: its section's
    record; or, where the run stopped before writing it (between a study's end and its
    section), what the job left: its report, a tuning job's record."""
    model = job_model(job)
    names = ("models", "model_artifacts", "lineage")
    if before is not None and (before.details.get("models") or {}).get(model):
        return {name: (before.details.get(name) or {}).get(model) for name in names}
    report = read_report(store, trial_of(job).output_prefix)
    if job.kind == "tuning":
        with contextlib.suppress(NotFound):
            report |= json.loads(store.get_bytes(run.tuning_record(model)))
    return {"models": report, "model_artifacts": run.final_model(model), "lineage": trained_on}


def exported(store: Store, job: ProcessingJob, result: JobResult | None) -> dict:
    """A tuned model's export, as its record says, and the best trial's copy removed: the
    model is kept once, exported, where a training job leaves its model. `result`: None when
    the export ended before this run was resumed."""
    record = json.loads(store.get_bytes(job.outputs["model"] + RECORD))
    for key in store.list_keys(job.inputs["model"]):
        store.delete(key)
    seconds = round(result.seconds, 1) if result is not None else None
    return {"exports": record["exports"], "export_job_seconds": seconds}


class Inference:
    """Every model's export on the held-out test split: per-label metrics, the comparison."""

    name = "inference"

    def jobs(self, settings: Settings, run: RunTree, sources: Sources) -> list[Job]:
        test = sources.prepared
        inputs = {
            "test": test.split("test"),
            "labels": test.split("labels"),
            "models": sources.models,
        }
        outputs = {"results": run.inference, "report": run.report(self.name)}
        instance = settings.inference.instance_type
        return [processing_job(settings, run, self.name, inputs, outputs, None, instance)]

    def run(self, ctx: RunContext, jobs: list[Job]) -> None:
        (job,) = jobs
        details = {
            "results": job.outputs["results"],
            "models_from": job.inputs["models"],
            "data_version": ctx.sources.data_version,
        }
        run_processing(ctx, job, details)
        md.merge(ctx.store, ctx.run, ctx.base)


class Register:
    """After inference, when [registry] names a model package group: the run's winner
    registered once (pipeline/registry/). No job: the driver's own requests, or a record."""

    name = registry.STEP

    def jobs(self, settings: Settings, run: RunTree, sources: Sources) -> list[Job]:
        return []

    def run(self, ctx: RunContext, jobs: list[Job]) -> None:
        started = time.time()
        record = md.merge(ctx.store, ctx.run, ctx.base).model_dump()
        client = ctx.backend.client  # SageMaker's (moto's when emulated), None locally
        image = identity(ctx.settings)[0]  # the image the run's jobs ran: the version serves it
        said = {"step": self.name, "start_time": md.iso(started)}
        try:
            registered = registry.register(ctx.settings, ctx.store, ctx.run, record, client, image)
        except Exception as e:
            reason = str(e)
            failed = md.StepSection(**said, status="failed", failure_reason=reason)
            md.write_section(ctx.store, ctx.run, failed)
            raise
        took = round(time.time() - started, 3)
        done = {"end_time": md.iso(time.time()), "time_taken": took}
        details = {"registered": registered}
        section = md.StepSection(**said, **done, status="completed", details=details)
        md.write_section(ctx.store, ctx.run, section)
        md.merge(ctx.store, ctx.run, ctx.base)


STAGES: tuple[Stage, ...] = (Reconcile(), Prepare(), Train(), Inference(), Register())
# What --steps chooses from. Registration is not chosen: it follows inference whenever
# [registry] names a group (registry.with_registration).
STEPS = tuple(stage.name for stage in STAGES if stage.name != Register.name)


def build_jobs(settings: Settings, steps: list[str], run: RunTree, sources: Sources) -> list[Job]:
    """Every job the run launches, in order, with its inputs, outputs and resources; the steps
    that run read what the run's own earlier steps write."""
    reading = sources.with_outputs_of(steps, run)
    return [
        job for stage in STAGES if stage.name in steps for job in stage.jobs(settings, run, reading)
    ]


# -- training and tuning jobs -------------------------------------------------------------------


def training_job(settings: Settings, run: RunTree, model: str, channels: dict, kind: str):
    """A training job of `model` shaped by [training] (and [training.<model>])."""
    t = settings.model_training.get(model, settings.training)
    step = "train" if kind == "training" else "tune"
    return TrainingJob(
        name=job_name(run.experiment, run.label, step, model),
        step="train",
        code=run.code,
        channels=channels,
        hyperparameters=settings.training_hyperparameters(model, kind),
        # A tuning job's best trial waits for its export (export_job) beside the final place.
        model_prefix=run.final_model(model) if kind == "training" else run.best_trial_model(model),
        output_prefix=run.model_output(model),
        checkpoint_prefix=run.checkpoints(model),
        sagemaker_output=run.training_output,
        env=job_env(settings),
        instance_type=t.instance_type,
        instance_count=t.instance_count,
        processes_per_host=t.processes_per_host if t.use_distributed else 1,
        use_spot=t.use_spot,
        max_run_seconds=t.max_run_seconds,
        max_wait_seconds=t.max_wait_seconds,
        max_restarts=t.max_restarts,
        metric_definitions=settings.metric_definitions,
        keep_alive_seconds=t.keep_alive_seconds,
    )


def tuning_job(settings: Settings, run: RunTree, model: str, channels: dict) -> TuningJob:
    """A tuning job of `model` over [tuning.hyperparameters] (and its own section)."""
    tuning = settings.tuning
    return TuningJob(
        name=job_name(
            run.experiment,
            run.label,
            "tune",
            model,
            limit=TUNING_JOB_NAME_LIMIT,
            case_sensitive=False,  # SageMaker compares tuning job names without case
        ),
        trial=training_job(settings, run, model, channels, "tuning"),
        ranges=settings.tuning_space(model)[1],
        strategy=tuning.strategy,
        objective_metric=tuning.objective_metric,
        objective_type=tuning.objective_type,
        max_jobs=tuning.max_jobs,
        max_parallel_jobs=tuning.max_parallel_jobs,
        early_stopping=tuning.early_stopping,
    )


def export_job(settings: Settings, run: RunTree, model: str, channels: dict) -> ProcessingJob:
    """After a study, its best model exported once (steps/export.py), on a CPU instance as
    inference runs: the programs [training] EXPORTS names, each checked against the eager
    model on validation rows, written where a training job leaves its model."""
    inputs = {
        "model": run.best_trial_model(model),
        "validation": channels["validation"],
        "labels": channels["labels"],
    }
    outputs = {"model": run.final_model(model)}
    given = {"model_name": model, "exports": settings.exports()}
    instance = settings.inference.instance_type
    return processing_job(settings, run, "export", inputs, outputs, given, instance, model)


def job_model(job: Job) -> str:
    """The model a training, tuning or per-model processing job works on."""
    return job.model if job.kind == "processing" else trial_of(job).hyperparameters["model_name"]


def trial_of(job: Job) -> TrainingJob | ProcessingJob:
    """The training job a tuning job launches for each trial; any other job itself."""
    return job.trial if job.kind == "tuning" else job


def job_step(job: Job) -> str:
    """The step a job's section of Metadata is named after: train and tune are two."""
    if job.kind == "tuning":
        return "tune"
    return job.step if job.kind == "processing" else "train"


def job_label(job: Job) -> str:
    """What the user calls a job: its step, and its model for training, tuning and export."""
    if job.kind == "processing":
        return f"{job.step} {job.model}" if job.model else job.step
    return f"{job_step(job)} {job_model(job)}"


# -- running and recording ----------------------------------------------------------------------


def launched(job: Job, run_job) -> JobResult:
    """`run_job(job)`, said when it starts and ends (the live display follows these)."""
    label = job_label(job)
    log.info(f"{label}: started ({job.kind} job {job.name})", extra={"event": ("started", label)})
    result = run_job(job)
    status = result.status.lower()
    ended = {"event": ("ended", label, status, result.seconds)}
    log.info(f"{label}: {status} in {result.seconds:.1f}s", extra=ended)
    return result


def run_processing(ctx: RunContext, job: ProcessingJob, details: dict) -> dict:
    """Run a stage's processing job and write its section: the job's own report (its
    step_metadata.json) with the stage's `details`, which it returns; raise JobFailed when it
    did not complete."""
    result = launched(job, ctx.backend.run_processing)
    if result.status == "Completed":
        details = {**read_report(ctx.store, job.outputs["report"]), **details}
    else:
        details = {}
    md.write_section(ctx.store, ctx.run, section(job.step, [result], details))
    if result.status != "Completed":
        raise JobFailed(result, job.step)
    return details


def index_in_cache(ctx: RunContext, step: str) -> None:
    """A data step's output, indexed under its cache key for later runs to reuse."""
    entry = ctx.base.data_steps.get(step)
    if entry and entry.get("key"):
        run_num = ctx.run.run_num
        indexed = cache.remember(ctx.store, ctx.tree, step, entry["key"], entry["inputs"], run_num)
        if indexed != run_num:
            said = f"another run indexed the same inputs first (data {run_label(indexed)})"
            entry["note"] = "; ".join(filter(None, [entry.get("note"), said]))
    md.merge(ctx.store, ctx.run, ctx.base)


def section(
    step: str, results: list[JobResult], details: dict, status: str | None = None
) -> md.StepSection:
    """A step's section of Metadata from its jobs' results."""
    failed = [r for r in results if r.status != "Completed"]
    peaks = [r.peak_memory_mb for r in results if r.peak_memory_mb is not None]
    # GPU figures come only from jobs that ran on GPUs and measured them.
    models = details.get("models", {})
    gpus = {
        m: d["gpu_usage"] for m, d in models.items() if isinstance(d, dict) and d.get("gpu_usage")
    }
    return md.StepSection(
        step=step,
        status=status or ("failed" if failed else "completed"),
        job_names=[r.name for r in results],
        failure_reason="; ".join(f"{r.name}: {r.failure_reason}" for r in failed) or None,
        start_time=md.iso(min(r.start_time for r in results)) if results else None,
        end_time=md.iso(max(r.end_time for r in results)) if results else None,
        time_taken=round(sum(r.seconds for r in results), 3) if results else None,
        memory_usage=max(peaks) if peaks else None,
        gpu_usage=gpus or None,
        restarts=sum(r.restarts for r in results),
        billing=[b for r in results for b in r.billing],
        details=details,
    )


def read_report(store: Store, prefix: str) -> dict:
    """What a job's step wrote of itself (steps/runtime/step.py `write_step_metadata`)."""
    try:
        return json.loads(store.get_bytes(step_report(prefix)))
    except NotFound:
        return {}


# -- the plan, as printed -----------------------------------------------------------------------


def plan_lines(number: int, job: Job, store: Store) -> list[str]:
    """What the plan says of one job: its step and model, its inputs and outputs, its search."""
    trial = trial_of(job)
    model = job_model(job) or None
    lines = [
        f"  {number}. {job_step(job)}{f' [{model}]' if model else ''} ({job.kind} job {job.name})"
    ]
    if job.kind == "processing":
        inputs, outputs = job.inputs, job.outputs
    else:
        inputs = trial.channels
        outputs = {
            "model": trial.model_prefix,
            "output": trial.output_prefix,
            "checkpoints": trial.checkpoint_prefix,
        }
    for kind, items in (("input", {"code": trial.code, **inputs}), ("output", outputs)):
        lines += [
            f"       {kind:6} {name:<12} {source_uri(store, where)}"
            for name, where in items.items()
        ]
    if job.kind == "tuning":
        searched = (
            f"{k}={getattr(v, 'options', None) or v.render()}" for k, v in job.ranges.items()
        )
        trials = f"{job.max_jobs} trials ({job.max_parallel_jobs} at once)"
        lines.append(
            f"       search {job.strategy}, {trials}, early stopping {job.early_stopping}: "
            + ", ".join(searched)
        )
    return lines
