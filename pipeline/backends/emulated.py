"""BACKEND = emulated: SageMaker without AWS and without Docker.

The SageMaker backend runs unchanged: it checks each request against SageMaker's service
model (pipeline/service_model.py), sends it to an embedded moto server, waits on it, reads
its CloudWatch logs, stops it, adopts its outputs. moto accepts a job and runs nothing; this
module plays SageMaker's part for each job it accepted, by rules taken from AWS's own
documentation and published job output, each cited where it is played (docs/sagemaker.md's table
lists them, and what is not played):

- lays out the job root from the request (its S3 inputs downloaded, the config files
  SageMaker writes) and starts the image's entrypoint in a new container's environment:
  `train` on every host (torchrun across them), or the processing request's
  ContainerEntrypoint and ContainerArguments; in the image with `--image`, else as a process
  of this machine, forked warm as the local backend's jobs are (player/fork_client.py);
- writes what the container prints to CloudWatch Logs, moves the job through SageMaker's
  statuses, uploads what SageMaker uploads (model.tar.gz and output.tar.gz under
  OutputDataConfig, the processing outputs, the checkpoints), and ends the job Completed,
  Failed (with FailureReason and, for processing, ExitMessage) or Stopped;
- refuses a name used before (ResourceInUse), stops a job as the Stop* calls do, restarts a
  spot job only when its instance is taken back (`Emulator.reclaim`);
- keeps a training job's instances as a managed warm pool for the next matching training job
  when its request asks (KeepAlivePeriodInSeconds), with each job's WarmPoolStatus
  (player/warm_pools.py);
- runs a tuning job's trials as training jobs created in moto (sampled from the request's
  ParameterRanges: every combination for Grid, at random otherwise), each with SageMaker's
  `_tuning_objective_metric`, reads their objective with the request's metric regexes,
  lists them as ListTrainingJobsForHyperParameterTuningJob does and reports the best one.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path

from pipeline.backend import EMULATED_IMAGE, EMULATED_ROLE
from pipeline.backends import moto_server
from pipeline.backends.emulated_search import candidates
from pipeline.backends.following import LOG_GROUPS, TERMINAL
from pipeline.backends.sagemaker import SageMakerBackend
from pipeline.code_bundle import PROJECT_ROOT
from pipeline.jobs import KINDS, JobResult, ProcessingJob, TrainingJob, TuningJob
from pipeline.paths import RunTree
from pipeline.player.environment import fresh_container_env
from pipeline.player.exits import status_after
from pipeline.player.fork_client import WARM_FOLDER, WarmStart, warm_start_enabled
from pipeline.player.images import ImageContainers, find_engine, resolve_image
from pipeline.player.job_root import (
    gathered,
    new_work_root,
    processing_outputs,
    remove_orphaned_work_roots,
)
from pipeline.player.play import play_processing, play_training
from pipeline.player.processes import Containers
from pipeline.player.transfers import LogStream, upload_folder, upload_tarball
from pipeline.player.warm_pools import WarmPools
from pipeline.service_model import TUNING_OBJECTIVE, shape
from pipeline.store import Store, aws_config
from steps.runtime.names import MODEL_DIR, OUTPUT_DATA_DIR

EMULATED_BUCKET = "smpipe-emulated"
KIND_CREATED_BY = {api.create: kind for kind, api in KINDS.items()}  # CreateTrainingJob: training
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


def start_moto(region: str) -> str:
    """An embedded moto server on a free local port; this process reaches it (and nothing
    else: fake credentials, its endpoint for every AWS service). Jobs are given its address and
    credentials by the Emulator (`plumbing`), nothing else of this process's environment."""
    _, endpoint = moto_server.serve()
    os.environ.update(
        {
            "AWS_ENDPOINT_URL": endpoint,
            # Credentials moto accepts, shaped as the IAM user guide's example keys: a secret
            # is masked wherever it appears in a job's output, so it must not be a word that
            # text holds ("emulated" was: metadata.json's backend came out "<redacted>").
            "AWS_ACCESS_KEY_ID": "AKIAEMULATEDDRIVER00",
            "AWS_SECRET_ACCESS_KEY": "smpipeEmulatedDriverSecretKey0000000000",
            "AWS_DEFAULT_REGION": region,
        }
    )
    os.environ.pop("AWS_SESSION_TOKEN", None)
    os.environ.pop("AWS_PROFILE", None)
    return endpoint


