"""`smpipe`'s command line: its commands, their arguments and options, each with its help.

argparse, as Accelerate's and transformers' own command lines: no dependency, and `--help`
answers before anything heavy is imported.
"""

from __future__ import annotations

import argparse
import re
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


def counted_as(text: str) -> int:
    """A number as a user types one: ASCII digits only, so that every command reads `+1`,
    `1_0` and `４` alike (refused; int() took the first two, and isdigit() the last); 0 when
    it is not one."""
    return int(text) if re.fullmatch(r"[0-9]+", text) else 0


def run_number(text: str) -> int:
    """A run_num as the run tree numbers them: 1 and up (0001 is 1)."""
    if counted_as(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a run number (1, 2, ...; 0003 is 3)")
    return counted_as(text)


def version_number(text: str) -> int:
    """A model package version, as the registry numbers them: 1 and up."""
    if counted_as(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a version (1, 2, ...)")
    return counted_as(text)


def at_least_one(text: str) -> int:
    """--keep: how many completed runs stay whole; 0 would leave no model at all."""
    if counted_as(text) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: keep at least 1 completed run (the newest N completed runs, and every "
            "run after them, are left whole)"
        )
    return counted_as(text)


def a_path(text: str) -> Path:
    """A path argument, never empty: `smpipe init "$DIR"` with DIR unset would have made the
    project in the current folder, and `upload` sent it, without a word."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r}: an empty path (a variable not set?); name it, `.` for this folder"
        )
    return Path(text)


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
        help="only what went wrong, the summary and where the report and registered version "
        "are; job output stays in the job logs",
    )
    loud.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="every line of every job, library warnings included",
    )


def build_parser() -> argparse.ArgumentParser:
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
    upload_options(
        command("upload", "copy a folder of raw data into the experiment's raw/ in the store")
    )
    command("runs", "list the experiment's runs: status, models, test macro-F1, data, duration")
    compare = command(
        "compare", "two runs side by side: metrics, per-label F1, settings that differ"
    )
    compare.add_argument("first", type=run_number, metavar="RUN_NUM")
    compare.add_argument("second", type=run_number, metavar="RUN_NUM")
    registry_options(command)
    report = command(
        "report", "rebuild experiment.html (every run), or with RUN_NUM that run's report.html"
    )
    report.add_argument("run_num", type=run_number, nargs="?", metavar="RUN_NUM")
    prune_options(command("prune", PRUNE))
    command("iam", IAM)  # pipeline/iam/
    predict_options(command("predict", PREDICT))
    return root


def registry_options(command) -> None:
    """`registry` and `approve`; each backend keeps its own registry, so both take --backend."""
    listing = command(
        "registry", "list the versions of [registry] MODEL_PACKAGE_GROUP: status, run, model"
    )
    approve = command(
        "approve", "approve a registered version (SageMaker's ModelApprovalStatus Approved)"
    )
    approve.add_argument("version", type=version_number, metavar="VERSION")
    approve.add_argument("--reject", action="store_true", help="set it Rejected instead")
    for sub in (listing, approve):
        sub.add_argument(
            "--backend",
            choices=["local", "sagemaker", "emulated"],
            help="overrides [experiment] BACKEND: the registry of the runs made with it",
        )


def init_options(commands) -> None:
    """`smpipe init DIR`: pipeline/project.py. No settings.ini: it makes one."""
    init = commands.add_parser(
        "init",
        help="start a project: settings.ini, the five user functions and a sample they run on",
        description="Create DIR (or fill it, if empty) with a project that runs as it is: "
        "settings.ini, every key commented; user_functions/ with the five functions, TODO where "
        "your data differs; data/ with a small sample. Nothing is ever overwritten.",
    )
    init.add_argument("folder", type=a_path, metavar="DIR", help="a new or empty folder")


def upload_options(upload: argparse.ArgumentParser) -> None:
    """`smpipe upload settings.ini FOLDER`: pipeline/raw_data.py."""
    upload.add_argument("folder", type=a_path, help="the raw data: a folder on this machine")
    upload.add_argument(
        "--if-empty",
        action="store_true",
        help="kept for scripts: a raw/ that holds this folder's content is left as it is, "
        "and one that holds other content is refused, with or without it",
    )


IAM = (
    "print the least-privilege IAM policies a run on the sagemaker backend needs, read off its "
    "plan: the driver's (whoever runs smpipe) and the execution role's ([experiment] ROLE_ARN)"
)


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
        type=a_path,
        help="the texts: .csv, .tsv, .jsonl (.json, .ndjson), .parquet with the text column(s) "
        "of the run's data and an optional id column, or a folder of .txt files (one text each)",
    )
    predict.add_argument(
        "output",
        type=a_path,
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
    if counted_as(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of instances (1, 2, ...)")
    return counted_as(text)
