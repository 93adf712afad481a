"""What our training loop costs a step against what the Trainer's costs, on a model with next
to nothing to compute (bench/tiny_classifier.py: 4,121 parameters), so that a step's time is
the loop around the model: the loader, moving the batch, the optimizer and schedule calls,
the bookkeeping. Three sides train the same batches of the demo's texts as bench/speed.py
prepares them (long and short, MAX_SEQUENCE_LENGTH 128; our job's batches: grouped by length,
16 rows, in its order), with the same model, fused AdamW, fp32 and threads:

1. ours: our training job's loop (steps/train.py's `train_epoch`, set up as bench/speed.py
   sets it up), its progress lines written to nowhere;
2. the Trainer at bench/speed.py's settings (no logging, no tqdm, no saving) and, as our job,
   no gradient clipping, its sampler replaced by our batches' order, padding with
   `DataCollatorWithPadding`;
3. bare: forward, backward, optimizer and schedule over batches padded beforehand: what the
   model itself costs a step.

Every side is clocked where its optimizer steps end (torch's global optimizer-step hook, the
same on each), after WARM steps; a side's step is the median of its steps in a round, and its
overhead that minus the bare loop's in the same round; figures are medians over rounds,
interleaved, each side first in turn. A first, untimed round checks that the three sides'
models saw the same tensors.

    python bench/loop_overhead.py [--steps N] [--rounds N]

Prints a table; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402
from transformers import DataCollatorWithPadding, Trainer, TrainingArguments  # noqa: E402

from bench import speed, tiny_classifier  # noqa: E402  (the texts prepared, our job set up)
from steps import train as train_step  # noqa: E402
from steps.batching import Batches, read_inputs, read_split  # noqa: E402
from steps.hyperparameters import parse_hyperparameters  # noqa: E402
from steps.runtime import names  # noqa: E402
from steps.sampler import ResumableBatchSampler  # noqa: E402
from steps.training_blocks import optimizer_for  # noqa: E402

WARM = 5  # optimizer steps before the clock, on every side
KEYS = ["input_ids", "attention_mask"]
# The precision every side computes in: the same work, whatever the CPU.
SETTINGS = {"mixed_precision": "no", "model_name": "minilm"}


class Seen:
    """What each side's model was given in training (shape and sums of its inputs), while on."""

    log: list | None = None

    @classmethod
    def hook(cls, module, args, kwargs) -> None:
        if cls.log is not None and module.training:
            ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
            cls.log.append((tuple(ids.shape), int(ids.sum()), int(mask.sum())))


@contextlib.contextmanager
def clocked():
    """The times at which optimizer steps end, on any optimizer, while inside."""
    stamps: list[float] = []
    handle = register_optimizer_step_post_hook(lambda *_: stamps.append(time.perf_counter()))
    try:
        yield stamps
    finally:
        handle.remove()


def watched(model: torch.nn.Module) -> torch.nn.Module:
    """The model, noting what it is given while `Seen.log` is on (untimed rounds only)."""
    if Seen.log is not None:
        model.register_forward_pre_hook(Seen.hook, with_kwargs=True)
    return model


def ours(channels: dict[str, Path], root: Path, steps: int) -> list[float]:
    job = speed.our_job(channels, root, **SETTINGS)
    watched(job.accelerator.unwrap_model(job.model))
    job.total_steps = WARM + steps
    with clocked() as stamps:
        train_step.train_epoch(job)
    return stamps


