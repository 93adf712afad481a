"""How `run` and `predict` are stopped (pipeline/interrupts.py), each case in a process of its
own (a test must not change the handlers of the process that runs the tests): the stop a
thread finds wakes a main thread that waits, a closed output after the outcome is recorded
stops nothing, a signal the command was started with ignored stays ignored, and a stop between
a run's claim and its loop is recorded."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, write_settings


def run_snippet(code: str, timeout: float = 120) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_closed_output_found_by_a_thread_wakes_a_main_thread_that_waits():
    """A tuning run's main thread waits for its trials (`Event.wait()`, no timeout): the stop
    a job's output thread found was only acted on once the last trial ended
    (`_thread.interrupt_main` sets a flag; it wakes nothing)."""
    out = run_snippet("""
        import signal, threading
        from pipeline import interrupts
        interrupts.stop_on_signals()
        released = threading.Event()
        threading.Timer(0.2, interrupts.stop_main, args=(signal.SIGPIPE,)).start()
        threading.Timer(60, released.set).start()  # the trials' end, long after
        try:
            released.wait()
            print("not stopped")
        except interrupts.Stopped as e:
            print("stopped:", interrupts.why_stopped(e), released.is_set())
            print(signal.getsignal(signal.SIGINT) is interrupts._still_stopping)
        import os; os._exit(0)
    """, timeout=40)  # fmt: skip
    assert out.split("\n")[:2] == ["stopped: the reader of its output went away False", "True"]


def test_a_closed_output_once_the_outcome_is_recorded_only_goes_quiet():
    """The summary printed after the run's end found the pipe closed: the command then said
    the run was interrupted, exit 130, though its record said completed."""
    out = run_snippet("""
        import signal
        from pipeline import interrupts
        interrupts.stop_on_signals()
        interrupts.outcome_recorded()
        interrupts.stop_main(signal.SIGPIPE)
        print("went on")
        interrupts.stop_on_signals()  # the next command of the process starts afresh
        try:
            interrupts.stop_main(signal.SIGPIPE)
        except interrupts.Stopped as e:
            print(interrupts.why_stopped(e))
    """)  # fmt: skip
    assert out == "went on\nthe reader of its output went away\n"


def test_a_signal_ignored_when_the_command_started_stays_ignored():
    """`nohup smpipe run ...`: a closed terminal must not stop the run nohup keeps going."""
    out = run_snippet("""
        import signal
        from pipeline import interrupts
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        interrupts.stop_on_signals()
        print(signal.getsignal(signal.SIGHUP) is signal.SIG_IGN,
              signal.getsignal(signal.SIGTERM) is interrupts._stop)
    """)  # fmt: skip
    assert out == "True True\n"


# A driver stopped (SIGINT to itself) as it claims the run, or as its heartbeat starts: both
# between the claim and the loop, where a stop left the run claimed with no record, or
# `running` for good.
STOPPED_AT = """
import json, os, signal, sys
from pipeline import driver, interrupts
from pipeline.config import load_settings
from pipeline.driver import parse_steps, run_pipeline
from pipeline.store import LocalStore

where = sys.argv[2]
create, heartbeat = LocalStore.create, driver.heartbeat

def create_then_stop(self, key, data):
    made = create(self, key, data)
    if key.endswith("CLAIM"):
        os.kill(os.getpid(), signal.SIGINT)
    return made

def beat_then_stop(store, key):
    os.kill(os.getpid(), signal.SIGINT)
    return heartbeat(store, key)

if where == "claim":
    LocalStore.create = create_then_stop
else:
    driver.heartbeat = beat_then_stop
interrupts.stop_on_signals()
settings = load_settings(sys.argv[1], env={})
try:
    run_pipeline(settings, LocalStore(settings.store_uri()), parse_steps("reconcile"))
except interrupts.Stopped as e:
    print("stopped:", interrupts.why_stopped(e))
    print(signal.getsignal(signal.SIGINT) is interrupts._still_stopping)
"""


@pytest.mark.parametrize("where", ["claim", "heartbeat"])
def test_a_stop_between_the_claim_and_the_loop_is_recorded(tmp_path, demo_raw, where):
    settings = write_settings(tmp_path / "s.ini", str(tmp_path / "store"),
                              data={"RAW_DATA": str(demo_raw)}, models={"MODEL_NAMES": "bow"})  # fmt: skip
    done = subprocess.run([sys.executable, "-c", STOPPED_AT, str(settings), where], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.stdout == "stopped: stopped by the user (Ctrl-C)\nTrue\n", done.stderr
    metadata = tmp_path / "store/test-exp/runs/0001/metadata.json"
    record = json.loads(metadata.read_text())
    assert record["status"] == "interrupted", record
    assert record["failure_reason"] == "stopped by the user (Ctrl-C)"


def test_a_command_puts_back_the_signal_handlers_it_found(tmp_path):
    """A command sets its own (`stop_on_signals`), and the process it ran in may go on: a test
    worker's next test met a Ctrl-C handler left by an earlier test's `smpipe upload`, which
    said "still stopping" and raised nothing."""
    out = run_snippet(f"""
        import signal
        from pipeline import cli
        before = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)]
        cli.main(["upload", {str(tmp_path / 'none.ini')!r}, {str(tmp_path)!r}])
        print([signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)]
              == before)
    """)  # fmt: skip
    assert out.endswith("True\n"), out


def test_once_a_command_says_how_it_ended_a_further_ctrl_c_changes_nothing():
    """A Ctrl-C after the final "interrupted: ..." line printed "still stopping: each job has
    up to 120 s to save", with nothing left to stop."""
    out = run_snippet("""
        import signal
        from pipeline import cli, interrupts
        interrupts.stop_on_signals()
        try:
            signal.raise_signal(signal.SIGINT)
        except interrupts.Stopped as e:
            print(cli.interrupted("run", e))
        print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)
    """)  # fmt: skip
    assert out == "130\nTrue\n"
