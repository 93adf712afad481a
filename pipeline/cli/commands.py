"""What each `smpipe` command does, once its arguments are parsed (parser.py): the settings and
store it opens, the work it asks of the pipeline, what it prints. Each returns the exit status;
the errors it raises are answered by main() (__init__.py). Tables are drawn with rich
(pipeline/tables.py); everything heavy is imported inside the command that needs it.
"""

from __future__ import annotations

import os
import shlex
import sys
from contextlib import contextmanager

from pipeline.interrupts import outcome_recorded, stop_on_signals


def open_experiment(
    path: str,
    backend: str | None = None,
    image: str | None = None,
    planning: bool = False,
    writing: bool = True,
):
    """The settings (environment overrides applied) and the store they name, checked.
    `planning`: a store that cannot be reached is said in a note, and the plan goes on as for
    an experiment with nothing in it yet (`smpipe plan` needs no AWS). Not `writing` (`runs`,
    `compare`, `registry`): a store this user may read and not write is theirs to list."""
    from pipeline.backends.choose import open_backend_store
    from pipeline.config import ConfigError, load_settings
    from pipeline.store import S3Store, Unreached

    if image is not None and not image.strip():  # `--image "$TAG"` with TAG unset, say
        raise ConfigError(
            [
                f"--image {image!r}: name the image every job runs in (`make image` builds "
                "smpipe:latest), or leave --image out to play the jobs as processes of this "
                "machine"
            ],
            path,
        )
    env = dict(os.environ)
    if backend:
        env["SMPIPE__EXPERIMENT__BACKEND"] = backend
    if image:
        env["SMPIPE__EMULATED__IMAGE"] = image
    settings = load_settings(path, env)
    # Said as the user gave them, not as the variables that carry them.
    given = {
        "SMPIPE__EXPERIMENT__BACKEND": backend and f"--backend {backend}",
        "SMPIPE__EMULATED__IMAGE": image and f"--image {image}",
    }
    named = tuple(given.get(v) or v for v in settings.overrides)
    settings = settings.model_copy(update={"overrides": named})
    if image and settings.experiment.backend != "emulated":
        raise ConfigError(
            [
                f"--image: jobs run in an image of your choosing on the emulated backend only "
                f"(BACKEND is {settings.experiment.backend})"
            ],
            settings.source,
        )
    store = open_backend_store(settings)
    if planning and isinstance(store, S3Store):
        unreached = store.problems(quick=True)
        if unreached:
            return settings, Unreached(store, "; ".join(unreached))
    unreachable = store.problems(writing)  # checked before anything is written
    if unreachable:
        raise ConfigError(unreachable, settings.source)
    return settings, store


@contextmanager
def displayed(verbose: bool, quiet: bool):
    """The driver's lines and every job's output through one display (live on a terminal,
    plain lines elsewhere); yields where the jobs' output goes: nowhere with --quiet (it stays
    in the job logs). The logger is put back as it was afterwards (main() may be called again
    in the same process)."""
    import logging

    from pipeline.console import Display
    from pipeline.errors import log

    display = Display(sys.stdout, verbose=verbose)
    before = (log.handlers, log.propagate, log.level)
    handler = display.handler()
    if quiet:  # what went wrong, and what the run produced (errors.RESULT)
        handler.addFilter(lambda r: r.levelno >= logging.WARNING or getattr(r, "result", False))
    log.handlers, log.propagate = [handler], False
    log.setLevel(logging.INFO)
    try:
        with open(os.devnull, "w") as devnull:
            yield devnull if quiet else display
    finally:
        display.close()
        log.handlers, log.propagate = before[0], before[1]
        log.setLevel(before[2])


def init_command(args) -> int:
    """A new project, and the commands that run it."""
    from pipeline.project import init_project

    name, files = init_project(args.folder)
    print(f"created project {name!r} in {args.folder}:")
    for path in files:
        print(f"  {path.as_posix()}")
    print("run its sample (MiniLM against a from-scratch baseline on 100 news items, here):")
    print(f"  cd {shlex.quote(str(args.folder))}")
    print("  smpipe run settings.ini")
    return 0


