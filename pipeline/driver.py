"""The driver: check everything, describe every job once, claim a run_num, run the stages on a
backend, record Metadata (`run_pipeline`).

    reconcile -> prepare (processing jobs) -> train | tune (training) -> inference (processing)

Everything that can be checked is checked before a run_num is claimed or anything is written.
The jobs are built once (pipeline/stages.py): `smpipe plan` prints the very objects the run
hands to the backend.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import nullcontext

from pipeline import cache, interrupts, registry
from pipeline import metadata as md
from pipeline.backend import Earlier, running_backend
from pipeline.backends.choose import hosts_refuse, make_backend
from pipeline.code_bundle import PROJECT_ROOT, ship_code
from pipeline.config import ConfigError, Settings
from pipeline.console import log_summary
from pipeline.errors import RESULT, PipelineError, log
from pipeline.interrupts import undisturbed, why_stopped
from pipeline.jobs import JobFailed
from pipeline.paths import ExperimentTree, RunTree
from pipeline.plan import check_requests, log_plan, prices_for
from pipeline.prune import remove_checkpoints
from pipeline.raw_data import raw_version_held, upload_version
from pipeline.runs import (
    checkpoint_files,
    claim_run_num,
    existing_run_nums,
    heartbeat,
    lease,
    mark_abandoned,
)
from pipeline.sources import (
    Sources,
    clear_partial_outputs,
    log_reused,
    resolve_sources,
    resumed_run,
    snapshot_hash,
    steps_to_run,
)
from pipeline.stages import (
    STAGES,
    STEPS,
    Job,
    RunContext,
    Stage,
    build_jobs,
    job_env,
)
from pipeline.store import Store, StoreError, is_complete
from pipeline.user_check import check_user_functions
from steps.runtime.secrets import secret_values


def parse_steps(text: str | None) -> list[str]:
    """--steps as the stages it names, in pipeline order; all of them when it is not given."""
    if not text:
        return list(STEPS)
    wanted = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in STEPS]
    if unknown or not wanted:
        raise PipelineError(
            f"--steps: unknown step(s) {unknown or wanted}; choose from {', '.join(STEPS)}"
        )
    return [s for s in STEPS if s in wanted]


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
    only the outermost caller needs another one (a test's SageMaker client, say).

    Checked before a run_num is claimed or anything is written: the settings, the user
    functions, the raw data, the earlier outputs a partial run reuses (pipeline/sources.py)
    and every request as SageMaker would check it (pipeline/plan.py). The user functions are
    checked in a process of their own (pipeline/user_check.py): nothing their import does
    reaches this process, and so none of the jobs it starts."""
    say_overrides(settings)
    reaches = check_user_functions(settings, steps)
    tree = ExperimentTree(settings.experiment.name)
    # A resumed run is held from the moment its record is read: no prune removes what it
    # resumes from meanwhile (pipeline/runs.py `lease`).
    held = lease(store, tree.run(resume), "resumed") if resume is not None else nullcontext()
    with held:
        data_steps: dict[str, cache.CacheEntry] = {}
        if resume is not None:
            asked = None if steps == list(STEPS) else steps
            run, base, steps, sources = resumed_run(settings, store, tree, resume, asked)
        else:
            run = tree.run("<next run_num>")
            steps, sources, data_steps = new_run(settings, store, tree, steps, reaches, use_cache)
        planned = build_jobs(settings, steps, run, sources)
        check_requests(planned, settings, store)
        if problems := hosts_refuse(settings, planned):
            raise ConfigError(problems, f"{settings.source}: what the backend's hosts cannot run")
        if dry_run:
            log_reused(sources)
            log_plan(planned, settings, store, show_requests, registry.STEP in steps)
            log.info("dry run: nothing was launched or written")
            return None
        mark_abandoned(store, tree)
        if resume is None:
            run, base = claim_run(settings, store, tree, steps, sources, data_steps)
        try:
            with heartbeat(store, run.heartbeat):
                return execute(
                    settings, store, run, base, steps, sources, echo or sys.stdout, make_backend
                )
        except KeyboardInterrupt as e:  # before execute's loop began: recorded here
            if base.status != "running":
                raise
            raise stopped_at_start(store, run, base, e) from None


