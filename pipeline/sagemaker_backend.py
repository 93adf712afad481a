"""The SageMaker backend: the jobs' requests sent to SageMaker, waited on, and their outputs
adopted into the run tree.

Each request is built by pipeline/jobs.py from the job description and sent as it is with a
boto3 SageMaker client, which checks every field against the service model before anything
is sent. The image's entrypoint (steps/entrypoint.py) is what SageMaker starts; the code every
job runs is the run's `code/` folder, given to each job as an input. The client, the logs
client, the image and the role are injected: the emulated backend passes moto's.

While a job runs: a progress line when its status changes (and once a minute), its
CloudWatch log streamed with the job's name in front. When it ends: a job that failed or was
stopped becomes one paragraph (status, FailureReason, ExitMessage, the last lines of its
log); a completed one has its outputs sealed with manifests (files, sizes, sha256, as the
local backend writes them), its model.tar.gz unpacked into the run tree.
"""

from __future__ import annotations

import json
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

from pipeline.jobs import (
    JobResult,
    ProcessingJob,
    TrainingJob,
    TuningJob,
    processing_request,
    training_request,
    tuning_request,
)
from pipeline.paths import RunTree
from pipeline.store import Store, key_of, seal_prefix, upload_dir

TERMINAL = ("Completed", "Failed", "Stopped")
LOG_GROUPS = {
    "training": "/aws/sagemaker/TrainingJobs",
    "processing": "/aws/sagemaker/ProcessingJobs",
}
TAIL_LINES = 5


