"""DISTRIBUTED_STRATEGY = fsdp beside ddp, two processes each, every side a whole run of the
pipeline on the local backend:

1. quality: the demo's MiniLM on the same rows and seeds (interleaved, ddp then fsdp for each
   seed), the test split's macro-F1 as inference measured it: FSDP's within DDP's spread?
2. memory: a randomly initialised BERT-large-sized classifier (24 layers, hidden 1024,
   intermediate 4096, 16 heads: about 335M parameters, from transformers' BertConfig, no
   download) in full finetuning, whose weights, gradients and AdamW state (16 bytes a
   parameter) dominate what a process holds, for --steps optimizer steps at batch 2 x 2 x 128
   tokens: each process's peak resident memory at the end of training (the job's own
   `peak_memory`, read in the epoch's last gather: exports not in), fsdp / ddp.

    python bench/fsdp.py [--per-label 100] [--seeds 1,2,3] [--steps 6] [--skip quality]

Prints a table and writes bench/fsdp.json (with the machine and the date).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.large_models import machine  # noqa: E402
from bench.lora_quality import spread  # noqa: E402

OUT = ROOT / "bench/fsdp.json"
STRATEGIES = ("ddp", "fsdp")
TWO_PROCESSES = {"USE_DISTRIBUTED": "true", "PROCESSES_PER_HOST": "2"}

# The user functions a user would write for the large model: the demo's, with load_model
# building it from its config (random weights: what is measured is memory, not quality).
LARGE_FUNCTIONS = """
from user_functions import encode, load_tokenizer, ordered_input_keys, reconcile  # noqa: F401


def load_model(model_name, id2label, label2id):
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(
        vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
        intermediate_size=4096, num_labels=len(id2label), id2label=id2label, label2id=label2id,
    ))
