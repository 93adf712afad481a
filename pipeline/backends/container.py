"""Playing SageMaker's part on this machine: lay a job root out from a request, start the
image's entrypoint in it, watch it.

The local and the emulated backends both run jobs through here, from the very request the
SageMaker backend sends: the inputs the request names are downloaded where the container
would find them, the config files SageMaker writes are written, the image's ENV lines (read
from docker/Dockerfile) are set with `SMPIPE_ML_ROOT` pointing at the job root in place of
/opt/ml, and `python3 -m steps.entrypoint ...` is started as SageMaker starts the image.
Nothing in steps/ can tell which backend started it.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from pipeline.jobs import Status
from pipeline.raw_data import is_hidden
from pipeline.store import (
    NotFound,
    Store,
    StoreError,
    download_dir,
    is_complete,
    key_of,
    open_store,
    verify_dir,
)
from steps.entrypoint import (
    DRIVER_PID_VARIABLE,
    ENTRYPOINT,
    MASTER_ADDR_VARIABLE,
    MASTER_PORT_VARIABLE,
    ML_ROOT_VARIABLE,
    redact,
    secret_values,
)

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = PROJECT_ROOT / "docker/Dockerfile"
CONTAINER_ROOT = "/opt/ml"


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        current += " " + line.removesuffix("\\").strip() if current else line.removesuffix("\\")
        if not line.endswith("\\"):
            lines.append(current.strip())
            current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def image_env(root: Path) -> dict[str, str]:
    """The image's ENV, as a container of it sees it, with the job root in place of /opt/ml."""
    env: dict[str, str] = {}
    for instruction, args in dockerfile_instructions():
        if instruction != "ENV":
            continue
        for token in shlex.split(args):
            key, _, value = token.partition("=")
            env[key] = value.replace(CONTAINER_ROOT, str(root))
    env[ML_ROOT_VARIABLE] = str(root)
    return env


# A container of the image starts with what Docker sets in every Linux container (HOME, PATH,
# HOSTNAME: https://docs.docker.com/engine/containers/run/#environment-variables) and what the
# base image's ENV adds (pytorch/pytorch: its Python's folder first on PATH, LANG and LC_ALL
# C.UTF-8); docker/Dockerfile's ENV comes on top (`image_env`), then the request's Environment,
# then what SageMaker sets. HOME is the job's own, empty folder: root's home in a new container
# holds no cache (a Hugging Face cache on this machine is not the job's).
DOCKER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What this machine's processor is, passed on when set, as the processor a job runs on is the
# host's: OpenBLAS's core type, on processors that older OpenBLAS builds misdetect; and the
# override of the bf16 detection (steps/precision.py), set where torch misjudges the CPU.
HOST_VARIABLES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "SMPIPE_CPU_BF16")


def fresh_container_env(root: Path) -> dict[str, str]:
    """The environment of a new container of the image, before its ENV (see above)."""
    home = root / "home"
    home.mkdir(parents=True, exist_ok=True)
    env = {
        "HOME": str(home),
        "PATH": f"{Path(sys.executable).parent}:{DOCKER_PATH}",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
    }
    env.update({k: os.environ[k] for k in HOST_VARIABLES if k in os.environ})
    return env


def in_root(root: Path, container_path: str) -> Path:
    """Where a container path (/opt/ml/...) lies in this job's root."""
    return root / container_path.removeprefix(CONTAINER_ROOT).lstrip("/")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- what SageMaker moves: inputs in, checkpoints both ways -------------------------------------


def fetch_input(store: Store, uri: str, local: Path, shard: tuple[int, int] = (0, 1)) -> None:
    """A manifested directory is downloaded and verified. Raw data the user keeps elsewhere
    (another bucket or folder), or a folder of several manifested ones (every model of a run),
    is downloaded as it is, and any manifest in it is checked.

    `shard` (this host's index, the hosts) is a ShardedByS3Key input on several instances:
    "sharded by Amazon S3 key, downloading one shard of data to each processing instance"
    (API_ProcessingS3Input). Which objects make a shard is not documented; here the keys in
    order, dealt out in turn (the i-th to host i mod n). A shard is not the whole folder its
    manifest lists, so it is not checked against it; it may be empty."""
    key = key_of(store, uri)
    elsewhere = key is None
    if elsewhere:
        store, key = open_store(uri), ""
    index, count = shard
    if count == 1 and is_complete(store, key):
        download_dir(store, key, local)
        return
    keys = store.list_keys(key)
    if elsewhere and "://" not in uri:
        # A folder on this machine (the local backend's RAW_DATA): its hidden files and
        # folders are not data, as everywhere (pipeline/raw_data.py).
        keys = [k for k in keys if not is_hidden(k)]
    if not keys:
        raise NotFound(f"nothing at {store.uri_of(key) if key else store.uri}")
    local.mkdir(parents=True, exist_ok=True)
    for k in sorted(keys)[index::count]:
        store.download_file(k, local / k[len(key) :].lstrip("/"))
    if count == 1:
        verify_dir(local)


