"""Our training job's loop against the Hugging Face Trainer at its best, on one GPU, in one
process, interleaved: MiniLM at 128 tokens and a BERT-base-sized encoder (random weights) at
512, on the demo's articles. Per side: examples/s, tokens/s, MFU against the measured matmul
peak, host syncs per optimizer step. `make gpu-check` runs it as its `speed` check.

    python bench/gpu_speed.py [--device cuda|cpu] [--models minilm,bert_base] [--seconds S]
                              [--rounds N] [--batch N,N] [--compile] [--profile]
                              [--peak FLOP/S] [--json PATH]

--device cpu (the default without CUDA) is a smoke run at tiny sizes. --batch times each model
at other rows per step; --compile adds a third side, our job with COMPILE = true; --profile
says where our sides' GPU time goes. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import io
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pipeline.stages import HUB_OFFLINE  # noqa: E402

# Offline as every job of a run is: with only huggingface_hub's switch, a machine whose network
# does not reach the Hub waits on it (30 s a smoke run).
for variable in HUB_OFFLINE:
    os.environ.setdefault(variable, "1")

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402
from transformers import DataCollatorWithPadding, Trainer, TrainingArguments  # noqa: E402

from bench import gpu_profile, speed  # noqa: E402
from bench import gpu_speed_models as models  # noqa: E402
from bench.gpu_check import matmul_peak, peak_dtype, rate  # noqa: E402
from steps import train as train_step  # noqa: E402
from steps.batching import write_inputs  # noqa: E402
from steps.precision import resolve  # noqa: E402
from steps.prepared_files import encoding_record, write_encoding  # noqa: E402
from steps.runtime import names  # noqa: E402
from user_functions.demo_data import bbc_articles  # noqa: E402

SEED = 42
MIN_TOKENS = 16  # the shortest row cut from an article (one that is shorter stays whole)
LABELS = sorted({label for label, _ in bbc_articles()})
ID2LABEL = dict(enumerate(LABELS))
# What `torch.cuda.set_sync_debug_mode("warn")` says at each synchronizing call
# (c10/cuda/CUDAFunctions.h, warn_or_error_on_sync: "called a synchronizing CUDA operation").
SYNC_WARNING = "synchronizing CUDA operation"


@dataclass(frozen=True)
class Model:
    name: str  # the model our job trains (bench/gpu_speed_models.py), its columns' prefix
    label: str
    max_length: int
    batch: int


# Each model as a GPU measures it, and as the CPU smoke run plays it.
MODELS = {
    "minilm": {
        "cuda": Model("minilm", "MiniLM", 128, 32),
        "cpu": Model("minilm", "MiniLM", 32, 4),
    },
    "bert_base": {
        "cuda": Model("bert_base", "BERT-base (random weights)", 512, 32),
        "cpu": Model("bert_tiny", "BERT, 2 layers of 64 (BERT-base's smoke size)", 64, 4),
    },
}
# warm: optimizer steps before a clock opens (compile_warm more with a compiled side, whose
# first steps compile); probe: the probe run's timed steps; seconds: the timed steps of one
# model's rounds, every side together (--seconds); steps a round at least and at most.
SIZES = {
    "cuda": {
        "warm": 3,
        "compile_warm": 10,
        "probe": 20,
        "rounds": 3,
        "seconds": 60.0,
        "min_steps": 10,
        "max_steps": 600,
    },
    "cpu": {
        "warm": 1,
        "compile_warm": 2,
        "probe": 2,
        "rounds": 2,
        "seconds": 0.0,
        "min_steps": 2,
        "max_steps": 2,
    },
}
# Our job's hyperparameters (the Trainer gets the same where it has them).
HYPERPARAMETERS = {
    "epochs": "1",
    "learning_rate": "1e-4",
    "warmup_ratio": "0.1",
    "weight_decay": "0.01",
    "seed": str(SEED),
    "checkpoint_every_steps": "0",
    "keep_checkpoints": "1",
    "wandb_mode": "disabled",
}


# -- the rows ----------------------------------------------------------------------------------


def demo_rows(tokenizer, max_length: int, rows: int) -> pa.Table:
    """`rows` rows from the demo's BBC articles (input_ids, attention_mask, length, label):
    each the beginning of an article, at most `max_length` tokens, cut at a length drawn
    uniformly from MIN_TOKENS to the article's and ended with [SEP], as the tokenizer ends a
    row it truncates. Articles repeat, truncated anew, once `rows` passes their number."""
    articles = bbc_articles()
    rng = np.random.default_rng(SEED)
    order = rng.permutation(len(articles))[: min(rows, len(articles))]
    texts = [" ".join(articles[i][1].read_text(errors="replace").split()) for i in order]
    encoded = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
    picks = np.arange(rows) % len(order)
    whole = np.array([len(encoded[i]) for i in picks])
    lengths = rng.integers(np.minimum(MIN_TOKENS, whole), whole + 1)
    sep = tokenizer.sep_token_id
    ids = (encoded[i][: n - 1] + [sep] for i, n in zip(picks, lengths.tolist(), strict=True))
    values = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    return pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(offsets, pa.array(values)),
            "attention_mask": pa.ListArray.from_arrays(
                offsets, pa.array(np.ones(len(values), dtype=np.int8))
            ),
            "length": pa.array(lengths.astype(np.int64)),
            "label": pa.array([LABELS.index(articles[order[i]][0]) for i in picks]),
        }
    )


def prepared(rows: pa.Table, model: Model, root: Path) -> dict[str, Path]:
    """The channels our training job reads, as prepare writes them (steps/prepare.py)."""
    table = pa.table(
        {
            f"{model.name}_input_ids": rows["input_ids"],
            f"{model.name}_attention_mask": rows["attention_mask"],
            f"{model.name}__length": rows["length"],
            "label_id": rows["label"],
        }
    )
    datasets.Dataset(table).save_to_disk(str(root / "train"))
    datasets.Dataset(table.slice(0, 32)).save_to_disk(str(root / "validation"))
    labels = root / "labels"
    labels.mkdir(parents=True)
    (labels / "id2label.json").write_text(json.dumps({str(i): n for i, n in ID2LABEL.items()}))
    keys = ["input_ids", "attention_mask"]
    pad = {"input_ids": 0, "attention_mask": 0}  # MiniLM's tokenizer pads with id 0
    write_inputs(labels, {model.name: {"keys": keys, "pad": pad, "sequence": keys}})
    write_encoding(labels, encoding_record(model.max_length, {model.name: {}}))
    return {c: root / c for c in ("train", "validation", "labels")}


# -- the clock -----------------------------------------------------------------------------------


class Window:
    """The timed steps of one run: from the end of optimizer step `warm` to the end of step
    `warm + steps`, seen where every optimizer step ends (torch's global optimizer-step hook,
    so the same on both sides), the device synchronized at both ends so that the window holds
    those steps' work and nothing else. Meanwhile it keeps each training forward's attention
    mask (summed after it closes: no work added inside) and, with `count_syncs`, has torch warn
    at every synchronizing CUDA call and counts the warnings given while it is open."""

    def __init__(self, device: str, warm: int, steps: int, count_syncs: bool = False):
        self.device, self.warm, self.steps, self.count_syncs = device, warm, steps, count_syncs
        self.taken, self.start, self.end = 0, None, None
        self.masks: list[torch.Tensor] = []
        self.seen: list[warnings.WarningMessage] = []
        self.warned = (0, 0)  # the warnings seen before it opened, and before it closed

    @contextlib.contextmanager
    def watching(self, model: torch.nn.Module):
        hooks = [
            register_optimizer_step_post_hook(self.stepped),
            model.register_forward_pre_hook(self.forward, with_kwargs=True),
        ]
        try:
            with warnings.catch_warnings(record=True) as self.seen:
                warnings.simplefilter("always")
                yield self
        finally:
            self.sync_debug(False)
            for hook in hooks:
                hook.remove()
        if self.end is None:
            raise RuntimeError(
                f"the run ended after {self.taken} optimizer steps, before its window's last "
                f"({self.warm + self.steps})"
            )

    def stepped(self, optimizer, args, kwargs) -> None:
        self.taken += 1
        if self.taken == self.warm:
            self.synchronize()
            self.start = time.perf_counter()
            self.warned = (len(self.seen), len(self.seen))
            self.sync_debug(self.count_syncs)
        elif self.taken == self.warm + self.steps:
            self.sync_debug(False)
            self.warned = (self.warned[0], len(self.seen))
            self.synchronize()
            self.end = time.perf_counter()

    def forward(self, module, args, kwargs) -> None:
        if module.training and self.start is not None and self.end is None:
            self.masks.append(kwargs["attention_mask"])

    def synchronize(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def sync_debug(self, on: bool) -> None:
        if self.device == "cuda":
            torch.cuda.set_sync_debug_mode("warn" if on else "default")

    def figures(self, flops, precision: str) -> dict:
        """What the window saw: its time, rows, real and padded tokens, model FLOPs on the
        real tokens (`flops` of [(rows, length)]), host syncs."""
        lengths = torch.cat([m.sum(dim=1) for m in self.masks]).tolist()
        counts = collections.Counter(lengths)
        syncs = [
            w for w in self.seen[self.warned[0] : self.warned[1]] if SYNC_WARNING in str(w.message)
        ]
        # Where each sync was asked for: the Python line that called the synchronizing op.
        sites = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
        return {
            "seconds": self.end - self.start,
            "steps": self.steps,
            "examples": len(lengths),
            "real_tokens": sum(lengths),
            "tokens": sum(m.numel() for m in self.masks),
            "flops": flops([(k, n) for n, k in counts.items()]),
            "syncs": len(syncs),
            "sync_sites": dict(sites.most_common()),
            "precision": precision,
        }


# -- the two sides -------------------------------------------------------------------------------


def training_flops(config):
    """Model FLOPs of training (forward and backward) on batches of (rows, width): bench/speed.py's
    count of a BERT-like encoder, held to torch's FlopCounterMode by tests/test_bench_flops.py."""
    return lambda shapes: speed.model_flops(config, shapes, backward=True)


