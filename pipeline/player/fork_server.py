"""The warm-start fork server: a program that has already imported what every job imports, and
forks a child per job, as Android's zygote, Chromium's zygote and `multiprocessing`'s
"forkserver" start method (https://docs.python.org/3/library/multiprocessing.html#contexts-and-
start-methods) do. Its client, what the local backend starts jobs through, is fork_client.py.

A local job is the image's entrypoint started in its job root (processes.py), and a training
job spends seconds importing torch, transformers, pandas and the rest before it does any work:
the server imports those third-party libraries once.

The container contract holds: each job is a process of its own, in a session of its own, with
exactly its own environment (os.environ is replaced by the job's), its own working directory
(the job root) and its own code. The server imports nothing of this project (no steps.*, no
user functions): a child rebuilds sys.path from the job's PYTHONPATH, as a fresh interpreter
would, and runs `steps.entrypoint` from the code shipped in its job root, through that
code's steps.runtime.fork (`become_module`: the entrypoint forks its step the same way). A
child that crashes (a segfault, os._exit, SIGKILL) ends alone: the server reports its status
as Popen would (a negative signal number for a signal death) and goes on serving.

Where forking is unsafe the job starts cold (the normal way), and the client says why once:
- a thread the fork would leave behind holding a lock. The server runs no torch op, so
  libgomp's OpenMP pool never starts in it (libgomp has no fork handlers: a child of a process
  that used OpenMP can hang in its first parallel region, GCC bug 52303). The threads the
  imports do start are known to be fork-safe (`FORK_SAFE_THREADS`); any other thread: cold.
- a CUDA context: CUDA does not support fork after initialisation, and torch refuses CUDA in
  such a child ("Cannot re-initialize CUDA in forked subprocess", torch/cuda/__init__.py). The
  server never touches CUDA; each child initialises its own.
- a job whose code shadows a preloaded library (a `transformers/` folder in its code): a fresh
  interpreter would import the job's copy.

The server is this file run as a script (`python fork_server.py FD DRIVER_PID`), not as
`pipeline.player.fork_server`, so that running it imports nothing of the project; the client
imports it for its wire constants (READY, MESSAGE_LIMIT) and nothing it imports is the project's.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path

# What local jobs import (PYTHONPROFILEIMPORTTIME=1 shows each one's cost: a training job's
# step spends most of its start in transformers' modeling_utils, which `from_pretrained` needs
# and which brings torch's inductor, scipy and sklearn; docs/performance.md has the figures).
# Warm, a training job's step imports only the model's own modules. numpy, scipy's BLAS and
# pyarrow come first, so that the threads their libraries start are attributed to them
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
    # A training job with tracking on imports wandb when Accelerate starts its tracker;
    # importing it starts no thread.
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
    the job is reaped (tests/test_warm_start.py checks a child's time with its subprocess's)."""
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
    """In the child: turn into the job's `python -m MODULE ARGS` and exit with its status: a
    container's descriptors, session, signals, environment, folder and sys.path, then
    steps.runtime.fork's `become_module`."""
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
        # The rest is what the entrypoint does when it forks its step: the one copy, imported
        # here from the job's own code (its sys.path is set), as its entrypoint will be; the
        # server itself imports nothing of the project.
        from steps.runtime.fork import become_module

        code = become_module(argv)
    except BaseException:  # noqa: BLE001 - the child must end here, whatever happened
        traceback.print_exc()
    finally:
        os._exit(code)


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
    # What the Python docs prescribe for a parent that forks without exec
    # (https://docs.python.org/3/library/gc.html#gc.freeze: "call gc.disable() early in the
    # parent process, gc.freeze() right before fork(), and gc.enable() early in child
    # processes"), the collector back on here so that every child starts with it: children
    # leave the preloaded objects' pages alone when they collect, and the imports are not
    # walked again and again as the heap grows (1.3 s of a 6.7 CPU-s start here). Cycles the
    # imports left (about 1.5% of their objects) stay, frozen with the rest.
    gc.disable()
    safe_threads = preload()
    gc.freeze()
    gc.enable()
    control.send(READY)
    serve(control, driver, safe_threads)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
