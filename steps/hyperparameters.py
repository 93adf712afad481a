"""The hyperparameters `steps/train.py` accepts, in one place.

SageMaker hands hyperparameters to a container as strings (hyperparameters.json). This
table says what each one means and what type it becomes, so the driver can refuse a
tunable with an unknown name before a job starts and `train.py` can cast once, at the top.
The driver imports this module; this module imports nothing of the driver.
"""

from __future__ import annotations

import json

# name -> (type, meaning)
HYPERPARAMETERS: dict[str, tuple[type, str]] = {
    "model_name": (str, "which model of MODEL_NAMES this job trains"),
    "model_names": (str, "every model of the run, comma separated (a comparison job has several)"),
    "job_kind": (str, "training | tuning: what launched this job"),
    "epochs": (int, "passes over the training split"),
    "learning_rate": (float, "peak AdamW learning rate"),
    "batch_size": (int, "examples per optimizer step, across all processes"),
    "max_per_device_batch_size": (int, "examples one process can hold; the rest is accumulation"),
    "max_sequence_length": (int, "tokens per example after truncation"),
    "warmup_ratio": (float, "share of optimizer steps spent warming the learning rate up"),
    "weight_decay": (float, "AdamW weight decay"),
    "seed": (int, "seed of the run: weights, shuffling, dropout"),
    "checkpoint_every_steps": (int, "optimizer steps between checkpoints; 0 means epoch ends only"),
    "keep_checkpoints": (int, "how many checkpoints to keep"),
    "wandb_project": (str, "wandb project name"),
    "wandb_mode": (str, "offline | online | disabled"),
    "max_steps": (int, "stop after this many optimizer steps; 0 means no limit"),
    "mixed_precision": (str, "auto | no | bf16 | fp16 (auto: bf16 or fp16 on a GPU, no on CPU)"),
    "group_by_length": (bool, "batches of rows of similar length (less padding)"),
    "compile": (bool, "torch.compile the model"),
    "dataloader_num_workers": (
        str,
        "loader processes beside each training process; auto: 2 on a GPU, 0 on CPU",
    ),
}

# What a job that is not given these gets (a request written by hand, an older driver).
DEFAULTS = {
    "mixed_precision": "auto",
    "group_by_length": True,
    "compile": False,
    "dataloader_num_workers": "auto",
}

# The names a tuning job may search over: the ones that change how a model learns (a test
# checks that each one does). MAX_SEQUENCE_LENGTH is not one: prepare applies it, once.
TUNABLE = (
    "epochs",
    "learning_rate",
    "batch_size",
    "warmup_ratio",
    "weight_decay",
)


# Names SageMaker and its Python SDK own, handed to the container beside ours: accepted and
# recorded, never refused (a container that refuses them fails every tuning trial).
# - `_tuning_objective_metric`: SageMaker adds it to the hyperparameters of every training job a
#   tuning job launches, its value the objective's metric name, and it counts toward the limit
#   of 100 hyperparameters (https://docs.aws.amazon.com/sagemaker/latest/dg/
#   automatic-model-tuning-define-ranges.html; the SDK's tuner drops it when it reads a trial
#   back: sagemaker-python-sdk src/sagemaker/tuner.py, `_prepare_init_params_from_job_description`).
# - `sagemaker_*`: what the SDK's estimators add (`sagemaker_program`, `sagemaker_submit_directory`,
#   `sagemaker_region`, `sagemaker_job_name`, `sagemaker_container_log_level`, and for tuning
#   `sagemaker_estimator_class_name`, `sagemaker_estimator_module`: src/sagemaker/estimator.py,
#   tuner.py), so the image also runs from an SDK Estimator or HyperparameterTuner.
# SageMaker reserves the leading underscore for itself; no name of ours starts with one.
RESERVED_PREFIXES = ("_", "sagemaker_")


def is_reserved(name: str) -> bool:
    return name.startswith(RESERVED_PREFIXES)


def reserved_hyperparameters(raw: dict[str, object]) -> dict[str, object]:
    """The hyperparameters SageMaker or its SDK set, as they arrived (recorded with the job)."""
    return {name: value for name, value in raw.items() if is_reserved(name)}


def parse_hyperparameters(raw: dict[str, object]) -> dict[str, object]:
    """Cast the strings SageMaker hands over into their types; refuse unknown names (the
    reserved ones above are left to `reserved_hyperparameters`)."""
    problems = []
    values: dict[str, object] = dict(DEFAULTS)
    for name, value in raw.items():
        if is_reserved(name):
            continue
        if name not in HYPERPARAMETERS:
            problems.append(f"unknown hyperparameter {name!r}")
            continue
        kind = HYPERPARAMETERS[name][0]
        # SageMaker's tuner and some launchers JSON-quote strings ('"0.1"'): unwrap them.
        if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
            value = json.loads(value)
        try:
            values[name] = _cast(kind, value)
        except (TypeError, ValueError):
            problems.append(f"hyperparameter {name}={value!r} is not a {kind.__name__}")
    if problems:
        raise ValueError("; ".join(problems))
    return values


def _cast(kind: type, value: object) -> object:
    # A tuner's IntegerParameter or a JSON round trip may hand over 3.0 or "3.0" for an int.
    if kind is bool:
        if str(value).lower() not in ("true", "false", "1", "0"):
            raise ValueError(value)
        return str(value).lower() in ("true", "1")
    if kind is int and not isinstance(value, bool):
        number = float(value)
        if not number.is_integer():
            raise ValueError(value)
        return int(number)
    return kind(value)
