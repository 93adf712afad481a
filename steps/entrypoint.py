"""The image's entrypoint: SageMaker's bring-your-own-container contract, for every job.

    python3 -m steps.entrypoint train                      a training job (and every tuning trial)
    python3 -m steps.entrypoint process STEP [ARGS ...]    a processing job running steps/STEP.py

This module is shipped with the run's code, like every step: the image carries only the
dependencies and a PYTHONPATH naming the two places SageMaker mounts the code channel
(`/opt/ml/input/data/code` for training, `/opt/ml/processing/input/code` for processing).
All three backends start it the same way; locally the job root replaces `/opt/ml` through
one variable, `SMPIPE_ML_ROOT`.

A training job: reads input/config/{hyperparameters,resourceconfig,inputdataconfig}.json,
exports the SM_* variables SageMaker's framework containers export, and runs the step (under
torchrun across every host and process when there are several: `nnodes` and `node_rank` from
resourceconfig.json, the first host as master). A processing job: exports
SM_PROCESSING_INPUT_<NAME> / SM_PROCESSING_OUTPUT_<NAME> from config/processingjobconfig.json
and runs the step. Both: SIGTERM and SIGINT go on to the processes that train (not to their
DataLoader workers, not through torchrun) and the step is waited for (its checkpoint); keys
named by Secrets Manager secrets are read in the job's own region; a failed step leaves its
one-paragraph reason in output/failure (training) or output/message (processing), which
SageMaker returns as FailureReason or ExitMessage; the exit status is the step's (75 when it
checkpointed on a signal).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path

from steps.contract import EXIT_INTERRUPTED, FINISHED, THREAD_GRACE_SECONDS, join_threads

# The image's ENTRYPOINT, exec form: `docker/Dockerfile` must say exactly this (a test checks).
ENTRYPOINT = ["python3", "-m", "steps.entrypoint"]
ML_ROOT_VARIABLE = "SMPIPE_ML_ROOT"
# Where a job's reason for failing goes, which SageMaker returns: a training job's
# output/failure as FailureReason, a processing job's output/message as ExitMessage
# (your-algorithms-training-algo-output.html, build-your-own-processing-container.html).
FAILURE_FILES = {"train": "output/failure", "process": "output/message"}
# Which module a training job runs (the demo's and every user's: steps.train).
STEP_VARIABLE = "SMPIPE_STEP"
PROCESSES_VARIABLE = "SMPIPE_PROCESSES_PER_HOST"
# Set on tuning trials: each trial keeps its checkpoints in a folder named after the trial,
# so trials sharing the tuning job's CheckpointConfig never resume from each other.
TRIAL_CHECKPOINTS_VARIABLE = "SMPIPE_CHECKPOINT_PER_TRIAL"
# Keys read from Secrets Manager inside the container, never passed in the request: the
# variable naming the secret -> the variable its value becomes (and the JSON key it may sit
# under in the secret, {"WANDB_API_KEY": "..."}).
WANDB_SECRET_VARIABLE = "SMPIPE_WANDB_SECRET_ID"
HF_TOKEN_SECRET_VARIABLE = "SMPIPE_HF_TOKEN_SECRET_ID"
SECRETS_FROM_MANAGER = {
    WANDB_SECRET_VARIABLE: "WANDB_API_KEY",
    HF_TOKEN_SECRET_VARIABLE: "HF_TOKEN",
}
# Where torchrun's master listens. SageMaker's hosts resolve `algo-1`; a local player that
# runs several emulated hosts on one machine names the address and a free port instead.
# Set by a local player (the local and emulated backends): the driver's pid. The container
# ends when the driver does, however the driver ends; on SageMaker the entrypoint is PID 1.
DRIVER_PID_VARIABLE = "SMPIPE_DRIVER_PID"
MASTER_ADDR_VARIABLE = "SMPIPE_MASTER_ADDR"
MASTER_PORT_VARIABLE = "SMPIPE_MASTER_PORT"
TAIL_LINES = 20
# Variables whose values are credentials: masked in everything a job prints or leaves in its
# output (logs, failure files, the wandb run). A fixed list, matched by name: a pattern such
# as "*TOKEN*" would also take TOKENIZERS_PARALLELISM and mask every "false" in a log.
SECRET_VARIABLES = (
    "WANDB_API_KEY",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "HUGGINGFACE_TOKEN",
)
# More names, from [tracking] SECRET_VARIABLES, comma separated.
EXTRA_SECRETS_VARIABLE = "SMPIPE_SECRET_VARIABLES"
REDACTED = "<redacted>"
SCRUB_LIMIT = 256 << 20  # output files larger than this are data, not logs


def secret_names(env: dict[str, str]) -> list[str]:
    extra = [n.strip() for n in env.get(EXTRA_SECRETS_VARIABLE, "").split(",") if n.strip()]
    return [*SECRET_VARIABLES, *extra]


def secret_values(env: dict[str, str]) -> list[str]:
    """The values to mask, longest first (one may contain another); short ones are skipped:
    masking "1" would mask every digit."""
    values = {env[k] for k in secret_names(env) if len(env.get(k, "")) >= 4}
    return sorted(values, key=len, reverse=True)


def redact(text: str, secrets: list[str]) -> str:
    for value in secrets:
        text = text.replace(value, REDACTED)
    return text


def scrub_files(folders: list[Path], secrets: list[str]) -> int:
    """Mask secrets in the files a job leaves behind. The mask keeps each file's length
    (one '*' per byte), so binary records with length prefixes (wandb's .wandb log) stay
    readable. Returns how many files changed."""
    changed = 0
    needles = [v.encode() for v in secrets]
    if not needles:  # nothing to mask: the job's files (a model's gigabytes) are not read
        return 0
    for folder in folders:
        for path in folder.rglob("*") if folder.is_dir() else []:
            if not path.is_file() or path.is_symlink() or path.stat().st_size > SCRUB_LIMIT:
                continue
            data = path.read_bytes()
            masked = data
            for needle in needles:
                masked = masked.replace(needle, b"*" * len(needle))
            if masked != data:
                path.write_bytes(masked)
                changed += 1
    return changed


def ml_root() -> Path:
    return Path(os.environ.get(ML_ROOT_VARIABLE, "/opt/ml"))


def env_key(name: str) -> str:
    """A channel or model name as it appears in an environment variable name."""
    return "".join(c if c.isalnum() else "_" for c in name).upper()


def step_module(step: str) -> str:
    """`train` is steps/train.py; a dotted name is any module shipped with the code."""
    return step if "." in step else f"steps.{step}"


def _deserialize(value: str) -> object:
    """Hyperparameters arrive as strings; SageMaker's containers decode the JSON-looking ones."""
    try:
        return json.loads(value)
    except (TypeError, ValueError):
        return value


class JobSetupError(RuntimeError):
    """The job cannot start its step: a config file or a secret it needs cannot be read."""


def read_config(path: Path) -> dict:
    """One of the JSON files SageMaker writes for the job, or why it cannot be read."""
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise JobSetupError(f"{path} cannot be read: {e.strerror or e}") from None
    except ValueError as e:
        raise JobSetupError(f"{path} is not valid JSON: {e}") from None


def training_variables(root: Path) -> dict[str, str]:
    """The SM_* variables of SageMaker's framework containers, from the job's config files."""
    config = root / "input/config"
    hps = {k: _deserialize(v) for k, v in read_config(config / "hyperparameters.json").items()}
    resource = read_config(config / "resourceconfig.json")
    input_config = read_config(config / "inputdataconfig.json")
    channels = sorted(input_config)
    hosts = resource["hosts"]
    checkpoints = root / "checkpoints"
    job_name = os.environ.get("TRAINING_JOB_NAME", "")
    if os.environ.get(TRIAL_CHECKPOINTS_VARIABLE) and job_name:
        checkpoints = checkpoints / job_name
    # As SageMaker's containers count them, without importing torch (a second per job).
    gpus = len(glob.glob("/dev/nvidia[0-9]*"))
    env: dict[str, object] = {
        "SM_MODEL_DIR": root / "model",
        "SM_INPUT_DIR": root / "input",
        "SM_INPUT_DATA_DIR": root / "input/data",
        "SM_INPUT_CONFIG_DIR": config,
        "SM_OUTPUT_DIR": root / "output",
        "SM_OUTPUT_FAILURE": root / FAILURE_FILES["train"],
        "SM_OUTPUT_DATA_DIR": root / "output/data",
        "SM_CHECKPOINT_DIR": checkpoints,
        "SM_LOG_LEVEL": 20,
        "SM_CHANNELS": channels,
        "SM_HPS": hps,
        "SM_CURRENT_HOST": resource["current_host"],
        "SM_CURRENT_INSTANCE_TYPE": resource.get("current_instance_type", ""),
        "SM_HOSTS": hosts,
        "SM_HOST_COUNT": len(hosts),
        "SM_CURRENT_HOST_RANK": hosts.index(resource["current_host"]),
        "SM_NETWORK_INTERFACE_NAME": resource.get("network_interface_name", "eth0"),
        "SM_NUM_CPUS": os.cpu_count() or 1,
        "SM_NUM_GPUS": gpus,
        "SM_RESOURCE_CONFIG": resource,
        "SM_INPUT_DATA_CONFIG": input_config,
    }
    env.update(distributed_variables(env["SM_NETWORK_INTERFACE_NAME"], len(hosts), gpus))
    for channel in channels:
        env[f"SM_CHANNEL_{env_key(channel)}"] = root / "input/data" / channel
    for key, value in hps.items():
        env[f"SM_HP_{env_key(key)}"] = value
    env["SM_TRAINING_ENV"] = {
        "channel_input_dirs": {c: str(root / "input/data" / c) for c in channels},
        "current_host": resource["current_host"],
        "hosts": hosts,
        "hyperparameters": hps,
        "job_name": job_name,
        "model_dir": str(root / "model"),
        "output_data_dir": str(root / "output/data"),
        "num_cpus": env["SM_NUM_CPUS"],
        "num_gpus": gpus,
    }
    return {
        k: v if isinstance(v, str) else (str(v) if isinstance(v, Path) else json.dumps(v))
        for k, v in env.items()
    }


def distributed_variables(interface: str, hosts: int, gpus: int) -> dict[str, str]:
    """What torchrun and NCCL need to be told on SageMaker (a variable already set wins)."""
    env = {}
    # torchrun gives its workers 30 s after passing on a SIGTERM before it kills them
    # (torch.distributed.launcher.api, TORCH_ELASTIC_SHUTDOWN_TIMEOUT); SageMaker gives 120
    # (API_StopTrainingJob.html). The entrypoint signals the workers itself, so this is for a
    # torchrun that gets the signal another way (its parent gone).
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "120")
    # NCCL picks a network interface itself and, on an instance with several, may pick one the
    # other hosts cannot reach: the one resourceconfig.json names is the one they share
    # (your-algorithms-training-algo-running-container.html). Set only where NCCL runs.
    if gpus and hosts > 1 and "NCCL_SOCKET_IFNAME" not in os.environ:
        env["NCCL_SOCKET_IFNAME"] = interface
    return env


