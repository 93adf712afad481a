"""wandb, through Accelerate's tracker: the run started beside the first epoch's steps
(`start_tracking`), waited for before a log and at the end (`tracked`), and named in the
model's record (`wandb_run_of`)."""

from __future__ import annotations

import concurrent.futures

from accelerate import Accelerator

from steps.runtime.environment import TrainingEnv
from steps.training_job import Job
from steps.training_report import timed


def start_tracking(accelerator: Accelerator, hp: dict, env: TrainingEnv):
    """wandb's run, started beside the first epoch's steps: wandb.init starts its service
    process and waits for it (docs/performance.md), which nothing before the
    first metric line needs. `tracked` waits for it. Accelerate's init_trackers, which runs
    on the main process only, is called as in the foreground; an error it raises is raised by
    `tracked`. What wandb's console capture misses (the step lines printed before it is up)
    is in the job's own log."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="wandb-init")
    started = pool.submit(
        accelerator.init_trackers,
        hp["wandb_project"],
        config=hp,
        init_kwargs={"wandb": {"name": env.job_name, "dir": str(env.output_data_dir)}},
    )
    pool.shutdown(wait=False)
    return started


def tracked(job: Job) -> None:
    """The wandb run is up (its start's error raised here): before a log, and before the end."""
    if job.tracking is not None:
        with timed("tracking"):  # the part of wandb's start the steps did not hide
            job.tracking.result()


def wandb_run_of(job: Job) -> dict | None:
    """This job's wandb run, kept in the model's record: inference logs the model, with its
    test metrics, as a `model` artifact of this run (steps/model_artifact.py)."""
    if not job.wandb_on:
        return None
    tracked(job)
    run = job.accelerator.get_tracker("wandb", unwrap=True)
    return {"id": run.id, "project": run.project}