def new_run(
    settings: Settings,
    store: Store,
    tree: ExperimentTree,
    steps: list[str],
    reaches: dict[str, tuple[str, str | None]],
    use_cache: bool,
) -> tuple[list[str], Sources, dict[str, cache.CacheEntry]]:
    """A new run's steps (the data steps the cache reuses left out), its sources, and the
    cache's word on each data step."""
    steps = registry.with_registration(settings, steps_to_run(settings, store, tree, steps))
    sources = resolve_sources(settings, store, tree, steps)
    data_steps = consult_cache(settings, store, tree, steps, sources, reaches, use_cache)
    skipped = {s for s, entry in data_steps.items() if entry.status in ("reused", "skipped")}
    return [s for s in steps if s not in skipped], sources, data_steps


def consult_cache(
    settings: Settings,
    store: Store,
    tree: ExperimentTree,
    steps: list[str],
    sources: Sources,
    reaches: dict[str, tuple[str, str | None]],
    use_cache: bool,
) -> dict[str, cache.CacheEntry]:
    """Each data step of `steps` reused (its sources pointed at the earlier output) or to be
    computed; prepare's output for these inputs makes reconcile unnecessary too. `reaches`:
    what each data step's user functions can reach (check_user_functions)."""
    placeholder = tree.run("<next run_num>")
    jobs = build_jobs(settings, steps, placeholder, sources)
    arguments = {j.step: j.arguments for j in jobs if j.kind == "processing"}
    snapshot = snapshot_hash(store, sources.reconciled) if sources.reconciled else None
    entries = cache.plan(store, tree, steps, sources.raw, snapshot, arguments, reaches, use_cache)
    prepare, reconcile = entries.get("prepare"), entries.get("reconcile")
    if prepare and prepare.status == "reused" and reconcile and reconcile.status != "reused":
        reconcile.status, reconcile.note = "skipped", "prepare's output for these inputs exists"
    for step, entry in entries.items():
        if entry.status != "reused":
            why = entry.note or "no earlier output from these inputs"
            log.info(f"{step} {'is not run' if entry.status == 'skipped' else 'runs'}: {why}")
            continue
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


def claim_run(
    settings: Settings,
    store: Store,
    tree: ExperimentTree,
    steps: list[str],
    sources: Sources,
    data_steps: dict[str, cache.CacheEntry],
) -> tuple[RunTree, md.Metadata]:
    """A new run_num, its settings and its first Metadata: written before anything is said
    (a closed stdout stops the run at its next line: pipeline/interrupts.py) and with stops
    held between the claim and the Metadata, so that no run is left claimed without one; a
    stop from then on is recorded. The raw version the run names is uploaded to the store
    first, and held until the run is claimed and names it, so that no prune removes it
    meanwhile (pipeline/prune.py raw_versions)."""
    code, packages = md.git_sha(PROJECT_ROOT), md.package_versions()  # the code that runs
    base = None
    try:
        with raw_version_held(store, sources.local_raw):
            if sources.local_raw is not None:
                upload_version(store, sources.local_raw)
            with interrupts.held() as came:
                run = tree.run(claim_run_num(store, tree))
                store.put_bytes(run.settings, settings.applied_ini.encode())
                base = md.Metadata(
                    run_id=f"{settings.experiment.name}/{run.label}",
                    model_version=run.run_num,
                    experiment_name=settings.experiment.name,
                    artifact_uri=store.uri_of(run.prefix),
                    backend=settings.experiment.backend,
                    start_time=md.iso(time.time()),
                    git_sha=code,
                    package_versions=packages,
                    settings=settings.applied_ini,
                    raw_path=sources.raw,  # a key of this store, or the user's URI or folder
                    planned_steps=steps,
                    sources=sources.record(),
                    data_steps={step: entry.record() for step, entry in data_steps.items()},
                )
                base.mask(secret_values({**os.environ, **job_env(settings)}))
                md.merge(store, run, base)
    except KeyboardInterrupt as e:
        if base is None:  # nothing claimed, or held out until the record was written
            raise
        raise stopped_at_start(store, run, base, e) from None
    if came:  # stopped as it was claimed: recorded as a stopped run is, resumable
        raise stopped_at_start(store, run, base, interrupts.stopped(came[0]))
    return run, base


def stopped_at_start(store: Store, run: RunTree, base: md.Metadata, stop: BaseException):
    """`stop`, once a run claimed but not yet in its loop (execute) is recorded as stopped, as
    the loop records a stop: interrupted, and resumable."""
    base.status, base.failure_reason = "interrupted", why_stopped(stop)
    base.end_time = md.iso(time.time())
    md.merge(store, run, base)
    said_stopped(run, stop)
    return stop


