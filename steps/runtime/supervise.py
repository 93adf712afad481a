"""The step's process, supervised: started in its own session that dies with the entrypoint,
SIGTERM and SIGINT passed on to the processes that train, its output passed on with secrets
masked, what it left running ended with it, and its exit turned into the job's status and
failure file (`supervise`, `failed_to_start`), as sagemaker-training-toolkit's trainer.py turns
a script's exit into the job's (files.py `write_failure_file`). Unlike the toolkit, the signal
reaches the script (its issues #125, #173), which checkpoints and exits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path

from steps.runtime import launch, names
from steps.runtime.fork import ForkedStep, can_fork_step
from steps.runtime.secrets import redact, scrub_files, secret_values
from steps.runtime.variables import JobSetupError

TAIL_LINES = 20  # the last lines of output kept, for a step that dies without saying why


def die_with_parent() -> None:
    """In the step's process: SIGTERM when the entrypoint dies, however it dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def follow_driver() -> None:
    """SIGTERM to this process when the driver that started it dies (a SIGKILLed driver
    cannot stop its jobs); it is forwarded to the step, which checkpoints and exits."""
    driver = os.environ.get(names.DRIVER_PID_VARIABLE)
    if not driver:
        return
    die_with_parent()
    if os.getppid() != int(driver):  # the driver was gone before the line above
        sys.exit(f"the driver (pid {driver}) that started this job is gone")


def start_step(command: list[str], env: dict[str, str]) -> subprocess.Popen | ForkedStep:
    """The step in a new session that dies with this process, its output on one pipe. Forked
    from this process where it was warm-started (see `can_fork_step`), torchrun as
    torchrun_fork.py, whose workers are forked in turn; started as a new interpreter otherwise
    (in a container, always)."""
    if can_fork_step(command):
        if command[2] == launch.TORCHRUN:
            command = [*command[:2], launch.TORCHRUN_FORK, *command[3:]]
        return ForkedStep(command, env, preexec_fn=die_with_parent)
    return subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )


def training_processes(proc: subprocess.Popen | ForkedStep) -> list[int]:
    """The processes that train: the step itself, or torchrun's workers (its children). Not
    their DataLoader workers: a loader worker killed by SIGTERM fails the training process's
    next batch, and not torchrun, which would give its workers only 30 s before SIGKILL
    (torch/distributed/elastic/multiprocessing/api.py, `close(..., timeout=30)`) where
    SageMaker gives 120 (StopTrainingJob)."""
    if not launch.runs_workers(proc.args):
        return [proc.pid]
    try:
        import psutil

        return [child.pid for child in psutil.Process(proc.pid).children()]
    except Exception:  # noqa: BLE001 - psutil missing or torchrun gone: the step as a whole
        return [proc.pid]


def pass_signals_on(proc: subprocess.Popen | ForkedStep) -> None:
    """SIGTERM and SIGINT to this process go on to the processes that train, each once;
    torchrun may still be starting workers when one comes, so they are looked for again every
    second until the step ends."""
    signalled: dict[object, int] = {}  # pid (or "*": the signal that came) -> signal sent

    def forward(signum, _frame):
        signalled["*"] = signum
        for pid in training_processes(proc):
            if pid not in signalled:
                signalled[pid] = signum
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass

    def keep_forwarding() -> None:
        while proc.poll() is None:
            time.sleep(1)
            if "*" in signalled:
                forward(signalled["*"], None)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    threading.Thread(target=keep_forwarding, daemon=True).start()


