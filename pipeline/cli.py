"""`smpipe`: the command line. `python run_pipeline.py settings.ini` is `smpipe run settings.ini`.

argparse, as Accelerate's and transformers' own command lines: no dependency, and `--help`
answers before anything heavy is imported. Tables are drawn with rich (pipeline/tables.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

EXAMPLES = """\
examples:
  smpipe init my-project                         a new project that runs as it is; then:
  cd my-project && smpipe run settings.ini       its sample, on this machine
  smpipe upload settings.ini ./raw_data          copy raw data into the experiment's raw/
  smpipe run settings.ini                        reconcile, prepare, train, test: a new run
  smpipe run settings.ini --steps train,inference   reuse the newest data
  smpipe run settings.ini --resume 3             continue run 3 where it stopped
  smpipe plan settings.ini --show-requests       the jobs (and SageMaker requests), nothing run
  smpipe runs settings.ini                       the experiment's runs
  smpipe compare settings.ini 3 5                two runs side by side
  smpipe report settings.ini                     every run on one page (experiment.html)
  smpipe report settings.ini 5                   rebuild run 5's report.html
  smpipe prune settings.ini --keep 3 --yes       remove old runs' bulky files; 3 completed stay
  smpipe predict settings.ini new.csv out.csv    label new texts with the newest run's winner
  smpipe predict settings.ini new/ out.csv --raw   new raw data, through the run's reconcile
  smpipe registry settings.ini                   the registered versions of [registry]'s group
  smpipe approve settings.ini 4 [--reject]       approve (or reject) version 4
  smpipe iam settings.ini                        the IAM policies a SageMaker run needs
"""


def _interrupt(signum, _frame):
    # SIGTERM ends the run the way Ctrl-C does: jobs stopped, the run marked interrupted.
    raise KeyboardInterrupt(f"signal {signum}")


def run_number(text: str) -> int:
    """A run_num as the run tree numbers them: 1 and up (0001 is 1)."""
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a run number (1, 2, ...; 0003 is 3)")
    return number


def version_number(text: str) -> int:
    """A model package version, as the registry numbers them: 1 and up."""
    number = int(text) if text.isdigit() else 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a version (1, 2, ...)")
    return number


def at_least_one(text: str) -> int:
    """--keep: how many completed runs stay whole; 0 would leave no model at all."""
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: keep at least 1 completed run (the newest N completed runs, and every "
            "run after them, are left whole)"
        )
    return number


class ShowVersion(argparse.Action):
    """--version: the installed package's version, looked up only when asked (importlib's
    metadata costs as much as all of `smpipe --help`: docs/performance.md)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import version

        print(f"smpipe {version('smpipe')}")
        parser.exit()


def image_option(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--image",
        metavar="TAG",
        help="overrides [emulated] IMAGE: the emulated backend runs every job in this image "
        "(`make image` builds smpipe:latest), a container per host, as SageMaker does",
    )


def run_options(sub: argparse.ArgumentParser) -> None:
    """The options `run` and `plan` share: what a run would do is what it does."""
    sub.add_argument(
        "--backend",
        choices=["local", "sagemaker", "emulated"],
        help="overrides [experiment] BACKEND; emulated: SageMaker's requests sent to an "
        "embedded moto and every job played on this machine",
    )
    image_option(sub)
    sub.add_argument(
        "--steps",
        help="comma-separated subset of reconcile,prepare,train,inference; skipped steps "
        "reuse the newest complete outputs of the experiment",
    )
    sub.add_argument(
        "--no-cache",
        action="store_true",
        help="compute reconcile and prepare even when an earlier run computed them from "
        "the same inputs (raw data, user functions, settings, code)",
    )
    sub.add_argument(
        "--resume",
        type=run_number,
        metavar="RUN_NUM",
        help="continue a failed, interrupted or abandoned run in place: its completed "
        "steps are kept and training resumes from its checkpoints",
    )
    sub.add_argument(
        "--show-requests",
        action="store_true",
        help="also print the SageMaker request each job becomes",
    )


