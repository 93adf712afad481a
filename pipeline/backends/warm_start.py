"""Warm start for local jobs: a fork server that has already imported what every job imports.

A local job is the image's entrypoint started in its job root (backends/container.py), and a
training job spends seconds importing torch, transformers, pandas and the rest before it does
any work. Here a server process imports those third-party libraries once and forks a child per
job, as Android's zygote, Chromium's zygote and `multiprocessing`'s "forkserver" start method
(https://docs.python.org/3/library/multiprocessing.html#contexts-and-start-methods) do.

The container contract holds: each job is a process of its own, in a session of its own, with
exactly its own environment (os.environ is replaced by the job's), its own working directory
(the job root) and its own code. The server imports nothing of this project (no steps.*, no
user functions): a child rebuilds sys.path from the job's PYTHONPATH, as a fresh interpreter
would, and runs `steps.entrypoint` from the code shipped in its job root. A child that crashes
(a segfault, os._exit, SIGKILL) ends alone: the server reports its status as Popen would (a
negative signal number for a signal death) and goes on serving.

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

Where forking is unsafe the job starts cold (the normal way), and the backend says why once:
- a thread the fork would leave behind holding a lock. The server runs no torch op, so
  libgomp's OpenMP pool never starts in it (libgomp has no fork handlers: a child of a process
  that used OpenMP can hang in its first parallel region, GCC bug 52303). The threads the
  imports do start are known to be fork-safe (`FORK_SAFE_THREADS`); any other thread: cold.
- a CUDA context: CUDA does not support fork after initialisation, and torch refuses CUDA in
  such a child ("Cannot re-initialize CUDA in forked subprocess", torch/cuda/__init__.py). The
  server never touches CUDA; each child initialises its own.
- a job whose code shadows a preloaded library (a `transformers/` folder in its code): a fresh
  interpreter would import the job's copy.

SMPIPE_WARM_START=0 turns warm start off (every local job starts cold), for debugging.

The server is this file run as a script (`python warm_start.py FD DRIVER_PID`), not as
`pipeline.backends.warm_start`, so that importing it imports nothing of the project.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import gc
import importlib
import itertools
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

WARM_START_VARIABLE = "SMPIPE_WARM_START"
# What local jobs import, measured with PYTHONPROFILEIMPORTTIME=1 (cumulative, 2 cores, which
# the profiler slows): a MiniLM training job's step imports transformers 4.6 s (its
# modeling_utils, which `from_pretrained` needs, brings torch's inductor, scipy and sklearn),
# torch 2.1, pandas 0.7, accelerate 0.5, matplotlib 0.3, numpy 0.2; a prepare job torch and
# pyarrow (steps.batching) 1.3 s, sklearn 1.0, datasets 0.8, transformers' tokenizer 0.5.
# Warm, the training job's step imports 0.06 s (the model's own modules). numpy, scipy's BLAS
# and pyarrow come first, so that the threads their libraries start are attributed to them
# (FORK_SAFE_THREADS).
PRELOAD = (
    "numpy",
    "scipy.linalg",
    "pyarrow",
    "pyarrow.compute",
    "torch",
    "safetensors.torch",
    "pandas",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "accelerate",
    "datasets",
    "sklearn.model_selection",
    "sklearn.metrics",
    "scipy.stats",
    "matplotlib.pyplot",
    # A training job with tracking on imports wandb (0.43 s, measured) when Accelerate starts
    # its tracker; importing it starts no thread.
    "wandb",
    "accelerate.tracking",
)
# Threads that importing these modules starts, and why a fork beside them is safe.
FORK_SAFE_THREADS = {
    # OpenBLAS (numpy's and scipy's own copies) starts its thread pool when it loads, and shuts
    # it down before every fork (pthread_atfork, OpenBLAS driver/others/memory.c,
    # openblas_fork_handler); the child starts its own on its first BLAS call.
    "numpy": "OpenBLAS's thread pool",
    "scipy.linalg": "OpenBLAS's thread pool",
    # Arrow's bundled jemalloc runs a background purging thread; jemalloc takes its own locks
    # around fork (jemalloc_prefork / jemalloc_postfork_child) and the child starts its own.
    "pyarrow": "jemalloc's background thread",
}
READY = b"ready\n"
MESSAGE_LIMIT = 1 << 20  # a request: argv, env and cwd as JSON
SERVER_START_SECONDS = 300  # the preload takes seconds; a busy machine, a minute


# -- the server ----------------------------------------------------------------------------------


def thread_ids() -> set[int]:
    """Every OS thread of this process (Python's and the libraries' own)."""
    return {int(t) for t in os.listdir("/proc/self/task")}


def preload(modules: tuple[str, ...] = PRELOAD) -> set[int]:
    """Import `modules` (those missing are skipped); return the threads their imports started
    that FORK_SAFE_THREADS vouches for."""
    safe: set[int] = set()
    for name in modules:
        before = thread_ids()
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        if name in FORK_SAFE_THREADS:
            safe |= thread_ids() - before
    return safe


def fork_refusal(safe_threads: set[int]) -> str | None:
    """Why this process must not fork now, or None. Checked before every fork: forking copies
    only the calling thread, and a lock another thread held stays locked in the child."""
    others = thread_ids() - {threading.get_native_id()} - safe_threads
    if others:
        names = sorted({Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in others})
        return (
            f"the fork server runs {len(others)} thread(s) of unknown safety ({', '.join(names)})"
        )
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "the fork server holds a CUDA context (CUDA does not survive fork)"
    return None


def shadowing(env: dict[str, str], cwd: str) -> str | None:
    """A folder on the job's path that holds a module the server has loaded (what PRELOAD
    named and everything those imported: huggingface_hub, tokenizers, yaml, ...): a fresh
    interpreter would import the job's copy, a warm child has the server's."""
    preloaded = {
        name.split(".")[0]
        for name, module in list(sys.modules.items())
        if getattr(module, "__file__", None) and not name.startswith("_")
    }
    for entry in [cwd, *job_path_entries(env, cwd)]:
        try:
            names = {n.split(".")[0] for n in os.listdir(entry)}
        except OSError:
            continue
        if names & preloaded:
            return (
                f"{entry} holds {', '.join(sorted(names & preloaded))}, which the server preloaded"
            )
    return None


def job_path_entries(env: dict[str, str], cwd: str) -> list[str]:
    """PYTHONPATH's entries as the interpreter puts them on sys.path: absolute, normalised,
    an empty one standing for the working directory (Python 3.11's getpath, observed)."""
    value = env.get("PYTHONPATH", "")
    return (
        [os.path.normpath(os.path.join(cwd, p)) for p in value.split(os.pathsep)] if value else []
    )


def job_sys_path(env: dict[str, str], cwd: str, base: list[str]) -> list[str]:
    """sys.path of `python -m ...` started in `cwd` with `env`: the working directory, then
    PYTHONPATH's entries, then the interpreter's own (the server's, which has no PYTHONPATH)
    (https://docs.python.org/3/library/sys_path_init.html)."""
    return [cwd, *job_path_entries(env, cwd), *base]


def set_command_line(argv: list[str]) -> None:
    """Show `argv` as this process's command line (/proc/PID/cmdline, what ps, pgrep -f and
    psutil read), truncated to the room the server's own command line left. A fork keeps its
    parent's; setproctitle and PostgreSQL's ps_status.c rewrite it the same way, in the memory
    the kernel reads it from (arg_start..arg_end, fields 48-49 of /proc/self/stat, proc(5))."""
    import ctypes

    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # fields 48 and 49, counted from 1
    except (OSError, IndexError, ValueError):
        return
    title = "\0".join(argv).encode()[: end - start - 1]
    ctypes.memmove(start, title.ljust(end - start, b"\0"), end - start)


def serve(control: socket.socket, driver: int, safe_threads: set[int]) -> None:
    """Answer requests until the driver is gone: its end of the control socket closes when it
    dies (however it dies), and our parent changes. PR_SET_PDEATHSIG is not used: it fires when
    the *thread* that started us ends (prctl(2)), and jobs are started from short-lived threads.
    A request brings two descriptors (SCM_RIGHTS): a socket of the job's own, for the reply and
    the exit status, and the write end of the job's output pipe."""
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ, "request")
    exits: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (the job's pid, its socket)
    while os.getppid() == driver:
        for key, _ in selector.select(timeout=1.0):
            if key.data == "request":
                message, fds, _, _ = socket.recv_fds(control, MESSAGE_LIMIT, 2)
                if not message and not fds:
                    return  # the driver is gone
                if len(fds) != 2:
                    for fd in fds:
                        os.close(fd)
                    continue
                connection = socket.socket(fileno=fds[0])
                closing = [control, selector, *(c for _, c in exits.values())]
                pid = answer(json.loads(message), connection, fds[1], safe_threads, closing, exits)
                if pid is None:
                    connection.close()
                    continue
                pidfd = os.pidfd_open(pid)  # readable when the child exits (Linux 5.3)
                exits[pidfd] = (pid, connection)
                selector.register(pidfd, selectors.EVENT_READ, "exit")
            else:
                selector.unregister(key.fd)
                pid, connection = exits.pop(key.fd)
                os.close(key.fd)
                report_exit(pid, connection)


def report_exit(pid: int, connection: socket.socket) -> None:
    """The child's exit status, as Popen.returncode reports it, and its whole CPU time, to whoever
    started it. wait4(2)'s rusage is the child's own time with that of every child it waited
    for (Linux's wait_task_zombie, kernel/exit.c, fills it with getrusage(p, RUSAGE_BOTH)): the
    job's step and its subprocesses, which the driver, not being the parent, cannot read once
    the job is reaped. Checked here: a child that burnt 0.6 s in a subprocess it waited for and
    0.4 s itself was reported at 1.05 s."""
    _, status, usage = os.wait4(pid, 0)
    report = {
        "status": os.waitstatus_to_exitcode(status),
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
    }
    try:
        connection.send(json.dumps(report).encode())
    except OSError:
        pass  # the driver's side went away first
    connection.close()


def answer(
    request: dict,
    connection: socket.socket,
    output: int,
    safe_threads: set[int],
    closing: list,
    pidfds: dict,
) -> int | None:
    """One request: fork a child for the job and reply with its pid, or reply why not."""
    refusal = None
    if request["argv"][1:2] != ["-m"] or len(request["argv"]) < 3:
        refusal = f"not a `python -m MODULE` command: {request['argv']}"
    refusal = refusal or fork_refusal(safe_threads) or shadowing(request["env"], request["cwd"])
    pid = None
    if refusal is None:
        try:
            pid = fork_job(request, output, [*closing, connection], list(pidfds))
        except OSError as e:
            refusal = f"fork failed: {e}"
    os.close(output)
    reply = {"pid": pid} if refusal is None else {"cold": refusal}
    try:
        connection.send(json.dumps(reply).encode())
    except OSError:
        pass  # its exit is still reaped
    return pid


def fork_job(request: dict, output: int, closing: list, pidfds: list[int]) -> int:
    """Fork the job's process; return its pid once it is a session leader (as Popen returns
    once its child has exec'ed), so that killpg(pid) reaches it from the first moment."""
    ready_r, ready_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError:
        os.close(ready_r)
        os.close(ready_w)
        raise
    if pid == 0:
        os.close(ready_r)
        become_job(request, output, ready_w, closing, pidfds)  # never returns
    os.close(ready_w)
    os.read(ready_r, 1)  # EOF: the child closed its end after setsid (or died)
    os.close(ready_r)
    return pid


def become_job(request: dict, output: int, ready: int, closing: list, pidfds: list[int]) -> None:
    """In the child: turn into the job's `python -m MODULE ARGS` and exit with its status."""
    code = 1
    try:
        os.setsid()
        os.close(ready)
        for item in closing:  # the server's sockets: the driver's and other jobs' are not ours
            item.close()
        for fd in pidfds:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)  # a container's stdin (no `docker run -i`)
        for source, target in ((null, 0), (output, 1), (output, 2)):
            os.dup2(source, target)
        os.close(null)
        os.close(output)
        signal.pthread_sigmask(signal.SIG_SETMASK, STARTUP_SIGNAL_MASK)
        for signum, handler in STARTUP_SIGNALS.items():
            try:
                signal.signal(signum, handler)
            except (OSError, ValueError):
                pass  # one the C library keeps for itself
        argv, env, cwd = request["argv"], request["env"], request["cwd"]
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.path[:] = job_sys_path(env, cwd, BASE_SYS_PATH)
        importlib.invalidate_caches()
        sys.orig_argv[:] = argv
        set_command_line(argv)
        reseed()
        code = run_module_as_main(argv[2], argv[3:])
    except BaseException:  # noqa: BLE001 - the child must end here, whatever happened
        traceback.print_exc()
    finally:
        os._exit(code)


