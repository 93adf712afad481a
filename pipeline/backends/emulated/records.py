"""The emulated account's SageMaker jobs as SageMaker describes them: moto keeps each job as it
was created and moves none; here each is moved as SageMaker moves it (InProgress when it
starts; its end, FailureReason and ExitMessage; a training job's secondary statuses, final
metrics, billing and warm pool; a tuning job's counters and best trial), beside the request it
came from and whether a Stop* call asked it to stop.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime

from pipeline.player.warm_pools import WarmPools
from pipeline.service_model import shape

# A tuning job's TrainingJobStatusCounters (API_TrainingJobStatusCounters.html), all 0 at start.
COUNTERS = ("Completed", "InProgress", "RetryableError", "NonRetryableError", "Stopped")


def now() -> datetime:
    return datetime.now(UTC)


def bill(job) -> None:
    """DescribeTrainingJob's billing fields, as AWS documents them (botocore's sagemaker
    service-2.json): a job is billed "for the time interval between" TrainingStartTime and
    TrainingEndTime, "after model artifacts are uploaded" for one that completed or stopped;
    BillableTimeInSeconds is "the absolute wall-clock time", per instance; both it and
    TrainingTimeInSeconds are whole seconds of at least 1 (their shapes' min). How AWS rounds is
    not documented: to the nearest second here. A spot job bills less than it trained, by a
    spot price only AWS knows: not played, its billable time is the time it trained (0%
    savings by the documented formula)."""
    seconds = (job.training_end_time - job.training_start_time).total_seconds()
    job.training_time_in_seconds = job.billable_time_in_seconds = max(1, round(seconds))


class JobRecords:
    """Every job the account accepted: its request (`requests`, by name) and moto's record of
    it (`jobs`: moto's SageMaker backend of the region), moved as SageMaker moves it."""

    def __init__(self, jobs) -> None:
        self.jobs = jobs
        self.requests: dict[str, dict] = {}  # every request moto accepted, by job name
        self.pools = WarmPools(jobs.training_jobs)
        self._trials: set[str] = set()  # a tuning job's trials keep no pools of theirs
        self._stopping: set[str] = set()  # jobs a Stop* call asked to stop
        # Every job's status and a tuning job's counters, moved by the jobs' and trials' threads.
        self._lock = threading.Lock()

    def trial(self, name: str) -> None:
        """The training job `name` is to be a tuning job's trial."""
        self._trials.add(name)

    def stop_asked(self, *names: str) -> None:
        """A Stop* call for `names`: each one still in progress is Stopping from now on, as
        "When it receives a StopTrainingJob request, SageMaker changes the status of the job
        to Stopping" (StopTrainingJob in botocore's sagemaker service-2.json; Stopping is in
        ProcessingJobStatus and HyperParameterTuningJobStatus too)."""
        with self._lock:
            self._stopping.update(names)
            for name in names:
                if name in self.jobs.training_jobs:
                    job = self.jobs.training_jobs[name]
                    if job.training_job_status == "InProgress":
                        job.training_job_status = job.secondary_status = "Stopping"
                elif name in self.jobs.processing_jobs:
                    job = self.jobs.processing_jobs[name]
                    if job.processing_job_status == "InProgress":
                        job.processing_job_status = "Stopping"
                elif name in self.jobs.hyper_parameter_tuning_jobs:
                    job = self.jobs.hyper_parameter_tuning_jobs[name]
                    if job.hyper_parameter_tuning_job_status == "InProgress":
                        job.hyper_parameter_tuning_job_status = "Stopping"

    def stop_requested(self, name: str) -> bool:
        return name in self._stopping

    def training(self, name: str):
        """moto's record of the training job `name`."""
        return self.jobs.training_jobs[name]

    def arn(self, name: str) -> str:
        return {**self.jobs.processing_jobs, **self.jobs.training_jobs}[name].arn

    def spot_running(self, prefix: str) -> list[str]:
        """The spot training jobs in progress whose names start with `prefix`."""
        return [
            name
            for name, request in self.requests.items()
            if name.startswith(prefix)
            and request.get("EnableManagedSpotTraining")
            and name in self.jobs.training_jobs
            and self.jobs.training_jobs[name].training_job_status == "InProgress"
        ]

    # -- a job starts ----------------------------------------------------------------------------

    def accepted(self, name: str, kind: str, request: dict) -> None:
        """SageMaker accepted `request` for the job `name` of `kind`: it is InProgress (and
        only then in `requests`: moto's new record reads Completed until it is moved)."""
        if kind == "processing":
            job = self.jobs.processing_jobs[name]
            job.processing_job_status = "InProgress"
            job.processing_start_time = now()
            # What moto does not keep of the request, SageMaker returns.
            job.environment = request.get("Environment", {})
            job.processing_resources = request["ProcessingResources"]
        elif kind == "training":
            self._training_started(name, request)
        else:
            job = self.jobs.hyper_parameter_tuning_jobs[name]
            job.hyper_parameter_tuning_job_status = "InProgress"
            job.best_training_job = job.OverallBestTrainingJob = None
            job.training_job_status_counters = dict.fromkeys(COUNTERS, 0)
        self.requests[name] = request

    def _training_started(self, name: str, request: dict) -> None:
        job = self.jobs.training_jobs[name]
        job.training_job_status, job.secondary_status = "InProgress", "Starting"
        # "the time when the training job starts on training instances" (TrainingStartTime,
        # botocore's sagemaker service-2.json): here none are provisioned, so the job starts
        # on them at once; downloading its input is billed (model-train-storage.html).
        job.training_start_time = now()
        job.algorithm_specification = request["AlgorithmSpecification"]
        job.environment = request.get("Environment", {})
        job.final_metric_data_list = []
        if name not in self._trials:
            self.pools.start(name, request)

    # -- while it runs ---------------------------------------------------------------------------

    def secondary(self, name: str, status: str) -> None:
        """A training job's SecondaryStatus: Training, Interrupted, Uploading; Stopping, once
        asked to stop, until it has stopped."""
        with self._lock:  # never over a Stopping that `stop_asked` is writing
            job = self.jobs.training_jobs[name]
            if job.training_job_status != "Stopping":
                job.secondary_status = status

    def final_metrics(self, name: str, metrics: dict[str, float]) -> None:
        """A training job's FinalMetricDataList, each metric's last value."""
        self.jobs.training_jobs[name].final_metric_data_list = [
            {"MetricName": k, "Value": v, "Timestamp": now()} for k, v in metrics.items()
        ]

    def metrics_of(self, name: str) -> dict[str, float]:
        """A training job's final metrics, as its FinalMetricDataList holds them."""
        listed = getattr(self.jobs.training_jobs[name], "final_metric_data_list", None) or []
        return {m["MetricName"]: m["Value"] for m in listed}

    def trial_started(self, tuning: str) -> None:
        with self._lock:
            self.jobs.hyper_parameter_tuning_jobs[tuning].training_job_status_counters[
                "InProgress"
            ] += 1

    def trial_ended(self, tuning: str, status: str) -> None:
        """A trial's end counted as TrainingJobStatusCounters counts it."""
        counted = status if status in ("Completed", "Stopped") else "NonRetryableError"
        with self._lock:
            counters = self.jobs.hyper_parameter_tuning_jobs[tuning].training_job_status_counters
            counters["InProgress"] -= 1
            counters[counted] += 1

    # -- its end ---------------------------------------------------------------------------------

    def ended(self, name: str, status: str, reason: str | None = None, exit_message=None) -> None:
        """The job `name` ended `status`, with FailureReason `reason` and, for processing,
        `exit_message` as its ExitMessage (a tuning job's best trial is set before: `best`)."""
        # FailureReason and ExitMessage are at most 1,024 characters (their shapes' max in
        # botocore's sagemaker service-2.json): SageMaker returns the first 1,024.
        if reason:
            reason = reason[: shape("FailureReason").metadata["max"]]
        if name in self.jobs.training_jobs and name not in self._trials:
            self.pools.end(name, self.requests[name])  # its pool is there when its end is seen
        # Under the lock: a Stop* call (`stop_asked`) between reading InProgress and writing
        # Stopping would leave an ended job Stopping for good. Its reason before its status:
        # whoever sees it ended sees why.
        with self._lock:
            if name in self.jobs.processing_jobs:
                job = self.jobs.processing_jobs[name]
                if reason:
                    job.failure_reason = reason
                if exit_message:
                    job.exit_message = exit_message[: shape("ExitMessage").metadata["max"]]
                job.processing_end_time = now()
                job.processing_job_status = status
            elif name in self.jobs.training_jobs:
                job = self.jobs.training_jobs[name]
                if reason:
                    job.failure_reason = reason
                job.training_end_time = now()
                bill(job)  # before its status: whoever sees it ended sees what it billed
                # Stopped's secondary statuses say why: MaxRuntimeExceeded, MaxWaitTimeExceeded
                # or Stopped (SecondaryStatus in the service model); the reason names it.
                limits = ("MaxRuntimeExceeded", "MaxWaitTimeExceeded")
                said = (reason or "").split(":", 1)[0] if status == "Stopped" else ""
                job.secondary_status = said if said in limits else status
                job.training_job_status = status
            else:
                job = self.jobs.hyper_parameter_tuning_jobs[name]
                if reason:
                    job.failure_reason = reason
                job.hyper_parameter_tuning_end_time = now()
                job.hyper_parameter_tuning_job_status = status

    def best(self, tuning: str, summary: dict, overall: dict | None) -> None:
        """A tuning job's BestTrainingJob, and its OverallBestTrainingJob (None: not
        warm-started)."""
        job = self.jobs.hyper_parameter_tuning_jobs[tuning]
        job.best_training_job, job.OverallBestTrainingJob = summary, overall