def run_command(args) -> int:
    from pipeline.driver import parse_steps, run_pipeline
    from pipeline.errors import log
    from pipeline.store import Unreached

    stop_on_signals()
    if args.dry_run:  # a plan records nothing: its output closed early ends it quietly
        outcome_recorded()
    settings, store = open_experiment(args.settings, args.backend, args.image, args.dry_run)
    steps = parse_steps(args.steps)
    with displayed(args.verbose, args.quiet) as echo:
        if isinstance(store, Unreached):
            log.warning(
                f"{store.why}: planned as for an experiment with nothing in it yet (no earlier "
                "data, runs or cache are read; the store is not needed to plan). `smpipe plan "
                f"{shlex.quote(args.settings)} --backend emulated --show-requests` shows the "
                "very requests offline"
            )
        run_pipeline(
            settings,
            store,
            steps,
            dry_run=args.dry_run,
            show_requests=args.show_requests,
            resume=args.resume,
            use_cache=not args.no_cache,
            echo=echo,
        )
    return 0


def upload_command(args) -> int:
    """Raw data is the user's: its data files (hidden ones are not data) are copied as they
    are, never mixed with other data nor written over, since earlier runs read raw/. A raw/
    that holds this very content (sizes and sha256) is left as it is; one that holds other
    content is refused, naming each file that differs (pipeline/raw_data.py). --if-empty
    asks for nothing more: a raw/ with data is compared all the same."""
    from pipeline.errors import counted
    from pipeline.paths import ExperimentTree
    from pipeline.raw_data import unfinished_upload, upload_raw

    stop_on_signals(once=False)  # SIGTERM, SIGHUP too: what was half sent is said
    settings, store = open_experiment(args.settings)
    tree = ExperimentTree(settings.experiment.name)
    try:
        uploaded = upload_raw(store, tree, args.folder)
    except KeyboardInterrupt:
        unfinished = unfinished_upload(store, tree)  # no run reads raw/ until it is finished
        print(f"interrupted: {unfinished or 'nothing was uploaded'}", file=sys.stderr)
        return 130
    if uploaded == 0:
        print(
            f"{store.uri_of(tree.raw)} holds this folder's content already (the same files, "
            "sizes and sha256)"
        )
    else:
        print(
            f"uploaded {counted(uploaded, 'file')} from {args.folder} to {store.uri_of(tree.raw)}"
        )
    if settings.raw_data_uri():  # the upload stands, and no run of these settings reads it
        print(
            f"warning: [data] RAW_DATA = {settings.data.raw_data} in {args.settings}: runs read "
            f"that, not {store.uri_of(tree.raw)}; empty RAW_DATA to run on what was uploaded",
            file=sys.stderr,
        )
    return 0


def runs_command(args) -> int:
    from pipeline.history import run_rows
    from pipeline.paths import ExperimentTree
    from pipeline.tables import console, fit, runs_table

    settings, store = open_experiment(args.settings, writing=False)
    rows = run_rows(store, ExperimentTree(settings.experiment.name))
    what = f"runs of {settings.experiment.name!r} in {store.uri}"
    shown = console()
    shown.print(fit(shown, runs_table(what, rows)) if rows else f"no {what}")
    return 0


def compare_command(args) -> int:
    from pipeline import tables
    from pipeline.history import compare_runs
    from pipeline.paths import ExperimentTree

    settings, store = open_experiment(args.settings, writing=False)
    result = compare_runs(store, ExperimentTree(settings.experiment.name), args.first, args.second)
    a, b = result["runs"]
    console = tables.console()
    for table in tables.comparison_tables(result):
        console.print(tables.fit(console, table))
    for run, models in result["only_in"].items():
        if models and result["comparable"]:
            console.print(f"only run {run} tested {', '.join(models)}")
    for what, differ, lines in (
        ("settings", "settings that differ", result["settings"]),
        ("user code", "files of their code/ that differ", result["code"]),
    ):
        if isinstance(lines, str):  # why the code cannot be compared
            console.print(lines)
        elif lines:
            console.print(f"{differ} (run {a} -> run {b}):")
            console.print("\n".join(f"  {line}" for line in lines))
        else:
            console.print(f"runs {a} and {b} ran with the same {what}")
    if not result["comparable"]:
        print(
            f"error: not comparing the metrics of runs {a} and {b}: {result['why']}",
            file=sys.stderr,
        )
        return 1
    return 0


