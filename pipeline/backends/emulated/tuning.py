"""SageMaker's tuning service, as the emulated account plays it: a tuning job's trials drawn from
the request's ParameterRanges (every combination for Grid, at random otherwise: SageMaker's own
search is not played), each created as a training job with SageMaker's
`_tuning_objective_metric`, read for its objective with the request's metric regexes, listed as
ListTrainingJobsForHyperParameterTuningJob lists them, and the best one reported. What the
emulator checks is that the request is whole and that each trial runs and reports its
objective.

A trial is created and waited for through the control plane that holds this service (`train`,
a callback): the service asks nothing else of it.
"""

from __future__ import annotations

import itertools
import math
import random
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pipeline.backends.emulated.records import JobRecords
from pipeline.backends.following import TERMINAL
from pipeline.search_space import Categorical, from_parameter_ranges
from pipeline.service_model import TUNING_OBJECTIVE

# What a tuning job's TrainingJobDefinition holds that a CreateTrainingJob request has no place
# for (botocore's sagemaker service-2.json: HyperParameterTrainingJobDefinition's members less
# CreateTrainingJobRequest's); each trial is created with the rest.
TUNING_ONLY = (
    "DefinitionName",
    "HyperParameterRanges",
    "HyperParameterTuningResourceConfig",
    "StaticHyperParameters",
    "TuningObjective",
)


def candidates(config: dict, static: dict) -> list[dict[str, str]]:
    """The trials' values: every combination for Grid, else MaxNumberOfTrainingJobs draws
    seeded by the static `seed` (SageMaker's own search is not played)."""
    ranges = from_parameter_ranges(config["ParameterRanges"])
    if config["Strategy"] == "Grid":
        return grid(ranges)
    rng = random.Random(int(static.get("seed", 0)))
    return [sample(ranges, rng) for _ in range(config["ResourceLimits"]["MaxNumberOfTrainingJobs"])]


def sample(tunables: dict, rng) -> dict[str, str]:
    values = {}
    for name, t in sorted(tunables.items()):
        if isinstance(t, Categorical):
            values[name] = rng.choice(t.options)
            continue
        if t.log:
            x = math.exp(rng.uniform(math.log(t.low), math.log(t.high)))
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


def objective_metric(request: dict) -> dict:
    """A tuning request's HyperParameterTuningJobObjective: its Type and MetricName."""
    return request["HyperParameterTuningJobConfig"]["HyperParameterTuningJobObjective"]