def processing_variables(root: Path) -> dict[str, str]:
    """SM_PROCESSING_INPUT_/OUTPUT_<NAME>, from the processing job's own config file."""
    config = read_config(root / "config/processingjobconfig.json")
    env = {"SM_OUTPUT_FAILURE": str(root / FAILURE_FILES["process"])}
    for item in config.get("ProcessingInputs", []):
        local = (item.get("S3Input") or {}).get("LocalPath")
        if local:
            env[f"SM_PROCESSING_INPUT_{env_key(item['InputName'])}"] = _in_root(local, root)
    for item in config.get("ProcessingOutputConfig", {}).get("Outputs", []):
        local = (item.get("S3Output") or {}).get("LocalPath")
        if local:
            env[f"SM_PROCESSING_OUTPUT_{env_key(item['OutputName'])}"] = _in_root(local, root)
    return env


def _in_root(path: str, root: Path) -> str:
    """A container path (/opt/ml/...) under the job root this job really has."""
    return str(root / path.removeprefix("/opt/ml/")) if path.startswith("/opt/ml/") else path


def job_region(root: Path) -> str | None:
    """The region the job runs in, from its own ARN: SageMaker sets TRAINING_JOB_ARN in a
    training container and writes ProcessingJobArn into processingjobconfig.json
    (your-algorithms-training-algo-running-container.html, build-your-own-processing-
    container.html), but no documented AWS_REGION (sagemaker-training-toolkit issues #12, #207)."""
    arn = os.environ.get("TRAINING_JOB_ARN", "")
    config = root / "config/processingjobconfig.json"
    if not arn and config.exists():
        arn = read_config(config).get("ProcessingJobArn", "")
    parts = arn.split(":")
    return parts[3] if len(parts) > 5 and parts[3] else None