def loudness(run: argparse.ArgumentParser) -> None:
    """How much of the jobs' output `run` shows."""
    loud = run.add_mutually_exclusive_group()
    loud.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="only what went wrong and the summary; job output stays in the job logs",
    )
    loud.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="every line of every job, library warnings included",
    )


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="smpipe",
        description="Finetune and compare text classifiers on SageMaker (or here) from one "
        "settings.ini.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    root.add_argument("--version", action=ShowVersion, help="print smpipe's version and exit")
    commands = root.add_subparsers(dest="command", required=True, metavar="COMMAND")
    init_options(commands)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name,
            help=text,
            description=text,
            epilog=EXAMPLES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.add_argument("settings", help="the settings.ini of the experiment")
        return sub

    run = command("run", "run the pipeline: a new run_num, or --resume one")
    plan = command(
        "plan", "print the jobs a run would launch, their inputs and outputs; launch nothing"
    )
    for sub in (run, plan):
        run_options(sub)
    run.add_argument("--dry-run", action="store_true", help="the same as `smpipe plan`")
    loudness(run)
    plan.set_defaults(dry_run=True, quiet=False, verbose=False)  # what `plan` is: `run --dry-run`
    upload = command("upload", "copy a folder of raw data into the experiment's raw/ in the store")
    upload.add_argument("folder", type=Path, help="the raw data: a folder on this machine")
    upload.add_argument(
        "--if-empty",
        action="store_true",
        help="kept for scripts: a raw/ that holds this folder's content is left as it is, "
        "and one that holds other content is refused, with or without it",
    )
    command("runs", "list the experiment's runs: status, models, test macro-F1, data, duration")
    compare = command(
        "compare", "two runs side by side: metrics, per-label F1, settings that differ"
    )
    compare.add_argument("first", type=run_number, metavar="RUN_NUM")
    compare.add_argument("second", type=run_number, metavar="RUN_NUM")
    command("registry", "list the versions of [registry] MODEL_PACKAGE_GROUP: status, run, model")
    approve = command(
        "approve", "approve a registered version (SageMaker's ModelApprovalStatus Approved)"
    )
    approve.add_argument("version", type=version_number, metavar="VERSION")
    approve.add_argument("--reject", action="store_true", help="set it Rejected instead")
    report = command(
        "report", "rebuild experiment.html (every run), or with RUN_NUM that run's report.html"
    )
    report.add_argument("run_num", type=run_number, nargs="?", metavar="RUN_NUM")
    prune_options(command("prune", PRUNE))
    command("iam", IAM)  # pipeline/iam.py
    predict_options(command("predict", PREDICT))
    return root


def init_options(commands) -> None:
    """`smpipe init DIR`: pipeline/project.py. No settings.ini: it makes one."""
    init = commands.add_parser(
        "init",
        help="start a project: settings.ini, the five user functions and a sample they run on",
        description="Create DIR (or fill it, if empty) with a project that runs as it is: "
        "settings.ini, every key commented; user_functions/ with the five functions, TODO where "
        "your data differs; data/ with a small sample. Nothing is ever overwritten.",
    )
    init.add_argument("folder", type=Path, metavar="DIR", help="a new or empty folder")


PRUNE = (
    "remove the bulky files (checkpoints, model weights and exports, tuning trials) of the "
    "runs before the newest N completed ones; their Metadata, settings, logs, metrics and "
    "reports stay, and data versions are never touched. A dry run unless --yes"
)


def prune_options(prune: argparse.ArgumentParser) -> None:
    """`smpipe prune settings.ini --keep N [--yes]`: pipeline/prune.py."""
    prune.add_argument(
        "--keep", type=at_least_one, required=True, metavar="N", help="completed runs kept whole"
    )
    prune.add_argument("--yes", action="store_true", help="remove them (default: only say what)")