def fresh_accelerate() -> None:
    """Both sides train in this one process, and each leaves Accelerate's process-wide state
    at its settings: reset, as the Trainer does before building its own (transformers'
    training_args.py) and Accelerate's tests do between cases."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def release(device: str) -> None:
    """The run's model, optimizer and batches given back before the next run, and the code
    compiled for it: the next run compiles as a job's process would. Dynamo counts a
    function's compiles across models (each new model's forward compiles anew) and stops
    compiling it at its recompile_limit, 8: on an H200 (2026-11-28) the 128-row runs used them
    up, and the 32-row model's compiled side ran eager.
    What outlives that (a compiled run leaves Inductor's caches, about 230,000 objects on a CPU
    smoke run) is frozen, out of the next run's collections, as main freezes the imports."""
    torch._dynamo.reset()
    gc.collect()
    gc.freeze()
    if device == "cuda":
        torch.cuda.empty_cache()


def fp32_weights(model: torch.nn.Module, side: str) -> None:
    """Mixed precision keeps fp32 weights; weights loaded in bf16 (a checkpoint stored so,
    loaded with dtype "auto") would train a different, cheaper model."""
    dtypes = {str(p.dtype) for p in model.parameters()}
    if dtypes != {"torch.float32"}:
        raise RuntimeError(f"{side}: the model's weights are {sorted(dtypes)}, not float32")


