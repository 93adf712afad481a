"""python run_pipeline.py settings.ini [--backend local|sagemaker|emulated] [--steps a,b] [--dry-run]
[--resume RUN_NUM]"""

from __future__ import annotations

import argparse
import os
import signal
import sys


def _interrupt(signum, _frame):
    # SIGTERM ends the run the way Ctrl-C does: jobs stopped, the run marked interrupted.
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Reconcile, prepare, train or tune, and test text classifiers."
    )
    parser.add_argument("settings", help="the settings.ini of the experiment")
    parser.add_argument(
        "--backend",
        choices=["local", "sagemaker", "emulated"],
        help="overrides [experiment] BACKEND; emulated: SageMaker's requests sent to an "
        "embedded moto and every job played on this machine",
    )
    parser.add_argument(
        "--steps",
        help="comma-separated subset of reconcile,prepare,train,inference; "
        "skipped steps reuse the newest complete outputs of the same experiment",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the jobs, inputs, outputs and paths; launch nothing",
    )
    parser.add_argument(
        "--resume",
        type=int,
        metavar="RUN_NUM",
        help="continue a failed, interrupted or abandoned run in place: its completed steps are "
        "kept and training resumes from its checkpoints",
    )
    parser.add_argument(
        "--show-requests",
        action="store_true",
        help="with --dry-run: also print the SageMaker request each job becomes",
    )
    args = parser.parse_args(argv)
    import logging

    # The driver's own lines (plan, summary) as plain text on the terminal; job output is
    # streamed by the backend with a [job] prefix.
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    logging.getLogger("smpipe").setLevel(logging.INFO)

    from pipeline.config import ConfigError, load_settings
    from pipeline.driver import PipelineError, parse_steps, run_pipeline
    from pipeline.store import StoreError, open_store
    from steps.user_code import UserFunctionError

    env = dict(os.environ)
    if args.backend:
        env["SMPIPE__EXPERIMENT__BACKEND"] = args.backend
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        settings = load_settings(args.settings, env)
        steps = parse_steps(args.steps)
        if settings.experiment.backend == "emulated":  # never a real AWS endpoint
            from pipeline.emulated_backend import open_emulated_store

            store = open_emulated_store(settings)
        else:
            store = open_store(settings.store_uri(), settings.experiment.region)
        unreachable = store.problems()  # checked before anything is written
        if unreachable:
            raise ConfigError(unreachable, settings.source)
        run_pipeline(settings, store, steps, dry_run=args.dry_run, show_requests=args.show_requests,
                     resume=args.resume)  # fmt: skip
    except (ConfigError, UserFunctionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (PipelineError, StoreError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: its jobs were stopped; the run is marked interrupted and its completed "
              "outputs stay", file=sys.stderr)  # fmt: skip
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
