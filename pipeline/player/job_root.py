"""A job root: the folder that stands for a container's /opt/ml on this machine. Laid out from
the request as SageMaker lays out an instance's (inputs downloaded where the request says, the
config files SageMaker writes, the output folders), and read back once the container exits
(what the entrypoint left in output/: its failure file and the `interrupted` marker). Job roots
live in a work root, a folder of the system's temporary one that its driver owns
(`new_work_root`).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

from pipeline.store import NotFound, StoreError
from steps.runtime import names
from steps.runtime.names import host_path
from steps.runtime.secrets import redact

WORK_PREFIX = "smpipe-jobs-"
OWNER = "driver.json"  # in a work root while its driver runs: who to ask whether it still does


def new_work_root(what: str) -> Path:
    """A new folder of the system's temporary one for what this driver plays (`what`: its run,
    its containers' HOME), owned by it: `remove_orphaned_work_roots` removes it once this
    process is gone, if it was killed before removing it itself."""
    root = Path(tempfile.mkdtemp(prefix=WORK_PREFIX))
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "for": what}
    (root / OWNER).write_text(json.dumps(owner))
    return root


def remove_orphaned_work_roots(echo) -> None:
    """Work roots of drivers on this machine that died without a word (SIGKILL, power loss):
    their jobs died with them (see DRIVER_PID_VARIABLE), so the folders only take space."""
    import psutil

    for root in Path(tempfile.gettempdir()).glob(WORK_PREFIX + "*"):
        try:
            owner = json.loads((root / OWNER).read_text())
        except (OSError, ValueError):
            continue  # not ours
        if owner.get("host") == socket.gethostname() and not psutil.pid_exists(owner["pid"]):
            shutil.rmtree(root, ignore_errors=True)
            gone = f"removed {root}: job folders of a driver (pid {owner['pid']}) that is gone"
            print(gone, file=echo, flush=True)


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


def host_names(count: int) -> list[str]:
    """`count` instances' names in the order resourceconfig.json lists them: "hosts: The list
    of names of all containers on the container network, sorted lexicographically. For example,
    `['algo-1', 'algo-2', 'algo-3']`" (AWS's training toolkit reading the file:
    sagemaker-training-toolkit src/sagemaker_training/environment.py, Environment). So ten
    hosts are algo-1, algo-10, algo-2, ... algo-9; algo-1 is first whatever the count. A
    processing job's file shows the same list for three hosts
    (build-your-own-processing-container.html); its order beyond nine the sources do not
    give: the same rule here."""
    return sorted(f"algo-{i}" for i in range(1, count + 1))


def processing_hosts(request: dict) -> list[str]:
    """A processing job's instances, as its resourceconfig.json lists them (`host_names`)."""
    return host_names(request["ProcessingResources"]["ClusterConfig"]["InstanceCount"])


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
            host_path(root, s3["LocalPath"]),
        )
    for item in request["ProcessingOutputConfig"]["Outputs"]:
        host_path(root, item["S3Output"]["LocalPath"]).mkdir(parents=True, exist_ok=True)
    config = processing_job_config(request, arn)
    write_json(host_path(root, names.PROCESSING_CONFIG_FILE), config)
    resource = {"current_host": host, "hosts": hosts}
    write_json(host_path(root, names.PROCESSING_RESOURCE_CONFIG_FILE), resource)


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
            merged[item["OutputName"]] = host_path(root, local)
            continue
        into = root / "outputs" / item["OutputName"]
        into.mkdir(parents=True, exist_ok=True)
        for host_root in roots.values():
            shutil.copytree(host_path(host_root, local), into, dirs_exist_ok=True)
        merged[item["OutputName"]] = into
    return merged