def registry_command(args) -> int:
    from pipeline.registry import versions
    from pipeline.tables import console, fit, versions_table

    settings, store = open_experiment(args.settings, backend=args.backend, writing=False)
    group = settings.registry.model_package_group
    rows = versions(settings, store)
    if not rows:
        backend = settings.experiment.backend
        others = " or ".join(b for b in ("local", "sagemaker", "emulated") if b != backend)
        console().print(
            f"no versions of model package group {group!r} in the {backend} backend's registry "
            f"yet (each backend keeps its own: --backend {others} lists another's)"
        )
        return 0
    title = f"model package group {group!r} ({settings.experiment.backend})"
    shown = console()
    shown.print(fit(shown, versions_table(title, rows)))
    return 0


def approve_command(args) -> int:
    from pipeline.registry import APPROVED, REJECTED, set_status

    settings, store = open_experiment(args.settings, backend=args.backend)
    row = set_status(settings, store, args.version, REJECTED if args.reject else APPROVED)
    group = settings.registry.model_package_group
    already = "" if row["changed"] else "already "
    said = f"{already}{row['approval_status']}: {row['description']}"
    print(f"version {row['version']} of model package group {group!r} is {said}")
    return 0


def report_command(args) -> int:
    """experiment.html, every run, or with a run number that run's report.html: written again
    from the store and said where a browser opens it."""
    from pipeline.history import HistoryError
    from pipeline.paths import ExperimentTree, run_label
    from pipeline.report import where_to_open, write_experiment_page, write_report
    from pipeline.runs import existing_run_nums

    settings, store = open_experiment(args.settings)
    tree = ExperimentTree(settings.experiment.name)
    runs = existing_run_nums(store, tree)
    if not runs:  # nothing to show, and nothing written into an experiment that has no run
        raise HistoryError(f"no runs of {settings.experiment.name!r} in {store.uri} yet")
    if args.run_num is None:
        key = write_experiment_page(store, tree)
        reports = [tree.run(n).report_html for n in runs if store.exists(tree.run(n).report_html)]
        print(f"every run of {settings.experiment.name!r}: {where_to_open(store, key, reports)}")
        return 0
    if args.run_num not in runs:
        raise HistoryError(
            f"no run {args.run_num:04d} of {settings.experiment.name!r} in {store.uri} "
            f"(runs {run_label(runs[0])}-{run_label(runs[-1])})"
        )
    key = write_report(store, tree, args.run_num)
    print(f"report of run {args.run_num:04d}: {where_to_open(store, key)}")
    return 0


def prune_command(args) -> int:
    """What would go (or goes, with --yes), run by run, and the bytes it frees; what is kept
    because something still reads it, and why."""
    from pipeline.prune import prune_experiment

    stop_on_signals(once=False)  # SIGTERM, SIGHUP too: a run half pruned is said
    settings, store = open_experiment(args.settings)
    print("\n".join(prune_experiment(settings, store, args.keep, remove=args.yes)))
    return 0


def iam_command(args) -> int:
    """Both policies, each under a heading (pipeline/iam/); AWS is asked only for the store
    bucket's default encryption, and only where credentials are at hand."""
    from pipeline.config import load_settings
    from pipeline.iam import policies_text

    print(policies_text(load_settings(args.settings)))
    return 0


def predict_command(args) -> int:
    """The job's lines and the driver's through the display, as `run` shows them."""
    from pipeline.predict import predict

    stop_on_signals()
    settings, store = open_experiment(args.settings, args.backend, args.image)
    with displayed(args.verbose, args.quiet) as echo:
        record = predict(
            settings,
            store,
            args.input,
            args.output,
            run_num=args.run,
            model=args.model,
            instance_count=args.instance_count,
            echo=echo,
            raw=args.raw,
        )
    if args.quiet:
        print(f"{record['predicted']:,} of {record['rows']:,} rows predicted: {record['output']}")
    return 0 if record["predicted"] else 1  # no row predicted: OUTPUT's `error` says why


# `plan` is `run --dry-run` (parser.py sets dry_run).
COMMANDS = {
    "init": init_command,
    "run": run_command,
    "plan": run_command,
    "upload": upload_command,
    "runs": runs_command,
    "compare": compare_command,
    "registry": registry_command,
    "approve": approve_command,
    "report": report_command,
    "prune": prune_command,
    "iam": iam_command,
    "predict": predict_command,
}
