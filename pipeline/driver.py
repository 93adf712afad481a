"""The driver: validate, describe every job once, claim a run_num, run the jobs on a backend,
record Metadata.

    reconcile (processing) -> prepare (processing) -> train | tune (training) -> inference (processing)

Everything that can be checked is checked before a run_num is claimed or anything is written:
the settings, the user functions, the raw data, and the earlier outputs a partial run reuses.
The jobs are built once (`build_jobs`); `--dry-run` prints those very objects, and the run
hands the same objects to the backend.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import cache, service_model
from pipeline import metadata as md
from pipeline.config import ConfigError, Settings
from pipeline.history import settings_changes
from pipeline.jobs import (
    TUNING_JOB_NAME_LIMIT,
    JobFailed,
    JobResult,
    ProcessingJob,
    TrainingJob,
    TuningJob,
    job_name,
    request_for,
)
from pipeline.paths import SPLITS, DataTree, ExperimentTree, RunTree, run_label
from pipeline.runs import claim_run_num, existing_run_nums, heartbeat, silent_driver
from pipeline.service_model import as_if_on_s3
from pipeline.store import (
    NotFound,
    Store,
    StoreError,
    artifact_key,
    aws_config,
    is_complete,
    source_uri,
    upload_dir,
)
from steps.entrypoint import (
    EXTRA_SECRETS_VARIABLE,
    HF_TOKEN_SECRET_VARIABLE,
    WANDB_SECRET_VARIABLE,
    secret_values,
)
from steps.user_code import load_user_functions, local_modules

# What the driver tells the user; run_pipeline.py sends it to the terminal. Job output
# streams separately, through the backend's `echo`.
log = logging.getLogger("smpipe")

STEPS = ("reconcile", "prepare", "train", "inference")
PROJECT_ROOT = Path(__file__).resolve().parent.parent


class PipelineError(RuntimeError):
    """A step failed or a run cannot start; the message is one paragraph for the user."""


@dataclass
class Sources:
    """Where each step reads from: this run's outputs or an earlier run's, named up front."""

    raw: str  # store prefix or URI
    reconciled: DataTree | None = None  # the data version whose snapshot prepare reads
    prepared: DataTree | None = None  # the data version whose splits train and inference read
    data_version: int | None = None
    models: str | None = None  # the models/ folder of the run whose models inference tests
    reused: dict[str, str] = field(default_factory=dict)  # what was taken from earlier runs

    def record(self) -> dict:
        """What Metadata keeps, so a resumed run reads exactly what the run started with."""
        return {"raw": self.raw, "data_version": self.data_version, "models": self.models,
                "reconciled": self.reconciled.prefix if self.reconciled else None,
                "prepared": self.prepared.prefix if self.prepared else None}  # fmt: skip

    @classmethod
    def from_record(cls, record: dict, tree: ExperimentTree) -> Sources:
        def data(prefix: str | None) -> DataTree | None:
            return tree.data(prefix.rstrip("/").rsplit("/", 1)[-1]) if prefix else None

        return cls(raw=record["raw"], reconciled=data(record["reconciled"]),
                   prepared=data(record["prepared"]), data_version=record["data_version"],
                   models=record["models"])  # fmt: skip


def parse_steps(text: str | None) -> list[str]:
    if not text:
        return list(STEPS)
    wanted = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in STEPS]
    if unknown or not wanted:
        raise PipelineError(
            f"--steps: unknown step(s) {unknown or wanted}; choose from {', '.join(STEPS)}"
        )
    return [s for s in STEPS if s in wanted]  # always in pipeline order


def newest_data(store: Store, tree: ExperimentTree, kind: str) -> int | None:
    """The newest data version whose `kind` (reconciled | prepared) is complete."""
    for version in reversed([int(v) for v in store.list_children(tree.data_root) if v.isdigit()]):
        data = tree.data(version)
        if kind == "reconciled" and is_complete(store, data.reconciled):
            return version
        if kind == "prepared" and all(is_complete(store, data.split(s)) for s in SPLITS):
            return version
    return None


def newest_models(
    store: Store, tree: ExperimentTree, model_names: list[str]
) -> tuple[int, dict] | None:
    """The newest run that left a complete model for every name, and its Metadata."""
    for run_num in reversed(existing_run_nums(store, tree)):
        try:
            record = json.loads(store.get_bytes(tree.run(run_num).metadata))
        except NotFound:
            continue
        recorded = record.get("model_artifacts") or {}
        keys = {m: artifact_key(store, where) for m, where in recorded.items()}
        if all(keys.get(m) and is_complete(store, keys[m]) for m in model_names):
            return run_num, {**record, "model_artifacts": keys}
    return None


def read_labels(store: Store, key: str) -> dict[str, str] | None:
    try:
        return json.loads(store.get_bytes(key))
    except NotFound:
        return None


def snapshot_hash(store: Store, data: DataTree) -> str | None:
    """The hash of the snapshot `data` holds, or that its prepared data was made from."""
    for key in (data.snapshot_info, data.prepared_from):
        try:
            return json.loads(store.get_bytes(key))["snapshot_hash"]
        except (NotFound, KeyError):
            continue
    return None


def lineage(store: Store, data: DataTree, version: int) -> dict:
    """What a model is trained on, recorded beside it: the data version, the hash of its
    snapshot, and the label map (id -> name)."""
    snapshot = snapshot_hash(store, data)
    return {"data_version": version, "data_snapshot_hash": snapshot,
            "id2label": read_labels(store, data.split("labels") + "id2label.json")}  # fmt: skip


def check_reused_models(
    store: Store, tree: ExperimentTree, run_num: int, record: dict, model_names: list[str]
) -> tuple[DataTree | None, list[str]]:
    """The data version run `run_num`'s models were trained on, whose test split is the only
    one they may be tested on; and why not, naming the model, when their label maps differ."""
    version = record.get("data_version")
    where = f"run {run_label(run_num)}"
    if version is None:
        return None, [
            f"{where} records no data version for its models, so no test split is known to be theirs"
        ]
    data = tree.data(version)
    if not all(is_complete(store, data.split(s)) for s in SPLITS):
        return None, [
            f"{where}'s models were trained on data {run_label(version)}, which is no longer complete at {store.uri_of(data.prepared)}"
        ]
    labels = read_labels(store, data.split("labels") + "id2label.json")
    problems = []
    for model in model_names:
        own = read_labels(store, record["model_artifacts"][model] + "id2label.json")
        if own is not None and own != labels:
            problems.append(
                f"model {model!r} of {where} knows labels {sorted(own.values())}, but data "
                f"{run_label(version)} has {sorted((labels or {}).values())}: they cannot be compared"
            )
    return data, problems


def check_raw_data(settings: Settings, store: Store, tree: ExperimentTree) -> list[str]:
    local_raw = settings.raw_data_uri() and "://" not in settings.raw_data_uri()
    if local_raw and not any(p.is_file() for p in Path(settings.raw_data_uri()).rglob("*")):
        return [f"[data] RAW_DATA: {settings.raw_data_uri()} is not a folder with files in it"]
    if local_raw and settings.experiment.backend != "local":
        return check_raw_upload(store, tree, Path(settings.raw_data_uri()))
    if not settings.data.raw_data and not store.list_keys(tree.raw):
        return [
            f"no raw data at {store.uri_of(tree.raw)} ([data] RAW_DATA is empty, so the experiment's raw/ folder is used)"
        ]
    # RAW_DATA in another bucket is checked by the job itself: it may need other credentials.
    return []


def local_files(folder: Path) -> dict[str, Path]:
    return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}


def check_raw_upload(store: Store, tree: ExperimentTree, folder: Path) -> list[str]:
    """A SageMaker job cannot read a folder on this machine: its files go to the experiment's
    raw/ first. That is refused when raw/ already holds other data (nothing is mixed)."""
    there = {k[len(tree.raw) :] for k in store.list_keys(tree.raw)}
    if there and there != set(local_files(folder)):
        return [
            f"[data] RAW_DATA: {folder} would be uploaded to {store.uri_of(tree.raw)}, which already "
            "holds other files; leave RAW_DATA empty to use those, or use another experiment NAME"
        ]
    return []


def resolve_sources(
    settings: Settings, store: Store, tree: ExperimentTree, steps: list[str]
) -> Sources:
    """Decide where every step reads from, or say what is missing; writes nothing."""
    problems = []
    uploads_raw = settings.experiment.backend != "local" and settings.raw_data_uri()
    raw = tree.raw if uploads_raw or not settings.raw_data_uri() else settings.raw_data_uri()
    sources = Sources(raw=raw)
    if "reconcile" in steps:
        problems += check_raw_data(settings, store, tree)
    if "prepare" in steps and "reconcile" not in steps:
        version = newest_data(store, tree, "reconciled")
        if version is None:
            problems.append(
                f"--steps skips reconcile, but {store.uri_of(tree.data_root)} holds no complete reconciled snapshot"
            )
        else:
            sources.reconciled = tree.data(version)
            sources.reused["reconciled"] = store.uri_of(sources.reconciled.reconciled)
    if {"train", "inference"} & set(steps) and "prepare" not in steps:
        version = newest_data(store, tree, "prepared")
        if version is None:
            problems.append(
                f"--steps skips prepare, but {store.uri_of(tree.data_root)} holds no complete prepared data"
            )
        else:
            sources.prepared = tree.data(version)
            sources.data_version = version
            sources.reused["prepared"] = store.uri_of(sources.prepared.prepared)
    if "inference" in steps and "train" not in steps:
        found = newest_models(store, tree, settings.models.model_names)
        if found is None:
            problems.append(
                f"--steps skips train, but no earlier run of {settings.experiment.name!r} has complete models for "
                f"{', '.join(settings.models.model_names)}"
            )
        elif "prepare" in steps:
            problems.append(
                f"--steps prepares new data but skips train: run {run_label(found[0])}'s models would be "
                "tested on data they were not trained on; add train, or run inference on its own"
            )
        else:
            # A model is tested only on the test split of the data version it was trained on.
            data, mismatched = check_reused_models(store, tree, *found, settings.models.model_names)
            problems += mismatched
            sources.models = tree.run(found[0]).models
            sources.reused["models"] = f"run {run_label(found[0])}"
            if data is not None:
                sources.prepared, sources.data_version = data, found[1]["data_version"]
                sources.reused["prepared"] = store.uri_of(data.prepared) + " (the models' own data)"
    if problems:
        raise PipelineError("cannot start: " + "; ".join(problems))
    return sources


def consult_cache(
    settings: Settings,
    store: Store,
    tree: ExperimentTree,
    steps: list[str],
    sources: Sources,
    functions,
    use_cache: bool,
) -> dict[str, cache.CacheEntry]:
    """Each data step of `steps` reused (its sources pointed at the earlier output) or to be
    computed; prepare's output for these inputs makes reconcile unnecessary too."""
    placeholder = tree.run("<next run_num>")
    arguments = {j.step: j.arguments for j in build_jobs(settings, steps, placeholder, sources)
                 if j.kind == "processing"}  # fmt: skip
    snapshot = snapshot_hash(store, sources.reconciled) if sources.reconciled else None
    entries = cache.plan(store, tree, steps, sources.raw, snapshot, arguments, functions, use_cache,
                         user_code(settings))  # fmt: skip
    prepare, reconcile = entries.get("prepare"), entries.get("reconcile")
    if prepare and prepare.status == "reused" and reconcile and reconcile.status != "reused":
        reconcile.status, reconcile.note = "skipped", "prepare's output for these inputs exists"
    for step, entry in entries.items():
        if entry.status != "reused":
            why = entry.note or "no earlier output from these inputs"
            log.info(f"{step} {'is not run' if entry.status == 'skipped' else 'runs'}: {why}")
        if entry.status == "reused":
            data = tree.data(entry.data_version)
            note = f"; {entry.note}" if entry.note else ""
            how = f"{store.uri_of(data.prefix)} (cache: same inputs, key {entry.key[:12]}{note})"
            if step == "reconcile":
                sources.reconciled, sources.reused["reconciled"] = data, how
            else:
                sources.prepared, sources.data_version = data, entry.data_version
                sources.reused["prepared"] = how
                sources.reconciled = sources.reconciled or data
    return entries


