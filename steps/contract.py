"""The container contract, read from the environment only.

Training jobs get SageMaker's own variables (SM_MODEL_DIR, SM_CHANNEL_<NAME>, SM_HPS, ...),
set by SageMaker's training drivers or, locally, by the local backend. Processing jobs get
SM_PROCESSING_INPUT_<NAME> / SM_PROCESSING_OUTPUT_<NAME>, which both backends set to the
directories they mount. No step script names an /opt/ml path itself.
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
from dataclasses import dataclass
from pathlib import Path

# Exit status a job uses to say "interrupted, resume me" (SIGTERM from a spot reclaim).
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL


def _env(name: str) -> str:
    try:
        return os.environ[name]
    except KeyError:
        raise RuntimeError(f"the container contract is missing ${name}") from None


@dataclass(frozen=True)
class TrainingEnv:
    model_dir: Path
    output_data_dir: Path
    checkpoint_dir: Path
    failure_file: Path
    channels: dict[str, Path]
    hyperparameters: dict[str, object]
    hosts: list[str]
    current_host: str
    num_gpus: int
    num_cpus: int
    job_name: str


def training_env() -> TrainingEnv:
    channels = json.loads(_env("SM_CHANNELS"))
    training = json.loads(_env("SM_TRAINING_ENV"))
    return TrainingEnv(
        model_dir=Path(_env("SM_MODEL_DIR")),
        output_data_dir=Path(_env("SM_OUTPUT_DATA_DIR")),
        checkpoint_dir=Path(_env("SM_CHECKPOINT_DIR")),
        failure_file=Path(_env("SM_OUTPUT_FAILURE")),
        channels={c: Path(_env(f"SM_CHANNEL_{c.upper()}")) for c in channels},
        hyperparameters=json.loads(_env("SM_HPS")),
        hosts=json.loads(_env("SM_HOSTS")),
        current_host=_env("SM_CURRENT_HOST"),
        num_gpus=int(_env("SM_NUM_GPUS")),
        num_cpus=int(_env("SM_NUM_CPUS")),
        job_name=training.get("job_name", ""),
    )


def processing_input(name: str) -> Path:
    return Path(_env(f"SM_PROCESSING_INPUT_{name.upper()}"))


def processing_output(name: str) -> Path:
    path = Path(_env(f"SM_PROCESSING_OUTPUT_{name.upper()}"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def failure_file() -> Path | None:
    value = os.environ.get("SM_OUTPUT_FAILURE")
    return Path(value) if value else None


# Written when a step's main() has returned: a step that exits 0 without it (os._exit in user
# code) ended before its work was done, and the entrypoint fails the job.
FINISHED = "finished"


def finished_marker() -> Path | None:
    failure = failure_file()
    return failure.parent / FINISHED if failure else None


def run_step(step: str, main) -> None:
    """Run a step's main(); on an exception write SageMaker's failure file (the reason the
    driver shows the user) with the traceback in the log. Either way the process then ends
    (`end_process`): a step whose work is over never waits for threads user code left."""
    try:
        main()
        marker = finished_marker()  # each host's container has its own: its first process
        if marker is not None and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            marker.write_text(step)
        code = 0
    except SystemExit as e:  # a step's own status (train's 75 after a checkpoint on SIGTERM)
        code = exit_status(e.code)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the failure file
        traceback.print_exc()
        reason = f"{step}: {type(e).__name__}: {e}"
        path = failure_file()
        if path is not None and int(os.environ.get("RANK", "0")) == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(reason[:1024])
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
    collected: the objects torch and transformers made cost a second of a training job).
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
    names = ", ".join(sorted(repr(t.name) for t in left))
    print(
        f"the step is over; {len(left)} thread(s) still running are not waited for: {names}",
        file=sys.stderr,
        flush=True,
    )
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code & 0xFF)


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
    (directory / "step_metadata.json").write_text(json.dumps(section, indent=2, default=str))
