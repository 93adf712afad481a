"""Hyperparameter tuning on the local backend: SageMaker's tuning job, run here with Optuna.

Optuna is the field's well-kept HPO library (samplers, pruners, studies that can be
extended with earlier trials); its parts map onto SageMaker's strategies one for one:

    Bayesian   TPE sampler (Optuna's default Bayesian optimizer)
    Random     random sampler (log-uniform on a `log` interval)
    Grid       grid sampler: every combination of the categorical options, each once
    Hyperband  TPE sampler with Optuna's Hyperband pruner over epochs

`[tuning] EARLY_STOPPING = Auto` adds the median pruner: a trial whose objective falls behind
the median of earlier trials at the same epoch is stopped. What ran is what was asked for,
and the Metadata and the terminal say so.

Trials are local training jobs, `MAX_PARALLEL_JOBS` at once. Each one's objective is read
live from its log with the metric definition's regex, the regex SageMaker uses; a pruned
trial gets SIGTERM (it checkpoints and exits), is not restarted, and its checkpoints are
removed. A trial that fails is recorded with its reason and the search goes on. The best
trial's model and output become the model's, at the place a training job leaves them; the
other trials' model files are deleted, their records kept in tuning/<model>/trials.json and
trials.csv, with a chart (objective by trial, each trial's validation curve). The trials are
recorded as they finish, so a resumed run (`--resume`) continues the study with them.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import itertools
import json
import re
import tempfile
import threading
import time
from pathlib import Path

from pipeline.config import Categorical
from pipeline.jobs import JobResult, TuningJob, job_name
from pipeline.paths import RunTree
from pipeline.store import NotFound, Store, download_dir, upload_dir

EPOCH = re.compile(r"^epoch=(\d+) ")  # the metric line, not the final "best ..." line


class TrialFailed(RuntimeError):
    """A trial that ended without an objective: recorded as failed, the search goes on."""


def distributions(ranges: dict) -> dict:
    import optuna.distributions as d

    out = {}
    for name, r in sorted(ranges.items()):
        if isinstance(r, Categorical):
            out[name] = d.CategoricalDistribution(list(r.options))
        elif r.integer:
            out[name] = d.IntDistribution(int(r.low), int(r.high), log=r.log)
        else:
            out[name] = d.FloatDistribution(r.low, r.high, log=r.log)
    return out


def search(job: TuningJob, seed: int):
    """The study a strategy asks for: (sampler, pruner), and how many trials to run."""
    import optuna

    grid = None
    if job.strategy == "Grid":
        grid = {name: list(r.options) for name, r in job.ranges.items()}
        combinations = len(list(itertools.product(*grid.values())))
        sampler, trials = (
            optuna.samplers.GridSampler(grid, seed=seed),
            min(job.max_jobs, combinations),
        )
    elif job.strategy == "Random":
        sampler, trials = optuna.samplers.RandomSampler(seed=seed), job.max_jobs
    else:  # Bayesian, Hyperband
        sampler, trials = optuna.samplers.TPESampler(seed=seed), job.max_jobs
    epochs = int(job.trial.hyperparameters.get("epochs", 1))
    if job.strategy == "Hyperband":
        pruner = optuna.pruners.HyperbandPruner(
            min_resource=1, max_resource=max(1, epochs), reduction_factor=3
        )
    elif job.early_stopping == "Auto":
        pruner = optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0)
    else:
        pruner = optuna.pruners.NopPruner()
    return sampler, pruner, trials


def suggest(trial, name: str, space):
    import optuna.distributions as d

    if isinstance(space, d.CategoricalDistribution):
        return trial.suggest_categorical(name, space.choices)
    if isinstance(space, d.IntDistribution):
        return trial.suggest_int(name, space.low, space.high, log=space.log)
    return trial.suggest_float(name, space.low, space.high, log=space.log)


def value_of(hp: str) -> str:
    return hp if isinstance(hp, str) else f"{hp:.6g}" if isinstance(hp, float) else str(hp)


def run_local_tuning(backend, job: TuningJob, store: Store, run: RunTree) -> JobResult:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # a failed trial is reported once, by us
    model_name = job.trial.hyperparameters["model_name"]
    seed = int(job.trial.hyperparameters.get("seed", 0))
    sampler, pruner, n_trials = search(job, seed)
    direction = "maximize" if job.objective_type == "Maximize" else "minimize"
    study = optuna.create_study(direction=direction, sampler=sampler, pruner=pruner)
    spaces = distributions(job.ranges)
    objective_regex = re.compile(job.trial.metric_definitions[job.objective_metric])
    records: dict[int, dict] = {}
    lock = threading.Lock()
    started = time.time()

    # A resumed run: the trials the study finished before are its first trials again.
    for record in earlier_trials(store, run, model_name):
        records[record["number"]] = record
        state = {
            "Completed": optuna.trial.TrialState.COMPLETE,
            "Stopped": optuna.trial.TrialState.PRUNED,
        }
        study.add_trial(optuna.trial.create_trial(
            params={k: _typed(spaces[k], v) for k, v in record["hyperparameters"].items()},
            distributions=spaces, value=record["objective"] if record["status"] == "Completed" else None,
            state=state.get(record["status"], optuna.trial.TrialState.FAIL),
            intermediate_values={int(k): v for k, v in record.get("epochs", {}).items()},
        ))  # fmt: skip
    say = backend._say(job.name)
    say(f"tuning {model_name}: {job.strategy} ({type(sampler).__name__}, {type(pruner).__name__}), "
        f"{n_trials} trials, {job.max_parallel_jobs} at once, {direction} {job.objective_metric}")  # fmt: skip

    def objective(trial) -> float:
        values = {name: value_of(suggest(trial, name, space)) for name, space in spaces.items()}
        number = trial.number + 1
        prefix = run.trial(model_name, number)
        trial_job = dataclasses.replace(
            job.trial,
            name=job_name(run.experiment, run.label, "tune", model_name, f"{number:03d}"),
            hyperparameters={**job.trial.hyperparameters, **values},
            model_prefix=prefix + "model/",
            output_prefix=prefix + "output/",
            checkpoint_prefix=run.checkpoints(f"{model_name}-trial-{number:03d}"),
            processes_per_host=1,  # a tuning job's parallelism is across trials
            instance_count=1,
            max_restarts=0,
        )
        reported: dict[int, float] = {}
        verdict: dict[str, str] = {}

        def watch(line: str) -> bool:
            epoch, found = EPOCH.match(line), objective_regex.search(line)
            if not (epoch and found):
                return False
            step, value = int(epoch.group(1)), float(found.group(1))
            reported[step] = value
            trial.report(value, step)
            if trial.should_prune():
                verdict["stopped"] = (
                    f"early stopping: {job.objective_metric}={value:.4f} at epoch {step}"
                )
                return True
            return False

        result = backend.run_training(trial_job, watch=watch)
        status = "Stopped" if verdict else result.status
        record = {"number": number, "job_name": trial_job.name, "status": status, "hyperparameters": values,
                  "objective": result.metrics.get(job.objective_metric) if status == "Completed" else None,
                  "epochs": reported, "seconds": result.seconds,
                  "stop_reason": verdict.get("stopped") or result.failure_reason,
                  "model": trial_job.model_prefix, "output": trial_job.output_prefix}  # fmt: skip
        with lock:
            records[number] = record
            save_trials(store, run, model_name, records)
        if status == "Stopped":
            for key in store.list_keys(
                trial_job.checkpoint_prefix
            ):  # a stopped trial never resumes
                store.delete(key)
            say(f"trial {number} stopped: {record['stop_reason']}")
            raise optuna.TrialPruned(record["stop_reason"])
        if status != "Completed" or record["objective"] is None:
            say(f"trial {number} failed: {record['stop_reason'] or 'no objective in its log'}")
            raise TrialFailed(record["stop_reason"] or f"no {job.objective_metric} in its log")
        say(f"trial {number}: {job.objective_metric}={record['objective']:.4f} {values}")
        return record["objective"]

    remaining = n_trials - len(records)
    try:
        if remaining > 0:
            study.optimize(objective, n_trials=remaining, n_jobs=job.max_parallel_jobs,
                           catch=(TrialFailed,))  # fmt: skip
    except BaseException:  # the driver is stopping: the running trials stop, no new one starts
        backend.stop()
        raise
    return finish(store, run, job, model_name, records, started, sampler, pruner)


def _typed(space, value: str):
    import optuna.distributions as d

    if isinstance(space, d.IntDistribution):
        return int(float(value))
    if isinstance(space, d.FloatDistribution):
        return float(value)
    return value


def earlier_trials(store: Store, run: RunTree, model_name: str) -> list[dict]:
    try:
        record = json.loads(store.get_bytes(run.tuning(model_name) + "trials.json"))
    except NotFound:
        return []
    return [t for t in record["trials"] if t["status"] in ("Completed", "Stopped", "Failed")]


def save_trials(store: Store, run: RunTree, model_name: str, records: dict[int, dict]) -> None:
    trials = [records[n] for n in sorted(records)]
    store.put_bytes(
        run.tuning(model_name) + "trials.json", json.dumps({"trials": trials}, indent=2).encode()
    )
    names = sorted({k for t in trials for k in t["hyperparameters"]})
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(
        ["trial", "job_name", "status", "objective", *names, "epochs_run", "seconds", "stop_reason"]
    )
    for t in trials:
        writer.writerow([t["number"], t["job_name"], t["status"], t["objective"],
                         *(t["hyperparameters"].get(n) for n in names), len(t["epochs"]), t["seconds"],
                         t["stop_reason"] or ""])  # fmt: skip
    store.put_bytes(run.tuning(model_name) + "trials.csv", out.getvalue().encode())


def finish(store, run, job, model_name, records, started, sampler, pruner) -> JobResult:
    """The best trial promoted, the others' model files deleted, the chart drawn."""
    trials = [records[n] for n in sorted(records)]
    sign = 1 if job.objective_type == "Maximize" else -1
    scored = [t for t in trials if t["status"] == "Completed" and t["objective"] is not None]
    best = max(scored, key=lambda t: sign * t["objective"]) if scored else None
    details = {"tuning_job": job.name, "strategy": job.strategy, "ran_as": job.strategy,
               "sampler": type(sampler).__name__, "pruner": type(pruner).__name__,
               "early_stopping": job.early_stopping, "objective_metric": job.objective_metric,
               "objective_type": job.objective_type, "trials": trials, "best": best,
               "stopped_early": sum(t["status"] == "Stopped" for t in trials),
               "failed": sum(t["status"] == "Failed" for t in trials)}  # fmt: skip
    store.put_bytes(run.tuning_record(model_name), json.dumps(details, indent=2).encode())
    if best is None:
        reasons = "; ".join(
            f"trial {t['number']} {t['status'].lower()}: {t['stop_reason']}" for t in trials
        )
        return JobResult(name=job.name, status="Failed", start_time=started, end_time=time.time(),
                         failure_reason=f"no trial of {len(trials)} completed with {job.objective_metric}: {reasons}",
                         details=details)  # fmt: skip
    copy_dir(store, best["model"], job.trial.model_prefix, best["job_name"])
    copy_dir(store, best["output"], job.trial.output_prefix, best["job_name"])
    for t in trials:  # only the best trial's model stays; every trial's record does
        if t is not best:
            for key in store.list_keys(t["model"]):
                store.delete(key)
    draw(store, run, model_name, trials, job.objective_metric, sign)
    return JobResult(name=job.name, status="Completed", failure_reason=None, start_time=started,
                     end_time=time.time(), details=details)  # fmt: skip