def ours(
    model: Model, channels: dict[str, Path], root: Path, window: Window, compile: bool = False
) -> dict:
    """Our training job's set-up and loop (steps/train.py's `set_up` and `train_epoch`) as the
    job runs them, MIXED_PRECISION = auto, DATALOADER_NUM_WORKERS = auto (two workers and
    pinned memory on a GPU), grouped by length, each batch padded to its longest row (to a
    multiple of 8 on a GPU); one epoch, cut at the window's end. `compile`: COMPILE = true."""
    batch, last = str(model.batch), window.warm + window.steps
    with contextlib.redirect_stdout(io.StringIO()):  # its first line and progress lines
        job = speed.our_job(
            channels,
            root,
            **HYPERPARAMETERS,
            model_name=model.name,
            batch_size=batch,
            max_per_device_batch_size=batch,
            max_steps=str(last),
            compile=str(compile).lower(),
        )
        net = job.accelerator.unwrap_model(job.model)
        fp32_weights(net, "ours")
        with window.watching(net):
            train_step.train_epoch(job)
    figures = window.figures(training_flops(net.config), job.settings["mixed_precision"])
    job.accelerator.free_memory()
    del job, net
    release(window.device)
    return figures


def trainer_arguments(root: Path, model: Model, last: int, precision: str, device: str) -> dict:
    """The Trainer's arguments: the same training as ours (batch, fused AdamW, learning rate,
    schedule, seed, precision, loader workers), and what transformers' GPU training guide
    recommends for speed (docs/transformers/perf_train_gpu_one: bf16 and TF32, data
    preloading with workers and pinned memory), grouping by length, non-blocking copies
    (AcceleratorConfig's `non_blocking`, "best if used with pin_memory") and persistent
    workers; no logging, saving or progress bar. It clips gradients to norm 1.0, its default,
    which ours does not."""
    gpu = device == "cuda"
    return {
        "output_dir": str(root),
        "per_device_train_batch_size": model.batch,
        "max_steps": last,
        "learning_rate": float(HYPERPARAMETERS["learning_rate"]),
        "weight_decay": float(HYPERPARAMETERS["weight_decay"]),
        "warmup_steps": float(HYPERPARAMETERS["warmup_ratio"]),  # a float below 1: a ratio
        "seed": SEED,
        "bf16": precision == "bf16",
        "fp16": precision == "fp16",
        "tf32": True if gpu else None,
        "optim": "adamw_torch_fused",
        "train_sampling_strategy": "group_by_length",
        "dataloader_num_workers": 2 if gpu else 0,
        "dataloader_pin_memory": gpu,
        "dataloader_persistent_workers": gpu,
        "accelerator_config": {"non_blocking": gpu},
        "use_cpu": not gpu,
        "logging_strategy": "no",
        "save_strategy": "no",
        "report_to": [],
        "disable_tqdm": True,
    }


