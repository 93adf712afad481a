"""Hyperparameter tuning on the local backend: SageMaker's tuning job, run here with Optuna.

`run_local_tuning` runs one study: the strategy's sampler and pruner (`search`), the trials as
local training jobs, `MAX_PARALLEL_JOBS` at once, each one's objective read live from its log
with SageMaker's regex (`pruning`), and the best trial promoted (`finish`). The study's journal,
trials.json, lets `--resume` continue it (`reseed`). What each strategy and EARLY_STOPPING does
is in docs/settings.md (Tuning).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import tempfile
import threading
import time
import warnings
from pathlib import Path

from pipeline import tuning_record
from pipeline.backend import TrialRunner, Watch
from pipeline.jobs import JobResult, TrainingJob, TuningJob, job_name
from pipeline.paths import RunTree
from pipeline.search_space import distributions, drawn_value, value_of
from pipeline.service_model import TUNING_OBJECTIVE
from pipeline.store import NotFound, Store, download_dir, is_complete, upload_dir
from steps.hyperparameters import HYPERPARAMETERS, parse_hyperparameters

# The metric line (steps/metrics.py metric_line), not the final "best ..." line: its epoch and
# the optimizer steps taken by then.
EPOCH = re.compile(r"^epoch=(\d+) step=(\d+) ")


class TrialFailed(RuntimeError):
    """A trial that ended without an objective: recorded as failed, the search goes on."""


class TrialInterrupted(RuntimeError):
    """The driver stopped a trial (Ctrl-C, SIGTERM): it is continued when the run is resumed."""


def search(job: TuningJob, seed: int):
    """The study a strategy asks for: (sampler, pruner), and how many trials to run. Optuna's
    parts map onto SageMaker's strategies one for one:

        Bayesian   TPE sampler (Optuna's default Bayesian optimizer)
        Random     random sampler (log-uniform on a `log` interval)
        Grid       brute-force sampler: every combination of the categorical options, each once
        Hyperband  TPE sampler with Optuna's Hyperband pruner over epochs

    `EARLY_STOPPING = Auto` adds the median pruner: a trial whose objective falls behind the
    median of earlier trials at the same epoch is stopped."""
    import optuna

    if job.strategy == "Grid":
        # Optuna's brute-force sampler: each combination once, told apart by its values (the
        # grid sampler tells them apart by trial number, which a resumed study does not keep).
        combinations = len(list(itertools.product(*(r.options for r in job.ranges.values()))))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            sampler = optuna.samplers.BruteForceSampler(seed=seed)
        trials = min(job.max_jobs, combinations)
    elif job.strategy == "Random":
        sampler, trials = optuna.samplers.RandomSampler(seed=seed), job.max_jobs
    else:  # Bayesian, Hyperband
        sampler, trials = optuna.samplers.TPESampler(seed=seed), job.max_jobs
    if job.strategy == "Hyperband":
        pruner = optuna.pruners.HyperbandPruner(
            min_resource=1, max_resource=max(1, job.max_epochs), reduction_factor=3
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


def run_local_tuning(backend: TrialRunner, job: TuningJob, store: Store, run: RunTree) -> JobResult:
    """The tuning job played here, its trials run by `backend`; its result as a tuning job's."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # a failed trial is reported once, by us
    model_name = job.trial.hyperparameters["model_name"]
    trials = Trials(store, run, model_name)
    # A resumed study's sampler is seeded past the trials it is told again (`reseed`): told
    # trials do not advance a seeded sampler's draws, which would repeat the first trials'.
    seed = int(job.trial.hyperparameters.get("seed", 0)) + len(trials.records)
    sampler, pruner, n_trials = search(job, seed)
    direction = "maximize" if job.objective_type == "Maximize" else "minimize"
    # Named after the run and model, not at random: Hyperband puts each trial in a bracket by
    # a checksum of the study's name and the trial's number ("Please specify study_name to
    # make the pruning algorithm reproducible": optuna's HyperbandPruner), so a seeded search,
    # and a resumed one, keeps its brackets.
    study = optuna.create_study(
        direction=direction,
        sampler=sampler,
        pruner=pruner,
        study_name=f"{run.experiment}-{run.label}-{model_name}",
    )
    spaces = distributions(job.ranges)
    started = time.time()
    remaining = n_trials - reseed(study, spaces, trials)

    def say(text: str) -> None:
        backend.say(job.name, text)

    how = f"{job.strategy} ({type(sampler).__name__}, {type(pruner).__name__})"
    resumed = f"; {n_trials - remaining} done before this run was resumed" if trials.records else ""
    say(
        f"tuning {model_name}: {how}, {n_trials} trials, {job.max_parallel_jobs} at once, "
        f"{direction} {job.objective_metric}{resumed}"
    )
    objective = trial_objective(backend, job, run, trials, spaces, say)
    if remaining > 0:
        optimize(study, objective, remaining, job.max_parallel_jobs, backend, trials)
    return finish(store, run, job, model_name, trials.records, started, sampler, pruner)


class Trials:
    """The study's record: trials.json and trials.csv rewritten whenever a trial starts or
    ends, so a resumed run knows which finished and which to continue."""

    def __init__(self, store: Store, run: RunTree, model_name: str) -> None:
        self.store, self.run, self.model_name = store, run, model_name
        self.records = {t["number"]: t for t in earlier_trials(store, run, model_name)}
        self.lock = threading.Lock()
        self.stopping = threading.Event()  # the driver is stopping: trials end as Interrupted
        self.last_number = max(self.records, default=0)

    def record(self, record: dict) -> None:
        with self.lock:
            self.records[record["number"]] = record
            save_trials(self.store, self.run, self.model_name, self.records)

    def next_number(self) -> int:
        with self.lock:
            self.last_number += 1
            return self.last_number


def reseed(study, spaces: dict, trials: Trials) -> int:
    """A resumed run: the finished trials become the study's first trials again (the samplers
    and pruners learn from them, Grid does not repeat them); an unfinished one is run again
    under its number with its values, so it continues from its checkpoint. Returns how many
    had finished."""
    import optuna

    states = {
        "Completed": optuna.trial.TrialState.COMPLETE,
        "Stopped": optuna.trial.TrialState.PRUNED,
        "Failed": optuna.trial.TrialState.FAIL,
    }
    finished = 0
    for number, record in sorted(trials.records.items()):
        params = {k: drawn_value(spaces[k], v) for k, v in record["hyperparameters"].items()}
        if record["status"] in states:
            finished += 1
            completed = record["status"] == "Completed"
            earlier = optuna.trial.create_trial(
                params=params,
                distributions=spaces,
                state=states[record["status"]],
                value=record["objective"] if completed else None,
                intermediate_values={int(k): v for k, v in record.get("epochs", {}).items()},
            )
            study.add_trial(earlier)
        else:  # Running or Interrupted when the driver stopped
            study.enqueue_trial(params, user_attrs={"number": number})
    return finished


def optimize(
    study, objective, n_trials: int, parallel: int, backend: TrialRunner, trials: Trials
) -> None:
    """`study.optimize` in a thread of its own, so that a Ctrl-C reaches the driver at once:
    optuna's thread pool would otherwise wait for every running trial to end. On one, the
    running trials are stopped (they checkpoint), recorded as interrupted, and no new one
    starts; the interrupt then goes on up."""
    done, failure = threading.Event(), []

    def run() -> None:
        try:
            study.optimize(
                objective,
                n_trials=n_trials,
                n_jobs=parallel,
                catch=(TrialFailed, TrialInterrupted),
            )
        except BaseException as e:  # noqa: BLE001 -- handed to the driver's thread below
            failure.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="tuning", daemon=True).start()
    try:
        done.wait()  # an Event, not Thread.join: see run_hosts in player/processes.py
    except BaseException:
        trials.stopping.set()  # the trials see it and stop the study: no new one starts
        backend.stop()
        done.wait()
        raise
    if failure:
        raise failure[0]