def keys_from_secrets(root: Path) -> dict[str, str]:
    """The keys whose secrets the request names, read from Secrets Manager in the job's own
    region (a client with no region fails where the container has no AWS_REGION)."""
    wanted = {v: os.environ[v] for v in SECRETS_FROM_MANAGER if os.environ.get(v)}
    if not wanted:
        return {}
    import boto3

    region = (
        job_region(root) or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    )
    client = boto3.client("secretsmanager", region_name=region)
    keys = {}
    for variable, secret_id in wanted.items():
        key = SECRETS_FROM_MANAGER[variable]
        try:
            value = client.get_secret_value(SecretId=secret_id)["SecretString"]
        except Exception as e:  # noqa: BLE001 - denied, missing, no region, binary: said whole
            raise JobSetupError(
                f"secret {secret_id!r} ({variable}) cannot be read from Secrets Manager in "
                f"{region or 'no region'}: {type(e).__name__}: {e}"
            ) from None
        try:  # a secret stored as {"WANDB_API_KEY": "..."} or as the bare key
            value = json.loads(value)[key]
        except (ValueError, KeyError, TypeError):
            pass
        keys[key] = value
        print(f"{key}: read from Secrets Manager secret {secret_id!r}", flush=True)
    return keys


def processes_per_host(env: dict[str, str]) -> int:
    """PROCESSES_PER_HOST: a number, or auto (one per GPU of the instance, as SageMaker's
    framework containers launch them; one where there is none)."""
    wanted = os.environ.get(PROCESSES_VARIABLE, "1")
    if wanted == "auto":
        return max(1, int(env.get("SM_NUM_GPUS", "0")))
    return int(wanted)


