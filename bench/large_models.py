"""A model larger than the demo's, on this machine: a decoder classifier of about 1B parameters
(TinyLlama's shape: 22 layers, hidden 2048, intermediate 5632, 32 heads, 4 key-value heads;
random weights from transformers' LlamaConfig, no download; MiniLM's tokenizer) trained for
--steps optimizer steps at batch 2 x 128 tokens, each side in a process of its own:

1. ours, FINETUNING = lora with GRADIENT_CHECKPOINTING = true: a whole run of the pipeline on
   the local backend; the training job's peak memory as the run's own metering measured it
   (Metadata `cost`), and what the job itself reports (peak RSS, parameters trained,
   checkpoint bytes, examples/s over its optimizer steps);
2. ours, FINETUNING = full, the same: its peak, or where it failed for memory (run under an
   address-space limit, --full-limit-gb, so that it fails as a job rather than as this
   machine's out-of-memory killer's choice);
3. the Hugging Face Trainer with a PEFT model (get_peft_model with the same LoRA targets, r,
   alpha and head; gradient_checkpointing=True, non-reentrant; the same precision) on the same
   rows, batch and steps: its examples/s and peak RSS; ours / its examples/s, in --rounds
   rounds of ours then the Trainer (the median of the rounds' ratios).

    python bench/large_models.py [--steps 10] [--rounds 3] [--no-full] [--layers 22]

Prints a table and writes bench/large_models.json (with the machine and the date).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OUT = ROOT / "bench/large_models.json"
ROWS_PER_LABEL = 10  # the fewest prepare splits 0.8/0.1/0.1 by label: about 40, 5 and 5 rows
MAX_LENGTH = 128  # BBC articles are longer: every row is cut to 128 tokens
BATCH = 2

# The user functions a user would write for it: the demo's, with load_model building the big
# model from its config (random weights: what is measured is memory and speed, not quality).
FUNCTIONS = """
from user_functions import encode, load_tokenizer, ordered_input_keys, reconcile  # noqa: F401


def config(id2label, label2id):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=30522, hidden_size=2048, intermediate_size=5632, num_hidden_layers={layers},
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
        num_labels=len(id2label), id2label=id2label, label2id=label2id, pad_token_id=0,
    )


def load_model(model_name, id2label, label2id):
    from transformers import LlamaForSequenceClassification

    return LlamaForSequenceClassification(config(id2label, label2id))
"""

# The Trainer's side, in a process of its own (its peak RSS is its own): the same rows, the
# same model and LoRA, timed from the first optimizer step's start to the last one's end.
TRAINER = """
import json, resource, sys, time
import datasets, torch
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainerCallback, TrainingArguments, DataCollatorWithPadding
sys.path.insert(0, sys.argv[1])
import big_functions as f

spec = json.loads(open(sys.argv[2]).read())
id2label = {{int(k): v for k, v in spec["id2label"].items()}}
torch.manual_seed(42)
model = f.load_model("big", id2label, {{v: k for k, v in id2label.items()}})
model = get_peft_model(model, LoraConfig(r=spec["r"], lora_alpha=spec["alpha"],
    target_modules=spec["targets"], modules_to_save=spec["heads"]))
tokenizer = f.load_tokenizer("big")
rows = tokenizer(spec["texts"], truncation=True, max_length={max_length})
train = datasets.Dataset.from_dict({{**rows, "labels": spec["labels"]}})

class Clock(TrainerCallback):
    times = {{}}
    def on_step_begin(self, args, state, control, **kw):
        self.times.setdefault("first", time.perf_counter())
    def on_step_end(self, args, state, control, **kw):
        self.times["last"] = time.perf_counter()

args = TrainingArguments(output_dir=sys.argv[3], per_device_train_batch_size={batch},
    max_steps=spec["steps"], learning_rate=1e-4, bf16=spec["bf16"], report_to=[],
    save_strategy="no", logging_strategy="no", disable_tqdm=True, use_cpu=True,
    dataloader_num_workers=0, seed=42, gradient_checkpointing=True,
    gradient_checkpointing_kwargs={{"use_reentrant": False}})
Trainer(model=model, args=args, train_dataset=train, callbacks=[Clock()],
        data_collator=DataCollatorWithPadding(tokenizer)).train()
