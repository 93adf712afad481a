"""A training job's report: its section of the run's Metadata (`write_report`, the last thing
the main process writes), and what the job measures for it as it goes: where its time outside
the optimizer steps goes (`timed`), and each process's peak memory (`peak_memory`)."""

from __future__ import annotations

import collections
import contextlib
import time

import torch
from accelerate import Accelerator

from steps.hyperparameters import reserved_hyperparameters
from steps.runtime.step import write_step_metadata
from steps.training_job import Job

# Where the job's time outside its optimizer steps goes, by phase (the report's
# `seconds_outside_steps`): what a job's fixed cost is made of, measured by every job.
OUTSIDE_STEPS: dict[str, float] = collections.defaultdict(float)


@contextlib.contextmanager
def timed(phase: str):
    started = time.time()
    try:
        yield
    finally:
        OUTSIDE_STEPS[phase] += time.time() - started


def seconds_before_main() -> float:
    """This process's age when main() starts: the interpreter and the imports (about 0 in a
    job forked from a warm server, which imported them before)."""
    import psutil

    return time.time() - psutil.Process().create_time()


def peak_memory(accelerator: Accelerator) -> tuple[str, int]:
    """This process's peak memory so far, and what it is: the GPU's allocated bytes on a GPU
    (what the model, its gradients, optimizer state and activations took), the host's
    resident set on a CPU."""
    if accelerator.device.type == "cuda":
        return "gpu_max_allocated_bytes", torch.cuda.max_memory_allocated(accelerator.device)
    import resource

    # ru_maxrss is in kilobytes on Linux (getrusage(2)).
    return "host_max_rss_bytes", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write_report(job: Job, exports: dict, merge: dict) -> None:
    """The job's section of the run's Metadata (step_metadata.json in output/data)."""
    accelerator, state, env = job.accelerator, job.state, job.env
    gpu = None
    if torch.cuda.is_available():
        gpu = {
            "devices": torch.cuda.device_count(),
            "max_memory_allocated_mb": torch.cuda.max_memory_allocated() / 2**20,
        }
    write_step_metadata(
        env.output_data_dir,
        {
            "model_name": job.hp["model_name"],
            "best_epoch": state.best_epoch,
            "best_validation_f1": state.best_metric,
            "history": state.history,
            "exports": exports,
            "resumed_from": job.resumed_from,
            "steps": state.step,
            "processes": accelerator.num_processes,
            "cpu_threads": torch.get_num_threads(),  # OMP_NUM_THREADS: a local trial's share
            "per_device_batch": job.per_device,
            "accumulation": job.accumulation,
            **job.settings,
            **job.finetuning.record(),
            "lora_merge": merge or None,
            # Each process's peak at its last epoch's end (end_epoch); the main one's read again
            # now, its saving and exports in.
            "peak_memory": [
                {"process": 0, **dict([peak_memory(accelerator)])},
                *[p for p in job.peak_memory if p["process"] != 0],
            ],
            "training_peak_memory": job.peak_memory,  # every process's, at the last epoch's end
            "checkpoint_bytes": job.checkpoint_bytes,
            "checkpoints_written": len(job.checkpoint_seconds),
            "checkpoint_seconds_total": round(sum(job.checkpoint_seconds), 3),
            "seconds": round(time.time() - job.started, 3),
            "train_loop_seconds": round(job.loop_seconds, 3),
            "seconds_outside_steps": {
                **{phase: round(t, 3) for phase, t in OUTSIDE_STEPS.items()},
                "checkpoints": round(sum(job.checkpoint_seconds), 3),
            },
            "gpu_usage": gpu,
            "sagemaker_hyperparameters": reserved_hyperparameters(env.hyperparameters),
        },
    )