def said_stopped(run: RunTree, stop: BaseException) -> None:
    """A stopped run's last word: in the log, and on the stop, which `smpipe` says on stderr
    (the log's stdout may be what closed: pipeline/cli/__init__.py `interrupted`)."""
    resume = f"--resume {run.run_num} continues it"
    log.info(f"run {run.label} interrupted: its jobs were stopped and their logs kept; {resume}")
    stop.add_note(f"run {run.label}: {resume}")


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
    """Run each planned stage's jobs in order on the backend, then end the run: completed, or
    failed or interrupted with its jobs stopped and the reason recorded."""
    started = time.time()
    ctx = RunContext(settings, store, run, sources.with_outputs_of(steps, run), base, None)
    try:  # from its first line on: a stop or an error anywhere ends the run recorded
        planned = set_up(ctx, steps, sources)
        ctx.backend = make_backend(settings, store, run, echo)
        base.image = getattr(ctx.backend, "image_record", None)  # a test's may hold none
        with running_backend(ctx.backend):  # its jobs stopped before any ending is recorded
            if base.resumed_at:  # what its last driver left: jobs running, bills unread
                base.billing_before_resume += ctx.backend.resumed(earlier(store, run, base))
                base.unbilled_jobs = []
            for stage, stage_jobs in planned:
                stage.run(ctx, stage_jobs)
    except JobFailed as e:
        ended(ctx, started, "failed", str(e))
        where = store.uri_of(e.result.log_key) if e.result.log_key else "the backend"
        kept = e.result.kept_folder
        if kept:  # a local job's folder: this machine's, until the run completes or is pruned
            where += (
                f"; its folder is kept at {kept} until the run completes (--resume "
                f"{run.run_num}) or `smpipe prune` prunes it"
            )
        raise PipelineError(
            f"step '{e.step}' failed in job {e.result.name}: {e.result.failure_reason}. "
            f"The job's log is at {where}; run {run.label} is marked failed at "
            f"{store.uri_of(run.metadata)} and nothing from it is promoted."
        ) from None
    except KeyboardInterrupt as e:  # Ctrl-C, or another stop (pipeline/interrupts.py)
        with undisturbed():
            ended(ctx, started, "interrupted", why_stopped(e))
        said_stopped(run, e)
        raise
    except StoreError as e:  # the store refused a write (full, gone, denied): one paragraph
        said = ended_if_possible(ctx, started, e)
        raise PipelineError(f"run {run.label} failed: {e}. {said}") from None
    except BaseException as e:
        ended(ctx, started, "failed", f"{type(e).__name__}: {e}")
        raise
    record = ended(ctx, started, "completed", None)
    where = store.uri_of(run.prefix)
    if store.folder_of(run.prefix):  # the emulated bucket of a local STORE
        where += f" (on this machine: {store.folder_of(run.prefix)})"
    log_summary(record, where)
    write_run_report(store, run, settings.source)
    kept_small(settings, store, run)
    return record


def earlier(store: Store, run: RunTree, base: md.Metadata) -> Earlier:
    """What a resumed run's record says of the drivers before this one, for its backend."""
    sections = md.read_sections(store, run)
    began = md.seconds(base.start_time) if base.start_time else 0.0
    counted, pools = md.accounted_jobs(base, sections), md.accounted_pools(base, sections)
    return Earlier(began, base.unbilled_jobs, counted, pools)


def kept_small(settings: Settings, store: Store, run: RunTree) -> None:
    """After a completed run: [experiment] KEEP_RUNS prunes what runs before the newest N
    completed ones no longer need, then the run's size and the experiment's are said (nine
    runs of the 100-row sample held 3.4 GB, and nothing said so)."""
    from pipeline.history import human_bytes
    from pipeline.prune import prune_experiment

    keep = settings.experiment.keep_runs
    if keep:
        for line in prune_experiment(settings, store, keep, remove=True):
            log.info(f"KEEP_RUNS = {keep}: {line}")
    tree = ExperimentTree(settings.experiment.name)
    runs = existing_run_nums(store, tree)
    size = sum(store.list_sizes(run.prefix).values())
    everything = sum(store.list_sizes(tree.root).values())
    hint = (
        ""
        if keep
        else (
            f" (`smpipe prune {settings.source} --keep 2 --yes` keeps older runs' records and "
            "removes their weights and checkpoints; [experiment] KEEP_RUNS does it after each run)"
        )
    )
    log.info(
        f"run {run.label} holds {human_bytes(size)}; experiment {tree.experiment!r} holds "
        f"{human_bytes(everything)} in {len(runs)} runs{hint}"
    )


