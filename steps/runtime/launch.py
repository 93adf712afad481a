"""The step's command line: one `python -m` process, or torchrun across every host and process
of the job (`nnodes` and `node_rank` from resourceconfig.json, the first host as master), as
SageMaker's framework containers launch a distributed training script."""

from __future__ import annotations

import json
import os
import sys

from steps.runtime import names

TORCHRUN = "torch.distributed.run"
# torchrun's command line, its workers forked from it (torchrun_fork.py): where the entrypoint
# was itself forked by a warm-start server.
TORCHRUN_FORK = "steps.runtime.torchrun_fork"


def runs_workers(command: list[str]) -> bool:
    """Whether `command` is torchrun's (either): the processes that train are its children."""
    return TORCHRUN in command or TORCHRUN_FORK in command


def step_module(step: str) -> str:
    """`train` is steps/train.py; a dotted name is any module shipped with the code."""
    return step if "." in step else f"steps.{step}"


def processing_command(step: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", step_module(step), *args]


def processes_per_host(env: dict[str, str]) -> int:
    """PROCESSES_PER_HOST: a number, or auto (one per GPU of the instance, as SageMaker's
    framework containers launch them; one where there is none)."""
    wanted = os.environ.get(names.PROCESSES_VARIABLE, "1")
    if wanted == "auto":
        return max(1, int(env.get(names.SM_NUM_GPUS, "0")))
    return int(wanted)


def training_command(env: dict[str, str]) -> list[str]:
    module = step_module(os.environ.get(names.STEP_VARIABLE, "train"))
    hosts = json.loads(env[names.SM_HOSTS])
    per_host = processes_per_host(env)
    if len(hosts) * per_host == 1:
        return [sys.executable, "-m", module]
    master = os.environ.get(names.MASTER_ADDR_VARIABLE, hosts[0])
    port = os.environ.get(names.MASTER_PORT_VARIABLE, "29500")
    return [
        sys.executable,
        "-m",
        TORCHRUN,
        f"--nnodes={len(hosts)}",
        f"--node_rank={hosts.index(env[names.SM_CURRENT_HOST])}",
        f"--nproc_per_node={per_host}",
        f"--master_addr={master}",
        f"--master_port={port}",
        # torchrun's log folder holds only what nothing here asks for (per-rank output
        # redirects, the error files of @record); by default it is a new folder in the temporary
        # folder, never removed: a container's own /tmp on SageMaker, this machine's for a job
        # played as a process, one left behind by every multi-process job. os.devnull: none
        # (torch/distributed/elastic/multiprocessing/api.py, DefaultLogsSpecs).
        f"--log-dir={os.devnull}",
        "-m",
        module,
    ]