def log_reused(sources: Sources) -> None:
    for what, where in sources.reused.items():
        log.info(f"reusing {what}: {where}")


# -- every job of a run, described once ------------------------------------------------------


# [hub] OFFLINE: the Hugging Face libraries' own switches (huggingface_hub's HF_HUB_OFFLINE,
# transformers' TRANSFORMERS_OFFLINE, datasets' HF_DATASETS_OFFLINE), set per run in the
# request's Environment, never baked into the image.
HUB_OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def job_env(settings: Settings) -> dict[str, str]:
    """The Environment of every job's request: the user functions, the secrets' names, the Hub."""
    env = {"SMPIPE_USER_FUNCTIONS": settings.experiment.user_functions}
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


def training_job(settings: Settings, run: RunTree, model_name: str, channels: dict, kind: str):
    """A training job of `model_name` shaped by [training] (and [training.<model>])."""
    t = settings.model_training.get(model_name, settings.training)
    step = "train" if kind == "training" else "tune"
    return TrainingJob(
        name=job_name(run.experiment, run.label, step, model_name),
        step="train",
        code=run.code,
        channels=channels,
        hyperparameters=settings.training_hyperparameters(model_name, kind),
        model_prefix=run.model(model_name) + "model/",
        output_prefix=run.model(model_name) + "output/",
        checkpoint_prefix=run.checkpoints(model_name),
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
    )