"""


def run(work: Path, name: str, models: str, training: dict, **more) -> dict:
    """One run of the pipeline; its record and its training job's report."""
    from tests.conftest import write_settings

    path = write_settings(
        work / f"{name}.ini", str(work / "store"), experiment={"NAME": name, **more.pop("experiment", {})},
        data={"RAW_DATA": str(work / "raw"), "MAX_SEQUENCE_LENGTH": "128", **more.pop("data", {})},
        models={"MODEL_NAMES": models},
        training={**TWO_PROCESSES, "KEEP_CHECKPOINTS_AFTER_RUN": "true", **training},
    )  # fmt: skip
    started = time.time()
    done = subprocess.run(
        [sys.executable, str(ROOT / "run_pipeline.py"), str(path)],
        cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": f"{work}{os.pathsep}{ROOT}"},
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    runs = work / "store" / name / "runs/0001"
    metadata = json.loads((runs / "metadata.json").read_text())
    report = json.loads((runs / f"models/{models}/output/step_metadata.json").read_text())
    return {"metadata": metadata, "report": report, "seconds": round(time.time() - started, 1)}


def quality(work: Path, seeds: list[int]) -> list[dict]:
    found = []
    for seed in seeds:
        for strategy in STRATEGIES:  # interleaved: the machine's drift falls on both
            done = run(
                work, f"quality-{strategy}-{seed}", "minilm",
                {"DISTRIBUTED_STRATEGY": strategy, "EPOCHS": "2", "LEARNING_RATE": "1e-4",
                 "BATCH_SIZE": "32", "MAX_PER_DEVICE_BATCH_SIZE": "16"},
                data={"SEED": str(seed)},
            )  # fmt: skip
            found.append(
                {
                    "strategy": strategy,
                    "seed": seed,
                    "macro_f1": done["metadata"]["holdout_performance"]["minilm"]["macro_f1"],
                    "best_validation_f1": done["report"]["best_validation_f1"],
                    "checkpoint_bytes": done["report"]["checkpoint_bytes"],
                    "train_loop_seconds": done["report"]["train_loop_seconds"],
                    "run_seconds": done["seconds"],
                }
            )
            print(json.dumps(found[-1]), flush=True)
    return found


def memory(work: Path, steps: int) -> list[dict]:
    (work / "large_functions.py").write_text(LARGE_FUNCTIONS)
    found = []
    for strategy in STRATEGIES:
        done = run(
            work, f"memory-{strategy}", "large",
            {"DISTRIBUTED_STRATEGY": strategy, "EPOCHS": "1", "MAX_STEPS": str(steps),
             "BATCH_SIZE": "4", "MAX_PER_DEVICE_BATCH_SIZE": "2",
             "CHECKPOINT_EVERY_STEPS": str(steps // 2), "KEEP_CHECKPOINTS": "1"},
            experiment={"USER_FUNCTIONS": "large_functions"}, data={"SEED": "1"},
        )  # fmt: skip
        report = done["report"]
        found.append(
            {
                "strategy": strategy,
                "parameters": report["parameters"],
                "precision": report["mixed_precision"],
                # At the last epoch's end, every process (end_epoch's gather); the report's
                # first row is the main process read again after its exports.
                "peak_rss_mb_per_process": [
                    round(p["host_max_rss_bytes"] / 2**20) for p in report["training_peak_memory"]
                ],
                "main_process_peak_rss_mb_with_exports": round(
                    report["peak_memory"][0]["host_max_rss_bytes"] / 2**20
                ),
                "checkpoint_bytes": report["checkpoint_bytes"],
                "examples_per_second": round(report["steps"] * 4 / report["train_loop_seconds"], 3),
                "run_seconds": done["seconds"],
            }
        )
        print(json.dumps(found[-1]), flush=True)
        # The run's models and checkpoints: gone once read.
        subprocess.run(["rm", "-rf", str(work / "store" / f"memory-{strategy}" / "runs")])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-label", type=int, default=100)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip", choices=("quality", "memory"), default=None)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    os.environ.setdefault("WANDB_MODE", "disabled")
    results: dict = {"machine": machine(), "date": datetime.now(UTC).date().isoformat()}
    with tempfile.TemporaryDirectory(prefix="smpipe-fsdp-") as tmp:
        from user_functions.demo_data import write_demo

        work = Path(tmp)
        write_demo(work / "raw", per_label=args.per_label)
        if args.skip != "memory":
            results["memory"] = memory(work, args.steps)
        if args.skip != "quality":
            results["quality"] = quality(work, seeds)
    print(f"\n({results['machine']['cpu']}, {results['date']}), two processes each:")
    if "memory" in results:
        ddp, fsdp = results["memory"]
        ratio = max(fsdp["peak_rss_mb_per_process"]) / max(ddp["peak_rss_mb_per_process"])
        results["memory_fsdp_over_ddp"] = round(ratio, 3)
        print(f"  BERT-large-sized ({ddp['parameters']:,} parameters), {args.steps} steps:")
        for side in (ddp, fsdp):
            print(
                f"    {side['strategy']:4}  peak RSS per process {side['peak_rss_mb_per_process']} MB, "
                f"main with exports {side['main_process_peak_rss_mb_with_exports']} MB, "
                f"checkpoint {side['checkpoint_bytes'] / 2**20:,.0f} MB, "
                f"{side['examples_per_second']} ex/s"
            )
        print(f"    fsdp / ddp, largest process: {ratio:.3f}")
    if "quality" in results:
        for strategy in STRATEGIES:
            scores = [r["macro_f1"] for r in results["quality"] if r["strategy"] == strategy]
            results[strategy] = spread(scores)
            r = results[strategy]
            print(
                f"  MiniLM {strategy:4} test macro-F1 mean {r['macro_f1_mean']:.4f} "
                f"(min {r['macro_f1_min']:.4f}, max {r['macro_f1_max']:.4f}), seeds {seeds}"
            )
    OUT.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