class SageMakerBackend:
    name = "sagemaker"

    def __init__(
        self,
        store: Store,
        run: RunTree,
        *,
        client,
        logs_client,
        image_uri: str,
        role_arn: str,
        echo=None,
        poll_seconds: float = 15.0,
    ) -> None:
        self.store, self.run = store, run
        self.client, self.logs = client, logs_client
        self.image, self.role = image_uri, role_arn
        self.echo = echo if echo is not None else sys.stdout
        self.poll_seconds = poll_seconds
        self._active: dict[str, str] = {}  # job name -> kind, for stop()
        self.on_close = None  # what else ends with the run (the emulator's players)
        self._lock = threading.Lock()

    def request(self, job) -> dict:
        """The request a job becomes."""
        build = {
            "processing": processing_request,
            "training": training_request,
            "tuning": tuning_request,
        }[job.kind]
        return build(job, self.image, self.role, self.store.uri_of)

    def _say(self, name: str, text: str) -> None:
        print(f"[{name}] {text}", file=self.echo, flush=True)

    # -- the protocol every backend answers ----------------------------------------------------

    def run_processing(self, job: ProcessingJob) -> JobResult:
        request = self.request(job)
        described, log = self._submit_and_wait("processing", job.name, request)
        result = self._result("processing", job.name, described, log)
        if result.status == "Completed":
            empty = [
                p
                for p in job.outputs.values()
                if seal_prefix(self.store, p, {"job_name": job.name}) is None
            ]
            if empty:
                where = ", ".join(self.store.uri_of(p) for p in empty)
                result.status, result.failure_reason = (
                    "Failed",
                    f"the job completed but wrote nothing to {where}",
                )
        return result

    def run_training(self, job: TrainingJob) -> JobResult:
        request = self.request(job)
        described, log = self._submit_and_wait("training", job.name, request)
        result = self._result("training", job.name, described, log)
        if result.status == "Completed":
            self._adopt_training_output(described, job, result)
        return result

    def run_tuning(self, job: TuningJob) -> JobResult:
        """SageMaker runs the trials and picks the best; the best training job's model lands
        where a training job's would (job.trial.model_prefix)."""
        request = self.request(job)
        described, _ = self._submit_and_wait("tuning", job.name, request)
        result = self._result("tuning", job.name, described, [])
        best = described.get("BestTrainingJob") or {}
        config = request["HyperParameterTuningJobConfig"]
        result.details = json.loads(json.dumps({
            "tuning_job": job.name, "strategy": config["Strategy"], "ran_as": config["Strategy"],
            "objective_metric": job.objective_metric, "objective_type": job.objective_type,
            "best": best or None, "counters": described.get("TrainingJobStatusCounters"),
        }, default=str))  # fmt: skip
        self.store.put_bytes(
            self.run.tuning_record(job.trial.hyperparameters["model_name"]),
            json.dumps(result.details, indent=2).encode(),
        )
        if result.status != "Completed":
            return result
        if not best:
            result.status = "Failed"
            result.failure_reason = f"tuning job {job.name} completed with no best training job"
            return result
        from botocore.exceptions import ClientError

        try:
            trained = self.client.describe_training_job(TrainingJobName=best["TrainingJobName"])
        except ClientError as e:
            result.status = "Failed"
            result.failure_reason = (
                f"the best training job {best['TrainingJobName']} of {job.name} cannot be read: {e}"
            )
            return result
        self._adopt_training_output(trained, job.trial, result)
        return result

    def stop(self) -> None:
        """Stop every job this backend started that has not ended (Ctrl-C, SIGTERM)."""
        with self._lock:
            active = dict(self._active)
        for name, kind in active.items():
            self._stop(name, kind)

    def _stop(self, name: str, kind: str) -> None:
        call = {
            "processing": ("stop_processing_job", "ProcessingJobName"),
            "training": ("stop_training_job", "TrainingJobName"),
            "tuning": ("stop_hyper_parameter_tuning_job", "HyperParameterTuningJobName"),
        }[kind]
        try:
            getattr(self.client, call[0])(**{call[1]: name})
            self._say(name, "stop requested")
        except Exception as e:  # noqa: BLE001 - stopping the others matters more
            self._say(name, f"could not be stopped: {e}")

    def close(self, succeeded: bool) -> None:
        if self.on_close is not None:
            self.on_close()

    # -- submitting and waiting ------------------------------------------------------------------

    def _describe(self, kind: str, name: str) -> dict:
        if kind == "processing":
            d = self.client.describe_processing_job(ProcessingJobName=name)
            return {**d, "Status": d["ProcessingJobStatus"]}
        if kind == "training":
            d = self.client.describe_training_job(TrainingJobName=name)
            return {**d, "Status": d["TrainingJobStatus"]}
        d = self.client.describe_hyper_parameter_tuning_job(HyperParameterTuningJobName=name)
        return {**d, "Status": d["HyperParameterTuningJobStatus"]}

    def _submit_and_wait(self, kind: str, name: str, request: dict) -> tuple[dict, list[str]]:
        from botocore.exceptions import BotoCoreError, ClientError

        create = {
            "processing": self.client.create_processing_job,
            "training": self.client.create_training_job,
            "tuning": self.client.create_hyper_parameter_tuning_job,
        }[kind]
        start = time.time()
        try:
            create(**request)
        except (ClientError, BotoCoreError) as e:
            return {"Status": "Failed", "FailureReason": f"SageMaker refused the job: {e}",
                    "_start": start}, []  # fmt: skip
        with self._lock:
            self._active[name] = kind
        self._say(name, f"{kind} job created")
        log: list[str] = []
        tokens: dict[str, str] = {}
        shown, last_shown = None, 0.0
        try:
            while True:
                described = self._describe(kind, name)
                self._read_logs(kind, name, tokens, log)
                state = (described["Status"], described.get("SecondaryStatus"),
                         json.dumps(described.get("TrainingJobStatusCounters"), default=str))  # fmt: skip
                if state != shown or time.time() - last_shown > 60:
                    elapsed = time.time() - start
                    extra = f" / {state[1]}" if state[1] else ""
                    counters = described.get("TrainingJobStatusCounters")
                    if kind == "tuning" and counters:
                        extra += (
                            " (trials: "
                            + ", ".join(f"{k} {v}" for k, v in counters.items() if v)
                            + ")"
                        )
                    self._say(name, f"{state[0]}{extra}, {elapsed:.0f}s")  # fmt: skip
                    shown, last_shown = state, time.time()
                if described["Status"] in TERMINAL:
                    self._read_logs(kind, name, tokens, log)
                    break
                time.sleep(self.poll_seconds)
        except BaseException:
            # The driver is stopping (Ctrl-C, SIGTERM): so does its job, and what it logged
            # so far is kept with the run.
            self._stop(name, kind)
            self.store.put_bytes(self.run.log(name), ("\n".join(log) + "\n").encode())
            raise
        finally:
            with self._lock:
                self._active.pop(name, None)
        described["_start"] = start
        return described, log

    def _read_logs(self, kind: str, name: str, tokens: dict, log: list[str]) -> None:
        """New lines of the job's CloudWatch log streams, echoed and kept for the run tree."""
        group = LOG_GROUPS.get(kind)
        if group is None or self.logs is None:
            return
        from botocore.exceptions import ClientError

        try:
            streams = self.logs.describe_log_streams(
                logGroupName=group, logStreamNamePrefix=f"{name}/"
            ).get("logStreams", [])
            for stream in streams:
                stream_name = stream["logStreamName"]
                args = {"logGroupName": group, "logStreamName": stream_name, "startFromHead": True}
                if stream_name in tokens:
                    args["nextToken"] = tokens[stream_name]
                while True:
                    page = self.logs.get_log_events(**args)
                    for event in page.get("events", []):
                        line = event["message"].rstrip("\n")
                        log.append(line)
                        host = stream_name.split("/", 1)[-1].rsplit("-", 1)[0]
                        prefix = f"{host}: " if len(streams) > 1 else ""
                        print(f"[{name}] {prefix}{line}", file=self.echo, flush=True)
                    token = page.get("nextForwardToken")
                    if not page.get("events") or token == args.get("nextToken"):
                        tokens[stream_name] = token or args.get("nextToken", "")
                        break
                    args["nextToken"] = tokens[stream_name] = token
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") != "ResourceNotFoundException":
                raise

    def _result(self, kind: str, name: str, described: dict, log: list[str]) -> JobResult:
        status = described["Status"]
        log_key = self.run.log(name)
        self.store.put_bytes(log_key, ("\n".join(log) + "\n").encode())
        reason = None
        if status != "Completed":
            parts = [f"{kind} job {name} ended {status}"]
            if described.get("FailureReason"):
                parts.append(f"FailureReason: {described['FailureReason']}")
            if described.get("ExitMessage"):
                parts.append(f"ExitMessage: {described['ExitMessage']}")
            tail = [line for line in log if line.strip()][-TAIL_LINES:]
            if tail:
                parts.append("last log lines: " + " | ".join(tail))
            reason = "; ".join(parts)
        return JobResult(
            name=name,
            status={"Completed": "Completed", "Stopped": "Stopped"}.get(status, "Failed"),
            failure_reason=reason,
            start_time=described["_start"],
            end_time=time.time(),
            log_key=log_key,
        )

    def _adopt_training_output(self, described: dict, job: TrainingJob, result: JobResult) -> None:
        """model.tar.gz unpacked into job.model_prefix, output.tar.gz into job.output_prefix,
        each with its manifest: the run tree looks the same whichever backend trained."""
        artifacts = described.get("ModelArtifacts", {}).get("S3ModelArtifacts", "")
        model_key = key_of(self.store, artifacts) if artifacts else None
        if not model_key or not self.store.exists(model_key):
            result.status = "Failed"
            result.failure_reason = (
                f"the job completed but left no model.tar.gz at {artifacts or '(none)'}"
            )
            return
        output_key = model_key.rsplit("/", 1)[0] + "/output.tar.gz"
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            for key, prefix in ((model_key, job.model_prefix), (output_key, job.output_prefix)):
                with tempfile.TemporaryDirectory(prefix="smpipe-adopt-") as tmp:
                    archive, folder = Path(tmp) / "archive.tar.gz", Path(tmp) / "files"
                    folder.mkdir()
                    if self.store.exists(key):
                        self.store.download_file(key, archive)
                        with tarfile.open(archive) as tar:
                            tar.extractall(folder, filter=_regular_files)
                    upload_dir(
                        self.store, folder, prefix, {"job_name": described["TrainingJobName"]}
                    )
        except (tarfile.TarError, OSError, ClientError, BotoCoreError) as e:
            result.status = "Failed"
            result.failure_reason = f"the job completed but its output could not be adopted: {e}"


def _regular_files(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
    """tarfile's `data` filter, and links left out: wandb's offline run folder links its debug
    logs to absolute paths in the container, which mean nothing here."""
    if member.issym() or member.islnk():
        return None
    return tarfile.data_filter(member, path)