def build_jobs(settings: Settings, steps: list[str], run: RunTree, sources: Sources) -> list:
    """Every job the run launches, in order, with its inputs, outputs and resources."""
    name, label = settings.experiment.name, run.label
    data = ExperimentTree(name).data(run.label if run.run_num == 0 else run.run_num)
    reconciled = data if "reconcile" in steps else sources.reconciled
    prepared = data if "prepare" in steps else sources.prepared
    env, d, t = job_env(settings), settings.data, settings.training
    jobs: list = []
    if "reconcile" in steps:
        jobs.append(ProcessingJob(
            name=job_name(name, label, "reconcile"), step="reconcile", code=run.code,
            inputs={"raw": sources.raw}, outputs={"snapshot": data.reconciled, "report": run.report("reconcile")},
            env=env, instance_type=d.instance_type,
        ))  # fmt: skip
    if "prepare" in steps:
        jobs.append(ProcessingJob(
            name=job_name(name, label, "prepare"), step="prepare", code=run.code,
            inputs={"snapshot": reconciled.reconciled},
            outputs={**{s: data.split(s) for s in SPLITS}, "report": run.report("prepare")},
            arguments=["--model-names", ",".join(settings.models.model_names),
                       "--max-length", str(t.max_sequence_length),
                       "--train-fraction", str(d.train_fraction),
                       "--validation-fraction", str(d.validation_fraction),
                       "--test-fraction", str(d.test_fraction), "--seed", str(d.seed)],
            env=env, instance_type=d.instance_type,
        ))  # fmt: skip
    if "train" in steps:
        channels = {c: prepared.split(c) for c in ("train", "validation", "labels")}
        for model in settings.models.model_names:
            if settings.experiment.job == "train":
                jobs.append(training_job(settings, run, model, channels, "training"))
                continue
            tuning = settings.tuning
            jobs.append(TuningJob(
                name=job_name(name, label, "tune", model, limit=TUNING_JOB_NAME_LIMIT),
                trial=training_job(settings, run, model, channels, "tuning"),
                ranges=settings.tuning_space(model)[1], strategy=tuning.strategy,
                objective_metric=tuning.objective_metric, objective_type=tuning.objective_type,
                max_jobs=tuning.max_jobs, max_parallel_jobs=tuning.max_parallel_jobs,
                early_stopping=tuning.early_stopping,
            ))  # fmt: skip
    if "inference" in steps:
        jobs.append(ProcessingJob(
            name=job_name(name, label, "inference"), step="inference", code=run.code,
            inputs={"test": prepared.split("test"), "labels": prepared.split("labels"),
                    "models": run.models if "train" in steps else sources.models},
            outputs={"results": run.inference, "report": run.report("inference")},
            arguments=["--model-names", ",".join(settings.models.model_names),
                       "--batch-size", str(settings.inference.batch_size),
                       "--model-format", settings.inference.model_format],
            env=env, instance_type=settings.inference.instance_type,
        ))  # fmt: skip
    return jobs


