"""Does bf16 cost quality? The demo's MiniLM trained and tested in fp32 and in bf16, the same
seeds for both, interleaved; and what each took.

For each seed (`[data] SEED`: the split, the initialization and the shuffling), one run with
`MIXED_PRECISION = no` and one with `bf16` ([training] and [inference] alike), each a whole
`run_pipeline.py` on the demo's data (MiniLM only), each its own experiment so both compute
every step. Prints, per precision: test macro-F1 per seed, mean, standard deviation and range
(fp32's range over the seeds is the run-to-run spread bf16 is held against); the paired
difference per seed; the training job's seconds and the whole run's wall time, and their ratio
bf16/fp32 per seed; and, for the bf16 runs, how inference's bf16 predictions agreed with fp32's
on the same model. Writes bench/precision_quality.json. Asserts nothing.

    python bench/precision_quality.py [--seeds 1,2,3] [--epochs N] [--max-length N]

`bf16` is forced here (not `auto`) so that the quality question is answered on any CPU; on a
CPU without native bf16 (AMX or AVX512-BF16) its times show what auto avoids there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from steps.precision import cpu_bf16  # noqa: E402

PRECISIONS = ("no", "bf16")


def run(precision: str, seed: int, args, work: Path, raw: Path) -> dict:
    """One whole run on the local backend; its Metadata's figures."""
    name = f"precision-{precision}-{seed}-{args.per_label or 'all'}-{args.max_length}"
    overrides = {
        "EXPERIMENT__STORE": str(work / "store"),
        "EXPERIMENT__NAME": name,
        "DATA__RAW_DATA": str(raw),
        "DATA__SEED": str(seed),
        "DATA__MAX_SEQUENCE_LENGTH": str(args.max_length),
        "MODELS__MODEL_NAMES": "minilm",
        "TRAINING__EPOCHS": str(args.epochs),
        "TRAINING__MIXED_PRECISION": precision,
        "INFERENCE__MIXED_PRECISION": precision,
        "TRACKING__WANDB_MODE": "disabled",
    }
    env = {**os.environ, **{f"SMPIPE__{k}": v for k, v in overrides.items()}}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "run_pipeline.py", "settings.ini"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    record = json.loads((work / "store" / name / "runs/0001/metadata.json").read_text())
    trained = record["steps"]["train"]["details"]["models"]["minilm"]
    tested = record["steps"]["inference"]["details"]
    return {
        "seed": seed,
        "precision": precision,
        "applied": trained["mixed_precision"],
        "test_macro_f1": tested["holdout_performance"]["minilm"]["macro_f1"],
        "test_accuracy": tested["holdout_performance"]["minilm"]["accuracy"],
        "train_job_seconds": trained["job_seconds"],
        "train_loop_seconds": trained["train_loop_seconds"],
        "wall_seconds": round(wall, 1),
        "against_fp32": (tested.get("against_fp32") or {}).get("minilm"),
    }


def summary(runs: list[dict]) -> dict:
    f1 = [r["test_macro_f1"] for r in runs]
    return {
        "macro_f1": f1,
        "mean": statistics.mean(f1),
        "sd": statistics.stdev(f1) if len(f1) > 1 else 0.0,
        "range": [min(f1), max(f1)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--epochs", type=int, default=2, help="the demo's MiniLM: 2")
    parser.add_argument("--max-length", type=int, default=128, help="the demo's: 128")
    parser.add_argument(
        "--per-label", type=int, default=0, help="articles per topic (0: all 2,225, the demo)"
    )
    parser.add_argument("--work", default=str(ROOT / "build/bench-precision"))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    work = Path(args.work)
    raw = work / f"raw-{args.per_label or 'all'}"
    if not raw.exists():
        demo = [sys.executable, "-m", "user_functions.demo_data", str(raw)]
        subprocess.run(
            demo + (["--per-label", str(args.per_label)] if args.per_label else []), check=True
        )
    native, why = cpu_bf16()
    print(f"CPU: {platform.processor() or platform.machine()}; native bf16: {native} ({why})")
    runs = []
    for seed in seeds:
        # fp32 first on odd seeds, bf16 first on even: a drift in the machine's speed falls on
        # both sides.
        order = PRECISIONS if seed % 2 else PRECISIONS[::-1]
        for precision in order:
            runs.append(run(precision, seed, args, work, raw))
            r = runs[-1]
            print(
                f"seed {seed} {precision:>4}: test macro-F1 {r['test_macro_f1']:.4f} "
                f"train job {r['train_job_seconds']:.0f} s, run {r['wall_seconds']:.0f} s"
                + (f", against fp32 {r['against_fp32']}" if r["against_fp32"] else ""),
                flush=True,
            )
    by = {
        p: sorted((r for r in runs if r["precision"] == p), key=lambda r: r["seed"])
        for p in PRECISIONS
    }
    fp32, bf16 = summary(by["no"]), summary(by["bf16"])
    pairs = list(zip(by["no"], by["bf16"], strict=True))  # the same seeds, in order
    differences = [b["test_macro_f1"] - f["test_macro_f1"] for f, b in pairs]
    train_ratio = [b["train_job_seconds"] / f["train_job_seconds"] for f, b in pairs]
    wall_ratio = [b["wall_seconds"] / f["wall_seconds"] for f, b in pairs]
    within = fp32["range"][0] <= bf16["mean"] <= fp32["range"][1]
    print()
    print(f"{'':>6} {'macro-F1 by seed':>32} {'mean':>7} {'sd':>7} {'range':>16}")
    for label, s in (("fp32", fp32), ("bf16", bf16)):
        values = " ".join(f"{x:.4f}" for x in s["macro_f1"])
        print(
            f"{label:>6} {values:>32} {s['mean']:7.4f} {s['sd']:7.4f} "
            f"{s['range'][0]:.4f}-{s['range'][1]:.4f}"
        )
    print(f"bf16 - fp32 per seed: {', '.join(f'{d:+.4f}' for d in differences)}")
    print(f"bf16's mean within fp32's range over the seeds: {within}")
    print(f"time bf16/fp32 per seed, training job: {', '.join(f'{x:.2f}' for x in train_ratio)}")
    print(f"time bf16/fp32 per seed, whole run:    {', '.join(f'{x:.2f}' for x in wall_ratio)}")
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "native_bf16": native, "why": why},
        "settings": {"seeds": seeds, "epochs": args.epochs, "max_length": args.max_length,
                     "per_label": args.per_label or "all"},
        "runs": runs, "fp32": fp32, "bf16": bf16, "differences": differences,
        "bf16_mean_within_fp32_range": within,
        "train_job_ratio": train_ratio, "wall_ratio": wall_ratio,
    }  # fmt: skip
    (ROOT / "bench/precision_quality.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
