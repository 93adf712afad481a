"""The embedded backend: every job is the image's entrypoint, started here as SageMaker would.

A job becomes the same request the SageMaker backend sends (pipeline/jobs.py); the job root
is laid out from it (pipeline/player/) and the entrypoint runs in it. Outputs go to the
store as manifested directories; checkpoints are mirrored to the store after each attempt,
and an interrupted training job is restarted from them up to MAX_RESTARTS times, as
SageMaker restarts a spot job. Tuning runs here too (pipeline/backends/local_tuning.py): its
trials are local training jobs.

Jobs start warm (pipeline/player/fork_client.py): from a run's second job on (from its
first where an earlier run of this process left a server of the same environment), a fork server
that has already imported torch, transformers and the rest forks each job's entrypoint, which
forks its step, saving the seconds of imports every job pays; each job is still a process of
its own with exactly its own environment, job root and code. SMPIPE_WARM_START=0 starts every
job cold (a new interpreter), for debugging.
"""

from __future__ import annotations

import shutil
import sys
import time
import weakref
from contextlib import contextmanager, nullcontext
from pathlib import Path

from pipeline.backend import LOCAL_IMAGE, LOCAL_ROLE, Earlier, Watch
from pipeline.backends.local_tuning import run_local_tuning
from pipeline.jobs import (
    KINDS,
    JobResult,
    ProcessingJob,
    TrainingJob,
    TuningJob,
    request_for,
)
from pipeline.paths import RunTree
from pipeline.player.environment import user_cache_folder
from pipeline.player.exits import status_after
from pipeline.player.fork_client import WARM_FOLDER, WarmStart, warm_start_enabled
from pipeline.player.job_root import (
    gathered,
    new_work_root,
    processing_outputs,
    remove_orphaned_work_roots,
)
from pipeline.player.play import play_processing, play_training
from pipeline.player.processes import Containers, ProcessLauncher
from pipeline.service_model import as_if_on_s3, refused
from pipeline.store import LocalStore, Store, StoreError, upload_dir
from steps.runtime.names import MODEL_DIR, OUTPUT_DATA_DIR


def result_of(
    name: str, exits: list, log_key: str, *, stop_requested: bool, restarts: int = 0
) -> JobResult:
    """The job's result as SageMaker would report it (status_after), with what this machine
    measured: its peak memory and the metrics its log showed."""
    status, reason = status_after(exits, stop_requested=stop_requested)
    peaks = [e.peak_rss_mb for e in exits if e.peak_rss_mb]
    cpu = [e.cpu_seconds for e in exits if e.cpu_seconds is not None]
    peak = round(sum(peaks), 1) if peaks else None
    # What it used here, every host and attempt: CPU-seconds and peak memory, never dollars.
    used = {"job": name, "use": "local", "cpu_seconds": round(sum(cpu), 2) if cpu else None}
    metrics: dict[str, float] = {}
    for e in exits:
        metrics.update(e.metrics)
    return JobResult(
        name=name,
        status=status,
        failure_reason=reason or ("stopped on request" if status == "Stopped" else None),
        start_time=min(e.start for e in exits),
        end_time=max(e.end for e in exits),
        peak_memory_mb=peak,
        restarts=restarts,
        log_key=log_key,
        metrics=metrics,
        billing=[used | {"peak_memory_mb": peak}],
    )


def local_restart(exits: list, restarts: int, max_restarts: int) -> bool:
    """This machine's rule, [training] MAX_RESTARTS: a job that was interrupted (it wrote a
    checkpoint on SIGTERM) or killed by a signal (the out-of-memory killer) starts again from
    its checkpoint. SageMaker restarts only a spot job that lost its instance (the emulated
    backend plays that rule)."""
    return restarts < max_restarts and any(e.interrupted or e.killed for e in exits)


def kept_jobs_folder(store: Store, run: RunTree) -> Path:
    """Where the folders of `run`'s failed local jobs are kept for inspection: in the run's own
    folder when the store is a folder on this machine (<store>/<experiment>/runs/<NNNN>/
    failed-jobs/), so that they go with the run; otherwise in this user's cache folder, under
    the store's and the run's names ($XDG_CACHE_HOME, by default ~/.cache, then
    smpipe/failed-jobs/<bucket>/<prefix>/<experiment>/runs/<NNNN>/). Never the system's
    temporary folder, where nothing would remove them. They are removed when the run
    completes (a resumed run included) and by `smpipe prune` (pipeline/prune.py
    `remove_kept_jobs`)."""
    if isinstance(store, LocalStore):
        return Path(store.uri_of(run.failed_jobs))
    where = store.uri_of(run.prefix).split("://", 1)[-1]  # bucket/prefix/experiment/runs/NNNN/
    return user_cache_folder("failed-jobs", where)