def job_step(job) -> str:
    if job.kind == "tuning":
        return "tune"
    return job.step if job.kind == "processing" else "train"


def job_label(job) -> str:
    """What the user calls a job: its step, and its model for training and tuning."""
    if job.kind == "processing":
        return job.step
    trial = job.trial if job.kind == "tuning" else job
    return f"{job_step(job)} {trial.hyperparameters['model_name']}"


def launched(job, run_job) -> JobResult:
    """`run_job(job)`, said when it starts and ends (the live display follows these)."""
    label = job_label(job)
    log.info(f"{label}: started ({job.kind} job {job.name})", extra={"event": ("started", label)})
    result = run_job(job)
    status = result.status.lower()
    log.info(f"{label}: {status} in {result.seconds:.1f}s",
             extra={"event": ("ended", label, status, result.seconds)})  # fmt: skip
    return result


def identity(settings: Settings) -> tuple[str, str]:
    """The image and role a backend's requests name: the settings' on sagemaker, stand-ins
    where nothing is sent to AWS (a local backend's requests are played here; emulated ones go
    to moto)."""
    from pipeline.emulated_backend import EMULATED_IMAGE, EMULATED_ROLE
    from pipeline.local_backend import LOCAL_IMAGE, LOCAL_ROLE

    e = settings.experiment
    if e.backend == "local":
        return LOCAL_IMAGE, LOCAL_ROLE
    if e.backend == "emulated":
        return e.image_uri or EMULATED_IMAGE, e.role_arn or EMULATED_ROLE
    return e.image_uri, e.role_arn


def describe(job, settings: Settings, store: Store) -> dict:
    """The request a job becomes on the run's backend (the local backend plays this same
    request)."""
    return request_for(job, *identity(settings), store.uri_of)


def check_requests(jobs: list, settings: Settings, store: Store) -> None:
    """Every request of the plan as SageMaker would check it, before anything is written or
    sent: one ConfigError naming each job, field and constraint (pipeline/service_model.py)."""
    problems = [
        problem
        for job in jobs
        for problem in service_model.refused(job.kind, as_if_on_s3(describe(job, settings, store)))
    ]
    names = [job.name for job in jobs]
    problems += [
        f"job name {n} is used twice in the plan" for n in sorted(set(names)) if names.count(n) > 1
    ]
    if problems:
        raise ConfigError(problems, f"{settings.source}: requests SageMaker would refuse")


def log_plan(jobs: list, settings: Settings, store: Store, show_requests: bool = False) -> None:
    log.info(
        f"plan for experiment {settings.experiment.name!r} on the {settings.experiment.backend} backend, store {store.uri}:",
        extra={"event": ("plan", [job_label(j) for j in jobs])},
    )
    for i, job in enumerate(jobs, 1):
        trial = job.trial if job.kind == "tuning" else job
        model = trial.hyperparameters.get("model_name") if job.kind != "processing" else None
        log.info(
            f"  {i}. {job_step(job)}{f' [{model}]' if model else ''} ({job.kind} job {job.name})"
        )
        inputs = job.inputs if job.kind == "processing" else trial.channels
        outputs = job.outputs if job.kind == "processing" else {
            "model": trial.model_prefix, "output": trial.output_prefix, "checkpoints": trial.checkpoint_prefix}  # fmt: skip
        for kind, items in (("input", {"code": job.code if job.kind != "tuning" else trial.code, **inputs}),
                            ("output", outputs)):  # fmt: skip
            for channel, where in items.items():
                uri = source_uri(store, where)
                log.info(f"       {kind:6} {channel:<12} {uri}")
        if job.kind == "tuning":
            ranges = ", ".join(
                f"{k}={getattr(v, 'options', None) or v.render()}" for k, v in job.ranges.items()
            )
            log.info(f"       search {job.strategy}, {job.max_jobs} trials ({job.max_parallel_jobs} at once), early stopping {job.early_stopping}: {ranges}")  # fmt: skip
        if show_requests:
            text = json.dumps(describe(job, settings, store), indent=2)
            log.info("\n".join("       " + line for line in text.splitlines()))


# -- running ------------------------------------------------------------------------------------


