"""What a run costs beside its optimizer steps, and what it leaves behind.

    python bench/run_cost.py [--trials 8] [--steps 10] [--skip-demo]

1. Tuning overhead: a study of `--trials` MiniLM trials of `--steps` optimizer steps each, one
   trial at a time, on the local backend with the demo's data (BBC News): each trial's wall
   time (its job, start to end) against its optimizer steps' time (`train_loop_seconds`, the
   same clock the training bench uses). The overhead share is what a trial spends outside its
   steps. Measured twice in this run, warm start on and off (SMPIPE_WARM_START=0: every job a
   fresh interpreter), so the baseline is taken on the same machine minutes apart.
2. The shipped tuning example as settings.ini has it (`SMPIPE__EXPERIMENT__JOB=tune`: 4 + 4
   trials, two at once, early stopping, wandb offline), the data steps reused: its wall time
   and its MiniLM trials' overhead share, with and without validation counted as overhead.
3. What a completed run keeps: the demo's training run (`make run`'s settings) in a fresh
   store, its tree's bytes against the bytes it keeps for use: each model's model/ folder (the
   weights and the programs [training] EXPORTS names), inference's results, Metadata and the
   report.

Prints a table and writes bench/run_cost.json. Asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_demo(
    store: Path, raw: Path, env: dict[str, str], wandb: bool = False, args: tuple = ()
) -> float:
    """`python run_pipeline.py settings.ini` with the demo's settings and `env` over them;
    wandb as settings.ini has it (offline) or disabled."""
    overrides = {
        "SMPIPE__EXPERIMENT__STORE": str(store),
        "SMPIPE__DATA__RAW_DATA": str(raw),
        **({} if wandb else {"SMPIPE__TRACKING__WANDB_MODE": "disabled"}),
        **env,
    }
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "run_pipeline.py", "settings.ini", *args],
        cwd=ROOT,
        env={**os.environ, **overrides},
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        sys.exit(f"the demo run failed ({overrides}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return time.perf_counter() - started


def newest_run(store: Path) -> Path:
    return max((store / "bbc-news/runs").iterdir(), key=lambda p: p.name)


def tuning_overhead(store: Path, raw: Path, trials: int, steps: int, warm: bool) -> dict:
    """One study of `trials` trials of `steps` steps; each trial's wall and loop seconds."""
    wall = run_demo(
        store,
        raw,
        {
            "SMPIPE__EXPERIMENT__JOB": "tune",
            "SMPIPE__MODELS__MODEL_NAMES": "minilm",
            "SMPIPE__TUNING__MAX_JOBS": str(trials),
            "SMPIPE__TUNING__MAX_PARALLEL_JOBS": "1",
            "SMPIPE__TUNING__EARLY_STOPPING": "Off",
            "SMPIPE__TUNING_HYPERPARAMETERS_MINILM__MAX_STEPS": str(steps),
            "SMPIPE_WARM_START": "1" if warm else "0",
        },
    )
    metadata = json.loads((newest_run(store) / "metadata.json").read_text())
    tune = metadata["steps"]["tune"]["details"]["models"]["minilm"]
    return {
        "trials": trials,
        "run_seconds": round(wall, 1),
        "study_seconds": tune.get("job_seconds"),
        "export_job_seconds": tune.get("export_job_seconds"),
        **trial_costs(newest_run(store), "minilm"),
    }


def trial_costs(run: Path, model: str) -> dict:
    """A study's trials (those that wrote a report): wall seconds (the driver's clock, job
    start to end) against their optimizer steps (`train_loop_seconds`), and validation's share
    of the rest (`seconds_outside_steps`)."""
    seconds, loops, validation, tracking = [], [], [], []
    for trial in json.loads((run / f"tuning/{model}/trials.json").read_text())["trials"]:
        report = run / f"tuning/{model}/trial-{trial['number']:03d}/output/step_metadata.json"
        if not report.exists():  # failed before its report
            continue
        job = json.loads(report.read_text())
        seconds.append(trial["seconds"])
        loops.append(job["train_loop_seconds"])
        validation.append(job["seconds_outside_steps"].get("validation", 0.0))
        tracking.append(job["seconds_outside_steps"].get("tracking", 0.0))
    outside = sum(seconds) - sum(loops)
    return {
        "trials_reported": len(seconds),
        "trial_seconds": round(sum(seconds), 1),
        "trial_loop_seconds": round(sum(loops), 1),
        "overhead_share": round(outside / sum(seconds), 3),
        "overhead_per_trial_s": round(outside / len(seconds), 2),
        "validation_per_trial_s": round(sum(validation) / len(seconds), 2),
        "tracking_wait_per_trial_s": round(sum(tracking) / len(seconds), 2),
        "share_outside_steps_and_validation": round((outside - sum(validation)) / sum(seconds), 3),
    }


