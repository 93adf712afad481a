"""Every name of the job contract, once: the container's paths, files, variables and markers.

Two sides agree on these names: the player that prepares a job (SageMaker itself, or a local
backend playing it: pipeline/) and the container that runs it (steps/entrypoint.py and the
steps). As sagemaker-training-toolkit's `params.py`, this module holds names only, and the
functions that spell a name from a name (`env_key`, `channel_variable`, ...) or place a
container path in a local job root (`host_path`). Standard library only: the player imports it
without importing anything else of steps/.
"""

from __future__ import annotations

from pathlib import Path

# -- the container's paths ----------------------------------------------------------------------
# A training job's layout: your-algorithms-training-algo-running-container.html (input/config,
# input/data/<channel>, model) and your-algorithms-training-algo-output.html (output/failure,
# output/data), docs.aws.amazon.com/sagemaker/latest/dg/. Locally the job root replaces the
# container root through ML_ROOT_VARIABLE (below); `host_path` places any of these there.
CONTAINER_ROOT = "/opt/ml"
MODEL_DIR = f"{CONTAINER_ROOT}/model"
INPUT_DIR = f"{CONTAINER_ROOT}/input"
INPUT_DATA_DIR = f"{INPUT_DIR}/data"
INPUT_CONFIG_DIR = f"{INPUT_DIR}/config"
HYPERPARAMETERS_FILE = f"{INPUT_CONFIG_DIR}/hyperparameters.json"
RESOURCE_CONFIG_FILE = f"{INPUT_CONFIG_DIR}/resourceconfig.json"
INPUT_DATA_CONFIG_FILE = f"{INPUT_CONFIG_DIR}/inputdataconfig.json"
OUTPUT_DIR = f"{CONTAINER_ROOT}/output"
OUTPUT_DATA_DIR = f"{OUTPUT_DIR}/data"
# Where a job's reason for failing goes, which SageMaker returns: a training job's
# output/failure as FailureReason, a processing job's output/message as ExitMessage
# (your-algorithms-training-algo-output.html, build-your-own-processing-container.html).
# SageMaker returns the first 1024 characters.
TRAINING_FAILURE_FILE = f"{OUTPUT_DIR}/failure"
PROCESSING_FAILURE_FILE = f"{OUTPUT_DIR}/message"
FAILURE_FILES = {"train": TRAINING_FAILURE_FILE, "process": PROCESSING_FAILURE_FILE}
FAILURE_REASON_LIMIT = 1024
# CheckpointConfig.LocalPath's default, synced with CheckpointConfig.S3Uri during training
# (model-checkpoints.html; API_CheckpointConfig.html).
CHECKPOINT_DIR = f"{CONTAINER_ROOT}/checkpoints"
# A host's NVIDIA GPUs, one device file each: what the entrypoint counts (without importing
# torch, which is slow) and what the driver counts where its jobs run on this machine.
GPU_DEVICE_FILES = "/dev/nvidia[0-9]*"
# A processing job's layout: "must begin with /opt/ml/processing/" for every input's and
# output's LocalPath (API_ProcessingS3Input.html), and the job's own config files under
# /opt/ml/config (build-your-own-processing-container.html).
PROCESSING_DIR = f"{CONTAINER_ROOT}/processing"
PROCESSING_INPUT_DIR = f"{PROCESSING_DIR}/input"
PROCESSING_OUTPUT_DIR = f"{PROCESSING_DIR}/output"
PROCESSING_CONFIG_FILE = f"{CONTAINER_ROOT}/config/processingjobconfig.json"
PROCESSING_RESOURCE_CONFIG_FILE = f"{CONTAINER_ROOT}/config/resourceconfig.json"
# The run's code arrives as an input named `code`: a training channel, a processing input.
# docker/Dockerfile's PYTHONPATH names both places (a test checks).
CODE_INPUT = "code"
TRAINING_CODE_DIR = f"{INPUT_DATA_DIR}/{CODE_INPUT}"
PROCESSING_CODE_DIR = f"{PROCESSING_INPUT_DIR}/{CODE_INPUT}"

