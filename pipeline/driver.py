"""The driver: validate, plan, claim a run_num, run the steps on a backend, record Metadata.

    reconcile (processing) -> prepare (processing) -> train | tune (training) -> inference (processing)

Everything that can be checked is checked before a run_num is claimed or anything is written:
the settings, the user functions, the raw data, and the earlier outputs a partial run reuses.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import metadata as md
from pipeline.config import Settings
from pipeline.jobs import JobFailed, JobResult, ProcessingJob, job_name, make_training_job
from pipeline.paths import DataTree, ExperimentTree, RunTree, run_label
from pipeline.runs import claim_run_num, existing_run_nums
from pipeline.store import NotFound, Store, is_complete, key_of
from steps.user_code import load_user_functions

# What the driver tells the user; run_pipeline.py sends it to the terminal. Job output
# streams separately, through the backend's `echo`.
log = logging.getLogger("smpipe")

STEPS = ("reconcile", "prepare", "train", "inference")
SPLITS = ("train", "validation", "test", "labels")


class PipelineError(RuntimeError):
    """A step failed or a run cannot start; the message is one paragraph for the user."""


@dataclass
class Sources:
    """Where each step reads from: this run's outputs or an earlier run's, named up front."""

    raw: str  # store prefix or URI
    reconciled: DataTree | None = None  # the data version whose snapshot prepare reads
    prepared: DataTree | None = None  # the data version whose splits train and inference read
    data_version: int | None = None
    models: dict[str, str] = field(default_factory=dict)  # model -> prefix of its model dir
    reused: dict[str, str] = field(default_factory=dict)  # what was taken from earlier runs


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
) -> tuple[int, dict[str, str]] | None:
    """The newest run that left a complete model for every name."""
    for run_num in reversed(existing_run_nums(store, tree)):
        run = tree.run(run_num)
        try:
            record = json.loads(store.get_bytes(run.metadata))
        except NotFound:
            continue
        artifacts = {
            m: key_of(store, uri) for m, uri in (record.get("model_artifacts") or {}).items()
        }
        if all(artifacts.get(m) and is_complete(store, artifacts[m]) for m in model_names):
            return run_num, {m: artifacts[m] for m in model_names}
    return None


def resolve_sources(
    settings: Settings, store: Store, tree: ExperimentTree, steps: list[str]
) -> Sources:
    """Decide where every step reads from, or say what is missing; writes nothing."""
    problems = []
    raw = settings.raw_data_uri() or tree.raw
    sources = Sources(raw=raw)
    if "reconcile" in steps:
        # RAW_DATA in another bucket is checked by the job itself: it may need other credentials.
        local_raw = settings.raw_data_uri() and "://" not in settings.raw_data_uri()
        if local_raw and not any(p.is_file() for p in Path(raw).rglob("*")):
            problems.append(f"[data] RAW_DATA: {raw} is not a folder with files in it")
        elif not settings.data.raw_data and not store.list_keys(tree.raw):
            problems.append(
                f"no raw data at {store.uri_of(tree.raw)} ([data] RAW_DATA is empty, so the experiment's raw/ folder is used)"
            )
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
        else:
            sources.models = found[1]
            sources.reused["models"] = f"run {run_label(found[0])}"
    if problems:
        raise PipelineError("cannot start: " + "; ".join(problems))
    return sources


def plan(
    settings: Settings,
    steps: list[str],
    run: RunTree | None,
    sources: Sources,
    tree: ExperimentTree,
) -> list[dict]:
    """The jobs a run would launch, with their inputs and outputs, for --dry-run and the log."""
    run = run or tree.run("<next run_num>")
    data = tree.data(run_label(run.run_num) if run.run_num else "<next run_num>")
    reconciled = sources.reconciled or data
    prepared = sources.prepared or data
    rows = []
    if "reconcile" in steps:
        rows.append(
            {
                "step": "reconcile",
                "kind": "processing",
                "inputs": [sources.raw],
                "outputs": [data.reconciled],
            }
        )
    if "prepare" in steps:
        rows.append({"step": "prepare", "kind": "processing", "inputs": [reconciled.reconciled],
                     "outputs": [data.split(s) for s in SPLITS]})  # fmt: skip
    if "train" in steps:
        tuning = settings.experiment.job == "tune"
        for m in settings.models.model_names:
            rows.append({"step": "train", "kind": "tuning" if tuning else "training", "model": m,
                         "inputs": [prepared.split(s) for s in ("train", "validation", "labels")],
                         "outputs": [run.tuning(m) if tuning else run.model(m), run.checkpoints(m)]})  # fmt: skip
    if "inference" in steps:
        models = sources.models or {m: run.model(m) + "model/" for m in settings.models.model_names}
        rows.append({"step": "inference", "kind": "processing", "inputs": [prepared.split("test"), *models.values()],
                     "outputs": [run.inference]})  # fmt: skip
    return rows


def log_plan(rows: list[dict], settings: Settings, store_uri: str) -> None:
    log.info(
        f"plan for experiment {settings.experiment.name!r} on the {settings.experiment.backend} backend, store {store_uri}:"
    )
    for i, row in enumerate(rows, 1):
        model = f" [{row['model']}]" if "model" in row else ""
        log.info(f"  {i}. {row['step']}{model} ({row['kind']} job)")
        for key in ("inputs", "outputs"):
            for path in row[key]:
                log.info(f"       {key[:-1]:6} {path}")


def make_backend(settings: Settings, store: Store, run: RunTree, echo):
    if settings.experiment.backend == "local":
        from pipeline.local_backend import LocalBackend

        return LocalBackend(store, run.logs, python_path=[settings.base_dir], echo=echo)
    from pipeline.sagemaker_backend import SageMakerBackend

    return SageMakerBackend(settings, store, run, echo=echo)


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


def run_pipeline(
    settings: Settings,
    store: Store,
    steps: list[str],
    dry_run: bool = False,
    echo=None,
    make_backend=make_backend,
) -> dict | None:
    """Run the pipeline; return the merged Metadata as a dict (None for a dry run).

    `make_backend(settings, store, run, echo)` builds the backend once the run is claimed;
    only the outermost caller needs another one (a test's SageMaker session, say)."""
    echo = echo or sys.stdout
    load_user_functions(settings.experiment.user_functions, settings.base_dir)
    tree = ExperimentTree(settings.experiment.name)
    sources = resolve_sources(settings, store, tree, steps)
    if dry_run:
        log_plan(plan(settings, steps, None, sources, tree), settings, store.uri)
        log.info("dry run: nothing was launched or written")
        return None

    run_num = claim_run_num(store, tree)
    run = tree.run(run_num)
    started = time.time()
    log.info(
        f"run {run_label(run_num)} of {settings.experiment.name!r}: {store.uri_of(run.prefix)}"
    )
    store.put_bytes(run.settings, settings.applied_ini.encode())
    base = md.Metadata(
        run_id=f"{settings.experiment.name}/{run_label(run_num)}",
        model_version=run_num,
        experiment_name=settings.experiment.name,
        artifact_uri=store.uri_of(run.prefix),
        backend=settings.experiment.backend,
        start_time=md.iso(started),
        git_sha=md.git_sha(Path(__file__).resolve().parent.parent),  # the code that ran
        package_versions=md.package_versions(),
        settings=settings.applied_ini,
        raw_path=sources.raw if settings.raw_data_uri() else store.uri_of(sources.raw),
    )
    for step in sources.reused:
        log.info(f"reusing {step}: {sources.reused[step]}")
    md.merge(store, run, base)
    log_plan(plan(settings, steps, run, sources, tree), settings, store.uri)
    backend = make_backend(settings, store, run, echo)
    env = {"SMPIPE_USER_FUNCTIONS": settings.experiment.user_functions}
    data = tree.data(run_num)
    try:
        if "reconcile" in steps:
            job = ProcessingJob(
                name=job_name(settings.experiment.name, run_label(run_num), "reconcile"),
                step="reconcile",
                inputs={"raw": sources.raw},
                outputs={"snapshot": data.reconciled, "report": run.report("reconcile")},
                env=env,
                instance_type=settings.data.instance_type,
            )
            _run_step(store, run, "reconcile", [backend.run_processing(job)], lambda: {
                **_report(store, run.report("reconcile")), "raw_path": base.raw_path,
                "snapshot": store.uri_of(data.reconciled)})  # fmt: skip
            sources.reconciled = data
        if sources.reconciled:
            snapshot = json.loads(store.get_bytes(sources.reconciled.snapshot_info))
            base.data_snapshot_hash = snapshot["snapshot_hash"]
        if "prepare" in steps:
            t, d = settings.training, settings.data
            job = ProcessingJob(
                name=job_name(settings.experiment.name, run_label(run_num), "prepare"),
                step="prepare",
                inputs={"snapshot": sources.reconciled.reconciled},
                outputs={
                    **{s: data.split(s) for s in SPLITS},
                    "report": run.report("prepare"),
                },
                arguments=[
                    "--model-names",
                    ",".join(settings.models.model_names),
                    "--max-length",
                    str(t.max_sequence_length),
                    "--train-fraction",
                    str(d.train_fraction),
                    "--validation-fraction",
                    str(d.validation_fraction),
                    "--test-fraction",
                    str(d.test_fraction),
                    "--seed",
                    str(d.seed),
                ],  # fmt: skip
                env=env,
                instance_type=settings.data.instance_type,
            )
            _run_step(
                store,
                run,
                "prepare",
                [backend.run_processing(job)],
                lambda: _report(store, run.report("prepare")),
            )
            sources.prepared, sources.data_version = data, run_num
        base.data_version = sources.data_version
        md.merge(store, run, base)

        if "train" in steps:
            step = "tune" if settings.experiment.job == "tune" else "train"
            sources.models = _train(settings, store, run, backend, sources, env, step)
        if "inference" in steps:
            names = settings.models.model_names
            job = ProcessingJob(
                name=job_name(settings.experiment.name, run_label(run_num), "inference"),
                step="inference",
                inputs={
                    "test": sources.prepared.split("test"),
                    "labels": sources.prepared.split("labels"),
                    **{f"model_{m}": sources.models[m] for m in names},
                },  # fmt: skip
                outputs={"results": run.inference, "report": run.report("inference")},
                arguments=[
                    "--model-names",
                    ",".join(names),
                    "--batch-size",
                    str(settings.inference.batch_size),
                ],
                env=env,
                instance_type=settings.inference.instance_type,
            )
            _run_step(store, run, "inference", [backend.run_processing(job)], lambda: {
                **_report(store, run.report("inference")), "results": store.uri_of(run.inference),
                "models": {m: store.uri_of(p) for m, p in sources.models.items()}})  # fmt: skip
    except JobFailed as e:
        _finish(store, run, base, started, "failed", str(e))
        raise PipelineError(
            f"step '{e.step}' failed in job {e.result.name}: {e.result.failure_reason}. "
            f"The job's log is at {store.uri_of(e.result.log_key) if e.result.log_key else 'the backend'}; "
            f"run {run_label(run_num)} is marked failed at {store.uri_of(run.metadata)} and nothing from it is promoted."
        ) from None
    except BaseException as e:
        _finish(store, run, base, started, "failed", f"{type(e).__name__}: {e}")
        raise
    record = _finish(store, run, base, started, "completed", None)
    backend.close(succeeded=True)
    log_summary(record, store.uri_of(run.prefix))
    return record


def _run_step(store: Store, run: RunTree, step: str, results: list[JobResult], details) -> None:
    ok = all(r.status == "Completed" for r in results)
    md.write_section(store, run, _section(step, results, details() if ok else {}))
    for r in results:
        if r.status != "Completed":
            raise JobFailed(r, step)


def _train(
    settings: Settings, store: Store, run: RunTree, backend, sources: Sources, env: dict, step: str
) -> dict[str, str]:
    """One training job per model, or one tuning job per model; returns model -> model dir."""
    results, details, models = [], {"models": {}, "model_artifacts": {}}, {}
    channels = {c: sources.prepared.split(c) for c in ("train", "validation", "labels")}
    for model_name in settings.models.model_names:
        if step == "tune":
            from pipeline.tuning import run_tuning

            outcome = run_tuning(settings, store, run, backend, model_name, channels, env)
            results.extend(outcome.results)
            if outcome.best is None:
                md.write_section(store, run, _section(step, results, {}))
                raise JobFailed(outcome.results[-1], step)
            details["models"][model_name] = outcome.details
            models[model_name] = outcome.best_model_prefix
        else:
            job = make_training_job(settings, run, model_name, kind="training", prefix=run.model(model_name),
                                    checkpoint_prefix=run.checkpoints(model_name), channels=channels, env=env)  # fmt: skip
            result = backend.run_training(job)
            results.append(result)
            if result.status != "Completed":
                md.write_section(store, run, _section(step, results, details))
                raise JobFailed(result, step)
            details["models"][model_name] = _report(store, job.output_prefix)
            models[model_name] = job.model_prefix
        details["model_artifacts"][model_name] = store.uri_of(models[model_name])
        md.write_section(store, run, _section(step, results, details, status="running"))
    md.write_section(store, run, _section(step, results, details))
    return models


def _finish(
    store: Store, run: RunTree, base: md.Metadata, started: float, status: str, reason: str | None
) -> dict:
    ended = time.time()
    base.status, base.failure_reason = status, reason
    base.end_time, base.time_taken = md.iso(ended), round(ended - started, 3)
    record = md.merge(store, run, base)
    return record.model_dump()


def log_summary(record: dict, run_uri: str) -> None:
    performance = record.get("holdout_performance") or {}
    if performance:
        log.info("\ntest-set performance")
        log.info(f"  {'model':<16}{'accuracy':>10}{'macro F1':>10}{'weighted F1':>13}{'rows':>7}")
        for name, p in sorted(performance.items(), key=lambda kv: -kv[1]["macro_f1"]):
            log.info(
                f"  {name:<16}{p['accuracy']:>10.4f}{p['macro_f1']:>10.4f}{p['weighted_f1']:>13.4f}{p['rows']:>7}"
            )
        comparison = record["steps"].get("inference", {}).get("details", {}).get("comparison")
        for pair in (comparison or {}).get("pairs", []):
            m = pair["mcnemar"]
            verdict = "significant" if m["significant_at_0.05"] else "not significant"
            log.info(
                f"  {pair['models'][0]} vs {pair['models'][1]}: McNemar p={m['p_value']:.3g} ({verdict} at 0.05)"
            )
    log.info(
        f"\nrun {run_label(record['model_version'])} {record['status']} in {record['time_taken']:.0f}s: {run_uri}"
    )