def trainer(model: Model, rows, tokenizer, root: Path, window: Window, precision: str) -> dict:
    """The Trainer on the same rows, the same model built from the same seed, each batch
    padded by `DataCollatorWithPadding` (to a multiple of 8 on a GPU, as ours pads)."""
    fresh_accelerate()
    torch.manual_seed(SEED)
    net = models.load_model(model.name, ID2LABEL, {v: k for k, v in ID2LABEL.items()})
    fp32_weights(net, "the Trainer")
    last = window.warm + window.steps
    arguments = trainer_arguments(root, model, last, precision, window.device)
    pad = 8 if window.device == "cuda" else None  # as ours pads
    run = Trainer(
        model=net,
        args=TrainingArguments(**arguments),
        train_dataset=rows,
        data_collator=DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad),
    )
    with contextlib.redirect_stdout(io.StringIO()), window.watching(net):
        run.train()
    figures = window.figures(training_flops(net.config), precision)
    run.accelerator.free_memory()
    del run, net
    release(window.device)
    return figures


# -- one model, then every model -----------------------------------------------------------------


# The sides, as the table names them: our job, the Trainer, and (--compile) our job compiled.
SIDE_LABELS = {"ours": "ours", "trainer": "Trainer", "compiled": "ours, compiled"}