PREDICT = (
    "label new texts with a run's exported model (the newest completed run's winner by test "
    "macro-F1 unless --run and --model say), in a processing job on the configured backend"
)


def predict_options(predict: argparse.ArgumentParser) -> None:
    """`smpipe predict settings.ini INPUT OUTPUT`: pipeline/predict/."""
    predict.add_argument(
        "input",
        type=Path,
        help="the texts: .csv, .tsv, .jsonl (.json, .ndjson), .parquet with the text column(s) "
        "of the run's data and an optional id column, or a folder of .txt files (one text each)",
    )
    predict.add_argument(
        "output",
        type=Path,
        help="the predictions, in the format its suffix names (.csv, .tsv, .jsonl, .parquet): "
        "id, predicted, probability_<label> per label, error; OUTPUT.json says what they came "
        "from. Never a file of yours: an existing OUTPUT is replaced only with the OUTPUT.json "
        "beside it that an earlier predict wrote of it, unchanged since",
    )
    predict.add_argument(
        "--raw",
        action="store_true",
        help="INPUT is a folder of new data as [data] RAW_DATA holds it, labels or none: the "
        "run's own reconcile makes its rows (here, in a process of its own)",
    )
    predict.add_argument("--run", type=run_number, metavar="RUN_NUM", help="a completed run")
    predict.add_argument("--model", metavar="NAME", help="a model trained in that run")
    predict.add_argument(
        "--backend",
        choices=["local", "sagemaker", "emulated"],
        help="overrides [experiment] BACKEND",
    )
    image_option(predict)
    predict.add_argument(
        "--instance-count",
        type=at_least_one_instance,
        default=1,
        metavar="N",
        help="instances of the processing job ([inference] INSTANCE_TYPE); the input is split "
        "across them by S3 key (ShardedByS3Key)",
    )
    loudness(predict)


def at_least_one_instance(text: str) -> int:
    number = int(text) if text.isdigit() else 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of instances (1, 2, ...)")
    return number


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        # No command: the commands and examples, on stderr with status 2, as argparse answers
        # any other missing argument (so `smpipe $COMMAND` with an empty variable fails).
        parser().print_help(sys.stderr)
        return 2
    try:
        args = parser().parse_args(argv)  # --version and --help print here
    except BrokenPipeError:
        if not stdout_closed():
            raise
        return quiet_exit()
    from pipeline.config import ConfigError
    from pipeline.errors import PipelineError
    from pipeline.history import HistoryError
    from pipeline.project import ProjectError
    from pipeline.prune import PruneError
    from pipeline.store import StoreError
    from steps.user_code import UserFunctionError

    try:
        if args.command in ("run", "plan"):
            return flushed(run_command(args))
        commands = {
            "init": init_command,
            "registry": registry_command,
            "approve": approve_command,
            "runs": runs_command,
            "compare": compare_command,
            "report": report_command,
            "upload": upload_command,
            "prune": prune_command,
            "predict": predict_command,
            "iam": iam_command,
        }
        return flushed(commands[args.command](args))
    except BrokenPipeError:
        if not stdout_closed():
            raise
        return quiet_exit()
    except (ConfigError, UserFunctionError, ProjectError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (PipelineError, StoreError, HistoryError, PruneError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        said = (
            "its job was stopped; OUTPUT and OUTPUT.json are as they were (the run keeps the "
            "job's log, if it started, with a record saying so)"
            if args.command == "predict"
            else "its jobs were stopped; the run is marked interrupted and its completed "
            "outputs stay"
        )
        print(f"interrupted: {said}", file=sys.stderr)
        return 130


def flushed(code: int) -> int:
    """`code`, once stdout is flushed: a pipe closed early (`smpipe runs S | head -1`) says
    so here, inside main()'s try, not at exit as an "Exception ignored" traceback."""
    sys.stdout.flush()
    return code


def stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone: the BrokenPipeError is that pipe's,
    not one of a job's. Linux marks such a pipe's write end POLLERR (fs/pipe.c, pipe_poll:
    `if (!pipe->readers) mask |= EPOLLERR`)."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
    except (AttributeError, OSError, ValueError):  # not a file (pytest's capture), no poll
        return False
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))


