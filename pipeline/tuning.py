"""Hyperparameter tuning on the local backend: SageMaker's tuning job, run here.

Trials are training jobs like any other, with the sampled values in their hyperparameters;
the objective is read off each job's log with the metric definition's regex, as SageMaker
reads it (the last value the job printed). `Random` samples uniformly (log-uniformly on a
`log` interval); `Grid` runs every combination of categorical options. `Bayesian` and
`Hyperband` need SageMaker's service: locally they are run as `Random`, and the Metadata says so.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pipeline.config import Categorical, Settings
from pipeline.jobs import JobResult, make_training_job
from pipeline.paths import RunTree
from pipeline.store import Store


@dataclass
class TuningOutcome:
    results: list[JobResult]
    details: dict
    best: dict | None = None
    best_model_prefix: str | None = None
    trials: list[dict] = field(default_factory=list)


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


def run_tuning(
    settings: Settings,
    store: Store,
    run: RunTree,
    backend,
    model_name: str,
    channels: dict,
    env: dict,
) -> TuningOutcome:
    if getattr(backend, "name", "") == "sagemaker":
        return run_service_tuning(settings, store, run, backend, model_name, channels, env)
    tuning = settings.tuning
    strategy = tuning.strategy
    if strategy == "Grid":
        candidates = grid(settings.tunables)[: tuning.max_jobs]
    else:
        rng = random.Random(settings.data.seed)
        candidates = [sample(settings.tunables, rng) for _ in range(tuning.max_jobs)]
    ran_as = strategy if strategy in ("Grid", "Random") else "Random"

    def trial(index_values):
        index, values = index_values
        # Trials run one process each: a tuning job's parallelism is across trials.
        job = make_training_job(settings, run, model_name, kind="tuning", prefix=run.trial(model_name, index),
                                checkpoint_prefix=run.checkpoints(f"{model_name}-trial-{index:03d}"),
                                channels=channels, env=env, extra_hyperparameters=values, name_parts=(f"{index:03d}",))  # fmt: skip
        job.processes_per_host, job.instance_count = 1, 1
        return job, backend.run_training(job)

    with ThreadPoolExecutor(max_workers=tuning.max_parallel_jobs) as pool:
        finished = list(pool.map(trial, enumerate(candidates, 1)))

    trials, results = [], []
    for (job, result), values in zip(finished, candidates, strict=True):
        results.append(result)
        objective = result.metrics.get(tuning.objective_metric)
        trials.append({"job_name": job.name, "status": result.status, "hyperparameters": values,
                       "objective": objective, "model": store.uri_of(job.model_prefix)})  # fmt: skip
    scored = [
        (tr, job)
        for tr, (job, _) in zip(trials, finished, strict=True)
        if tr["status"] == "Completed" and tr["objective"] is not None
    ]
    sign = 1 if tuning.objective_type == "Maximize" else -1
    outcome = TuningOutcome(results=results, details={}, trials=trials)
    if scored:
        best, best_job = max(scored, key=lambda pair: sign * pair[0]["objective"])
        outcome.best, outcome.best_model_prefix = best, best_job.model_prefix
    outcome.details = {
        "strategy": strategy, "ran_as": ran_as, "objective_metric": tuning.objective_metric,
        "objective_type": tuning.objective_type, "trials": trials, "best": outcome.best,
    }  # fmt: skip
    store.put_bytes(run.tuning_record(model_name), json.dumps(outcome.details, indent=2).encode())
    return outcome


def run_service_tuning(
    settings: Settings,
    store: Store,
    run: RunTree,
    backend,
    model_name: str,
    channels: dict,
    env: dict,
) -> TuningOutcome:
    """SageMaker runs the trials and picks the best; the best model lands under tuning/<model>/best/."""
    job = make_training_job(settings, run, model_name, kind="tuning", prefix=run.tuning_best(model_name),
                            checkpoint_prefix=run.checkpoints(model_name), channels=channels, env=env)  # fmt: skip
    result, details = backend.run_tuning(job)
    outcome = TuningOutcome(results=[result], details=details)
    if result.status == "Completed":
        outcome.best, outcome.best_model_prefix = details["best"], job.model_prefix
    store.put_bytes(run.tuning_record(model_name), json.dumps(details, indent=2).encode())
    return outcome
