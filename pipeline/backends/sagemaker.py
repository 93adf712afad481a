"""The SageMaker backend: the jobs' requests sent to SageMaker, waited on, and their outputs
adopted into the run tree.

`SageMakerBackend` sends each request as pipeline/jobs.py builds it (checked first against
SageMaker's service model: pipeline/service_model.py), follows the job to its end
(pipeline/backends/following.py) and returns its JobResult. What reads SageMaker's answers
afterwards is beside it: `WarmPools`, and plain functions (`billed`, `trials_billed`,
`pool_status`, `adopt_training_output`).
"""

from __future__ import annotations

import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

from pipeline import tuning_record
from pipeline.backend import Earlier
from pipeline.backends.billing import billed, trials_billed
from pipeline.backends.following import (
    PATIENCE_SECONDS,
    TAIL_LINES,
    TERMINAL,
    Followed,
    Following,
    log_tail,
    read_log,
)
from pipeline.backends.lost_create import ours_after_all
from pipeline.backends.resuming import resumed, searched_before, trial_summaries, warm_started
from pipeline.jobs import (
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


class Trials:
    """A SageMaker tuning job's trials, seen from the driver. Every trial shares the tuning
    job's CheckpointConfig.S3Uri, and SageMaker copies everything under it into each new
    trial (model-checkpoints.html; the API takes one CheckpointConfig per training
    definition), so each trial checkpoints in a folder named after itself
    (steps/runtime/variables.py), and that folder is removed once the trial has ended: nothing
    resumes an ended trial, and the trials that start later copy in only what is still running."""

    def __init__(self, backend: SageMakerBackend, job: TuningJob, names: list[str]) -> None:
        self.backend, self.job = backend, job
        # The tuning jobs that searched for `job`: itself, and those a resumed run's one draws
        # on (pipeline/backends/resuming.py); their trials are this model's, tidied and weighed
        # alike.
        self.names = names
        self.tidied: set[str] = set()

    def summaries(self) -> list[dict]:
        # Each named after the tuning job that launched it, as SageMaker names it (its
        # TuningJobName), read from which list it is in where an answer leaves it out.
        found = [
            {"TuningJobName": name, **s}
            for name in self.names
            for s in trial_summaries(self.backend.client, name)
        ]
        return tuning_record.in_creation_order(found)

    def tidy(self, _described: dict) -> list[dict]:
        """Remove the checkpoints of every trial that has ended; return every trial."""
        summaries = self.summaries()
        # Under the request's own CheckpointConfig, where each trial made its folder: what the
        # request said, not what the run tree would say today.
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
        # SageMaker writes a job's archives under <S3OutputPath>/<job name>/
        # (API_OutputDataConfig.html), S3OutputPath being what the request said.
        store, output = self.backend.store, self.job.trial.sagemaker_output
        for name in self.tidied - {keep}:
            for key in store.list_keys(f"{output}{name}/"):
                store.delete(key)

    def keep_logs(self, summaries: list[dict]) -> None:
        """Each trial's CloudWatch log kept in the run tree, as a local trial's is (a trial's
        log is a training job's: logging-cloudwatch.html); one kept before stays."""
        backend = self.backend
        for summary in summaries:
            name, lines = summary["TrainingJobName"], []
            if backend.store.exists(backend.run.log(name)):
                continue
            try:
                read_log(backend.logs, "training", name, {}, lines, lambda *_: None)
            except Exception as e:  # noqa: BLE001 - the trial's outcome stands without its log
                backend.say(self.job.name, f"could not keep the log of trial {name}: {e}")
                continue
            backend.store.put_bytes(backend.run.log(name), ("\n".join(lines) + "\n").encode())

    def failures(self, summaries: list[dict]) -> str:
        """Why trials failed, each with the last lines of its log (three trials at most)."""
        failed = [s for s in summaries if s["TrainingJobStatus"] == "Failed"]
        said = []
        for summary in failed[:3]:
            tail = log_tail(self.backend.logs, summary["TrainingJobName"], self.backend.say)
            why = summary.get("FailureReason", "no reason given")
            said.append(
                f"trial {summary['TrainingJobName']} failed: {why}"
                + (f" (last log lines: {' | '.join(tail)})" if tail else "")
            )
        if len(failed) > 3:
            said.append(f"{len(failed) - 3} more trials failed")
        return "; ".join(said)


class SageMakerBackend:
    """Every job sent to SageMaker, with the operations jobs.KINDS names for its kind. The
    image's entrypoint (steps/entrypoint.py) is what SageMaker starts; the code every job runs
    is the run's `code/` folder, given to each job as an input. The client, the logs client,
    the image and the role are injected: the emulated backend passes moto's."""

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
        self.poll_seconds, self.patience_seconds = poll_seconds, patience_seconds
        self._active: dict[str, str] = {}  # job name -> kind, for stop()
        self.pools = WarmPools(client, self.say)
        self._lock = threading.Lock()
        self.earlier: Earlier | None = None  # what a resumed run's record says (`resumed`)
        self.unbilled: list[dict] = []  # jobs stopped with the driver: kind and name each

    @property
    def image_record(self) -> dict:
        """SageMaker pulls the image each job names by its URI: the tag is resolved there, at
        each job's start, and no Describe* answer says to what."""
        return {"name": self.image}

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

    # -- the Backend protocol (pipeline/backend.py) ---------------------------------------------

    def run_processing(self, job: ProcessingJob) -> JobResult:
        request = self.request(job)
        followed = self._submit_and_wait("processing", job.name, request)
        result = self._result("processing", job.name, followed)
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
        followed = self._submit_and_wait("training", job.name, request)
        described = followed.described
        result = self._result("training", job.name, followed)
        pool = self.pools.after(job.name, request, described)
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
            adopt_training_output(self.store, described, job, result)
        return result

    def run_tuning(self, job: TuningJob) -> JobResult:
        """SageMaker runs the trials and picks the best; the best training job's model lands
        at job.trial.model_prefix (where the export job reads it). While it runs, each ended
        trial's checkpoints are removed; when it ends, every trial's model archive too (the
        best one's once it is unpacked). The result's details are the tuning record
        (pipeline/tuning_record.py), from what SageMaker says of the job and its trials. A
        resumed run's tuning job is warm-started from the run's earlier ones, or not created
        where they searched it all: their best is adopted (pipeline/backends/resuming.py)."""
        request = self.request(job)
        if keep_alive_refused(job):
            self.say(job.name, keep_alive_refused(job))
        parents: list[dict] = []
        if self.earlier is not None:
            request, parents = warm_started(self, job, request)
        names = [p["HyperParameterTuningJobName"] for p in parents]
        if request is None:
            trials = Trials(self, job, names)
            followed = searched_before(job, parents)
        else:
            trials = Trials(self, job, [job.name, *names])
            followed = self._submit_and_wait("tuning", job.name, request, on_poll=trials.tidy)
        described = followed.described
        summaries = trials.tidy(described) if described else []  # none: no job was created
        # Named after the tuning job that searched: none is created where one is adopted.
        searched_by = described.get("HyperParameterTuningJobName", job.name)
        result = self._result("tuning", searched_by, followed)
        # Its own trials: a parent's were billed with the run's earlier attempt, or by `resumed`.
        own = [s for s in summaries if s["TuningJobName"] == job.name]
        result.billing = trials_billed(self, job.name, own)
        trials.keep_logs(summaries)
        best = tuning_record.best_of(described)
        result.details = tuning_record.from_tuning_job(job, described, summaries)
        result.details["tuning_job"] = searched_by
        if result.status == "Completed" and not best:
            result.status = "Failed"
            result.failure_reason = f"tuning job {searched_by} completed with no best training job"
        if result.status != "Completed":
            result.failure_reason = "; ".join(
                filter(None, [result.failure_reason, trials.failures(summaries)])
            )
            return result
        trials.remove_archives(keep=best["TrainingJobName"])
        from botocore.exceptions import ClientError

        try:
            trained = self.client.describe_training_job(TrainingJobName=best["TrainingJobName"])
        except ClientError as e:
            result.status = "Failed"
            result.failure_reason = (
                f"the best training job {best['TrainingJobName']} of {searched_by} cannot be "
                f"read: {e}"
            )
            return result
        adopt_training_output(self.store, trained, job.trial, result)
        if result.status == "Completed":  # unpacked into the run tree: kept once, there
            trials.remove_archives(keep=None)
        return result

    def resumed(self, earlier: Earlier) -> list[dict]:
        """The run was resumed: what its earlier driver left running is stopped and waited
        for, and the bills it did not read are read (pipeline/backends/resuming.py); its
        tuning jobs are warm-started (`run_tuning`)."""
        self.earlier = earlier
        return resumed(self, earlier)

    def stop(self) -> None:
        """Stop every job this backend started that has not ended (Ctrl-C, SIGTERM)."""
        with self._lock:
            active = dict(self._active)
        for name, kind in active.items():
            self.stop_job(name, kind)

    def stop_job(self, name: str, kind: str) -> None:
        """Ask SageMaker to stop one job; said, and a refusal said too."""
        api = KINDS[kind]
        try:
            self._call(api.stop, **{api.name_member: name})
            self.say(name, "stop requested")
        except Exception as e:  # noqa: BLE001 - stopping the others matters more
            self.say(name, f"could not be stopped: {e}")

    def close(self, succeeded: bool) -> None:
        """Nothing of SageMaker's ends with the run (the emulated backend closes its emulator)."""

    # -- submitting and waiting ------------------------------------------------------------------

    def describe_job(self, kind: str, name: str) -> dict:
        """SageMaker's Describe* answer for a job, as it gave it."""
        api = KINDS[kind]
        return self._call(api.describe, **{api.name_member: name})

    def _submit_and_wait(self, kind: str, name: str, request: dict, on_poll=None) -> Followed:
        """Create the job and follow it to its end (pipeline/backends/following.py: a progress
        line when its status changes, and once a minute; its CloudWatch log streamed with the
        job's name in front). A create whose answer was lost is recognised
        (pipeline/backends/lost_create.py). An error
        while following it (throttling beyond botocore's retries, expired credentials, a
        missing logs: permission) is said and the following goes on: the job runs on
        SageMaker whatever this process reads of it."""
        from botocore.exceptions import BotoCoreError, ClientError

        start = time.time()
        problems = refused(KINDS[kind].create, request)
        if problems:  # what AWS would answer, said before anything is sent
            reason = "SageMaker would refuse the request: " + "; ".join(problems)
            return Followed("Failed", {}, start, reason=reason)
        try:
            self._call(KINDS[kind].create, **request)
            created = f"{kind} job created"
        except (ClientError, BotoCoreError) as e:
            created, why = ours_after_all(kind, name, request, e, self.describe_job)
            if created is None:
                return Followed("Failed", {}, start, reason=f"SageMaker refused the job: {e}{why}")
        with self._lock:
            self._active[name] = kind
        self.say(name, created)
        following = Following(self, kind, name, start)
        try:
            return following.to_the_end(on_poll)
        except BaseException:
            # The driver is stopping (Ctrl-C, SIGTERM): so does its job, and what it logged
            # so far is kept with the run. Its bill is SageMaker's once it has ended: read by
            # a --resume (`resumed`).
            self.stop_job(name, kind)
            self.unbilled.append({"kind": kind, "job": name})
            self.store.put_bytes(self.run.log(name), ("\n".join(following.log) + "\n").encode())
            raise
        finally:
            with self._lock:
                self._active.pop(name, None)

    def _result(self, kind: str, name: str, followed: Followed) -> JobResult:
        """The job's log kept in the run tree, and a job that failed or was stopped as one
        paragraph (status, FailureReason, ExitMessage, the last lines of its log). A completed
        one's outputs are sealed with manifests by its caller (files, sizes, sha256, as the
        local backend writes them; a training job's archives: `adopt_training_output`)."""
        status, described = followed.status, followed.described
        log_key = self.run.log(name)
        # Added to, never written over: an adopted tuning job's log, kept by an earlier driver.
        kept = self.store.get_bytes(log_key) if self.store.exists(log_key) else b""
        self.store.put_bytes(log_key, kept + ("\n".join(followed.log) + "\n").encode())
        reason = None
        if status != "Completed":
            parts = [f"{kind} job {name} ended {status}"]
            if followed.failure_reason:
                parts.append(f"FailureReason: {followed.failure_reason}")
            if described.get("ExitMessage"):
                parts.append(f"ExitMessage: {described['ExitMessage']}")
            tail = [line for line in followed.log if line.strip()][-TAIL_LINES:]
            if tail:
                parts.append("last log lines: " + " | ".join(tail))
            reason = "; ".join(parts)
        return JobResult(
            name=name,
            status={"Completed": "Completed", "Stopped": "Stopped"}.get(status, "Failed"),
            failure_reason=reason,
            start_time=followed.start,
            end_time=time.time(),
            log_key=log_key,
            billing=billed(kind, described),
        )


class WarmPools:
    """The run's training jobs' warm pools, one job after the other: whose pool the next job
    may start on, and what each job's pool did."""

    def __init__(self, client, say) -> None:
        self.client, self.say = client, say
        self.last_training: str | None = None  # whose warm pool the next one may start on

    def after(self, name: str, request: dict, described: dict) -> dict:
        """What SageMaker's managed warm pools did for a training job, said and recorded:
        whether it started on the pool the run's previous training job left (that job's
        WarmPoolStatus is then Reused, ReusedByJob this one, with the seconds it was kept:
        API_WarmPoolStatus.html), and whether it left one itself."""
        if "TrainingJobName" not in described:  # refused: no job was created
            return {}
        previous, self.last_training = self.last_training, name
        record: dict = {}
        before = pool_status(self.client, previous) if previous else {}
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
            self.say(name, _pool_line(status, asked))
        return record


def pool_status(client, name: str) -> dict:
    """A training job's WarmPoolStatus now, or {} (absent, or unreadable: it only informs)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return client.describe_training_job(TrainingJobName=name).get("WarmPoolStatus", {})
    except (ClientError, BotoCoreError):
        return {}


def adopt_training_output(
    store: Store, described: dict, job: TrainingJob, result: JobResult
) -> None:
    """model.tar.gz unpacked into job.model_prefix, output.tar.gz into job.output_prefix,
    each with its manifest: the run tree looks the same whichever backend trained."""
    artifacts = described.get("ModelArtifacts", {}).get("S3ModelArtifacts", "")
    model_key = key_of(store, artifacts) if artifacts else None
    if not model_key or not store.exists(model_key):
        result.status = "Failed"
        result.failure_reason = (
            f"the job completed but left no model.tar.gz at {artifacts or '(none)'}"
        )
        return
    # /opt/ml/output/data is uploaded compressed (model-train-storage-uncompressed.html) as
    # output.tar.gz beside the model.tar.gz the job reported: read where SageMaker put it.
    output_key = model_key.rsplit("/", 1)[0] + "/output.tar.gz"
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        for key, prefix in ((model_key, job.model_prefix), (output_key, job.output_prefix)):
            with tempfile.TemporaryDirectory(prefix="smpipe-adopt-") as tmp:
                archive, folder = Path(tmp) / "archive.tar.gz", Path(tmp) / "files"
                folder.mkdir()
                if store.exists(key):
                    store.download_file(key, archive)
                    with tarfile.open(archive) as tar:
                        tar.extractall(folder, filter=_regular_files)
                upload_dir(store, folder, prefix, {"job_name": described["TrainingJobName"]})
    except (tarfile.TarError, OSError, ClientError, BotoCoreError) as e:
        result.status = "Failed"
        result.failure_reason = f"the job completed but its output could not be adopted: {e}"


def _pool_line(status: str | None, asked: int) -> str:
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


def _regular_files(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
    """tarfile's `data` filter, and links left out: wandb's offline run folder links its debug
    logs to absolute paths in the container, which mean nothing here."""
    if member.issym() or member.islnk():
        return None
    return tarfile.data_filter(member, path)