def make_backend(settings: Settings, store: Store, run: RunTree, echo):
    backend = settings.experiment.backend
    if backend == "local":
        from pipeline.local_backend import LocalBackend

        return LocalBackend(store, run, echo=echo)
    if backend == "emulated":
        from pipeline.emulated_backend import emulated_backend

        return emulated_backend(settings, store, run, echo)
    import boto3

    from pipeline.sagemaker_backend import SageMakerBackend

    session = boto3.Session(region_name=settings.experiment.region)
    clients = {name: session.client(name, config=aws_config()) for name in ("sagemaker", "logs")}
    return SageMakerBackend(store, run, client=clients["sagemaker"], logs_client=clients["logs"],
                            image_uri=settings.experiment.image_uri, role_arn=settings.experiment.role_arn, echo=echo)  # fmt: skip


def ship_code(settings: Settings, store: Store, prefix: str) -> None:
    """The code every job of the run runs: steps/ and the user functions module with the
    modules beside it that it imports, as they are now. Jobs receive it as an input; the image
    holds none of it."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    with tempfile.TemporaryDirectory(prefix="smpipe-code-") as tmp:
        shutil.copytree(PROJECT_ROOT / "steps", Path(tmp, "steps"), ignore=ignore)
        for name, path in user_code(settings).items():
            if path.is_dir():
                shutil.copytree(path, Path(tmp, name), ignore=ignore)
            else:
                shutil.copy2(path, Path(tmp, path.name))
        upload_dir(store, tmp, prefix)


def user_code(settings: Settings) -> dict[str, Path]:
    """The user's modules a run ships: USER_FUNCTIONS, found beside the settings file (or in
    this project: the demo's), and its local imports."""
    bases = [Path(settings.base_dir), PROJECT_ROOT]
    return local_modules(settings.experiment.user_functions, bases)


def upload_raw(settings: Settings, store: Store, tree: ExperimentTree) -> None:
    """RAW_DATA on this machine, for a backend whose jobs run elsewhere: into raw/, once."""
    folder = Path(settings.raw_data_uri())
    there = set(k[len(tree.raw) :] for k in store.list_keys(tree.raw))
    files = local_files(folder)
    if there == set(files):
        return
    for rel, path in files.items():
        store.upload_file(path, tree.raw + rel)
    log.info(f"uploaded {len(files)} raw files from {folder} to {store.uri_of(tree.raw)}")


def run_pipeline(
    settings: Settings,
    store: Store,
    steps: list[str],
    dry_run: bool = False,
    echo=None,
    make_backend=make_backend,
    show_requests: bool = False,
    resume: int | None = None,
    use_cache: bool = True,
) -> dict | None:
    """Run the pipeline; return the merged Metadata as a dict (None for a dry run).

    `resume`: the run_num of a failed, interrupted or abandoned run to continue in place.
    `use_cache`: reuse a data step's earlier output when its inputs are unchanged.
    `make_backend(settings, store, run, echo)` builds the backend once the run is claimed;
    only the outermost caller needs another one (a test's SageMaker client, say)."""
    echo = echo or sys.stdout
    functions = load_user_functions(settings.experiment.user_functions, settings.base_dir)
    tree = ExperimentTree(settings.experiment.name)
    data_steps: dict[str, cache.CacheEntry] = {}
    if resume is not None:
        run, base, steps, sources = resumed_run(settings, store, tree, resume, steps)
    else:
        sources = resolve_sources(settings, store, tree, steps)
        data_steps = consult_cache(settings, store, tree, steps, sources, functions, use_cache)
        skipped = {s for s, entry in data_steps.items() if entry.status in ("reused", "skipped")}
        steps = [s for s in steps if s not in skipped]
    target = run if resume is not None else tree.run("<next run_num>")
    planned = build_jobs(settings, steps, target, sources)
    check_requests(planned, settings, store)
    if dry_run:
        log_reused(sources)
        log_plan(planned, settings, store, show_requests)
        log.info("dry run: nothing was launched or written")
        return None
    mark_abandoned(store, tree)
    if resume is None:
        if "reconcile" in steps and sources.raw == tree.raw and settings.raw_data_uri():
            upload_raw(settings, store, tree)
        run, base = claim_run(settings, store, tree, steps, sources)
        base.data_steps = {step: entry.record() for step, entry in data_steps.items()}
    with heartbeat(store, run.heartbeat):
        return execute(settings, store, run, base, steps, sources, echo, make_backend)


def claim_run(
    settings: Settings, store: Store, tree: ExperimentTree, steps: list[str], sources: Sources
) -> tuple[RunTree, md.Metadata]:
    """A new run_num, its settings and its first Metadata."""
    run = tree.run(claim_run_num(store, tree))
    store.put_bytes(run.settings, settings.applied_ini.encode())
    base = md.Metadata(
        run_id=f"{settings.experiment.name}/{run.label}",
        model_version=run.run_num,
        experiment_name=settings.experiment.name,
        artifact_uri=store.uri_of(run.prefix),
        backend=settings.experiment.backend,
        start_time=md.iso(time.time()),
        git_sha=md.git_sha(PROJECT_ROOT),  # the code that ran
        package_versions=md.package_versions(),
        settings=settings.applied_ini,
        raw_path=sources.raw,  # a key of this store, or the user's own URI or folder
        planned_steps=steps,
        sources=sources.record(),
    )
    log.info(f"run {run.label} of {settings.experiment.name!r}: {store.uri_of(run.prefix)}")
    return run, base


