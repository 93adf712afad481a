"""The job's environment, as a step reads it: one object for a training step (`training_env`),
a folder per name for a processing step (`processing_input`, `processing_output`).

Training jobs get SageMaker's own variables (SM_MODEL_DIR, SM_CHANNEL_<NAME>, SM_HPS, ...),
which the entrypoint exports from the job's config files (steps/runtime/variables.py) as
SageMaker's framework containers do. Processing jobs get SM_PROCESSING_INPUT_<NAME> /
SM_PROCESSING_OUTPUT_<NAME>. No step script names an /opt/ml path itself.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from steps.runtime import names


def ml_root() -> Path:
    """The container root: /opt/ml, or the job root a local player put in its place."""
    return Path(os.environ.get(names.ML_ROOT_VARIABLE, names.CONTAINER_ROOT))


def image_record() -> str | None:
    """The image's record (docker/Dockerfile writes it) as one log line; None outside an image
    (a local player's process)."""
    try:
        record = json.loads(Path(names.IMAGE_RECORD_FILE).read_text())
    except (OSError, ValueError):
        return None
    return "image: " + " ".join(f"{k}={v}" for k, v in sorted(record.items()))


def _env(name: str) -> str:
    try:
        return os.environ[name]
    except KeyError:
        raise RuntimeError(f"the container contract is missing ${name}") from None


@dataclass(frozen=True)
class TrainingEnv:
    model_dir: Path
    output_data_dir: Path
    checkpoint_dir: Path
    failure_file: Path
    channels: dict[str, Path]
    hyperparameters: dict[str, object]
    hosts: list[str]
    current_host: str
    num_gpus: int
    num_cpus: int
    job_name: str


def training_env() -> TrainingEnv:
    channels = json.loads(_env(names.SM_CHANNELS))
    training = json.loads(_env(names.SM_TRAINING_ENV))
    return TrainingEnv(
        model_dir=Path(_env(names.SM_MODEL_DIR)),
        output_data_dir=Path(_env(names.SM_OUTPUT_DATA_DIR)),
        checkpoint_dir=Path(_env(names.SM_CHECKPOINT_DIR)),
        failure_file=Path(_env(names.SM_OUTPUT_FAILURE)),
        channels={c: Path(_env(names.channel_variable(c))) for c in channels},
        hyperparameters=json.loads(_env(names.SM_HPS)),
        hosts=json.loads(_env(names.SM_HOSTS)),
        current_host=_env(names.SM_CURRENT_HOST),
        num_gpus=int(_env(names.SM_NUM_GPUS)),
        num_cpus=int(_env(names.SM_NUM_CPUS)),
        job_name=training.get("job_name", ""),
    )


def processing_input(name: str) -> Path:
    return Path(_env(names.processing_input_variable(name)))


def processing_output(name: str) -> Path:
    path = Path(_env(names.processing_output_variable(name)))
    path.mkdir(parents=True, exist_ok=True)
    return path


def failure_file() -> Path | None:
    value = os.environ.get(names.SM_OUTPUT_FAILURE)
    return Path(value) if value else None
