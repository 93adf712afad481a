"""The driver's check of the user functions, run in a process of its own.

Before any job starts, the driver imports the user's module to check the five functions
against the contract (steps/user_code.py) and to key the data-step cache by what they can reach
(pipeline/cache.py `step_reaches`). Importing it runs the user's code, and whatever that does
stays in the checking process: a variable set in os.environ (which every local job would
inherit from the driver), a chdir, modules imported or patched, signal handlers, atexit hooks,
sys.exit, and threads started and never ended (the driver would wait for a non-daemon one when
it exits, forever). The driver gets back the problems found, or each data step's cache key
part; the jobs get the environment the driver had, which no user code has touched.

The checking process resolves modules exactly as the driver would (its sys.path, its working
directory, the settings file's folder first), answers on a pipe of its own (what the import
prints goes where the driver's output goes), and leaves with os._exit once it has answered:
nothing the import started is waited for, and its session is killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from steps.user_code import UserFunctionError

if TYPE_CHECKING:  # the driver's side only: the checking process imports neither
    from pipeline.config import Settings

# How long the check may take: importing torch and transformers from a cold disk takes a
# minute on a small instance; a module that never finishes importing is refused after this.
CHECK_SECONDS = 600
# The checking process: the driver's sys.path, then the check. `-c`, so that nothing of this
# project is imported before sys.path is the driver's.
BOOTSTRAP = (
    "import json, sys; request = json.loads(sys.stdin.read()); sys.path[:] = request['sys_path']; "
    "from pipeline.user_check import answer; answer(request)"
)


def check_user_functions(settings: Settings) -> dict[str, tuple[str, str | None]]:
    """Check USER_FUNCTIONS in a process of its own: raise UserFunctionError listing every
    problem, or return what each data step's functions can reach (cache.step_reaches)."""
    from pipeline.code_bundle import user_code

    module = settings.experiment.user_functions
    request = {
        "module": module,
        "search_path": settings.base_dir,
        "sys_path": sys.path,
        "own": {name: str(path) for name, path in user_code(settings).items()},
    }
    read, write = os.pipe()
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", BOOTSTRAP, str(write)],
            stdin=subprocess.PIPE,
            pass_fds=[write],
            start_new_session=True,  # the terminal's Ctrl-C is the driver's; killed as one below
        )
    except BaseException:
        os.close(read)
        raise
    finally:
        os.close(write)
    try:
        child.stdin.write(json.dumps(request).encode())
        child.stdin.close()
        said = read_answer(read, child, time.monotonic() + CHECK_SECONDS)
    finally:
        os.close(read)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)  # what the import started goes with it
        child.wait()
    if said is None:
        raise UserFunctionError(
            [f"importing '{module}' did not finish in {CHECK_SECONDS} s"], module
        )
    try:
        answer = json.loads(said)
    except ValueError:
        why = f"exit status {child.returncode}"
        raise UserFunctionError(
            [f"checking '{module}' ended without an answer ({why})"], module
        ) from None
    if answer.get("problems"):
        raise UserFunctionError(answer["problems"], module)
    return {step: (reach, why) for step, (reach, why) in answer["reaches"].items()}


def read_answer(fd: int, child: subprocess.Popen, deadline: float) -> bytes | None:
    """What the child wrote on `fd`: until the pipe ends, or until the child has exited and
    nothing more is there (a process it forked may hold the pipe open); None at `deadline`."""
    said = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], min(1.0, deadline - time.monotonic()))
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return said
            said += chunk
        elif child.poll() is not None:
            return said
    return None


def answer(request: dict) -> None:
    """In the checking process: import and check, write the answer, leave."""
    from pipeline.cache import step_reaches
    from steps.user_code import load_user_functions

    fd = int(sys.argv[1])
    module = request["module"]
    try:
        functions = load_user_functions(module, request["search_path"])
        own = {name: Path(path) for name, path in request["own"].items()}
        said = {"reaches": step_reaches(functions, own)}
    except UserFunctionError as e:
        said = {"problems": e.problems}
    except BaseException as e:  # noqa: BLE001 - following its imports ran more of its code
        said = {"problems": [f"checking '{module}' raised {type(e).__name__}: {e}"]}
    data = json.dumps(said).encode()
    while data:
        data = data[os.write(fd, data) :]
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(0)