def reseed() -> None:
    """Random state a fresh interpreter draws anew: `random` reseeds itself in a forked child
    (os.register_at_fork in Lib/random.py), numpy's global RandomState (seeded from the OS when
    numpy is imported) does not."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def run_module_as_main(module: str, args: list[str]) -> int:
    """`python -m module args...` in this process; the exit status the interpreter would have:
    SystemExit's code, 1 and the traceback for an uncaught exception, death by SIGINT for an
    uncaught KeyboardInterrupt (CPython does the same since 3.8, bpo-1054041). Then what the
    interpreter does on its way out: non-daemon threads are joined (for THREAD_GRACE_SECONDS
    at most: the caller leaves with os._exit, without the ones still running) and atexit
    handlers run."""
    sys.argv = ["-m", *args]  # runpy puts the module's file in argv[0], as `-m` does
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = exit_code(e.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - reported as the interpreter reports it
        sys.excepthook(*sys.exc_info())
        code = 1
    join_threads(THREAD_GRACE_SECONDS)
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code & 0xFF


# A job's threads still running this long after its module returned are left behind, as
# steps/contract.py's `end_process` leaves a step's (this file imports nothing of steps/).
THREAD_GRACE_SECONDS = 2.0


def join_threads(seconds: float) -> None:
    """threading._shutdown with a deadline: the hooks of threading._register_atexit, then
    every non-daemon thread joined until `seconds` have passed (Lib/threading.py)."""
    deadline = time.monotonic() + seconds
    for hook in reversed(getattr(threading, "_threading_atexits", [])):
        hook()
    me = threading.current_thread()
    for thread in [t for t in threading.enumerate() if t is not me and not t.daemon]:
        thread.join(max(0.0, deadline - time.monotonic()))


def exit_code(code: object) -> int:
    """SystemExit's code as the interpreter turns it into a status: None is 0, an integer is
    itself, anything else is printed and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


