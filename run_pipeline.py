"""python run_pipeline.py settings.ini [--backend local|sagemaker] [--steps a,b] [--dry-run]"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Reconcile, prepare, train or tune, and test text classifiers."
    )
    parser.add_argument("settings", help="the settings.ini of the experiment")
    parser.add_argument(
        "--backend", choices=["local", "sagemaker"], help="overrides [experiment] BACKEND"
    )
    parser.add_argument("--steps", help="comma-separated subset of reconcile,prepare,train,inference; "
                        "skipped steps reuse the newest complete outputs of the same experiment")  # fmt: skip
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the jobs, inputs, outputs and paths; launch nothing",
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
    try:
        settings = load_settings(args.settings, env)
        steps = parse_steps(args.steps)
        store = open_store(settings.store_uri(), settings.experiment.region)
        run_pipeline(settings, store, steps, dry_run=args.dry_run)
    except (ConfigError, UserFunctionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (PipelineError, StoreError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: the run is marked failed; its completed outputs stay", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
