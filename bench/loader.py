"""The training loader alone, no model: rows a second that the row-by-row collate (the
baseline, tests/jobs/row_by_row.py), steps/batching.py's `Batches` and the training job's
whole loader (training_blocks.loader_for: the sampler, `Batches`, and pinned memory and
workers where the job uses them) deliver, over --passes epochs of the job's batches
(grouped by length, 16 rows) of the demo's texts as bench/speed.py prepares them (long and
short, MAX_SEQUENCE_LENGTH 128). Interleaved rounds, each side first in turn; rates are
medians, the ratio the median of the ratios taken within each round.

    python bench/loader.py [--rows N] [--rounds N] [--passes N]

bench/speed.py prints the job's loader beside its training loop (`loader_rates`).
Prints a table; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from steps.batching import Batches, read_inputs, read_split  # noqa: E402
from steps.training_blocks import loader_for  # noqa: E402

BATCH, SEED = 16, 42  # bench/speed.py's batch and seed


def collate_rate(collate, batches: list[list[int]], passes: int = 1) -> float:
    """Rows a second `collate` pads, over `batches` of row indices, `passes` times."""
    started = time.perf_counter()
    for _ in range(passes):
        for indices in batches:
            collate(indices)
    return passes * sum(len(b) for b in batches) / (time.perf_counter() - started)


def loader_rate(loader: DataLoader, passes: int = 1) -> float:
    """Rows a second a loader yields over its sampler's epoch, `passes` times (iterator and
    workers started inside the clock, as each epoch of the job starts them)."""
    sampler = loader.batch_sampler
    rows = 0
    started = time.perf_counter()
    for _ in range(passes):
        sampler.set_epoch(0)
        for batch in loader:
            rows += len(next(iter(batch.values())))
    return rows / (time.perf_counter() - started)


def loader_rates(loader: DataLoader) -> dict[str, float]:
    """The training job's loader (`Job.train_loader`) over one epoch, and its collate alone
    over the same batches: rows a second of each."""
    sampler = loader.batch_sampler
    sampler.set_epoch(0)
    return {
        "collate_rows_per_s": collate_rate(loader.collate_fn, list(sampler)),
        "loader_rows_per_s": loader_rate(loader),
    }


def sides_for(channels: dict[str, Path], passes: int) -> dict:
    """Each side as a function of no arguments that returns its rows a second."""
    from tests.jobs.row_by_row import RowByRow

    keys = ["input_ids", "attention_mask"]
    inputs = read_inputs(channels["labels"], "minilm", keys)
    table = read_split(channels["train"])
    batches = Batches(table, "minilm", keys, inputs)
    old = RowByRow(table, "minilm", keys, inputs)
    # The job's loader as one process of the job builds it here (on a GPU: workers, pinned).
    hp = {"seed": SEED, "group_by_length": True, "dataloader_num_workers": "auto"}
    one = SimpleNamespace(num_processes=1, process_index=0)
    sampler, loader = loader_for(batches, hp, BATCH, 1, one, torch.cuda.is_available())
    epoch = list(sampler)
    return {
        "row_by_row": lambda: collate_rate(old, epoch, passes),
        "batches": lambda: collate_rate(batches, epoch, passes),
        "loader": lambda: loader_rate(loader, passes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument(
        "--rows",
        type=int,
        default=1779,
        help="texts per corpus (default 1779, the demo's training split)",
    )
    parser.add_argument("--rounds", type=int, default=7, help="rounds, median (default 7)")
    parser.add_argument(
        "--passes", type=int, default=10, help="epochs a side runs in a round (default 10)"
    )
    args = parser.parse_args()
    from bench import speed  # the texts, prepared as prepare writes them

    torch.set_num_threads(os.cpu_count() or 1)
    work = Path(tempfile.mkdtemp(prefix="smpipe-loader-"))
    tokenizer = speed.AutoTokenizer.from_pretrained(speed.minilm_path())
    print(
        f"loader rows/s, {args.rows} texts a corpus, batches of {BATCH}, {args.passes} epochs "
        f"a round, median of {args.rounds} rounds"
    )
    print(
        f"  {speed.cpu_model()} (amx_tile on {speed.amx_tile_cpus()} of {os.cpu_count()} CPUs), "
        f"{torch.get_num_threads()} threads"
    )
    for kind, data in speed.texts(args.rows).items():
        sides = sides_for(speed.prepared_dir(tokenizer, data, work / kind), args.passes)
        runs = {name: [] for name in sides}
        for side in sides.values():  # warm-up
            side()
        for r in range(args.rounds):
            for name in speed.rotated(list(sides), r):
                runs[name].append(sides[name]())
        rates = {name: statistics.median(done) for name, done in runs.items()}
        faster = speed.paired_ratio(runs["row_by_row"], runs["batches"])  # rates: new / old
        print(
            f"  {kind:>5}: collate row by row {rates['row_by_row']:,.0f}, Batches "
            f"{rates['batches']:,.0f} ({faster:.1f}x), the job's loader "
            f"{rates['loader']:,.0f}"
        )


if __name__ == "__main__":
    main()