def bench_model(
    model: Model,
    device: str,
    size: dict,
    peak: float,
    tokenizer,
    work: Path,
    compile: bool,
    profile: bool = False,
) -> dict:
    """A probe run of each side counts its host syncs (`Window`) and times its steps; the
    rounds are sized from those times to about size["seconds"] of timed steps, every side
    together; then each side runs once untimed, and once a round, every run a new model and
    loader, each round started by the next side in turn. A round's run is one whole epoch of rows made for it, so
    that every side's window holds nearly the same rows: the samplers order them differently
    (the Trainer's goes from long to short within each megabatch, ours shuffles its batches),
    and a window cut from a longer epoch would hold longer rows on one side."""
    warm = size["warm"] + (size["compile_warm"] if compile else 0)  # the same on every side
    precision = resolve("auto", torch.cuda.device_count() if device == "cuda" else 0).applied
    work = work / f"{model.name}-{model.batch}"

    def sides(steps: int, runs: str) -> dict:
        """Each side, to run on one epoch of (warm + steps) steps, its rows in work/`runs`."""
        rows = demo_rows(tokenizer, model.max_length, (warm + steps) * model.batch)
        channels = prepared(rows, model, work / runs)
        hf_rows = datasets.Dataset(rows.select(["input_ids", "attention_mask", "label"]))
        hf_rows = hf_rows.rename_column("label", "labels")
        them = {
            "ours": lambda root, window: ours(model, channels, root, window),
            "trainer": lambda root, window: trainer(
                model, hf_rows, tokenizer, root, window, precision
            ),
        }
        if compile:
            them["compiled"] = lambda root, window: ours(model, channels, root, window, True)
        return them

    said = f"{model.label}, {model.batch} rows"

    def timed(name: str, run: str, side, root: Path, window: Window) -> dict:
        """One run, its wall time said as it ends: set-up and (compiled) compile included."""
        started = time.monotonic()
        figures = side(root, window)
        print(
            f"  {said}: {SIDE_LABELS[name]}, {run}: {time.monotonic() - started:.0f} s", flush=True
        )
        return figures

    probe = size["probe"]
    probes = {
        name: timed(name, "probe", side, work / f"{name}-probe", Window(device, warm, probe, True))
        for name, side in sides(probe, "probe-data").items()
    }
    step_seconds = sum(p["seconds"] / p["steps"] for p in probes.values())
    steps = int(size["seconds"] / (size["rounds"] * step_seconds))
    steps = min(max(steps, size["min_steps"]), size["max_steps"])
    rounds = sides(steps, "rounds-data")
    names = list(rounds)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    # A round first, untimed, on the rounds' rows: the process meets each of their padded
    # widths once before any clock. On an H200 (2026-11-27 and 28) round 1 was the slowest
    # round of both sides in most runs, and of ours, the first to run in it, in every run
    # (BERT-base at 128 rows: 3.42 s, then 2.26 s and 2.28 s), as work done once a shape
    # would be (cuDNN builds an attention plan for each shape it meets and keeps it).
    for name in names:
        timed(
            name, "warm-up round", rounds[name], work / f"{name}-warm", Window(device, warm, steps)
        )
    for r in range(size["rounds"]):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            window = Window(device, warm, steps)
            runs[name].append(
                timed(name, f"round {r + 1}", rounds[name], work / f"{name}-{r}", window)
            )
    done = summary(model, probes, runs, peak, steps)
    for name in [n for n in names if n != "trainer" and profile]:
        window = Window(device, warm, probe)  # one run more, its timed steps profiled
        with gpu_profile.profiled(window) as seen:
            rounds[name](work / f"{name}-profiled", window)
        shares = gpu_profile.kernel_shares(seen.kernels, window)
        idle = gpu_profile.idle_time(seen.events, window.steps)
        if idle is not None:
            shares["idle"] = idle
        done["sides"][name]["profile"] = shares
        step_seconds = statistics.median(done["sides"][name]["seconds"]) / steps
        for line in gpu_profile.profile_lines(shares, step_seconds):
            print(f"  {said}: {SIDE_LABELS[name]}, profiled: {line}", flush=True)
    return done