class TuningService:
    """The account's tuning jobs, each played from its request in `records`. `train(request)`
    creates the training job a CreateTrainingJob `request` describes, waits for it to end, and
    returns its TrainingJobStatus."""

    def __init__(self, records: JobRecords, train: Callable[[dict], str]) -> None:
        self.records, self._train = records, train
        self.trials: dict[str, list[str]] = {}  # tuning job -> its training jobs, in order

    def play(self, name: str) -> None:
        """The tuning job `name`, from its first trial to its end."""
        request = self.records.requests[name]
        config = request["HyperParameterTuningJobConfig"]
        static = request["TrainingJobDefinition"].get("StaticHyperParameters", {})
        self.trials[name] = []
        drawn = enumerate(candidates(config, static), 1)
        parallel = config["ResourceLimits"]["MaxParallelTrainingJobs"]
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            trials = list(pool.map(lambda one: self._trial(name, request, *one), drawn))
        # BestTrainingJob: "the training job that completed with the best current
        # HyperParameterTuningJobObjective" (botocore's sagemaker service-2.json), so a
        # stopped tuning job reports one too.
        best = self._best(name, trials, objective_metric(request))
        if best is not None:
            self.records.best(name, best, self._overall(request, best))
        if self.records.stop_requested(name):
            self.records.ended(name, "Stopped")
            return
        if best is None:
            self.records.ended(name, "Failed", "No training job succeeded with an objective metric")
            return
        self.records.ended(name, "Completed")

    def _overall(self, request: dict, best: dict) -> dict | None:
        """OverallBestTrainingJob, for a tuning job warm-started with WarmStartType
        IdenticalDataAndAlgorithm only: "the best objective metric value of all training jobs
        launched by this tuning job and all parent jobs", its own best "compared to the best
        training jobs from the parent tuning jobs" (OverallBestTrainingJob and
        HyperParameterTuningJobWarmStartConfig, botocore's sagemaker service-2.json)."""
        warm = request.get("WarmStartConfig") or {}
        if warm.get("WarmStartType") != "IdenticalDataAndAlgorithm":
            return None
        tuning_jobs = self.records.jobs.hyper_parameter_tuning_jobs
        parents = [p["HyperParameterTuningJobName"] for p in warm["ParentHyperParameterTuningJobs"]]
        bests = [best, *(tuning_jobs[p].best_training_job for p in parents)]
        sign = 1 if objective_metric(request)["Type"] == "Maximize" else -1
        scored = [b for b in bests if b]
        return max(
            scored, key=lambda b: sign * b["FinalHyperParameterTuningJobObjectiveMetric"]["Value"]
        )

    def _trial(self, name: str, request: dict, index: int, values: dict) -> tuple[str, dict]:
        """One trial of the tuning job `name`, created unless the job was stopped, and waited
        for; its name and the values drawn for it."""
        # Trials are named <tuning job>-NNN-<8 hex> (as in the SDK's tests of a real
        # DescribeHyperParameterTuningJob: sagemaker-python-sdk tests/unit/
        # tuner_visualize_test_utils.py).
        trial = f"{name}-{index:03d}-{uuid.uuid4().hex[:8]}"
        if self.records.stop_requested(name):
            return trial, values
        definition = request["TrainingJobDefinition"]
        # The definition's one CheckpointConfig goes to every trial as it is (its member of
        # HyperParameterTrainingJobDefinition, botocore's sagemaker service-2.json): whether
        # SageMaker gives each trial that S3Uri or one of its own, the sources are silent.
        fields = {k: v for k, v in definition.items() if k not in TUNING_ONLY}
        # SageMaker adds the objective's name to every trial's hyperparameters, as is, not
        # JSON-quoted (automatic-model-tuning-define-ranges.html; the SDK's fixture of a
        # trial's DescribeTrainingJob: "_tuning_objective_metric": "Validation-accuracy").
        static = definition.get("StaticHyperParameters", {})
        metric = objective_metric(request)["MetricName"]
        hyperparameters = {**static, **values, TUNING_OBJECTIVE: metric}
        self.trials[name].append(trial)
        self.records.trial_started(name)
        status = self._train(
            {"TrainingJobName": trial, "HyperParameters": hyperparameters, **fields}
        )
        self.records.trial_ended(name, status)
        return trial, values

    def _best(self, name: str, trials: list[tuple[str, dict]], objective: dict) -> dict | None:
        """BestTrainingJob, as DescribeHyperParameterTuningJob reports it
        (API_HyperParameterTrainingJobSummary.html), or None when no trial has an objective."""
        sign = 1 if objective["Type"] == "Maximize" else -1
        trained = self.records.jobs.training_jobs
        scored = [
            (self.records.metrics_of(t)[objective["MetricName"]], t, values)
            for t, values in trials
            if t in trained
            and trained[t].training_job_status == "Completed"
            and objective["MetricName"] in self.records.metrics_of(t)
        ]
        if not scored:
            return None
        value, best, values = max(scored, key=lambda s: sign * s[0])
        return {
            "TrainingJobName": best,
            "TrainingJobArn": trained[best].arn,
            "TuningJobName": name,
            "CreationTime": trained[best].creation_time,
            "TrainingJobStatus": "Completed",
            "TunedHyperParameters": values,
            "ObjectiveStatus": "Succeeded",
            "FinalHyperParameterTuningJobObjectiveMetric": {
                "Type": objective["Type"],
                "MetricName": objective["MetricName"],
                "Value": value,
            },
        }

    def summaries(self, name: str) -> list[dict]:
        """ListTrainingJobsForHyperParameterTuningJob's TrainingJobSummaries: one per trial
        created, with the fields the API reference lists
        (API_HyperParameterTrainingJobSummary.html)."""
        request = self.records.requests[name]
        ranges = request["HyperParameterTuningJobConfig"]["ParameterRanges"]
        searched = {r["Name"] for kind in ranges.values() for r in kind}
        created = [t for t in self.trials.get(name, []) if t in self.records.requests]
        return [self._summary(name, t, searched, objective_metric(request)) for t in created]

    def _summary(self, name: str, trial: str, searched: set[str], objective: dict) -> dict:
        job = self.records.training(trial)
        tuned = self.records.requests[trial]["HyperParameters"]
        summary = {
            "TrainingJobName": trial,
            "TrainingJobArn": job.arn,
            "TuningJobName": name,
            "CreationTime": job.creation_time,
            "TrainingJobStatus": job.training_job_status,
            "TunedHyperParameters": {k: v for k, v in tuned.items() if k in searched},
            "TrainingStartTime": job.training_start_time,
        }
        if job.training_job_status in TERMINAL:
            summary["TrainingEndTime"] = job.training_end_time
        if getattr(job, "failure_reason", None):
            summary["FailureReason"] = job.failure_reason
        value = self.records.metrics_of(trial).get(objective["MetricName"])
        if value is not None:
            summary["FinalHyperParameterTuningJobObjectiveMetric"] = {
                "Type": objective["Type"],
                "MetricName": objective["MetricName"],
                "Value": value,
            }
        # "Pending: The training job is in progress and evaluation of its final objective
        # metric is pending" (ObjectiveStatus in botocore's sagemaker service-2.json).
        ended = job.training_job_status in TERMINAL
        summary["ObjectiveStatus"] = (
            "Pending" if not ended else "Succeeded" if value is not None else "Failed"
        )
        return summary
