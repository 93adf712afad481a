"""The tuning record: what a tuning job did, in one shape whichever backend ran it.

Built from a local study (`from_study`: pipeline/backends/local_tuning.py) or from what
SageMaker says of a tuning job (`from_tuning_job`: the SageMaker and emulated backends). The
tune stage saves it (`save`) at tuning/<model>/tuning.json, with trials.csv and trials.png drawn
from it; the run's report reads nothing else of the study. Its fields are RECORD_FIELDS and
TRIAL_FIELDS below, explained in docs/outputs.md (The tuning record).
"""

from __future__ import annotations

import csv
import io
import json
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.jobs import TuningJob
    from pipeline.paths import RunTree
    from pipeline.store import Store

RECORD_FIELDS = (
    "tuning_job",
    "strategy",
    "sampler",  # sampler, pruner: what played it here (Optuna's classes); None on SageMaker
    "pruner",
    "early_stopping",
    "objective_metric",
    "objective_type",
    "trials",  # a trial per training job the tuning job launched, in creation order
    "best",  # the trial promoted (one of `trials`), None when none completed
    "counters",  # {status: how many trials ended so}
)
TRIAL_FIELDS = (
    "number",
    "job_name",
    "status",  # Completed | Stopped | Failed; Interrupted: a local trial --resume continues
    "hyperparameters",  # the searched values, as the trial was sent them (strings)
    "objective",  # its final objective: the latest one it emitted (None: none)
    "epochs",  # {epoch: objective} as the trial reported them ({} where unknown)
    "seconds",  # how long it trained (None: unknown)
    "stop_reason",  # why it stopped or failed (None: it completed)
)


def _record(job: TuningJob, trials: list[dict], best: dict | None, **played_by) -> dict:
    return {
        "tuning_job": job.name,
        "strategy": job.strategy,
        "sampler": played_by.get("sampler"),
        "pruner": played_by.get("pruner"),
        "early_stopping": job.early_stopping,
        "objective_metric": job.objective_metric,
        "objective_type": job.objective_type,
        "trials": trials,
        "best": best,
        "counters": dict(sorted(Counter(t["status"] for t in trials).items())),
    }


def from_study(job: TuningJob, journal: list[dict], sampler: str, pruner: str) -> dict:
    """A local study's record, from its trials as it keeps them (`journal`, in order). The
    best is the completed trial with the best objective, as SageMaker's BestTrainingJob is
    the one "that completed with the best current" objective
    (DescribeHyperParameterTuningJob, botocore's sagemaker service-2.json)."""
    trials = [{name: entry.get(name) for name in TRIAL_FIELDS} for entry in journal]
    sign = 1 if job.objective_type == "Maximize" else -1
    scored = [t for t in trials if t["status"] == "Completed" and t["objective"] is not None]
    best = max(scored, key=lambda t: sign * t["objective"]) if scored else None
    return _record(job, trials, best, sampler=sampler, pruner=pruner)


def from_tuning_job(job: TuningJob, described: dict, summaries: list[dict]) -> dict:
    """A SageMaker tuning job's record: its trials from ListTrainingJobsForHyperParameterTuningJob
    (a HyperParameterTrainingJobSummary each), numbered in the order they were created, and
    the best from DescribeHyperParameterTuningJob's (`best_of`: the same shape).
    `described` is {} when SageMaker refused the job."""
    trials = [summary_trial(s, n) for n, s in enumerate(in_creation_order(summaries), 1)]
    named = best_of(described).get("TrainingJobName")
    best = next((t for t in trials if t["job_name"] == named), None)
    return _record(job, trials, best)


def best_of(described: dict) -> dict:
    """A DescribeHyperParameterTuningJob answer's best trial: OverallBestTrainingJob where it
    is warm-started with WarmStartType IdenticalDataAndAlgorithm ("the best objective metric
    value of all training jobs launched by this tuning job and all parent jobs", botocore's
    sagemaker service-2.json), else BestTrainingJob; {} when it has none."""
    warm = (described.get("WarmStartConfig") or {}).get("WarmStartType")
    overall = (
        described.get("OverallBestTrainingJob") if warm == "IdenticalDataAndAlgorithm" else None
    )
    return overall or described.get("BestTrainingJob") or {}


def best_answer(answers: list[dict], objective_type: str) -> dict | None:
    """Of DescribeHyperParameterTuningJob answers, the one whose best trial (`best_of`) has
    the best final objective; None when none has a best trial with one."""
    sign = 1 if objective_type == "Maximize" else -1

    def objective(answer: dict) -> float | None:
        metric = best_of(answer).get("FinalHyperParameterTuningJobObjectiveMetric") or {}
        return metric.get("Value")

    scored = [a for a in answers if objective(a) is not None]
    return max(scored, key=lambda a: sign * objective(a)) if scored else None


def in_creation_order(summaries: list[dict]) -> list[dict]:
    """Trials' summaries as they were created (CreationTime, then the name: SageMaker names
    trials <tuning job>-NNN-<8 hex>); ListTrainingJobsForHyperParameterTuningJob sorts by
    Name unless asked otherwise (its SortBy)."""
    return sorted(summaries, key=lambda s: (str(s.get("CreationTime")), s["TrainingJobName"]))


