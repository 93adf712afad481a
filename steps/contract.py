"""The container contract, read from the environment only.

Training jobs get SageMaker's own variables (SM_MODEL_DIR, SM_CHANNEL_<NAME>, SM_HPS, ...),
set by SageMaker's training drivers or, locally, by the local backend. Processing jobs get
SM_PROCESSING_INPUT_<NAME> / SM_PROCESSING_OUTPUT_<NAME>, which both backends set to the
directories they mount. No step script names an /opt/ml path itself.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

# Exit status a job uses to say "interrupted, resume me" (SIGTERM from a spot reclaim).
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL


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
    channels = json.loads(_env("SM_CHANNELS"))
    training = json.loads(_env("SM_TRAINING_ENV"))
    return TrainingEnv(
        model_dir=Path(_env("SM_MODEL_DIR")),
        output_data_dir=Path(_env("SM_OUTPUT_DATA_DIR")),
        checkpoint_dir=Path(_env("SM_CHECKPOINT_DIR")),
        failure_file=Path(_env("SM_OUTPUT_FAILURE")),
        channels={c: Path(_env(f"SM_CHANNEL_{c.upper()}")) for c in channels},
        hyperparameters=json.loads(_env("SM_HPS")),
        hosts=json.loads(_env("SM_HOSTS")),
        current_host=_env("SM_CURRENT_HOST"),
        num_gpus=int(_env("SM_NUM_GPUS")),
        num_cpus=int(_env("SM_NUM_CPUS")),
        job_name=training.get("job_name", ""),
    )


def processing_input(name: str) -> Path:
    return Path(_env(f"SM_PROCESSING_INPUT_{name.upper()}"))


def processing_output(name: str) -> Path:
    path = Path(_env(f"SM_PROCESSING_OUTPUT_{name.upper()}"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def failure_file() -> Path | None:
    value = os.environ.get("SM_OUTPUT_FAILURE")
    return Path(value) if value else None


# Written when a step's main() has returned: a step that exits 0 without it (os._exit in user
# code) ended before its work was done, and the entrypoint fails the job.
FINISHED = "finished"


def finished_marker() -> Path | None:
    failure = failure_file()
    return failure.parent / FINISHED if failure else None


def run_step(step: str, main) -> None:
    """Run a step's main(); on an exception write SageMaker's failure file (the reason the
    driver shows the user) and exit non-zero with the traceback in the log."""
    try:
        main()
        marker = finished_marker()  # each host's container has its own: its first process
        if marker is not None and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            marker.write_text(step)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - every failure must reach the failure file
        traceback.print_exc()
        reason = f"{step}: {type(e).__name__}: {e}"
        path = failure_file()
        if path is not None and int(os.environ.get("RANK", "0")) == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(reason[:1024])
        sys.exit(1)
    finally:
        # The interpreter's shutdown garbage-collects every object torch and transformers
        # made (1.2 s of a job that imported the Trainer, 0.5 s for torch alone, measured);
        # frozen objects are skipped there. atexit handlers still run (wandb's finish).
        gc.freeze()


def write_step_metadata(directory: Path, section: dict) -> None:
    """What a step reports for its Metadata section; the driver picks it up from the output."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "step_metadata.json").write_text(json.dumps(section, indent=2, default=str))