def trial_objective(
    backend: TrialRunner, job: TuningJob, run: RunTree, trials: Trials, spaces: dict, say
):
    """What one trial does: a training job with the sampled values, its objective read live
    from its log and reported to the pruner, its outcome recorded. A pruned trial gets SIGTERM
    (it checkpoints and exits) and is not restarted; a failed one is recorded with its reason
    and the search goes on. A trial writes no exports and draws no curves; its checkpoints are
    removed when it ends, however it ends, unless the driver's stop interrupted it."""
    import optuna

    objective_regex = re.compile(job.trial.metric_definitions[job.objective_metric])

    def objective(trial) -> float:
        if trials.stopping.is_set():
            trial.study.stop()
            raise TrialInterrupted("the driver is stopping")
        values = {name: value_of(suggest(trial, name, space)) for name, space in spaces.items()}
        number = trial.user_attrs.get("number") or trials.next_number()
        trial_job = trial_training_job(job, run, number, values)
        record = started_record(number, trial_job, values)
        trials.record(record)
        verdict: dict[str, str] = {}
        watch = pruning(
            trial, record, objective_regex, job.objective_metric, verdict, last_epoch(trial_job)
        )
        result = backend.run_training(trial_job, watch=watch)
        status, objective = outcome(result, verdict, trials.stopping.is_set(), record, job)
        record.update(
            status=status,
            seconds=result.seconds,
            objective=objective,
            stop_reason=verdict.get("stopped") or result.failure_reason,
        )
        trials.record(record)
        if status == "Interrupted":
            trial.study.stop()
            raise TrialInterrupted(f"trial {number} interrupted")
        # A trial that ended is never resumed (a resumed study tells the sampler its record):
        # its checkpoints, weights with optimizer state, go now.
        for key in trials.store.list_keys(trial_job.checkpoint_prefix):
            trials.store.delete(key)
        if status == "Stopped":
            say(f"trial {number} stopped: {record['stop_reason']}")
            raise optuna.TrialPruned(record["stop_reason"])
        if status != "Completed" or record["objective"] is None:
            say(f"trial {number} failed: {record['stop_reason'] or 'no objective in its log'}")
            raise TrialFailed(record["stop_reason"] or f"no {job.objective_metric} in its log")
        say(f"trial {number}: {job.objective_metric}={record['objective']:.4f} {values}")
        return record["objective"]

    return objective


