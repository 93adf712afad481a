"""The training loop never waits for the device between its logging steps: steps/train.py's
optimizer steps, counted by tests/jobs/host_reads.py, read no tensor's value on the host but
after a logging step and at the epoch's end (and, with several processes, after the first
step, where they measure their pace for the SIGTERM check: training_blocks.StopCheck). What
is read late is still acted on: a non-finite loss named by its own step, SIGTERM at the next
step the processes agree on."""

from __future__ import annotations

import json
import re
import signal
from types import SimpleNamespace

import pytest
import torch

from steps.train import read_loss
from steps.training_blocks import Diverged, EpochLoss
from tests.jobs.prepared import write_small_splits
from tests.jobs.training_job import HPS, Gated, job_root, start

# 64 rows, 2 a step: one epoch of 32 optimizer steps, a progress line every 3.
SMALL_STEPS = {**HPS, "epochs": "1", "batch_size": "2", "max_per_device_batch_size": "1",
               "checkpoint_every_steps": "0"}  # fmt: skip


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    return write_small_splits(tmp_path_factory.mktemp("prepared"))


def host_reads(tmp_path, splits, processes: int, warm) -> tuple[str, list[dict]]:
    """One epoch of SMALL_STEPS, forked as the local backend starts a job: its output and each
    process's reads by step."""
    root, env = job_root(tmp_path, splits, SMALL_STEPS)
    proc = start({**env, "SMPIPE_STEP": "tests.jobs.host_reads"}, processes, warm)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    model = root / "model"
    return out, [
        json.loads((model / f"host-reads-rank{r}.json").read_text()) for r in range(processes)
    ]


@pytest.mark.parametrize("processes", [1, 2])
def test_an_optimizer_step_reads_nothing_on_the_host_but_after_logging_steps(
    tmp_path, splits, processes, warm
):
    out, ranks = host_reads(tmp_path, splits, processes, warm)
    logged = {int(s) for s in re.findall(r"^step=(\d+)/", out, re.M)}
    for rank, seen in enumerate(ranks):
        steps = seen["steps_per_epoch"]
        assert steps == 32 and logged == set(range(3, steps + 1, 3)), out[-3000:]
        reads = {int(step): names for step, names in seen["reads"].items()}
        per_step = [sum(reads.get(step, {}).values()) for step in range(steps + 1)]
        print(f"rank {rank} of {processes}: host reads after each optimizer step {per_step}")
        # Step 0: before the first step. The last: the epoch's end reads the loss once.
        quiet = {s for s in range(steps) if s not in logged}
        if processes > 1:  # the processes' first SIGTERM check: the flags and their pace
            quiet.discard(1)
            assert reads.get(1) == {"tolist": 1}, reads
        assert {s: reads[s] for s in sorted(quiet) if s in reads} == {}, per_step
        assert all(per_step[s] > 0 for s in logged | {steps}), per_step


@pytest.mark.parametrize("processes", [1, 2])
def test_sigterm_between_logging_steps_is_acted_on_where_the_processes_agree(
    tmp_path, splits, processes, warm
):
    """SIGTERM in step 4: one process checkpoints after it; two ask each other after the next
    logging step, 6 (their steps take milliseconds, far from STOP_CHECK_SECONDS)."""
    root, env = job_root(tmp_path, splits, SMALL_STEPS)
    job = Gated(env, tmp_path / "gates", 4, processes, warm)
    job.proc.send_signal(signal.SIGTERM)
    log = job.output()
    assert job.proc.returncode == 75, log[-3000:]
    at = 4 if processes == 1 else 6
    assert f"SIGTERM: checkpoint written at step {at}; exiting to be resumed" in log, log[-3000:]


def test_a_non_finite_loss_read_after_its_step_is_named_by_its_step():
    """The loss of steps 1 to 3 read at once, after step 3: step 2's nan is the one named."""
    job = SimpleNamespace(
        hp={"learning_rate": 10.0, "weight_decay": 10.0},
        state=SimpleNamespace(step=0, epoch=0, epoch_loss=[0.0, 0.0]),
        last_finite=None,
    )
    losses = EpochLoss(job.state.epoch_loss, torch.device("cpu"))
    for loss in (1.0, float("nan"), 0.7):  # one micro-batch a step
        losses.add(torch.tensor(loss))
        job.state.step += 1
        losses.step_taken(job.state.step)
    expected = (
        r"the training loss is nan at optimizer step 2 \(epoch 1, found after step 3\); "
        r"the last finite loss was 1\.0000 at step 1\. Lower LEARNING_RATE \(10\)"
    )
    with pytest.raises(Diverged, match=expected):
        read_loss(job, losses)
