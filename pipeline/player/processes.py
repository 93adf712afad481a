"""A job's containers played as processes of this machine: the image's entrypoint
(`python3 -m steps.entrypoint ...`) started in its job root with the container's environment,
its output followed, stopped as `docker stop` stops a container, metered (metering.py), and
its exit read back. Nothing in steps/ can tell which backend started it.
"""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Protocol

from pipeline.player.environment import image_env
from pipeline.player.exits import ContainerExit
from pipeline.player.job_root import clear_output, left_in_output
from pipeline.player.metering import exit_cpu_seconds, watch_memory
from steps.runtime.names import (
    DRIVER_PID_VARIABLE,
    ENTRYPOINT,
    MASTER_ADDR_VARIABLE,
    MASTER_PORT_VARIABLE,
    host_path,
)
from steps.runtime.secrets import redact, secret_values


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# StopTrainingJob: "sends the algorithm the SIGTERM signal ... delays job termination for 120
# seconds" before SIGKILL, as `docker stop -t 120` (API_StopTrainingJob.html); the same window
# after MaxRuntimeInSeconds (API_StoppingCondition.html).
STOP_GRACE_SECONDS = 120


class Starter(Protocol):
    """Starts an entrypoint some other way than a new interpreter (fork_client.WarmStart)."""

    def start(self, argv: list[str], env: dict[str, str], cwd: Path):
        """A Popen-like process (pid leading its own session, args, stdout, poll, wait), or
        None: start this one the normal way."""


