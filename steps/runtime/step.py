"""What a step script calls around its work: `run_step(name, main)` (the failure file, the
finished marker, the exit) and `write_step_metadata` (its Metadata section).

Every step ends the same way, as sagemaker-training-toolkit's trainer.py ends a training job:
an exception becomes the one-paragraph reason in SageMaker's failure file, and the process
leaves without waiting forever for threads user code left running.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

from steps.runtime import names
from steps.runtime.environment import failure_file


def finished_marker() -> Path | None:
    failure = failure_file()
    return failure.parent / names.FINISHED if failure else None


def run_step(step: str, main) -> None:
    """Run a step's main(); on an exception write SageMaker's failure file (the reason the
    driver shows the user) with the traceback in the log. Either way the process then ends
    (`end_process`): a step whose work is over never waits for threads user code left."""
    # What the step imported lives as long as its process: out of the collector's sight, each
    # later collection walks only what the step makes (torch's and transformers' objects took
    # 0.3 s a collection; the training job collects to free its model, docs/performance.md).
    gc.freeze()
    try:
        main()
        marker = finished_marker()  # each host's container has its own: its first process
        if marker is not None and int(os.environ.get(names.LOCAL_RANK, "0")) == 0:
            marker.write_text(step)
        code = 0
    except SystemExit as e:  # a step's own status (train's 75 after a checkpoint on SIGTERM)
        code = exit_status(e.code)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the failure file
        traceback.print_exc()
        reason = f"{step}: {type(e).__name__}: {e}"
        path = failure_file()
        if path is not None and int(os.environ.get(names.RANK, "0")) == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(reason[: names.FAILURE_REASON_LIMIT])
        code = 1
    end_process(code)


def exit_status(code: object) -> int:
    """SystemExit's code as the interpreter turns it into a status: None is 0, an integer is
    itself, anything else is printed and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


# How long a step whose work is over waits for the threads still running (a user module's
# logger or client started one at import, not as a daemon) before it ends without them.
THREAD_GRACE_SECONDS = 2.0


def end_process(code: int, grace: float = THREAD_GRACE_SECONDS) -> None:
    """End this process with `code`. The interpreter's own exit when every thread has ended
    within `grace` seconds (modules torn down, their files closed; garbage frozen first, not
    collected: collecting what torch and transformers made is slow, docs/performance.md).
    Otherwise the threads still running are named in the log and left behind: the
    interpreter would join them forever, and so would the job, its driver and whoever stops
    them. The step's own teardown still runs first, in the interpreter's order (atexit
    handlers: wandb's finish, Accelerate's and torch's; then the streams flushed), and the
    process leaves with os._exit, as sagemaker-training-toolkit ends every training job
    (src/sagemaker_training/trainer.py, `_exit_processes`)."""
    left = join_threads(grace)
    if not left:
        gc.freeze()
        sys.exit(code)
    names_left = ", ".join(sorted(repr(t.name) for t in left))
    print(
        f"the step is over; {len(left)} thread(s) still running are not waited for: {names_left}",
        file=sys.stderr,
        flush=True,
    )
    try:
        atexit._run_exitfuncs()
    finally:
        flush_streams()
        os._exit(code & 0xFF)


def flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def join_threads(seconds: float) -> list[threading.Thread]:
    """Wait up to `seconds` for this process's non-daemon threads, as the interpreter does at
    exit (Lib/threading.py `_shutdown`: first the hooks of threading._register_atexit, which
    end concurrent.futures' idle workers, then each thread joined); the ones still running."""
    deadline = time.monotonic() + seconds

    def hooks() -> None:
        for hook in reversed(getattr(threading, "_threading_atexits", [])):
            try:
                hook()
            except Exception:  # noqa: BLE001 - as at exit: one failing hook stops none other
                traceback.print_exc()

    if getattr(threading, "_threading_atexits", None):  # they join what they end: bounded too
        runner = threading.Thread(target=hooks, name="threading-atexit", daemon=True)
        runner.start()
        runner.join(max(0.0, deadline - time.monotonic()))
    me = threading.current_thread()
    waited = [t for t in threading.enumerate() if t is not me and not t.daemon]
    for thread in waited:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [t for t in waited if t.is_alive()]


def write_step_metadata(directory: Path, section: dict) -> None:
    """What a step reports for its Metadata section; the driver picks it up from the output."""
    directory.mkdir(parents=True, exist_ok=True)
    text = json.dumps(section, indent=2, default=str)
    (directory / names.STEP_METADATA_FILE).write_text(text)


def own_logs(folder: Path) -> None:
    """wandb's run folder links its service's debug log (logs/debug-core.log) to a file in the
    user's cache folder named by the second the service started (wandb-core's
    core-debug-<time>.log): two jobs started in one second share it, and the other job goes on
    writing it while this one's output is sealed, whose size and sha256 then disagree, failing
    the output's check. Once this job's wandb has ended, each link out of `folder` becomes a
    copy of what it held (one that leads nowhere goes): the job's output holds its own files."""
    inside = folder.resolve()
    for link in sorted(p for p in folder.rglob("*") if p.is_symlink()):
        target = link.resolve()
        if target.is_relative_to(inside):
            continue
        data = target.read_bytes() if target.is_file() else None
        link.unlink()
        if data is not None:
            link.write_bytes(data)
