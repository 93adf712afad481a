"""What a job is, independent of where it runs.

A backend takes one of these and runs it under the SageMaker container contract: the same
step module, the same channels and hyperparameters, the same output locations in the store.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

JOB_NAME_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")  # SageMaker's rule


def job_name(*parts: str) -> str:
    """A SageMaker-valid job name (63 characters, letters, digits and '-') that is unique."""
    stamp = time.strftime("%H%M%S", time.gmtime())
    base = "-".join(re.sub(r"[^a-zA-Z0-9]+", "-", p).strip("-") for p in parts if p)
    base = re.sub(r"-+", "-", base)[: 63 - len(stamp) - 1].strip("-")
    return f"{base}-{stamp}"


@dataclass
class ProcessingJob:
    name: str
    step: str  # module under steps/, run as `python -m steps.<step>`
    inputs: dict[str, str]  # channel -> store prefix of a manifested directory
    outputs: dict[str, str]  # channel -> store prefix the output is uploaded to
    arguments: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    instance_type: str = "ml.m5.xlarge"


@dataclass
class TrainingJob:
    name: str
    step: str
    channels: dict[str, str]  # channel -> store prefix of a manifested directory
    hyperparameters: dict[str, str]
    model_prefix: str  # where SM_MODEL_DIR lands
    output_prefix: str  # where SM_OUTPUT_DATA_DIR lands
    checkpoint_prefix: str  # synced with SM_CHECKPOINT_DIR
    env: dict[str, str] = field(default_factory=dict)
    instance_type: str = "ml.m5.xlarge"
    instance_count: int = 1
    processes_per_host: int = 1
    use_spot: bool = False
    max_run_seconds: int = 86400
    max_wait_seconds: int = 172800
    max_restarts: int = 0
    metric_definitions: dict[str, str] = field(default_factory=dict)


@dataclass
class JobResult:
    name: str
    status: str  # Completed | Failed | Interrupted
    failure_reason: str | None
    start_time: float
    end_time: float
    peak_memory_mb: float | None = None
    exit_code: int | None = None
    restarts: int = 0
    log_key: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return round(self.end_time - self.start_time, 3)


class JobFailed(RuntimeError):
    def __init__(self, result: JobResult, step: str):
        self.result = result
        self.step = step
        super().__init__(f"step '{step}': job {result.name} failed: {result.failure_reason}")


def make_training_job(settings, run, model_name: str, *, kind: str, prefix: str, checkpoint_prefix: str,
                      channels: dict[str, str], env: dict[str, str], extra_hyperparameters: dict | None = None,
                      name_parts: tuple[str, ...] = ()) -> TrainingJob:  # fmt: skip
    """A training job of `model_name` shaped by [training] (and [training.<model>]): used by a
    plain training run, by every local tuning trial, and by a SageMaker tuning job."""
    from pipeline.paths import run_label

    t = settings.model_training.get(model_name, settings.training)
    step_name = "train" if kind == "training" else "tune"
    return TrainingJob(
        name=job_name(
            settings.experiment.name, run_label(run.run_num), step_name, model_name, *name_parts
        ),
        step="train",
        channels=channels,
        hyperparameters={
            **settings.training_hyperparameters(model_name, kind),
            **(extra_hyperparameters or {}),
        },
        model_prefix=prefix + "model/",
        output_prefix=prefix + "output/",
        checkpoint_prefix=checkpoint_prefix,
        env=env,
        instance_type=t.instance_type,
        instance_count=t.instance_count,
        processes_per_host=t.processes_per_host if t.use_distributed else 1,
        use_spot=t.use_spot,
        max_run_seconds=t.max_run_seconds,
        max_wait_seconds=t.max_wait_seconds,
        max_restarts=t.max_restarts,
        metric_definitions=settings.metric_definitions,
    )