def execute(
    settings: Settings,
    store: Store,
    run: RunTree,
    base: md.Metadata,
    steps: list[str],
    sources: Sources,
    echo,
    make_backend,
) -> dict:
    """Launch the run's jobs in order on the backend, record each step, finish the run."""
    started = time.time()
    tree = ExperimentTree(settings.experiment.name)
    base.mask(secret_values({**os.environ, **job_env(settings)}))
    log_reused(sources)
    md.merge(store, run, base)
    jobs = build_jobs(settings, steps, run, sources)
    if base.resumed_at:
        clear_partial_outputs(store, run, jobs)
    log_plan(jobs, settings, store)
    if not is_complete(store, run.code):  # a resumed run runs the code it started with
        ship_code(settings, store, run.code)
    backend = make_backend(settings, store, run, echo)
    read_own_outputs(store, tree, run, steps, sources, base)
    training = [j for j in jobs if j.kind != "processing"]
    try:
        for job in jobs:
            if job.kind == "processing":
                result = launched(job, backend.run_processing)
                _processing_section(store, run, job, result, base, sources)
            elif job is training[0]:
                trained_on = lineage(store, sources.prepared, sources.data_version)
                _train(store, run, backend, training, trained_on)
    except JobFailed as e:
        _finish(store, run, base, started, "failed", str(e))
        backend.close(succeeded=False)
        write_run_report(store, run)
        raise PipelineError(
            f"step '{e.step}' failed in job {e.result.name}: {e.result.failure_reason}. "
            f"The job's log is at {store.uri_of(e.result.log_key) if e.result.log_key else 'the backend'}; "
            f"run {run.label} is marked failed at {store.uri_of(run.metadata)} and nothing from it is promoted."
        ) from None
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (run_pipeline.py turns it into this)
        backend.stop()
        _finish(store, run, base, started, "interrupted", "stopped by the user (SIGINT/SIGTERM)")
        backend.close(succeeded=False)
        log.info(f"run {run.label} interrupted: its jobs were stopped and their logs kept; "
                 f"--resume {run.run_num} continues it")  # fmt: skip
        raise
    except StoreError as e:  # the store refused a write (full, gone, denied): one paragraph
        backend.stop()
        marked = _finish_if_possible(store, run, base, started, str(e))
        backend.close(succeeded=False)
        raise PipelineError(f"run {run.label} failed: {e}. {marked}") from None
    except BaseException as e:
        backend.stop()
        _finish(store, run, base, started, "failed", f"{type(e).__name__}: {e}")
        backend.close(succeeded=False)
        raise
    record = _finish(store, run, base, started, "completed", None)
    backend.close(succeeded=True)
    where = store.uri_of(run.prefix)
    if hasattr(store, "folder_of"):  # the emulated bucket of a local STORE
        where += f" (on this machine: {store.folder_of(run.prefix)})"
    log_summary(record, where)
    write_run_report(store, run)
    return record


def read_own_outputs(
    store: Store, tree: ExperimentTree, run: RunTree, steps: list[str], sources: Sources, base
) -> None:
    """Later steps read what this run's own data steps write; data from an earlier run keeps
    its snapshot's hash in Metadata."""
    if "reconcile" in steps:
        sources.reconciled = tree.data(run.run_num)
    if "prepare" in steps:
        sources.prepared, sources.data_version = tree.data(run.run_num), run.run_num
    base.data_version = sources.data_version
    if sources.prepared is not None and "prepare" not in steps:
        base.data_snapshot_hash = snapshot_hash(store, sources.prepared)


# -- runs that stopped: abandoned ones marked, failed or interrupted ones resumed ---------------


def mark_abandoned(store: Store, tree: ExperimentTree) -> None:
    """A run left `running` by a driver that died without a word (SIGKILL, power loss) is
    marked `abandoned`, so nobody waits for it or mistakes it for a live one."""
    for run_num in existing_run_nums(store, tree):
        run = tree.run(run_num)
        try:
            record = json.loads(store.get_bytes(run.metadata))
        except (NotFound, ValueError):
            continue
        if record.get("status") != "running":
            continue
        why = silent_driver(store, run.heartbeat)
        if why is None:
            continue
        record.update(status="abandoned", failure_reason=why, end_time=record.get("end_time"))
        store.put_bytes(run.metadata, json.dumps(record, indent=2).encode())
        log.info(
            f"run {run.label} was left running: {why}; marked abandoned (--resume {run_num} continues it)"
        )


RESUMABLE = ("failed", "interrupted", "abandoned")


