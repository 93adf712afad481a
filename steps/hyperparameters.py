"""The hyperparameters `steps/train.py` takes: one table, everything else derived from it.

Each row names one hyperparameter once: its type, default, bounds, whether a tuning job may
search it, whether `[training.<model>]` may set it, and what it means. From the table come
the settings schema (the fields of `[training]`, and `[data] SEED`, `[tracking] WANDB_*`, in
pipeline/config_sections.py), the strings a training job receives (SageMaker hands
hyperparameters to a container as strings, in hyperparameters.json: `wire`) and their parsing
at the top of train.py (`parse_hyperparameters`). The driver imports this module; this module
imports nothing of the driver.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# Bounds are sanity, not taste: beyond them a job would fail deep inside (an integer
# overflow, a tensor of 10^14 tokens, a seed numpy refuses) or train nothing useful.
HUGE = 10**9


@dataclass(frozen=True)
class Hyperparameter:
    name: str
    type: type  # int, float, bool or str: what train.py gets
    default: object  # None: the driver sets it for every job (section "run")
    help: str = ""
    # The settings section that sets it; "run": the driver, from the job it launches.
    section: str = "training"
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    # The words it takes: the only values of a str, or a word a number may be replaced by.
    choices: tuple[str, ...] = ()
    tunable: bool = False  # a tuning job may search it (it changes how a model learns)
    per_model: bool = False  # [training.<model>] may set it

    def bounds(self) -> dict[str, float]:
        return {k: v for k in ("ge", "gt", "le", "lt") if (v := getattr(self, k)) is not None}

    def cast(self, value: object) -> object:
        """The value a job received, as its type; ValueError naming what it must be."""
        if isinstance(value, str) and value in self.choices:
            return value
        if self.type is str and self.choices:
            raise ValueError(f"is not one of {', '.join(self.choices)}")
        try:
            typed = _cast(self.type, value)
        except (TypeError, ValueError):
            words = f" or {', '.join(self.choices)}" if self.choices else ""
            raise ValueError(f"is not a {self.type.__name__}{words}") from None
        for bound, limit in self.bounds().items():
            if not _SATISFIED[bound](typed, limit):
                raise ValueError(f"must be {_SYMBOL[bound]} {limit}")
        return typed


_SATISFIED = {
    "ge": lambda v, b: v >= b,
    "gt": lambda v, b: v > b,
    "le": lambda v, b: v <= b,
    "lt": lambda v, b: v < b,
}
_SYMBOL = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}

# MIXED_PRECISION's words (steps/precision.py resolves them on the job's hardware).
PRECISION_CHOICES = ("auto", "no", "bf16", "fp16")
# [training] EXPORTS as a job receives it: the formats in one order, or none (a tuning trial).
EXPORT_CHOICES = ("torchscript", "exported", "torchscript,exported", "none")
# FINETUNING's words: what of the model trains (steps/finetuning.py).
FINETUNING_CHOICES = ("full", "lora")
# DISTRIBUTED_STRATEGY's words: how processes share the model (steps/fsdp.py for fsdp).
STRATEGY_CHOICES = ("ddp", "fsdp")
# The hyperparameters that mean something only with FINETUNING = lora (pipeline/config_checks.py
# refuses them where no model they apply to trains with LoRA).
LORA_ONLY = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
# The settings that ask something of the model itself: steps/finetuning.py checks them against
# what load_model builds, in the training job and, for each model they ask it of, before any job.
MODEL_SETTINGS = ("finetuning", "gradient_checkpointing", "distributed_strategy", *LORA_ONLY)


def asks_of_the_model(values: dict) -> bool:
    return (
        values["finetuning"] == "lora"
        or bool(values["gradient_checkpointing"])
        or values["distributed_strategy"] == "fsdp"
    )


# Defaults are the Hugging Face Trainer's where it has the same idea (learning rate 5e-5,
# 3 epochs); the shipped settings.ini says where its demo differs (`# demo:`). Aligned by
# hand: one hyperparameter, two lines.
H = Hyperparameter
# fmt: off
TABLE: tuple[Hyperparameter, ...] = (
    H("model_name",     str,   None, section="run",
      help="which model of MODEL_NAMES this job trains"),
    H("exports",        str,   "torchscript", section="run", choices=EXPORT_CHOICES,
      help="the programs written beside the weights ([training] EXPORTS); none: a tuning "
           "trial's (the study's best model is exported after it, steps/export.py)"),
    H("epochs",         int,   3,    ge=1, le=10_000, tunable=True, per_model=True,
      help="passes over the training split"),
    H("learning_rate",  float, 5e-5, gt=0, le=10, tunable=True, per_model=True,
      help="peak AdamW learning rate, reached after warmup and decayed linearly to 0"),
    H("batch_size",     int,   32,   ge=1, le=65_536, tunable=True, per_model=True,
      help="examples per optimizer step, across all processes"),
    H("max_per_device_batch_size", int, 16, ge=1, le=65_536, per_model=True,
      help="examples one process holds at once; gradient accumulation makes up the rest"),
    H("warmup_ratio",   float, 0.1,  ge=0, lt=1, tunable=True, per_model=True,
      help="share of optimizer steps spent warming the learning rate up from 0"),
    H("weight_decay",   float, 0.01, ge=0, le=10, tunable=True, per_model=True,
      help="AdamW weight decay (not applied to biases and norms)"),
    H("max_steps",      int,   0,    ge=0, le=HUGE, per_model=True,
      help="stop after this many optimizer steps; 0 means train every epoch"),
    H("seed",           int,   42,   section="data", ge=0, le=2**32 - 1,  # numpy's, torch's range
      help="seed of the split, of weight initialization and of shuffling"),
    H("checkpoint_every_steps", int, 50, ge=0, le=HUGE,
      help="a checkpoint every N optimizer steps (0: epoch ends only) and at every epoch end"),
    H("keep_checkpoints", int, 2, ge=1, le=1000,
      help="how many checkpoints to keep"),
    H("wandb_project",  str,   "smpipe", section="tracking",
      help="wandb project"),
    H("wandb_mode",     str,   "offline", section="tracking",
      choices=("offline", "online", "disabled"), help="wins over a WANDB_API_KEY in the env"),
    H("mixed_precision", str,  "auto", choices=PRECISION_CHOICES, per_model=True,
      help="auto: bf16 where the GPU or CPU computes it natively (steps/precision.py), fp16 "
           "with a loss scaler on older GPUs, fp32 on other CPUs"),
    H("group_by_length", bool, True,
      help="batches of rows of similar length (as the Trainer's group_by_length): less padding"),
    H("compile",        bool,  False, per_model=True,
      help="torch.compile the model (dynamic shapes)"),
    H("finetuning",     str,   "full", choices=FINETUNING_CHOICES, per_model=True,
      help="full: every weight trains; lora: low-rank adapters on the attention and MLP "
           "projections (PEFT's LoRA), the classification head in full (steps/finetuning.py)"),
    H("lora_r",         int,   8,    ge=1, le=4096, tunable=True, per_model=True,
      help="LoRA's rank (PEFT's LoraConfig r); FINETUNING = lora only"),
    H("lora_alpha",     int,   8,    ge=1, le=65_536, tunable=True, per_model=True,
      help="LoRA's scaling numerator: adapters are scaled by alpha / r (PEFT's lora_alpha)"),
    H("lora_dropout",   float, 0.0,  ge=0, lt=1, per_model=True,
      help="dropout on the adapters' input (PEFT's lora_dropout)"),
    H("lora_target_modules", str, "auto", per_model=True,
      help="the modules that get adapters, comma-separated names as PEFT matches them; auto: "
           "every linear layer of the model's repeated blocks (attention and MLP projections)"),
    H("gradient_checkpointing", bool, False, per_model=True,
      help="recompute activations in the backward pass (the model's own "
           "gradient_checkpointing_enable, non-reentrant): less memory, about a third more time"),
    H("distributed_strategy", str, "ddp", choices=STRATEGY_CHOICES, per_model=True,
      help="ddp: every process holds the whole model; fsdp: each holds 1/N of the weights, "
           "gradients and optimizer state, one transformer layer gathered at a time "
           "(torch's FSDP2, steps/fsdp.py)"),
    H("dataloader_num_workers", int, "auto", ge=0, le=64, choices=("auto",),
      help="DataLoader processes beside each training process (the Trainer's "
           "dataloader_num_workers); auto: 2 on a GPU, 0 on a CPU"),
)
# fmt: on
HYPERPARAMETERS: dict[str, Hyperparameter] = {h.name: h for h in TABLE}

# What a job that is not given a hyperparameter gets (a request written by hand).
DEFAULTS = {h.name: h.default for h in TABLE if h.default is not None}
# What has no default: the driver sets it for every training job (section "run"), and a
# training job without it cannot start (`parse_hyperparameters(..., required=True)`).
REQUIRED = tuple(h.name for h in TABLE if h.default is None)
# The names a tuning job may search over: the ones that change how a model learns (a test
# checks that each one does).
TUNABLE = tuple(h.name for h in TABLE if h.tunable)
# What makes a training the one its checkpoints were written by: the tunable ones change how
# a model learns (above), and these say what trains, on which rows in which order, for how
# long. A job resumes only checkpoints written with the same values (steps/checkpointing.py):
# another's, in a checkpoint folder two jobs share, would hand back that job's model as this
# one's. The rest may change across a resume (the processes, the precision, checkpointing).
SAME_ON_RESUME = (
    "model_name",
    *TUNABLE,
    "max_steps",
    "seed",
    "finetuning",
    "lora_dropout",
    "lora_target_modules",
    "group_by_length",
)
# [training.<model>] may change how one model learns; the rest is shared by every model
# (one job shape, one checkpointing).
PER_MODEL = tuple(h.name for h in TABLE if h.per_model)


def wire(value: object) -> str:
    """A value as a training job receives it: a string, booleans as `true`/`false`."""
    return str(value).lower() if isinstance(value, bool) else str(value)


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


def parse_hyperparameters(raw: dict[str, object], required: bool = False) -> dict[str, object]:
    """Cast the strings SageMaker hands over into their types, within their bounds; refuse
    unknown names (the reserved ones above are left to `reserved_hyperparameters`) and, for a
    training job (`required`), a REQUIRED one missing. ValueError listing every problem."""
    missing = [name for name in REQUIRED if required and name not in raw]
    problems = [
        f"required hyperparameter {name!r} is missing from hyperparameters.json" for name in missing
    ]
    values: dict[str, object] = dict(DEFAULTS)
    for name, value in raw.items():
        if is_reserved(name):
            continue
        if name not in HYPERPARAMETERS:
            problems.append(
                f"unknown hyperparameter {name!r} (known: {', '.join(HYPERPARAMETERS)})"
            )
            continue
        # SageMaker's tuner and some launchers JSON-quote strings ('"0.1"'): unwrap them.
        if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
            value = json.loads(value)
        try:
            values[name] = HYPERPARAMETERS[name].cast(value)
        except ValueError as e:
            problems.append(f"hyperparameter {name}={value!r} {e}")
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