def outcome(result, verdict: dict, stopping: bool, record: dict, job: TuningJob):
    """A trial's status and objective, as SageMaker reports a tuning job's trials."""
    status = "Stopped" if verdict else result.status
    if stopping and status != "Completed":
        status = "Interrupted"  # continued from its checkpoint when the run is resumed
    elif status not in ("Completed", "Stopped"):
        status = "Failed"
    objective = None
    if status == "Completed":
        objective = result.metrics.get(job.objective_metric)
    elif status == "Stopped":
        # As SageMaker reports a trial its tuning job stopped early: TrainingJobStatus
        # Stopped, with FinalHyperParameterTuningJobObjectiveMetric "the latest objective
        # metric emitted by a training job that was launched by a hyperparameter tuning
        # job" (botocore's sagemaker service-2.json; API_HyperParameterTrainingJobSummary;
        # API_FinalHyperParameterTuningJobObjectiveMetric.html); an ObjectiveStatus of
        # Failed "typically occurs when the training job failed or did not emit an
        # objective metric" (ObjectiveStatus, ibid.). It is still not the best trial: that
        # is the one "that completed with the best current" objective
        # (DescribeHyperParameterTuningJob's BestTrainingJob), and a stopped trial saved no
        # model.
        objective = last_reported(record)
    return status, objective


def started_record(number: int, trial_job: TrainingJob, values: dict) -> dict:
    """A trial's record as it starts (trials.json): filled in when it ends."""
    return {
        "number": number,
        "job_name": trial_job.name,
        "status": "Running",
        "hyperparameters": values,
        "objective": None,
        "epochs": {},
        "seconds": None,
        "stop_reason": None,
        "model": trial_job.model_prefix,
        "output": trial_job.output_prefix,
    }


def last_epoch(trial_job: TrainingJob):
    """Whether a trial's metric line (its epoch, the optimizer steps by then) is its last: the
    epoch is its EPOCHS, or MAX_STEPS is reached, as steps/train.py ends its loop (the
    hyperparameters read as train.py reads them; a name the table does not know is the
    training program's own business, refused by the job if at all)."""
    known = {k: v for k, v in trial_job.hyperparameters.items() if k in HYPERPARAMETERS}
    hp = parse_hyperparameters(known)
    epochs, max_steps = hp["epochs"], hp["max_steps"]
    return lambda epoch, steps: epoch >= epochs or bool(max_steps and steps >= max_steps)


def last_reported(record: dict) -> float | None:
    """The objective of a trial's latest epoch (its epochs are numbers, or strings once read
    back from trials.json)."""
    epochs = record["epochs"]
    return epochs[max(epochs, key=int)] if epochs else None


def pruning(
    trial, record: dict, objective_regex, metric: str, verdict: dict, is_last=None
) -> Watch:
    """What watches a trial's log: each epoch's objective recorded and reported to the pruner;
    True (stop the trial) when the pruner says so, with why in `verdict`. The pruner is not
    asked after the last epoch (`is_last(epoch, steps)`): the trial saves its model next, and
    stopping it then would lose that model for nothing. Nothing is reported after a verdict:
    the trial is stopping."""

    def watch(line: str) -> bool:
        epoch, found = EPOCH.match(line), objective_regex.search(line)
        if verdict or not (epoch and found):
            return False
        step, value = int(epoch.group(1)), float(found.group(1))
        record["epochs"][step] = value
        trial.report(value, step)
        if is_last is not None and is_last(step, int(epoch.group(2))):
            return False
        if trial.should_prune():
            verdict["stopped"] = f"early stopping: {metric}={value:.4f} at epoch {step}"
            return True
        return False

    return watch


