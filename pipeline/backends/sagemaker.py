"""The SageMaker backend: the jobs' requests sent to SageMaker, waited on, and their outputs
adopted into the run tree.

Each request is built by pipeline/jobs.py from the job description, checked against every
constraint of SageMaker's service model (pipeline/service_model.py: boto3's own check covers
required members, types and minimum lengths only), and sent as it is, with the operations
jobs.KINDS names for its kind. The image's entrypoint (steps/entrypoint.py) is what SageMaker
starts; the code every job runs is the run's `code/` folder, given to each job as an input.
The client, the logs client, the image and the role are injected: the emulated backend passes
moto's.

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

from pipeline.cost import spot_savings
from pipeline.jobs import (
    ENDED,
    KINDS,
    JobResult,
    ProcessingJob,
    TrainingJob,
    TuningJob,
    keep_alive_refused,
    request_for,
)
from pipeline.paths import RunTree
from pipeline.service_model import refused
from pipeline.store import Store, key_of, seal_prefix, upload_dir

TERMINAL = ENDED  # a job's status that no longer changes
LOG_GROUPS = {
    "training": "/aws/sagemaker/TrainingJobs",
    "processing": "/aws/sagemaker/ProcessingJobs",
}
TAIL_LINES = 5


def trial_record(summary: dict) -> dict:
    """What the run keeps of one trial (a TrainingJobSummary of
    ListTrainingJobsForHyperParameterTuningJob)."""
    objective = summary.get("FinalHyperParameterTuningJobObjectiveMetric") or {}
    return {
        "job_name": summary["TrainingJobName"],
        "status": summary["TrainingJobStatus"],
        "hyperparameters": summary.get("TunedHyperParameters", {}),
        "objective": objective.get("Value"),
        "failure_reason": summary.get("FailureReason"),
    }


def billed(kind: str, described: dict) -> list[dict]:
    """What a job that ran bills, as its Describe* call reports it (pipeline/cost.py prices
    it). A training job: BillableTimeInSeconds ("the absolute wall-clock time ... Multiply
    BillableTimeInSeconds by the number of instances (InstanceCount)") and TrainingTimeInSeconds,
    spot savings from the two (DescribeTrainingJob, botocore's sagemaker service-2.json).
    DescribeProcessingJob reports no billable time: a processing job's is estimated as
    ProcessingEndTime - ProcessingStartTime on each of its instances. A request SageMaker
    refused, or a job that never started, bills nothing."""
    if kind == "training" and described.get("ResourceConfig"):
        resources = described["ResourceConfig"]
        billable, training = (
            described.get("BillableTimeInSeconds"),
            described.get("TrainingTimeInSeconds"),
        )
        record = {
            "job": described["TrainingJobName"],
            "use": "training",
            "instance_type": resources["InstanceType"],
            "instance_count": resources["InstanceCount"],
            "billable_seconds": billable,
            "training_seconds": training,
        }
        if described.get("EnableManagedSpotTraining"):
            record["spot_savings_percent"] = spot_savings(billable, training)
        return [record]
    cluster = (described.get("ProcessingResources") or {}).get("ClusterConfig")
    if kind == "processing" and cluster and described.get("ProcessingStartTime"):
        start, end = described["ProcessingStartTime"], described.get("ProcessingEndTime")
        seconds = max(1, round((end - start).total_seconds())) if end else None
        return [
            {
                "job": described["ProcessingJobName"],
                "use": "processing",
                "instance_type": cluster["InstanceType"],
                "instance_count": cluster["InstanceCount"],
                "billable_seconds": seconds,
                "estimated_from": "ProcessingStartTime to ProcessingEndTime",
            }
        ]
    return []


class Trials:
    """A SageMaker tuning job's trials, seen from the driver. Every trial shares the tuning
    job's CheckpointConfig.S3Uri, and SageMaker copies everything under it into each new
    trial (model-checkpoints.html; the API takes one CheckpointConfig per training
    definition), so each trial checkpoints in a folder named after itself
    (steps/entrypoint.py) and that folder is removed once the trial has ended: nothing resumes
    an ended trial, and the trials that start later copy in only what is still running."""

    def __init__(self, backend: SageMakerBackend, job: TuningJob) -> None:
        self.backend, self.job = backend, job
        self.tidied: set[str] = set()

    def summaries(self) -> list[dict]:
        client, found, token = self.backend.client, [], None
        while True:
            args = {"HyperParameterTuningJobName": self.job.name, "MaxResults": 100}
            page = client.list_training_jobs_for_hyper_parameter_tuning_job(
                **args, **({"NextToken": token} if token else {})
            )
            found += page.get("TrainingJobSummaries", [])
            token = page.get("NextToken")
            if not token:
                return found

    def tidy(self, _described: dict) -> list[dict]:
        """Remove the checkpoints of every trial that has ended; return every trial."""
        summaries = self.summaries()
        store, prefix = self.backend.store, self.job.trial.checkpoint_prefix
        for summary in summaries:
            name = summary["TrainingJobName"]
            if summary["TrainingJobStatus"] in TERMINAL and name not in self.tidied:
                for key in store.list_keys(f"{prefix}{name}/"):
                    store.delete(key)
                self.tidied.add(name)
        return summaries

    def remove_archives(self, keep: str | None) -> None:
        """The model and output archives SageMaker left for every trial but `keep`."""
        store, output = self.backend.store, self.job.trial.sagemaker_output
        for name in self.tidied - {keep}:
            for key in store.list_keys(f"{output}{name}/"):
                store.delete(key)

    def failures(self, summaries: list[dict]) -> str:
        """Why trials failed, each with the last lines of its log (three trials at most)."""
        failed = [s for s in summaries if s["TrainingJobStatus"] == "Failed"]
        said = []
        for summary in failed[:3]:
            tail = self.backend.log_tail(summary["TrainingJobName"])
            why = summary.get("FailureReason", "no reason given")
            said.append(
                f"trial {summary['TrainingJobName']} failed: {why}"
                + (f" (last log lines: {' | '.join(tail)})" if tail else "")
            )
        if len(failed) > 3:
            said.append(f"{len(failed) - 3} more trials failed")
        return "; ".join(said)


# How long the status of a running job may be unreadable before the driver gives up on it
# (and says how to look it up); a job's own MaxRuntimeInSeconds is not shortened by this.
PATIENCE_SECONDS = 15 * 60


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
        patience_seconds: float = PATIENCE_SECONDS,
    ) -> None:
        self.store, self.run = store, run
        self.client, self.logs = client, logs_client
        self.image, self.role = image_uri, role_arn
        self.echo = echo if echo is not None else sys.stdout
        self.poll_seconds = poll_seconds
        self.patience_seconds = patience_seconds
        self._active: dict[str, str] = {}  # job name -> kind, for stop()
        self._last_training: str | None = None  # whose warm pool the next one may start on
        self.on_close = None  # what else ends with the run (the emulator's players)
        self._lock = threading.Lock()

    def request(self, job) -> dict:
        """The request a job becomes."""
        return request_for(job, self.image, self.role, self.store.uri_of)

    def say(self, job_name: str, text: str) -> None:
        print(f"[{job_name}] {text}", file=self.echo, flush=True)

    def _call(self, operation: str, **request) -> dict:
        """The client's method for one of SageMaker's operations (CreateTrainingJob ->
        create_training_job, as botocore names them)."""
        from botocore import xform_name

        return getattr(self.client, xform_name(operation))(**request)

    # -- the Backend protocol (pipeline/backends/__init__.py) -----------------------------------

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
        if keep_alive_refused(job):
            self.say(job.name, keep_alive_refused(job))
        described, log = self._submit_and_wait("training", job.name, request)
        result = self._result("training", job.name, described, log)
        pool = self._warm_pool(job.name, request, described)
        if pool:
            result.details["warm_pool"] = pool
        if pool.get("previous_pool_billable_seconds") is not None:  # billed as training
            resources = request["ResourceConfig"]  # the pool's: a match has the same (warm_pools)
            result.billing.append(
                {
                    "job": pool["previous_job"],
                    "use": "warm pool",
                    "instance_type": resources["InstanceType"],
                    "instance_count": resources["InstanceCount"],
                    "billable_seconds": pool["previous_pool_billable_seconds"],
                }
            )
        if result.status == "Completed":
            self._adopt_training_output(described, job, result)
        return result

    def run_tuning(self, job: TuningJob) -> JobResult:
        """SageMaker runs the trials and picks the best; the best training job's model lands
        at job.trial.model_prefix (where the export job reads it). While it runs, each ended
        trial's checkpoints are removed; when it ends, every trial's model archive too (the
        best one's once it is unpacked)."""
        request = self.request(job)
        if keep_alive_refused(job):
            self.say(job.name, keep_alive_refused(job))
        trials = Trials(self, job)
        described, _ = self._submit_and_wait("tuning", job.name, request, on_poll=trials.tidy)
        summaries = trials.tidy(described) if described.get("Status") in TERMINAL else []
        result = self._result("tuning", job.name, described, [])
        result.billing = self._trials_billed(job.name, summaries or [])
        best = described.get("BestTrainingJob") or {}
        config = request["HyperParameterTuningJobConfig"]
        details = {
            "tuning_job": job.name,
            "strategy": config["Strategy"],
            "ran_as": config["Strategy"],
            "objective_metric": job.objective_metric,
            "objective_type": job.objective_type,
            "best": best or None,
            "counters": described.get("TrainingJobStatusCounters"),
            "trials": [trial_record(t) for t in summaries or []],
        }
        result.details = json.loads(json.dumps(details, default=str))
        self.store.put_bytes(
            self.run.tuning_record(job.trial.hyperparameters["model_name"]),
            json.dumps(result.details, indent=2).encode(),
        )
        if result.status == "Completed" and not best:
            result.status = "Failed"
            result.failure_reason = f"tuning job {job.name} completed with no best training job"
        if result.status != "Completed":
            result.failure_reason = "; ".join(
                filter(None, [result.failure_reason, trials.failures(summaries or [])])
            )
            return result
        trials.remove_archives(keep=best["TrainingJobName"])
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
        if result.status == "Completed":  # unpacked into the run tree: kept once, there
            trials.remove_archives(keep=None)
        return result

    def _trials_billed(self, tuning_job: str, summaries: list[dict]) -> list[dict]:
        """A tuning job bills its training jobs: each trial's DescribeTrainingJob (the
        summaries ListTrainingJobsForHyperParameterTuningJob gives carry no billable time)."""
        from botocore.exceptions import BotoCoreError, ClientError

        records = []
        for summary in summaries:
            try:
                described = self.client.describe_training_job(
                    TrainingJobName=summary["TrainingJobName"]
                )
            except (ClientError, BotoCoreError) as e:
                trial = summary["TrainingJobName"]
                self.say(tuning_job, f"could not read what trial {trial} billed: {e}")
                continue
            records += [{**b, "tuning_job": tuning_job} for b in billed("training", described)]
        return records

    def _warm_pool(self, name: str, request: dict, described: dict) -> dict:
        """What SageMaker's managed warm pools did for a training job, said and recorded:
        whether it started on the pool the run's previous training job left (that job's
        WarmPoolStatus is then Reused, ReusedByJob this one, with the seconds it was kept:
        API_WarmPoolStatus.html), and whether it left one itself."""
        if "TrainingJobName" not in described:  # refused: no job was created
            return {}
        previous, self._last_training = self._last_training, name
        record: dict = {}
        before = self._pool_status(previous) if previous else {}
        # The previous job's pool, billed as training compute for the seconds it was kept
        # ("ResourceRetainedBillableTimeInSeconds * InstanceCount", API_WarmPoolStatus), once
        # it was reused or has ended; still Available, its time is not known yet.
        if before.get("ResourceRetainedBillableTimeInSeconds"):
            kept = before["ResourceRetainedBillableTimeInSeconds"]
            record |= {"previous_job": previous, "previous_pool_billable_seconds": kept}
        if before.get("ReusedByJob") == name:
            kept = before.get("ResourceRetainedBillableTimeInSeconds")
            record |= {"started_on_pool_of": previous, "pool_kept_seconds": kept}
            self.say(name, f"started on the warm pool {previous} left (kept {kept} s, billed)")
        asked = request["ResourceConfig"].get("KeepAlivePeriodInSeconds")
        if asked:
            status = (described.get("WarmPoolStatus") or {}).get("Status")
            record |= {"keep_alive_seconds": asked, "pool_status_at_end": status}
            self.say(name, _pool_said(status, asked))
        return record

    def _pool_status(self, name: str) -> dict:
        """A training job's WarmPoolStatus now, or {} (absent, or unreadable: it only informs)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return self.client.describe_training_job(TrainingJobName=name).get("WarmPoolStatus", {})
        except (ClientError, BotoCoreError):
            return {}

    def stop(self) -> None:
        """Stop every job this backend started that has not ended (Ctrl-C, SIGTERM)."""
        with self._lock:
            active = dict(self._active)
        for name, kind in active.items():
            self._stop(name, kind)

    def _stop(self, name: str, kind: str) -> None:
        api = KINDS[kind]
        try:
            self._call(api.stop, **{api.name_member: name})
            self.say(name, "stop requested")
        except Exception as e:  # noqa: BLE001 - stopping the others matters more
            self.say(name, f"could not be stopped: {e}")

    def close(self, succeeded: bool) -> None:
        if self.on_close is not None:
            self.on_close()

    # -- submitting and waiting ------------------------------------------------------------------

    def _describe(self, kind: str, name: str) -> dict:
        api = KINDS[kind]
        described = self._call(api.describe, **{api.name_member: name})
        return {**described, "Status": described[api.status_member]}

    def _ours_after_all(
        self, kind: str, name: str, request: dict, error: Exception
    ) -> tuple[str | None, str]:
        """A create that failed, and the job SageMaker may have made of it all the same.

        CreateTrainingJob, CreateProcessingJob and CreateHyperParameterTuningJob take no
        client token (only CreateModelPackage has an idempotencyToken member in botocore's
        sagemaker service-2.json), and botocore retries a call whose connection dropped
        (botocore/retries/standard.py: ConnectionError and HTTPClientError are transient): a
        create that SageMaker carried out but whose answer was lost is sent again, and the
        retry is refused with ResourceInUse ("a training job with this name already exists").
        That job runs and bills. So a ResourceInUse to a retry, or a dropped connection, is
        followed by a Describe of the name: a job that shows this very request (`_not_ours`:
        its role, image, every S3 location, its arguments, hyperparameters and environment; its
        S3 locations lie in this run's tree) is adopted and followed as if the create had
        answered; any other is refused, saying why. Returns (what to say of the adopted job,
        or None; the reason)."""
        from botocore import xform_name
        from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError

        response = getattr(error, "response", None) or {}
        code = response.get("Error", {}).get("Code", "")
        # botocore records how many times it resent the call (endpoint.py: "We want to share
        # num retries, not num attempts": ResponseMetadata.RetryAttempts). A ResourceInUse to
        # the first attempt means the name was taken before this call: that job is not ours.
        retried = response.get("ResponseMetadata", {}).get("RetryAttempts", 0)
        if not (code == "ResourceInUse" and retried) and not isinstance(error, HTTPClientError):
            return None, ""
        try:
            described = self._describe(kind, name)
        except ClientError:  # no job of that name: the create was not carried out
            return None, ""
        except BotoCoreError as e:
            api = KINDS[kind]
            return None, (
                f"; whether SageMaker created it could not be read ({e}): "
                f"`aws sagemaker {xform_name(api.describe, '-')} "
                f"--{xform_name(api.name_member, '-')} {name}` tells"
            )
        differences = _not_ours(kind, request, described)
        if differences:
            return None, (
                f"; the {kind} job {name} that exists is not this request "
                f"({'; '.join(differences)})"
            )
        lost = "its retry was refused" if code == "ResourceInUse" else "its answer was lost"
        describe = KINDS[kind].describe
        return f"{kind} job created ({lost}; {describe} shows this very request: adopted)", ""

    def _submit_and_wait(
        self, kind: str, name: str, request: dict, on_poll=None
    ) -> tuple[dict, list[str]]:
        """Create the job and follow it to its end: its status and log each poll, `on_poll`
        (a tuning job's housekeeping) after each. An error while following it (throttling
        beyond botocore's retries, expired credentials, a missing logs: permission) is said and
        the following goes on: the job runs on SageMaker whatever this process reads of it."""
        from botocore.exceptions import BotoCoreError, ClientError

        start = time.time()
        problems = refused(kind, request)
        if problems:  # what AWS would answer, said before anything is sent
            reason = "SageMaker would refuse the request: " + "; ".join(problems)
            return {"Status": "Failed", "FailureReason": reason, "_start": start}, []
        try:
            self._call(KINDS[kind].create, **request)
            created = f"{kind} job created"
        except (ClientError, BotoCoreError) as e:
            created, why = self._ours_after_all(kind, name, request, e)
            if created is None:
                reason = f"SageMaker refused the job: {e}{why}"
                return {"Status": "Failed", "FailureReason": reason, "_start": start}, []
        with self._lock:
            self._active[name] = kind
        self.say(name, created)
        log: list[str] = []
        follow = Following(self, kind, name, start)
        try:
            while True:
                described = follow.describe()
                follow.read_logs(log)
                if described is not None and on_poll is not None:
                    follow.guarded("tidy its trials", on_poll, described)
                if described is not None and described["Status"] in TERMINAL:
                    follow.read_logs(log)
                    break
                if follow.given_up():
                    described = follow.lost()
                    break
                time.sleep(follow.pause())
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
                    host = stream_name.split("/", 1)[-1].rsplit("-", 1)[0]
                    for event in page.get("events", []):
                        line = event["message"].rstrip("\n")
                        line = f"{host}: {line}" if len(streams) > 1 else line  # whose line
                        log.append(line)
                        self.say(name, line)
                    token = page.get("nextForwardToken")
                    if not page.get("events") or token == args.get("nextToken"):
                        tokens[stream_name] = token or args.get("nextToken", "")
                        break
                    args["nextToken"] = tokens[stream_name] = token
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") != "ResourceNotFoundException":
                raise

    def log_tail(self, name: str, lines: int = TAIL_LINES) -> list[str]:
        """The last lines a training job (a tuning trial) wrote to CloudWatch, or []."""
        log: list[str] = []
        try:
            self._read_logs("training", name, {}, log)
        except Exception:  # noqa: BLE001 - a tail is a courtesy; the reason is said without it
            return []
        return [line for line in log if line.strip()][-lines:]

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
            billing=billed(kind, described),
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


def _identity(kind: str, message: dict) -> dict:
    """What makes a Create* request this run's own, read alike from the request and from the
    Describe* answer (which repeats the request's members under the same names, botocore's
    sagemaker service-2.json): field -> value; maps of hyperparameters and environment compared
    key by key (SageMaker may add keys of its own to what it reports, never change ours)."""
    if kind == "processing":
        app = message.get("AppSpecification") or {}
        inputs = message.get("ProcessingInputs")
        outputs = (message.get("ProcessingOutputConfig") or {}).get("Outputs")
        return {
            "RoleArn": message.get("RoleArn"),
            "AppSpecification.ImageUri": app.get("ImageUri"),
            "AppSpecification.ContainerArguments": app.get("ContainerArguments"),
            "ProcessingInputs": None
            if inputs is None
            else {i.get("InputName"): (i.get("S3Input") or {}).get("S3Uri") for i in inputs},
            "ProcessingOutputConfig.Outputs": None
            if outputs is None
            else {o.get("OutputName"): (o.get("S3Output") or {}).get("S3Uri") for o in outputs},
            "Environment": message.get("Environment"),
        }
    tuning = kind == "tuning"
    definition = (message.get("TrainingJobDefinition") or {}) if tuning else message
    channels = definition.get("InputDataConfig")
    return {
        "RoleArn": definition.get("RoleArn"),
        "AlgorithmSpecification.TrainingImage": (
            definition.get("AlgorithmSpecification") or {}
        ).get("TrainingImage"),
        "InputDataConfig": None
        if channels is None
        else {
            c.get("ChannelName"): ((c.get("DataSource") or {}).get("S3DataSource") or {}).get(
                "S3Uri"
            )
            for c in channels
        },
        "OutputDataConfig.S3OutputPath": (definition.get("OutputDataConfig") or {}).get(
            "S3OutputPath"
        ),
        "CheckpointConfig.S3Uri": (definition.get("CheckpointConfig") or {}).get("S3Uri"),
        "StaticHyperParameters" if tuning else "HyperParameters": definition.get(
            "StaticHyperParameters" if tuning else "HyperParameters"
        ),
        "Environment": definition.get("Environment"),
    }


# What a Describe* answer must report for a job to be recognised as ours at all.
IDENTIFYING = ("RoleArn", "AppSpecification.ImageUri", "AlgorithmSpecification.TrainingImage")


def _not_ours(kind: str, request: dict, described: dict) -> list[str]:
    """How the job SageMaker describes differs from the request we sent; [] when it is ours.
    A member the answer does not report is no evidence either way, but the role and image
    must be there."""
    sent, seen = _identity(kind, request), _identity(kind, described)
    said = [f for f in IDENTIFYING if f in sent and sent[f] is not None and seen.get(f) is None]
    if said:
        return [f"{', '.join(said)} not reported"]
    differences = []
    for field, ours in sent.items():
        theirs = seen.get(field)
        if ours is None or theirs is None:
            continue
        if isinstance(ours, dict) and field in (
            "HyperParameters",
            "StaticHyperParameters",
            "Environment",
        ):
            changed = sorted(k for k, v in ours.items() if theirs.get(k) != v)
            if changed:
                differences.append(f"{field} differs at {', '.join(changed)}")
        elif ours != theirs:
            differences.append(f"{field} is {_shown(theirs)}, not {_shown(ours)}")
    return differences


def _shown(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 120 else text[:100] + "..."


def _pool_said(status: str | None, asked: int) -> str:
    """A training job's warm pool as it ended (train-warm-pools.html: Available while kept;
    Terminated when none could be kept: "The default resource limit for warm pools is 0")."""
    if status == "Available":
        return (
            f"warm pool Available: its instances wait up to {asked} s, billed, for the next "
            "matching training job ([training] KEEP_ALIVE_SECONDS)"
        )
    if status == "Terminated":
        return (
            "no warm pool kept (WarmPoolStatus Terminated): SageMaker keeps one only within the "
            "account's warm pool quota, 0 until an increase is requested (Service Quotas); "
            "[training] KEEP_ALIVE_SECONDS = 0 stops asking"
        )
    return f"warm pool {status or 'not reported'} ([training] KEEP_ALIVE_SECONDS = {asked})"


class Following:
    """What the driver reads of one job while it runs, and what it does when reading fails:
    each kind of failure said once, the pause between polls doubled up to a minute, the logs
    given up for this job on a permission error, the job given up after PATIENCE_SECONDS of
    unreadable status (it is asked to stop: nobody would see its end)."""

    def __init__(self, backend: SageMakerBackend, kind: str, name: str, start: float) -> None:
        self.backend, self.kind, self.name, self.start = backend, kind, name, start
        self.tokens: dict[str, str] = {}
        self.shown, self.last_shown = None, 0.0
        self.failing_since: float | None = None
        self.last_error = ""
        self.logs_off = False
        self.said: set[str] = set()

    def _say_once(self, what: str, error: Exception) -> None:
        code = getattr(error, "response", {}).get("Error", {}).get("Code", type(error).__name__)
        if (what, code) not in self.said:
            self.said.add((what, code))
            self.backend.say(
                self.name, f"could not {what}: {error}; the job goes on, and so does the driver"
            )

    def guarded(self, what: str, call, *args):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return call(*args)
        except (ClientError, BotoCoreError) as e:
            self._say_once(what, e)
            return None

    def describe(self) -> dict | None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            described = self.backend._describe(self.kind, self.name)
        except (ClientError, BotoCoreError) as e:
            self._say_once("read its status", e)
            self.failing_since = self.failing_since or time.time()
            self.last_error = str(e)
            return None
        self.failing_since = None
        self._show(described)
        return described

    def _show(self, described: dict) -> None:
        state = (
            described["Status"],
            described.get("SecondaryStatus"),
            json.dumps(described.get("TrainingJobStatusCounters"), default=str),
        )
        if state == self.shown and time.time() - self.last_shown <= 60:
            return
        extra = f" / {state[1]}" if state[1] else ""
        counters = described.get("TrainingJobStatusCounters")
        if self.kind == "tuning" and counters:
            extra += " (trials: " + ", ".join(f"{k} {v}" for k, v in counters.items() if v) + ")"
        self.backend.say(self.name, f"{state[0]}{extra}, {time.time() - self.start:.0f}s")
        self.shown, self.last_shown = state, time.time()

    def read_logs(self, log: list[str]) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        if self.logs_off:
            return
        try:
            self.backend._read_logs(self.kind, self.name, self.tokens, log)
        except (ClientError, BotoCoreError) as e:
            self._say_once("read its CloudWatch log", e)
            code = getattr(e, "response", {}).get("Error", {}).get("Code", "")
            if "AccessDenied" in code or "Unrecognized" in code:
                self.logs_off = True  # a permission does not come back by asking again

    def pause(self) -> float:
        if self.failing_since is None:
            return self.backend.poll_seconds
        failing = time.time() - self.failing_since
        return min(60.0, max(self.backend.poll_seconds, failing / 4))

    def given_up(self) -> bool:
        return (
            self.failing_since is not None
            and time.time() - self.failing_since > self.backend.patience_seconds
        )

    def lost(self) -> dict:
        from botocore import xform_name

        self.backend._stop(self.name, self.kind)
        minutes = (time.time() - self.failing_since) / 60
        api = KINDS[self.kind]  # the AWS CLI's spelling of the operation and its name member
        how = f"{xform_name(api.describe, '-')} --{xform_name(api.name_member, '-')} {self.name}"
        return {
            "Status": "Failed",
            "FailureReason": (
                f"its status could not be read for {minutes:.0f} minutes ({self.last_error}); "
                f"it was asked to stop; `aws sagemaker {how}` tells how it ended"
            ),
        }


def _regular_files(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
    """tarfile's `data` filter, and links left out: wandb's offline run folder links its debug
    logs to absolute paths in the container, which mean nothing here."""
    if member.issym() or member.islnk():
        return None
    return tarfile.data_filter(member, path)
