"""What checkpointing costs: per save, as a share of training time at the default cadence, and
the time to resume. The baseline, measured in the same run on the same data, is the same
training job with checkpoints at epoch ends only.

    python bench/checkpoint_cost.py [--rows N] [--max-length L]

The real demo model (MiniLM) on the real demo data, one epoch, on the local backend.
"""

from __future__ import annotations

import argparse
import configparser
import io
import json
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.backends.local import LocalBackend  # noqa: E402
from pipeline.code_bundle import ship_code  # noqa: E402
from pipeline.config import load_settings  # noqa: E402
from pipeline.driver import parse_steps, run_pipeline  # noqa: E402
from pipeline.paths import ExperimentTree  # noqa: E402
from pipeline.sources import upload_raw  # noqa: E402
from pipeline.stages import training_job  # noqa: E402
from pipeline.store import LocalStore  # noqa: E402
from user_functions.demo_data import write_demo  # noqa: E402


class TermAt(io.StringIO):
    """Echo stream that sends SIGTERM to the training job when it reports `step`."""

    def __init__(self, step: int):
        super().__init__()
        self.step, self.sent = step, False

    def write(self, text):
        if not self.sent and f"] step={self.step}/" in text:
            import psutil

            for child in psutil.Process().children(recursive=True):
                if "steps.train" in " ".join(child.cmdline()):
                    child.send_signal(signal.SIGTERM)
            self.sent = True
        return super().write(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--per-label", type=int, default=None, help="articles per topic (default: all)"
    )
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument(
        "--keep", action="store_true", help="keep the work folder (store, job logs)"
    )
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="smpipe-bench-"))
    shipped = configparser.ConfigParser(interpolation=None, delimiters=("=",))
    shipped.optionxform = str.upper
    shipped.read(ROOT / "settings.ini")
    default_cadence = shipped.getint("training", "CHECKPOINT_EVERY_STEPS")
    shipped.set("experiment", "STORE", str(work / "store"))
    shipped.set("models", "MODEL_NAMES", "minilm")
    shipped.set("training", "EPOCHS", "1")
    shipped.set("data", "MAX_SEQUENCE_LENGTH", str(args.max_length))
    shipped.set("tracking", "WANDB_MODE", "disabled")
    shipped.remove_section("training.bow")
    with open(work / "settings.ini", "w") as f:
        shipped.write(f)
    settings = load_settings(work / "settings.ini", env={})
    store = LocalStore(settings.store_uri())
    write_demo(work / "raw", per_label=args.per_label)
    upload_raw(store, ExperimentTree(settings.experiment.name), work / "raw")
    run_pipeline(settings, store, parse_steps("reconcile,prepare"), echo=io.StringIO())
    data = ExperimentTree(settings.experiment.name).data(1)

    bench_run = ExperimentTree(settings.experiment.name).run(999)
    ship_code(settings, store, bench_run.code)
    channels = {c: data.split(c) for c in ("train", "validation", "labels")}

    def train(name: str, cadence: int, echo=None, restarts: int = 0) -> dict:
        # The job the driver would launch for minilm, with its own prefixes per variant.
        job = replace(
            training_job(settings, bench_run, "minilm", channels, "training"),
            name=name,
            model_prefix=f"bench/{name}/model/",
            output_prefix=f"bench/{name}/output/",
            checkpoint_prefix=f"bench/{name}/checkpoints/",
            max_restarts=restarts,
        )
        job.hyperparameters["checkpoint_every_steps"] = str(cadence)
        backend = LocalBackend(
            store, bench_run, work_root=str(work / "jobs"), echo=echo or io.StringIO()
        )
        started = time.time()
        result = backend.run_training(job)
        if result.status != "Completed":
            raise SystemExit(f"{name} failed: {result.failure_reason}")
        report = json.loads(store.get_bytes(f"bench/{name}/output/step_metadata.json"))
        report["wall_seconds"] = time.time() - started
        return report

    baseline = train("epoch-ends-only", 0)
    default = train("default-cadence", default_cadence)
    # SIGTERM a little after the first mid-epoch checkpoint (or before the last step of a short run).
    kill_step = max(1, min(default_cadence + 5, baseline["steps"] - 1))
    resumed = train("resumed", default_cadence, echo=TermAt(step=kill_step), restarts=1)

    def per_save(r):
        return r["checkpoint_seconds_total"] / max(1, r["checkpoints_written"])

    print(
        f"\ncheckpoint cost: MiniLM, {default['steps']} optimizer steps, max length {args.max_length}"
    )
    print(f"  {'variant':<30}{'saves':>6}{'s/save':>8}{'ckpt s':>8}{'train s':>9}{'share':>8}")
    for name, r in (
        ("epoch ends only (baseline)", baseline),
        (f"every {default_cadence} steps (default)", default),
    ):
        share = r["checkpoint_seconds_total"] / r["seconds"]
        print(
            f"  {name:<30}{r['checkpoints_written']:>6}{per_save(r):>8.2f}{r['checkpoint_seconds_total']:>8.2f}{r['seconds']:>9.1f}{share:>8.1%}"
        )
    extra = default["checkpoint_seconds_total"] - baseline["checkpoint_seconds_total"]
    print(f"  the default cadence adds {extra:+.2f}s of checkpoint writing to the baseline's, "
          f"{extra / baseline['seconds']:+.1%} of its training time")  # fmt: skip
    wall = default["seconds"] - baseline["seconds"]
    print(
        f"  whole-job difference {wall:+.1f}s ({wall / baseline['seconds']:+.1%}; includes run-to-run noise)"
    )
    rf = resumed["resumed_from"]
    if rf is None:
        print(f"  resume: the job was not interrupted at step {kill_step}")
    else:
        print(
            f"  resume: state loaded in {rf['seconds']:.2f}s (step {rf['step']}, after SIGTERM at step {kill_step})"
        )
    if args.keep:
        print(f"  work folder: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
