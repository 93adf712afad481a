"""The driver's check of the user functions, run in a process of its own.

Before any job starts, the driver imports the user's module to check the five functions against
the contract (steps/user_code.py) and to key the data-step cache by what they can reach
(pipeline/cache.py `step_reaches`). Importing runs the user's code, so it runs in a checking
process: what the import does (os.environ, chdir, patched modules, signal handlers, atexit
hooks, sys.exit, threads never ended) stays there, and the jobs get the driver's environment.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from steps.user_code import UserFunctionError

if TYPE_CHECKING:  # the driver's side only: the checking process imports neither
    from pipeline.config import Settings

# How long the check may take: importing torch and transformers from a cold disk takes a
# minute on a small instance; a module that never finishes importing is refused after this.
CHECK_SECONDS = 600
# The checking process started as a new interpreter: the driver's sys.path, then the check.
# `-c`, so that nothing of this project is imported before sys.path is the driver's.
BOOTSTRAP = (
    "import json, sys; request = json.loads(open(sys.argv[1]).read()); "
    "sys.path[:] = request['sys_path']; from pipeline.user_check import answer; answer(request)"
)


def not_shipped(settings: Settings) -> str | None:
    """Why USER_FUNCTIONS would not reach the jobs, if it would not: jobs import only the code
    a run ships, found beside the settings file (or in smpipe's own folder: the demo's), never
    what this machine's PYTHONPATH or site-packages hold, so the check looks where shipping
    looks, and says where the driver found the module instead."""
    import importlib.util

    from pipeline.code_bundle import PROJECT_ROOT, user_code

    module = settings.experiment.user_functions
    top = module.split(".")[0]
    if top in user_code(settings):
        return None
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    where = None
    if spec is not None:  # a namespace package has no origin, only its folders
        where = spec.origin or next(iter(spec.submodule_search_locations or []), None)
    found = f"; this machine imports it from {where}, which no job receives" if where else ""
    return (
        f"[experiment] USER_FUNCTIONS = {module}: no {top}.py or {top}/ beside the settings "
        f"file ({settings.base_dir}) nor in {PROJECT_ROOT}, where a run takes the code its "
        f"jobs import{found}: put it (or a link to it) beside {Path(settings.source).name}"
    )


def demo_in_use(settings: Settings) -> str | None:
    """Said when USER_FUNCTIONS is found not beside the settings file but in smpipe's own
    folder: the run then ships smpipe's demo functions, which a project whose own module is
    missing did not mean (a settings.ini copied elsewhere)."""
    from pipeline.code_bundle import PROJECT_ROOT, user_code

    module = settings.experiment.user_functions
    path = user_code(settings).get(module.split(".")[0])
    if path is None or path.resolve().parent != PROJECT_ROOT:
        return None  # found beside the settings file (smpipe's own settings.ini among them)
    if Path(settings.base_dir).resolve() == PROJECT_ROOT:
        return None
    return (
        f"note: [experiment] USER_FUNCTIONS = {module} is not beside {settings.source}: the run "
        f"ships smpipe's own demo functions, {path}; put yours beside the settings file"
    )


def check_user_functions(
    settings: Settings, steps: list[str] | None = None
) -> dict[str, tuple[str, str | None]]:
    """Check USER_FUNCTIONS in a process of its own: raise UserFunctionError listing every
    problem, or return what each data step's functions can reach (cache.step_reaches).
    `steps`: the run's; one that does not train (or None: a check asked for outside a run)
    is not held to what training asks of the models (a stand-in model serves data steps).

    The checking process resolves modules exactly as the driver would (its sys.path, its
    working directory, the settings file's folder first) and imports the module in the
    environment a local job imports it in (`check_env`); what the import prints goes where the
    driver's output goes."""
    module = settings.experiment.user_functions
    unshipped = not_shipped(settings)
    if unshipped:
        raise UserFunctionError([unshipped], module)
    if demo := demo_in_use(settings):
        from pipeline.errors import log

        log.info(demo)
    trains = steps is not None and "train" in steps
    kept = passed_before(settings, trains)
    if kept.exists() and not os.environ.get(CHECK_AGAIN):  # this very check passed before
        answer = json.loads(kept.read_text())
        return {step: (reach, why) for step, (reach, why) in answer.items()}
    answer = ask_checking_process(settings, trains)
    if answer.get("problems"):
        raise UserFunctionError(answer["problems"], module)
    try:  # a pass is kept: the next run or plan of the same code skips the 4 s of load_model
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(json.dumps(answer["reaches"]))
    except OSError:  # a cache that cannot be written costs the next check its time, no more
        pass
    return {step: (reach, why) for step, (reach, why) in answer["reaches"].items()}


def ask_checking_process(settings: Settings, trains: bool) -> dict:
    """The checking process's answer: {"reaches": ...} or {"problems": [...]}; a check that
    did not finish, or ended without an answer, raises UserFunctionError."""
    from pipeline.code_bundle import user_code
    from pipeline.player.job_root import new_work_root

    module = settings.experiment.user_functions
    env = check_env()
    # The request and the answer, in a folder the next driver removes if this one is killed
    # before it can (job_root.py). The check runs in it, as every job runs in a folder of its
    # own (a container's, or a job root here): a relative path in the user's code (`./model`)
    # then fails here, naming load_model, not in the job after the data steps.
    folder = new_work_root("the user functions' check")
    try:
        request_file, answer_file = folder / "request.json", folder / "answer.json"
        request = {
            "module": module,
            "search_path": settings.base_dir,
            "sys_path": [os.path.abspath(p) for p in sys.path],  # "": the driver's folder
            "env": env,
            "own": {name: str(path) for name, path in user_code(settings).items()},
            "models": model_settings(settings, trains),
            "answer": str(answer_file),
        }
        request_file.write_text(json.dumps(request))
        status = run_check(request_file, answer_file, env, time.monotonic() + CHECK_SECONDS)
        said = answer_file.read_text() if answer_file.exists() else None
    finally:
        # The check ran in this folder: a file its process still wrote as it was killed can
        # make one pass fail (rmtree's last rmdir), so it is tried again for a moment.
        for _ in range(40):
            shutil.rmtree(folder, ignore_errors=True)
            if not folder.exists():
                break
            time.sleep(0.05)
    if status is None:
        raise UserFunctionError(
            [f"importing '{module}' did not finish in {CHECK_SECONDS} s"], module
        )
    if said is None:
        raise UserFunctionError(
            [f"checking '{module}' ended without an answer (exit status {status})"], module
        )
    return json.loads(said)


# Set (to anything) to check the user functions again although a pass of this very check is
# kept: after a change outside them (the checkpoint folder load_model reads, say).
CHECK_AGAIN = "SMPIPE_CHECK_AGAIN"


def installed(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{package} {version(package)}"
    except PackageNotFoundError:
        return f"{package} none"


def passed_before(settings: Settings, trains: bool = True) -> Path:
    """Where a pass of this check is kept: named by the user's shipped files (path and
    content), the models and their settings, and the check's own code (this module and the
    steps modules it runs), in the user's cache folder ($XDG_CACHE_HOME or ~/.cache, as pip
    keeps its own). What lies outside the user's files (a checkpoint folder from_pretrained
    reads, an installed library) is not in the name: a change there is found by the job."""
    from pipeline.cache import all_files_digest, digest, step_code_digest
    from pipeline.code_bundle import user_code
    from pipeline.player.environment import user_cache_folder

    key = digest(
        all_files_digest(user_code(settings)),
        settings.experiment.user_functions,
        json.dumps(model_settings(settings, trains), sort_keys=True),
        Path(__file__).read_text(),
        step_code_digest("user_code"),
        step_code_digest("finetuning"),
        sys.version,
        *(installed(name) for name in ("torch", "transformers", "peft", "accelerate")),
    )
    return user_cache_folder("user-check", f"{key}.json")


def model_settings(settings: Settings, trains: bool = True) -> dict[str, dict]:
    """Each model's settings that ask something of the model (steps/hyperparameters.py
    MODEL_SETTINGS, the length rows are cut at, and whether the run trains it), for the model
    check (steps/finetuning.py `check_models`): every model of MODEL_NAMES is built once on
    the meta device, whatever they ask."""
    from steps.hyperparameters import MODEL_SETTINGS

    return {
        name: {
            **settings.model_training.get(name, settings.training).model_dump(
                include=set(MODEL_SETTINGS)
            ),
            "max_sequence_length": settings.data.max_sequence_length,
            "trains": trains,
        }
        for name in settings.models.model_names
    }


def check_env() -> dict[str, str]:
    """The checking process's environment: a local job's (processes.py `ProcessLauncher`), the
    driver's (`local_job_env`) with the image's ENV on top (docker/Dockerfile: progress bars
    and transformers' warnings off, as in every job), less what names one job (its PYTHONPATH:
    the check's sys.path is the driver's)."""
    from pipeline.player.environment import image_env, local_job_env
    from pipeline.player.fork_client import per_job_variables
    from steps.runtime.names import CONTAINER_ROOT

    image = image_env(Path(CONTAINER_ROOT))
    per_job = per_job_variables()
    return {**local_job_env(), **{k: v for k, v in image.items() if k not in per_job}}


def run_check(request_file: Path, answer_file: Path, env: dict[str, str], deadline: float):
    """Run the checking process to its end; its exit status, or None at `deadline`. Forked from a
    kept fork server of `env` where there is one and it forks it (fork_server.py says when it
    cannot), a new interpreter otherwise.

    A kept server (fork_client.IDLE: a notebook's second run, the test suite) has torch,
    transformers and datasets imported, which most user modules import at the top: the check
    then takes a fraction of a second instead of seconds. No server is started for a check."""
    from pipeline.player.fork_client import IDLE

    with IDLE.lent(env) as server:
        child = None if server is None else forked_check(server, request_file, env)
        status = None if child is None else wait_for(child, deadline)
    if child is not None and (status is None or answer_file.exists()):
        return status
    # No server, one that would not fork it, or a forked check that ended without an answer
    # (one that could not import this module, say): a new interpreter's answer counts.
    child = subprocess.Popen(
        [sys.executable, "-c", BOOTSTRAP, str(request_file)],
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=request_file.parent,  # a folder of its own, as a job's: see `ask_checking_process`
        start_new_session=True,  # the terminal's Ctrl-C is the driver's; killed as one below
    )
    return wait_for(child, deadline)


def forked_check(server, request_file: Path, env: dict[str, str]):
    """The checking process forked by `server` (fork_client.Server), what it prints passed on
    to this process's standard output (where a new interpreter's would go); None where the
    server answers that it cannot fork it. The child finds this module where the driver does:
    the project's folder on its PYTHONPATH (`main` puts the driver's sys.path and environment
    back before the user's module is imported)."""
    from pipeline.player.fork_client import WarmProcess

    project = str(Path(__file__).resolve().parents[1])
    argv = [sys.executable, "-m", "pipeline.user_check", str(request_file)]
    child = server.start(argv, {**env, "PYTHONPATH": project}, str(request_file.parent))
    if not isinstance(child, WarmProcess):
        return None
    threading.Thread(target=pass_on, args=(child.stdout,), daemon=True).start()
    return child


def pass_on(output) -> None:
    with output:
        for chunk in iter(lambda: output.read1(1 << 16), b""):
            with contextlib.suppress(OSError):
                os.write(1, chunk)


def wait_for(child, deadline: float) -> int | None:
    """`child`'s exit status, or None at `deadline`; then its session is killed either way:
    what the import started goes with it."""
    status = None
    try:
        status = child.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:  # Ctrl-C included
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        if status is None:
            child.wait()
    return status


def answer(request: dict) -> None:
    """In the checking process: import and check, write the answer to a file of the check's
    own folder, leave with os._exit: nothing the import started is waited for (a non-daemon
    thread would hold a normal exit forever), and `wait_for` kills its session."""
    import warnings

    from pipeline.cache import step_reaches
    from steps.user_code import load_user_functions

    # What the libraries warn of as the user's code runs here (PEFT calling a transformers
    # API that warns FutureWarning) reached the terminal of every run and plan; a job's go to
    # its log. The check has no log, and says what it finds itself.
    warnings.simplefilter("ignore")
    module = request["module"]
    try:
        functions = load_user_functions(module, request["search_path"])
        own = {name: Path(path) for name, path in request["own"].items()}
        said = {"reaches": step_reaches(functions, own)}
        if request["models"]:  # torch is imported for them only
            from steps.finetuning import check_models

            problems = check_models(functions, request["models"])
            said = {"problems": problems} if problems else said
    except UserFunctionError as e:
        said = {"problems": e.problems}
    except BaseException as e:  # noqa: BLE001 - following its imports ran more of its code
        said = {"problems": [f"checking '{module}' raised {type(e).__name__}: {e}"]}
    written = Path(request["answer"] + ".part")
    written.write_text(json.dumps(said))
    written.rename(request["answer"])  # whole or not at all
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(0)


def main(request_file: str) -> None:
    """The forked checking process (`python -m pipeline.user_check REQUEST`): the driver's
    sys.path and environment, then the check."""
    request = json.loads(Path(request_file).read_text())
    sys.path[:] = request["sys_path"]
    os.environ.clear()
    os.environ.update(request["env"])
    answer(request)


if __name__ == "__main__":
    main(sys.argv[1])