def gathered(roots: dict[str, Path], folder: str, into: Path) -> Path:
    """`folder` of a training job (/opt/ml/model, /opt/ml/output/data) as the one folder its
    tarball is made of: every host's. AWS's local mode of SageMaker gathers "the model
    artifacts from all the container nodes... As the official SageMaker Training Service, it
    will override duplicate files if multiple containers have the same file names"
    (sagemaker-python-sdk src/sagemaker/local/image.py, retrieve_artifacts), copying the hosts
    in their order. So here: a file several hosts wrote is the last host's in `roots`' order
    (resourceconfig.json's); which host wins on SageMaker itself the sources are silent. One
    host: its own folder. Several: their files hard-linked under `into` (copied where a link
    cannot be made), so a model's weights are not copied."""
    folders = [host_path(root, folder) for root in roots.values()]
    if len(folders) == 1:
        return folders[0]
    into.mkdir(parents=True, exist_ok=True)
    for source in folders:
        for path in sorted(source.rglob("*")):
            if not path.is_file():
                continue
            target = into / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.unlink(missing_ok=True)
            try:
                os.link(path, target)
            except OSError:
                shutil.copy2(path, target)
    return into


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
    input_config = {}
    for channel in request["InputDataConfig"]:
        source = channel["DataSource"]["S3DataSource"]
        fetch_named(
            fetch,
            channel["ChannelName"],
            source["S3Uri"],
            host_path(root, names.INPUT_DATA_DIR) / channel["ChannelName"],
        )
        # A channel without InputMode takes TrainingInputMode's ("If you don't set a value for
        # InputMode, SageMaker uses the value set for TrainingInputMode": Channel in the service
        # model); ContentType is there where the channel sets one (your-algorithms-training-
        # algo-running-container's example; ../shared/aws-container-facts.md).
        algorithm = request.get("AlgorithmSpecification", {})
        mode = channel.get("InputMode") or algorithm.get("TrainingInputMode", "File")
        input_config[channel["ChannelName"]] = {
            **({"ContentType": channel["ContentType"]} if channel.get("ContentType") else {}),
            "TrainingInputMode": mode,
            "S3DistributionType": source.get("S3DataDistributionType", "FullyReplicated"),
            "RecordWrapperType": channel.get("RecordWrapperType", "None"),
        }
    resource = resource_config(request, host, hosts)
    write_json(host_path(root, names.HYPERPARAMETERS_FILE), hyperparameters)
    write_json(host_path(root, names.RESOURCE_CONFIG_FILE), resource)
    write_json(host_path(root, names.INPUT_DATA_CONFIG_FILE), input_config)
    if request.get("CheckpointConfig"):
        checkpoint = {"LocalPath": names.CHECKPOINT_DIR, **request["CheckpointConfig"]}
        write_json(host_path(root, names.CHECKPOINT_CONFIG_FILE), checkpoint)
    for folder in (names.MODEL_DIR, names.OUTPUT_DATA_DIR, names.CHECKPOINT_DIR):
        host_path(root, folder).mkdir(parents=True, exist_ok=True)


def new_instance(root: Path) -> None:
    """A restarted training job's host as the new instance it runs on finds it: model/,
    output/ and checkpoints/ empty, the checkpoints then copied back from S3 (CheckpointSync),
    nothing else of the attempt before. "An interruption gives Interrupted -> Starting -> ...
    on a new instance, with checkpoints restored from S3" (model-managed-spot-training); the
    model and output folders are read from no S3 at a restart (model-train-storage's table)."""
    for folder in (names.MODEL_DIR, names.OUTPUT_DIR, names.CHECKPOINT_DIR):
        # Not ignoring errors: what a container left that this user cannot remove (rootful
        # docker's root-owned files) would start the restart with the first attempt's files.
        if host_path(root, folder).exists():
            shutil.rmtree(host_path(root, folder))
    for folder in (names.MODEL_DIR, names.OUTPUT_DATA_DIR, names.CHECKPOINT_DIR):
        host_path(root, folder).mkdir(parents=True, exist_ok=True)


def write_json(path: Path, value: dict) -> None:
    """A config file SageMaker writes, its folder made first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2))


def training_hosts(request: dict) -> list[str]:
    """A training job's instances, algo-1 ... algo-N
    (your-algorithms-training-algo-running-container.html), as resourceconfig.json lists them
    (`host_names`)."""
    return host_names(request["ResourceConfig"]["InstanceCount"])


def left_in_output(failure: Path, secrets: list[str]) -> tuple[bool, str | None]:
    """What the entrypoint left beside its failure file: whether it was interrupted (and
    checkpointed: the `interrupted` marker, taken away), and its reason for failing, redacted."""
    marker = failure.parent / names.INTERRUPTED
    interrupted = marker.exists()
    marker.unlink(missing_ok=True)
    reason = failure.read_text().strip() if failure.exists() else None
    return interrupted, redact(reason, secrets) if reason else None


def clear_output(failure: Path) -> None:
    """What an earlier attempt left in output/ (its failure file, its marker) taken away."""
    failure.unlink(missing_ok=True)
    (failure.parent / names.INTERRUPTED).unlink(missing_ok=True)