def say_overrides(settings: Settings) -> None:
    """What the file does not say (the run's settings.ini records it): the SMPIPE__ variables
    that changed it, and each per-model value an override of every model's gave way."""
    if settings.overrides:
        log.info(f"settings from {settings.source}, overridden by {', '.join(settings.overrides)}")
    for line in settings.given_way:
        log.info(line)


def set_up(ctx: RunContext, steps: list[str], sources: Sources) -> list[tuple[Stage, list[Job]]]:
    """The run said, its Metadata written, its stages' jobs built and printed, its code
    shipped."""
    settings, store, run, base = ctx.settings, ctx.store, ctx.run, ctx.base
    if not base.resumed_at:
        log.info(f"run {run.label} of {settings.experiment.name!r}: {store.uri_of(run.prefix)}")
    base.mask(secret_values({**os.environ, **job_env(settings)}))
    log_reused(sources)
    md.merge(store, run, base)
    base.data_version = ctx.sources.data_version
    if ctx.sources.prepared is not None and "prepare" not in steps:  # an earlier run's data
        base.data_snapshot_hash = snapshot_hash(store, ctx.sources.prepared)
    planned = [(s, s.jobs(settings, run, ctx.sources)) for s in STAGES if s.name in steps]
    jobs = [job for _, stage_jobs in planned for job in stage_jobs]
    if base.resumed_at:
        clear_partial_outputs(store, run, jobs)
    if settings.experiment.backend != "local":  # asked once, kept with the run
        base.prices = base.prices if base.resumed_at else prices_for(jobs, settings, store)
    log_plan(
        jobs, settings, store, registering=registry.STEP in steps, basis=base.prices, brief=True
    )
    if not is_complete(store, run.code):  # a resumed run runs the code it started with
        ship_code(settings, store, run.code)
    return planned


def ended(ctx: RunContext, started: float, status: str, reason: str | None) -> dict:
    """The run's final Metadata written once its backend is closed (`running_backend`); a
    completed run's checkpoints removed (it will not be resumed), a failed run's report drawn."""
    base = ctx.base
    with undisturbed():
        if status == "completed" and not ctx.settings.training.keep_checkpoints_after_run:
            base.checkpoints_removed_bytes = remove_checkpoints(ctx.store, ctx.run)
        elif status != "completed":
            base.checkpoints_left = checkpoint_files(ctx.store, ctx.run)
        now = time.time()
        # (None before a backend is made); each once, a resume's interrupted reading included
        more = getattr(ctx.backend, "unbilled", None) or []
        base.unbilled_jobs += [j for j in more if j not in base.unbilled_jobs]
        base.status, base.failure_reason = status, reason
        earlier = (base.time_taken or 0) if base.resumed_at else 0  # the parts before --resume
        base.end_time, base.time_taken = md.iso(now), round(earlier + now - started, 3)
        record = md.merge(ctx.store, ctx.run, base).model_dump()
    interrupts.outcome_recorded()  # what the run prints from now on is not worth a stop
    if status == "failed":
        write_run_report(ctx.store, ctx.run, ctx.settings.source)
    return record


def ended_if_possible(ctx: RunContext, started: float, error: StoreError) -> str:
    """Mark the run failed when the store still takes a small write; say what became of it."""
    resume = f"--resume {ctx.run.run_num} continues it"
    try:
        ended(ctx, started, "failed", str(error))
    except StoreError as e:
        return (
            f"It could not be marked failed either ({e}); the next run marks it abandoned once "
            f"its heartbeat stops, and {resume}."
        )
    return f"It is marked failed at {ctx.store.uri_of(ctx.run.metadata)}; {resume}."


def write_run_report(store: Store, run: RunTree, settings_file: str) -> None:
    """report.html of a run that ended, and experiment.html with it. Views of what is recorded:
    a failure to draw one is said, and changes nothing of the run."""
    from pipeline.report import where_to_open, write_experiment_page, write_report

    tree = ExperimentTree(run.experiment)
    try:
        key = write_report(store, tree, run.run_num)
        log.info(f"report: {where_to_open(store, key)}", extra=RESULT)
        page = write_experiment_page(store, tree)
    except Exception as e:  # noqa: BLE001 -- the run's outcome stands either way
        log.warning(f"the pages of run {run.label} could not be written: {type(e).__name__}: {e}")
        return
    # A page on this machine is opened where it lies; one in S3 is copied here by
    # `smpipe report`, with the run reports it links to.
    here = store.folder_of(page) or store.uri_of(page)
    if "://" in here:
        here = f"{here} (`smpipe report {settings_file}` copies it here)"
    log.info(f"every run: {here}", extra=RESULT)
