"""SageMaker's instances, as the emulated account plays them: each processing and training job
moto accepted played on this machine by the player (pipeline/player/), in the image with
`--image`, else as processes started warm; what its containers print written to CloudWatch
Logs, what SageMaker uploads uploaded, its end recorded (records.py); stopped as the Stop*
calls stop it; a spot job whose instance is taken back started again.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from pipeline.backends.emulated.account import job_plumbing
from pipeline.backends.emulated.records import JobRecords
from pipeline.backends.following import LOG_GROUPS
from pipeline.code_bundle import PROJECT_ROOT
from pipeline.player.environment import fresh_container_env
from pipeline.player.exits import status_after
from pipeline.player.fork_client import WARM_FOLDER, WarmStart, warm_start_enabled
from pipeline.player.images import ImageLauncher, ImageRef, find_engine, resolve_image
from pipeline.player.job_root import (
    gathered,
    new_work_root,
    processing_outputs,
    remove_orphaned_work_roots,
)
from pipeline.player.play import play_processing, play_training
from pipeline.player.processes import Containers, ProcessLauncher
from pipeline.player.transfers import LogStream, upload_folder, upload_tarball
from pipeline.store import Store
from steps.runtime.names import MODEL_DIR, OUTPUT_DATA_DIR


def job_containers(
    image: str, engine: str, endpoint: str, warm: WarmStart | None
) -> tuple[Containers, ImageRef | None]:
    """What runs the jobs' containers, and the image they run in. With an image, every job
    runs in it (player/images.py), reaching moto at `endpoint` through a relay at its network's
    gateway; without, as processes of this machine (player/processes.py) in a new container's
    environment (player/environment.py), started warm by `warm` as the local backend starts its
    jobs (fork_client.py: each still a process of its own with exactly its own environment).
    Either way the image's ENV, the request's Environment, what SageMaker sets and the
    emulator's plumbing (`job_plumbing`) come on top."""
    if not image:
        base = fresh_container_env() | job_plumbing(endpoint)
        return Containers(ProcessLauncher(base_env=base, starter=warm)), None
    engine = find_engine(engine)
    # Resolved to its id once, before any job (ImageUnavailable: none, or another lock's):
    # every job runs that id, whatever the tag names meanwhile.
    ref = resolve_image(engine, image, PROJECT_ROOT / "requirements.lock")
    port = int(endpoint.rsplit(":", 1)[1])
    return Containers(ImageLauncher(engine, ref, job_plumbing, port)), ref


