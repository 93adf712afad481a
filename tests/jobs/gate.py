"""A training job that stops at a step a test names, whatever the machine's speed.

With SMPIPE_TEST_GATE="<folder>:<step>" in its environment, `gate(model)` makes the job wait
in the first forward pass of optimizer step <step>: it writes <folder>/<marker> (its pid) and
waits there until the process gets SIGTERM, then goes on: the step finishes, and the job does
what it does on SIGTERM. A test waits for the file (a fact, not a printed line that the job
has already outrun), then signals or kills the job: the interruption lands in that step, every
time. Once: a job that finds the file there (the restarted one) does not wait.
<step> `epoch2`: the first step after the first validation (the first epoch's end, which
is checkpointed). "<folder>:<step>:<name>": only in a job whose TRAINING_JOB_NAME holds <name>
(one trial of a study).
With SMPIPE_TEST_GATE_HOLD=1 too, the job then holds its stop: once the SIGTERM has come it
writes <folder>/stopping (its pid) and waits for <folder>/release before it goes on, so a
test can act while the job is being stopped.

The step is counted as train.py counts it: the step the job resumed from (its checkpoint
folder's CURRENT, none: 0), plus one for every `accumulation` training forward passes of this
process, accumulation = ceil(BATCH_SIZE / (processes x MAX_PER_DEVICE_BATCH_SIZE)) (an epoch
of whole steps, as the tests' data has). Only the standard library: a test copies this file
beside user functions of its own.
"""

import math
import os
import signal
import time
from pathlib import Path

GATE_VARIABLE = "SMPIPE_TEST_GATE"
HOLD_VARIABLE = "SMPIPE_TEST_GATE_HOLD"
PATIENCE_SECONDS = 300  # a test that never signals fails the job, naming the gate


def marker(folder, step: int | str, rank: int = 0) -> Path:
    return Path(folder) / f"waiting-at-step-{step}-rank-{rank}"


def gate(model):
    """The model, made to wait in step <step> when SMPIPE_TEST_GATE says so."""
    spec = os.environ.get(GATE_VARIABLE)
    if spec:
        folder, step, *job = spec.split(":")
        if not job or job[0] in os.environ.get("TRAINING_JOB_NAME", ""):
            model.register_forward_pre_hook(Gate(folder, step))
    return model


class Gate:
    def __init__(self, folder: str, step: str):
        self.folder, self.step = folder, step
        self.forwards, self.resumed_at, self.signalled, self.passed = 0, None, False, False
        self.validated = False

    def __call__(self, module, args):
        if not module.training:  # validation (a check before the loop is not)
            self.validated = self.resumed_at is not None
            return
        if self.passed:
            return
        if self.resumed_at is None:  # the loop has begun: the job's own SIGTERM handler is set
            self.resumed_at, self.accumulation = resumed_step(), accumulation()
            self.chain_sigterm()
        self.forwards += 1
        if not self.reached():
            return
        self.passed = True
        rank = int(os.environ.get("RANK", "0"))
        here = marker(self.folder, self.step, rank)
        if here.exists():
            return
        write_whole(here, str(os.getpid()))
        deadline = time.monotonic() + PATIENCE_SECONDS
        while not self.signalled:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{GATE_VARIABLE}: no SIGTERM came at step {self.step}")
            time.sleep(0.01)
        if os.environ.get(HOLD_VARIABLE):
            write_whole(Path(self.folder) / "stopping", str(os.getpid()))
            while not (Path(self.folder) / "release").exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{HOLD_VARIABLE}: no release came at step {self.step}")
                time.sleep(0.01)

    def reached(self) -> bool:
        if self.step == "epoch2":
            return self.validated
        return self.resumed_at + math.ceil(self.forwards / self.accumulation) >= int(self.step)

    def chain_sigterm(self) -> None:
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum, frame):
            self.signalled = True
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)


def write_whole(path: Path, text: str) -> None:
    """Whole or absent: a test that sees the file reads the pid."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text)
    partial.replace(path)


def resumed_step() -> int:
    current = Path(os.environ["SM_CHECKPOINT_DIR"]) / "CURRENT"
    return int(current.read_text().strip().rsplit("-", 1)[1]) if current.exists() else 0


def accumulation() -> int:
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    batch, per_device = (
        int(os.environ[f"SM_HP_{name}"]) for name in ("BATCH_SIZE", "MAX_PER_DEVICE_BATCH_SIZE")
    )
    return math.ceil(batch / (processes * per_device))