STARTUP_SIGNALS: dict[int, object] = {}  # a fresh interpreter's dispositions, set in main()
STARTUP_SIGNAL_MASK: set[int] = set()
BASE_SYS_PATH: list[str] = []


def main(argv: list[str]) -> int:
    """The server: snapshot a fresh interpreter's state, preload, say so, serve."""
    control, driver = socket.socket(fileno=int(argv[0])), int(argv[1])
    # Run as a script, Python put this file's folder first on sys.path; a fresh `python -m`
    # has its working directory there instead, which each child puts back (job_sys_path).
    here = os.path.dirname(os.path.abspath(__file__))
    BASE_SYS_PATH[:] = [p for p in sys.path if p != here]
    sys.path[:] = BASE_SYS_PATH
    for signum in signal.valid_signals():
        handler = signal.getsignal(signum)
        if handler is not None and signum not in (signal.SIGKILL, signal.SIGSTOP):
            STARTUP_SIGNALS[signum] = handler
    STARTUP_SIGNAL_MASK.update(signal.pthread_sigmask(signal.SIG_BLOCK, []))
    safe_threads = preload()
    # Children then leave the preloaded objects' pages alone when they collect garbage
    # (https://docs.python.org/3/library/gc.html#gc.freeze: "call gc.freeze() in the parent
    # process just before fork").
    gc.freeze()
    control.send(READY)
    serve(control, driver, safe_threads)
    return 0