class CheckpointSync:
    """/opt/ml/checkpoints kept in step with CheckpointConfig.S3Uri as SageMaker keeps it
    (https://docs.aws.amazon.com/sagemaker/latest/dg/model-checkpoints.html): when the job
    starts, everything under the URI is copied into every host's folder; what a host writes
    there is uploaded, and what it deletes of what it had is deleted in S3. Nothing else is
    touched: the files of other jobs under the same URI (every trial of a tuning job shares
    one) stay as they are. Played when the container exits, where SageMaker also syncs while it
    runs; temporary files of a checkpoint cut short are not uploaded."""

    def __init__(self, store: Store, prefix: str, folders: list[Path]) -> None:
        self.store, self.prefix, self.folders = store, prefix, folders
        self.had: dict[Path, dict[str, tuple[int, int]]] = {}

    def _files(self, folder: Path) -> dict[str, tuple[int, int]]:
        found = {}
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(folder).as_posix()
            if path.is_file() and ".tmp" not in rel and not path.name.startswith("."):
                stat = path.stat()
                found[rel] = (stat.st_size, stat.st_mtime_ns)
        return found

    def down(self) -> None:
        keys = self.store.list_keys(self.prefix)
        for folder in self.folders:
            for key in keys:
                self.store.download_file(key, folder / key[len(self.prefix) :])
            self.had[folder] = self._files(folder)

    def up(self) -> None:
        written: dict[str, Path] = {}  # the first host's file wins, as the first host's model
        deleted: set[str] = set()
        for folder in self.folders:
            now, had = self._files(folder), self.had.get(folder, {})
            for rel, stamp in now.items():
                if had.get(rel) != stamp:
                    written.setdefault(rel, folder / rel)
            deleted |= set(had) - set(now)
        pointers = [rel for rel in written if rel.rsplit("/", 1)[-1] == "CURRENT"]
        for rel in [r for r in written if r not in pointers] + pointers:  # pointers last
            self.store.upload_file(written[rel], self.prefix + rel)
        for rel in sorted(deleted - set(written)):
            self.store.delete(self.prefix + rel)
        for folder in self.folders:
            self.had[folder] = self._files(folder)


# -- laying out a job root --------------------------------------------------------------------


class InputMissing(RuntimeError):
    """An input of a job that cannot be read: the job fails naming it, as SageMaker fails a
    job whose data it cannot download (a ClientError)."""


def fetch_named(fetch, name: str, uri: str, local: Path) -> None:
    try:
        fetch(uri, local)
    except (NotFound, StoreError) as e:
        raise InputMissing(f"ClientError: input '{name}' ({uri}) cannot be read: {e}") from None


def processing_job_config(request: dict, arn: str | None) -> dict:
    """processingjobconfig.json as the developer guide shows it: the request with the job's
    ARN, and the fields SageMaker fills in where the request left them out (null, or their
    defaults: S3CompressionType None, S3DownloadMode StartOfJob)
    (build-your-own-processing-container.html; tests/contract/processing/)."""
    app = request["AppSpecification"]
    inputs = [
        {
            **item,
            "S3Input": {
                "S3CompressionType": "None",
                "S3DownloadMode": "StartOfJob",
                **item["S3Input"],
            },
        }
        for item in request.get("ProcessingInputs", [])
    ]
    cluster = request["ProcessingResources"]["ClusterConfig"]
    return {
        **({"ProcessingJobArn": arn} if arn else {}),  # the local backend's jobs have none
        "ProcessingJobName": request["ProcessingJobName"],
        "AppSpecification": {
            "ImageUri": app["ImageUri"],
            "ContainerEntrypoint": app.get("ContainerEntrypoint"),
            "ContainerArguments": app.get("ContainerArguments"),
        },
        "Environment": request.get("Environment", {}),
        "ProcessingInputs": inputs,
        "ProcessingOutputConfig": {
            "KmsKeyId": None,
            **request.get("ProcessingOutputConfig", {"Outputs": []}),
        },
        "ProcessingResources": {"ClusterConfig": {"VolumeKmsKeyId": None, **cluster}},
        "RoleArn": request["RoleArn"],
        "StoppingCondition": request["StoppingCondition"],
    }


