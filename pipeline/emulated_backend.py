"""BACKEND = emulated: SageMaker without AWS and without Docker.

The SageMaker backend runs unchanged: it sends the real requests (botocore checks every
field against the service model) to an embedded moto server, waits on them, reads their
CloudWatch logs, stops them, adopts their outputs. moto accepts a job and runs nothing;
this module plays SageMaker's part for each job it accepted:

- lays out the job root from the request (the request's S3 inputs downloaded, the config
  files SageMaker writes, the request's Environment over the image's ENV from
  docker/Dockerfile) and starts the image's entrypoint as SageMaker would: `train` on every
  host (torchrun across them), or the processing request's ContainerEntrypoint and
  ContainerArguments;
- writes what the container prints to CloudWatch Logs (`/aws/sagemaker/TrainingJobs`,
  `<job>/algo-N-<time>`), moves the job through SageMaker's statuses, uploads what SageMaker
  uploads (model.tar.gz and output.tar.gz under OutputDataConfig, the processing outputs,
  the checkpoints), and ends the job Completed, Failed (with FailureReason and, for
  processing, ExitMessage) or Stopped;
- restarts an interrupted spot job from its checkpoints, as managed spot training does;
- runs a tuning job's trials as training jobs created in moto (sampled from the request's
  ParameterRanges: a grid for Grid, at random otherwise), reads their objective with the
  request's metric regexes and reports the best one.

Only what needs AWS itself stays unchecked: quotas, IAM permissions, VPC, the image in ECR.
"""

from __future__ import annotations

import copy
import io
import itertools
import json
import logging
import math
import os
import shutil
import tarfile
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from pipeline.container import Containers, in_root, play_processing, play_training
from pipeline.paths import RunTree
from pipeline.sagemaker_backend import LOG_GROUPS, SageMakerBackend
from pipeline.store import Store, aws_config, key_of

EMULATED_IMAGE = "smpipe:emulated"
EMULATED_ROLE = "arn:aws:iam::123456789012:role/smpipe-emulated"
EMULATED_BUCKET = "smpipe-emulated"
SPOT_RESTARTS = 3  # SageMaker restarts a spot job until MaxWaitTimeInSeconds; here, this often


def start_moto(region: str) -> str:
    """An embedded moto server on a free local port; this process and every job it starts
    reach it (and nothing else: fake credentials, its endpoint for every AWS service)."""
    from moto.server import ThreadedMotoServer

    from pipeline.container import free_port

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update({
        "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "emulated", "AWS_SECRET_ACCESS_KEY": "emulated",
        "AWS_DEFAULT_REGION": region,
    })  # fmt: skip
    os.environ.pop("AWS_SESSION_TOKEN", None)
    os.environ.pop("AWS_PROFILE", None)
    return endpoint


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


class LogStream:
    """What one host of a job prints, as SageMaker sends it to CloudWatch Logs."""

    def __init__(self, logs, group: str, stream: str):
        self.logs, self.group, self.stream = logs, group, stream
        try:
            logs.create_log_group(logGroupName=group)
        except logs.exceptions.ResourceAlreadyExistsException:
            pass
        logs.create_log_stream(logGroupName=group, logStreamName=stream)

    def write(self, text: str) -> None:
        events = [
            {"timestamp": int(time.time() * 1000), "message": line}
            for line in text.splitlines()
            if line
        ]
        if events:
            self.logs.put_log_events(
                logGroupName=self.group, logStreamName=self.stream, logEvents=events
            )


def _now() -> datetime:
    return datetime.now(timezone.utc)


