"""A training job that counts where its optimizer steps read a tensor's values on the host
(SMPIPE_STEP = tests.jobs.host_reads): steps/train.py's own set-up and `train_epoch`, one
epoch, under a TorchFunctionMode that sees every tensor function called from Python. On a GPU
each such read waits for the device to finish all the work queued before it; on a CPU the same
calls are made, so they are counted there. Each process writes host-reads-rank<N>.json to the
model folder: for each optimizer step, the reads made after its update and before the next
step's (its bookkeeping, then the next step's micro-batches), by function name.
"""

from __future__ import annotations

import collections
import json

from torch.overrides import TorchFunctionMode

from steps import train
from steps.hyperparameters import parse_hyperparameters
from steps.runtime.environment import training_env
from steps.runtime.step import run_step

# Tensor functions that hand a tensor's values to Python, or whose result's shape depends on
# them: each waits for the device.
READS = frozenset(
    {
        "item",
        "tolist",
        "numpy",
        "cpu",
        "__bool__",
        "__float__",
        "__int__",
        "__index__",
        "__complex__",
        "__format__",
        "__array__",
        "__repr__",
        "is_nonzero",
        "equal",
        "allclose",
        "nonzero",
        "masked_select",
        "unique",
        "unique_consecutive",
    }
)


class HostReads(TorchFunctionMode):
    """Host reads of tensors, by the optimizer step `state.step` says has just been taken. The
    loader's batches are left out (`paused_while_loading`): they are made on the host by
    design, in worker processes where the job runs beside a GPU."""

    def __init__(self, state) -> None:
        super().__init__()
        self.state, self.paused = state, False
        self.reads: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if not self.paused and name in READS:
            self.reads[self.state.step][name] += 1
        return func(*args, **(kwargs or {}))

    def paused_while_loading(self, loader):
        """`loader`, read with the count paused while it makes each batch."""
        counter = self

        class Paused:
            def __iter__(self):
                batches = None
                while True:
                    counter.paused = True
                    try:
                        batches = batches or iter(loader)  # it draws the loader's base seed
                        batch = next(batches)
                    except StopIteration:
                        return
                    finally:
                        counter.paused = False
                    yield batch

        return Paused()


def main() -> None:
    env = training_env()
    job = train.set_up(parse_hyperparameters(env.hyperparameters), env)
    counter = HostReads(job.state)
    job.train_loader = counter.paused_while_loading(job.train_loader)
    with counter:
        train.train_epoch(job)
    seen = {
        "steps_per_epoch": job.sampler.steps_per_epoch,
        "reads": {step: dict(names) for step, names in sorted(counter.reads.items())},
    }
    rank = job.accelerator.process_index
    (env.model_dir / f"host-reads-rank{rank}.json").write_text(json.dumps(seen))
    train.leave(job)


if __name__ == "__main__":
    run_step("host-reads", main)