def processing_hosts(request: dict) -> list[str]:
    """A processing job's instances, named as resourceconfig.json names them."""
    count = request["ProcessingResources"]["ClusterConfig"]["InstanceCount"]
    return [f"algo-{i}" for i in range(1, count + 1)]


def lay_out_processing(
    request: dict,
    root: Path,
    fetch,
    arn: str | None = None,
    host: str = "algo-1",
    hosts: list[str] | None = None,
) -> None:
    """One instance's inputs downloaded to their LocalPath (a ShardedByS3Key input: its shard,
    `fetch(uri, local, (index, hosts))`), output folders made, the job's config written:
    /opt/ml/config/processingjobconfig.json is the request with the job's ARN
    (build-your-own-processing-container.html), resourceconfig.json its hosts ("current_host",
    "hosts", as the same page shows them)."""
    hosts = hosts or [host]
    for item in request["ProcessingInputs"]:
        s3 = item["S3Input"]
        sharded = s3.get("S3DataDistributionType") == "ShardedByS3Key" and len(hosts) > 1
        shard = (hosts.index(host), len(hosts)) if sharded else (0, 1)
        fetch_named(
            lambda uri, local, shard=shard: fetch(uri, local, shard),
            item["InputName"],
            s3["S3Uri"],
            in_root(root, s3["LocalPath"]),
        )
    for item in request["ProcessingOutputConfig"]["Outputs"]:
        in_root(root, item["S3Output"]["LocalPath"]).mkdir(parents=True, exist_ok=True)
    (root / "config").mkdir(parents=True, exist_ok=True)
    config = processing_job_config(request, arn)
    (root / "config/processingjobconfig.json").write_text(json.dumps(config, indent=2))
    resource = {"current_host": host, "hosts": hosts}
    (root / "config/resourceconfig.json").write_text(json.dumps(resource, indent=2))


def processing_roots(request: dict, root: Path) -> dict[str, Path]:
    """Each instance's job root: `root` itself for one, `root/<host>` for several."""
    hosts = processing_hosts(request)
    return {hosts[0]: root} if len(hosts) == 1 else {host: root / host for host in hosts}


def processing_outputs(request: dict, root: Path) -> dict[str, Path]:
    """OutputName -> the folder to upload to its S3Uri. Every instance uploads its LocalPath
    to the same S3Uri; several instances' folders are merged here first (a file two write
    under the same name is the last host's, as the last upload to one S3 key is what stays)."""
    roots = processing_roots(request, root)
    merged = {}
    for item in request["ProcessingOutputConfig"]["Outputs"]:
        local = item["S3Output"]["LocalPath"]
        if len(roots) == 1:
            merged[item["OutputName"]] = in_root(root, local)
            continue
        into = root / "outputs" / item["OutputName"]
        into.mkdir(parents=True, exist_ok=True)
        for host_root in roots.values():
            shutil.copytree(in_root(host_root, local), into, dirs_exist_ok=True)
        merged[item["OutputName"]] = into
    return merged


# SageMaker's names for a training job's one instance group and its network interface, as
# resourceconfig.json shows them (your-algorithms-training-algo-running-container.html; the
# toolkit reads current_group_name: sagemaker-training-toolkit environment.py).
HOMOGENEOUS_GROUP = "homogeneousCluster"
NETWORK_INTERFACE = "eth0"


def resource_config(request: dict, host: str, hosts: list[str]) -> dict:
    """/opt/ml/input/config/resourceconfig.json of `host`, as SageMaker writes it."""
    instance_type = request["ResourceConfig"]["InstanceType"]
    return {
        "current_host": host,
        "current_instance_type": instance_type,
        "current_group_name": HOMOGENEOUS_GROUP,
        "hosts": hosts,
        "instance_groups": [
            {
                "instance_group_name": HOMOGENEOUS_GROUP,
                "instance_type": instance_type,
                "hosts": hosts,
            }
        ],
        "network_interface_name": NETWORK_INTERFACE,
    }