def end_leftovers(group: int, grace: float = 2.0) -> None:
    """SIGTERM to what is left of the step's process group once the step has exited, then
    SIGKILL to what is still there `grace` seconds later."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(group, signum)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.time() + grace
        while time.time() < deadline:
            reap_orphans()
            try:
                os.killpg(group, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)


def reap_orphans() -> None:
    """As PID 1 of a container, the entrypoint inherits the orphans of what the step started:
    their exit status is collected so that none stays a zombie (which still counts as alive)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def supervise(
    command: list[str], env: dict[str, str], failure: Path, what: str, outputs: list[Path]
) -> int:
    """Run the step in its own process group and wait; SIGTERM and SIGINT go on to the
    processes that train (`training_processes`), which checkpoint and exit. What it prints is
    passed on with secrets masked, and so are the files it leaves in `outputs` (and the
    failure file) once it ends. A step that checkpointed on a signal exits EXIT_INTERRUPTED,
    whatever torchrun makes of its workers' status."""
    failure.parent.mkdir(parents=True, exist_ok=True)
    failure.unlink(missing_ok=True)
    interrupted = failure.parent / names.INTERRUPTED
    finished = failure.parent / names.FINISHED
    interrupted.unlink(missing_ok=True)
    finished.unlink(missing_ok=True)
    secrets = secret_values({**os.environ, **env})
    proc = start_step(command, {**os.environ, **env})
    pass_signals_on(proc)
    tail: deque[str] = deque(maxlen=TAIL_LINES)

    def pump() -> None:
        for raw in iter(proc.stdout.readline, b""):
            line = redact(raw.decode("utf-8", errors="replace"), secrets)
            sys.stdout.write(line)
            sys.stdout.flush()
            if line.strip():
                tail.append(line.rstrip())

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    code = proc.wait()
    # The job is the step: what it started and left running ends with it, and the job does
    # not wait for it (a helper holding the step's output open would keep it open forever).
    end_leftovers(proc.pid)
    reader.join(timeout=10)
    if code == 0 and not finished.exists():  # os._exit(0) in user code, say
        code = 1
        failure.write_text(
            f"{what} exited with status 0 before it finished its work (os._exit in user code?)"
        )
    finished.unlink(missing_ok=True)
    killed = worker_killed(tail) if code != 0 and launch.runs_workers(command) else None
    if code != 0 and interrupted.exists():  # it checkpointed on the signal: no failure to report
        code = names.EXIT_INTERRUPTED  # torchrun reports its workers' 75 as its own failure (1)
    elif killed:  # torchrun exits 1 whatever ended its worker: the job was killed, and says so
        rank, signum = killed
        then = failure.read_text(errors="replace") if failure.exists() else ""
        reason = f"{what}: rank {rank} was killed by {signal.Signals(signum).name}" + (
            f"; then {then}" if then else ""
        )
        failure.write_text(reason[: names.FAILURE_REASON_LIMIT])
        code = 128 + signum  # as a shell reports a signal: the backends' restart rule reads it
    elif code != 0 and not failure.exists():
        # The step died before it could say why (killed, out of memory, a crash in C code).
        last = " | ".join(list(tail)[-3:]) or "no output"
        reason = f"{what} exited with status {code}: {last}"
        failure.write_text(reason[: names.FAILURE_REASON_LIMIT])
    if failure.exists():  # the reason the user reads: masked in words, not asterisks
        failure.write_text(redact(failure.read_text(errors="replace"), secrets))
    scrub_files([failure.parent, *outputs], secrets)
    return code if code >= 0 else 128 - code


def worker_killed(tail) -> tuple[int, int] | None:
    """The rank and the signal of a torchrun worker whose death ended the job, from torchrun's
    own summary of it ("Root Cause (first observed failure)": its `rank` and its `exitcode`,
    negative for a signal: torch/distributed/elastic/multiprocessing/errors/__init__.py,
    ChildFailedError.format_msg); None where the first failure was not a signal."""
    lines = list(tail)
    starts = [i for i, line in enumerate(lines) if "Root Cause (first observed failure)" in line]
    if not starts:
        return None
    rank = exitcode = None
    for line in lines[starts[-1] :]:
        field, _, value = line.partition(":")
        field, words = field.strip(), value.split()
        if field == "rank" and words and words[0].isdigit():
            rank = int(words[0])
        elif field == "exitcode" and words and words[0].lstrip("-").isdigit():
            exitcode = int(words[0])
    if rank is None or exitcode is None or exitcode >= 0:
        return None
    try:
        signal.Signals(-exitcode)
    except ValueError:
        return None
    return rank, -exitcode


def failed_to_start(failure: Path, error: BaseException) -> int:
    """An error before the step starts: its reason in the failure file, where SageMaker
    reads it, as sagemaker-training-toolkit's trainer.py `train()` writes any error of its
    own setup (files.py `write_failure_file`); secrets masked. Exit status 1."""
    said = str(error) if isinstance(error, JobSetupError) else f"{type(error).__name__}: {error}"
    reason = redact(f"the job could not start its step: {said}", secret_values(dict(os.environ)))
    if not isinstance(error, JobSetupError):
        traceback.print_exc()
    print(reason, file=sys.stderr, flush=True)
    try:
        failure.parent.mkdir(parents=True, exist_ok=True)
        failure.write_text(reason[: names.FAILURE_REASON_LIMIT])
    except OSError as e:
        print(f"{failure} cannot be written: {e}", file=sys.stderr, flush=True)
    return 1