def copy_dir(store: Store, source: str, destination: str, job: str) -> None:
    with tempfile.TemporaryDirectory(prefix="smpipe-copy-") as tmp:
        download_dir(store, source, Path(tmp))
        upload_dir(store, tmp, destination, {"job_name": job})


def draw(
    store: Store, run: RunTree, model_name: str, trials: list[dict], metric: str, sign: int
) -> None:
    """tuning/<model>/trials.png: the objective by trial with the best so far, and each
    trial's objective by epoch (stopped trials end early)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    done = [t for t in trials if t["objective"] is not None]
    left.scatter([t["number"] for t in done], [t["objective"] for t in done], label="trial")
    best, line = None, []
    for t in done:
        best = t["objective"] if best is None or sign * t["objective"] > sign * best else best
        line.append(best)
    left.step([t["number"] for t in done], line, where="post", color="C1", label="best so far")
    left.set(xlabel="trial", ylabel=metric, title="objective by trial")
    left.legend()
    for t in trials:
        epochs = sorted((int(k), v) for k, v in t["epochs"].items())
        if epochs:
            style = "--" if t["status"] == "Stopped" else "-"
            right.plot([e for e, _ in epochs], [v for _, v in epochs], style, marker="o",
                       label=f"{t['number']} ({t['status'].lower()})")  # fmt: skip
    right.set(xlabel="epoch", ylabel=metric, title="each trial, by epoch")
    right.legend(fontsize=7)
    from matplotlib.ticker import MaxNLocator

    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"tuning {model_name}")
    fig.tight_layout()
    with tempfile.TemporaryDirectory() as tmp:
        fig.savefig(Path(tmp, "trials.png"), dpi=100)
        store.upload_file(Path(tmp, "trials.png"), run.tuning(model_name) + "trials.png")
    plt.close(fig)
