"""How a command that runs jobs (`run`, `predict`) is told to stop, and what it says.

Ctrl-C, SIGTERM (a stop), SIGHUP (the terminal it ran in closed) and a closed output (the
reader of its stdout gone: `smpipe run S | head`) each end it the same way: as the
KeyboardInterrupt Ctrl-C raises, so its jobs are stopped, their checkpoints kept and the run
marked interrupted with the reason (`STOPS`). Once it is stopping, a further signal is said,
not obeyed: obeyed, a second Ctrl-C cut the stop short and left the job running, its folder in
the temporary folder and its checkpoint unsynced. The stop is bounded all the same: a job has
120 s to save, then it is killed (pipeline/player/processes.py).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from pipeline.errors import log

# What each way of being stopped records as the run's reason. SIGPIPE is not a signal the
# driver takes (Python ignores it, so that a write to any closed pipe raises BrokenPipeError
# where it happened); the display names it when its own output is closed (`stop_main`).
STOPS = {
    signal.SIGINT: "stopped by the user (Ctrl-C)",
    signal.SIGTERM: "stopped by SIGTERM",
    signal.SIGHUP: "the terminal it ran in was closed (SIGHUP)",
    signal.SIGPIPE: "the reader of its output went away",
}
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STILL_STOPPING = (
    "still stopping: each job has up to 120 s to save, then it is killed; its network and "
    "work folder are removed"
)

# What `stop_main` sent the main thread as its SIGINT (the signal it names), and whether the
# command's outcome is recorded (`outcome_recorded`): a closed output then only goes quiet.
_state: dict = {"pending": None, "recorded": False}
_lock = threading.RLock()  # a handler may run in the main thread while it holds the lock


class Stopped(KeyboardInterrupt):
    """A stop, raised as Ctrl-C's KeyboardInterrupt is (every `except KeyboardInterrupt` ends
    the run alike), with what stopped it."""

    def __init__(self, signum: int) -> None:
        super().__init__(STOPS[signum])
        self.signum = signum


def why_stopped(error: BaseException) -> str:
    """The reason a run records for the KeyboardInterrupt that ended it."""
    return STOPS[error.signum] if isinstance(error, Stopped) else STOPS[signal.SIGINT]


def stop_on_signals(once: bool = True) -> None:
    """From now on in this process, each of SIGNALS stops it as Ctrl-C does (`Stopped`): once,
    any after it said (STILL_STOPPING) while jobs are stopped; or, not `once` (a command with
    no jobs to wait for: `upload`, `prune`), every time. SIGHUP's default would kill the
    driver outright, leaving the run `running`, its jobs' folders in the temporary folder and
    no checkpoint to resume from. A signal the command was started with ignored (`nohup`, a
    script's background job) stays ignored. `main()` puts the handlers back (`restored`)."""
    _state.update(pending=None, recorded=False)
    for each in SIGNALS:
        if signal.getsignal(each) is not signal.SIG_IGN:
            signal.signal(each, _stop if once else _stop_every_time)


def done() -> None:
    """The command has ended, and says how: a signal now changes nothing (`restored` puts the
    handlers back once it has returned)."""
    if threading.current_thread() is threading.main_thread():
        for each in SIGNALS:
            signal.signal(each, signal.SIG_IGN)


@contextmanager
def restored(handler=None) -> Iterator[None]:
    """The signal handlers as they were before the block (`handler` handles SIGNALS in it, if
    given): a command sets its own, and the process it ran in (a test's) may go on to
    another. Only the main thread can set handlers (signal.signal); elsewhere nothing is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {each: signal.getsignal(each) for each in SIGNALS}
    if handler is not None:
        for each in SIGNALS:
            signal.signal(each, handler)
    try:
        yield
    finally:
        for each, was in before.items():  # None: a handler set outside Python
            signal.signal(each, signal.SIG_DFL if was is None else was)


def stopped(signum: int) -> Stopped:
    """The stop `signum` makes, from the main thread (a handler, or a caller that held the
    signals): a SIGINT `stop_main` sent is named as what it sent; from now on every signal is
    said, not obeyed."""
    with _lock:
        pending, _state["pending"] = _state["pending"], None
    for each in SIGNALS:
        if signal.getsignal(each) is _stop:
            signal.signal(each, _still_stopping)
    return Stopped(pending if signum == signal.SIGINT and pending is not None else signum)


def _stop(signum, _frame) -> None:
    raise stopped(signum)


def _stop_every_time(signum, _frame) -> None:
    raise Stopped(signum)


def _still_stopping(_signum, _frame) -> None:
    log.warning(STILL_STOPPING)


def outcome_recorded() -> None:
    """The command's outcome is recorded (a run's final Metadata, a predict's OUTPUT): what
    it still prints is not worth a stop, and an output closed now only goes quiet."""
    _state["recorded"] = True


def stop_main(signum: int) -> None:
    """Stop the command as `signum` would, from whichever thread found the reason: raised here
    in the main thread, else sent to it as a real SIGINT (`signal.pthread_kill`: it wakes a
    main thread that waits, which `_thread.interrupt_main` does not), named `signum`. Nothing
    once the outcome is recorded, or while it is stopping."""
    handler = signal.getsignal(signal.SIGINT)
    if _state["recorded"] or handler is _still_stopping:
        return
    if threading.current_thread() is threading.main_thread():
        raise stopped(signum)
    with _lock:
        if _state["pending"] is not None:  # one is on its way
            return
        _state["pending"] = signum
    if callable(handler):  # one of Python's: SIG_DFL would kill, SIG_IGN ignore
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


@contextmanager
def undisturbed() -> Iterator[None]:
    """While jobs are stopped and their ending recorded (bounded by the jobs' 120 s grace), a
    further signal is said, not obeyed, however the stop began (an error; a caller of the
    driver that set no handlers, as a test's)."""
    with restored(_still_stopping):
        yield


@contextmanager
def held() -> Iterator[list[int]]:
    """SIGNALS held for a few renames that must all happen or none: the numbers of those that
    came are in the list yielded (in the main thread; elsewhere nothing is held)."""
    came: list[int] = []
    with restored(lambda signum, _frame: came.append(signum)):
        yield came