def trial_training_job(job: TuningJob, run: RunTree, number: int, values: dict) -> TrainingJob:
    """Trial `number`: the tuning job's training job with the sampled values, its model,
    output and checkpoints in folders of its own."""
    model_name = job.trial.hyperparameters["model_name"]
    return dataclasses.replace(
        job.trial,
        env={**job.trial.env, **cores_of_a_trial(min(job.max_parallel_jobs, job.max_jobs))},
        name=job_name(run.experiment, run.label, "tune", model_name, f"{number:03d}"),
        # As SageMaker's tuner sends every trial its objective (automatic-model-tuning-define-
        # ranges.html): the trial's hyperparameters are those of a trial on SageMaker.
        hyperparameters={
            **job.trial.hyperparameters,
            **values,
            TUNING_OBJECTIVE: job.objective_metric,
        },
        model_prefix=run.trial_model(model_name, number),
        output_prefix=run.trial_output(model_name, number),
        checkpoint_prefix=run.local_trial_checkpoints(model_name, number),
        processes_per_host=1,  # a tuning job's parallelism is across trials
        instance_count=1,
        max_restarts=0,
    )


# The variables OpenMP and MKL size their thread pools by, read once, when torch loads
# (https://pytorch.org/docs/stable/notes/cpu_threading_torchscript_inference.html: "OMP_NUM_THREADS
# and MKL_NUM_THREADS"; setting them after `import torch` changes nothing).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def cores_of_a_trial(parallel: int) -> dict[str, str]:
    """On SageMaker each trial has instances of its own; here `parallel` trials share this
    machine, and each would start as many threads as it has cores: trials whose threads
    outnumber the cores contend for them, and each step slows (docs/performance.md has the
    measurement), so each gets its share of the cores, unless the user has set the variables
    themselves."""
    if parallel <= 1 or any(name in os.environ for name in THREAD_VARIABLES):
        return {}
    share = str(max(1, (os.cpu_count() or 1) // parallel))
    return dict.fromkeys(THREAD_VARIABLES, share)


def earlier_trials(store: Store, run: RunTree, model_name: str) -> list[dict]:
    try:
        record = json.loads(store.get_bytes(run.trials(model_name, "json")))
    except NotFound:
        return []
    return record["trials"]


def save_trials(store: Store, run: RunTree, model_name: str, records: dict[int, dict]) -> None:
    """The study's journal, trials.json (each trial with its model and output, for `finish`
    and --resume), and trials.csv, the record's table of the trials so far."""
    trials = [records[n] for n in sorted(records)]
    store.put_bytes(
        run.trials(model_name, "json"), json.dumps({"trials": trials}, indent=2).encode()
    )
    shown = [{name: t.get(name) for name in tuning_record.TRIAL_FIELDS} for t in trials]
    tuning_record.write_table(store, run, model_name, shown)


def finish(store, run, job, model_name, records, started, sampler, pruner) -> JobResult:
    """The best trial promoted, the others' model files deleted; the study's tuning record
    the result's details."""
    journal = [records[n] for n in sorted(records)]
    details = tuning_record.from_study(job, journal, type(sampler).__name__, type(pruner).__name__)
    if details["best"] is None:
        reasons = "; ".join(
            f"trial {t['number']} {t['status'].lower()}: {t['stop_reason']}" for t in journal
        )
        why = f"no trial of {len(journal)} completed with {job.objective_metric}: {reasons}"
        return JobResult(
            name=job.name,
            status="Failed",
            failure_reason=why,
            start_time=started,
            end_time=time.time(),
            details=details,
        )
    best = records[details["best"]["number"]]
    # Run again when a resumed run finds the study done but not recorded: what was copied
    # stays, and nothing is copied onto itself.
    for source, destination in (
        (best["model"], job.trial.model_prefix),
        (best["output"], job.trial.output_prefix),
    ):
        if not is_complete(store, destination):
            copy_dir(store, source, destination, best["job_name"])
    for t in journal:  # the best trial's model is kept once, at the tuning job's model
        if t["model"] and t["model"] != job.trial.model_prefix:  # place; every record stays
            for key in store.list_keys(t["model"]):
                store.delete(key)
        t["model"] = job.trial.model_prefix if t is best else None
    save_trials(store, run, model_name, records)
    return JobResult(
        name=job.name,
        status="Completed",
        failure_reason=None,
        start_time=started,
        end_time=time.time(),
        details=details,
    )


def copy_dir(store: Store, source: str, destination: str, job: str) -> None:
    with tempfile.TemporaryDirectory(prefix="smpipe-copy-") as tmp:
        download_dir(store, source, Path(tmp))
        upload_dir(store, tmp, destination, {"job_name": job})