def training_command(env: dict[str, str]) -> list[str]:
    module = step_module(os.environ.get(STEP_VARIABLE, "train"))
    hosts = json.loads(env["SM_HOSTS"])
    per_host = processes_per_host(env)
    if len(hosts) * per_host == 1:
        return [sys.executable, "-m", module]
    master = os.environ.get(MASTER_ADDR_VARIABLE, hosts[0])
    port = os.environ.get(MASTER_PORT_VARIABLE, "29500")
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={len(hosts)}",
        f"--node_rank={hosts.index(env['SM_CURRENT_HOST'])}",
        f"--nproc_per_node={per_host}",
        f"--master_addr={master}",
        f"--master_port={port}",
        "-m",
        module,
    ]


def _die_with_parent() -> None:
    """In the step's process: SIGTERM when the entrypoint dies, however it dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def training_processes(proc: subprocess.Popen) -> list[int]:
    """The processes that train: the step itself, or torchrun's workers (its children). Not
    their DataLoader workers: a loader worker killed by SIGTERM fails the training process's
    next batch, and not torchrun, which would give its workers only 30 s before SIGKILL
    (torch/distributed/elastic/multiprocessing/api.py, `close(..., timeout=30)`) where
    SageMaker gives 120 (StopTrainingJob)."""
    if "torch.distributed.run" not in proc.args:
        return [proc.pid]
    try:
        import psutil

        return [child.pid for child in psutil.Process(proc.pid).children()]
    except Exception:  # noqa: BLE001 - psutil missing or torchrun gone: the step as a whole
        return [proc.pid]


def pass_signals_on(proc: subprocess.Popen) -> None:
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


def start_step(command: list[str], env: dict[str, str]) -> subprocess.Popen | ForkedStep:
    """The step in a new session that dies with this process, its output on one pipe. Forked
    from this process where it was warm-started (see `can_fork_step`), started as a new
    interpreter otherwise (in a container, always)."""
    if can_fork_step(command):
        return ForkedStep(command, env)
    return subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )


def can_fork_step(command: list[str]) -> bool:
    """Whether the step may be forked from this process rather than started afresh: the local
    backend's fork server (pipeline/backends/warm_start.py) started this entrypoint with torch
    and the rest already imported, and the step is one `python -m` process (torchrun starts
    its own). Only while this process is single-threaded (fork copies only the calling thread;
    a lock another one held would stay locked in the child) and holds no CUDA context (CUDA
    does not survive fork). Of the variables this entrypoint adds for the step (SM_*), the
    preloaded libraries read at import only SM_HP_MP_PARAMETERS and SM_FRAMEWORK_PARAMS
    (transformers' is_sagemaker_mp_enabled), which matter only with smdistributed, which the
    image does not have."""
    torch = sys.modules.get("torch")
    return (
        torch is not None
        and command[:2] == [sys.executable, "-m"]
        and "torch.distributed.run" not in command
        and len(os.listdir("/proc/self/task")) == 1
        and not torch.cuda.is_initialized()
    )


class ForkedStep:
    """A step forked from this process, as subprocess.Popen shows one (`pid`, `args`,
    `stdout`, `poll()`, `wait()`, `returncode`): what `run` and `pass_signals_on` use."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
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
            _become_step(command, env, write, ready_write)  # never returns
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


def _become_step(command: list[str], env: dict[str, str], output: int, ready: int) -> None:
    """In the forked child: what Popen(start_new_session=True, preexec_fn=_die_with_parent)
    and a fresh `python -m MODULE ARGS` would make of it; exits with the step's status."""
    code = 1
    try:
        os.setsid()
        _die_with_parent()
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
        sys.orig_argv[:] = command
        _set_command_line(command)
        numpy = sys.modules.get("numpy")
        if numpy is not None:  # its global RandomState is not reseeded by fork; `random` is
            numpy.random.seed()
        code = _run_module_as_main(command[2], command[3:])
    except BaseException:  # noqa: BLE001 - the child must end here, whatever happened
        traceback.print_exc()
    finally:
        os._exit(code)


def _run_module_as_main(module: str, args: list[str]) -> int:
    """`python -m module args...` in this process, and the status the interpreter would exit
    with: SystemExit's code, 1 for an uncaught exception, death by SIGINT for an uncaught
    KeyboardInterrupt (as CPython since 3.8); non-daemon threads joined (for at most
    THREAD_GRACE_SECONDS: the caller then leaves with os._exit) and atexit handlers run on
    the way out. pipeline/backends/warm_start.py does the same for the entrypoint (steps/
    cannot import pipeline/, and the server imports nothing of steps/)."""
    import atexit
    import runpy

    sys.argv = ["-m", *args]  # runpy puts the module's file in argv[0], as `-m` does
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:  # None is 0, a number itself, anything else printed and 1
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - reported as the interpreter reports it
        sys.excepthook(*sys.exc_info())
        code = 1
    join_threads(THREAD_GRACE_SECONDS)  # as threading._shutdown, with a deadline
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code & 0xFF


def _set_command_line(argv: list[str]) -> None:
    """Show `argv` as this process's command line (/proc/PID/cmdline: what ps, pgrep -f and
    psutil read); a fork keeps its parent's. Written where the kernel reads it (arg_start..
    arg_end, /proc/self/stat fields 48-49, proc(5)), as setproctitle does, truncated to the
    room there is."""
    import ctypes

    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # fields 48 and 49, counted from 1
    except (OSError, IndexError, ValueError):
        return
    title = "\0".join(argv).encode()[: end - start - 1]
    ctypes.memmove(start, title.ljust(end - start, b"\0"), end - start)


def run(
    command: list[str], env: dict[str, str], failure: Path, what: str, outputs: list[Path]
) -> int:
    """Run the step in its own process group and wait; SIGTERM and SIGINT go on to the
    processes that train (`training_processes`), which checkpoint and exit. What it prints is
    passed on with secrets masked, and so are the files it leaves in `outputs` (and the
    failure file) once it ends. A step that checkpointed on a signal exits EXIT_INTERRUPTED,
    whatever torchrun makes of its workers' status."""
    failure.parent.mkdir(parents=True, exist_ok=True)
    failure.unlink(missing_ok=True)
    marker, finished = failure.parent / "interrupted", failure.parent / FINISHED
    marker.unlink(missing_ok=True)
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
    if code != 0 and marker.exists():  # it checkpointed on the signal: no failure to report
        code = EXIT_INTERRUPTED  # torchrun reports its workers' 75 as its own failure (1)
    elif code != 0 and not failure.exists():
        # The step died before it could say why (killed, out of memory, a crash in C code).
        last = " | ".join(list(tail)[-3:]) or "no output"
        failure.write_text(f"{what} exited with status {code}: {last}"[:1024])
    if failure.exists():  # the reason the user reads: masked in words, not asterisks
        failure.write_text(redact(failure.read_text(errors="replace"), secrets))
    scrub_files([failure.parent, *outputs], secrets)
    return code if code >= 0 else 128 - code


def follow_driver() -> None:
    """SIGTERM to this process when the driver that started it dies (a SIGKILLed driver
    cannot stop its jobs); it is forwarded to the step, which checkpoints and exits."""
    driver = os.environ.get(DRIVER_PID_VARIABLE)
    if not driver:
        return
    _die_with_parent()
    if os.getppid() != int(driver):  # the driver was gone before the line above
        sys.exit(f"the driver (pid {driver}) that started this job is gone")


def set_up(root: Path, argv: list[str]) -> tuple[list[str], dict[str, str], str, list[Path]]:
    """The step's command, its environment, its name in messages and its output folders."""
    if argv[0] == "train":
        env = {**training_variables(root), **keys_from_secrets(root)}
        Path(env["SM_CHECKPOINT_DIR"]).mkdir(parents=True, exist_ok=True)
        for sub in ("model", "output/data"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        return training_command(env), env, "the training step", [root / "model"]
    env = {**processing_variables(root), **keys_from_secrets(root)}
    command = [sys.executable, "-m", step_module(argv[1]), *argv[2:]]
    outputs = [Path(v) for k, v in env.items() if k.startswith("SM_PROCESSING_OUTPUT_")]
    return command, env, f"step {argv[1]}", outputs


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
        failure.write_text(reason[:1024])  # SageMaker returns the first 1024 characters
    except OSError as e:
        print(f"{failure} cannot be written: {e}", file=sys.stderr, flush=True)
    return 1


def main(argv: list[str]) -> int:
    root = ml_root()
    follow_driver()
    if argv[:1] not in (["train"], ["process"]) or (argv[0] == "process" and len(argv) < 2):
        print(f"usage: {' '.join(ENTRYPOINT)} train | process STEP [ARGS ...]", file=sys.stderr)
        return 2
    failure = root / FAILURE_FILES[argv[0]]
    try:
        command, env, what, outputs = set_up(root, argv)
    except Exception as e:  # noqa: BLE001 - whatever it is, SageMaker must be told why
        return failed_to_start(failure, e)
    return run(command, env, Path(env["SM_OUTPUT_FAILURE"]), what, outputs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
