"""The variables a job's step gets, from the config files SageMaker writes for the job.

A training job: input/config/{hyperparameters,resourceconfig,inputdataconfig}.json become the
SM_* variables SageMaker's framework containers export (sagemaker-training-toolkit,
ENVIRONMENT_VARIABLES.md), and what torchrun and NCCL need across hosts. A processing job:
config/processingjobconfig.json becomes SM_PROCESSING_INPUT_<NAME> / SM_PROCESSING_OUTPUT_<NAME>.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

from steps.runtime import names
from steps.runtime.names import host_path


class JobSetupError(RuntimeError):
    """The job cannot start its step: a config file or a secret it needs cannot be read."""


def read_config(path: Path) -> dict:
    """One of the JSON files SageMaker writes for the job, or why it cannot be read."""
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise JobSetupError(f"{path} cannot be read: {e.strerror or e}") from None
    except ValueError as e:
        raise JobSetupError(f"{path} is not valid JSON: {e}") from None
    # Each is one JSON object: of names to values, channels or host facts
    # (your-algorithms-training-algo-running-container.html; build-your-own-processing-
    # container.html for processingjobconfig.json).
    if not isinstance(config, dict):
        raise JobSetupError(f"{path} holds a {type(config).__name__}, not a JSON object")
    return config


def resource_config(path: Path) -> tuple[dict, int]:
    """A training job's resourceconfig.json, and this host's place among the job's hosts:
    `current_host` is one of `hosts`, the names of every host of the job, sorted
    (your-algorithms-training-algo-running-container.html, Distributed Training Configuration;
    torchrun's node_rank is that place). JobSetupError naming the file and every key wrong."""
    resource = read_config(path)
    hosts, current = resource.get("hosts"), resource.get("current_host")
    problems = []
    if "hosts" not in resource:
        problems.append("it has no hosts")
    elif not (isinstance(hosts, list) and hosts and all(isinstance(h, str) for h in hosts)):
        problems.append(f"hosts is {json.dumps(hosts)}, not a list of host names")
    if "current_host" not in resource:
        problems.append("it has no current_host")
    elif not isinstance(current, str):
        problems.append(f"current_host is {json.dumps(current)}, not a host name")
    elif not problems and current not in hosts:
        problems.append(f"current_host {current!r} is not one of its hosts ({', '.join(hosts)})")
    if problems:
        raise JobSetupError(f"{path}: {'; '.join(problems)}")
    return resource, hosts.index(current)


def _deserialize(value: str) -> object:
    """Hyperparameters arrive as strings; SageMaker's containers decode the JSON-looking ones."""
    try:
        return json.loads(value)
    except (TypeError, ValueError):
        return value


def training_variables(root: Path) -> dict[str, str]:
    """The SM_* variables of SageMaker's framework containers, from the job's config files."""
    hps = {
        k: _deserialize(v)
        for k, v in read_config(host_path(root, names.HYPERPARAMETERS_FILE)).items()
    }
    resource, rank = resource_config(host_path(root, names.RESOURCE_CONFIG_FILE))
    input_config = read_config(host_path(root, names.INPUT_DATA_CONFIG_FILE))
    channels = sorted(input_config)
    hosts = resource["hosts"]
    data = host_path(root, names.INPUT_DATA_DIR)
    checkpoints = host_path(root, names.CHECKPOINT_DIR)
    job_name = os.environ.get(names.TRAINING_JOB_NAME, "")
    if os.environ.get(names.TRIAL_CHECKPOINTS_VARIABLE) and job_name:
        checkpoints = checkpoints / job_name
    # As SageMaker's containers count them, without importing torch (slow: docs/performance.md).
    gpus = len(glob.glob(names.GPU_DEVICE_FILES))
    env: dict[str, object] = {
        names.SM_MODEL_DIR: host_path(root, names.MODEL_DIR),
        names.SM_INPUT_DIR: host_path(root, names.INPUT_DIR),
        names.SM_INPUT_DATA_DIR: data,
        names.SM_INPUT_CONFIG_DIR: host_path(root, names.INPUT_CONFIG_DIR),
        names.SM_OUTPUT_DIR: host_path(root, names.OUTPUT_DIR),
        names.SM_OUTPUT_FAILURE: host_path(root, names.TRAINING_FAILURE_FILE),
        names.SM_OUTPUT_DATA_DIR: host_path(root, names.OUTPUT_DATA_DIR),
        names.SM_CHECKPOINT_DIR: checkpoints,
        names.SM_LOG_LEVEL: 20,
        names.SM_CHANNELS: channels,
        names.SM_HPS: hps,
        names.SM_CURRENT_HOST: resource["current_host"],
        names.SM_CURRENT_INSTANCE_TYPE: resource.get("current_instance_type", ""),
        names.SM_HOSTS: hosts,
        names.SM_HOST_COUNT: len(hosts),
        names.SM_CURRENT_HOST_RANK: rank,
        names.SM_NETWORK_INTERFACE_NAME: resource.get("network_interface_name", "eth0"),
        names.SM_NUM_CPUS: os.cpu_count() or 1,
        names.SM_NUM_GPUS: gpus,
        names.SM_RESOURCE_CONFIG: resource,
        names.SM_INPUT_DATA_CONFIG: input_config,
    }
    env.update(distributed_variables(env[names.SM_NETWORK_INTERFACE_NAME], len(hosts), gpus))
    for channel in channels:
        env[names.channel_variable(channel)] = data / channel
    for key, value in hps.items():
        env[names.hyperparameter_variable(key)] = value
    env[names.SM_TRAINING_ENV] = {
        "channel_input_dirs": {c: str(data / c) for c in channels},
        "current_host": resource["current_host"],
        "hosts": hosts,
        "hyperparameters": hps,
        "job_name": job_name,
        "model_dir": str(host_path(root, names.MODEL_DIR)),
        "output_data_dir": str(host_path(root, names.OUTPUT_DATA_DIR)),
        "num_cpus": env[names.SM_NUM_CPUS],
        "num_gpus": gpus,
    }
    return {
        k: v if isinstance(v, str) else (str(v) if isinstance(v, Path) else json.dumps(v))
        for k, v in env.items()
    }


def distributed_variables(interface: str, hosts: int, gpus: int) -> dict[str, str]:
    """What torchrun, NCCL and gloo need to be told on SageMaker (a variable already set
    wins)."""
    env = {}
    # torchrun gives its workers 30 s after passing on a SIGTERM before it kills them
    # (torch.distributed.launcher.api, TORCH_ELASTIC_SHUTDOWN_TIMEOUT); SageMaker gives 120
    # (API_StopTrainingJob.html). The entrypoint signals the workers itself, so this is for a
    # torchrun that gets the signal another way (its parent gone).
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "120")
    # Hosts played as processes of one machine (a local player names torchrun's master, on
    # loopback) share no interface of resourceconfig.json's name, which that machine may lack:
    # there, NCCL and gloo find their own.
    hosts_apart = hosts > 1 and names.MASTER_ADDR_VARIABLE not in os.environ
    # NCCL picks a network interface itself and, on an instance with several, may pick one the
    # other hosts cannot reach: the one resourceconfig.json names is the one they share
    # (your-algorithms-training-algo-running-container.html). Set only where NCCL runs.
    if gpus and hosts_apart and "NCCL_SOCKET_IFNAME" not in os.environ:
        env["NCCL_SOCKET_IFNAME"] = interface
    # Gloo (CPU training's backend, and a GPU job's for CPU tensors) binds to the address the
    # hostname resolves to, else to loopback ("Using the loopback address as fallback. Manually
    # set the network interface to bind to with GLOO_SOCKET_IFNAME": torch's
    # ProcessGroupGloo.cpp). On SageMaker the hostname is `aws` on every host, not algo-N
    # (AWS's PyTorch training containers LD_PRELOAD changehostname.c to make it algo-N, "leading
    # NCCL/MPI to think there is only one host" without it: aws/deep-learning-containers), so
    # across hosts gloo is told the interface the hosts share.
    if hosts_apart and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = interface
    return env


def processing_variables(root: Path) -> dict[str, str]:
    """SM_PROCESSING_INPUT_/OUTPUT_<NAME>, from the processing job's own config file."""
    config = read_config(host_path(root, names.PROCESSING_CONFIG_FILE))
    env = {names.SM_OUTPUT_FAILURE: str(host_path(root, names.PROCESSING_FAILURE_FILE))}
    for item in config.get("ProcessingInputs", []):
        local = (item.get("S3Input") or {}).get("LocalPath")
        if local:
            variable = names.processing_input_variable(item["InputName"])
            env[variable] = str(host_path(root, local))
    for item in config.get("ProcessingOutputConfig", {}).get("Outputs", []):
        local = (item.get("S3Output") or {}).get("LocalPath")
        if local:
            variable = names.processing_output_variable(item["OutputName"])
            env[variable] = str(host_path(root, local))
    return env