class LocalBackend:
    name = "local"
    client = None  # nothing is sent to SageMaker (Backend.client)
    image_record = None  # jobs are processes of this machine

    def __init__(
        self,
        store: Store,
        run: RunTree,
        echo=None,
        work_root: str | None = None,
        kept_root: str | None = None,
    ) -> None:
        """`work_root`: where jobs run (a new folder of the system's temporary one by
        default); `kept_root`: where failed jobs' folders are kept (`kept_jobs_folder`)."""
        self.store, self.run = store, run
        self.kept_root = Path(kept_root) if kept_root else kept_jobs_folder(store, run)
        self.echo = echo if echo is not None else sys.stdout
        if work_root is None:
            remove_orphaned_work_roots(self.echo)
            self.work_root = new_work_root(run.prefix)
        else:
            self.work_root = Path(work_root)
            self.work_root.mkdir(parents=True, exist_ok=True)
        self.warm = (
            WarmStart(self.work_root / WARM_FOLDER, self.echo) if warm_start_enabled() else None
        )
        # Tests and tools drop a backend without close(): its fork servers are left as close()
        # leaves them (warm_start.IDLE).
        self._finalizer = weakref.finalize(self, self.warm.close) if self.warm else None
        self.containers = Containers(ProcessLauncher(starter=self.warm))
        # Every job's JobResult.billing so far: a tuning job bills its trials'.
        self.billed: list[dict] = []
        # Jobs stopped with the driver (Ctrl-C) before what they used was measured: the run's
        # CPU-seconds are then a lower bound (`Backend.unbilled`; a local job bills nothing).
        self.unbilled: list[dict] = []

    def say(self, job_name: str, text: str) -> None:
        print(f"[{job_name}] {text}", file=self.echo, flush=True)

    def _speaker(self, job_name: str):
        """`say` for one job: what a container's lines are handed to."""
        return lambda line: self.say(job_name, line)

    def _stop_requested(self, job_name: str) -> bool:
        """Whether a stop reached the job while it ran (status_after: it is then Stopped)."""
        return self.containers.stop_reached(job_name)

    def _log_path(self, name: str) -> Path:
        return self.work_root / f"{name}.log"

    def _upload_log(self, name: str) -> str:
        key = self.run.log(name)
        if self._log_path(name).exists():
            self.store.upload_file(self._log_path(name), key)
        return key

    # -- the Backend protocol (pipeline/backend.py) ---------------------------------------------

    def _request(self, job) -> tuple[dict, JobResult | None]:
        """The request SageMaker would get for `job`, and a Failed result when SageMaker would
        refuse it: the local backend plays only requests that AWS accepts."""
        request = request_for(job, LOCAL_IMAGE, LOCAL_ROLE, self.store.uri_of)
        problems = refused(KINDS[job.kind].create, as_if_on_s3(request))
        if not problems:
            return request, None
        now = time.time()
        reason = "SageMaker would refuse the request: " + "; ".join(problems)
        return request, JobResult(job.name, "Failed", reason, now, now)

    @contextmanager
    def _measured(self, kind: str, name: str):
        """A job whose JobResult never reaches the run (the driver stopping: Ctrl-C, SIGTERM,
        an error) had what it used measured, or not, but no section holds it: it is named in
        `unbilled`, and the run's CPU-seconds are a lower bound."""
        try:
            yield
        except BaseException:
            self.unbilled.append({"kind": kind, "job": name})
            raise

    def run_processing(self, job: ProcessingJob) -> JobResult:
        with self._measured("processing", job.name):
            return self._run_processing(job)

    def run_training(self, job: TrainingJob, watch: Watch | None = None) -> JobResult:
        """`watch(line)`, if given, sees every line the job prints; when it returns True the
        job is stopped (SIGTERM: it checkpoints and exits) and not restarted (TrialRunner)."""
        with self._measured("training", job.name):
            return self._run_training(job, watch)

    def _run_processing(self, job: ProcessingJob) -> JobResult:
        request, refusal = self._request(job)
        if refusal:
            return refusal
        root = self.work_root / job.name
        with (
            self._interruptible(job.name, root),
            open(self._log_path(job.name), "a", encoding="utf-8") as log,
        ):
            exits = play_processing(
                request, root, self.store, self.containers, log=log, on_line=self._speaker(job.name)
            )
        result = result_of(
            job.name,
            exits,
            self._upload_log(job.name),
            stop_requested=self._stop_requested(job.name),
        )
        self.billed += result.billing
        outputs = {
            job.outputs[name]: local for name, local in processing_outputs(request, root).items()
        }
        empty = [prefix for prefix, local in outputs.items() if not any(local.rglob("*"))]
        if result.status == "Completed" and empty:  # nothing to cache or reuse: a failure
            where = ", ".join(self.store.uri_of(p) for p in empty)
            result.status, result.failure_reason = (
                "Failed",
                f"the job completed but wrote nothing to {where}",
            )
        if result.status == "Completed":
            for prefix, local in outputs.items():
                upload_dir(self.store, local, prefix, {"job_name": job.name})
        self._cleanup(root, result)
        return result

    def _run_training(self, job: TrainingJob, watch: Watch | None) -> JobResult:
        request, refusal = self._request(job)
        if refusal:
            return refusal

        def say(line: str) -> None:
            self.say(job.name, line)
            if watch is not None and watch(line):
                self.containers.stop(job.name)

        root = self.work_root / job.name
        with (
            self._interruptible(job.name, root),
            open(self._log_path(job.name), "a", encoding="utf-8") as log,
        ):
            played = play_training(
                request,
                root,
                self.store,
                self.containers,
                log=log,
                on_line=say,
                restart=lambda exits, restarts: local_restart(exits, restarts, job.max_restarts),
                on_restart=lambda n: say(
                    f"interrupted or killed; restart {n} of {job.max_restarts}"
                ),
            )
        result = result_of(
            job.name,
            played.exits,
            self._upload_log(job.name),
            stop_requested=self._stop_requested(job.name),
            restarts=played.restarts,
        )
        self.billed += result.billing
        if result.status == "Completed":
            # Every host's model/ and output/data/, as SageMaker uploads them (gathered).
            for folder, prefix in (
                (MODEL_DIR, job.model_prefix),
                (OUTPUT_DATA_DIR, job.output_prefix),
            ):
                local = gathered(played.roots, folder, root / "gathered" / Path(folder).name)
                upload_dir(self.store, local, prefix, {"job_name": job.name})
        self._cleanup(root, result)
        return result

    @contextmanager
    def _interruptible(self, name: str, root: Path):
        """The driver is stopping (Ctrl-C, SIGTERM): the job has been stopped and waited for,
        and its checkpoints synced; its log goes to the store and its folder goes away."""
        try:
            yield
        except BaseException:
            try:
                self._upload_log(name)
            except StoreError:  # the store is what failed (full, say): the first error stands
                pass
            shutil.rmtree(root, ignore_errors=True)
            raise

    def run_tuning(self, job: TuningJob) -> JobResult:
        before = len(self.billed)
        # The trials share one environment: its fork server starts beside the first trial.
        # Its trials that ended were measured, but no result of it would hold them.
        with self._measured("tuning", job.name):
            with self.warm.expecting_more() if self.warm else nullcontext():
                result = run_local_tuning(self, job, self.store, self.run)
        result.billing = [{**b, "tuning_job": job.name} for b in self.billed[before:]]
        return result

    def resumed(self, earlier: Earlier) -> list[dict]:
        """Nothing is left running: a local job ends with the driver that started it, however
        it ends (pipeline/player/processes.py: each job follows DRIVER_PID_VARIABLE). What
        one stopped with its driver used is not known, now or later: it stays named."""
        self.unbilled += earlier.unbilled
        return []

    def stop(self) -> None:
        self.containers.stop()

    def close(self, succeeded: bool) -> None:
        """Stop the fork servers and remove the work root (failed jobs' folders are kept
        elsewhere: `_cleanup`). A run that completed needs none of its failed jobs' folders
        any more (a failed trial's, an earlier attempt's): they go too."""
        if self._finalizer is not None:
            self._finalizer()  # WarmStart.close, once
        shutil.rmtree(self.work_root, ignore_errors=True)
        if succeeded:
            shutil.rmtree(self.kept_root, ignore_errors=True)

    def _cleanup(self, root: Path, result: JobResult) -> None:
        """A finished job's folder is removed, and so is one the driver stopped (its
        checkpoints are in the store); a failed one's is moved to `kept_root` for inspection,
        and its log and result say where."""
        if result.status == "Completed" or self.containers.stopping:
            shutil.rmtree(root, ignore_errors=True)
            return
        kept = self.kept_root / root.name
        try:
            shutil.rmtree(kept, ignore_errors=True)  # an earlier attempt's: the newest stays
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(root, kept)
        except OSError as e:
            shutil.rmtree(root, ignore_errors=True)
            said = f"job folder not kept: it could not be moved to {kept} ({e}); removed"
        else:
            result.kept_folder = str(kept)
            said = f"job folder kept for inspection: {kept}"
        self.say(result.name, said)
        try:  # the job's log ends by saying it
            with open(self._log_path(result.name), "a", encoding="utf-8") as log:
                log.write(f"smpipe: {said}\n")
            self._upload_log(result.name)
        except (OSError, StoreError):
            pass  # its log as it was stands
