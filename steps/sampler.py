"""The training sampler a checkpoint resumes mid-epoch: every epoch's batches drawn from
(seed, epoch), grouped by length as the Trainer's `group_by_length` groups them."""

from __future__ import annotations

import math

import numpy as np
import torch


class ResumableBatchSampler:
    """Shuffled batches of indices for one rank, resumable mid-epoch.

    Each epoch draws a permutation from (seed, epoch) and pads it by wrapping around, so every
    epoch has exactly `steps_per_epoch * accumulation` micro-batches per rank: accumulation
    groups line up with epochs and a resumed job sees exactly the batches it had not seen.

    Given the rows' lengths, batches are grouped by length as the Trainer's `group_by_length`
    does: the permutation is cut into megabatches, each sorted by length and cut into global
    batches (neighbouring ranks get neighbouring lengths), and the batches are shuffled, the
    longest first so that a batch too large for the device fails at once. Everything is drawn
    from (seed, epoch), so a resumed epoch is the same epoch.
    """

    def __init__(
        self,
        num_examples: int,
        per_device: int,
        accumulation: int,
        world: int,
        rank: int,
        seed: int,
        lengths=None,
    ):
        self.n, self.per_device, self.accumulation = num_examples, per_device, accumulation
        self.world, self.rank, self.seed = world, rank, seed
        self.lengths = None if lengths is None else np.asarray(lengths)
        per_step = per_device * world * accumulation
        self.steps_per_epoch = max(1, math.ceil(num_examples / per_step))
        self.batches_per_epoch = self.steps_per_epoch * accumulation
        self.epoch = 0
        self.start = 0  # micro-batches of this epoch already consumed
        # Resumed from a checkpoint of another shape: (its processes, per-device batch,
        # accumulation), or None (load_state_dict).
        self.resharded: tuple | None = None

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "start": self.start,
            "seed": self.seed,
            "n": self.n,
            "world": self.world,
            "per_device": self.per_device,
            "accumulation": self.accumulation,
            "grouped": self.lengths is not None,
        }

    def load_state_dict(self, state: dict) -> None:
        """The position of a checkpoint's epoch. Written by another number of processes (a
        resume after PROCESSES_PER_HOST or INSTANCE_COUNT changed), it is taken in optimizer
        steps: a checkpoint is written between two (`start` is a whole number of accumulation
        groups), and the rest of the epoch is this world's batches from the same step on. The
        rows of that rest are then drawn in this world's order: the epoch is not the one an
        uninterrupted run would have seen, and `resharded` says so."""
        mine = (self.n, self.seed, self.lengths is not None)
        if (state["n"], state["seed"], state.get("grouped", False)) != mine:
            raise ValueError(f"sampler state is for another run: {state}")
        if "accumulation" not in state:  # written before the shape was recorded
            if state["world"] != self.world:
                raise Unresumable(
                    f"the checkpoints were written by {state['world']} processes, by a version "
                    f"that did not record their batch split; this job has {self.world}: resume "
                    f"with {state['world']}, or start a new run"
                )
            state = {**state, "per_device": self.per_device, "accumulation": self.accumulation}
        shape = (state["world"], state["per_device"], state["accumulation"])
        mine = (self.world, self.per_device, self.accumulation)
        rows, my_rows = math.prod(shape), math.prod(mine)
        if rows != my_rows:  # an optimizer step of other rows: its step count means other data
            raise Unresumable(
                f"the checkpoints' optimizer steps are {rows} rows ({shape[0]} processes x "
                f"{shape[1]} x {shape[2]} accumulated), this job's are {my_rows} ({mine[0]} x "
                f"{mine[1]} x {mine[2]}): resume with a number of processes that splits "
                "BATCH_SIZE the same way, or start a new run"
            )
        self.epoch, self.start = state["epoch"], state["start"]
        self.resharded = shape if shape != mine else None
        if self.resharded:
            self.start = state["start"] // state["accumulation"] * self.accumulation

    def __len__(self) -> int:
        return self.batches_per_epoch - self.start

    def global_batches(self) -> list[list[int]]:
        """This epoch's batches across all ranks, in order."""
        g = torch.Generator().manual_seed(self.seed * 1000003 + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()
        needed = self.batches_per_epoch * self.per_device * self.world
        order = (order * math.ceil(needed / self.n))[:needed]
        size = self.per_device * self.world
        if self.lengths is not None:
            lengths = self.lengths
            mega = size * max(1, min(self.n // (size * 4), 50))
            order = [
                i
                for m in range(0, needed, mega)
                for i in sorted(order[m : m + mega], key=lambda i: -lengths[i])
            ]
        batches = [order[b * size : (b + 1) * size] for b in range(self.batches_per_epoch)]
        if self.lengths is not None:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
            longest = max(range(len(batches)), key=lambda b: lengths[batches[b]].max())
            batches[0], batches[longest] = batches[longest], batches[0]
        return batches

    def __iter__(self):
        batches = self.global_batches()
        for b in range(self.start, self.batches_per_epoch):
            yield batches[b][self.rank * self.per_device : (self.rank + 1) * self.per_device]


class Unresumable(ValueError):
    """No checkpoint of this run will load in this job (every one was written the same way):
    the job stops, saying why, rather than train from step 1."""
