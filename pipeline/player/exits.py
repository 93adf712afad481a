"""How a job's containers ended, and the status SageMaker reports for a job whose containers
ended so: SageMaker's words for how a job ends (`Status`, which every backend reports), what
every runner of containers returns (`ContainerExit`) and every backend that plays jobs reports
through (`status_after`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, get_args

# How a job ends, in SageMaker's words and only those: the end states of the TrainingJobStatus,
# ProcessingJobStatus and HyperParameterTuningJobStatus enums of botocore's sagemaker
# service-2.json (InProgress | Completed | Failed | Stopping | Stopped, and Deleting ...).
# "Interrupted" is not one of them: it is a SecondaryStatus of a job still InProgress, a spot
# job about to restart (DescribeTrainingJob's SecondaryStatus); tests/test_backends.py reads
# the enums.
Status = Literal["Completed", "Failed", "Stopped"]
ENDED: tuple[Status, ...] = get_args(Status)


@dataclass
class ContainerExit:
    code: int
    interrupted: bool
    reason: str | None  # the step's own words (output/failure or output/message)
    start: float
    end: float
    peak_rss_mb: float | None
    metrics: dict[str, float] = field(default_factory=dict)
    timed_out: bool = False  # stopped at its MaxRuntimeInSeconds
    # CPU time of its processes, children included ("CPU-seconds", not billed: the local
    # backend's measure of what a job used).
    cpu_seconds: float | None = None

    @classmethod
    def before_start(cls, reason: str) -> ContainerExit:
        """A container that never started: its job failed while being laid out."""
        now = time.time()
        return cls(code=1, interrupted=False, reason=reason, start=now, end=now, peak_rss_mb=None)

    @property
    def killed(self) -> bool:
        """Ended by a signal: the entrypoint itself (a negative status) or its step (the
        entrypoint exits 128 + the signal, as a shell reports it)."""
        return self.code < 0 or 128 < self.code <= 128 + 64


def status_after(
    exits: list[ContainerExit], *, stop_requested: bool, capacity_lost: bool = False
) -> tuple[Status, str | None]:
    """How a job whose containers exited so ends, and why: every backend that plays containers
    reports them through here, as DescribeTrainingJob reports a job (TrainingJobStatus and
    SecondaryStatus in botocore's sagemaker service-2.json).

    Stopped when it was stopped on request (Stop*, the driver stopping, a pruned trial: no
    reason, as SageMaker gives none) or at its MaxRuntimeInSeconds (SecondaryStatus
    MaxRuntimeExceeded), whatever its containers exited with: "When it receives a
    StopTrainingJob request, SageMaker changes the status of the job to Stopping. After
    SageMaker stops the job, it sets the status to Stopped" (StopTrainingJob in the service
    model). Else Completed when every container exited 0; Stopped when its spot capacity was
    taken back and MaxWaitTimeInSeconds ran out (MaxWaitTimeExceeded). Otherwise Failed, with
    the container's own reason (its failure file) or its exit status. A container that was
    interrupted and checkpointed (exit 75) is Failed too if it was neither stopped nor
    restarted: SageMaker's Interrupted is a job still InProgress, about to restart, and whether
    to restart is the backend's rule, asked before this (local_restart; the emulator's spot
    rule)."""
    if stop_requested:
        return "Stopped", None
    if any(e.timed_out for e in exits):
        seconds = round(max(e.end for e in exits) - min(e.start for e in exits))
        return "Stopped", (
            f"MaxRuntimeExceeded: the job was stopped after {seconds} s, its MaxRuntimeInSeconds"
        )
    if all(e.code == 0 for e in exits):
        return "Completed", None
    if capacity_lost:
        lost = "the job lost its spot capacity and its MaxWaitTimeInSeconds ran out"
        return "Stopped", f"MaxWaitTimeExceeded: {lost}"
    code = max((e.code for e in exits), key=abs)
    said = f"exit status {code}"
    if any(e.interrupted for e in exits):
        said += ": it was interrupted, saved a checkpoint and was not restarted"
    elif any(e.killed for e in exits):
        said += f": {killed_from_outside(code)}"
    return "Failed", next((e.reason for e in exits if e.reason), None) or said


def killed_from_outside(code: int) -> str:
    """Who ended a container killed by a signal when no stop was asked for (no Stop*, no
    MaxRuntimeInSeconds, no spot reclaim: status_after rules those out before): not SageMaker
    and not smpipe, so something on the host (`docker stop`, `kill`, the engine removing the
    container, or, for SIGKILL, the kernel's out-of-memory killer)."""
    import signal

    number = -code if code < 0 else code - 128
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    oom = ", or the kernel's out-of-memory killer" if number == signal.SIGKILL else ""
    return (
        f"killed by {name}, which neither the job's stop nor its limits sent: something outside "
        f"the run stopped it (`docker stop` or `kill` on its container or process{oom})"
    )
