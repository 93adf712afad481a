"""Hyperparameter tuning on the local backend: SageMaker's tuning job, run here.

Trials are local training jobs built from the tuning job's trial definition, with the sampled
values in their hyperparameters; the objective is read off each job's log with the metric
definition's regex, as SageMaker reads it (the last value the job printed). `Random` samples
uniformly (log-uniformly on a `log` interval); `Grid` runs every combination of categorical
options. `Bayesian` and `Hyperband` need SageMaker's service: locally they are run as
`Random`, and the Metadata says so. The best trial's model becomes the model's, at the place
a training job leaves it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline.config import Categorical
from pipeline.jobs import JobResult, TuningJob, job_name
from pipeline.paths import RunTree
from pipeline.store import Store, download_dir, upload_dir


def sample(tunables: dict, rng: random.Random) -> dict[str, str]:
    values = {}
    for name, t in sorted(tunables.items()):
        if isinstance(t, Categorical):
            values[name] = rng.choice(t.options)
        elif t.log:
            x = math.exp(rng.uniform(math.log(t.low), math.log(t.high)))
            values[name] = str(round(x)) if t.integer else f"{x:.6g}"
        else:
            x = rng.uniform(t.low, t.high)
            values[name] = str(round(x)) if t.integer else f"{x:.6g}"
    return values


def grid(tunables: dict) -> list[dict[str, str]]:
    names = sorted(tunables)
    return [
        dict(zip(names, combo, strict=True))
        for combo in itertools.product(*(tunables[n].options for n in names))
    ]


def ranges_from_request(ranges: dict) -> dict:
    """A tuning request's ParameterRanges as the settings write them."""
    from pipeline.config import Interval

    out: dict = {}
    for kind, integer in (("ContinuousParameterRanges", False), ("IntegerParameterRanges", True)):
        for r in ranges.get(kind, []):
            log = r.get("ScalingType") in ("Logarithmic", "ReverseLogarithmic")
            out[r["Name"]] = Interval(float(r["MinValue"]), float(r["MaxValue"]), integer, log)
    for r in ranges.get("CategoricalParameterRanges", []):
        out[r["Name"]] = Categorical(tuple(r["Values"]))
    return out


def copy_dir(store: Store, source: str, destination: str, job: str) -> None:
    with tempfile.TemporaryDirectory(prefix="smpipe-copy-") as tmp:
        download_dir(store, source, Path(tmp))
        upload_dir(store, tmp, destination, {"job_name": job})


def run_local_tuning(backend, job: TuningJob, store: Store, run: RunTree) -> JobResult:
    model_name = job.trial.hyperparameters["model_name"]
    if job.strategy == "Grid":
        candidates = grid(job.ranges)[: job.max_jobs]
    else:
        rng = random.Random(int(job.trial.hyperparameters.get("seed", 0)))
        candidates = [sample(job.ranges, rng) for _ in range(job.max_jobs)]
    ran_as = job.strategy if job.strategy in ("Grid", "Random") else "Random"

    def trial(index_values):
        index, values = index_values
        prefix = run.trial(model_name, index)
        # Trials run one process each: a tuning job's parallelism is across trials.
        trial_job = dataclasses.replace(
            job.trial,
            name=job_name(run.experiment, run.label, "tune", model_name, f"{index:03d}"),
            hyperparameters={**job.trial.hyperparameters, **values},
            model_prefix=prefix + "model/",
            output_prefix=prefix + "output/",
            checkpoint_prefix=run.checkpoints(f"{model_name}-trial-{index:03d}"),
            processes_per_host=1,
            instance_count=1,
        )
        return trial_job, backend.run_training(trial_job)

    pool = ThreadPoolExecutor(max_workers=job.max_parallel_jobs)
    try:
        finished = list(pool.map(trial, enumerate(candidates, 1)))
    except BaseException:  # the driver is stopping: the running trials stop, no new one starts
        backend.stop()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()

    trials = []
    for (trial_job, result), values in zip(finished, candidates, strict=True):
        trials.append({"job_name": trial_job.name, "status": result.status, "hyperparameters": values,
                       "objective": result.metrics.get(job.objective_metric),
                       "failure_reason": result.failure_reason,
                       "model": trial_job.model_prefix})  # fmt: skip
    scored = [
        (t, trial_job)
        for t, (trial_job, _) in zip(trials, finished, strict=True)
        if t["status"] == "Completed" and t["objective"] is not None
    ]
    sign = 1 if job.objective_type == "Maximize" else -1
    best = max(scored, key=lambda pair: sign * pair[0]["objective"]) if scored else None
    details = {"tuning_job": job.name, "strategy": job.strategy, "ran_as": ran_as,
               "objective_metric": job.objective_metric, "objective_type": job.objective_type,
               "trials": trials, "best": best[0] if best else None}  # fmt: skip
    store.put_bytes(run.tuning_record(model_name), json.dumps(details, indent=2).encode())
    results = [r for _, r in finished]
    result = JobResult(
        name=job.name,
        status="Completed" if best else "Failed",
        failure_reason=None
        if best
        else "no trial completed with an objective: "
        + "; ".join(f"{t['job_name']}: {t['failure_reason']}" for t in trials),
        start_time=min(r.start_time for r in results),
        end_time=max(r.end_time for r in results),
        peak_memory_mb=max((r.peak_memory_mb or 0 for r in results), default=None) or None,
        log_key=results[-1].log_key,
        details=details,
    )
    if best:
        best_job = best[1]
        copy_dir(store, best_job.model_prefix, job.trial.model_prefix, best_job.name)
        copy_dir(store, best_job.output_prefix, job.trial.output_prefix, best_job.name)
    return result