class Instances:
    """Where the account's jobs run: each in a folder of its own under `work_root` (a new one
    by default), its containers run by `containers`, in `image_ref`'s image or as processes."""

    def __init__(
        self,
        store: Store,
        logs,
        records: JobRecords,
        work_root: str | None = None,
        image: str = "",
        engine: str = "auto",
    ) -> None:
        self.store, self.logs, self.records = store, logs, records
        if work_root is None:
            remove_orphaned_work_roots(sys.stderr)
            self.work_root = new_work_root("emulated")
        else:
            self.work_root = Path(work_root)
        # Jobs played as processes start warm; a container of an image starts as it starts.
        self.warm = None
        if not image and warm_start_enabled():
            self.warm = WarmStart(self.work_root / WARM_FOLDER)
        endpoint = os.environ["AWS_ENDPOINT_URL"]  # the account's (account.start_moto)
        self.containers, self.image_ref = job_containers(image, engine, endpoint, self.warm)
        self._reclaimed: set[str] = set()  # spot jobs whose instance AWS took back

    def sharing_environment(self) -> AbstractContextManager:
        """While the jobs started in it share one environment (a tuning job's trials): its
        fork server starts beside the first of them."""
        return self.warm.expecting_more() if self.warm else nullcontext()

    def stop(self, job: str = "", signum: int = signal.SIGTERM) -> None:
        """The containers of every job whose name starts with `job` stopped (all by default)."""
        self.containers.stop(job, signum)

    def take_back(self, names: list[str]) -> None:
        """AWS takes the spot instances of the training jobs `names` back: each gets SIGTERM
        and is started again from its checkpoints while its MaxWaitTimeInSeconds lasts."""
        for name in names:
            self._reclaimed.add(name)
            self.containers.stop(name, restartable=True)

    def close(self) -> None:
        """After every job has ended: what the containers held, and every job's folder."""
        self.containers.close()
        if self.warm is not None:  # its servers are left to the next run of this process
            self.warm.close()
        shutil.rmtree(self.work_root, ignore_errors=True)

    def _status_after(self, name: str, exits) -> tuple[str, str | None]:
        """A job's end as DescribeTrainingJob / DescribeProcessingJob report it (status_after),
        its FailureReason as SageMaker words it: ClientError for what SageMaker could not do
        for the job (its data), AlgorithmError for what the container did."""
        status, reason = status_after(
            exits,
            stop_requested=self.containers.stop_reached(name),  # a Stop* that reached it
            capacity_lost=name in self._reclaimed,
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

    # -- the two job kinds that run on instances -------------------------------------------------

    def play_processing(self, name: str) -> None:
        request, root, stamp = self.records.requests[name], self.work_root / name, int(time.time())
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
            arn=self.records.arn(name),
        )
        status, reason = self._status_after(name, exits)
        if status == "Completed":
            for output, local in processing_outputs(request, root).items():
                upload_folder(self.store, local, uris[output])
        # "If multiple containers exit with an ExitMessage, the content of the ExitMessage from
        # each processing container is concatenated, then truncated to 1 KB" (byoc-metadata.html;
        # `JobRecords.ended` truncates it). The hosts in resourceconfig.json's order; no
        # separator is documented.
        said = "".join(e.reason for e in exits if e.reason)
        self.records.ended(name, status, reason, exit_message=said)
        shutil.rmtree(root, ignore_errors=True)

    def play_training(self, name: str) -> None:
        request, records, stamp = self.records.requests[name], self.records, int(time.time())
        streams = {}

        def log_for(host: str) -> LogStream:
            if host not in streams:
                streams[host] = LogStream(
                    self.logs, LOG_GROUPS["training"], f"{name}/{host}-{stamp}"
                )
            return streams[host]

        def restarted(count: int) -> None:
            records.secondary(name, "Interrupted")
            log_for("algo-1").write(f"spot capacity interrupted the job; restart {count}")
            records.secondary(name, "Training")

        records.secondary(name, "Training")
        played = play_training(
            request,
            self.work_root / name,
            self.store,
            self.containers,
            log=log_for,
            on_line=None,
            on_restart=restarted,
            arn=records.arn(name),
            restart=self._spot_restart(name, request, time.time()),
        )
        metrics: dict[str, float] = {}
        for e in played.exits:
            metrics.update(e.metrics)
        records.final_metrics(name, metrics)
        status, reason = self._status_after(name, played.exits)
        # A stopped job's artifacts are uploaded too: "Algorithms might use this 120-second
        # window to save the model artifacts, so the results of the training is not lost"
        # (StopTrainingJob in the service model). A failed one's: the sources are silent.
        if status in ("Completed", "Stopped"):
            records.secondary(name, "Uploading")
            base = request["OutputDataConfig"]["S3OutputPath"].rstrip("/") + f"/{name}/output/"
            # Every host's model/ and output/data/, in one tarball each (job_root.gathered).
            work = self.work_root / name / "gathered"
            for folder, tarball in ((MODEL_DIR, "model"), (OUTPUT_DATA_DIR, "output")):
                local = gathered(played.roots, folder, work / tarball)
                upload_tarball(self.store, local, base + f"{tarball}.tar.gz")
        records.ended(name, status, reason)
        shutil.rmtree(self.work_root / name, ignore_errors=True)