# -- the image ----------------------------------------------------------------------------------
# The image's ENTRYPOINT, exec form: docker/Dockerfile must say exactly this (a test checks).
ENTRYPOINT = ["python3", "-m", "steps.entrypoint"]
# What the image is (its base, the lock it holds, its torch and Python), written by
# docker/Dockerfile at build: the entrypoint logs it first, so each job's log says which image
# ran it. Nothing outside an image has this file.
IMAGE_RECORD_FILE = "/etc/smpipe/image.json"

# -- markers: files the step leaves beside its failure file, read by the entrypoint and player --
# The step checkpointed on SIGTERM/SIGINT and exited to be resumed (its content: the step).
INTERRUPTED = "interrupted"
# The step's main() returned: a step that exits 0 without it (os._exit in user code) ended
# before its work was done, and the entrypoint fails the job.
FINISHED = "finished"
# Exit status a job uses to say "interrupted, resume me" (SIGTERM from a spot reclaim):
# EX_TEMPFAIL of sysexits.h.
EXIT_INTERRUPTED = 75
# What a processing step reports for its Metadata section, in its report output.
STEP_METADATA_FILE = "step_metadata.json"
# The inference step's table of each label's precision, recall and F1, a model's folder of the
# run's inference output each (the report and `smpipe compare` read it).
PER_LABEL_FILE = "per_label.csv"

# -- SageMaker's variables ----------------------------------------------------------------------
# Set by SageMaker in a training container (your-algorithms-training-algo-running-container.html).
TRAINING_JOB_NAME = "TRAINING_JOB_NAME"
TRAINING_JOB_ARN = "TRAINING_JOB_ARN"
# The SM_* variables SageMaker's framework containers export (sagemaker-training-toolkit,
# ENVIRONMENT_VARIABLES.md and src/sagemaker_training/params.py); the entrypoint exports them
# for every training step, steps/runtime/environment.py reads them.
SM_MODEL_DIR = "SM_MODEL_DIR"
SM_INPUT_DIR = "SM_INPUT_DIR"
SM_INPUT_DATA_DIR = "SM_INPUT_DATA_DIR"
SM_INPUT_CONFIG_DIR = "SM_INPUT_CONFIG_DIR"
SM_OUTPUT_DIR = "SM_OUTPUT_DIR"
SM_OUTPUT_DATA_DIR = "SM_OUTPUT_DATA_DIR"
SM_OUTPUT_FAILURE = "SM_OUTPUT_FAILURE"
SM_CHECKPOINT_DIR = "SM_CHECKPOINT_DIR"
SM_CHANNELS = "SM_CHANNELS"
# The channels a training job is given (pipeline/stages.py) and reads (steps/train.py): the
# splits prepare wrote, and its label map and encoding.
TRAINING_CHANNELS = ("train", "validation", "labels")
SM_HPS = "SM_HPS"
SM_HOSTS = "SM_HOSTS"
SM_CURRENT_HOST = "SM_CURRENT_HOST"
SM_NUM_CPUS = "SM_NUM_CPUS"
SM_NUM_GPUS = "SM_NUM_GPUS"
SM_NETWORK_INTERFACE_NAME = "SM_NETWORK_INTERFACE_NAME"
SM_TRAINING_ENV = "SM_TRAINING_ENV"
SM_LOG_LEVEL = "SM_LOG_LEVEL"
SM_CURRENT_INSTANCE_TYPE = "SM_CURRENT_INSTANCE_TYPE"
SM_HOST_COUNT = "SM_HOST_COUNT"
SM_CURRENT_HOST_RANK = "SM_CURRENT_HOST_RANK"
SM_RESOURCE_CONFIG = "SM_RESOURCE_CONFIG"
SM_INPUT_DATA_CONFIG = "SM_INPUT_DATA_CONFIG"
# The rank variables torchrun sets in each process it starts (torch.distributed.run); a
# single process has neither and is rank 0.
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"


def env_key(name: str) -> str:
    """A channel, input, hyperparameter or model name as it appears in a variable name: each
    character that is not a letter or digit becomes '_', and all is upper case, as the
    toolkit's channel variables (`train-data` is SM_CHANNEL_TRAIN_DATA)."""
    return "".join(c if c.isalnum() else "_" for c in name).upper()


