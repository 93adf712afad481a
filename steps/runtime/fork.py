"""Become `python -m MODULE ARGS` in a forked process, as a fresh interpreter would run it.

The one copy of it: the entrypoint forks its step from itself where a warm-start server
started it with the libraries already imported (`ForkedStep`), and the warm-start server
(pipeline/player/fork_server.py) forks each job the same way (`become_module`). Both forks
have had their descriptors, session, signals and environment set by the caller first.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

from steps.runtime.step import THREAD_GRACE_SECONDS, exit_status, flush_streams, join_threads


def become_module(argv: list[str]) -> int:
    """In a forked child whose descriptors, session, signals and environment are already the
    job's: what `python -m MODULE ARGS` (`argv`, as `[python, "-m", MODULE, *ARGS]`) would do,
    and the status it would exit with. The caller leaves with os._exit(status)."""
    sys.orig_argv[:] = argv
    set_command_line(argv)
    reseed()
    return run_module_as_main(argv[2], argv[3:])


def reseed() -> None:
    """Random state a fresh interpreter draws anew: `random` reseeds itself in a forked child
    (os.register_at_fork in Lib/random.py), numpy's global RandomState (seeded from the OS when
    numpy is imported) does not."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def run_module_as_main(module: str, args: list[str]) -> int:
    """`python -m module args...` in this process, and the status the interpreter would exit
    with: SystemExit's code, 1 and the traceback for an uncaught exception, death by SIGINT for
    an uncaught KeyboardInterrupt (CPython does the same since 3.8, bpo-1054041). Then what the
    interpreter does on its way out: non-daemon threads joined (for THREAD_GRACE_SECONDS at
    most: the caller leaves with os._exit, without the ones still running), atexit handlers
    run, the streams flushed."""
    import atexit

    sys.argv = ["-m", *args]  # runpy puts the module's file in argv[0], as `-m` does
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = exit_status(e.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - reported as the interpreter reports it
        sys.excepthook(*sys.exc_info())
        code = 1
    join_threads(THREAD_GRACE_SECONDS)  # as threading._shutdown, with a deadline
    atexit._run_exitfuncs()
    flush_streams()
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code & 0xFF


def set_command_line(argv: list[str]) -> None:
    """Show `argv` as this process's command line (/proc/PID/cmdline: what ps, pgrep -f and
    psutil read); a fork keeps its parent's. setproctitle and PostgreSQL's ps_status.c rewrite
    it the same way, in the memory the kernel reads it from (arg_start..arg_end, fields 48-49
    of /proc/self/stat, proc(5)), truncated to the room there is."""
    import ctypes

    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # fields 48 and 49, counted from 1
    except (OSError, IndexError, ValueError):
        return
    title = "\0".join(argv).encode()[: end - start - 1]
    ctypes.memmove(start, title.ljust(end - start, b"\0"), end - start)


# -- the entrypoint's step, forked from a warm-started entrypoint --------------------------------


def can_fork_step(command: list[str]) -> bool:
    """Whether the step may be forked from this process rather than started afresh: the local
    backend's fork server (pipeline/player/fork_server.py) started this entrypoint with torch
    and the rest already imported, and the step is a `python -m` command: the step's own
    module, or torchrun (then run as torchrun_fork.py, which forks its workers too). Only
    while this process is single-threaded (fork copies only the calling thread; a lock
    another one held would stay locked in the child) and holds no CUDA context (CUDA does
    not survive fork). Of the variables the entrypoint adds for the step
    (SM_*), the preloaded libraries read at import only SM_HP_MP_PARAMETERS and
    SM_FRAMEWORK_PARAMS (transformers' is_sagemaker_mp_enabled), which matter only with
    smdistributed, which the image does not have."""
    torch = sys.modules.get("torch")
    return (
        torch is not None
        and command[:2] == [sys.executable, "-m"]
        and len(os.listdir("/proc/self/task")) == 1
        and not torch.cuda.is_initialized()
    )


class ForkedStep:
    """A step forked from this process, as subprocess.Popen shows one (`pid`, `args`,
    `stdout`, `poll()`, `wait()`, `returncode`), and started as Popen(command, env=env,
    stdout=PIPE, stderr=STDOUT, start_new_session=True, preexec_fn=preexec_fn) starts one."""

    def __init__(
        self, command: list[str], env: dict[str, str], preexec_fn: Callable[[], None]
    ) -> None:
        self.args, self.returncode = command, None
        self._lock = threading.Lock()  # one waitpid at a time, as Popen's _waitpid_lock
        read, write = os.pipe()
        ready_read, ready_write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(read)
            os.close(ready_read)
            _become_step(command, env, write, ready_write, preexec_fn)  # never returns
        os.close(write)
        os.close(ready_write)
        os.read(ready_read, 1)  # EOF once the child leads its session, as Popen after exec
        os.close(ready_read)
        self.stdout = os.fdopen(read, "rb")

    def poll(self) -> int | None:
        return self._wait(os.WNOHANG)

    def wait(self) -> int:
        return self._wait(0)

    def _wait(self, flags: int) -> int | None:
        if not self._lock.acquire(blocking=flags == 0):
            return None  # another thread is waiting for it
        try:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, flags)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode
        finally:
            self._lock.release()


def _become_step(
    command: list[str], env: dict[str, str], output: int, ready: int, preexec_fn
) -> None:
    """In the forked child: what Popen(start_new_session=True, preexec_fn=preexec_fn) and a
    fresh `python -m MODULE ARGS` would make of it; exits with the step's status."""
    code = 1
    try:
        os.setsid()
        preexec_fn()
        os.close(ready)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(output)
        fresh = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
        for signum, handler in fresh.items():
            if callable(signal.getsignal(signum)):  # a handler; an ignored signal stays so
                signal.signal(signum, handler)
        os.environ.clear()
        os.environ.update(env)  # sys.path stays: same working directory, same PYTHONPATH
        code = become_module(command)
    except BaseException:  # noqa: BLE001 - the child must end here, whatever happened
        traceback.print_exc()
    finally:
        os._exit(code)
