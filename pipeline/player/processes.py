"""A job's containers run on this machine (`Containers`): each started through a launcher, its
output followed, stopped as `docker stop` stops a container, metered (metering.py) where its
processes are this machine's, and its exit read back. The launcher says how a container
starts: as processes of this machine (`ProcessLauncher`: the image's entrypoint,
`python3 -m steps.entrypoint ...`, in its job root with the container's environment), or in the
image itself with a container engine (images.ImageLauncher). Nothing in steps/ can tell which
backend started it.
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
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pipeline.player.environment import image_env, local_job_env
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


@dataclass(frozen=True)
class Launch:
    """One host's container to start: in its laid-out job `root`, the entrypoint's `arguments`
    with `env` (the request's Environment and what SageMaker sets), for `job`; `entrypoint` is
    a processing request's ContainerEntrypoint (None: the image's)."""

    root: Path
    arguments: list[str]
    env: dict[str, str]
    job: str
    entrypoint: list[str] | None = None


class Launcher(Protocol):
    """How `Containers` starts a container, signals it and lets it go: `ProcessLauncher` as
    processes of this machine, images.ImageLauncher with a container engine."""

    metered: bool  # the container's processes are this machine's: metering.py reads them
    noise: frozenset[str]  # lines of the launcher's own, not the job's

    def started(self, launch: Launch) -> AbstractContextManager[tuple[Any, list[str]]]:
        """The container started: a Popen-like process (pid leading its own session, stdout,
        poll, wait) and the secret values its environment holds. What the container held is
        let go when the block ends, its process waited for."""
        ...

    def signal(self, pid: int, signum: int) -> None:
        """`signum` to the container whose process is `pid`, as `docker kill` sends it;
        SIGKILL ends every process in it. ProcessLookupError: it is gone."""
        ...

    def hosts_env(self, env: dict[str, str]) -> dict[str, str]:
        """A training job's `env`, and how its hosts find torchrun's master."""
        ...

    def close(self) -> None:
        """Let go of what is held between jobs."""
        ...


class Starter(Protocol):
    """Starts an entrypoint some other way than a new interpreter (fork_client.WarmStart)."""

    def start(self, argv: list[str], env: dict[str, str], cwd: Path):
        """A Popen-like process (pid leading its own session, args, stdout, poll, wait), or
        None: start this one the normal way."""


class ProcessLauncher:
    """Containers as processes of this machine: the image's entrypoint in its job root.

    `base_env`: what a container starts with before the image's ENV. None: this machine's
    environment (the local backend runs jobs as the user's own processes: `local_job_env`);
    the emulated backend gives a fresh container's (`fresh_container_env`).
    `starter`: how to start an entrypoint (warm start: fork_client.WarmStart); None, or a
    starter that declines a job: a new interpreter."""

    metered = True
    noise: frozenset[str] = frozenset()

    def __init__(
        self, base_env: dict[str, str] | None = None, starter: Starter | None = None
    ) -> None:
        self.base_env, self.starter = base_env, starter

    @contextmanager
    def started(self, launch: Launch) -> Iterator[tuple[Any, list[str]]]:
        """The entrypoint started in its environment (`Containers.run`). `entrypoint`, a
        processing request's ContainerEntrypoint, can only be the image's here."""
        entrypoint, root = launch.entrypoint, launch.root
        if entrypoint is not None and list(entrypoint) != list(ENTRYPOINT):
            raise ValueError(
                f"cannot play ContainerEntrypoint {entrypoint} as a process: the image's "
                f"entrypoint is {ENTRYPOINT} (with an image, any entrypoint is played)"
            )
        base = local_job_env(root) if self.base_env is None else self.base_env
        full = {**base, **image_env(root), **launch.env}
        # The container ends with this process however it ends (SIGKILL included). A
        # warm-started one is the fork server's child: the starter names the server, which
        # follows this process.
        full[DRIVER_PID_VARIABLE] = str(os.getpid())
        argv = [sys.executable, *ENTRYPOINT[1:], *launch.arguments]
        proc = None if self.starter is None else self.starter.start(argv, full, root)
        if proc is None:
            proc = subprocess.Popen(
                argv,
                cwd=str(root),
                env=full,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: a signal reaches every process
            )
        yield proc, secret_values(full)

    def signal(self, pid: int, signum: int) -> None:
        """`signum` to the container's processes (its entrypoint leads a session of its own).
        SIGKILL goes to the entrypoint and every process under it (the step runs in a session
        of its own), as Docker kills a container."""
        if signum != signal.SIGKILL:
            os.killpg(pid, signum)
            return
        import psutil

        try:
            tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for process in tree:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass

    def hosts_env(self, env: dict[str, str]) -> dict[str, str]:
        """SageMaker's hosts resolve one another's names; here every host is this machine,
        torchrun's master at a free port."""
        return {
            **env,
            MASTER_ADDR_VARIABLE: "127.0.0.1",
            MASTER_PORT_VARIABLE: str(free_port()),
        }

    def close(self) -> None:
        """Nothing is held between jobs."""


class Containers:
    """The containers a backend runs on this machine, each started through `launcher` (None:
    as processes of this machine, `ProcessLauncher()`); `stop` ends them all."""

    def __init__(self, launcher: Launcher | None = None) -> None:
        self.launcher: Launcher = launcher if launcher is not None else ProcessLauncher()
        self._running: dict[int, str] = {}  # pid -> the job it belongs to
        self._lock = threading.Lock()
        self.stopping = False  # set by stop(): nothing is restarted after it
        self._stopped: set[str] = set()  # jobs stopped on request (a pruned trial)
        self.grace_seconds = STOP_GRACE_SECONDS
        self._timed_out: set[int] = set()  # containers stopped by their MaxRuntimeInSeconds
        self._reached: set[str] = set()  # jobs a stop's signal reached while one of theirs ran

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
            self._signal(pid, signum, stopping=not restartable)

    def _signal(self, pid: int, signum: int, stopping: bool = True) -> bool:
        """`signum` to a container, and SIGKILL to it `grace_seconds` later if it still runs;
        `stopping`: a stop of its job on request (`stop_reached`). Whether it reached one."""
        try:
            self.launcher.signal(pid, signum)
        except ProcessLookupError:
            return False
        if stopping:
            self._reach(pid)
        timer = threading.Timer(self.grace_seconds, self._kill, args=(pid,))
        timer.daemon = True
        timer.start()
        return True

    def _time_out(self, pid: int) -> None:
        """MaxRuntimeInSeconds reached: the container is stopped as StopTrainingJob stops one
        (API_StoppingCondition.html: SIGTERM, and the same 120 s to save the model). Counted
        only when the signal reached it: one that ended as its time ran out (waited for, not
        yet forgotten: `run` joins this before `_forget` reads it) keeps its own exit."""
        with self._lock:
            if pid not in self._running:
                return
        # Not a stop on request (`stop_reached`): its own reason, MaxRuntimeExceeded.
        if self._signal(pid, signal.SIGTERM, stopping=False):
            with self._lock:
                self._timed_out.add(pid)

    def _kill(self, pid: int) -> None:
        """SIGKILL to a container that outlived its grace: every process in it ends."""
        with self._lock:
            if pid not in self._running:
                return
        try:
            self.launcher.signal(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _register(self, pid: int, job: str) -> None:
        with self._lock:
            self._running[pid] = job
            # stop() came while this one was starting (for every job, or for this one's, as
            # StopTrainingJob stops it): it stops too.
            late = self.stopping or any(job.startswith(p) for p in self._stopped if p)
        if late:
            try:
                self.launcher.signal(pid, signal.SIGTERM)
            except ProcessLookupError:  # it has ended already: its exit is read as any other
                return
            self._reach(pid)

    def _reach(self, pid: int) -> None:
        with self._lock:
            if pid in self._running:
                self._reached.add(self._running[pid])

    def was_stopped(self, job: str) -> bool:
        with self._lock:
            return any(job.startswith(prefix) for prefix in self._stopped if prefix)

    def stop_reached(self, job: str) -> bool:
        """Whether a stop on request (the driver's, Stop*, a pruned trial's) signalled
        a container of `job` while it ran: its job is Stopped, whatever it exited with
        (status_after). One that had exited before the stop came, its work done (a trial still
        uploading its checkpoints), stays what it exited as."""
        with self._lock:
            return job in self._reached

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
        """Start the container in `root` (what an earlier attempt left in output/ cleared) and
        wait for it; at `deadline` (the job's MaxRuntimeInSeconds from its start) it is stopped.

        `env` is the request's Environment and what SageMaker sets; the image's ENV comes
        under it and over the base environment, as a container's would. Every line goes to
        `log` (redacted) and to `on_line` (the job's stream), and is searched with the metric
        regexes."""
        failure = host_path(root, failure_file)
        clear_output(failure)
        start = time.time()
        with self.launcher.started(Launch(root, arguments, env, job, entrypoint)) as started:
            proc, secrets = started
            try:
                self._register(proc.pid, job)
                followed = self._follow(proc, secrets, log, on_line, metric_regexes, deadline)
            finally:
                timed_out = self._forget(proc.pid)
        interrupted, reason = left_in_output(failure, secrets)
        return ContainerExit(
            interrupted=interrupted,
            reason=reason,
            start=start,
            end=time.time(),
            timed_out=timed_out,
            **followed,
        )

    def _follow(self, proc, secrets, log, on_line, metric_regexes, deadline) -> dict:
        """A started container followed to its exit (`run`): its code, metrics and what it
        used, as ContainerExit's fields."""
        clock = self._clock(deadline, proc.pid)
        metered = self.launcher.metered
        peak = {"rss": 0.0, "cpu": 0.0}
        done = threading.Event()
        watcher = threading.Thread(target=watch_memory, args=(proc.pid, peak, done), daemon=True)
        if metered:
            watcher.start()
        try:
            noise = self.launcher.noise
            metrics = follow_output(proc, secrets, log, on_line, metric_regexes or {}, noise)
            exact_cpu = exit_cpu_seconds(proc) if metered else None
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
            if metered:
                watcher.join()
            if clock is not None:
                clock.cancel()
                clock.join()  # a time-out in progress is counted (or not) before `_forget`
        return {
            "code": code,
            "metrics": metrics,
            "peak_rss_mb": round(peak["rss"] / 2**20, 1) if peak["rss"] else None,
            "cpu_seconds": round(max(exact_cpu or 0.0, peak["cpu"]), 2) or None,
        }

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
        return timed_out

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
        job's (`train`; the launcher says how its hosts find torchrun's master) or a
        processing job's (its `arguments`). `log` is one writer, or a function giving each
        host's."""
        if arguments is None:  # training
            arguments, env = ["train"], self.launcher.hosts_env(env)
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

    def close(self) -> None:
        """Let go of what the launcher holds between jobs (the image player's relay)."""
        self.launcher.close()


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