def quiet_exit() -> int:
    """The reader of stdout has gone: say nothing more, as the Python docs' recipe for a
    closed pipe does (https://docs.python.org/3/library/signal.html#note-on-sigpipe):
    stdout pointed at /dev/null, so that the flush at exit does not fail again, and status 1,
    Python's own on EPIPE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 1


IAM = (
    "print the least-privilege IAM policies a run on the sagemaker backend needs, read off its "
    "plan: the driver's (whoever runs smpipe) and the execution role's ([experiment] ROLE_ARN)"
)


def iam_command(args) -> int:
    """Both policies, each under a heading (pipeline/iam.py); AWS is asked only for the store
    bucket's default encryption, and only where credentials are at hand."""
    from pipeline.config import load_settings
    from pipeline.iam import said

    print(said(load_settings(args.settings)))
    return 0


def init_command(args) -> int:
    """A new project, and the commands that run it."""
    import shlex

    from pipeline.project import init_project

    name, files = init_project(args.folder)
    print(f"created project {name!r} in {args.folder}:")
    for path in files:
        print(f"  {path.as_posix()}")
    print("run its sample (MiniLM against a from-scratch baseline on 100 news items, here):")
    print(f"  cd {shlex.quote(str(args.folder))}")
    print("  smpipe run settings.ini")
    return 0


def open_experiment(
    path: str, backend: str | None = None, image: str | None = None, planning: bool = False
):
    """The settings (environment overrides applied) and the store they name, checked.
    `planning`: a store that cannot be reached is said in a note, and the plan goes on as for
    an experiment with nothing in it yet (`smpipe plan` needs no AWS)."""
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
    unreachable = store.problems()  # checked before anything is written
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
    log.handlers, log.propagate = [display.handler()], False
    log.setLevel(logging.WARNING if quiet else logging.INFO)
    try:
        with open(os.devnull, "w") as devnull:
            yield devnull if quiet else display
    finally:
        display.close()
        log.handlers, log.propagate = before[0], before[1]
        log.setLevel(before[2])


def run_command(args) -> int:
    from pipeline.console import summary_lines
    from pipeline.driver import parse_steps, run_pipeline
    from pipeline.errors import log
    from pipeline.store import Unreached

    signal.signal(signal.SIGTERM, _interrupt)
    settings, store = open_experiment(args.settings, args.backend, args.image, args.dry_run)
    steps = parse_steps(args.steps)
    with displayed(args.verbose, args.quiet) as echo:
        if isinstance(store, Unreached):
            log.warning(
                f"{store.why}: planned as for an experiment with nothing in it yet (no earlier "
                "data, runs or cache are read; the store is not needed to plan). `smpipe plan "
                "settings.ini --backend emulated --show-requests` shows the very requests offline"
            )
        record = run_pipeline(
            settings,
            store,
            steps,
            dry_run=args.dry_run,
            show_requests=args.show_requests,
            resume=args.resume,
            use_cache=not args.no_cache,
            echo=echo,
        )
    if args.quiet and record:
        print("\n".join(summary_lines(record, record["artifact_uri"])))
    return 0


def runs_command(args) -> int:
    from pipeline.history import run_rows
    from pipeline.paths import ExperimentTree
    from pipeline.tables import console, runs_table

    settings, store = open_experiment(args.settings)
    rows = run_rows(store, ExperimentTree(settings.experiment.name))
    what = f"runs of {settings.experiment.name!r} in {store.uri}"
    console().print(runs_table(what, rows) if rows else f"no {what}")
    return 0