def resumed_run(
    settings: Settings, store: Store, tree: ExperimentTree, run_num: int, steps: list[str]
) -> tuple[RunTree, md.Metadata, list[str], Sources]:
    """Run `run_num` again where it stopped: its completed steps kept, the rest with the same
    sources, settings and code; training resumes from the run's checkpoints."""
    run = tree.run(run_num)
    try:
        record = json.loads(store.get_bytes(run.metadata))
    except NotFound:
        raise PipelineError(
            f"--resume {run_num}: no run {run.label} at {store.uri_of(run.prefix)}"
        ) from None
    if record.get("status") == "running":
        why = silent_driver(store, run.heartbeat)
        if why is None:
            raise PipelineError(
                f"--resume {run_num}: run {run.label} is still running (its driver is alive)"
            )
        record["status"] = "abandoned"
    if record.get("status") not in RESUMABLE:
        raise PipelineError(
            f"--resume {run_num}: run {run.label} is {record.get('status')}; only a "
            f"{', '.join(RESUMABLE)} run can be resumed"
        )
    if not record.get("planned_steps") or record.get("sources") is None:
        raise PipelineError(
            f"--resume {run_num}: run {run.label} was made by an older driver that did not record its plan"
        )
    if steps != list(STEPS) and steps != record["planned_steps"]:
        raise PipelineError(
            f"--resume continues the steps run {run.label} planned ({','.join(record['planned_steps'])}); leave out --steps"
        )
    changed = settings_changes(store.get_bytes(run.settings).decode(), settings.applied_ini)
    if changed:
        raise PipelineError(
            f"--resume {run_num}: the settings differ from the ones run {run.label} started with "
            f"({'; '.join(changed)}); resume with those, or start a new run"
        )
    done = {
        name
        for name, section in record.get("steps", {}).items()
        if section.get("status") == "completed"
    }
    remaining = [
        s
        for s in record["planned_steps"]
        if s not in done and not (s == "train" and "tune" in done)
    ]
    sources = Sources.from_record(record["sources"], tree)
    for step in ("reconcile", "prepare"):
        if step in record["planned_steps"] and step in done:
            sources.reused[step] = f"completed by run {run.label}"
    if "reconcile" in done:
        sources.reconciled = tree.data(run_num)
    if "prepare" in done:
        sources.prepared, sources.data_version = tree.data(run_num), run_num
    if not remaining:
        raise PipelineError(f"--resume {run_num}: every step of run {run.label} completed already")
    keep = {k: v for k, v in record.items() if k in md.Metadata.model_fields and k != "steps"}
    base = md.Metadata(**{**keep, "status": "running", "failure_reason": None, "end_time": None,
                          "resumed_at": [*record.get("resumed_at", []), md.iso(time.time())]})  # fmt: skip
    log.info(f"resuming run {run.label} ({record['status']}): {', '.join(remaining)} left")
    return run, base, remaining, sources


def clear_partial_outputs(store: Store, run: RunTree, jobs: list) -> None:
    """A resumed run runs its unfinished data and inference steps again. What their earlier
    attempt left of their outputs (a driver killed between one output's manifest and the
    next) is the run's own and was never a result: it is removed, and said, so the step can
    write its versioned outputs whole. Models are kept: a complete one is not trained again."""
    for job in jobs:
        if job.kind != "processing":
            continue
        for prefix in job.outputs.values():
            keys = store.list_keys(prefix)
            if keys:
                for key in keys:
                    store.delete(key)
                log.info(
                    f"{job.step}: removed what its unfinished attempt left at {store.uri_of(prefix)}"
                )


def _processing_section(
    store: Store, run: RunTree, job, result: JobResult, base: md.Metadata, sources: Sources
) -> None:
    details = {}
    if result.status == "Completed":
        details = _report(store, job.outputs["report"])
        if job.step == "reconcile":
            details["raw_path"] = base.raw_path
            details["snapshot"] = job.outputs["snapshot"]
        if job.step == "inference":
            details["results"] = job.outputs["results"]
            details["models_from"] = job.inputs["models"]
            details["data_version"] = sources.data_version
    md.write_section(store, run, _section(job.step, [result], details))
    if result.status != "Completed":
        raise JobFailed(result, job.step)
    if job.step in ("reconcile", "prepare"):
        base.data_snapshot_hash = snapshot_hash(store, sources.reconciled)
    tree = ExperimentTree(run.experiment)
    if job.step == "prepare":
        from_ = {"reconciled": sources.reconciled.prefix, "snapshot_hash": base.data_snapshot_hash}
        store.put_bytes(tree.data(run.run_num).prepared_from, json.dumps(from_).encode())
    entry = base.data_steps.get(job.step)
    if entry and entry.get("key"):  # indexed under its key, for later runs to reuse
        indexed = cache.remember(store, tree, job.step, entry["key"], entry["inputs"], run.run_num)
        if indexed != run.run_num:
            said = f"another run indexed the same inputs first (data {run_label(indexed)})"
            entry["note"] = "; ".join(filter(None, [entry.get("note"), said]))
    md.merge(store, run, base)


