"""Where each step of a run reads from, decided before anything is written: the raw data,
this run's outputs or the newest complete ones of earlier runs, the models an inference-only
run tests and the data they were trained on; and, for a resumed run, the sources it started
with.

Every check here reads the store and writes nothing; a problem is one PipelineError naming
what is missing and where.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipeline import metadata as md
from pipeline.code_bundle import STEPS, files_that_differ, shipped_files, user_files
from pipeline.config import ConfigError, Settings
from pipeline.errors import PipelineError, Refused, counted, log
from pipeline.history import settings_changes
from pipeline.paths import SPLITS, DataTree, ExperimentTree, RunTree, labels_of, run_label
from pipeline.raw_data import (
    LocalRaw,
    folder_problems,
    local_version,
    stored_sizes,
    unfinished_upload,
)
from pipeline.raw_data import upload_raw as upload_raw  # `smpipe upload`'s, named here too
from pipeline.runs import checkpoint_files, existing_run_nums, never_started, silent_driver
from pipeline.store import NotFound, Store, artifact_key, files_gone, is_complete
from steps.prepared_files import ENCODING, parse_encoding


@dataclass
class Sources:
    """Where each step reads from: this run's outputs or an earlier run's, named up front."""

    raw: str  # store prefix or URI
    # A local RAW_DATA on a backend whose jobs run elsewhere: the raw version `raw` names,
    # uploaded before the run is claimed (pipeline/raw_data.py); recorded as the folder.
    local_raw: LocalRaw | None = None
    reconciled: DataTree | None = None  # the data version whose snapshot prepare reads
    prepared: DataTree | None = None  # the data version whose splits train and inference read
    data_version: int | None = None
    models: str | None = None  # the models/ folder of the run whose models inference tests
    reused: dict[str, str] = field(default_factory=dict)  # what was taken from earlier runs

    def record(self) -> dict:
        """What Metadata keeps, so a resumed run reads exactly what the run started with."""
        return {
            "raw": self.raw,
            **({"raw_from": str(self.local_raw.folder)} if self.local_raw else {}),
            "data_version": self.data_version,
            "models": self.models,
            "reconciled": self.reconciled.prefix if self.reconciled else None,
            "prepared": self.prepared.prefix if self.prepared else None,
        }

    def with_outputs_of(self, steps: list[str], run: RunTree) -> Sources:
        """Where each step reads once `run`'s own steps have written: their outputs in place
        of earlier ones (the plan's placeholder run, run_num 0, included)."""
        tree = ExperimentTree(run.experiment)
        data = tree.data(run.run_num if run.run_num else run.label)
        return replace(
            self,
            reconciled=data if "reconcile" in steps else self.reconciled,
            prepared=data if "prepare" in steps else self.prepared,
            data_version=run.run_num if "prepare" in steps else self.data_version,
            models=run.models if "train" in steps else self.models,
        )

    @classmethod
    def from_record(cls, record: dict, tree: ExperimentTree) -> Sources:
        def data(prefix: str | None) -> DataTree | None:
            return tree.data(DataTree(prefix).version) if prefix else None

        return cls(
            raw=record["raw"],
            reconciled=data(record["reconciled"]),
            prepared=data(record["prepared"]),
            data_version=record["data_version"],
            models=record["models"],
        )


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
        except (NotFound, ValueError, UnicodeDecodeError):  # none yet, or cut short: not read
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
    return {
        "data_version": version,
        "data_snapshot_hash": snapshot,
        "id2label": read_labels(store, data.id2label),
    }


def check_reused_models(
    store: Store, tree: ExperimentTree, run_num: int, record: dict, model_names: list[str]
) -> tuple[DataTree | None, list[str]]:
    """The data version run `run_num`'s models were trained on, whose test split is the only
    one they may be tested on; and why not, naming the model, when their label maps differ."""
    version = record.get("data_version")
    where = f"run {run_label(run_num)}"
    if version is None:
        return None, [
            f"{where} records no data version for its models, so no test split is known to be "
            "theirs"
        ]
    data = tree.data(version)
    if not all(is_complete(store, data.split(s)) for s in SPLITS):
        return None, [
            f"{where}'s models were trained on data {run_label(version)}, which is no longer "
            f"complete at {store.uri_of(data.prepared)}"
        ]
    labels = read_labels(store, data.id2label)
    problems = []
    for model in model_names:
        own = read_labels(store, labels_of(record["model_artifacts"][model]))
        if own is not None and own != labels:
            problems.append(
                f"model {model!r} of {where} knows labels {sorted(own.values())}, but data "
                f"{run_label(version)} has {sorted((labels or {}).values())}: they cannot be "
                "compared"
            )
    return data, problems


def check_raw_data(settings: Settings, store: Store, tree: ExperimentTree) -> list[str]:
    """Where the settings say the raw data is, checked by content (pipeline/raw_data.py): a
    local folder holds data files and nothing the store would take for its own; the
    experiment's raw/ holds files and no unfinished upload."""
    raw = settings.raw_data_uri()
    if raw and "://" not in raw:
        return [f"[data] RAW_DATA: {problem}" for problem in folder_problems(Path(raw))]
    if not raw:
        if getattr(store, "unreached", False):  # a plan without the store: unknown, not empty
            return []
        if not stored_sizes(store, tree.raw):
            return [
                f"no raw data at {store.uri_of(tree.raw)} ([data] RAW_DATA is empty, so the "
                "experiment's raw/ folder is used)"
            ]
        unfinished = unfinished_upload(store, tree)
        return [unfinished] if unfinished else []
    # RAW_DATA in another bucket is checked by the job itself: it may need other credentials.
    return []


def encoded_otherwise(settings: Settings, store: Store, data: DataTree) -> str | None:
    """Why prepared data cannot be trained on with these settings, or None when it can: it
    was cut at another [data] MAX_SEQUENCE_LENGTH, or it encodes not every model (training
    would see rows cut otherwise than inference, or find no rows for a model)."""
    where = data.split("labels") + ENCODING
    try:
        record = parse_encoding(store.get_bytes(where), store.uri_of(where))
    except NotFound:
        return f"{store.uri_of(where)} is missing (the data predates the record of its encoding)"
    except ValueError as e:
        return str(e)
    wanted = settings.data.max_sequence_length
    if record["max_length"] != wanted:
        return (
            f"it was cut at {record['max_length']} tokens and [data] MAX_SEQUENCE_LENGTH "
            f"is {wanted}"
        )
    missing = [m for m in settings.models.model_names if m not in record.get("models", {})]
    if missing:
        return f"it encodes no rows for {', '.join(missing)}"
    return None


def steps_to_run(
    settings: Settings, store: Store, tree: ExperimentTree, steps: list[str]
) -> list[str]:
    """`steps`, with prepare added when training would reuse prepared data encoded otherwise
    than the settings say: the data is prepared again (or taken from the cache), never cut
    again or silently used as it is."""
    if "train" not in steps or "prepare" in steps:
        return steps
    version = newest_data(store, tree, "prepared")
    if version is None:
        return steps  # resolve_sources says what is missing
    why = encoded_otherwise(settings, store, tree.data(version))
    if why is None:
        return steps
    log.info(
        f"prepare runs: the newest prepared data, {run_label(version)}, cannot be reused: {why}"
    )
    at = steps.index("train")
    return [*steps[:at], "prepare", *steps[at:]]


def raw_read_by_jobs(settings: Settings, tree: ExperimentTree, digest: str) -> str:
    """Where the reconcile job reads the raw data: [data] RAW_DATA's URI as it is; a local
    RAW_DATA folder as it is where the jobs run on this machine (the local backend), and its raw
    version of content `digest` in the store where they run elsewhere; the experiment's raw/
    when RAW_DATA is empty. `smpipe iam` grants what this names (pipeline/iam/)."""
    raw = settings.raw_data_uri()
    if raw and "://" not in raw and settings.experiment.backend != "local":
        return tree.raw_version(digest).files
    return raw or tree.raw


def resolve_sources(
    settings: Settings, store: Store, tree: ExperimentTree, steps: list[str]
) -> Sources:
    """Decide where every step reads from, or say what is missing; writes nothing."""
    problems = []
    sources = Sources(raw=settings.raw_data_uri() or tree.raw)
    newest = f"{store.uri_of(tree.data_root)} holds no complete"
    # Where the settings say the raw data is: a problem of the settings (exit 2), said with
    # the rest.
    raw_problems = check_raw_data(settings, store, tree) if "reconcile" in steps else []
    local = settings.raw_data_uri() and "://" not in settings.raw_data_uri()
    elsewhere = settings.experiment.backend != "local"
    if "reconcile" in steps and local and elsewhere and not raw_problems:
        # Jobs that run elsewhere cannot read this machine's folder: they read its content
        # as a raw version of the store, which the run names (the local backend reads the
        # folder where it is).
        sources.local_raw = local_version(tree, Path(settings.raw_data_uri()))
        sources.raw = raw_read_by_jobs(settings, tree, sources.local_raw.version.digest)
        say_raw_version(store, sources.local_raw)
    if "prepare" in steps and "reconcile" not in steps:
        version = newest_data(store, tree, "reconciled")
        if version is None:
            problems.append(f"--steps skips reconcile, but {newest} reconciled snapshot")
        else:
            sources.reconciled = tree.data(version)
            sources.reused["reconciled"] = store.uri_of(sources.reconciled.reconciled)
    if {"train", "inference"} & set(steps) and "prepare" not in steps:
        version = newest_data(store, tree, "prepared")
        if version is None:
            problems.append(f"--steps skips prepare, but {newest} prepared data")
        else:
            sources.prepared = tree.data(version)
            sources.data_version = version
            sources.reused["prepared"] = store.uri_of(sources.prepared.prepared)
    if "inference" in steps and "train" not in steps:
        problems += reuse_models(settings, store, tree, steps, sources)
    if raw_problems:
        raise ConfigError([*raw_problems, *problems], settings.source)
    if problems:
        raise PipelineError("cannot start: " + "; ".join(problems))
    return sources


def say_raw_version(store: Store, raw: LocalRaw) -> None:
    version = raw.version
    named = f"raw version {version.digest[:12]} of {raw.folder}"
    if is_complete(store, version.prefix):
        log.info(f"raw data: {named}, in the store already: {store.uri_of(version.files)}")
    else:
        size = sum(c.size for c in raw.found.values())
        log.info(
            f"raw data: {named}, new: {counted(len(raw.files), 'file')} ({size:,} bytes) to "
            f"upload to {store.uri_of(version.files)} before the run starts"
        )


def reuse_models(
    settings: Settings, store: Store, tree: ExperimentTree, steps: list[str], sources: Sources
) -> list[str]:
    """An inference-only run tests the newest complete models, on the test split of the data
    they were trained on (`sources` pointed at both); or why it cannot."""
    names = settings.models.model_names
    found = newest_models(store, tree, names)
    if found is None:
        return [
            f"--steps skips train, but no earlier run of {settings.experiment.name!r} has "
            f"complete models for {', '.join(names)}"
        ]
    if "prepare" in steps:
        return [
            f"--steps prepares new data but skips train: run {run_label(found[0])}'s models "
            "would be tested on data they were not trained on; add train, or run inference on "
            "its own"
        ]
    # A model is tested only on the test split of the data version it was trained on.
    data, mismatched = check_reused_models(store, tree, *found, names)
    sources.models = tree.run(found[0]).models
    sources.reused["models"] = f"run {run_label(found[0])}"
    if data is not None:
        sources.prepared, sources.data_version = data, found[1]["data_version"]
        sources.reused["prepared"] = store.uri_of(data.prepared) + " (the models' own data)"
    return mismatched


def log_reused(sources: Sources) -> None:
    for what, where in sources.reused.items():
        log.info(f"reusing {what}: {where}")


RESUMABLE = ("failed", "interrupted", "abandoned")


# What a --resume may change: the shape of the training job, not what it trains. A checkpoint
# of one number of processes loads in another (steps/checkpointing.py `load_checkpoint`).
RESHAPING = tuple(
    f"[training] {key}"
    for key in ("PROCESSES_PER_HOST", "INSTANCE_COUNT", "USE_DISTRIBUTED", "INSTANCE_TYPE")
)


def resumed_run(
    settings: Settings, store: Store, tree: ExperimentTree, run_num: int, steps: list[str] | None
) -> tuple[RunTree, md.Metadata, list[str], Sources]:
    """Run `run_num` again where it stopped: its completed steps kept, the rest with the same
    sources, settings and code; training resumes from the run's checkpoints. `steps`: what
    --steps asked for (None: not given)."""
    run = tree.run(run_num)
    record = stopped_record(store, run)
    planned = record["planned_steps"]
    if steps is not None and steps != planned:
        raise Refused(
            f"--resume continues the steps run {run.label} planned ({','.join(planned)}); "
            "leave out --steps"
        )
    reshaped = check_settings(settings, store, run)
    check_code(settings, store, run)
    if reshaped:
        log.info(
            f"resuming run {run.label} on another job shape ({'; '.join(reshaped)}): training "
            "goes on from its checkpoints with the new number of processes"
        )
    steps_done = record.get("steps", {}).items()
    done = {name for name, section in steps_done if section.get("status") == "completed"}
    remaining = [s for s in planned if s not in done and not (s == "train" and "tune" in done)]
    if not remaining:
        raise Refused(f"--resume {run_num}: every step of run {run.label} completed already")
    sources = Sources.from_record(record["sources"], tree)
    if "reconcile" in remaining:
        check_raw(store, run, record, sources.raw)
    for step in ("reconcile", "prepare"):
        if step in planned and step in done:
            sources.reused[step] = f"completed by run {run.label}"
    if "reconcile" in done:
        sources.reconciled = tree.data(run_num)
    if "prepare" in done:
        sources.prepared, sources.data_version = tree.data(run_num), run_num
    check_models_whole(store, run, settings.models.model_names)
    if done & {"train", "tune"}:  # inference, left, tests the models this run trained
        sources.models = run.models
    else:
        tuned_there = settings.experiment.job == "tune" and settings.experiment.backend != "local"
        check_checkpoints(store, run, record, f"--resume {run_num}", tuned_there)
    keep = {k: v for k, v in record.items() if k in md.Metadata.model_fields and k != "steps"}
    resumed_at = [*record.get("resumed_at", []), md.iso(time.time())]
    again = {"status": "running", "failure_reason": None, "end_time": None}
    # The steps run again lose their sections, not what their jobs cost.
    again["billing_before_resume"] = [
        *record.get("billing_before_resume", []),
        *(b for n in remaining for b in record.get("steps", {}).get(n, {}).get("billing", [])),
    ]
    again["checkpoints_left"] = None  # counted again when it stops
    base = md.Metadata(**{**keep, **again, "resumed_at": resumed_at})
    log.info(f"resuming run {run.label} ({record['status']}): {', '.join(remaining)} left")
    return run, base, remaining, sources


def check_settings(settings: Settings, store: Store, run: RunTree) -> list[str]:
    """The settings' changes since the run started that only reshape its training job
    (RESHAPING); any other refuses the resume, naming each."""
    changed = settings_changes(store.get_bytes(run.settings).decode(), settings.applied_ini)
    reshaped = [c for c in changed if c.startswith(RESHAPING)]
    if len(reshaped) < len(changed):
        others = [c for c in changed if c not in reshaped]
        raise Refused(
            f"--resume {run.run_num}: the settings differ from the ones run {run.label} started "
            f"with ({'; '.join(others)}); resume with those, or start a new run (only "
            f"{', '.join(k.removeprefix('[training] ') for k in RESHAPING)} may change)"
        )
    return reshaped


def check_code(settings: Settings, store: Store, run: RunTree) -> None:
    """A resumed run runs the code it started with (its code/): user code edited since, a
    fix of what made it fail say, would not be applied, so the resume is refused naming
    the files, as changed settings are."""
    shipped = shipped_files(store, run.code)
    if shipped is None:  # no job started: the code is shipped when it resumes
        return
    shipped.pop(STEPS)
    gone = files_gone(store, run.code)
    if gone:  # the jobs would fail on every resume, naming a copy of it
        raise Refused(
            f"--resume {run.run_num}: the code run {run.label} started with lost files its "
            f"manifest lists ({store.uri_of(run.code)}: {', '.join(gone)}); put them back to "
            "resume, or start a new run"
        )
    differ = files_that_differ(shipped, user_files(settings), f"run {run.label}", "yours")
    if differ:
        raise Refused(
            f"--resume {run.run_num}: your code differs from the code run {run.label} started "
            f"with ({'; '.join(differ)}), and a resumed run runs the code it started with "
            f"({store.uri_of(run.code)}); put it back to resume, or start a new run, which "
            "reuses the data steps whose inputs did not change"
        )


def check_raw(store: Store, run: RunTree, record: dict, raw: str) -> None:
    """A resumed run's reconcile reads the raw data the run started with: a local folder the
    local backend reads in place, edited since (a fix of what made it fail, say), would be
    read as it is now and its snapshot cached under the key of what it was. The resume is
    refused, as edited code is."""
    from pipeline.cache import raw_digest

    started = ((record.get("data_steps") or {}).get("reconcile") or {}).get("inputs") or {}
    if not started.get("raw"):
        return  # not known when it started (raw data the driver cannot list)
    now = raw_digest(store, raw)
    if now is not None and now != started["raw"]:
        raise Refused(
            f"--resume {run.run_num}: the raw data at {raw} differs from what run {run.label} "
            "started with (its content digest), and a resumed run reads the data it started "
            "with; put it back to resume, or start a new run, which reconciles it anew"
        )


def check_models_whole(store: Store, run: RunTree, models: list[str]) -> None:
    """A model the run completed is taken as it is (a resume trains it no more): each file its
    manifest lists must still be there, else inference would fail on every resume, naming a
    copy of it. One gone (removed by hand, a lifecycle rule) refuses the resume, naming it."""
    problems = [
        f"{store.uri_of(prefix)} lacks {', '.join(gone)}"
        for prefix in (run.final_model(model) for model in models)
        if (gone := files_gone(store, prefix))
    ]
    if problems:
        raise Refused(
            f"--resume {run.run_num}: a model run {run.label} completed lost files its "
            f"manifest lists ({'; '.join(problems)}); put them back to resume, or start a new run"
        )


def check_checkpoints(
    store: Store, run: RunTree, record: dict, resume: str, tuned_on_sagemaker: bool = False
) -> None:
    """Training goes on from the checkpoints the run left: any that are gone since it stopped
    (removed by hand, or by a lifecycle rule) stop the resume, which would otherwise train
    those models from step 1 without a word; what each model starts from is said."""
    if tuned_on_sagemaker:
        # SageMaker restarts no trial (pipeline/backends/resuming.py): nothing to go on from.
        log.info(
            f"resuming run {run.label}: each tuning job not completed starts again, "
            "warm-started from the run's tuning jobs that ended where SageMaker still holds them"
        )
        return
    # A model trained whole before the run stopped is not trained again: its checkpoints wait.
    trained = ((record.get("steps") or {}).get("train") or {}).get("details") or {}
    done = set(trained.get("model_artifacts") or {})
    left = {f: n for f, n in (record.get("checkpoints_left") or {}).items() if f not in done}
    now = {f: n for f, n in checkpoint_files(store, run).items() if f not in done}
    gone = sorted(folder for folder, files in left.items() if files and not now.get(folder))
    if gone:
        raise Refused(
            f"{resume}: the checkpoints run {run.label} left are gone ({', '.join(gone)}, "
            f"under {store.uri_of(run.checkpoints_root)}): resuming would train from step 1; "
            "start a new run"
        )
    for folder, files in sorted(now.items()):
        log.info(
            f"resuming run {run.label}: {folder} goes on from its checkpoints "
            f"({counted(files, 'file')})"
        )


def stopped_record(store: Store, run: RunTree) -> dict:
    """The Metadata of a run that stopped without completing, which --resume may continue."""
    resume = f"--resume {run.run_num}"
    try:
        record = json.loads(store.get_bytes(run.metadata))
    except NotFound:
        runs = existing_run_nums(store, ExperimentTree(run.experiment))
        if run.run_num in runs:  # claimed, and no record yet
            why = never_started(store, run)
            raise Refused(
                f"{resume}: run {run.label} never started ({why}; it has no Metadata): nothing "
                "ran, so there is nothing to continue; a new run starts afresh"
                if why
                else f"{resume}: run {run.label} is starting (its driver is alive)"
            ) from None
        there = f"runs {run_label(runs[0])}-{run_label(runs[-1])}" if runs else "no runs yet"
        raise Refused(
            f"{resume}: no run {run.label} at {store.uri_of(run.prefix)} ({there})"
        ) from None
    if record.get("status") == "running":
        if silent_driver(store, run) is None:
            raise Refused(f"{resume}: run {run.label} is still running (its driver is alive)")
        record["status"] = "abandoned"
    if record.get("status") not in RESUMABLE:
        raise Refused(
            f"{resume}: run {run.label} is {record.get('status')}; only a "
            f"{', '.join(RESUMABLE)} run can be resumed"
        )
    if record.get("pruned"):
        raise Refused(
            f"{resume}: run {run.label} was pruned at {record['pruned'].get('time')} (its "
            "checkpoints and model weights are gone); start a new run"
        )
    if not record.get("planned_steps") or record.get("sources") is None:
        raise Refused(
            f"{resume}: run {run.label} was made by an older driver that did not record its plan"
        )
    return record


def clear_partial_outputs(store: Store, run: RunTree, jobs: list) -> None:
    """A resumed run runs its unfinished data and inference steps again. What their earlier
    attempt left of their outputs (a driver killed between one output's manifest and the
    next) is the run's own and was never a result: it is removed, and said, so the step can
    write its versioned outputs whole. Models are kept: a complete one is not trained again."""
    for job in jobs:
        if job.kind != "processing":
            continue
        if job.step == "export" and is_complete(store, job.outputs["model"]):
            continue  # a model, exported before: kept
        for prefix in job.outputs.values():
            keys = store.list_keys(prefix)
            if keys:
                for key in keys:
                    store.delete(key)
                where = store.uri_of(prefix)
                log.info(f"{job.step}: removed what its unfinished attempt left at {where}")