def summary(model: Model, probes: dict, runs: dict, peak: float, steps: int) -> dict:
    """Per side, medians over rounds: examples/s, tokens/s (real tokens), model FLOP/s and
    MFU; syncs per step from the probe, and the lines that asked for them; the share of real
    tokens in the padded batches. And each side against the Trainer: the median over rounds of
    the side's model FLOP/s over the Trainer's (above 1.00x the side is faster), FLOPs and not
    time, so that what is left of the difference between the windows' rows counts as work."""

    def median(values) -> float:
        return statistics.median(values)

    sides = {}
    for name, done in runs.items():
        sides[name] = {
            "precision": done[0]["precision"],
            "examples_per_s": median([r["examples"] / r["seconds"] for r in done]),
            "tokens_per_s": median([r["real_tokens"] / r["seconds"] for r in done]),
            "model_flops_per_s": median([r["flops"] / r["seconds"] for r in done]),
            "mfu": median([r["flops"] / r["seconds"] for r in done]) / peak,
            "syncs_per_step": probes[name]["syncs"] / probes[name]["steps"],
            "sync_sites": probes[name]["sync_sites"],
            "real_token_share": sum(r["real_tokens"] for r in done)
            / sum(r["tokens"] for r in done),
            "seconds": [r["seconds"] for r in done],
            "probe_seconds_per_step": probes[name]["seconds"] / probes[name]["steps"],
        }

    def flop_rate(run: dict) -> float:
        return run["flops"] / run["seconds"]

    against = {
        name: median(
            [flop_rate(o) / flop_rate(t) for o, t in zip(done, runs["trainer"], strict=True)]
        )
        for name, done in runs.items()
        if name != "trainer"
    }
    return {
        "model": model.label,
        "max_length": model.max_length,
        "batch": model.batch,
        "rounds": len(runs["ours"]),
        "steps_per_round": steps,
        "sides": sides,
        "ours_vs_trainer": against["ours"],
        "vs_trainer": against,
    }


def machine(device: str, peak: float) -> dict:
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else None
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": gpu or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peak_flops_per_s": peak,
        "peak_dtype": str(peak_dtype("auto", torch.cuda.device_count() if gpu else 0)),
    }


COLUMNS = ("model", "side", "examples/s", "tokens/s", "MFU", "syncs/step", "real tokens")


def table_rows(results: dict) -> list[tuple[str, ...]]:
    """One row a model and side, the header first."""
    rows = [COLUMNS]
    for done in results["models"].values():
        said = f"{done['model']}, {done['max_length']} tokens, {done['batch']} rows"
        for side, f in done["sides"].items():
            name = SIDE_LABELS[side]
            rows.append(
                (
                    said,
                    f"{name} ({f['precision']})",
                    f"{f['examples_per_s']:.1f}",
                    f"{f['tokens_per_s']:.0f}",
                    f"{f['mfu']:.2%}",
                    f"{f['syncs_per_step']:.2f}",
                    f"{f['real_token_share']:.0%}",
                )
            )
    return rows