def summary_trial(summary: dict, number: int) -> dict:
    """One trial from its HyperParameterTrainingJobSummary (botocore's sagemaker
    service-2.json): TrainingJobName, TrainingJobStatus and TunedHyperParameters always;
    FinalHyperParameterTuningJobObjectiveMetric ("the latest objective metric emitted by a
    training job", so a stopped trial keeps one), TrainingStartTime, TrainingEndTime and
    FailureReason when there are such. An ObjectiveStatus of Failed "typically occurs when
    the training job failed or did not emit an objective metric"."""
    metric = summary.get("FinalHyperParameterTuningJobObjectiveMetric") or {}
    start, end = summary.get("TrainingStartTime"), summary.get("TrainingEndTime")
    seconds = round((end - start).total_seconds(), 1) if start and end else None
    reason = summary.get("FailureReason")
    if not reason and summary.get("ObjectiveStatus") == "Failed":
        reason = "no objective metric was evaluated (ObjectiveStatus Failed)"
    return {
        "number": number,
        "job_name": summary["TrainingJobName"],
        "status": summary["TrainingJobStatus"],
        "hyperparameters": dict(summary.get("TunedHyperParameters") or {}),
        "objective": metric.get("Value"),
        "epochs": {},  # the summary keeps the final objective only
        "seconds": seconds,
        "stop_reason": reason,
    }


def save(store: Store, run: RunTree, model_name: str, record: dict) -> None:
    """The record, its table and its chart, in the run tree."""
    store.put_bytes(run.tuning_record(model_name), json.dumps(record, indent=2).encode())
    write_table(store, run, model_name, record["trials"])
    png = chart(record, f"tuning {model_name}")
    if png is not None:
        store.put_bytes(run.trials(model_name, "png"), png)


def write_table(store: Store, run: RunTree, model_name: str, trials: list[dict]) -> None:
    """trials.csv: a row per trial, a column per searched hyperparameter. The local tuner
    also writes it whenever a trial starts or ends."""
    names = sorted({k for t in trials for k in t["hyperparameters"]})
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(
        ["trial", "job_name", "status", "objective", *names, "epochs_run", "seconds", "stop_reason"]
    )
    for t in trials:
        searched = [t["hyperparameters"].get(n) for n in names]
        writer.writerow(
            [t["number"], t["job_name"], t["status"], t["objective"], *searched]
            + [len(t["epochs"] or {}), t["seconds"], t["stop_reason"] or ""]
        )
    store.put_bytes(run.trials(model_name, "csv"), out.getvalue().encode())


def chart(record: dict, title: str) -> bytes | None:
    """A PNG of the objective by trial with the best so far, and, where the trials reported
    their epochs, each trial's objective by epoch (stopped trials end early); None when no
    trial has an objective."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trials = record.get("trials") or []
    if not any(t.get("objective") is not None for t in trials):
        return None
    by_epoch = any(t.get("epochs") for t in trials)
    fig, axes = plt.subplots(1, 2 if by_epoch else 1, figsize=(11 if by_epoch else 6, 4))
    axes = list(axes) if by_epoch else [axes]
    sign = 1 if record.get("objective_type") == "Maximize" else -1
    _objective_by_trial(axes[0], trials, record.get("objective_metric"), sign)
    if by_epoch:
        _objective_by_epoch(axes[1], trials, record.get("objective_metric"))
    from matplotlib.ticker import MaxNLocator

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    return out.getvalue()


def _objective_by_trial(ax, trials: list[dict], metric: str | None, sign: int) -> None:
    scored = [t for t in trials if t.get("objective") is not None]
    for status, marker, color in (("Completed", "o", "C0"), ("Stopped", "x", "C3")):
        shown = [t for t in scored if t["status"] == status]
        if shown:
            x, y = [t["number"] for t in shown], [t["objective"] for t in shown]
            ax.scatter(x, y, marker=marker, color=color, label=f"trial ({status.lower()})")
    # The best so far among the completed trials, the ones that can be promoted.
    done = [t for t in scored if t["status"] == "Completed"]
    best, line = None, []
    for t in done:
        best = t["objective"] if best is None or sign * t["objective"] > sign * best else best
        line.append(best)
    ax.step([t["number"] for t in done], line, where="post", color="C1", label="best so far")
    ax.set(xlabel="trial", ylabel=metric, title="objective by trial")
    ax.legend()


def _objective_by_epoch(ax, trials: list[dict], metric: str | None) -> None:
    for t in trials:
        epochs = sorted((int(k), v) for k, v in (t.get("epochs") or {}).items())
        if epochs:
            style = "--" if t["status"] == "Stopped" else "-"
            label = f"{t['number']} ({t['status'].lower()})"
            ax.plot([e for e, _ in epochs], [v for _, v in epochs], style, marker="o", label=label)
    ax.set(xlabel="epoch", ylabel=metric, title="each trial, by epoch")
    ax.legend(fontsize=7)