seconds = Clock.times["last"] - Clock.times["first"]
print(json.dumps({{"seconds": seconds, "examples_per_second": spec["steps"] * {batch} / seconds,
    "host_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}}))
"""


def project(work: Path, layers: int) -> Path:
    """The user's project: raw data, the functions and the settings of one LoRA run."""
    from user_functions.demo_data import write_demo

    write_demo(work / "raw", per_label=ROWS_PER_LABEL)
    (work / "big_functions.py").write_text(FUNCTIONS.format(layers=layers))
    return work


def settings(work: Path, name: str, finetuning: str, steps: int) -> Path:
    text = textwrap.dedent(f"""\
        [experiment]
        NAME = {name}
        STORE = {work / "store"}
        USER_FUNCTIONS = big_functions
        [data]
        RAW_DATA = {work / "raw"}
        MAX_SEQUENCE_LENGTH = {MAX_LENGTH}
        [models]
        MODEL_NAMES = big
        [training]
        EPOCHS = 1
        MAX_STEPS = {steps}
        BATCH_SIZE = {BATCH}
        MAX_PER_DEVICE_BATCH_SIZE = {BATCH}
        CHECKPOINT_EVERY_STEPS = {steps // 2}
        KEEP_CHECKPOINTS = 1
        KEEP_CHECKPOINTS_AFTER_RUN = true
        MAX_RESTARTS = 0
        FINETUNING = {finetuning}
        GRADIENT_CHECKPOINTING = true
        [tracking]
        WANDB_MODE = disabled
        """)
    path = work / f"{name}.ini"
    path.write_text(text)
    return path


def limit_memory(gigabytes: float | None):
    def apply() -> None:
        if gigabytes:
            size = int(gigabytes * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (size, size))

    return apply


def ours(work: Path, name: str, finetuning: str, steps: int, limit_gb: float | None) -> dict:
    """One run of the pipeline; the training job's figures, or how it failed."""
    path = settings(work, name, finetuning, steps)
    started = time.time()
    done = subprocess.run(
        [sys.executable, str(ROOT / "run_pipeline.py"), str(path)],
        cwd=work, capture_output=True, text=True, preexec_fn=limit_memory(limit_gb),
        env={**os.environ, "PYTHONPATH": f"{work}{os.pathsep}{ROOT}"},
    )  # fmt: skip
    seconds = time.time() - started
    runs = sorted((work / "store" / name / "runs").glob("*/metadata.json"))
    metadata = json.loads(runs[-1].read_text()) if runs else {}
    train = [j for j in metadata.get("cost", {}).get("jobs", []) if "-train-" in j["job"]]
    report_file = work / "store" / name / "runs/0001/models/big/output/step_metadata.json"
    report = json.loads(report_file.read_text()) if report_file.exists() else {}
    figures = {
        "finetuning": finetuning,
        "exit": done.returncode,
        "run_seconds": round(seconds, 1),
        "address_space_limit_gb": limit_gb,
        "job_peak_memory_mb": train[0]["peak_memory_mb"] if train else None,
    }
    if report:
        figures |= {
            "parameters": report["parameters"],
            "trained_parameters": report["trained_parameters"],
            "job_max_rss_mb": round(report["peak_memory"][0]["host_max_rss_bytes"] / 2**20, 1),
            "checkpoint_bytes": report["checkpoint_bytes"],
            "precision": report["mixed_precision"],
            "examples_per_second": round(report["steps"] * BATCH / report["train_loop_seconds"], 3),
            "lora": report.get("lora"),
        }
    if done.returncode != 0:
        figures["failure"] = (done.stdout + done.stderr).strip().splitlines()[-12:]
    # The run's models and checkpoints are 8 to 20 GB a run: gone once read (its data stays,
    # for the Trainer's side).
    shutil.rmtree(work / "store" / name / "runs", ignore_errors=True)
    return figures


def trainer(work: Path, name: str, lora: dict, steps: int, precision: str) -> dict:
    """The Trainer with the PEFT model, on the rows our run `name` trained on."""
    import datasets

    prepared = sorted((work / "store" / name / "data").glob("*/prepared/train"))[-1]
    labels_dir = prepared.parent / "labels"
    id2label = json.loads((labels_dir / "id2label.json").read_text())
    reconciled = datasets.load_from_disk(str(prepared.parent.parent / "reconciled" / "dataset"))
    texts = list(reconciled["text"])[: steps * BATCH]
    label2id = {v: int(k) for k, v in id2label.items()}
    spec = {
        "id2label": id2label, "texts": texts,
        "labels": [label2id[x] for x in list(reconciled["label"])[: steps * BATCH]],
        "r": lora["r"], "alpha": lora["alpha"], "targets": lora["target_modules"],
        "heads": lora["modules_to_save"], "steps": steps, "bf16": precision == "bf16",
    }  # fmt: skip
    (work / "trainer.json").write_text(json.dumps(spec))
    script = work / "trainer_side.py"
    script.write_text(TRAINER.format(max_length=MAX_LENGTH, batch=BATCH))
    done = subprocess.run(
        [sys.executable, str(script), str(work), str(work / "trainer.json"), str(work / "trainer")],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    if done.returncode != 0:
        return {"exit": done.returncode, "failure": done.stderr.strip().splitlines()[-12:]}
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    figures["host_max_rss_mb"] = round(figures.pop("host_max_rss_bytes") / 2**20, 1)
    return figures


def machine() -> dict:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line),
        platform.processor(),
    )
    flags = open("/proc/cpuinfo").read()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "amx": "amx_tile" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=22, help="TinyLlama's 22: about 1.03B")
    parser.add_argument("--no-full", action="store_true", help="skip full finetuning")
    parser.add_argument("--full-limit-gb", type=float, default=21.0)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of ours and the Trainer")
    args = parser.parse_args()
    results: dict = {"machine": machine(), "date": datetime.now(UTC).date().isoformat()}
    results |= {"steps": args.steps, "batch": BATCH, "tokens": MAX_LENGTH, "layers": args.layers}
    with tempfile.TemporaryDirectory(prefix="smpipe-large-") as tmp:
        work = project(Path(tmp), args.layers)
        # Rounds of ours then the Trainer, each side a process of its own: a ratio is taken
        # within a round, and the median of the rounds' is given (one 10-step side is about
        # 30 s of training here, so a few seconds of anything else move one round's figure).
        rounds = []
        for round_ in range(args.rounds):
            name = f"lora-{round_ + 1}"
            side = ours(work, name, "lora", args.steps, None)
            print(json.dumps(side, indent=1), flush=True)
            if side["exit"] != 0:
                rounds.append({"ours": side})
                break
            theirs = trainer(work, name, side["lora"], args.steps, side["precision"])
            print(json.dumps(theirs, indent=1), flush=True)
            ratio = side["examples_per_second"] / theirs["examples_per_second"]
            rounds.append({"ours": side, "trainer_peft": theirs, "ratio": round(ratio, 3)})
        results["lora"], results["rounds"] = rounds[0]["ours"], rounds
        ratios = [r["ratio"] for r in rounds if "ratio" in r]
        if ratios:
            results["trainer_peft"] = rounds[0]["trainer_peft"]
            results["lora_vs_trainer_examples_per_second"] = {
                "median": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
            }
        if not args.no_full:
            results["full"] = ours(work, "full", "full", args.steps, args.full_limit_gb)
            print(json.dumps(results["full"], indent=1), flush=True)
    OUT.write_text(json.dumps(results, indent=1) + "\n")
    print(
        f"\n{results['layers']} layers, {results['lora'].get('parameters')} parameters, "
        f"{args.steps} steps of {BATCH} x {MAX_LENGTH} tokens ({results['machine']['cpu']}):"
    )
    for side in ("lora", "full"):
        r = results.get(side)
        if r:
            print(
                f"  {side:5} exit {r['exit']}  job peak {r['job_peak_memory_mb']} MB (metering), "
                f"RSS {r.get('job_max_rss_mb')} MB, trained {r.get('trained_parameters')}, "
                f"checkpoint {r.get('checkpoint_bytes')} B, {r.get('examples_per_second')} ex/s"
            )
    for i, r in enumerate(results["rounds"], 1):
        if "ratio" in r:
            print(
                f"  round {i}: ours {r['ours']['examples_per_second']} ex/s, Trainer+PEFT "
                f"{r['trainer_peft']['examples_per_second']:.3f} ex/s (RSS "
                f"{r['trainer_peft']['host_max_rss_mb']} MB): {r['ratio']}x"
            )
    if "lora_vs_trainer_examples_per_second" in results:
        print(f"  ours / Trainer+PEFT: {results['lora_vs_trainer_examples_per_second']}")


if __name__ == "__main__":
    main()
