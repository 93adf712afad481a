"""The environment a job's container starts with, as SageMaker and Docker give it: a new
container's (Docker's defaults and the base image's), the image's ENV (read from
docker/Dockerfile, the job root in place of /opt/ml), and what SageMaker sets in a training
container. The request's own Environment goes on top (processes.py `ProcessLauncher`).
"""

from __future__ import annotations

import atexit
import os
import shlex
import shutil
import sys
import threading
from pathlib import Path

from pipeline.player.job_root import new_work_root
from steps.runtime.names import (
    CONTAINER_ROOT,
    CPU_BF16_VARIABLE,
    ML_ROOT_VARIABLE,
    TRAINING_JOB_ARN,
    TRAINING_JOB_NAME,
)

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = PROJECT_ROOT / "docker/Dockerfile"


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        current += " " + line.removesuffix("\\").strip() if current else line.removesuffix("\\")
        if not line.endswith("\\"):
            lines.append(current.strip())
            current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def image_env(root: Path) -> dict[str, str]:
    """The image's ENV, as a container of it sees it, with the job root in place of /opt/ml."""
    env: dict[str, str] = {}
    for instruction, args in dockerfile_instructions():
        if instruction != "ENV":
            continue
        for token in shlex.split(args):
            key, _, value = token.partition("=")
            env[key] = value.replace(CONTAINER_ROOT, str(root))
    env[ML_ROOT_VARIABLE] = str(root)
    return env


# A container of the image starts with what Docker sets in every Linux container (HOME, PATH,
# HOSTNAME: https://docs.docker.com/engine/containers/run/#environment-variables) and what the
# base image's ENV adds (pytorch/pytorch's Dockerfile: its Python's folder first on PATH, the
# NVIDIA_* variables and LD_LIBRARY_PATH, which matter only beside a GPU driver; no LANG or
# LC_ALL, nor does docker/Dockerfile set them, so a job gets none: its Python coerces the C
# locale to C.UTF-8 itself, PEP 538); docker/Dockerfile's ENV comes on top (`image_env`), then
# the request's Environment, then what SageMaker sets.
DOCKER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What this machine's processor is, passed on when set, as the processor a job runs on is the
# host's: OpenBLAS's core type, on processors that older OpenBLAS builds misdetect; and the
# override of the bf16 detection (steps/precision.py), set where torch misjudges the CPU.
HOST_VARIABLES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", CPU_BF16_VARIABLE)
# Where torch keeps what COMPILE compiles: unless this names a folder, the system's temporary
# one (torch/_inductor/runtime/cache_dir_utils.py `default_cache_dir`: <tmp>/torchinductor_<user>),
# where nothing would remove it. A container's /tmp goes with the container.
COMPILE_CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
# Where wandb-core writes its debug log: $WANDB_CACHE_DIR/wandb/logs/core-debug-<second>.log,
# else the user's cache folder (wandb's core, GetLoggerPath: `os.Getenv("WANDB_CACHE_DIR")`,
# then `os.UserCacheDir()`), where nothing removes it: every local job added a file to
# ~/.cache/wandb/logs. A container's goes with the container; a local job's with its folder
# (the run keeps a copy: steps/runtime/step.py `own_logs`).
WANDB_CACHE_VARIABLE = "WANDB_CACHE_DIR"
_home: Path | None = None
_home_lock = threading.Lock()


def container_home() -> Path:
    """HOME of the containers this process plays: an empty folder of its own, not the user's
    (root's home in a new container holds no cache; a Hugging Face cache on this machine is not
    the job's), made on first use and removed at exit. One for every job this process plays,
    not one per job: a fork server starts the jobs (fork_client.py) and imported
    huggingface_hub, datasets, matplotlib and accelerate with it, which keep paths under HOME
    from their import (the preload's os.environ reads, traced by tests/test_warm_start.py,
    include HOME); a HOME per job would need a server per job. What jobs write there is
    matplotlib's font cache and config folder (traced: a run's jobs write nothing else), so a
    job that left a file in HOME for a later one would find it here and not on SageMaker
    (README: what `emulated` plays; `--image` gives each container its own). A work root
    (job_root.py): the next driver removes it if this one was killed before it could."""
    global _home
    with _home_lock:
        if _home is None:
            home = new_work_root("containers' HOME") / "home"
            home.mkdir()
            atexit.register(shutil.rmtree, home.parent, ignore_errors=True)
            _home = home
        return _home


def fresh_container_env() -> dict[str, str]:
    """The environment of a new container of the image, before its ENV (see above); and
    torch's compile cache beside the containers' HOME, removed with it, as a container's /tmp
    is with the container."""
    env = {
        "HOME": str(container_home()),
        "PATH": f"{Path(sys.executable).parent}:{DOCKER_PATH}",
        COMPILE_CACHE_VARIABLE: str(container_home().parent / "torchinductor"),
    }
    env.update({k: os.environ[k] for k in HOST_VARIABLES if k in os.environ})
    return env


def user_cache_folder(*parts: str) -> Path:
    """A folder of smpipe's in the user's cache folder ($XDG_CACHE_HOME, by default ~/.cache,
    where pip and Hugging Face keep theirs): what this machine keeps between runs outside the
    store, never in the system's temporary folder."""
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(home, "smpipe", *parts)


def local_job_env(root: Path | None = None) -> dict[str, str]:
    """A local job's environment before the image's ENV: this machine's (the local backend
    runs jobs as the user's own processes), with torch's compile cache in the user's cache
    folder unless the user names one: kept between runs, so that a model compiled before
    compiles again in seconds, and out of the system's temporary folder. Where that folder
    could not be made (a read-only home), torch keeps its own default: a compiling job that
    could not write its cache would fail. wandb's cache in the job's folder `root`, unless the
    user names one (WANDB_CACHE_VARIABLE)."""
    env = dict(os.environ)
    cache = user_cache_folder("torchinductor")
    if COMPILE_CACHE_VARIABLE not in env and can_be_made(cache):
        env[COMPILE_CACHE_VARIABLE] = str(cache)
    if root is not None and WANDB_CACHE_VARIABLE not in env:
        env[WANDB_CACHE_VARIABLE] = str(root / "wandb-cache")
    return env


def can_be_made(folder: Path) -> bool:
    """Whether `folder` is, or could be made, a folder this user writes in; nothing made."""
    existing = next((p for p in (folder, *folder.parents) if p.exists()), Path("/"))
    return existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)


def training_env(request: dict, arn: str | None) -> dict[str, str]:
    """What SageMaker sets in a training container besides the request's Environment
    (your-algorithms-training-algo-running-container.html)."""
    env = {**request.get("Environment", {}), TRAINING_JOB_NAME: request["TrainingJobName"]}
    if arn:
        env[TRAINING_JOB_ARN] = arn
    return env
