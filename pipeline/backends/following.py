"""Following a SageMaker job to its end (pipeline/backends/sagemaker.py): its status polled,
a progress line when it changes (and once a minute), its CloudWatch log streamed with the
job's name in front, and what the driver does when reading fails.

The Describe* answers are kept as AWS gave them: what the driver knows besides (when it
created the job, why it gave up on it) travels beside them, in a `Followed`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipeline.jobs import KINDS
from pipeline.player.exits import ENDED

TERMINAL = ENDED  # a job's status that no longer changes
# Where SageMaker sends a job's log (logging-cloudwatch.html); a tuning job's trials are
# training jobs.
LOG_GROUPS = {
    "training": "/aws/sagemaker/TrainingJobs",
    "processing": "/aws/sagemaker/ProcessingJobs",
}
TAIL_LINES = 5


class Followable(Protocol):
    """What following a job uses of the backend that created it (SageMakerBackend)."""

    poll_seconds: float
    patience_seconds: float
    logs: Any  # a boto3 CloudWatch Logs client

    def say(self, job_name: str, text: str) -> None: ...
    def describe_job(self, kind: str, name: str) -> dict: ...
    def stop_job(self, name: str, kind: str) -> None: ...


# How long the status of a running job may be unreadable before the driver gives up on it
# (and says how to look it up); a job's own MaxRuntimeInSeconds is not shortened by this.
PATIENCE_SECONDS = 15 * 60


@dataclass
class Followed:
    """How a job ended, as the driver followed it. `described`: SageMaker's last Describe*
    answer, untouched ({} when no job was created); `status`: SageMaker's word for the end,
    or Failed where the driver ended it (`reason` says why: a request refused, a status
    unreadable for too long); `start`: when the driver sent the create."""

    status: str
    described: dict
    start: float
    log: list[str] = field(default_factory=list)
    reason: str | None = None

    @property
    def failure_reason(self) -> str | None:
        return self.reason or self.described.get("FailureReason")


def status_of(kind: str, described: dict) -> str:
    """A Describe* answer's status (TrainingJobStatus, ProcessingJobStatus,
    HyperParameterTuningJobStatus: jobs.KINDS names the member)."""
    return described[KINDS[kind].status_member]


def read_log(client, kind: str, name: str, tokens: dict, log: list[str], say) -> None:
    """New lines of the job's CloudWatch log streams, each `say`d and kept in `log` for the run
    tree; `client`: CloudWatch Logs'; `tokens`: where each stream was read up to."""
    group = LOG_GROUPS.get(kind)
    if group is None or client is None:
        return
    from botocore.exceptions import ClientError

    try:
        found = client.describe_log_streams(logGroupName=group, logStreamNamePrefix=f"{name}/")
        streams = found.get("logStreams", [])
        for stream in streams:
            stream_name = stream["logStreamName"]
            args = {"logGroupName": group, "logStreamName": stream_name, "startFromHead": True}
            if stream_name in tokens:
                args["nextToken"] = tokens[stream_name]
            while True:
                page = client.get_log_events(**args)
                host = stream_name.split("/", 1)[-1].rsplit("-", 1)[0]
                for event in page.get("events", []):
                    line = event["message"].rstrip("\n")
                    line = f"{host}: {line}" if len(streams) > 1 else line  # whose line
                    log.append(line)
                    say(name, line)
                token = page.get("nextForwardToken")
                if not page.get("events") or token == args.get("nextToken"):
                    tokens[stream_name] = token or args.get("nextToken", "")
                    break
                args["nextToken"] = tokens[stream_name] = token
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") != "ResourceNotFoundException":
            raise


def log_tail(logs, name: str, say, lines: int = TAIL_LINES) -> list[str]:
    """The last lines a training job (a tuning trial) wrote to CloudWatch, or []."""
    log: list[str] = []
    try:
        read_log(logs, "training", name, {}, log, say)
    except Exception:  # noqa: BLE001 - a tail is a courtesy; the reason is said without it
        return []
    return [line for line in log if line.strip()][-lines:]


class Following:
    """What the driver reads of one job while it runs, and what it does when reading fails:
    each kind of failure said once, the pause between polls doubled up to a minute, the logs
    given up for this job on a permission error, the job given up after PATIENCE_SECONDS of
    unreadable status (it is asked to stop: nobody would see its end)."""

    def __init__(self, backend: Followable, kind: str, name: str, start: float) -> None:
        self.backend, self.kind, self.name, self.start = backend, kind, name, start
        self.log: list[str] = []
        self.tokens: dict[str, str] = {}
        self.shown, self.last_shown = None, 0.0
        self.failing_since: float | None = None
        self.last_error = ""
        self.logs_off = False
        self.said: set[str] = set()

    def to_the_end(self, on_poll=None) -> Followed:
        """Its status and log each poll, `on_poll` (a tuning job's housekeeping) after each,
        until it ends or its status has been unreadable for too long."""
        while True:
            described = self.describe()
            self.read_logs()
            if described is not None and on_poll is not None:
                self.guarded("tidy its trials", on_poll, described)
            if described is not None and status_of(self.kind, described) in TERMINAL:
                self.read_logs()
                return Followed(status_of(self.kind, described), described, self.start, self.log)
            if self.given_up():
                return self.lost()
            time.sleep(self.pause())

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
            described = self.backend.describe_job(self.kind, self.name)
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
            status_of(self.kind, described),
            described.get("SecondaryStatus"),
            json.dumps(described.get("TrainingJobStatusCounters"), default=str),
        )
        if state == self.shown and time.time() - self.last_shown <= 60:
            return
        extra = f" / {state[1]}" if state[1] else ""
        counters = described.get("TrainingJobStatusCounters")
        if self.kind == "tuning" and counters:
            extra += " (trials: " + ", ".join(f"{k} {v}" for k, v in counters.items() if v) + ")"
        line = f"{state[0]}{extra}, {time.time() - self.start:.0f}s"
        self.backend.say(self.name, line)
        if self.kind not in LOG_GROUPS:  # a tuning job logs nothing: its log is its progress
            self.log.append(line)
        self.shown, self.last_shown = state, time.time()

    def read_logs(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        if self.logs_off:
            return
        try:
            read_log(
                self.backend.logs, self.kind, self.name, self.tokens, self.log, self.backend.say
            )
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

    def lost(self) -> Followed:
        from botocore import xform_name

        self.backend.stop_job(self.name, self.kind)
        minutes = (time.time() - self.failing_since) / 60
        api = KINDS[self.kind]  # the AWS CLI's spelling of the operation and its name member
        how = f"{xform_name(api.describe, '-')} --{xform_name(api.name_member, '-')} {self.name}"
        reason = (
            f"its status could not be read for {minutes:.0f} minutes ({self.last_error}); "
            f"it was asked to stop; `aws sagemaker {how}` tells how it ended"
        )
        return Followed("Failed", {}, self.start, self.log, reason)
