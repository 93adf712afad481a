"""Checkpoints written by steps/checkpointing.py, and a crash at each point of writing one.

    python -m tests.jobs.checkpoint_writer ROOT CRASH [CRASH ...]

For each CRASH (one of CRASHES), a child of this process writes the checkpoints of steps 1 to 3
to ROOT/CRASH, then dies with os._exit(9) at that point of writing step 4's, as a process killed
there would; this process prints `CRASH STATUS` for each. One interpreter imports torch for all
of them: a fork per crash, each child building its own state (this process runs no torch op
before it forks, so no thread pool is copied half-held)."""

from __future__ import annotations

import io
import os
import sys
import traceback
from pathlib import Path

import torch

from steps import checkpointing as ckpt
from steps.sampler import ResumableBatchSampler

CRASHES = ("after_begin", "mid_state", "before_rename", "before_pointer", "after_pointer")


def new_state() -> ckpt.State:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    sampler = ResumableBatchSampler(100, 4, 1, 1, 0, seed=1)
    return ckpt.State(model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler,
                      seed=1, run_name="w")  # fmt: skip


def save(directory: Path, state: ckpt.State, step: int, crash: str | None = None) -> None:
    """Step `step`'s checkpoint (every weight `step`), dying at `crash` if given."""
    state.step = step
    with torch.no_grad():
        state.model.weight.fill_(step)
    if crash == "mid_state":  # the state file half written
        real_save = ckpt._save

        def partial(obj, path):
            if path.name == ckpt.STATE_FILE:
                data = io.BytesIO()
                torch.save(obj, data)
                path.write_bytes(data.getvalue()[: len(data.getvalue()) // 2])
                os._exit(9)
            real_save(obj, path)

        ckpt._save = partial
    if crash == "before_rename":
        ckpt.os.rename = lambda *a: os._exit(9)
    if crash == "before_pointer":
        ckpt.os.replace = lambda *a: os._exit(9)
    tmp = ckpt.begin_checkpoint(directory, ckpt.checkpoint_name(step))
    if crash == "after_begin":
        os._exit(9)
    ckpt.write_rank_state(tmp, 0, state)
    ckpt.finish_checkpoint(directory, tmp, state, None, keep=2)
    if crash == "after_pointer":
        os._exit(9)


def crash_writing(directory: Path, crash: str) -> None:
    state = new_state()
    for step in (1, 2, 3):
        save(directory, state, step)
    save(directory, state, 4, crash)


def main(root: Path, crashes: list[str]) -> None:
    # Constructing AdamW imports torch._dynamo (torch/_compile.py `_disable_dynamo`): imported
    # once here, not in every child (an import, not a torch op).
    import torch._dynamo  # noqa: F401

    for crash in crashes:
        pid = os.fork()
        if pid == 0:
            status = 0  # a crash ends the child before this: 9
            try:
                crash_writing(root / crash, crash)
            except BaseException:  # noqa: BLE001 - said, and the status says it failed
                traceback.print_exc()
                status = 1
            os._exit(status)
        _, status = os.waitpid(pid, 0)
        print(crash, os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
