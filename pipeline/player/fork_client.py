"""Warm start for jobs played as processes, the client's side: what the local backend and the
emulated one without an image start jobs through (`WarmStart`, a processes.Starter), talking
to fork servers (fork_server.py, a program of its own) over a socketpair.

Environment snapshot: the libraries read some variables when they are imported
(huggingface_hub's HF_HOME and HF_HUB_OFFLINE become constants, OpenBLAS and libgomp read
OMP_NUM_THREADS when they load, Python reads PYTHONHASHSEED when it starts). So a server starts
with a job's environment minus the variables that name one job (`per_job_variables`: the job
root, PYTHONPATH, the job's name, its torchrun rendezvous, ...) and those no preloaded library
reads when imported (`NOT_READ_AT_IMPORT`: this project's own, pytest's per-test bookkeeping,
which AWS to call and as whom; a test traces the preload's reads), and the backend keeps one
server per distinct such environment (in practice one per run, and a closed backend's server
serves the next run of the same process: `IdleServers`): a job whose import-relevant
environment differs gets a server of its own. What stays shared by every job of a server:
values drawn once at import (the string-hash salt, transformers' hub SESSION_ID).

SMPIPE_WARM_START=0 turns warm start off (every job played as a process starts cold), for
debugging.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from pipeline.player import fork_server
from pipeline.player.environment import WANDB_CACHE_VARIABLE
from pipeline.player.fork_server import MESSAGE_LIMIT, READY
from steps.runtime import names

WARM_START_VARIABLE = "SMPIPE_WARM_START"
WARM_FOLDER = "warm-start"  # in a backend's work root: its fork servers' logs
SERVER_START_SECONDS = 300  # the preload takes seconds; a busy machine, a minute


def per_job_variables() -> frozenset[str]:
    """The variables that name one job (set by processes.py and the request): left out
    of a server's environment, so that one server serves every job of a run."""
    return frozenset(
        {
            "PYTHONPATH",  # names the job root's code folders (docker/Dockerfile's ENV)
            names.TRAINING_JOB_NAME,  # what SageMaker sets (training_env)
            names.TRAINING_JOB_ARN,
            names.ML_ROOT_VARIABLE,
            names.DRIVER_PID_VARIABLE,
            names.MASTER_ADDR_VARIABLE,
            names.MASTER_PORT_VARIABLE,
            names.STEP_VARIABLE,
            names.PROCESSES_VARIABLE,
            names.TRIAL_CHECKPOINTS_VARIABLE,
            WANDB_CACHE_VARIABLE,  # a local job's own folder (environment.local_job_env)
        }
    )


# Variables left out of a server's environment besides the per-job ones, because no preloaded
# library reads them when imported (tests/test_warm_start.py traces every os.environ read of a
# preload): a job still gets them, in its own environment. SMPIPE_*: this project's (the server
# imports nothing of it). PYTEST_*: pytest's bookkeeping (PYTEST_CURRENT_TEST changes with every
# test phase). Which AWS to call and as whom: botocore reads these when a session or client is
# made, never at import; a server kept between runs (IDLE) then holds no run's AWS credentials.
# Nor its wandb key: wandb reads WANDB_API_KEY when it logs in, not when imported (the same
# trace), and tests that each set their own key no longer each start a server; nor WANDB_MODE,
# read when a run starts.
NOT_READ_AT_IMPORT_PREFIXES = ("SMPIPE_", "PYTEST_")
NOT_READ_AT_IMPORT = frozenset(
    {
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_ENDPOINT_URL",
        "AWS_DEFAULT_REGION",
        "AWS_REGION",
        "AWS_PROFILE",
        "WANDB_API_KEY",
        "WANDB_MODE",
    }
)


def server_env(env: dict[str, str], per_job: frozenset[str]) -> dict[str, str]:
    """What of a job's environment its server starts with (and is chosen by)."""
    return {
        k: v
        for k, v in env.items()
        if k not in per_job
        and k not in NOT_READ_AT_IMPORT
        and not k.startswith(NOT_READ_AT_IMPORT_PREFIXES)
    }