# -- the backend's side ---------------------------------------------------------------------------


def per_job_variables() -> frozenset[str]:
    """The variables that name one job (set by backends/container.py and the request): left out
    of a server's environment, so that one server serves every job of a run. Imported here, not
    at the top: this file is also the server's script, which imports nothing of the project."""
    from steps.entrypoint import (
        DRIVER_PID_VARIABLE,
        MASTER_ADDR_VARIABLE,
        MASTER_PORT_VARIABLE,
        ML_ROOT_VARIABLE,
        PROCESSES_VARIABLE,
        STEP_VARIABLE,
        TRIAL_CHECKPOINTS_VARIABLE,
    )

    return frozenset(
        {
            "PYTHONPATH",  # names the job root's code folders (docker/Dockerfile's ENV)
            "TRAINING_JOB_NAME",  # what SageMaker sets (training_env)
            "TRAINING_JOB_ARN",
            ML_ROOT_VARIABLE,
            DRIVER_PID_VARIABLE,
            MASTER_ADDR_VARIABLE,
            MASTER_PORT_VARIABLE,
            STEP_VARIABLE,
            PROCESSES_VARIABLE,
            TRIAL_CHECKPOINTS_VARIABLE,
        }
    )


# Variables left out of a server's environment besides the per-job ones, because no preloaded
# library reads them when imported (tests/test_warm_start.py traces every os.environ read of a
# preload): a job still gets them, in its own environment. SMPIPE_*: this project's (the server
# imports nothing of it). PYTEST_*: pytest's bookkeeping (PYTEST_CURRENT_TEST changes with every
# test phase). Which AWS to call and as whom: botocore reads these when a session or client is
# made, never at import; a server kept between runs (IDLE) then holds no run's AWS credentials.
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


