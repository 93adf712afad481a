"""LoRA beside full finetuning on the demo's MiniLM: the same rows, the same seeds, each a whole
run of the pipeline on the local backend (the test split's macro-F1 as inference measured it),
with what each trained and what its checkpoint weighed.

    python bench/lora_quality.py [--per-label 100] [--seeds 1,2,3]

Each method at the learning rate its users would start from: full finetuning at the demo's
1e-4; LoRA (r 8, alpha 16, the attention and MLP projections, the head in full) at 5e-4, as
low-rank adapters want a larger step. [data] SEED sets the split, the new head's
initialization and the shuffling alike, so both methods of a seed see the same rows. Prints a
table and writes bench/lora_quality.json (with the machine and the date).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.large_models import machine  # noqa: E402

OUT = ROOT / "bench/lora_quality.json"
METHODS = {
    "full": {"FINETUNING": "full", "LEARNING_RATE": "1e-4"},
    "lora": {"FINETUNING": "lora", "LEARNING_RATE": "5e-4", "LORA_R": "8", "LORA_ALPHA": "16"},
}


def run(work: Path, method: str, seed: int) -> dict:
    from tests.conftest import write_settings

    name = f"{method}-{seed}"
    path = write_settings(
        work / f"{name}.ini", str(work / "store"),
        experiment={"NAME": name}, data={"RAW_DATA": str(work / "raw"), "SEED": str(seed),
                                         "MAX_SEQUENCE_LENGTH": "128"},
        models={"MODEL_NAMES": "minilm"},
        training={**METHODS[method], "EPOCHS": "2", "BATCH_SIZE": "32",
                  "MAX_PER_DEVICE_BATCH_SIZE": "16", "KEEP_CHECKPOINTS_AFTER_RUN": "true"},
    )  # fmt: skip
    started = time.time()
    done = subprocess.run(
        [sys.executable, str(ROOT / "run_pipeline.py"), str(path)],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    metadata = json.loads((work / "store" / name / "runs/0001/metadata.json").read_text())
    report_file = work / "store" / name / "runs/0001/models/minilm/output/step_metadata.json"
    report = json.loads(report_file.read_text())
    return {
        "method": method,
        "seed": seed,
        "macro_f1": metadata["holdout_performance"]["minilm"]["macro_f1"],
        "best_validation_f1": report["best_validation_f1"],
        "trained_parameters": report["trained_parameters"],
        "checkpoint_bytes": report["checkpoint_bytes"],
        "train_loop_seconds": report["train_loop_seconds"],
        "precision": report["mixed_precision"],
        "run_seconds": round(time.time() - started, 1),
    }


def spread(scores: list[float]) -> dict:
    """Test macro-F1 over seeds: its mean, least and most."""
    return {
        "macro_f1_mean": round(statistics.mean(scores), 4),
        "macro_f1_min": min(scores),
        "macro_f1_max": max(scores),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-label", type=int, default=100)
    parser.add_argument("--seeds", default="1,2,3")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    os.environ.setdefault("WANDB_MODE", "disabled")
    results: dict = {"machine": machine(), "date": datetime.now(UTC).date().isoformat()}
    results |= {"per_label": args.per_label, "methods": METHODS, "runs": []}
    with tempfile.TemporaryDirectory(prefix="smpipe-lora-quality-") as tmp:
        from user_functions.demo_data import write_demo

        work = Path(tmp)
        write_demo(work / "raw", per_label=args.per_label)
        for seed in seeds:
            for method in METHODS:  # interleaved: the machine's drift falls on both
                results["runs"].append(run(work, method, seed))
                print(json.dumps(results["runs"][-1]), flush=True)
    for method in METHODS:
        results[method] = spread([r["macro_f1"] for r in results["runs"] if r["method"] == method])
    full, lora = ([r for r in results["runs"] if r["method"] == m] for m in ("full", "lora"))
    results["checkpoint_share"] = round(
        statistics.mean(
            b["checkpoint_bytes"] / a["checkpoint_bytes"] for a, b in zip(full, lora, strict=True)
        ),
        4,
    )
    OUT.write_text(json.dumps(results, indent=1) + "\n")
    print(
        f"\nMiniLM, {args.per_label} articles a label, seeds {seeds} ({results['machine']['cpu']}):"
    )
    for method in METHODS:
        r = results[method]
        print(
            f"  {method:4}  test macro-F1 mean {r['macro_f1_mean']:.4f} "
            f"(min {r['macro_f1_min']:.4f}, max {r['macro_f1_max']:.4f})"
        )
    print(f"  LoRA's checkpoint / full's: {results['checkpoint_share']:.2%}")


if __name__ == "__main__":
    main()