def lay_out_training(
    request: dict, root: Path, host: str, hosts: list[str], fetch, hyperparameters: dict
) -> None:
    """input/data/<channel>, input/config/*.json, model/, output/, checkpoints/."""
    config = root / "input/config"
    config.mkdir(parents=True, exist_ok=True)
    input_config = {}
    for channel in request["InputDataConfig"]:
        source = channel["DataSource"]["S3DataSource"]
        fetch_named(
            fetch,
            channel["ChannelName"],
            source["S3Uri"],
            root / "input/data" / channel["ChannelName"],
        )
        input_config[channel["ChannelName"]] = {
            "TrainingInputMode": channel.get("InputMode", "File"),
            "S3DistributionType": source.get("S3DataDistributionType", "FullyReplicated"),
            "RecordWrapperType": "None",
        }
    resource = resource_config(request, host, hosts)
    (config / "hyperparameters.json").write_text(json.dumps(hyperparameters, indent=2))
    (config / "resourceconfig.json").write_text(json.dumps(resource, indent=2))
    (config / "inputdataconfig.json").write_text(json.dumps(input_config, indent=2))
    if request.get("CheckpointConfig"):
        checkpoint = {"LocalPath": CONTAINER_ROOT + "/checkpoints", **request["CheckpointConfig"]}
        (config / "checkpointconfig.json").write_text(json.dumps(checkpoint, indent=2))
    for sub in ("model", "output/data", "checkpoints"):
        (root / sub).mkdir(parents=True, exist_ok=True)


def training_hosts(request: dict) -> list[str]:
    """algo-1 ... algo-N (your-algorithms-training-algo-running-container.html)."""
    return [f"algo-{i}" for i in range(1, request["ResourceConfig"]["InstanceCount"] + 1)]


def checkpoint_prefix(request: dict, store: Store) -> str:
    uri = request["CheckpointConfig"]["S3Uri"]
    base = key_of(store, uri)
    if base is None:
        raise StoreError(f"checkpoints outside the store: {uri}")
    return base.rstrip("/") + "/"


@dataclass
class Played:
    exits: list[ContainerExit]
    roots: dict[str, Path]  # host -> its job root; the first host's model is the job's
    restarts: int


def play_processing(
    request: dict,
    root: Path,
    store: Store,
    containers: Containers,
    *,
    log,
    on_line,
    arn: str | None = None,
) -> ContainerExit:
    """A processing job as SageMaker runs it: on each of its instances at once, inputs in (a
    sharded input's share), the entrypoint with the request's ContainerEntrypoint and
    ContainerArguments, outputs left in their LocalPath (`processing_outputs`). One exit per
    instance, in host order. `log` is one writer, or a function giving each host's."""
    app = request["AppSpecification"]
    if app.get("ContainerEntrypoint", ENTRYPOINT) != ENTRYPOINT:
        raise ValueError(
            f"cannot play ContainerEntrypoint {app['ContainerEntrypoint']}: "
            f"the image's entrypoint is {ENTRYPOINT}"
        )
    roots, hosts = processing_roots(request, root), processing_hosts(request)

    def fetch(uri: str, local: Path, shard: tuple[int, int]) -> None:
        fetch_input(store, uri, local, shard)

    try:
        for host, host_root in roots.items():
            lay_out_processing(request, host_root, fetch, arn, host, hosts)
    except InputMissing as e:
        return [ContainerExit.before_start(str(e))]
    how = {
        "failure_file": "/opt/ml/output/message",
        "on_line": on_line,
        "job": request["ProcessingJobName"],
        "deadline": time.time() + request["StoppingCondition"]["MaxRuntimeInSeconds"],
    }
    arguments, env = app.get("ContainerArguments", []), request.get("Environment", {})
    if len(roots) == 1:
        writer = log(hosts[0]) if callable(log) else log
        return [containers.run(root, arguments, env, log=writer, **how)]
    exits = containers.run_hosts(roots, env, arguments=arguments, log=log, **how)
    return [exits[host] for host in hosts]


Restart = Callable[[list["ContainerExit"], int], bool]


def training_env(request: dict, arn: str | None) -> dict[str, str]:
    """What SageMaker sets in a training container besides the request's Environment
    (your-algorithms-training-algo-running-container.html)."""
    env = {**request.get("Environment", {}), "TRAINING_JOB_NAME": request["TrainingJobName"]}
    if arn:
        env["TRAINING_JOB_ARN"] = arn
    return env