def registry_command(args) -> int:
    from pipeline.registry import versions
    from pipeline.tables import console, versions_table

    settings, store = open_experiment(args.settings)
    group = settings.registry.model_package_group
    rows = versions(settings, store)
    if not rows:
        console().print(f"no versions of model package group {group!r} yet")
        return 0
    title = f"model package group {group!r} ({settings.experiment.backend})"
    console().print(versions_table(title, rows))
    return 0


def approve_command(args) -> int:
    from pipeline.registry import APPROVED, REJECTED, set_status

    settings, store = open_experiment(args.settings)
    row = set_status(settings, store, args.version, REJECTED if args.reject else APPROVED)
    group = settings.registry.model_package_group
    said = f"{row['approval_status']}: {row['description']}"
    print(f"version {row['version']} of model package group {group!r} is {said}")
    return 0


def compare_command(args) -> int:
    from pipeline import tables
    from pipeline.history import compare_runs
    from pipeline.paths import ExperimentTree

    settings, store = open_experiment(args.settings)
    result = compare_runs(store, ExperimentTree(settings.experiment.name), args.first, args.second)
    a, b = result["runs"]
    console = tables.console()
    for table in tables.comparison_tables(result):
        console.print(table)
    for run, models in result["only_in"].items():
        if models and result["comparable"]:
            console.print(f"only run {run} tested {', '.join(models)}")
    if result["settings"]:
        console.print(f"settings that differ (run {a} -> run {b}):")
        for line in result["settings"]:
            console.print(f"  {line}")
    else:
        console.print(f"runs {a} and {b} ran with the same settings")
    if not result["comparable"]:
        print(
            f"error: not comparing the metrics of runs {a} and {b}: {result['why']}",
            file=sys.stderr,
        )
        return 1
    return 0


def report_command(args) -> int:
    """experiment.html, every run, or with a run number that run's report.html: written again
    from the store and said where a browser opens it."""
    from pipeline.paths import ExperimentTree
    from pipeline.report import where_to_open, write_experiment_page, write_report
    from pipeline.runs import existing_run_nums

    settings, store = open_experiment(args.settings)
    tree = ExperimentTree(settings.experiment.name)
    runs = existing_run_nums(store, tree)
    if args.run_num is None:
        key = write_experiment_page(store, tree)
        reports = [tree.run(n).report_html for n in runs if store.exists(tree.run(n).report_html)]
        print(f"every run of {settings.experiment.name!r}: {where_to_open(store, key, reports)}")
        return 0
    if args.run_num not in runs:
        from pipeline.history import HistoryError

        there = f"runs {runs[0]}-{runs[-1]}" if runs else "no runs"
        raise HistoryError(
            f"no run {args.run_num:04d} of {settings.experiment.name!r} in {store.uri} ({there})"
        )
    key = write_report(store, tree, args.run_num)
    print(f"report of run {args.run_num:04d}: {where_to_open(store, key)}")
    return 0


def prune_command(args) -> int:
    """What would go (or goes, with --yes), run by run, and the bytes it frees; what is kept
    because something still reads it, and why."""
    from pipeline.prune import prune_experiment

    settings, store = open_experiment(args.settings)
    print("\n".join(prune_experiment(settings, store, args.keep, remove=args.yes)))
    return 0


def predict_command(args) -> int:
    """The job's lines and the driver's through the display, as `run` shows them."""
    from pipeline.predict import predict

    signal.signal(signal.SIGTERM, _interrupt)
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
    return 0


def upload_command(args) -> int:
    """Raw data is the user's: its data files (hidden ones are not data) are copied as they
    are, never mixed with other data nor written over, since earlier runs read raw/. A raw/
    that holds this very content (sizes and sha256) is left as it is; one that holds other
    content is refused, naming each file that differs (pipeline/raw_data.py). --if-empty
    asks for nothing more: a raw/ with data is compared all the same."""
    from pipeline.paths import ExperimentTree
    from pipeline.raw_data import unfinished_upload, upload_raw

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
        print(f"uploaded {uploaded} files from {args.folder} to {store.uri_of(tree.raw)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
