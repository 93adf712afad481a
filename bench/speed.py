"""Speed against the ecosystem's own tools at their best, and against the machine's peak.
Every figure is a ratio to a baseline measured in the same process, interleaved, after
warm-up, same model (MiniLM), rows, batch size, steps and threads on every side (bf16 peers
without native bf16: a share, BF16_SHARE_WITHOUT_NATIVE). Rates are
medians of --repeat runs (training, jobs) or rounds (inference, prepare); a ratio is the median
of the ratios taken within each round, since this machine's speed drifts within a minute:

1. training: our training job's loop (steps/train.py, MIXED_PRECISION = auto) against the
   Hugging Face `Trainer` at its best CPU settings, `DataCollatorWithPadding` and grouped by
   length, in bf16 (`bf16=True`) and in fp32: which is faster depends on the CPU, so both run
   and the ratio is given against each and against the faster; on long texts (BBC articles)
   and short ones (their lead sentences), both at MAX_SEQUENCE_LENGTH 128; beside our loop's
   rows a second, our loader's over an epoch of its batches with no model (its collate alone,
   and the job's whole DataLoader: bench/loader.py) and how many times the loop's each is;
2. inference: our inference step's batching (steps/inference.py's run_batches over the
   TorchScript export, 64 rows a batch, each pass held to its MAX_TOKENS_PER_PASS, in the
   precision auto applies) against `transformers.pipeline("text-classification")` at batch
   size 64 in bf16 and in fp32, and a one-row-at-a-time loop;
3. model FLOP/s of each side (`encoder_flops`) and MFU: over the matmul peak of the precision
   it ran in and over the bf16 peak, both measured here (`matmul_peak`);
4. preparation: our prepare's encode (steps/prepare.py) against one tokenizer call over the
   whole column (the floor) and an unbatched per-row `datasets.map`;
5. orchestration: what the local backend adds to a job, and `run_pipeline.py --help` start-up.

    python bench/speed.py [--rows N] [--steps N] [--repeat N] [--rounds N] [--inference-rounds N]

Prints a table and writes bench/results.json (with the machine: CPU, how many CPUs name
amx_tile, whether it computes bf16 natively, what auto applied, the date). Checkpoint cost:
bench/checkpoint_cost.py; the loop's cost a step against the Trainer's: bench/loop_overhead.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from pipeline.stages import HUB_OFFLINE  # noqa: E402

# Offline as every job of a run is: with only huggingface_hub's switch, a machine whose network
# does not reach the Hub waits on it (30 s a smoke run).
for variable in HUB_OFFLINE:
    os.environ.setdefault(variable, "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("SMPIPE_USER_FUNCTIONS", "user_functions")  # names.USER_FUNCTIONS_VARIABLE

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    pipeline,
)

from bench.loader import loader_rates  # noqa: E402
from steps import export as export_step  # noqa: E402
from steps import inference as inference_step  # noqa: E402
from steps import precision as precision_step  # noqa: E402
from steps import prepare as prepare_step  # noqa: E402
from steps import train as train_step  # noqa: E402
from steps.batching import Batches, write_inputs  # noqa: E402
from steps.hyperparameters import parse_hyperparameters  # noqa: E402
from steps.prepared_files import encoding_record, write_encoding  # noqa: E402
from steps.runtime import names  # noqa: E402
from steps.runtime.environment import TrainingEnv  # noqa: E402
from steps.user_code import load_user_functions  # noqa: E402
from user_functions import minilm_path  # noqa: E402
from user_functions.demo_data import bbc_articles  # noqa: E402

MAX_LENGTH = 128
BATCH = 16
WARM = 2  # optimizer steps before the clock starts, on both sides
# Our training job's hyperparameters in every training measure (the Trainer's get the same).
HYPERPARAMETERS = {
    "model_name": "minilm",
    "epochs": "1",
    "learning_rate": "1e-4",
    "batch_size": str(BATCH),
    "max_per_device_batch_size": str(BATCH),
    "warmup_ratio": "0.1",
    "weight_decay": "0.01",
    "seed": "42",
    "checkpoint_every_steps": "0",
    "keep_checkpoints": "1",
    "wandb_project": "b",
    "wandb_mode": "disabled",
}
# Where the CPU has no native bf16, the bf16 peers run 5x (inference) to 17x (a training step,
# whose backward matmuls take a slower bf16 kernel than the forward's: 30 s against 1 s in
# fp32, MiniLM 16 x 128, 2 threads) slower than fp32, and do this share of the others' work:
# a quarter of the timed steps after one warm-up step, a quarter of the rows. Their rates are
# per example, and the ratio to them is far from 1 there, which this much work measures well;
# where bf16 is native they do all of it.
BF16_SHARE_WITHOUT_NATIVE = 4
# MIXED_PRECISION's values (steps/precision.py) as this bench names a side's precision.
PRECISION_NAMES = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
datasets.disable_progress_bars()


def texts(rows: int) -> dict[str, tuple[list[str], list[int]]]:
    """Long texts (whole articles) and short ones (each article's lead sentence), same labels."""
    articles = bbc_articles()
    rng = np.random.default_rng(0)
    picked = [articles[i] for i in rng.permutation(len(articles))[:rows]]
    names = sorted({label for label, _ in articles})
    long, short, labels = [], [], []
    for label, path in picked:
        lines = [
            line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()
        ]
        long.append(" ".join(" ".join(lines).split()))
        lead = lines[1] if len(lines) > 1 else lines[0]
        short.append(lead.split(". ")[0])
        labels.append(names.index(label))
    return {"long": (long, labels), "short": (short, labels)}


def median(values: list[float]) -> float:
    return statistics.median(values)


def paired_ratio(ours: list[float], theirs: list[float]) -> float:
    """The median over rounds of theirs / ours (times measured back to back in each round):
    this machine's speed drifts by up to 2x within a minute, and a ratio taken within a
    round cancels the drift that a ratio of medians keeps."""
    return median([t / o for o, t in zip(ours, theirs, strict=True)])


# -- 1. training ---------------------------------------------------------------------------


def prepared_dir(tokenizer, data: tuple[list[str], list[int]], root: Path) -> dict[str, Path]:
    """The channels our training job reads, as prepare writes them."""
    text, labels = data
    enc = tokenizer(text, truncation=True, max_length=MAX_LENGTH)
    table = datasets.Dataset.from_dict(
        {
            "minilm_input_ids": enc["input_ids"],
            "minilm_attention_mask": enc["attention_mask"],
            "minilm__length": [len(x) for x in enc["input_ids"]],
            "label_id": labels,
        }
    )
    table.save_to_disk(str(root / "train"))
    table.select(range(min(32, len(table)))).save_to_disk(str(root / "validation"))
    (root / "labels").mkdir(parents=True, exist_ok=True)
    (root / "labels/id2label.json").write_text(json.dumps({str(i): f"l{i}" for i in range(5)}))
    write_inputs(
        root / "labels",
        {
            "minilm": {
                "keys": ["input_ids", "attention_mask"],
                "pad": {"input_ids": tokenizer.pad_token_id, "attention_mask": 0},
                "sequence": ["input_ids", "attention_mask"],
            }
        },
    )
    write_encoding(root / "labels", encoding_record(MAX_LENGTH, {"minilm": {}}))
    return {c: root / c for c in ("train", "validation", "labels")}


def our_job(channels: dict[str, Path], root: Path, **hyperparameters: str):
    """Our training job set up (steps/train.py's `set_up`) in this process, on the prepared
    `channels`, with HYPERPARAMETERS and `hyperparameters` over them: its loop is
    `train_step.train_epoch(job)`."""
    hp = parse_hyperparameters({**HYPERPARAMETERS, "max_steps": "0", **hyperparameters})
    for sub in ("model", "out", "ckpt"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    env = TrainingEnv(
        model_dir=root / "model",
        output_data_dir=root / "out",
        checkpoint_dir=root / "ckpt",
        failure_file=root / "failure",
        channels=channels,
        hyperparameters=hp,
        hosts=["algo-1"],
        current_host="algo-1",
        num_gpus=torch.cuda.device_count(),
        num_cpus=os.cpu_count() or 1,
        job_name="bench",
    )
    # Every side trains in this one process, and a Trainer leaves Accelerate's process-wide
    # state at its precision, which our job's Accelerator may not change (a job is a process
    # of its own and never meets this): reset as the Trainer does before building its own
    # (transformers' training_args.py) and Accelerate's tests do between cases.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return train_step.set_up(hp, env)


def ours_training(channels: dict[str, Path], root: Path, steps: int) -> dict:
    job = our_job(channels, root)
    job.total_steps = WARM
    train_step.train_epoch(job)
    job.total_steps = WARM + steps
    started = time.perf_counter()
    train_step.train_epoch(job)
    seconds = time.perf_counter() - started
    batches = job.sampler.global_batches()[WARM : WARM + steps]
    # The shapes the model saw: the loader's own padding of those batches, untimed.
    shapes = [tuple(job.train_loader.collate_fn(b)[job.keys[0]].shape) for b in batches]
    return {
        **loader_rates(job.train_loader),  # the job's loader over one epoch, no model
        "seconds": seconds,
        "examples": steps * BATCH,
        "real_tokens": sum(int(job.sampler.lengths[b].sum()) for b in batches),
        "tokens": sum(rows * width for rows, width in shapes),
        "shapes": shapes,
        "precision": PRECISION_NAMES[job.settings["mixed_precision"]],
    }


class ClockAt(TrainerCallback):
    def __init__(self, first: int, last: int):
        self.first, self.last, self.times = first, last, {}

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in (self.first, self.last):
            self.times[state.global_step] = time.perf_counter()


class CountingCollator(DataCollatorWithPadding):
    """DataCollatorWithPadding, counting real and padded tokens of the timed steps."""

    def __call__(self, features):
        batch = super().__call__(features)
        mask = batch["attention_mask"]
        self.seen.append((int(mask.sum()), tuple(mask.shape)))
        return batch


def trainer_training(tokenizer, data, root: Path, steps: int, bf16: bool, warm: int = WARM) -> dict:
    """The Trainer at its best CPU settings: grouped by length, padded per batch, and bf16
    (`bf16=True`: Accelerate's torch.autocast) or fp32, the faster of which depends on the CPU."""
    text, labels = data
    enc = tokenizer(text, truncation=True, max_length=MAX_LENGTH)
    train = datasets.Dataset.from_dict(
        {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}
    )
    torch.manual_seed(42)
    model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=5)
    collator = CountingCollator(tokenizer)
    collator.seen = []
    clock = ClockAt(warm, warm + steps)
    args = TrainingArguments(
        output_dir=str(root),
        per_device_train_batch_size=BATCH,
        train_sampling_strategy="group_by_length",
        max_steps=warm + steps,
        learning_rate=1e-4,
        weight_decay=0.01,
        bf16=bf16,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        seed=42,
    )
    Trainer(
        model=model, args=args, train_dataset=train, data_collator=collator, callbacks=[clock]
    ).train()
    timed = collator.seen[warm : warm + steps]
    return {
        "seconds": clock.times[warm + steps] - clock.times[warm],
        "examples": steps * BATCH,
        "real_tokens": sum(real for real, _ in timed),
        "tokens": sum(rows * width for _, (rows, width) in timed),
        "shapes": [shape for _, shape in timed],
        "precision": "bf16" if bf16 else "fp32",
    }


# -- model FLOPs, and the most a matmul reaches here ----------------------------------------


def encoder_flops(config, shapes: list[tuple[int, int]], backward: bool = False) -> dict[str, int]:
    """Matmul FLOPs of a BERT-like encoder with a sequence-classification head, over batches
    of the given (rows, width) shapes: padding included, as it is computed. Split into parts:

    - linear: per token, 2 FLOPs per weight of the layers' matrices (Q, K, V, the attention
      output, the two feed-forward ones): the "2 x non-embedding parameters" of Kaplan et al.
      2020 (Scaling Laws, table 1) without biases and norms, which are not matmuls;
    - attention: per token, QK^T and AV, 2 x width x hidden FLOPs each per layer: the
      4 x layers x hidden x width of PaLM's count (Chowdhery et al. 2022, appendix B; there
      12 for training), exact for an encoder, which attends to every position;
    - head: the pooler and classifier, on each row's first token only.

    A backward pass computes two matmuls per forward one (the gradient of the input and of
    the weight), so training is 3x the forward. tests/test_bench_flops.py holds this to
    torch's FlopCounterMode on the real MiniLM."""
    layers, hidden, inner = config.num_hidden_layers, config.hidden_size, config.intermediate_size
    per_token = 2 * layers * (4 * hidden * hidden + 2 * hidden * inner)
    parts = {"linear": 0, "attention": 0, "head": 0}
    for rows, width in shapes:
        parts["linear"] += per_token * rows * width
        parts["attention"] += 4 * layers * hidden * width * rows * width
        parts["head"] += 2 * rows * (hidden * hidden + hidden * config.num_labels)
    return {part: (3 if backward else 1) * flops for part, flops in parts.items()}


def model_flops(config, shapes: list[tuple[int, int]], backward: bool = False) -> int:
    return sum(encoder_flops(config, shapes, backward).values())


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
PEAK_SIZES = (512, 1024, 2048, 3072)
PEAK_SECONDS = 2.0  # the longest one product may take (estimated from the size below it)


def matmul_peak(dtype: torch.dtype) -> dict:
    """The most FLOP/s a matmul in `dtype` reaches on this machine, the ceiling for model
    FLOP/s: square matrices of PEAK_SIZES, as `a @ b` and as nn.Linear lays its weight out
    (`x @ w.T`), the best of up to 5 products each after one to warm up. Larger matrices come
    closer to the peak, but not in every layout: bf16 without native bf16 runs in a fallback
    kernel that reached 18 GFLOP/s here as `x @ w.T` and under 1 GFLOP/s as `a @ b` (one 2048
    product of those would take over a minute), so a size whose product would take over
    PEAK_SECONDS at the rate of the size below is not tried."""
    best = {"flops_per_s": 0.0}
    for layout in ("a @ b", "x @ w.T"):
        rate = None
        for n in PEAK_SIZES:
            flops = 2 * n**3
            if rate and flops / rate > PEAK_SECONDS:
                break
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            if layout == "x @ w.T":
                b = b.t()
            a @ b
            started, runs = time.perf_counter(), []
            while len(runs) < 5 and (len(runs) < 2 or time.perf_counter() - started < 3):
                begun = time.perf_counter()
                a @ b
                runs.append(flops / (time.perf_counter() - begun))
            rate = max(runs)
            if rate > best["flops_per_s"]:
                best = {"flops_per_s": rate, "size": n, "layout": layout}
    return best


def matmul_peaks(before: dict | None = None) -> dict[str, dict]:
    """Each precision's peak, or the better of it and `before`'s: measured at the start and
    again at the end, as other work on the machine can hold one measurement down."""
    now = {name: matmul_peak(dtype) for name, dtype in PRECISIONS.items()}
    if before is None:
        return now
    return {
        name: max(now[name], before[name], key=lambda peak: peak["flops_per_s"]) for name in now
    }


def add_mfu(tables: list[dict], peaks: dict) -> None:
    """MFU for every side that counted its model FLOP/s: against the peak of the precision it
    ran in, and against the bf16 peak (model FLOP/s over the most a bf16 matmul
    reaches here; on a CPU without native bf16 an fp32 side exceeds 100% of it)."""
    for table in tables:
        for sides in table.values():
            for name in [
                key.removesuffix("_precision") for key in sides if key.endswith("_precision")
            ]:
                flops = sides[f"{name}_model_flops_per_s"]
                sides[f"{name}_mfu"] = flops / peaks[sides[f"{name}_precision"]]["flops_per_s"]
                sides[f"{name}_mfu_vs_bf16_peak"] = flops / peaks["bf16"]["flops_per_s"]


def against_peers(runs: dict[str, list[dict]], peer: str, config, backward: bool) -> dict:
    """Ours against a peer run in bf16 and in fp32 in the same rounds: rates, paired ratios
    against each and against the peer at its best (whichever precision is faster by median:
    the one a user would pick), and model FLOP/s (MFU follows the peak: `add_mfu`)."""
    out = {}
    per_example = {}
    for name, done in runs.items():
        per_example[name] = [run["seconds"] / run["examples"] for run in done]
        flops = median(
            [model_flops(config, run["shapes"], backward) / run["seconds"] for run in done]
        )
        out[f"{name}_examples_per_s"] = median([run["examples"] / run["seconds"] for run in done])
        out[f"{name}_precision"] = done[0]["precision"]
        out[f"{name}_model_flops_per_s"] = flops
    for precision in PRECISIONS:
        side = f"{peer}_{precision}"
        out[f"ratio_vs_{side}"] = paired_ratio(per_example["ours"], per_example[side])
    best = max(PRECISIONS, key=lambda p: out[f"{peer}_{p}_examples_per_s"])
    out[f"{peer}_best"] = best
    out[f"ratio_vs_{peer}_best"] = out[f"ratio_vs_{peer}_{best}"]
    return out


def rotated(names: list[str], round_: int) -> list[str]:
    """The sides in a round's order: each round starts one later, so no side always runs
    first (after a slow one, or in a process the others have warmed)."""
    shift = round_ % len(names)
    return names[shift:] + names[:shift]


def bench_training(
    corpora, tokenizer, steps: int, repeat: int, work: Path, bf16_share: int = 1
) -> dict:
    config = AutoConfig.from_pretrained(minilm_path(), num_labels=5)
    bf16_steps, bf16_warm = (steps, WARM) if bf16_share == 1 else (max(1, steps // bf16_share), 1)
    sides = {
        "ours": lambda data, channels, root: ours_training(channels, root, steps),
        "trainer_bf16": lambda data, channels, root: trainer_training(
            tokenizer, data, root, bf16_steps, bf16=True, warm=bf16_warm
        ),
        "trainer_fp32": lambda data, channels, root: trainer_training(
            tokenizer, data, root, steps, bf16=False
        ),
    }
    out = {}
    for kind, data in corpora.items():
        channels = prepared_dir(tokenizer, data, work / f"prepared-{kind}")
        runs = {name: [] for name in sides}
        for r in range(repeat):
            for name in rotated(list(sides), r):
                runs[name].append(sides[name](data, channels, work / f"{name}-{kind}-{r}"))
        out[kind] = (
            against_peers(runs, "trainer", config, backward=True)
            | {
                f"{name}_real_token_share": done[0]["real_tokens"] / done[0]["tokens"]
                for name, done in runs.items()
            }
            | loader_against_loop(runs["ours"])
        )
    return out


def loader_rows(table: dict) -> list[tuple]:
    """print_table's lines for our loader beside our loop (`loader_against_loop`)."""
    count, times = "{:,.0f}", "{:,.0f}x"
    return [
        ("training rows/s, our loader's collate alone", table, "ours_collate_rows_per_s", count),
        ("  collate / our loop", table, "ours_collate_over_loop", times),
        ("training rows/s, our job's DataLoader", table, "ours_loader_rows_per_s", count),
        ("  DataLoader / our loop", table, "ours_loader_over_loop", times),
    ]


def loader_against_loop(ours: list[dict]) -> dict:
    """Our loader's rows a second (its collate alone, and the whole DataLoader) beside our
    loop's, and the median over rounds of loader / loop, each taken in its round."""
    out = {}
    for part in ("collate", "loader"):
        rates = [run[f"{part}_rows_per_s"] for run in ours]
        out[f"ours_{part}_rows_per_s"] = median(rates)
        out[f"ours_{part}_over_loop"] = median(
            [rate * run["seconds"] / run["examples"] for rate, run in zip(rates, ours, strict=True)]
        )
    return out


TRAINER_SCRIPT = """
import sys, time
import datasets, torch
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                          Trainer, TrainerCallback, TrainingArguments)
path, data, out, steps, same_work = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"

class Loop(TrainerCallback):  # the training steps alone, as our job's train_loop_seconds
    first = last = None
    def on_step_begin(self, args, state, control, **kwargs):
        self.first = self.first or time.perf_counter()
    def on_step_end(self, args, state, control, **kwargs):
        self.last = time.perf_counter()

def compute_metrics(prediction):
    from sklearn.metrics import accuracy_score, f1_score
    predicted = prediction.predictions.argmax(-1)
    return {"accuracy": accuracy_score(prediction.label_ids, predicted),
            "f1": f1_score(prediction.label_ids, predicted, average="macro")}

tokenizer = AutoTokenizer.from_pretrained(path)
train = datasets.load_from_disk(data)
model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=5)
# What our job also does: validate each epoch, checkpoint, keep the best model by F1.
work = dict(eval_strategy="epoch", save_strategy="epoch", load_best_model_at_end=True,
            metric_for_best_model="f1", save_total_limit=1) if same_work else dict(save_strategy="no")
args = TrainingArguments(output_dir=out, per_device_train_batch_size=16, per_device_eval_batch_size=16,
                         max_steps=steps, train_sampling_strategy="group_by_length", report_to=[],
                         logging_strategy="no", disable_tqdm=True, use_cpu=True, learning_rate=1e-4, **work)
loop = Loop()
trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=DataCollatorWithPadding(tokenizer),
                  eval_dataset=train.select(range(32)) if same_work else None,
                  compute_metrics=compute_metrics if same_work else None, callbacks=[loop])
trainer.train()
trainer.save_model(out + "/model")
if same_work:  # and the program our job writes by default (TorchScript), as the PyTorch docs write it
    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model
        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits
    wrapper = Logits(trainer.model.eval())
    sample = tokenizer(["a short one", "a somewhat longer sentence than that"], padding=True, return_tensors="pt")
    example = (sample["input_ids"], sample["attention_mask"])
    with torch.no_grad():
        torch.jit.trace(wrapper, example, strict=False).save(out + "/model.torchscript.pt")
print("LOOP", loop.last - loop.first)
"""


def bench_fixed_cost(tokenizer, data, steps: int, repeat: int, work: Path) -> dict:
    """Wall time of a whole training job minus its training loop: imports, data and model
    loading, export, teardown. Ours through the image's entrypoint (what every backend runs,
    including its validation and the export [inference] MODEL_FORMAT needs), started cold (a
    fresh interpreter, as in a container) and warm (forked by the local backend's fork server,
    which imported the libraries before), against a Trainer script that trains the same
    steps and saves the model (the bare yardstick), and one that also does our job's work:
    validates, checkpoints, keeps the best model by F1, writes TorchScript (the program
    [inference] MODEL_FORMAT needs by default, all ours writes then).
    The loop is the training steps alone on every side (ours: train_loop_seconds; the
    Trainer's: its first step's start to its last step's end)."""
    from pipeline.player.environment import image_env
    from pipeline.player.fork_client import WarmStart
    from pipeline.player.job_root import lay_out_training
    from steps.runtime.names import ENTRYPOINT

    channels = prepared_dir(tokenizer, data, work / "fixed-prepared")
    text, labels = data
    enc = tokenizer(text, truncation=True, max_length=MAX_LENGTH)
    datasets.Dataset.from_dict(
        {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}
    ).save_to_disk(str(work / "fixed-hf"))
    (work / "trainer.py").write_text(TRAINER_SCRIPT)
    hps = {**HYPERPARAMETERS, "max_steps": str(steps)}

    def link(uri: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        local.symlink_to(uri, target_is_directory=True)

    def job(name: str, steps_: int) -> tuple[Path, dict]:
        root = work / name
        request = {
            "InputDataConfig": [
                {"ChannelName": c, "DataSource": {"S3DataSource": {"S3Uri": str(p)}}}
                for c, p in channels.items()
            ],
            "ResourceConfig": {"InstanceType": "local", "InstanceCount": 1},
        }
        lay_out_training(
            request, root, "algo-1", ["algo-1"], link, {**hps, "max_steps": str(steps_)}
        )
        env = {
            **os.environ,
            **image_env(root),
            names.USER_FUNCTIONS_VARIABLE: "user_functions",
            "PYTHONPATH": str(ROOT),
            "TRAINING_JOB_NAME": "fixed-cost",
        }
        return root, env

    argv = [sys.executable, *ENTRYPOINT[1:], "train"]

    def run(env: dict, warm: bool) -> None:
        """The job, through the entrypoint: cold (a fresh interpreter) or warm (forked)."""
        proc = starter.start(argv, env, ROOT) if warm else None
        if proc is None:
            subprocess.run(argv, env=env, cwd=ROOT, check=True, capture_output=True)
            return
        proc.stdout.read()
        if proc.wait() != 0:
            sys.exit(f"a warm-started job failed: {env['SMPIPE_ML_ROOT']}")

    # The local backend's warm start (pipeline/player/fork_client.py): its first job of an
    # environment starts cold and its second starts the server; two one-step jobs do that
    # here, untimed, so the timed warm jobs start from a server that is up, as a run's later
    # jobs do.
    starter = WarmStart(work / "warm-start")
    for n in range(2):
        run(job(f"fixed-prime-{n}", 1)[1], warm=True)
    runs = {"ours": [], "ours_warm": [], "trainer": [], "trainer_same_work": []}
    phases = {"ours": [], "ours_warm": []}
    for r in range(repeat):
        for name, warm in (("ours", False), ("ours_warm", True)):
            root, env = job(f"fixed-{name}-{r}", steps)
            started = time.perf_counter()
            run(env, warm)
            wall = time.perf_counter() - started
            report = json.loads((root / "output/data/step_metadata.json").read_text())
            runs[name].append((wall, report["train_loop_seconds"]))
            phases[name].append(report["seconds_outside_steps"])

        for name, same_work in (("trainer", "0"), ("trainer_same_work", "1")):
            started = time.perf_counter()
            done = subprocess.run(
                [
                    sys.executable,
                    str(work / "trainer.py"),
                    minilm_path(),
                    str(work / "fixed-hf"),
                    str(work / f"fixed-{name}-{r}"),
                    str(steps),
                    same_work,
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            wall = time.perf_counter() - started
            loop = next(line for line in done.stdout.splitlines() if line.startswith("LOOP"))
            runs[name].append((wall, float(loop.split()[1])))
    starter.close()
    out = {}
    for name, times in runs.items():
        out[f"{name}_fixed_s"] = median([wall - loop for wall, loop in times])
        out[f"{name}_loop_s"] = median([loop for _, loop in times])
    for name, reports in phases.items():  # where our fixed cost goes, phase by phase
        out[f"{name}_phases_s"] = {k: median([p[k] for p in reports]) for k in reports[0]}
    return out


# -- 2. inference ----------------------------------------------------------------------------


class Recording:
    """A program as run_batches calls it, noting each pass's shape: the FLOPs it computed."""

    def __init__(self, program):
        self.program, self.shapes = program, []

    def __call__(self, *inputs):
        self.shapes.append(tuple(inputs[0].shape))
        return self.program(*inputs)


def bench_inference(
    corpora, tokenizer, rounds: int, work: Path, bf16_share: int = 1, batch_size: int = 64
) -> dict:
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=5).eval()
    keys = ["input_ids", "attention_mask"]
    sample = tokenizer(
        ["a short one", "a somewhat longer sentence than that"], padding=True, return_tensors="pt"
    )
    inputs = {
        "keys": keys,
        "pad": {"input_ids": tokenizer.pad_token_id, "attention_mask": 0},
        "sequence": keys,
    }
    # The TorchScript program as the training job writes it (steps/export.py), traced on two
    # rows of different lengths.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracing warns about every branch it freezes
        export_step.write_torchscript(
            export_step.LogitsOnly(model, keys).eval(),
            tuple(sample[k] for k in keys),
            keys,
            inputs,
            work / "model.torchscript.pt",
        )
        scripted = export_step.LOADERS["torchscript"](work / "model.torchscript.pt").eval()
    program = Recording(scripted)
    applied = precision_step.resolve("auto", 0)
    # Every side runs the same weights, the new head's included. The pipelines load them as a
    # user does, in the dtype asked for: transformers 5's `dtype` (`torch_dtype` before, now
    # its deprecated alias) casts the whole model, so the pipeline's bf16 is bf16 weights,
    # not autocast.
    saved = work / "model-hf"
    model.save_pretrained(saved)
    tokenizer.save_pretrained(saved)
    pipes, pipe_shapes = {}, {}
    for name, dtype in PRECISIONS.items():
        pipes[name] = pipeline(
            "text-classification",
            model=str(saved),
            dtype=dtype,
            device=-1,
            batch_size=batch_size,
            truncation=True,
            max_length=MAX_LENGTH,
        )
        pipe_shapes[name] = []
        pipes[name].model.register_forward_pre_hook(
            lambda _, args, kwargs, shapes=pipe_shapes[name]: shapes.append(
                tuple(kwargs["input_ids"].shape)
            ),
            with_kwargs=True,
        )

    def ours(text):
        enc = tokenizer(text, truncation=True, max_length=MAX_LENGTH)
        table = pa.table(
            {
                "m_input_ids": enc["input_ids"],
                "m_attention_mask": enc["attention_mask"],
                "m__length": [len(x) for x in enc["input_ids"]],
            }
        )
        batches = Batches(table, "m", keys, inputs, labels=False)
        program.shapes = []
        logits = inference_step.run_batches(program, batches, keys, batch_size, applied)
        return logits.argmax(-1).tolist(), program.shapes, PRECISION_NAMES[applied.applied]

    def pipeline_in(precision):
        def run(text):
            pipe_shapes[precision].clear()
            labels = [int(r["label"].split("_")[-1]) for r in pipes[precision](text)]
            return labels, list(pipe_shapes[precision]), precision

        return run

    def one_at_a_time(text):  # the seed's loop: one row at a time, padded to the maximum
        labels = []
        with torch.inference_mode():
            for row in text:
                enc = tokenizer(row, truncation=True, max_length=MAX_LENGTH,
                                padding="max_length", return_tensors="pt")  # fmt: skip
                labels.append(int(scripted(*(enc[k] for k in keys)).argmax(-1)))
        return labels, [(1, MAX_LENGTH)] * len(text), "fp32"

    sides = {
        "ours": ours,
        "pipeline_bf16": pipeline_in("bf16"),
        "pipeline_fp32": pipeline_in("fp32"),
        "one_at_a_time": one_at_a_time,
    }
    config = model.config
    out = {}
    for kind, (text, _) in corpora.items():
        for side in sides.values():  # warm-up: a batch on every side
            side(text[:batch_size])
        rows = {name: text for name in sides}
        rows["pipeline_bf16"] = text[: max(batch_size, len(text) // bf16_share)]
        runs = {name: [] for name in sides}
        predicted = {}
        for r in range(rounds):
            for name in rotated(list(sides), r):
                started = time.perf_counter()
                predicted[name], shapes, precision = sides[name](rows[name])
                seconds = time.perf_counter() - started
                runs[name].append({"seconds": seconds, "examples": len(rows[name]),
                                   "shapes": shapes, "precision": precision})  # fmt: skip
        compared = {name: runs[name] for name in ("ours", "pipeline_bf16", "pipeline_fp32")}
        per_example = {
            name: [x["seconds"] / x["examples"] for x in done] for name, done in runs.items()
        }
        # bf16 may turn a close call: agreement is counted, and exact agreement asserted among
        # the sides that ran in fp32.
        agreement = {
            name: float(np.mean(np.array(labels) == predicted["pipeline_fp32"][: len(labels)]))
            for name, labels in predicted.items()
            if name != "pipeline_fp32"
        }
        fp32 = [name for name, done in runs.items() if done[0]["precision"] == "fp32"]
        assert all(agreement.get(name, 1.0) == 1.0 for name in fp32), (
            f"{kind}: the sides that ran in fp32 ({', '.join(fp32)}) disagree on a prediction"
        )
        out[kind] = against_peers(compared, "pipeline", config, backward=False) | {
            "one_at_a_time_examples_per_s": median([1 / x for x in per_example["one_at_a_time"]]),
            "ratio_vs_one_at_a_time": paired_ratio(
                per_example["ours"], per_example["one_at_a_time"]
            ),
            "agreement_with_pipeline_fp32": agreement,
        }
    return out


# -- 3. preparation --------------------------------------------------------------------------


def bench_prepare(corpora, tokenizer, repeat: int) -> dict:
    functions = load_user_functions("user_functions")
    out = {}
    for kind, (text, labels) in corpora.items():
        table = datasets.Dataset.from_dict({"text": text, "label_id": labels})
        runs = {"ours": [], "one_call": [], "load_and_one_call": [], "unbatched_map": []}
        for _ in range(repeat + 1):
            started = time.perf_counter()
            tokenizer(text, truncation=True, max_length=MAX_LENGTH)
            runs["one_call"].append(time.perf_counter() - started)

            # Ours loads the tokenizer (the user's load_tokenizer) before it encodes: so here.
            started = time.perf_counter()
            AutoTokenizer.from_pretrained(minilm_path())(
                text, truncation=True, max_length=MAX_LENGTH
            )
            runs["load_and_one_call"].append(time.perf_counter() - started)

            started = time.perf_counter()
            with open(os.devnull, "w") as quiet:
                stdout, sys.stdout = sys.stdout, quiet
                try:
                    prepare_step.encode_for(table, functions, "minilm", MAX_LENGTH)
                finally:
                    sys.stdout = stdout
            runs["ours"].append(time.perf_counter() - started)

            started = time.perf_counter()
            table.map(
                lambda r: tokenizer(r["text"], truncation=True, max_length=MAX_LENGTH),
                load_from_cache_file=False,
            )
            runs["unbatched_map"].append(time.perf_counter() - started)
        rate = {name: len(text) / median(times[1:]) for name, times in runs.items()}
        out[kind] = {
            **{f"{name}_rows_per_s": r for name, r in rate.items()},
            **{
                f"ratio_vs_{name}": paired_ratio(runs["ours"][1:], runs[name][1:])
                for name in ("one_call", "load_and_one_call", "unbatched_map")
            },
        }
    return out


# -- 4. orchestration ------------------------------------------------------------------------


def bench_orchestration(repeat: int, work: Path) -> dict:
    import configparser

    from pipeline.backends.local import LocalBackend
    from pipeline.code_bundle import ship_code
    from pipeline.config import load_settings
    from pipeline.paths import ExperimentTree
    from pipeline.sources import upload_raw
    from pipeline.stages import build_jobs
    from pipeline.store import LocalStore
    from user_functions.demo_data import write_demo

    shipped = configparser.ConfigParser(interpolation=None, delimiters=("=",))
    shipped.optionxform = str.upper
    shipped.read(ROOT / "settings.ini")
    shipped.set("experiment", "STORE", str(work / "store"))
    with open(work / "settings.ini", "w") as f:
        shipped.write(f)
    settings = load_settings(work / "settings.ini", env={})
    store = LocalStore(settings.store_uri())
    tree = ExperimentTree(settings.experiment.name)
    write_demo(work / "raw", per_label=5)
    upload_raw(store, tree, work / "raw")
    overhead = []
    for r in range(repeat):
        run = tree.run(900 + r)
        ship_code(settings, store, run.code)
        from pipeline.sources import Sources

        sources = Sources(raw=tree.raw)
        job = build_jobs(settings, ["reconcile"], run, sources)[0]
        backend = LocalBackend(
            store, run, echo=open(os.devnull, "w"), work_root=str(work / f"jobs{r}")
        )
        started = time.perf_counter()
        result = backend.run_processing(job)
        wall = time.perf_counter() - started
        assert result.status == "Completed", result.failure_reason
        overhead.append(wall - result.seconds)
    helps = []
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, str(ROOT / "run_pipeline.py"), "--help"],
            check=True,
            capture_output=True,
        )
        helps.append(time.perf_counter() - started)
    python = []
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        python.append(time.perf_counter() - started)
    return {
        "local_job_overhead_s": median(overhead),
        "help_startup_s": median(helps),
        "bare_python_startup_s": median(python),
    }


def print_fixed_cost(f: dict, steps: int) -> None:
    print(
        f"  training job outside its loop ({steps} steps): ours {f['ours_fixed_s']:.1f}s "
        f"(loop {f['ours_loop_s']:.1f}s), Trainer script {f['trainer_fixed_s']:.1f}s "
        f"(loop {f['trainer_loop_s']:.1f}s); ratio {f['ours_fixed_s'] / f['trainer_fixed_s']:.2f}x"
    )
    print(
        f"  the same, ours warm-started (the local backend): {f['ours_warm_fixed_s']:.1f}s "
        f"(loop {f['ours_warm_loop_s']:.1f}s); ratio "
        f"{f['ours_warm_fixed_s'] / f['trainer_fixed_s']:.2f}x"
    )
    for name in ("ours", "ours_warm"):
        said = ", ".join(f"{k} {v:.2f}" for k, v in f[f"{name}_phases_s"].items())
        print(f"    {name} outside its steps, by phase (s): {said}")
    print(
        f"  the same, against a Trainer script doing our job's work (validation, checkpoint, best model, "
        f"TorchScript): {f['trainer_same_work_fixed_s']:.1f}s "
        f"(loop {f['trainer_same_work_loop_s']:.1f}s); ratio "
        f"{f['ours_fixed_s'] / f['trainer_same_work_fixed_s']:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument(
        "--rows", type=int, default=256, help="texts per corpus for inference (default 256)"
    )
    parser.add_argument(
        "--train-rows",
        type=int,
        default=1779,
        help="texts per corpus training draws its batches from (default 1779, the demo's training split)",
    )
    parser.add_argument(
        "--prepare-rows",
        type=int,
        default=2225,
        help="texts per corpus for prepare (default all 2225)",
    )
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps (default 6)")
    parser.add_argument(
        "--repeat", type=int, default=3, help="training and job repetitions, median (default 3)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="prepare rounds, median (default 5)")
    parser.add_argument(
        "--inference-rounds", type=int, default=3, help="inference rounds, median (default 3)"
    )
    parser.add_argument(
        "--only-fixed-cost",
        action="store_true",
        help="measure only the training job's fixed cost (updates that part of results.json)",
    )
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    work = Path(tempfile.mkdtemp(prefix="smpipe-speed-"))
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    corpora = texts(args.rows)
    if args.only_fixed_cost:
        results = json.loads((ROOT / "bench/results.json").read_text())
        results["training_job_fixed_cost"] = bench_fixed_cost(
            tokenizer, texts(args.rows)["long"], args.steps, args.repeat, work
        )
        (ROOT / "bench/results.json").write_text(json.dumps(results, indent=2))
        print_fixed_cost(results["training_job_fixed_cost"], args.steps)
        return
    facts = machine()
    share = 1 if facts["native_bf16"] else BF16_SHARE_WITHOUT_NATIVE
    results = {
        "machine": facts,
        "settings": vars(args)
        | {"batch": BATCH, "max_length": MAX_LENGTH, "bf16_peers_share_of_work": 1 / share},
    }
    seconds = {}

    def timed(name: str, measure):
        started = time.perf_counter()
        results[name] = measure()
        seconds[name] = seconds.get(name, 0) + time.perf_counter() - started

    timed("matmul_peak", matmul_peaks)
    # Inference first, in a process that has not trained: as the inference job runs. After
    # training, glibc's malloc has raised its mmap threshold and a pass's big tensors no
    # longer cost page faults, which hides what holding passes to a token budget saves.
    timed(
        "inference",
        lambda: bench_inference(corpora, tokenizer, args.inference_rounds, work, share),
    )
    timed(
        "training",
        lambda: bench_training(
            texts(args.train_rows), tokenizer, args.steps, args.repeat, work, share
        ),
    )
    timed("prepare", lambda: bench_prepare(texts(args.prepare_rows), tokenizer, args.rounds))
    timed("orchestration", lambda: bench_orchestration(args.repeat, work))
    timed(
        "training_job_fixed_cost",
        lambda: bench_fixed_cost(
            tokenizer, texts(args.rows)["long"], args.steps, args.repeat, work
        ),
    )
    before = results.pop("matmul_peak")
    timed("matmul_peak", lambda: matmul_peaks(before))
    add_mfu([results["training"], results["inference"]], results["matmul_peak"])
    results["seconds"] = seconds | {"total": sum(seconds.values())}
    (ROOT / "bench/results.json").write_text(json.dumps(results, indent=2))
    print_table(results, args)


def cpu_model() -> str:
    """The CPU's name as the kernel reports it (Linux), else what Python's platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def amx_tile_cpus() -> int:
    """CPUs whose flags name amx_tile (Intel AMX, native bf16 matmuls): `grep -c amx_tile
    /proc/cpuinfo`; 0 where there is no such file."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return 0
    return sum(1 for line in lines if line.startswith("flags") and " amx_tile" in line)


def machine() -> dict:
    native, why = precision_step.cpu_bf16()
    applied = precision_step.resolve("auto", 0)
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "amx_tile_cpus": amx_tile_cpus(),
        "threads": torch.get_num_threads(),
        "native_bf16": native,
        "native_bf16_why": why,
        "auto_applied": PRECISION_NAMES[applied.applied],
        "auto_reason": applied.reason,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
    }


def print_table(results: dict, args) -> None:
    m, peaks = results["machine"], results["matmul_peak"]
    t, i, p, o = (results[k] for k in ("training", "inference", "prepare", "orchestration"))
    print(
        f"\nspeed: MiniLM, max length {MAX_LENGTH}, batch {BATCH}, texts per corpus: training "
        f"{args.train_rows}, inference {args.rows}, prepare {args.prepare_rows}; median of "
        f"{args.repeat} (training, jobs), {args.inference_rounds} rounds (inference) or "
        f"{args.rounds} (prepare) (bench/results.json)"
    )
    print(
        f"  {m['cpu']} (amx_tile on {m['amx_tile_cpus']} of {m['cpus']} CPUs), "
        f"{m['threads']} threads, {m['date']}: "
        f"{'native' if m['native_bf16'] else 'no native'} bf16 ({m['native_bf16_why']})"
    )
    print(f"  ours, MIXED_PRECISION = auto: {m['auto_applied']} ({m['auto_reason']})")
    share = results["settings"]["bf16_peers_share_of_work"]
    if share < 1:
        print(
            f"  the bf16 peers, slow here, do {share:.0%} of the work: steps, rows (BF16_SHARE_WITHOUT_NATIVE)"
        )
    print(
        "  matmul peak: "
        + ", ".join(
            f"{name} {peak['flops_per_s'] / 1e9:.1f} GFLOP/s ({peak['size']}, {peak['layout']})"
            for name, peak in peaks.items()
        )
    )
    pct, ratio, rate, giga = "{:.1%}", "{:.2f}x", "{:.1f}", lambda flops: f"{flops / 1e9:.1f}"
    rows = []
    for table, task, peer, name, described in (
        (t, "training", "trainer", "Trainer", "Trainer (grouped, dyn. padding)"),
        (i, "inference", "pipeline", "pipeline", "transformers pipeline"),
    ):
        sides = {
            "ours": f"ours (auto: {table['long']['ours_precision']})",
            f"{peer}_bf16": f"{described} bf16",
            f"{peer}_fp32": f"{described} fp32",
        }
        for key, said in sides.items():
            rows.append((f"{task} examples/s, {said}", table, f"{key}_examples_per_s", rate))
        if task == "inference":
            rows.append(
                (
                    f"{task} examples/s, one at a time padded to 128",
                    table,
                    "one_at_a_time_examples_per_s",
                    rate,
                )
            )
        for side in ("bf16", "fp32"):
            rows.append((f"  ratio ours / {name} {side}", table, f"ratio_vs_{peer}_{side}", ratio))
        rows.append((f"  ratio ours / {name} at its best", table, f"ratio_vs_{peer}_best", ratio))
        rows.append((f"    {name} at its best in", table, f"{peer}_best", "{}"))
        if task == "inference":
            rows.append(("  ratio ours / one at a time", table, "ratio_vs_one_at_a_time", ratio))
        else:
            for key, said in (("ours", "ours"), (f"{peer}_fp32", name)):
                rows.append(
                    (f"real tokens per batch, {said}", table, f"{key}_real_token_share", pct)
                )
            rows += loader_rows(table)
        for key, said in sides.items():
            rows.append((f"{task} model GFLOP/s, {said}", table, f"{key}_model_flops_per_s", giga))
            rows.append(("  MFU (against its precision's peak)", table, f"{key}_mfu", pct))
            rows.append(("  MFU against the bf16 peak", table, f"{key}_mfu_vs_bf16_peak", pct))
    rows += [
        ("prepare rows/s, ours", p, "ours_rows_per_s", "{:.0f}"),
        ("prepare rows/s, one tokenizer call (floor)", p, "one_call_rows_per_s", "{:.0f}"),
        ("prepare rows/s, unbatched map", p, "unbatched_map_rows_per_s", "{:.0f}"),
        (
            "prepare rows/s, loading the tokenizer + one call",
            p,
            "load_and_one_call_rows_per_s",
            "{:.0f}",
        ),
        ("  ratio ours / one call", p, "ratio_vs_one_call", ratio),
        ("  ratio ours / loading the tokenizer + one call", p, "ratio_vs_load_and_one_call", ratio),
    ]
    width = max(len(label) for label, *_ in rows) + 2
    print(f"  {'measure':<{width}}{'long':>10}{'short':>10}")
    for label, table, key, fmt in rows:
        said = [
            fmt(table[k][key]) if callable(fmt) else fmt.format(table[k][key])
            for k in ("long", "short")
        ]
        cells = "".join(f"{cell:>10}" for cell in said)
        print(f"  {label:<{width}}{cells}")
    print_fixed_cost(results["training_job_fixed_cost"], args.steps)
    print(
        f"  local backend overhead per job: {o['local_job_overhead_s']:.2f}s; run_pipeline.py "
        f"--help {o['help_startup_s']:.2f}s (bare python {o['bare_python_startup_s']:.2f}s)"
    )
    print("  seconds: " + ", ".join(f"{name} {s:.0f}" for name, s in results["seconds"].items()))


if __name__ == "__main__":
    main()