def job_plumbing(endpoint: str) -> dict[str, str]:
    """What a job is given to reach the embedded moto at `endpoint`: its address, and
    credentials as the job's role would give them (AWS delivers a role's temporary credentials
    through the container credentials provider, undocumented for SageMaker; any credentials
    reach moto). No region: SageMaker documents none, and a job finds its own from its ARN
    (steps/runtime/secrets.py)."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "ASIAEMULATEDJOBROLE0",
        "AWS_SECRET_ACCESS_KEY": "smpipeEmulatedJobRoleSecretKey000000000",
        "AWS_SESSION_TOKEN": "smpipeEmulatedJobRoleSessionToken0000000",
    }


def job_containers(image: str, engine: str, endpoint: str, warm: WarmStart | None) -> Containers:
    """What runs the jobs' containers. With an image, every job runs in it (player/images.py),
    reaching moto at `endpoint` through a relay at its network's gateway; without, as processes
    of this machine (player/processes.py) in a new container's environment
    (player/environment.py), started warm by `warm` as the local backend starts its jobs
    (fork_client.py: each still a process of its own with exactly its own environment).
    Either way the image's ENV, the request's Environment, what SageMaker sets and the
    emulator's plumbing (`job_plumbing`) come on top."""
    if not image:
        return Containers(base_env=fresh_container_env() | job_plumbing(endpoint), starter=warm)
    engine = find_engine(engine)
    # Resolved to its id once, before any job (ImageUnavailable: none, or another lock's):
    # every job runs that id, whatever the tag names meanwhile.
    ref = resolve_image(engine, image, PROJECT_ROOT / "requirements.lock")
    return ImageContainers(engine, ref, job_plumbing, int(endpoint.rsplit(":", 1)[1]))