# StopTrainingJob's time between SIGTERM and SIGKILL (API_StopTrainingJob.html), as
# backends/container.py's STOP_GRACE_SECONDS.
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
    processes, a notebook several, and a server's preload (6 s of CPU here) is then paid once,
    not once a run. A server serves each job from the state it had after its preload, whatever
    ran before, so a run forked from a kept server sees what one forked from a new server
    would; what stays shared is what a run's jobs already share (see the module's docstring).
    At most `limit` are kept (each holds the libraries' memory, 0.5 GB here), the oldest
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

    def close(self) -> None:
        """Stop every kept server (at exit, and for tests that need a cold start)."""
        with self._lock:
            servers, self._servers = list(self._servers.values()), collections.OrderedDict()
        for server in servers:
            server.close()


IDLE = IdleServers(limit=2)
atexit.register(IDLE.close)


class WarmStart:
    """The local backend's starter (Containers(starter=...)): a fork server per distinct
    import-relevant environment. `start` returns the job's process, or None where the job
    starts cold: the first job of an environment (below), or one a server refused or could
    not serve (the reason said to `echo`, once).

    The first job of an environment starts cold, and the server starts with the second: it
    preloads more than any one job imports (5 s here, against 0.8 s for a cold reconcile job
    and 3.6 s for prepare), so a backend that runs one job (a test, a one-step run) would pay
    for nothing, and a run's first job, reconcile, is light. Where more jobs of the
    environment are sure to follow (a study's trials: `expecting_more`), the server starts
    beside the first job instead, so that the second does not wait for its preload (6 s a
    study, measured on the shipped tuning example's second MiniLM trial).
    A backend that closes leaves its healthy servers to the next backend of this process with
    the same environment (`IDLE`): that backend's first job starts warm too.
    `folder` holds the servers' own logs (what they print on stderr: a traceback if one
    fails). `launcher`: the command that runs this file as the server (tests start it beside
    a thread of their own)."""

    def __init__(self, folder: Path, echo=None, launcher: list[str] | None = None) -> None:
        self.folder = folder
        self.launcher = launcher or [sys.executable, __file__]
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
        from steps.entrypoint import DRIVER_PID_VARIABLE

        shared = server_env(env, self._per_job)
        server = self._server(shared)
        if server is None:
            return None  # the first job of this environment
        if server.failure is None:
            env = {**env, DRIVER_PID_VARIABLE: str(server.process.pid)}
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
    """SMPIPE_WARM_START=0 turns warm start off (every local job starts cold)."""
    return os.environ.get(WARM_START_VARIABLE, "1") != "0"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
