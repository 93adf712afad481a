"""What the stages of a training job share (steps/train.py): one `Job`, set up once
(`set_up`), then read and advanced by each stage, and handed to the blocks that need more of it
than a value or two (steps/best_model.py, steps/training_report.py, steps/tracking.py)."""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from steps import checkpointing as ckpt
from steps.batching import Batches
from steps.finetuning import Finetuning
from steps.hyperparameters import parse_hyperparameters
from steps.runtime.environment import TrainingEnv
from steps.runtime.names import TRAINING_CHANNELS
from steps.sampler import ResumableBatchSampler
from steps.training_blocks import StopCheck


@dataclass
class Job:
    """What the stages share: set up once, then read and advanced by each stage."""

    hp: dict
    env: TrainingEnv
    accelerator: Accelerator
    keys: list[str]
    id2label: dict[int, str]
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    state: ckpt.State
    sampler: ResumableBatchSampler
    train_loader: DataLoader
    val_batches: Batches
    inputs: dict  # this model's padding values and sequence inputs (labels/inputs.json)
    max_length: int  # the tokens prepare cut rows to (labels/encoding.json)
    per_device: int
    accumulation: int
    total_steps: int
    wandb_on: bool
    settings: dict  # what was applied: precision, optimizer, compile, grouping
    finetuning: Finetuning  # what of the model trains (full or LoRA), gradient checkpointing
    best_weights: dict | None = None
    resumed_from: dict | None = None
    checkpoint_seconds: list[float] = field(default_factory=list)
    checkpoint_bytes: int | None = None  # the newest checkpoint's, as written (main process)
    peak_memory: list[dict] = field(default_factory=list)  # per process (`end_epoch`)
    started: float = field(default_factory=time.time)
    epoch_started: float = 0.0
    loop_seconds: float = 0.0  # in train_epoch: the optimizer steps, nothing around them
    last_finite: tuple[int, float] | None = None  # (optimizer step, its mean loss)
    stop_check: StopCheck = field(default_factory=StopCheck)  # when the processes ask (SIGTERM)
    tracking: concurrent.futures.Future | None = None  # wandb starting (start_tracking)
    # FSDP: the model on the meta device, on the main process, for the gathered final weights
    frame: torch.nn.Module | None = None


def job_hyperparameters(env: TrainingEnv) -> dict:
    """The job's hyperparameters, cast (steps/hyperparameters.py), once it is known to have
    what it needs: ValueError listing every problem at once, each naming the hyperparameter or
    channel, before anything is loaded. SageMaker writes a job's channels, InputDataConfig, to
    inputdataconfig.json and each one's data to /opt/ml/input/data/<channel>
    (your-algorithms-training-algo-running-container.html, Input Data Configuration, Training
    Data); SM_CHANNELS names those inputdataconfig.json lists (steps/runtime/variables.py)."""
    problems = []
    try:
        hp = parse_hyperparameters(env.hyperparameters, required=True)
    except ValueError as e:
        problems.append(str(e))
    missing = [repr(c) for c in TRAINING_CHANNELS if c not in env.channels]
    if missing:
        has = ", ".join(sorted(env.channels)) or "none"
        one = len(missing) == 1
        problems.append(
            f"channel{'' if one else 's'} {', '.join(missing)} {'is' if one else 'are'} missing "
            f"from inputdataconfig.json (the job's channels: {has})"
        )
    for channel in TRAINING_CHANNELS:
        if channel in env.channels and not env.channels[channel].is_dir():
            problems.append(f"channel {channel!r} has no folder {env.channels[channel]}")
    if problems:
        raise ValueError("; ".join(problems))
    return hp