class Containers:
    """The entrypoint processes this machine runs for a backend; `stop` ends them all.

    `base_env`: what a container starts with before the image's ENV. None: this machine's
    environment (the local backend runs jobs as the user's own processes); the emulated
    backend gives a fresh container's (`fresh_container_env`).
    `starter`: how to start an entrypoint (warm start: fork_client.WarmStart); None, or a
    starter that declines a job: a new interpreter.
    images.ImageContainers is this runner with a container engine in place of the processes."""

    metered = True  # the container's processes are this machine's: metering.py reads them
    noise: frozenset[str] = frozenset()  # lines of the runner's own, not the job's

    def __init__(
        self,
        base_env: dict[str, str] | None = None,
        starter: Starter | None = None,
    ) -> None:
        self.starter = starter
        self._running: dict[int, str] = {}  # pid -> the job it belongs to
        self._lock = threading.Lock()
        self.stopping = False  # set by stop(): nothing is restarted after it
        self._stopped: set[str] = set()  # jobs stopped on request (a pruned trial)
        self.base_env = base_env
        self.grace_seconds = STOP_GRACE_SECONDS
        self._timed_out: set[int] = set()  # containers stopped by their MaxRuntimeInSeconds

    def stop(
        self, job: str = "", signum: int = signal.SIGTERM, *, restartable: bool = False
    ) -> None:
        """`signum` to every running container whose job name starts with `job` (all of them
        by default), as `docker stop` sends it to PID 1: the entrypoint forwards it and the
        training step checkpoints; what a job still has to say is still read. A container
        still running `grace_seconds` later is killed, with every process it started.
        `restartable`: the job is not being stopped (a spot instance taken back), and may be
        started again."""
        with self._lock:
            if not restartable:
                self.stopping = self.stopping or not job
                self._stopped.add(job)
            pids = [pid for pid, tag in self._running.items() if tag.startswith(job)]
        for pid in pids:
            self._signal(pid, signum)

    def _signal(self, pid: int, signum: int) -> None:
        """`signum` to a container, and SIGKILL to it `grace_seconds` later if it still runs."""
        try:
            self._send(pid, signum)
        except ProcessLookupError:
            return
        timer = threading.Timer(self.grace_seconds, self._kill, args=(pid,))
        timer.daemon = True
        timer.start()

    def _send(self, pid: int, signum: int) -> None:
        """`signum` to a container's processes (its entrypoint leads a session of its own)."""
        os.killpg(pid, signum)

    def _time_out(self, pid: int) -> None:
        """MaxRuntimeInSeconds reached: the container is stopped as StopTrainingJob stops one
        (API_StoppingCondition.html: SIGTERM, and the same 120 s to save the model)."""
        with self._lock:
            if pid not in self._running:
                return
            self._timed_out.add(pid)
        self._signal(pid, signal.SIGTERM)

    def _kill(self, pid: int) -> None:
        """SIGKILL to a container that outlived its grace: the entrypoint and every process
        under it (the step runs in a session of its own), as Docker kills a container."""
        import psutil

        with self._lock:
            if pid not in self._running:
                return
        try:
            tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for process in tree:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass

    def _register(self, pid: int, job: str) -> None:
        with self._lock:
            self._running[pid] = job
            # stop() came while this one was starting (for every job, or for this one's, as
            # StopTrainingJob stops it): it stops too.
            late = self.stopping or any(job.startswith(p) for p in self._stopped if p)
        if late:
            self._send(pid, signal.SIGTERM)

    def was_stopped(self, job: str) -> bool:
        with self._lock:
            return any(job.startswith(prefix) for prefix in self._stopped if prefix)

    def run(
        self,
        root: Path,
        arguments: list[str],
        env: dict[str, str],
        *,
        failure_file: str,
        log,
        on_line=None,
        metric_regexes: dict[str, str] | None = None,
        job: str = "",
        deadline: float | None = None,
        entrypoint: list[str] | None = None,
    ) -> ContainerExit:
        """Start `python3 -m steps.entrypoint <arguments>` in `root` and wait for it; at
        `deadline` (the job's MaxRuntimeInSeconds from its start) it is stopped.

        `env` is the request's Environment and what SageMaker sets; the image's ENV comes
        under it and over the base environment, as a container's would. Every line goes to
        `log` (redacted) and to `on_line` (the job's stream), and is searched with the metric
        regexes."""
        failure = host_path(root, failure_file)
        start = time.time()
        proc, secrets = self._start(root, arguments, env, failure, job, entrypoint)
        clock = self._clock(deadline, proc.pid)
        peak = {"rss": 0.0, "cpu": 0.0}
        done = threading.Event()
        watcher = threading.Thread(target=watch_memory, args=(proc.pid, peak, done), daemon=True)
        if self.metered:
            watcher.start()
        try:
            metrics = follow_output(proc, secrets, log, on_line, metric_regexes or {}, self.noise)
            exact_cpu = exit_cpu_seconds(proc) if self.metered else None
            code = proc.wait()
        except BaseException:
            # The driver is stopping (Ctrl-C, an error): the container is stopped as `docker
            # stop` stops one, SIGKILL to all of it `grace_seconds` after the SIGTERM, so this
            # wait ends even where the step ignores SIGTERM.
            self._signal(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
        finally:
            done.set()
            if self.metered:
                watcher.join()
            if clock is not None:
                clock.cancel()
            timed_out = self._forget(proc.pid)
        interrupted, reason = left_in_output(failure, secrets)
        return ContainerExit(
            code=code,
            interrupted=interrupted,
            reason=reason,
            start=start,
            end=time.time(),
            peak_rss_mb=round(peak["rss"] / 2**20, 1) if peak["rss"] else None,
            metrics=metrics,
            timed_out=timed_out,
            cpu_seconds=round(max(exact_cpu or 0.0, peak["cpu"]), 2) or None,
        )

    def _clock(self, deadline: float | None, pid: int) -> threading.Timer | None:
        """The job's MaxRuntimeInSeconds, counted from its start: it is stopped then."""
        if deadline is None:
            return None
        clock = threading.Timer(max(0.0, deadline - time.time()), self._time_out, (pid,))
        clock.daemon = True
        clock.start()
        return clock

    def _forget(self, pid: int) -> bool:
        """A container that ended and was waited for is no longer running; whether its
        MaxRuntimeInSeconds ended it."""
        with self._lock:
            self._running.pop(pid, None)
            timed_out = pid in self._timed_out
            self._timed_out.discard(pid)
        self._ended(pid)
        return timed_out

    def _ended(self, pid: int) -> None:
        """A container has ended and been waited for (the image player removes its network)."""

    def _start(
        self,
        root: Path,
        arguments: list[str],
        env: dict[str, str],
        failure: Path,
        job: str,
        entrypoint: list[str] | None = None,
    ) -> tuple[subprocess.Popen, list[str]]:
        """The entrypoint started in its environment (see `run`), with what an earlier attempt
        left in output/ cleared; and the secret values that environment holds. `entrypoint`, a
        processing request's ContainerEntrypoint, can only be the image's here."""
        if entrypoint is not None and list(entrypoint) != list(ENTRYPOINT):
            raise ValueError(
                f"cannot play ContainerEntrypoint {entrypoint} as a process: the image's "
                f"entrypoint is {ENTRYPOINT} (with an image, any entrypoint is played)"
            )
        base = os.environ if self.base_env is None else self.base_env
        full = {**base, **image_env(root), **env}
        # The container ends with this process however it ends (SIGKILL included). A
        # warm-started one is the fork server's child: the starter names the server, which
        # follows this process.
        full[DRIVER_PID_VARIABLE] = str(os.getpid())
        clear_output(failure)
        argv = [sys.executable, *ENTRYPOINT[1:], *arguments]
        proc = None if self.starter is None else self.starter.start(argv, full, root)
        if proc is None:
            proc = subprocess.Popen(
                argv,
                cwd=str(root),
                env=full,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() reaches every process
            )
        self._register(proc.pid, job)
        return proc, secret_values(full)

    def run_hosts(
        self,
        roots: dict[str, Path],
        env: dict[str, str],
        *,
        log,
        on_line=None,
        arguments: list[str] | None = None,
        **kwargs,
    ) -> dict[str, ContainerExit]:
        """One entrypoint per host of a job, at once, as SageMaker starts them: a training
        job's (`train`; torchrun's master is this machine, at a free port) or a processing
        job's (its `arguments`). `log` is one writer, or a function giving each host's."""
        if arguments is None:  # training
            arguments, env = ["train"], self.hosts_env(env)
        exits: dict[str, ContainerExit] = {}
        errors: list[BaseException] = []

        finished = {host: threading.Event() for host in roots}

        def one(host: str, root: Path) -> None:
            say = on_line
            if on_line is not None and len(roots) > 1:
                say = lambda line: on_line(f"{host}: {line}")  # noqa: E731
            writer = log(host) if callable(log) else log
            try:
                exits[host] = self.run(root, arguments, env, log=writer, on_line=say, **kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
                errors.append(e)
                self.stop(kwargs.get("job", ""))
            finally:
                finished[host].set()

        def wait_all() -> None:
            # Events, not Thread.join: a join interrupted by Ctrl-C marks a running thread
            # as stopped (CPython 3.11, bpo-45274), and the next join would not wait.
            for event in finished.values():
                while not event.wait(0.5):
                    pass

        for item in roots.items():
            threading.Thread(target=one, args=item, daemon=True).start()
        try:
            wait_all()
        except BaseException:
            self.stop(kwargs.get("job", ""))
            wait_all()  # the job checkpoints and exits; its folders are removed after
            raise
        if errors:
            raise errors[0]
        return exits

    def hosts_env(self, env: dict[str, str]) -> dict[str, str]:
        """A training job's hosts find torchrun's master: SageMaker's hosts resolve one
        another's names; here every host is this machine, the master at a free port."""
        return {
            **env,
            MASTER_ADDR_VARIABLE: "127.0.0.1",
            MASTER_PORT_VARIABLE: str(free_port()),
        }

    def close(self) -> None:
        """Nothing is held between jobs (the image player holds its relay)."""


# How long the output of a container that has exited is still read: a process it started
# that left its session (setsid) may hold the output open for as long as it lives.
OUTPUT_GRACE_SECONDS = 10


def follow_output(
    proc, secrets: list[str], log, on_line, metric_regexes: dict[str, str], noise=frozenset()
) -> dict:
    """Every line the container prints, redacted, to `log` and `on_line`; the last value each
    metric regex found (SageMaker reads MetricDefinitions off the log the same way). Read
    until the output ends, and no longer than OUTPUT_GRACE_SECONDS once the entrypoint has
    exited."""
    compiled = {k: re.compile(v) for k, v in metric_regexes.items()}
    metrics: dict[str, float] = {}

    def take(raw: bytes) -> None:
        line = redact(raw.decode("utf-8", errors="replace"), secrets)
        if line in noise:  # the engine's own, not the job's
            return
        log.write(line + "\n")
        if on_line is not None:
            on_line(line)
        for metric, regex in compiled.items():
            found = regex.search(line)
            if found:
                try:
                    metrics[metric] = float(found.group(1))
                except (ValueError, IndexError):
                    pass

    fd, pending, exited = proc.stdout.fileno(), b"", None
    while exited is None or time.monotonic() < exited + OUTPUT_GRACE_SECONDS:
        ready, _, _ = select.select([fd], [], [], 0.5)
        chunk = os.read(fd, 1 << 16) if ready else None
        if chunk == b"":  # every writer has closed it
            break
        if chunk:
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                take(raw)
        if exited is None and _has_exited(proc):
            exited = time.monotonic()
    if pending:
        take(pending)
    return metrics


def _has_exited(proc) -> bool:
    """Whether the entrypoint has exited, without reaping it (`exit_cpu_seconds` reads it
    first): waitid's WNOWAIT for a child of ours, the fork server's report for a warm one."""
    if not isinstance(proc, subprocess.Popen):
        return proc.poll() is not None
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True