def play_training(
    request: dict,
    work: Path,
    store: Store,
    containers: Containers,
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
        store, checkpoint_prefix(request, store), [root / "checkpoints" for root in roots.values()]
    )
    metrics = request["AlgorithmSpecification"].get("MetricDefinitions", [])
    attempt = {
        "on_line": on_line,
        "log": log,
        "failure_file": "/opt/ml/output/failure",
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
        if on_restart is not None:
            on_restart(restarts)


# -- running the entrypoint -------------------------------------------------------------------


@dataclass
class ContainerExit:
    code: int
    interrupted: bool
    reason: str | None  # the step's own words (output/failure or output/message)
    start: float
    end: float
    peak_rss_mb: float | None
    metrics: dict[str, float] = field(default_factory=dict)
    timed_out: bool = False  # stopped at its MaxRuntimeInSeconds
    # CPU time of its processes, children included ("CPU-seconds", not billed: the local
    # backend's measure of what a job used).
    cpu_seconds: float | None = None

    @classmethod
    def before_start(cls, reason: str) -> ContainerExit:
        """A container that never started: its job failed while being laid out."""
        now = time.time()
        return cls(code=1, interrupted=False, reason=reason, start=now, end=now, peak_rss_mb=None)

    @property
    def killed(self) -> bool:
        """Ended by a signal: the entrypoint itself (a negative status) or its step (the
        entrypoint exits 128 + the signal, as a shell reports it)."""
        return self.code < 0 or 128 < self.code <= 128 + 64


def status_after(
    exits: list[ContainerExit], *, stop_requested: bool, capacity_lost: bool = False
) -> tuple[Status, str | None]:
    """How a job whose containers exited so ends, and why: every backend that plays containers
    reports them through here, as DescribeTrainingJob reports a job (TrainingJobStatus and
    SecondaryStatus in botocore's sagemaker service-2.json).

    Completed when every container exited 0. Stopped when it was stopped on request (Stop*,
    the driver stopping, a pruned trial: no reason, as SageMaker gives none), at its
    MaxRuntimeInSeconds (SecondaryStatus MaxRuntimeExceeded) or when its spot capacity was
    taken back and MaxWaitTimeInSeconds ran out (MaxWaitTimeExceeded). Otherwise Failed, with
    the container's own reason (its failure file) or its exit status. A container that was
    interrupted and checkpointed (exit 75) is Failed too if it was neither stopped nor
    restarted: SageMaker's Interrupted is a job still InProgress, about to restart, and whether
    to restart is the backend's rule, asked before this (local_restart; the emulator's spot
    rule)."""
    if all(e.code == 0 for e in exits):
        return "Completed", None
    if stop_requested:
        return "Stopped", None
    if any(e.timed_out for e in exits):
        seconds = round(max(e.end for e in exits) - min(e.start for e in exits))
        return "Stopped", (
            f"MaxRuntimeExceeded: the job was stopped after {seconds} s, its MaxRuntimeInSeconds"
        )
    if capacity_lost:
        lost = "the job lost its spot capacity and its MaxWaitTimeInSeconds ran out"
        return "Stopped", f"MaxWaitTimeExceeded: {lost}"
    code = max((e.code for e in exits), key=abs)
    said = f"exit status {code}"
    if any(e.interrupted for e in exits):
        said += ": it was interrupted, saved a checkpoint and was not restarted"
    return "Failed", next((e.reason for e in exits if e.reason), None) or said


# StopTrainingJob: "sends the algorithm the SIGTERM signal ... delays job termination for 120
# seconds" before SIGKILL, as `docker stop -t 120` (API_StopTrainingJob.html); the same window
# after MaxRuntimeInSeconds (API_StoppingCondition.html).
STOP_GRACE_SECONDS = 120


class Starter(Protocol):
    """Starts an entrypoint some other way than a new interpreter (backends/warm_start.py)."""

    def start(self, argv: list[str], env: dict[str, str], cwd: Path):
        """A Popen-like process (pid leading its own session, args, stdout, poll, wait), or
        None: start this one the normal way."""


class Containers:
    """The entrypoint processes this machine runs for a backend; `stop` ends them all.

    `base_env(root)`: what a container starts with before the image's ENV. None: this
    machine's environment (the local backend runs jobs as the user's own processes); the
    emulated backend gives a fresh container's (`fresh_container_env`).
    `starter`: how to start an entrypoint (the local backend's warm start); None, or a starter
    that declines a job: a new interpreter, as a container starts (the emulated backend)."""

    def __init__(
        self,
        base_env: Callable[[Path], dict[str, str]] | None = None,
        starter: Starter | None = None,
    ) -> None:
        self.starter = starter
        self._running: dict[int, str] = {}  # pid -> the job it belongs to
        self._lock = threading.Lock()
        self.stopping = False  # set by stop(): nothing is restarted after it
        self._stopped: set[str] = set()  # jobs stopped on request (a pruned trial)
        self.base_env = base_env
        self.grace_seconds = STOP_GRACE_SECONDS
        self._timed_out: set[int] = set()  # containers stopped by their MaxRuntimeInSeconds

    def stop(
        self, job: str = "", signum: int = signal.SIGTERM, *, restartable: bool = False
    ) -> None:
        """`signum` to every running container whose job name starts with `job` (all of them
        by default), as `docker stop` sends it to PID 1: the entrypoint forwards it and the
        training step checkpoints; what a job still has to say is still read. A container
        still running `grace_seconds` later is killed, with every process it started.
        `restartable`: the job is not being stopped (a spot instance taken back), and may be
        started again."""
        with self._lock:
            if not restartable:
                self.stopping = self.stopping or not job
                self._stopped.add(job)
            pids = [pid for pid, tag in self._running.items() if tag.startswith(job)]
        for pid in pids:
            self._signal(pid, signum)

    def _signal(self, pid: int, signum: int) -> None:
        """`signum` to a container, and SIGKILL to it `grace_seconds` later if it still runs."""
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            return
        timer = threading.Timer(self.grace_seconds, self._kill, args=(pid,))
        timer.daemon = True
        timer.start()

    def _time_out(self, pid: int) -> None:
        """MaxRuntimeInSeconds reached: the container is stopped as StopTrainingJob stops one
        (API_StoppingCondition.html: SIGTERM, and the same 120 s to save the model)."""
        with self._lock:
            if pid not in self._running:
                return
            self._timed_out.add(pid)
        self._signal(pid, signal.SIGTERM)

    def _kill(self, pid: int) -> None:
        """SIGKILL to a container that outlived its grace: the entrypoint and every process
        under it (the step runs in a session of its own), as Docker kills a container."""
        import psutil

        with self._lock:
            if pid not in self._running:
                return
        try:
            tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for process in tree:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass

    def _register(self, pid: int, job: str) -> None:
        with self._lock:
            self._running[pid] = job
            late = self.stopping  # stop() came while this one was starting: it stops too
        if late:
            os.killpg(pid, signal.SIGTERM)

    def was_stopped(self, job: str) -> bool:
        with self._lock:
            return any(job.startswith(prefix) for prefix in self._stopped if prefix)

    def run(
        self,
        root: Path,
        arguments: list[str],
        env: dict[str, str],
        *,
        failure_file: str,
        log,
        on_line=None,
        metric_regexes: dict[str, str] | None = None,
        job: str = "",
        deadline: float | None = None,
    ) -> ContainerExit:
        """Start `python3 -m steps.entrypoint <arguments>` in `root` and wait for it; at
        `deadline` (the job's MaxRuntimeInSeconds from its start) it is stopped.

        `env` is the request's Environment and what SageMaker sets; the image's ENV comes
        under it and over the base environment, as a container's would. Every line goes to
        `log` (redacted) and to `on_line` (the job's stream), and is searched with the metric
        regexes."""
        failure = in_root(root, failure_file)
        start = time.time()
        proc, secrets = self._start(root, arguments, env, failure, job)
        clock = self._clock(deadline, proc.pid)
        peak = {"rss": 0.0, "cpu": 0.0}
        done = threading.Event()
        watcher = threading.Thread(target=_watch_memory, args=(proc.pid, peak, done), daemon=True)
        watcher.start()
        try:
            metrics = follow_output(proc, secrets, log, on_line, metric_regexes or {})
            exact_cpu = _exit_cpu_seconds(proc)
            code = proc.wait()
        except BaseException:
            # The driver is stopping (Ctrl-C, an error): the container is stopped as `docker
            # stop` stops one, SIGKILL to all of it `grace_seconds` after the SIGTERM, so this
            # wait ends even where the step ignores SIGTERM.
            self._signal(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
        finally:
            done.set()
            watcher.join()
            if clock is not None:
                clock.cancel()
            with self._lock:
                self._running.pop(proc.pid, None)
                timed_out = proc.pid in self._timed_out
                self._timed_out.discard(proc.pid)
        interrupted, reason = _left_in_output(failure, secrets)
        return ContainerExit(
            code=code,
            interrupted=interrupted,
            reason=reason,
            start=start,
            end=time.time(),
            peak_rss_mb=round(peak["rss"] / 2**20, 1) if peak["rss"] else None,
            metrics=metrics,
            timed_out=timed_out,
            cpu_seconds=round(max(exact_cpu or 0.0, peak["cpu"]), 2) or None,
        )

    def _clock(self, deadline: float | None, pid: int) -> threading.Timer | None:
        """The job's MaxRuntimeInSeconds, counted from its start: it is stopped then."""
        if deadline is None:
            return None
        clock = threading.Timer(max(0.0, deadline - time.time()), self._time_out, (pid,))
        clock.daemon = True
        clock.start()
        return clock

    def _start(
        self, root: Path, arguments: list[str], env: dict[str, str], failure: Path, job: str
    ) -> tuple[subprocess.Popen, list[str]]:
        """The entrypoint started in its environment (see `run`), with what an earlier attempt
        left in output/ cleared; and the secret values that environment holds."""
        base = os.environ if self.base_env is None else self.base_env(root)
        full = {**base, **image_env(root), **env}
        # The container ends with this process however it ends (SIGKILL included). A
        # warm-started one is the fork server's child: the starter names the server, which
        # follows this process.
        full[DRIVER_PID_VARIABLE] = str(os.getpid())
        failure.unlink(missing_ok=True)
        (failure.parent / "interrupted").unlink(missing_ok=True)
        argv = [sys.executable, *ENTRYPOINT[1:], *arguments]
        proc = None if self.starter is None else self.starter.start(argv, full, root)
        if proc is None:
            proc = subprocess.Popen(
                argv,
                cwd=str(root),
                env=full,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() reaches every process
            )
        self._register(proc.pid, job)
        return proc, secret_values(full)

    def run_hosts(
        self,
        roots: dict[str, Path],
        env: dict[str, str],
        *,
        log,
        on_line=None,
        arguments: list[str] | None = None,
        **kwargs,
    ) -> dict[str, ContainerExit]:
        """One entrypoint per host of a job, at once, as SageMaker starts them: a training
        job's (`train`; torchrun's master is this machine, at a free port) or a processing
        job's (its `arguments`). `log` is one writer, or a function giving each host's."""
        env = dict(env)
        if arguments is None:  # training: SageMaker's hosts resolve one another's names;
            arguments = ["train"]  # here every host is this machine
            env[MASTER_ADDR_VARIABLE] = "127.0.0.1"
            env[MASTER_PORT_VARIABLE] = str(free_port())
        exits: dict[str, ContainerExit] = {}
        errors: list[BaseException] = []

        finished = {host: threading.Event() for host in roots}

        def one(host: str, root: Path) -> None:
            say = on_line
            if on_line is not None and len(roots) > 1:
                say = lambda line: on_line(f"{host}: {line}")  # noqa: E731
            writer = log(host) if callable(log) else log
            try:
                exits[host] = self.run(root, arguments, env, log=writer, on_line=say, **kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
                errors.append(e)
                self.stop(kwargs.get("job", ""))
            finally:
                finished[host].set()

        def wait_all() -> None:
            # Events, not Thread.join: a join interrupted by Ctrl-C marks a running thread
            # as stopped (CPython 3.11, bpo-45274), and the next join would not wait.
            for event in finished.values():
                while not event.wait(0.5):
                    pass

        for item in roots.items():
            threading.Thread(target=one, args=item, daemon=True).start()
        try:
            wait_all()
        except BaseException:
            self.stop(kwargs.get("job", ""))
            wait_all()  # the job checkpoints and exits; its folders are removed after
            raise
        if errors:
            raise errors[0]
        return exits


# How long the output of a container that has exited is still read: a process it started
# that left its session (setsid) may hold the output open for as long as it lives.
OUTPUT_GRACE_SECONDS = 10


def follow_output(proc, secrets: list[str], log, on_line, metric_regexes: dict[str, str]) -> dict:
    """Every line the container prints, redacted, to `log` and `on_line`; the last value each
    metric regex found (SageMaker reads MetricDefinitions off the log the same way). Read
    until the output ends, and no longer than OUTPUT_GRACE_SECONDS once the entrypoint has
    exited."""
    compiled = {k: re.compile(v) for k, v in metric_regexes.items()}
    metrics: dict[str, float] = {}

    def take(raw: bytes) -> None:
        line = redact(raw.decode("utf-8", errors="replace"), secrets)
        log.write(line + "\n")
        if on_line is not None:
            on_line(line)
        for metric, regex in compiled.items():
            found = regex.search(line)
            if found:
                try:
                    metrics[metric] = float(found.group(1))
                except (ValueError, IndexError):
                    pass

    fd, pending, exited = proc.stdout.fileno(), b"", None
    while exited is None or time.monotonic() < exited + OUTPUT_GRACE_SECONDS:
        ready, _, _ = select.select([fd], [], [], 0.5)
        chunk = os.read(fd, 1 << 16) if ready else None
        if chunk == b"":  # every writer has closed it
            break
        if chunk:
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                take(raw)
        if exited is None and _has_exited(proc):
            exited = time.monotonic()
    if pending:
        take(pending)
    return metrics


def _has_exited(proc) -> bool:
    """Whether the entrypoint has exited, without reaping it (`_exit_cpu_seconds` reads it
    first): waitid's WNOWAIT for a child of ours, the fork server's report for a warm one."""
    if not isinstance(proc, subprocess.Popen):
        return proc.poll() is not None
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True


def _left_in_output(failure: Path, secrets: list[str]) -> tuple[bool, str | None]:
    """What the entrypoint left beside its failure file: whether it was interrupted (and
    checkpointed: the `interrupted` marker, taken away), and its reason for failing, redacted."""
    marker = failure.parent / "interrupted"
    interrupted = marker.exists()
    marker.unlink(missing_ok=True)
    reason = failure.read_text().strip() if failure.exists() else None
    return interrupted, redact(reason, secrets) if reason else None


def _watch_memory(pid: int, peak: dict, stop: threading.Event) -> None:
    """Peak memory of the job's whole process tree (torchrun's workers too), and its CPU time so
    far, into `peak`. Memory as the job's container would hold it: each process's own pages
    (USS), and the pages processes share counted once (the largest shared part). Summing RSS
    would count a shared page once per process: a warm-started job's entrypoint and step share
    the libraries their fork server imported (pipeline/backends/warm_start.py), and their RSS
    summed overstated it by 0.3 GB (1.91 GB against 1.57 GB for the same job started cold)."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    # Memory every 0.5 s, and more often at first: a warm-started job may end within half a
    # second. CPU time every 0.05 s (a read of /proc/<pid>/stat a process) over the processes
    # last seen: the figure that stands when a job's exact one cannot be had (_exit_cpu_seconds).
    procs, pause, memory_due = [root], 0.02, 0.0
    while not stop.wait(min(pause, CPU_SAMPLE_SECONDS)):
        if time.monotonic() >= memory_due:
            memory_due, pause = time.monotonic() + pause, min(0.5, pause * 2)
            try:
                procs = [root, *root.children(recursive=True)]
                # Linux's smaps_rollup: a fraction of a millisecond a process.
                memory = [p.memory_full_info() for p in procs if p.is_running()]
            except psutil.Error:
                continue
            own = sum(m.uss for m in memory)
            shared = max((m.rss - m.uss for m in memory), default=0)
            peak["rss"] = max(peak["rss"], own + shared)
        peak["cpu"] = max(peak["cpu"], _cpu_of(procs))


CPU_SAMPLE_SECONDS = 0.05


def _cpu_of(procs: list) -> float:
    """The CPU time of a process tree so far: a process that has gone (and so been waited for)
    is in its parent's children's times."""
    import psutil

    total = 0.0
    for process in procs:
        try:
            total += _tree_cpu(process.cpu_times())
        except psutil.Error:
            continue
    return total


def _tree_cpu(times) -> float:
    """A process's CPU time with that of the children it has waited for (getrusage(2):
    RUSAGE_CHILDREN counts "all children ... that have terminated and been waited for"): summed
    over a process tree, each second is counted once, by the process or by its parent."""
    return times.user + times.system + times.children_user + times.children_system


def _exit_cpu_seconds(proc) -> float | None:
    """The whole CPU time of a container this process started: read from the exited entrypoint
    before it is reaped (waitid's WNOWAIT leaves it waitable), so its step and every process it
    waited for are in. A warm-started one is the fork server's child, not ours: the server
    reaps it and sends its wait4 figure (warm_start.report_exit); None if the server died
    first (the sampled figure stands, which misses at most its last CPU_SAMPLE_SECONDS)."""
    import psutil

    if not isinstance(proc, subprocess.Popen):
        proc.wait()
        return proc.cpu_seconds
    try:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        return _tree_cpu(psutil.Process(proc.pid).cpu_times())
    except (ChildProcessError, psutil.Error):
        return None