def default_launcher() -> list[str]:
    """The command that runs a fork server: this interpreter, fork_server.py as a script."""
    return [sys.executable, fork_server.__file__]


# StopTrainingJob's time between SIGTERM and SIGKILL (API_StopTrainingJob.html), as
# processes.py's STOP_GRACE_SECONDS.
LOST_GRACE_SECONDS = 120


class WarmProcess:
    """A warm-started job as subprocess.Popen shows one: `pid` (a session leader, so killpg
    reaches all of it), `args`, `stdout` (its output, bytes), `poll()`, `wait()`,
    `returncode`. The exit status comes from the server, which is the job's parent."""

    def __init__(self, connection: socket.socket, pid: int, args: list[str], stdout) -> None:
        self.pid, self.args, self.stdout = pid, args, stdout
        self.returncode: int | None = None
        self.cpu_seconds: float | None = None  # the server's wait4 figure, once it has exited
        self._connection = connection
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        return self._receive(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._receive(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def _receive(self, timeout: float | None) -> int | None:
        if not self._lock.acquire(blocking=timeout != 0):
            return None  # another thread is waiting for it (Popen.poll does the same)
        try:
            if self.returncode is not None:
                return self.returncode
            self._connection.settimeout(timeout)
            try:
                message = self._connection.recv(MESSAGE_LIMIT)
            except (TimeoutError, BlockingIOError):
                return None
            self._connection.close()
            if not message:
                self.returncode = self._lost()
                return self.returncode
            report = json.loads(message)
            self.cpu_seconds = report["cpu_seconds"]
            self.returncode = report["status"]
            return self.returncode
        finally:
            self._lock.release()

    def _lost(self) -> int:
        """The server died before the job: the job got SIGTERM (its PR_SET_PDEATHSIG) and its
        status went to whoever adopted it; wait until it is gone and report that SIGTERM. A
        job still there LOST_GRACE_SECONDS later (its step ignores SIGTERM) is killed with
        every process under it, as a container that outlives `docker stop`'s grace."""
        import psutil

        deadline = time.monotonic() + LOST_GRACE_SECONDS
        while True:
            try:
                job = psutil.Process(self.pid)
                if job.status() == psutil.STATUS_ZOMBIE:
                    break
                tree = [job, *job.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            if time.monotonic() > deadline:
                for process in tree:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        process.kill()
            time.sleep(0.2)
        return -signal.SIGTERM


class Server:
    """One fork server: the process, the driver's end of its control socket, and why it could
    not start (if so). The socket is a socketpair the server inherits, as Chromium's zygote
    does, so no name on the filesystem (nor its 108-byte limit, unix(7)) is involved."""

    def __init__(self, env: dict[str, str], log: Path, launcher: list[str]) -> None:
        self.log, self.failure, self.owner = log, None, os.getpid()
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs, open(log, "ab") as stderr:
            self.process = subprocess.Popen(
                [*launcher, str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()],
                cwd="/",  # its own folder goes with its backend; a job chdirs to its root
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # not a terminal: a job's stdout is a pipe
                stderr=stderr,
                start_new_session=True,  # the terminal's Ctrl-C is for the driver
            )
        self.control.settimeout(SERVER_START_SECONDS)
        try:
            ready = self.control.recv(len(READY))
        except OSError:
            ready = b""
        self.control.settimeout(None)
        if ready != READY:
            self.process.kill()
            self.process.wait()
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            self.failure = f"the fork server did not start: {' | '.join(tail) or 'no output'}"

    def start(self, argv: list[str], env: dict[str, str], cwd: str) -> WarmProcess | str:
        """Ask for the job; its process, or why the server answered cold."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        read, write = os.pipe()
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()
        try:
            with theirs:
                socket.send_fds(self.control, [request], [theirs.fileno(), write])
            reply = json.loads(mine.recv(MESSAGE_LIMIT) or b'{"cold": "the server ended"}')
        except OSError as e:
            reply = {"cold": f"the fork server cannot be reached: {e}"}
        finally:
            os.close(write)  # the job has its own copy now
        if "pid" not in reply:
            mine.close()
            os.close(read)
            return reply["cold"]
        return WarmProcess(mine, reply["pid"], argv, os.fdopen(read, "rb"))

    def close(self) -> None:
        self.control.close()  # what it waits for; its jobs are over by now
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class IdleServers:
    """Servers whose backend has closed, kept for the next backend of the same process whose
    jobs have the same environment (and launcher): the suite runs hundreds of runs in a few
    processes, a notebook several, and a server's preload (seconds of CPU) is then paid once,
    not once a run. A server serves each job from the state it had after its preload, whatever
    ran before, so a run forked from a kept server sees what one forked from a new server
    would; what stays shared is what a run's jobs already share (see the module's docstring).
    At most `limit` are kept (each holds the preloaded libraries' memory), the oldest
    stopped first; the rest stop when this process exits, as every server does."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._servers: collections.OrderedDict[tuple, Server] = collections.OrderedDict()
        self._lock = threading.Lock()

    def keep(self, key: tuple, server: Server) -> None:
        """Keep `server` if it can serve again (else stop it); stop the oldest beyond `limit`."""
        healthy = (
            server.failure is None
            and server.process.poll() is None
            and server.owner == os.getpid()  # a server follows the process that started it
        )
        with self._lock:
            evicted = [self._servers.pop(key)] if key in self._servers else []
            if healthy and self.limit > 0:
                self._servers[key] = server
            else:
                evicted.append(server)
            while len(self._servers) > self.limit:
                evicted.append(self._servers.popitem(last=False)[1])
        for old in evicted:
            old.close()

    def take(self, key: tuple) -> Server | None:
        """A kept server for `key` that is still running, or None."""
        with self._lock:
            server = self._servers.pop(key, None)
        if server is None or (server.process.poll() is None and server.owner == os.getpid()):
            return server
        server.close()
        return None

    @contextlib.contextmanager
    def lent(self, env: dict[str, str]):
        """Within: the kept server (of `default_launcher`) whose jobs would have `env`'s
        import-relevant environment, kept again afterwards; None where there is none (nothing
        is started for this)."""
        key = (
            tuple(default_launcher()),
            tuple(sorted(server_env(env, per_job_variables()).items())),
        )
        server = self.take(key)
        try:
            yield server
        finally:
            if server is not None:
                self.keep(key, server)

    def close(self) -> None:
        """Stop every kept server (at exit, and for tests that need a cold start)."""
        with self._lock:
            servers, self._servers = list(self._servers.values()), collections.OrderedDict()
        for server in servers:
            server.close()


# Three: a process that runs both local and emulated runs (a notebook, the test suite) keeps
# one of each, and one more for runs whose settings change what the libraries read at import.
IDLE = IdleServers(limit=3)
atexit.register(IDLE.close)


class WarmStart:
    """The starter of the local backend and of the emulated one's processes
    (ProcessLauncher(starter=...)): a fork server per distinct import-relevant environment.
    `start` returns the job's process, or None where the job starts cold: the first job of an
    environment (below), or one a server refused or could not serve (the reason said to
    `echo`, once).

    The first job of an environment starts cold, and the server starts with the second: it
    preloads more than any one job imports (longer than a cold reconcile or prepare job's own
    imports), so a backend that runs one job (a test, a one-step run) would pay for nothing,
    and a run's first job, reconcile, is light. Where more jobs of the
    environment are sure to follow (a study's trials: `expecting_more`), the server starts
    beside the first job instead, so that the second does not wait for its preload.
    A backend that closes leaves its healthy servers to the next backend of this process with
    the same environment (`IDLE`): that backend's first job starts warm too.
    `folder` holds the servers' own logs (what they print on stderr: a traceback if one
    fails). `launcher`: the command that runs fork_server.py (tests start it beside a
    thread of their own)."""

    def __init__(self, folder: Path, echo=None, launcher: list[str] | None = None) -> None:
        self.folder = folder
        self.launcher = launcher or default_launcher()
        self.echo = echo if echo is not None else sys.stderr
        self._servers: dict[tuple, Server] = {}
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self._said: set[str] = set()
        self._seen: set[tuple] = set()  # environments that have had their first (cold) job
        self._starting: dict[tuple, concurrent.futures.Future] = {}  # servers started early
        self._early = False
        self._per_job = per_job_variables()

    @contextlib.contextmanager
    def expecting_more(self):
        """Within: the server of an environment starts beside its first job (in a thread)."""
        self._early = True
        try:
            yield
        finally:
            self._early = False

    def start(self, argv: list[str], env: dict[str, str], cwd: Path) -> WarmProcess | None:
        """Start `argv` (`python -m ...`) in `cwd` with exactly `env`, but for DRIVER_PID_VARIABLE,
        which becomes the server's pid: the job's parent, which follows the driver."""
        shared = server_env(env, self._per_job)
        server = self._server(shared)
        if server is None:
            return None  # the first job of this environment
        if server.failure is None:
            env = {**env, names.DRIVER_PID_VARIABLE: str(server.process.pid)}
            started = server.start(argv, env, str(cwd))
            if isinstance(started, WarmProcess):
                return started
            self._say(started)
        else:
            self._say(server.failure)
        return None

    def _server(self, env: dict[str, str]) -> Server | None:
        key = tuple(sorted(env.items()))
        with self._lock:  # two hosts of a job ask at once: one server
            if key not in self._seen:
                self._seen.add(key)
                idle = IDLE.take((tuple(self.launcher), key))
                if idle is not None:
                    self._servers[key] = idle
                    return idle
                if self._early:
                    self._starting[key] = self._start_early(env)
                return None
            starting = self._starting.get(key)
        if starting is not None:  # started beside the first job: wait for the rest of it
            early = starting.result()
            with self._lock:
                if self._starting.pop(key, None) is starting:
                    self._servers[key] = early
        with self._lock:
            server = self._servers.get(key)
            # A server that crashed is started again; one that could not start is not retried.
            if server is None or (server.failure is None and server.process.poll() is not None):
                self.folder.mkdir(parents=True, exist_ok=True)
                log = self.folder / f"server-{next(self._numbers)}.log"
                server = self._servers[key] = Server(env, log, self.launcher)
            return server

    def _start_early(self, env: dict[str, str]) -> concurrent.futures.Future:
        self.folder.mkdir(parents=True, exist_ok=True)
        log = self.folder / f"server-{next(self._numbers)}.log"
        starting: concurrent.futures.Future = concurrent.futures.Future()

        def start() -> None:
            try:
                starting.set_result(Server(env, log, self.launcher))
            except BaseException as e:  # said by the job that waits for it
                starting.set_exception(e)

        threading.Thread(target=start, name="fork-server-start", daemon=True).start()
        return starting

    def _say(self, reason: str) -> None:
        with self._lock:
            if reason in self._said:
                return
            self._said.add(reason)
        print(f"warm start: {reason}; the job starts cold", file=self.echo, flush=True)

    def close(self) -> None:
        """Leave the healthy servers (their jobs have ended) to the next backend of this
        process (`IDLE`), stop the others, and remove their folder."""
        with self._lock:
            servers, self._servers = list(self._servers.items()), {}
            starting, self._starting = list(self._starting.items()), {}
        servers += [(key, f.result()) for key, f in starting if f.exception() is None]
        for key, server in servers:
            IDLE.keep((tuple(self.launcher), key), server)
        for log in self.folder.glob("server-*.log") if self.folder.exists() else []:
            log.unlink()
        if self.folder.exists() and not any(self.folder.iterdir()):
            self.folder.rmdir()


def warm_start_enabled() -> bool:
    """SMPIPE_WARM_START=0 turns warm start off (every job played as a process starts cold)."""
    return os.environ.get(WARM_START_VARIABLE, "1") != "0"