def print_table(results: dict, device: str) -> None:
    m = results["machine"]
    print(
        f"\ngpu speed: ours against the Trainer, {m['device']}, torch {m['torch']}, "
        f"transformers {m['transformers']}, {m['date']}; MFU against "
        f"{rate(m['peak_flops_per_s'])} ({m['peak_dtype'].removeprefix('torch.')} matmul, "
        "bench/gpu_check.py)"
    )
    rows = table_rows(results)
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    for done in results["models"].values():
        said = f"{done['model']}, {done['batch']} rows"
        for side, ratio in done["vs_trainer"].items():
            print(
                f"{said}: {SIDE_LABELS[side]}/Trainer {ratio:.2f}x (median of "
                f"{done['rounds']} rounds of {done['steps_per_round']} steps a side)"
            )
        for side, f in done["sides"].items():
            if f["sync_sites"]:
                sites = ", ".join(f"{at} x{n}" for at, n in f["sync_sites"].items())
                print(f"{said}: {SIDE_LABELS[side]} synced at {sites} (probe)")
    if device != "cuda":
        print("syncs/step: no CUDA here, so none to count (the counter: tests/test_gpu_speed.py)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda where torch sees a GPU, else cpu (a smoke run of tiny sizes)",
    )
    parser.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}"
    )
    parser.add_argument(
        "--seconds",
        type=float,
        help="timed seconds of one model's rounds, both sides together "
        f"(default {SIZES['cuda']['seconds']:g} on a GPU)",
    )
    parser.add_argument("--rounds", type=int, help="rounds (default 3 on a GPU)")
    parser.add_argument(
        "--batch",
        help="comma-separated rows per step, each model timed at each (default: the model's "
        "own, 32 on a GPU)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="a third side: our job with COMPILE = true (torch.compile, dynamic shapes)",
    )
    parser.add_argument(
        "--peak", type=float, help="the matmul peak in FLOP/s (default: measured here)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="one run more of each of our sides, its timed steps under torch's profiler: the "
        "device's busy share and where its time went",
    )
    parser.add_argument("--json", type=Path, help="write the figures there too")
    args = parser.parse_args()
    args.models = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in args.models if n not in MODELS]
    if unknown or not args.models:
        parser.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU on this machine")
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds: at least 1")
    try:
        args.batch = [int(b) for b in args.batch.split(",")] if args.batch else [None]
    except ValueError:
        parser.error(f"--batch: whole numbers, comma-separated, not {args.batch!r}")
    if any(b is not None and b < 1 for b in args.batch):
        parser.error("--batch: at least 1 row a step")
    return args


def main() -> int:
    args = parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the loaders' workers fork after it
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    device = args.device
    size = dict(SIZES[device])
    size |= {k: v for k, v in (("seconds", args.seconds), ("rounds", args.rounds)) if v is not None}
    os.environ[names.USER_FUNCTIONS_VARIABLE] = models.__name__
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    peak = args.peak or matmul_peak(device, peak_dtype("auto", gpus))
    tokenizer = models.load_tokenizer("minilm")
    # Every run ends in gc.collect (`release`, Accelerate's free_memory): out of its sight what
    # lives for the whole bench, the imports above all (8.7 of a CPU smoke run's 24 s were
    # collections walking them; https://docs.python.org/3/library/gc.html#gc.freeze).
    gc.freeze()
    if args.compile:  # why a compiled side compiles more than once, as it does
        torch._logging.set_logs(recompiles=True)
    results = {"machine": machine(device, peak), "sizes": size, "models": {}}
    with tempfile.TemporaryDirectory(prefix="gpu-speed-") as work:
        for key, batch in itertools.product(args.models, args.batch):
            model = MODELS[key][device]
            model = model if batch is None else dataclasses.replace(model, batch=batch)
            said = f"{model.label}, {model.batch} rows"
            print(f"{said}: probing, then {size['rounds']} rounds", flush=True)
            started = time.monotonic()
            done = bench_model(
                model, device, size, peak, tokenizer, Path(work), args.compile, args.profile
            )
            results["models"][key if batch is None else f"{key}@{batch}"] = done
            print(f"{said}: done in {time.monotonic() - started:.0f} s", flush=True)
            if args.json:  # each model's figures kept as soon as they are in
                args.json.write_text(json.dumps(results, indent=2))
    print_table(results, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