def _train(store: Store, run: RunTree, backend, jobs: list, trained_on: dict) -> None:
    """One training or tuning job per model; every model lands at models/<model>/model/,
    recorded by its key with the data it was trained on."""
    step = job_step(jobs[0])
    results, details = [], {"models": {}, "model_artifacts": {}, "lineage": {}}
    before = md.read_sections(store, run).get(step)  # a resumed run's models that are done
    for job in jobs:
        trial = job.trial if job.kind == "tuning" else job
        model = trial.hyperparameters["model_name"]
        if before is not None and is_complete(store, trial.model_prefix):
            for name in details:
                details[name][model] = before.details.get(name, {}).get(model)
            log.info(f"{model}: trained before this run was resumed ({trial.model_prefix})")
            continue
        result = launched(job, backend.run_tuning if job.kind == "tuning" else backend.run_training)
        results.append(result)
        if result.status != "Completed":
            md.write_section(store, run, _section(step, results, details))
            raise JobFailed(result, step)
        details["models"][model] = {**_report(store, trial.output_prefix), **result.details,
                                    "job_seconds": round(result.seconds, 1)}  # fmt: skip
        details["model_artifacts"][model] = trial.model_prefix
        details["lineage"][model] = trained_on
        md.write_section(store, run, _section(step, results, details, status="running"))
    md.write_section(store, run, _section(step, results, details))


def _section(
    step: str, results: list[JobResult], details: dict, status: str | None = None
) -> md.StepSection:
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
        details=details,
    )


def _report(store: Store, prefix: str) -> dict:
    try:
        return json.loads(store.get_bytes(prefix + "step_metadata.json"))
    except NotFound:
        return {}


def _finish(
    store: Store, run: RunTree, base: md.Metadata, started: float, status: str, reason: str | None
) -> dict:
    ended = time.time()
    base.status, base.failure_reason = status, reason
    base.end_time, base.time_taken = md.iso(ended), round(ended - started, 3)
    record = md.merge(store, run, base)
    return record.model_dump()


def _finish_if_possible(
    store: Store, run: RunTree, base: md.Metadata, started: float, reason: str
) -> str:
    """Mark the run failed when the store still takes a small write; say what became of it."""
    try:
        _finish(store, run, base, started, "failed", reason)
    except StoreError as e:
        return (
            f"It could not be marked failed either ({e}); the next run marks it abandoned once "
            f"its heartbeat stops, and --resume {run.run_num} continues it."
        )
    return (
        f"It is marked failed at {store.uri_of(run.metadata)}; --resume {run.run_num} continues it."
    )


def write_run_report(store: Store, run: RunTree) -> None:
    """report.html of a run that ended. A view of what is recorded: a failure to draw it is
    said, and changes nothing of the run."""
    from pipeline.report import write_report

    try:
        key = write_report(store, ExperimentTree(run.experiment), run.run_num)
    except Exception as e:  # noqa: BLE001 -- the run's outcome stands either way
        log.warning(f"report.html of run {run.label} could not be written: {type(e).__name__}: {e}")
        return
    log.info(f"report: {store.uri_of(key)}")


def log_summary(record: dict, run_uri: str) -> None:
    for line in summary_lines(record, run_uri):
        log.info(line)


def summary_lines(record: dict, run_uri: str) -> list[str]:
    """What a finished run says at the end: per model its test metrics, training time, best
    epoch and where its model is; the comparison's winner and whether the win is significant."""
    performance = record.get("holdout_performance") or {}
    train = (
        (record.get("steps") or {}).get("train") or (record.get("steps") or {}).get("tune") or {}
    )
    trained = (train.get("details") or {}).get("models") or {}
    lines = []
    if performance:
        lines += ["", "test-set performance",
                  f"  {'model':<14}{'accuracy':>9}{'macro F1':>10}{'weighted F1':>13}{'rows':>6}{'trained':>9}{'best epoch':>12}  model"]  # fmt: skip
        for name, p in sorted(performance.items(), key=lambda kv: -kv[1]["macro_f1"]):
            t = trained.get(name) or {}
            took = f"{t['job_seconds']:.0f}s" if t.get("job_seconds") is not None else "-"
            where = (record.get("model_artifacts") or {}).get(name, "-")
            lines.append(f"  {name:<14}{p['accuracy']:>9.4f}{p['macro_f1']:>10.4f}{p['weighted_f1']:>13.4f}"
                         f"{p['rows']:>6}{took:>9}{str(t.get('best_epoch', '-')):>12}  {where}")  # fmt: skip
        comparison = (record["steps"].get("inference") or {}).get("details", {}).get("comparison")
        for pair in (comparison or {}).get("pairs", []):
            lines.append("  " + verdict(pair))
    lines.append(
        f"\nrun {run_label(record['model_version'])} {record['status']} in {record['time_taken']:.0f}s: {run_uri}"
    )
    return lines


def verdict(pair: dict) -> str:
    """One line on a pair of models: which is ahead in test accuracy, by how much, and
    whether that is significant."""
    a, b = pair["models"]
    m, ci = pair["mcnemar"], pair.get("accuracy_difference_ci95")
    ahead = a if pair["accuracy_difference"] >= 0 else b
    behind = b if ahead == a else a
    # accuracy(ahead) - accuracy(behind), and its interval, whichever way the pair is ordered
    sign = 1 if ahead == a else -1
    interval = ""
    if ci:
        low, high = sorted((sign * ci[0], sign * ci[1]))
        interval = f", 95% CI [{low:+.4f}, {high:+.4f}]"
    how = f"accuracy {sign * pair['accuracy_difference']:+.4f}{interval}; McNemar p={m['p_value']:.3g}"
    if m["significant_at_0.05"]:
        return f"{ahead} beats {behind}: {how}, significant at 0.05"
    return f"{ahead} vs {behind}: no significant difference ({ahead} ahead by {how})"
