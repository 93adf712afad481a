"""A training job as the tests start it: a job root laid out as the backends lay it out, the
image's entrypoint run in it (a new interpreter, or forked by a fork server), and what it
leaves read back. Shared by the tests of what a training job does (tests/test_resume.py,
tests/test_training_job.py, tests/test_fsdp.py, tests/reliability/...)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from safetensors.torch import load_file

from pipeline.player.environment import image_env
from pipeline.player.fork_client import WarmProcess, WarmStart
from pipeline.player.job_root import lay_out_training
from pipeline.player.processes import free_port
from steps.runtime.names import (
    ENTRYPOINT,
    MASTER_ADDR_VARIABLE,
    MASTER_PORT_VARIABLE,
    PROCESSES_VARIABLE,
)
from tests.conftest import ROOT, gated, wait_at_gate

HPS = {
    "model_name": "bow", "epochs": "3", "learning_rate": "0.01",
    "batch_size": "8", "max_per_device_batch_size": "4", "warmup_ratio": "0.1",
    "weight_decay": "0.01", "seed": "5", "checkpoint_every_steps": "3", "keep_checkpoints": "2",
    "wandb_project": "t", "wandb_mode": "disabled", "max_steps": "0",
}  # fmt: skip


def job_root(tmp: Path, channels: dict[str, Path], hps: dict = HPS) -> tuple[Path, dict[str, str]]:
    """A job root laid out as the backends lay it out, and the environment the image's
    entrypoint starts in (the code is this checkout)."""
    request = {
        "InputDataConfig": [
            {"ChannelName": name, "DataSource": {"S3DataSource": {"S3Uri": str(src)}}}
            for name, src in channels.items()
        ],
        "ResourceConfig": {"InstanceType": "local", "InstanceCount": 1},
    }

    def link(uri: str, local: Path) -> None:
        if not local.exists():
            local.parent.mkdir(parents=True, exist_ok=True)
            local.symlink_to(uri, target_is_directory=True)

    lay_out_training(request, tmp, "algo-1", ["algo-1"], link, hps)
    return tmp, {
        **os.environ,
        **image_env(tmp),
        "TRAINING_JOB_NAME": "resume-test",
        "SMPIPE_USER_FUNCTIONS": "user_functions",
        "PYTHONPATH": str(ROOT),
    }


class Forked:
    """A job a fork server started (fork_client.WarmProcess), read as a Popen(text=True)."""

    def __init__(self, process: WarmProcess) -> None:
        self.process, self.pid, self.args = process, process.pid, process.args
        self.stdout = io.TextIOWrapper(process.stdout)

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.process.wait(timeout)

    def send_signal(self, sig: int) -> None:
        if self.process.poll() is None:  # as Popen: never to a pid the job no longer holds
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        out = self.stdout.read()
        self.process.wait(timeout)
        return out, None


def start(env: dict, processes: int, warm: WarmStart | None = None) -> subprocess.Popen | Forked:
    """The image's entrypoint for a training job, in a new interpreter or forked by `warm`'s
    server (cold all the same for the first job of an environment it has no server for)."""
    env = {**env, PROCESSES_VARIABLE: str(processes), MASTER_ADDR_VARIABLE: "127.0.0.1",
           MASTER_PORT_VARIABLE: str(free_port())}  # fmt: skip
    command = [sys.executable, *ENTRYPOINT[1:], "train"]
    forked = warm.start(command, env, ROOT) if warm is not None else None
    if forked is not None:
        return Forked(forked)
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def run_to_end(env: dict, processes: int = 1, warm: WarmStart | None = None) -> str:
    proc = start(env, processes, warm)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return out


class Gated:
    """The job started (or resumed), its output read aside, once it waits in optimizer step
    `step` for a signal (tests/jobs/gate.py)."""

    def __init__(self, env: dict, gates: Path, step: int, processes: int = 1, warm=None):
        functions = env.get("SMPIPE_USER_FUNCTIONS", "user_functions")
        functions = "tests.jobs.gated" if functions == "user_functions" else functions
        self.proc = start({**env, **gated(gates, step, functions)}, processes, warm)
        self.lines: list[str] = []
        self.reader = threading.Thread(
            target=lambda: self.lines.extend(self.proc.stdout), daemon=True
        )
        self.reader.start()
        try:
            wait_at_gate(gates, step, lambda: self.proc.poll() is None)
        except AssertionError as e:
            self.proc.kill()
            raise AssertionError(f"{e}:\n{self.output()}") from None

    def output(self) -> str:
        """Everything it printed, once it has ended."""
        self.proc.wait(timeout=120)
        self.reader.join(timeout=60)
        return "".join(self.lines)


def result(root: Path) -> tuple[dict, list]:
    weights = load_file(str(root / "model/model.safetensors"))
    history = [
        {k: v for k, v in h.items() if k != "seconds"}
        for h in json.loads((root / "model/history.json").read_text())
    ]
    return weights, history