def shipped_example(store: Path, raw: Path) -> dict:
    """The tuning example as settings.ini ships it (its comment gives the command)."""
    wall = run_demo(store, raw, {"SMPIPE__EXPERIMENT__JOB": "tune"}, wandb=True)
    return {"run_seconds": round(wall, 1), **trial_costs(newest_run(store), "minilm")}


def tree_size(store: Path, raw: Path) -> dict:
    """The demo's training run: its tree against the files it keeps for use."""
    wall = run_demo(store, raw, {})
    run = newest_run(store)
    files = [p for p in run.rglob("*") if p.is_file()]
    # Kept for use: the models as inference runs them, every metric and report. The rest is
    # resume state (checkpoints/), trials' leftovers, the run's code and logs.
    not_for_use = ("checkpoints/", "tuning/", "code/", "logs/", "models/minilm/best-trial/")
    kept = [p for p in files if not str(p.relative_to(run)).startswith(not_for_use)]
    models = [p for p in files if "/model/" in str(p.relative_to(run))]
    total = sum(p.stat().st_size for p in files)
    for_use = sum(p.stat().st_size for p in kept)
    return {
        "run_seconds": round(wall, 1),
        "tree_bytes": total,
        "kept_for_use_bytes": for_use,
        "final_model_bytes": sum(p.stat().st_size for p in models),
        "ratio": round(total / for_use, 3),
        "largest": sorted(
            ((str(p.relative_to(run)), p.stat().st_size) for p in files), key=lambda x: -x[1]
        )[:6],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip-demo", action="store_true", help="only the tuning overhead")
    parser.add_argument("--skip-example", action="store_true", help="not the shipped example")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="smpipe-run-cost-"))
    raw = ROOT / "build/demo_raw"
    if not raw.exists():
        subprocess.run([sys.executable, "-m", "user_functions.demo_data", str(raw)], check=True)
    store = work / "store"
    # The data steps run once, first, for both models; every run after reuses them (cache/).
    run_demo(store, raw, {}, args=("--steps", "reconcile,prepare"))
    results = {
        "settings": vars(args),
        "tuning_cold": tuning_overhead(store, raw, args.trials, args.steps, warm=False),
        "tuning_warm": tuning_overhead(store, raw, args.trials, args.steps, warm=True),
    }
    if not args.skip_example:
        results["shipped_example"] = shipped_example(store, raw)
    if not args.skip_demo:
        results["demo_tree"] = tree_size(store, raw)
    (ROOT / "bench/run_cost.json").write_text(json.dumps(results, indent=2))
    print(f"\nrun cost ({args.trials} MiniLM trials of {args.steps} steps, one at a time; {store})")
    for name in ("tuning_cold", "tuning_warm"):
        r = results[name]
        print(
            f"  {name:<12} study {r['study_seconds']}s, trials {r['trial_seconds']}s of which "
            f"optimizer steps {r['trial_loop_seconds']}s: overhead {r['overhead_share']:.0%} "
            f"({r['overhead_per_trial_s']}s a trial), export after the study "
            f"{r['export_job_seconds']}s"
        )
    if "shipped_example" in results:
        r = results["shipped_example"]
        print(
            f"  shipped tuning example {r['run_seconds']}s; its MiniLM trials (two at once, wandb "
            f"offline): overhead {r['overhead_share']:.0%} ({r['overhead_per_trial_s']}s a "
            f"trial, validation {r['validation_per_trial_s']}s of it), outside steps and "
            f"validation {r['share_outside_steps_and_validation']:.0%}"
        )
    if "demo_tree" in results:
        t = results["demo_tree"]
        print(
            f"  demo run tree {t['tree_bytes'] / 2**20:.1f} MiB, kept for use "
            f"{t['kept_for_use_bytes'] / 2**20:.1f} MiB (final models "
            f"{t['final_model_bytes'] / 2**20:.1f} MiB): {t['ratio']:.2f}x"
        )


if __name__ == "__main__":
    main()