def trainer(channels: dict[str, Path], root: Path, steps: int) -> list[float]:
    """The Trainer on our batches: the rows of our job's first epoch, in its order."""
    table = read_split(channels["train"])
    order = [i for batch in our_batches(table) for i in batch]

    class InOurOrder(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return order

    columns = ["minilm_input_ids", "minilm_attention_mask", "label_id"]
    train = datasets.Dataset(table.select(columns).rename_columns([*KEYS, "labels"]))
    torch.manual_seed(42)
    model = watched(tiny_classifier.TinyClassifier(5))
    args = TrainingArguments(
        output_dir=str(root),
        per_device_train_batch_size=speed.BATCH,
        max_steps=WARM + steps,
        learning_rate=1e-4,
        weight_decay=0.01,
        max_grad_norm=0.0,  # no clipping (its default clips at 1.0): our job does not clip
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        seed=42,
    )
    pad = DataCollatorWithPadding(speed.AutoTokenizer.from_pretrained(speed.minilm_path()))
    with clocked() as stamps:
        InOurOrder(model=model, args=args, train_dataset=train, data_collator=pad).train()
    return stamps


def bare(channels: dict[str, Path], root: Path, steps: int) -> list[float]:
    """The model's own cost: our batches padded and on the device before the clock, then
    forward, backward, AdamW and its schedule as our job builds them
    (training_blocks.optimizer_for)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    table = read_split(channels["train"])
    inputs = read_inputs(channels["labels"], "minilm", KEYS)
    padded = Batches(table, "minilm", KEYS, inputs)
    ready = [
        {k: v.to(device) for k, v in padded(b).items()} for b in our_batches(table)[: WARM + steps]
    ]
    torch.manual_seed(42)
    model = watched(tiny_classifier.TinyClassifier(5)).to(device).train()
    hp = parse_hyperparameters({**speed.HYPERPARAMETERS, **SETTINGS})
    optimizer, scheduler, _ = optimizer_for(model, hp, len(ready))
    with clocked() as stamps:
        for batch in ready:
            out = model(**{k: batch[k] for k in KEYS}, labels=batch["label_id"])
            out.loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return stamps


SIDES = {"ours": ours, "trainer": trainer, "bare": bare}


def our_batches(table) -> list[list[int]]:
    """Our job's first epoch of batches (its sampler: grouped by length, seed 42, 16 rows)."""
    lengths = np.asarray(table.column("minilm__length"))
    return ResumableBatchSampler(len(table), speed.BATCH, 1, 1, 0, 42, lengths).global_batches()


def quietly(side, channels: dict[str, Path], root: Path, steps: int) -> list[float]:
    """A side run with what it prints (our job's lines, the Trainer's summary) put aside."""
    with contextlib.redirect_stdout(io.StringIO()):
        return side(channels, root, steps)


def step_seconds(stamps: list[float]) -> list[float]:
    """Each step's seconds after WARM: from the end of one optimizer step to the next's."""
    return np.diff(stamps[WARM - 1 :]).tolist()


def measure(channels: dict[str, Path], work: Path, steps: int, rounds: int) -> dict:
    """Each side's median step and mean step (seconds), and its overhead over bare, by round."""
    logs = {}
    for name, side in SIDES.items():  # the untimed first round: the same tensors everywhere
        Seen.log = logs[name] = []
        quietly(side, channels, work / f"check-{name}", steps)
    Seen.log = None
    assert logs["ours"] == logs["trainer"] == logs["bare"], "the sides trained on other batches"
    runs = {name: [] for name in SIDES}
    for r in range(rounds):
        for name in speed.rotated(list(SIDES), r):
            seconds = step_seconds(quietly(SIDES[name], channels, work / f"{name}-{r}", steps))
            assert len(seconds) == steps, (name, len(seconds))
            runs[name].append((statistics.median(seconds), statistics.fmean(seconds)))
    out = {}
    for name, done in runs.items():
        out[f"{name}_median_step_us"] = statistics.median(m for m, _ in done) * 1e6
        out[f"{name}_mean_step_us"] = statistics.median(m for _, m in done) * 1e6
        if name != "bare":
            over = [(m - b) * 1e6 for (m, _), (b, _) in zip(done, runs["bare"], strict=True)]
            out[f"{name}_overhead_us"] = statistics.median(over)
    out["ours_minus_trainer_us"] = statistics.median(
        (o - t) * 1e6 for (o, _), (t, _) in zip(runs["ours"], runs["trainer"], strict=True)
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument(
        "--steps", type=int, default=100, help=f"timed steps (default 100; at most {112 - WARM})"
    )
    parser.add_argument("--rounds", type=int, default=7, help="rounds, median (default 7)")
    args = parser.parse_args()
    os.environ[names.USER_FUNCTIONS_VARIABLE] = tiny_classifier.__name__
    torch.set_num_threads(os.cpu_count() or 1)
    work = Path(tempfile.mkdtemp(prefix="smpipe-loop-"))
    tokenizer = speed.AutoTokenizer.from_pretrained(speed.minilm_path())
    results = {}
    for kind, data in speed.texts(1779).items():  # the demo's training split: 112 batches
        channels = speed.prepared_dir(tokenizer, data, work / f"prepared-{kind}")
        results[kind] = measure(channels, work / kind, args.steps, args.rounds)
    print_table(results, args)


def print_table(results: dict, args) -> None:
    m = speed.machine()
    print(
        f"\nloop overhead: a {sum(p.numel() for p in tiny_classifier.TinyClassifier(5).parameters()):,}"
        f"-parameter classifier, batches of {speed.BATCH}, {args.steps} steps after {WARM}, "
        f"median of {args.rounds} rounds; microseconds a step"
    )
    print(
        f"  {m['cpu']} (amx_tile on {m['amx_tile_cpus']} of {m['cpus']} CPUs), "
        f"{m['threads']} threads, torch {m['torch']}, {m['date']}"
    )
    rows = [
        ("step, ours (median)", "ours_median_step_us"),
        ("step, Trainer (median)", "trainer_median_step_us"),
        ("step, bare loop (median)", "bare_median_step_us"),
        ("overhead over bare, ours", "ours_overhead_us"),
        ("overhead over bare, Trainer", "trainer_overhead_us"),
        ("ours - Trainer, paired", "ours_minus_trainer_us"),
        ("step, ours (mean: logging steps in)", "ours_mean_step_us"),
        ("step, Trainer (mean)", "trainer_mean_step_us"),
        ("step, bare loop (mean)", "bare_mean_step_us"),
    ]
    width = max(len(label) for label, _ in rows) + 2
    print(f"  {'measure (us)':<{width}}{'long':>10}{'short':>10}")
    for label, key in rows:
        cells = "".join(f"{results[kind][key]:>10.0f}" for kind in ("long", "short"))
        print(f"  {label:<{width}}{cells}")


if __name__ == "__main__":
    sys.exit(main())