class Emulator:
    """Plays the jobs moto accepts; `backend()` is the SageMaker backend wired to it."""

    def __init__(self, store: Store, region: str, work_root: str | None = None):
        import boto3
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.sagemaker.models import sagemaker_backends

        self.store = store
        self.client = boto3.client("sagemaker", region_name=region, config=aws_config())
        self.logs = boto3.client("logs", region_name=region, config=aws_config())
        self._moto = sagemaker_backends[DEFAULT_ACCOUNT_ID][region]
        self.work_root = Path(work_root or tempfile.mkdtemp(prefix="smpipe-emulated-"))
        self.containers = Containers()
        self.requests: dict[str, dict] = {}  # every request moto accepted, by job name
        self.metrics: dict[str, dict[str, float]] = {}  # training job -> final metrics
        self._threads: dict[str, threading.Thread] = {}
        self._stopping: set[str] = set()
        events = self.client.meta.events
        events.register("provide-client-params.sagemaker", self._capture)
        events.register("after-call.sagemaker.CreateProcessingJob", self._created)
        events.register("after-call.sagemaker.CreateTrainingJob", self._created)
        events.register("after-call.sagemaker.CreateHyperParameterTuningJob", self._created)
        # moto has no Stop* calls: SageMaker's part, played here.
        for operation in ("StopProcessingJob", "StopTrainingJob", "StopHyperParameterTuningJob"):
            events.register(f"before-call.sagemaker.{operation}", self._stop)

    def backend(self, run: RunTree, image_uri: str, role_arn: str, echo=None):
        return SageMakerBackend(self.store, run, client=self.client, logs_client=self.logs,
                                image_uri=image_uri or EMULATED_IMAGE, role_arn=role_arn or EMULATED_ROLE,
                                echo=echo, poll_seconds=0.5)  # fmt: skip

    def secrets(self):
        import boto3

        return boto3.client("secretsmanager", region_name=self.client.meta.region_name)

    def close(self) -> None:
        self.containers.stop()
        for thread in list(self._threads.values()):
            thread.join()
        shutil.rmtree(self.work_root, ignore_errors=True)

    # -- hooks on the client ---------------------------------------------------------------------

    def _capture(self, params, model, **_):
        name = params.get("ProcessingJobName") or params.get("TrainingJobName")
        name = name or params.get("HyperParameterTuningJobName")
        if model.name.startswith("Create") and name:
            self.requests[name] = copy.deepcopy(params)

    def _created(self, http_response, parsed, model, **_):
        if http_response.status_code != 200:
            return
        arn = next(v for k, v in parsed.items() if k.endswith("Arn"))
        name = arn.rsplit("/", 1)[-1]
        play = {
            "CreateProcessingJob": self._play_processing,
            "CreateTrainingJob": self._play_training,
            "CreateHyperParameterTuningJob": self._play_tuning,
        }[model.name]
        self._started(name, model.name)
        thread = threading.Thread(target=self._guard, args=(play, name), daemon=True)
        self._threads[name] = thread
        thread.start()

    def _stop(self, model, params, **_):
        body = params["body"]
        name = next(iter(json.loads(body.decode() if isinstance(body, bytes) else body).values()))
        self._stopping.add(name)
        if model.name == "StopHyperParameterTuningJob":
            for trial in [n for n in self._threads if n.startswith(name + "-")]:
                self._stopping.add(trial)
        self.containers.stop(name)  # SIGTERM: the entrypoint forwards it, training checkpoints
        return (type("Response", (), {"status_code": 200, "headers": {}})(), {})

    # -- moto's records, moved as SageMaker moves them ----------------------------------------

    def _started(self, name: str, operation: str) -> None:
        if operation == "CreateProcessingJob":
            job, request = self._moto.processing_jobs[name], self.requests[name]
            job.processing_job_status = "InProgress"
            job.processing_start_time = _now()
            # What moto does not keep of the request, SageMaker returns.
            job.environment = request.get("Environment", {})
            job.processing_resources = request["ProcessingResources"]
        elif operation == "CreateTrainingJob":
            job, request = self._moto.training_jobs[name], self.requests[name]
            job.training_job_status, job.secondary_status = "InProgress", "Starting"
            job.algorithm_specification = request["AlgorithmSpecification"]
            job.environment = request.get("Environment", {})
            job.final_metric_data_list = []
        else:
            job = self._moto.hyper_parameter_tuning_jobs[name]
            job.hyper_parameter_tuning_job_status = "InProgress"
            job.best_training_job = job.OverallBestTrainingJob = None
            job.training_job_status_counters = {
                k: 0 for k in ("Completed", "InProgress", "RetryableError", "NonRetryableError", "Stopped")
            }  # fmt: skip

    def _end(self, name: str, status: str, reason: str | None = None, exit_message=None) -> None:
        if name in self._moto.processing_jobs:
            job = self._moto.processing_jobs[name]
            job.processing_job_status = status
            job.processing_end_time = _now()
            if reason:
                job.failure_reason = reason
            if exit_message:
                job.exit_message = exit_message
        elif name in self._moto.training_jobs:
            job = self._moto.training_jobs[name]
            job.training_job_status, job.secondary_status = status, status
            job.training_end_time = _now()
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

    def _status_after(self, name: str, exits, what: str) -> tuple[str, str | None]:
        if all(e.code == 0 for e in exits):
            return "Completed", None
        if name in self._stopping:
            return "Stopped", None
        if any(e.interrupted for e in exits):
            return "Failed", f"{what} was interrupted (SIGTERM) and not restarted"
        reason = next((e.reason for e in exits if e.reason), None)
        return "Failed", f"AlgorithmError: {reason or f'exit status {exits[0].code}'}"

    # -- the three job kinds ---------------------------------------------------------------------

    def _play_processing(self, name: str) -> None:
        request, root = self.requests[name], self.work_root / name
        stream = LogStream(self.logs, LOG_GROUPS["processing"], f"{name}/algo-1-{int(time.time())}")
        exit_ = play_processing(
            request, root, self.store, self.containers, log=stream, on_line=None
        )
        status, reason = self._status_after(name, [exit_], "the processing job")
        if status == "Completed":
            for output in request["ProcessingOutputConfig"]["Outputs"]:
                self._upload(
                    in_root(root, output["S3Output"]["LocalPath"]), output["S3Output"]["S3Uri"]
                )
        self._end(name, status, reason, exit_message=exit_.reason)  # fmt: skip
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
            return streams[host]  # fmt: skip

        def restarted(count: int) -> None:
            job.secondary_status = "Interrupted"
            log_for("algo-1").write(f"spot capacity interrupted the job; restart {count}")
            job.secondary_status = "Training"

        job.secondary_status = "Training"
        played = play_training(request, self.work_root / name, self.store, self.containers,
                               log=log_for, on_line=None, on_restart=restarted,
                               max_restarts=SPOT_RESTARTS if request.get("EnableManagedSpotTraining") else 0)  # fmt: skip
        metrics: dict[str, float] = {}
        for e in played.exits:
            metrics.update(e.metrics)
        self.metrics[name] = metrics
        job.final_metric_data_list = [
            {"MetricName": k, "Value": v, "Timestamp": _now()} for k, v in metrics.items()
        ]
        status, reason = self._status_after(name, played.exits, "the training job")
        if status == "Completed":
            job.secondary_status = "Uploading"
            base = request["OutputDataConfig"]["S3OutputPath"].rstrip("/") + f"/{name}/output/"
            main = next(iter(played.roots.values()))
            self._upload_tarball(main / "model", base + "model.tar.gz")
            self._upload_tarball(main / "output/data", base + "output.tar.gz")
        self._end(name, status, reason)
        shutil.rmtree(self.work_root / name, ignore_errors=True)

    def _play_tuning(self, name: str) -> None:
        request, job = self.requests[name], self._moto.hyper_parameter_tuning_jobs[name]
        config, definition = request["HyperParameterTuningJobConfig"], request["TrainingJobDefinition"]  # fmt: skip
        ranges = ranges_from_request(config["ParameterRanges"])
        static = definition.get("StaticHyperParameters", {})
        limits = config["ResourceLimits"]
        if config["Strategy"] == "Grid":
            candidates = grid(ranges)
        else:
            import random

            rng = random.Random(int(static.get("seed", 0)))
            candidates = [sample(ranges, rng) for _ in range(limits["MaxNumberOfTrainingJobs"])]
        counters = job.training_job_status_counters
        lock = threading.Lock()

        def trial(index_values) -> tuple[str, dict]:
            index, values = index_values
            trial_name = f"{name}-{index:03d}-{uuid.uuid4().hex[:8]}"
            if name in self._stopping:
                return trial_name, values
            fields = {k: v for k, v in definition.items()
                      if k not in ("StaticHyperParameters", "DefinitionName", "TuningObjective", "HyperParameterRanges")}  # fmt: skip
            with lock:
                counters["InProgress"] += 1
            self.client.create_training_job(
                TrainingJobName=trial_name, HyperParameters={**static, **values}, **fields
            )
            self._threads[trial_name].join()
            status = self._moto.training_jobs[trial_name].training_job_status
            with lock:
                counters["InProgress"] -= 1
                key = {"Completed": "Completed", "Stopped": "Stopped"}.get(
                    status, "NonRetryableError"
                )
                counters[key] += 1  # fmt: skip
            return trial_name, values

        with ThreadPoolExecutor(max_workers=limits["MaxParallelTrainingJobs"]) as pool:
            trials = list(pool.map(trial, enumerate(candidates, 1)))
        objective = config["HyperParameterTuningJobObjective"]
        sign = 1 if objective["Type"] == "Maximize" else -1
        scored = [
            (self.metrics[t][objective["MetricName"]], t, values)
            for t, values in trials
            if t in self._moto.training_jobs
            and self._moto.training_jobs[t].training_job_status == "Completed"
            and objective["MetricName"] in self.metrics.get(t, {})
        ]
        if name in self._stopping:
            self._end(name, "Stopped")
            return
        if not scored:
            self._end(name, "Failed", "No training job succeeded with an objective metric")
            return
        value, best, values = max(scored, key=lambda s: sign * s[0])
        trained = self._moto.training_jobs[best]
        job.best_training_job = job.OverallBestTrainingJob = {
            "TrainingJobName": best, "TrainingJobArn": trained.arn, "TuningJobName": name,
            "CreationTime": trained.creation_time, "TrainingJobStatus": "Completed",
            "TunedHyperParameters": values, "ObjectiveStatus": "Succeeded",
            "FinalHyperParameterTuningJobObjectiveMetric": {
                "Type": objective["Type"], "MetricName": objective["MetricName"], "Value": value},
        }  # fmt: skip
        self._end(name, "Completed")

    # -- what SageMaker uploads --------------------------------------------------------------------

    def _key(self, uri: str) -> str:
        key = key_of(self.store, uri)
        if key is None:
            raise ValueError(f"{uri} is outside the emulated store {self.store.uri}")
        return key.rstrip("/") + "/"

    def _upload(self, local: Path, uri: str) -> None:
        prefix = self._key(uri)
        for path in sorted(local.rglob("*")):
            if path.is_file():
                self.store.upload_file(path, prefix + path.relative_to(local).as_posix())

    def _upload_tarball(self, local: Path, uri: str) -> None:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            for path in sorted(local.rglob("*")):
                if path.is_file():
                    tar.add(path, arcname=path.relative_to(local).as_posix())
        self.store.put_bytes(self._key(uri).rstrip("/"), buffer.getvalue())


