"""Playing a job from its request to its status, as SageMaker plays it on its instances: every
host's job root laid out (job_root.py), the inputs and checkpoints moved (transfers.py), the
containers run (a `ContainerRunner`); their exits are read as a status by exits.py.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pipeline.player.environment import training_env
from pipeline.player.exits import ContainerExit
from pipeline.player.job_root import (
    InputMissing,
    lay_out_processing,
    lay_out_training,
    new_instance,
    processing_hosts,
    processing_roots,
    training_hosts,
)
from pipeline.player.transfers import CheckpointSync, checkpoint_prefix, fetch_input
from pipeline.store import Store
from steps.runtime import names
from steps.runtime.names import host_path


class ContainerRunner(Protocol):
    """What playing a job asks of whatever runs its containers: `processes.Containers`, which
    starts each through a launcher, the image's entrypoint as processes of this machine
    (`processes.ProcessLauncher`) or the image itself, a container per host, with docker or
    podman (`images.ImageLauncher`)."""

    stopping: bool  # the driver is stopping: nothing is restarted

    def run(self, root: Path, arguments: list[str], env: dict[str, str], **how) -> ContainerExit:
        """One host's container, started in `root` and waited for."""
        ...

    def run_hosts(self, roots: dict[str, Path], env: dict[str, str], **how) -> dict:
        """Every host's container at once; host -> its ContainerExit."""
        ...

    def stop(
        self, job: str = "", signum: int = signal.SIGTERM, *, restartable: bool = False
    ) -> None:
        """Stop the containers of every job whose name starts with `job`."""
        ...

    def was_stopped(self, job: str) -> bool:
        """Whether `job` was stopped on request."""
        ...


@dataclass
class Played:
    exits: list[ContainerExit]
    roots: dict[str, Path]  # host -> its job root, in resourceconfig.json's order
    restarts: int


def play_processing(
    request: dict,
    root: Path,
    store: Store,
    containers: ContainerRunner,
    *,
    log,
    on_line,
    arn: str | None = None,
) -> list[ContainerExit]:
    """A processing job as SageMaker runs it: on each of its instances at once, inputs in (a
    sharded input's share), the entrypoint with the request's ContainerEntrypoint and
    ContainerArguments, outputs left in their LocalPath (`processing_outputs`). One exit per
    instance, in host order. `log` is one writer, or a function giving each host's."""
    app = request["AppSpecification"]
    roots, hosts = processing_roots(request, root), processing_hosts(request)

    def fetch(uri: str, local: Path, shard: tuple[int, int]) -> None:
        fetch_input(store, uri, local, shard)

    try:
        for host, host_root in roots.items():
            lay_out_processing(request, host_root, fetch, arn, host, hosts)
    except InputMissing as e:
        return [ContainerExit.before_start(str(e))]
    how = {
        "failure_file": names.PROCESSING_FAILURE_FILE,
        "on_line": on_line,
        "job": request["ProcessingJobName"],
        "entrypoint": app.get("ContainerEntrypoint"),
        "deadline": time.time() + request["StoppingCondition"]["MaxRuntimeInSeconds"],
    }
    arguments, env = app.get("ContainerArguments", []), request.get("Environment", {})
    if len(roots) == 1:
        writer = log(hosts[0]) if callable(log) else log
        return [containers.run(root, arguments, env, log=writer, **how)]
    exits = containers.run_hosts(roots, env, arguments=arguments, log=log, **how)
    return [exits[host] for host in hosts]


Restart = Callable[[list[ContainerExit], int], bool]


def play_training(
    request: dict,
    work: Path,
    store: Store,
    containers: ContainerRunner,
    *,
    log,
    on_line,
    restart: Restart,
    on_restart=None,
    arn: str | None = None,
) -> Played:
    """A training job as SageMaker runs it: every host laid out and started with `train`,
    checkpoints synced down before and up after each attempt, and the job started again from
    them while `restart(exits, restarts so far)` says so (a spot job that lost its instance,
    on SageMaker; an interrupted or killed one, locally)."""
    hosts = training_hosts(request)
    roots = {host: work / host for host in hosts}
    fetch = lambda uri, local: fetch_input(store, uri, local)  # noqa: E731
    try:
        for host, root in roots.items():
            lay_out_training(request, root, host, hosts, fetch, request["HyperParameters"])
    except InputMissing as e:
        return Played([ContainerExit.before_start(str(e))], roots, 0)
    name = request["TrainingJobName"]
    sync = CheckpointSync(
        store,
        checkpoint_prefix(request, store),
        [host_path(root, names.CHECKPOINT_DIR) for root in roots.values()],
    )
    metrics = request["AlgorithmSpecification"].get("MetricDefinitions", [])
    attempt = {
        "on_line": on_line,
        "log": log,
        "failure_file": names.TRAINING_FAILURE_FILE,
        "metric_regexes": {m["Name"]: m["Regex"] for m in metrics},
        "job": name,
        # MaxRuntimeInSeconds covers every attempt of the job (API_StoppingCondition.html).
        "deadline": time.time() + request["StoppingCondition"]["MaxRuntimeInSeconds"],
    }
    restarts = 0
    while True:
        sync.down()
        try:
            exits = list(
                containers.run_hosts(roots, training_env(request, arn), **attempt).values()
            )
        finally:  # the driver stopping the job too: what it checkpointed reaches the store
            sync.up()
        stopped = containers.stopping or containers.was_stopped(name)
        stopped = stopped or any(e.timed_out for e in exits)
        if stopped or all(e.code == 0 for e in exits) or not restart(exits, restarts):
            return Played(exits, roots, restarts)
        restarts += 1
        for root in roots.values():
            new_instance(root)
        if on_restart is not None:
            on_restart(restarts)