class S3View:
    """A local-folder store seen as a bucket, so the requests name s3:// URIs (botocore
    insists) while the files stay in the user's folder."""

    def __init__(self, store: Store, bucket: str = EMULATED_BUCKET):
        self._store, self.bucket = store, bucket
        self.uri = f"s3://{bucket}"

    def uri_of(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def folder_of(self, key: str) -> str:
        """Where the emulated bucket's `key` really is."""
        return self._store.uri_of(key)

    def __getattr__(self, name):
        return getattr(self._store, name)


def _now() -> datetime:
    return datetime.now(UTC)


def _bill(job) -> None:
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


def _body(params: dict) -> dict:
    body = params["body"]
    return json.loads(body.decode() if isinstance(body, bytes) else body)


class _Response:
    def __init__(self, status_code: int):
        self.status_code, self.headers = status_code, {}


def _ok(parsed: dict):
    """What a before-call hook returns for a call SageMaker answers and moto does not."""
    return _Response(200), {**parsed, "ResponseMetadata": {"HTTPStatusCode": 200}}


def _error_response(status: int, code: str, message: str):
    error = {"Error": {"Code": code, "Message": message}}
    return _Response(status), {**error, "ResponseMetadata": {"HTTPStatusCode": status}}


def used_name_message(kind: str, name: str, arn: str) -> str:
    """ResourceInUse's message for a job name used before, as AWS words it where a source shows
    it: training, "Training job names must be unique within an AWS account and region, and a
    training job with this name already exists (arn:...)" (CreateTrainingJob, as AWS answered
    it: github.com/aws/amazon-sagemaker-examples/pull/3108); tuning, "A hyperparameter tuning
    job with the name, X, already exists. Choose a different name."
    (CreateHyperParameterTuningJob: github.com/aws/amazon-sagemaker-examples/pull/3353). No
    source shows CreateProcessingJob's: the training message's wording, with "processing job"
    in it, is this emulator's guess."""
    if kind == "tuning":
        return (
            f"A hyperparameter tuning job with the name, {name}, already exists. "
            "Choose a different name."
        )
    job = {"processing": "processing job", "training": "training job"}[kind]
    return (
        f"{job.capitalize()} names must be unique within an AWS account and region, "
        f"and a {job} with this name already exists ({arn})"
    )


class Emulator:
    """Plays the jobs moto accepts; `backend()` is the SageMaker backend wired to it."""

    def __init__(
        self,
        store: Store,
        region: str,
        work_root: str | None = None,
        image: str = "",
        engine: str = "auto",
    ):
        import boto3
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.sagemaker.models import sagemaker_backends

        self.store = store
        self.client = boto3.client("sagemaker", region_name=region, config=aws_config())
        self.logs = boto3.client("logs", region_name=region, config=aws_config())
        self._moto = sagemaker_backends[DEFAULT_ACCOUNT_ID][region]
        if work_root is None:
            remove_orphaned_work_roots(sys.stderr)
            self.work_root = new_work_root("emulated")
        else:
            self.work_root = Path(work_root)
        # Jobs played as processes start warm; a container of an image starts as it starts.
        self.warm = None
        if not image and warm_start_enabled():
            self.warm = WarmStart(self.work_root / WARM_FOLDER)
        self.containers = job_containers(image, engine, os.environ["AWS_ENDPOINT_URL"], self.warm)
        self.requests: dict[str, dict] = {}  # every request moto accepted, by job name
        self.metrics: dict[str, dict[str, float]] = {}  # training job -> final metrics
        self.trials: dict[str, list[str]] = {}  # tuning job -> its training jobs, in order
        self._threads: dict[str, threading.Thread] = {}
        self._pending = threading.local()  # the Create* request being sent from this thread
        self._stopping: set[str] = set()
        self._reclaimed: set[str] = set()  # spot jobs whose instance AWS took back
        self.pools = WarmPools(self._moto.training_jobs)
        self._trial_names: set[str] = set()  # a tuning job's trials keep no pools of theirs
        events = self.client.meta.events
        events.register("provide-client-params.sagemaker", self._capture)
        for api in KINDS.values():
            # SageMaker refuses a name used before in the account and region; moto overwrites.
            events.register(f"before-call.sagemaker.{api.create}", self._refuse_used_name)
            events.register(f"after-call.sagemaker.{api.create}", self._created)
            # moto has no Stop* calls: SageMaker's part, played here.
            events.register(f"before-call.sagemaker.{api.stop}", self._stop)
        # A warm pool's time runs out between calls: it is Terminated before anyone looks.
        for operation in ("DescribeTrainingJob", "ListTrainingJobs"):
            events.register(f"before-call.sagemaker.{operation}", lambda **_: self.pools.expire())
        # Nor ListTrainingJobsForHyperParameterTuningJob.
        events.register(
            "before-call.sagemaker.ListTrainingJobsForHyperParameterTuningJob", self._list_trials
        )
        # moto makes a new model package for every CreateModelPackage, whatever its ClientToken.
        events.register("before-call.sagemaker.CreateModelPackage", self._same_client_token)

    def backend(self, run: RunTree, image_uri: str, role_arn: str, echo=None):
        return SageMakerBackend(
            self.store,
            run,
            client=self.client,
            logs_client=self.logs,
            image_uri=image_uri or EMULATED_IMAGE,
            role_arn=role_arn or EMULATED_ROLE,
            echo=echo,
            poll_seconds=0.5,
        )

    def secrets(self):
        import boto3

        region = self.client.meta.region_name
        return boto3.client("secretsmanager", region_name=region, config=aws_config())

    def close(self) -> None:
        self.containers.stop()
        for thread in list(self._threads.values()):
            thread.join()
        self.containers.close()
        if self.warm is not None:  # its servers are left to the next run of this process
            self.warm.close()
        shutil.rmtree(self.work_root, ignore_errors=True)

    # -- hooks on the client ---------------------------------------------------------------------

    def _capture(self, params, model, **_):
        if model.name in KIND_CREATED_BY:  # kept until SageMaker (moto) accepts it
            self._pending.request = copy.deepcopy(params)

    def _created(self, http_response, parsed, model, **_):
        if http_response.status_code != 200:
            return
        arn = next(v for k, v in parsed.items() if k.endswith("Arn"))
        name = arn.rsplit("/", 1)[-1]
        self.requests[name] = self._pending.request
        kind = KIND_CREATED_BY[model.name]
        play = {
            "processing": self._play_processing,
            "training": self._play_training,
            "tuning": self._play_tuning,
        }[kind]
        self._started(name, kind)
        thread = threading.Thread(target=self._guard, args=(play, name), daemon=True)
        self._threads[name] = thread
        thread.start()

    def _refuse_used_name(self, model, params, **_):
        """SageMaker's answer to a name used before: ResourceInUse (the Create* calls' errors
        in botocore's sagemaker service-2.json), in the words AWS sent (`used_name_message`).
        A name stays used after its job ends: SageMaker deletes no job."""
        body = _body(params)
        requested = next((v for k, v in body.items() if k.endswith("JobName")), None)
        name = requested
        known = {
            **self._moto.processing_jobs,
            **self._moto.training_jobs,
            **self._moto.hyper_parameter_tuning_jobs,
        }
        if model.name == KINDS["tuning"].create and isinstance(name, str):
            # A tuning job's name "is not case sensitive" (HyperParameterTuningJobName,
            # botocore's sagemaker service-2.json): `News-...` is taken once `news-...` is.
            taken = {n.lower(): n for n in self._moto.hyper_parameter_tuning_jobs}
            name = taken.get(name.lower(), name)
        if name not in known:
            return None
        arn = getattr(known[name], "arn", None) or name
        message = used_name_message(KIND_CREATED_BY[model.name], requested, arn)
        return _error_response(400, "ResourceInUse", message)

    def _stop(self, model, params, **_):
        name = next(iter(_body(params).values()))
        self._stopping.add(name)
        if model.name == "StopHyperParameterTuningJob":
            for trial in self.trials.get(name, []):
                self._stopping.add(trial)
        # StopTrainingJob: SIGTERM, SIGKILL 120 s later (API_StopTrainingJob.html); the
        # entrypoint forwards it, training checkpoints. StopProcessingJob: "SIGINT and SIGKILL"
        # are what the processing container gets (build-your-own-processing-container.html).
        signum = signal.SIGINT if model.name == "StopProcessingJob" else signal.SIGTERM
        self.containers.stop(name, signum)
        return _ok({})

    def _list_trials(self, params, **_):
        """ListTrainingJobsForHyperParameterTuningJob: a TrainingJobSummary per trial, with the
        fields the API reference lists (API_HyperParameterTrainingJobSummary.html)."""
        name = _body(params)["HyperParameterTuningJobName"]
        objective = self.requests[name]["HyperParameterTuningJobConfig"][
            "HyperParameterTuningJobObjective"
        ]
        summaries = []
        for trial in self.trials.get(name, []):
            job = self._moto.training_jobs[trial]
            tuned = self.requests[trial]["HyperParameters"]
            summary = {
                "TrainingJobName": trial,
                "TrainingJobArn": job.arn,
                "TuningJobName": name,
                "CreationTime": job.creation_time,
                "TrainingJobStatus": job.training_job_status,
                "TunedHyperParameters": {
                    k: v for k, v in tuned.items() if k in self._searched(name)
                },
                "TrainingStartTime": job.training_start_time,
            }
            if job.training_job_status in TERMINAL:
                summary["TrainingEndTime"] = job.training_end_time
            if getattr(job, "failure_reason", None):
                summary["FailureReason"] = job.failure_reason
            value = self.metrics.get(trial, {}).get(objective["MetricName"])
            if value is not None:
                summary["FinalHyperParameterTuningJobObjectiveMetric"] = {
                    "Type": objective["Type"],
                    "MetricName": objective["MetricName"],
                    "Value": value,
                }
            summary["ObjectiveStatus"] = "Succeeded" if value is not None else "Failed"
            summaries.append(summary)
        return _ok({"TrainingJobSummaries": summaries})

    def _same_client_token(self, params, **_):
        """CreateModelPackage is idempotent on its ClientToken: "A unique token that guarantees
        that the call to this API is idempotent" (its idempotencyToken member in botocore's
        sagemaker service-2.json), and an idempotent AWS API "uses the token to return a
        response identical to the response that was returned the first time that the request
        was completed" (AWS Well-Architected Framework, REL04-BP04). A repeated token is
        answered with the package its first request made, and nothing is created. How long
        SageMaker remembers a token is not documented: here, as long as the package exists."""
        token = _body(params).get("ClientToken")
        made = [p for p in self._moto.model_packages.values() if token and p.client_token == token]
        return _ok({"ModelPackageArn": made[0].arn}) if made else None

    def _searched(self, name: str) -> set[str]:
        ranges = self.requests[name]["HyperParameterTuningJobConfig"]["ParameterRanges"]
        return {r["Name"] for kind in ranges.values() for r in kind}

    def reclaim(self, job: str = "") -> list[str]:
        """AWS takes a spot instance back: every running spot training job whose name starts
        with `job` gets SIGTERM and is started again from its checkpoints, while its
        MaxWaitTimeInSeconds lasts (model-managed-spot-training.html). Returns their names."""
        names = [
            name
            for name, request in self.requests.items()
            if name.startswith(job)
            and request.get("EnableManagedSpotTraining")
            and name in self._moto.training_jobs
            and self._moto.training_jobs[name].training_job_status == "InProgress"
        ]
        for name in names:
            self._reclaimed.add(name)
            self.containers.stop(name, restartable=True)
        return names

    # -- moto's records, moved as SageMaker moves them ----------------------------------------

    def _started(self, name: str, kind: str) -> None:
        if kind == "processing":
            job, request = self._moto.processing_jobs[name], self.requests[name]
            job.processing_job_status = "InProgress"
            job.processing_start_time = _now()
            # What moto does not keep of the request, SageMaker returns.
            job.environment = request.get("Environment", {})
            job.processing_resources = request["ProcessingResources"]
        elif kind == "training":
            job, request = self._moto.training_jobs[name], self.requests[name]
            job.training_job_status, job.secondary_status = "InProgress", "Starting"
            # "the time when the training job starts on training instances" (TrainingStartTime,
            # botocore's sagemaker service-2.json): here none are provisioned, so the job starts
            # on them at once; downloading its input is billed (model-train-storage.html).
            job.training_start_time = _now()
            job.algorithm_specification = request["AlgorithmSpecification"]
            job.environment = request.get("Environment", {})
            job.final_metric_data_list = []
            if name not in self._trial_names:
                self.pools.start(name, request)
        else:
            job = self._moto.hyper_parameter_tuning_jobs[name]
            job.hyper_parameter_tuning_job_status = "InProgress"
            job.best_training_job = job.OverallBestTrainingJob = None
            job.training_job_status_counters = {
                k: 0
                for k in (
                    "Completed",
                    "InProgress",
                    "RetryableError",
                    "NonRetryableError",
                    "Stopped",
                )
            }

    def _end(self, name: str, status: str, reason: str | None = None, exit_message=None) -> None:
        # FailureReason and ExitMessage are at most 1,024 characters (their shapes' max in
        # botocore's sagemaker service-2.json): SageMaker returns the first 1,024.
        if reason:
            reason = reason[: shape("FailureReason").metadata["max"]]
        if name in self._moto.processing_jobs:
            job = self._moto.processing_jobs[name]
            job.processing_job_status = status
            job.processing_end_time = _now()
            if reason:
                job.failure_reason = reason
            if exit_message:
                job.exit_message = exit_message[: shape("ExitMessage").metadata["max"]]
        elif name in self._moto.training_jobs:
            job = self._moto.training_jobs[name]
            if name not in self._trial_names:  # its pool is there when its end is seen
                self.pools.end(name, self.requests[name])
            job.training_end_time = _now()
            _bill(job)  # before its status: whoever sees it ended sees what it billed
            job.training_job_status, job.secondary_status = status, status
            if reason:
                job.failure_reason = reason
        else:
            job = self._moto.hyper_parameter_tuning_jobs[name]
            job.hyper_parameter_tuning_job_status = status
            job.hyper_parameter_tuning_end_time = _now()
            if reason:
                job.failure_reason = reason

    def _guard(self, play, name: str) -> None:
        """Whatever goes wrong in playing a job ends that job Failed, never the driver."""
        try:
            play(name)
        except Exception as e:  # noqa: BLE001 - becomes the job's FailureReason
            self._end(name, "Failed", f"ClientError: the emulator could not run the job: {e}")

    def _status_after(self, name: str, exits) -> tuple[str, str | None]:
        """A job's end as DescribeTrainingJob / DescribeProcessingJob report it (status_after),
        its FailureReason as SageMaker words it: ClientError for what SageMaker could not do
        for the job (its data), AlgorithmError for what the container did."""
        status, reason = status_after(
            exits, stop_requested=name in self._stopping, capacity_lost=name in self._reclaimed
        )
        if status == "Failed" and not reason.startswith("ClientError"):
            reason = f"AlgorithmError: {reason}"
        return status, reason

    def _spot_restart(self, name: str, request: dict, started: float):
        """SageMaker starts a job again only when it is a spot job whose instance was taken
        back, and only while MaxWaitTimeInSeconds (waiting plus running) lasts
        (model-managed-spot-training.html; API_StoppingCondition.html). A job that fails, is
        killed for its memory or stops otherwise ends there; RetryStrategy, which retries
        internal errors, is not requested here."""

        def restart(_exits, _restarts: int) -> bool:
            if name not in self._reclaimed or not request.get("EnableManagedSpotTraining"):
                return False
            wait = request["StoppingCondition"].get("MaxWaitTimeInSeconds", 0)
            if time.time() - started >= wait:
                return False
            self._reclaimed.discard(name)
            return True

        return restart

    # -- the three job kinds ---------------------------------------------------------------------

    def _play_processing(self, name: str) -> None:
        request, root, stamp = self.requests[name], self.work_root / name, int(time.time())
        uris = {
            o["OutputName"]: o["S3Output"]["S3Uri"]
            for o in request["ProcessingOutputConfig"]["Outputs"]
        }
        exits = play_processing(
            request,
            root,
            self.store,
            self.containers,
            # A stream per instance, as SageMaker names them: <job>/<host>-<time>.
            log=lambda host: LogStream(
                self.logs, LOG_GROUPS["processing"], f"{name}/{host}-{stamp}"
            ),
            on_line=None,
            arn=self._moto.processing_jobs[name].arn,
        )
        status, reason = self._status_after(name, exits)
        if status == "Completed":
            for output, local in processing_outputs(request, root).items():
                upload_folder(self.store, local, uris[output])
        # "If multiple containers exit with an ExitMessage, the content of the ExitMessage from
        # each processing container is concatenated, then truncated to 1 KB" (byoc-metadata.html;
        # `_end` truncates it). The hosts in resourceconfig.json's order; no separator is
        # documented.
        said = "".join(e.reason for e in exits if e.reason)
        self._end(name, status, reason, exit_message=said)
        shutil.rmtree(root, ignore_errors=True)

    def _play_training(self, name: str) -> None:
        request, job = self.requests[name], self._moto.training_jobs[name]
        stamp = int(time.time())
        streams = {}

        def log_for(host: str) -> LogStream:
            if host not in streams:
                streams[host] = LogStream(
                    self.logs, LOG_GROUPS["training"], f"{name}/{host}-{stamp}"
                )
            return streams[host]

        def restarted(count: int) -> None:
            job.secondary_status = "Interrupted"
            log_for("algo-1").write(f"spot capacity interrupted the job; restart {count}")
            job.secondary_status = "Training"

        job.secondary_status = "Training"
        played = play_training(
            request,
            self.work_root / name,
            self.store,
            self.containers,
            log=log_for,
            on_line=None,
            on_restart=restarted,
            arn=job.arn,
            restart=self._spot_restart(name, request, time.time()),
        )
        metrics: dict[str, float] = {}
        for e in played.exits:
            metrics.update(e.metrics)
        self.metrics[name] = metrics
        job.final_metric_data_list = [
            {"MetricName": k, "Value": v, "Timestamp": _now()} for k, v in metrics.items()
        ]
        status, reason = self._status_after(name, played.exits)
        if status == "Completed":
            job.secondary_status = "Uploading"
            base = request["OutputDataConfig"]["S3OutputPath"].rstrip("/") + f"/{name}/output/"
            # Every host's model/ and output/data/, in one tarball each (job_root.gathered).
            work = self.work_root / name / "gathered"
            for folder, tarball in ((MODEL_DIR, "model"), (OUTPUT_DATA_DIR, "output")):
                local = gathered(played.roots, folder, work / tarball)
                upload_tarball(self.store, local, base + f"{tarball}.tar.gz")
        self._end(name, status, reason)
        shutil.rmtree(self.work_root / name, ignore_errors=True)

    def _play_tuning(self, name: str) -> None:
        request, job = self.requests[name], self._moto.hyper_parameter_tuning_jobs[name]
        config = request["HyperParameterTuningJobConfig"]
        definition = request["TrainingJobDefinition"]
        static = definition.get("StaticHyperParameters", {})
        limits = config["ResourceLimits"]
        counters = job.training_job_status_counters
        lock = threading.Lock()
        objective = config["HyperParameterTuningJobObjective"]
        self.trials[name] = []

        def trial(index_values) -> tuple[str, dict]:
            index, values = index_values
            # Trials are named <tuning job>-NNN-<8 hex> (as in the SDK's tests of a real
            # DescribeHyperParameterTuningJob: sagemaker-python-sdk tests/unit/
            # tuner_visualize_test_utils.py).
            trial_name = f"{name}-{index:03d}-{uuid.uuid4().hex[:8]}"
            if name in self._stopping:
                return trial_name, values
            # The definition's one CheckpointConfig goes to every trial as it is (its member of
            # HyperParameterTrainingJobDefinition, botocore's sagemaker service-2.json): whether
            # SageMaker gives each trial that S3Uri or one of its own, the sources are silent.
            fields = {k: v for k, v in definition.items() if k not in TUNING_ONLY}
            # SageMaker adds the objective's name to every trial's hyperparameters, as is, not
            # JSON-quoted (automatic-model-tuning-define-ranges.html; the SDK's fixture of a
            # trial's DescribeTrainingJob: "_tuning_objective_metric": "Validation-accuracy").
            hyperparameters = {**static, **values, TUNING_OBJECTIVE: objective["MetricName"]}
            with lock:
                counters["InProgress"] += 1
                self._trial_names.add(trial_name)
            self.client.create_training_job(
                TrainingJobName=trial_name, HyperParameters=hyperparameters, **fields
            )
            with lock:
                self.trials[name].append(trial_name)
            self._threads[trial_name].join()
            status = self._moto.training_jobs[trial_name].training_job_status
            with lock:
                counters["InProgress"] -= 1
                counters[status if status in ("Completed", "Stopped") else "NonRetryableError"] += 1
            return trial_name, values

        # The trials share one environment: its fork server starts beside the first trial.
        with (
            self.warm.expecting_more() if self.warm else nullcontext(),
            ThreadPoolExecutor(max_workers=limits["MaxParallelTrainingJobs"]) as pool,
        ):
            trials = list(pool.map(trial, enumerate(candidates(config, static), 1)))
        if name in self._stopping:
            self._end(name, "Stopped")
            return
        best = self._best(name, trials, objective)
        if best is None:
            self._end(name, "Failed", "No training job succeeded with an objective metric")
            return
        job.best_training_job = job.OverallBestTrainingJob = best
        self._end(name, "Completed")

    def _best(self, name: str, trials: list[tuple[str, dict]], objective: dict) -> dict | None:
        """BestTrainingJob, as DescribeHyperParameterTuningJob reports it
        (API_HyperParameterTrainingJobSummary.html), or None when no trial has an objective."""
        sign = 1 if objective["Type"] == "Maximize" else -1
        scored = [
            (self.metrics[t][objective["MetricName"]], t, values)
            for t, values in trials
            if t in self._moto.training_jobs
            and self._moto.training_jobs[t].training_job_status == "Completed"
            and objective["MetricName"] in self.metrics.get(t, {})
        ]
        if not scored:
            return None
        value, best, values = max(scored, key=lambda s: sign * s[0])
        trained = self._moto.training_jobs[best]
        return {
            "TrainingJobName": best,
            "TrainingJobArn": trained.arn,
            "TuningJobName": name,
            "CreationTime": trained.creation_time,
            "TrainingJobStatus": "Completed",
            "TunedHyperParameters": values,
            "ObjectiveStatus": "Succeeded",
            "FinalHyperParameterTuningJobObjectiveMetric": {
                "Type": objective["Type"],
                "MetricName": objective["MetricName"],
                "Value": value,
            },
        }


def open_emulated_store(settings) -> Store:
    """Start the embedded moto and open the store the emulated jobs see: a local STORE as a
    bucket of its own (the files stay in the folder), an s3:// STORE as moto's bucket of that
    name (it lives as long as the driver does)."""
    from pipeline.store import S3Store, open_store

    start_moto(settings.experiment.region)
    uri = settings.store_uri()
    if not uri.startswith("s3://"):
        return S3View(open_store(uri))
    store = S3Store(uri, settings.experiment.region)
    try:
        store.client.create_bucket(Bucket=store.bucket)
    except store.client.exceptions.BucketAlreadyOwnedByYou:
        pass
    return store


class EmulatedBackend:
    """BACKEND = emulated, as the driver holds it: the SageMaker backend (`sagemaker`), its
    requests sent to moto, and the Emulator that plays them (`emulator`: tests take a spot
    instance back through it); closing it closes both. `client` is the SageMaker client the
    backend calls, for hooks on its calls."""

    def __init__(self, sagemaker: SageMakerBackend, emulator: Emulator) -> None:
        self.sagemaker, self.emulator = sagemaker, emulator
        self.client = sagemaker.client
        ref = getattr(emulator.containers, "ref", None)  # jobs played as processes: none
        self.image_record = ref.record() if ref else None

    def run_processing(self, job: ProcessingJob) -> JobResult:
        return self.sagemaker.run_processing(job)

    def run_training(self, job: TrainingJob) -> JobResult:
        return self.sagemaker.run_training(job)

    def run_tuning(self, job: TuningJob) -> JobResult:
        return self.sagemaker.run_tuning(job)

    def stop(self) -> None:
        self.sagemaker.stop()

    def close(self, succeeded: bool) -> None:
        self.sagemaker.close(succeeded)
        self.emulator.close()

    def say(self, job_name: str, text: str) -> None:
        self.sagemaker.say(job_name, text)


def emulated_backend(settings, store: Store, run: RunTree, echo=None) -> EmulatedBackend:
    """The SageMaker backend, its requests sent to moto and its jobs played by an Emulator."""
    emulator = Emulator(
        store,
        settings.experiment.region,
        image=settings.emulated.image,
        engine=settings.emulated.engine,
    )
    for secret_id, key in (
        (settings.tracking.wandb_secret_id, "WANDB_API_KEY"),
        (settings.hub.token_secret_id, "HF_TOKEN"),
    ):
        if secret_id and os.environ.get(key):
            # The secret the jobs would read on AWS, made from this machine's key: the jobs
            # themselves never see this machine's environment.
            secrets = emulator.secrets()
            try:
                secrets.create_secret(Name=secret_id, SecretString=os.environ[key])
            except secrets.exceptions.ResourceExistsException:
                pass
    sagemaker = emulator.backend(
        run, settings.experiment.image_uri, settings.experiment.role_arn, echo
    )
    return EmulatedBackend(sagemaker, emulator)