# -- SageMaker's search, as the emulator plays it: the request's ranges drawn at random (a
# grid for Grid). The search itself is SageMaker's business; what is checked here is that the
# request is whole and that each trial runs and reports its objective.


def ranges_from_request(ranges: dict) -> dict:
    """A tuning request's ParameterRanges as the settings write them."""
    from pipeline.config import Categorical, Interval

    out: dict = {}
    for kind, integer in (("ContinuousParameterRanges", False), ("IntegerParameterRanges", True)):
        for r in ranges.get(kind, []):
            log = r.get("ScalingType") in ("Logarithmic", "ReverseLogarithmic")
            out[r["Name"]] = Interval(float(r["MinValue"]), float(r["MaxValue"]), integer, log)
    for r in ranges.get("CategoricalParameterRanges", []):
        out[r["Name"]] = Categorical(tuple(r["Values"]))
    return out


def sample(tunables: dict, rng) -> dict[str, str]:
    from pipeline.config import Categorical

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


def emulated_backend(settings, store: Store, run: RunTree, echo=None) -> SageMakerBackend:
    """The SageMaker backend, its requests sent to moto and its jobs played by an Emulator."""
    emulator = Emulator(store, settings.experiment.region)
    secret_id = settings.tracking.wandb_secret_id
    if secret_id and os.environ.get("WANDB_API_KEY"):
        # The secret the jobs would read on AWS, made from this machine's key.
        secrets = emulator.secrets()
        try:
            secrets.create_secret(Name=secret_id, SecretString=os.environ["WANDB_API_KEY"])
        except secrets.exceptions.ResourceExistsException:
            pass
    backend = emulator.backend(
        run, settings.experiment.image_uri, settings.experiment.role_arn, echo
    )
    backend.on_close = emulator.close
    return backend