def channel_variable(channel: str) -> str:
    """SM_CHANNEL_<NAME>: the folder of a training job's input channel."""
    return f"SM_CHANNEL_{env_key(channel)}"


def hyperparameter_variable(name: str) -> str:
    """SM_HP_<NAME>: one hyperparameter, JSON-decoded where it looks like JSON."""
    return f"SM_HP_{env_key(name)}"


# A processing job's inputs and outputs by name, as SageMaker's framework processors export
# them from processingjobconfig.json (the entrypoint does, for every processing step).
PROCESSING_INPUT_PREFIX = "SM_PROCESSING_INPUT_"
PROCESSING_OUTPUT_PREFIX = "SM_PROCESSING_OUTPUT_"


def processing_input_variable(name: str) -> str:
    return PROCESSING_INPUT_PREFIX + env_key(name)


def processing_output_variable(name: str) -> str:
    return PROCESSING_OUTPUT_PREFIX + env_key(name)


# -- this project's variables (SMPIPE_*) --------------------------------------------------------
# Set by a local player: the job root, which replaces CONTAINER_ROOT (SageMaker sets none).
ML_ROOT_VARIABLE = "SMPIPE_ML_ROOT"
# Which module a training job runs (the demo's and every user's: steps.train).
STEP_VARIABLE = "SMPIPE_STEP"
# PROCESSES_PER_HOST: a number, or `auto` (one per GPU).
PROCESSES_VARIABLE = "SMPIPE_PROCESSES_PER_HOST"
# Set on tuning trials: each trial keeps its checkpoints in a folder named after the trial,
# so trials sharing the tuning job's CheckpointConfig never resume from each other.
TRIAL_CHECKPOINTS_VARIABLE = "SMPIPE_CHECKPOINT_PER_TRIAL"
# The dotted module of the user functions ([experiment] USER_FUNCTIONS).
USER_FUNCTIONS_VARIABLE = "SMPIPE_USER_FUNCTIONS"
# Keys read from Secrets Manager inside the container, never passed in the request: the
# variable naming the secret (steps/runtime/secrets.py says what each becomes).
WANDB_SECRET_VARIABLE = "SMPIPE_WANDB_SECRET_ID"
HF_TOKEN_SECRET_VARIABLE = "SMPIPE_HF_TOKEN_SECRET_ID"
# More names of variables whose values are masked, from [tracking] SECRET_VARIABLES, comma
# separated.
EXTRA_SECRETS_VARIABLE = "SMPIPE_SECRET_VARIABLES"
# Set by a local player (the local and emulated backends): the driver's pid. The container
# ends when the driver does, however the driver ends; on SageMaker the entrypoint is PID 1.
DRIVER_PID_VARIABLE = "SMPIPE_DRIVER_PID"
# Where torchrun's master listens. SageMaker's hosts resolve `algo-1`; a local player that
# runs several emulated hosts on one machine names the address and a free port instead.
MASTER_ADDR_VARIABLE = "SMPIPE_MASTER_ADDR"
MASTER_PORT_VARIABLE = "SMPIPE_MASTER_PORT"
# `native` or `none`: overrides the detection of bf16 on a CPU (steps/precision.py).
CPU_BF16_VARIABLE = "SMPIPE_CPU_BF16"
CPU_BF16_CHOICES = ("native", "none")


def host_path(root: Path, container_path: str) -> Path:
    """Where a container path (/opt/ml/...) lies in a job root that stands for /opt/ml: the
    job's own on this machine (a local player's), or /opt/ml itself in a container."""
    if container_path != CONTAINER_ROOT and not container_path.startswith(CONTAINER_ROOT + "/"):
        raise ValueError(f"{container_path!r} is not a container path under {CONTAINER_ROOT}")
    return Path(root) / container_path.removeprefix(CONTAINER_ROOT).lstrip("/")


# -- added by the player (H2) --
# A training job's CheckpointConfig as the container sees it, LocalPath filled in (SageMaker
# writes it beside the other config files; the toolkit reads no such file, the player writes it
# for a step that wants the request's S3Uri).
CHECKPOINT_CONFIG_FILE = f"{INPUT_CONFIG_DIR}/checkpointconfig.json"
