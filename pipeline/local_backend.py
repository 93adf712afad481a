"""The embedded backend: a job is a subprocess on this machine under SageMaker's container contract.

For a training job the job root mirrors /opt/ml: input/data/<channel>, input/config/
(hyperparameters.json, resourceconfig.json, inputdataconfig.json), model/, output/data/,
output/failure and checkpoints/, and the SM_* variables point into it exactly as SageMaker's
training drivers set them. For a processing job, inputs land in processing/input/<name> and
outputs are read from processing/output/<name> and uploaded when the job ends. Inputs come
from the store and outputs go back to it, so the step scripts cannot tell the difference.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from pipeline.jobs import JobResult, ProcessingJob, TrainingJob
from pipeline.store import NotFound, Store, download_dir, is_complete, open_store, upload_dir
from steps.contract import EXIT_INTERRUPTED

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SECRET_ENV_RE = re.compile(r"(KEY|SECRET|TOKEN|PASSWORD)", re.IGNORECASE)
# Jobs run offline: nothing is fetched from a model or dataset hub, progress bars stay quiet.
JOB_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


def secret_values(env: dict[str, str]) -> list[str]:
    """Values of variables that look like credentials; they are blanked out of every log."""
    return sorted(
        {v for k, v in env.items() if SECRET_ENV_RE.search(k) and len(v) >= 4},
        key=len,
        reverse=True,
    )


def redact(text: str, secrets: list[str]) -> str:
    for value in secrets:
        text = text.replace(value, "<redacted>")
    return text


def step_module(step: str) -> str:
    """`train` is steps/train.py; a dotted name is any importable module (tests use their own)."""
    return step if "." in step else f"steps.{step}"


def is_external(source: str) -> bool:
    """An input outside the store: another bucket or a folder of the user's."""
    return "://" in source or os.path.isabs(source)


def source_uri(store: Store, source: str) -> str:
    return source if is_external(source) else store.uri_of(source)


def fetch_input(store: Store, source: str, local: Path) -> None:
    """A manifested directory is downloaded and verified; raw data the user keeps elsewhere
    (another bucket or folder, with no manifest of ours) is downloaded as it is."""
    if is_external(source):
        store, source = open_store(source), ""
    if is_complete(store, source):
        download_dir(store, source, local)
        return
    keys = store.list_keys(source)
    if not keys:
        raise NotFound(f"nothing at {store.uri_of(source) if source else store.uri}")
    for key in keys:
        store.download_file(key, local / key[len(source) :].lstrip("/"))


def sync_up(store: Store, local_dir: Path, prefix: str) -> None:
    """Copy the current checkpoint (the one CURRENT names) into the store, pointer last, so
    a restart elsewhere resumes from it. Older local ones are fallbacks for this machine only:
    a checkpoint holds the optimizer state too, and the store keeps one per job, not N."""
    pointer = local_dir / "CURRENT"
    if not pointer.exists():
        return
    current = local_dir / pointer.read_text().strip()
    for path in sorted(current.rglob("*")):
        if path.is_file():
            store.upload_file(path, prefix + path.relative_to(local_dir).as_posix())
    store.upload_file(pointer, prefix + "CURRENT")


def sync_down(store: Store, prefix: str, local_dir: Path) -> None:
    for key in store.list_keys(prefix):
        store.download_file(key, local_dir / key[len(prefix) :])


class LocalBackend:
    name = "local"

    def __init__(
        self,
        store: Store,
        log_prefix: str,
        python_path: list[str] | None = None,
        work_root: str | None = None,
        echo=None,
    ):
        self.store = store
        self.log_prefix = log_prefix  # store prefix under which job logs are written
        self.python_path = [str(PROJECT_ROOT), *(python_path or [])]
        self.work_root = Path(work_root or tempfile.mkdtemp(prefix="smpipe-jobs-"))
        self.echo = echo if echo is not None else sys.stdout

    # -- the two job kinds ------------------------------------------------------------------

    def run_processing(self, job: ProcessingJob) -> JobResult:
        root = self.work_root / job.name
        env = {"PROCESSING_JOB_NAME": job.name, "SM_OUTPUT_FAILURE": str(root / "output/message")}
        config = {
            "ProcessingJobName": job.name,
            "ProcessingInputs": [],
            "ProcessingOutputConfig": {"Outputs": []},
        }
        for channel, prefix in job.inputs.items():
            local = root / "processing/input" / channel
            fetch_input(self.store, prefix, local)
            env[f"SM_PROCESSING_INPUT_{channel.upper()}"] = str(local)
            config["ProcessingInputs"].append(
                {
                    "InputName": channel,
                    "S3Input": {"S3Uri": source_uri(self.store, prefix), "LocalPath": str(local)},
                }
            )
        for channel, prefix in job.outputs.items():
            local = root / "processing/output" / channel
            local.mkdir(parents=True, exist_ok=True)
            env[f"SM_PROCESSING_OUTPUT_{channel.upper()}"] = str(local)
            config["ProcessingOutputConfig"]["Outputs"].append(
                {
                    "OutputName": channel,
                    "S3Output": {"S3Uri": self.store.uri_of(prefix), "LocalPath": str(local)},
                }
            )
        (root / "config").mkdir(parents=True, exist_ok=True)
        (root / "config/processingjobconfig.json").write_text(json.dumps(config, indent=2))
        command = [sys.executable, "-m", step_module(job.step), *job.arguments]
        result = self._run(job.name, command, {**env, **job.env}, root / "output/message", {})
        if result.status == "Completed":
            for channel, prefix in job.outputs.items():
                upload_dir(
                    self.store, root / "processing/output" / channel, prefix, {"job_name": job.name}
                )
        self._cleanup(root, result)
        return result

    def run_training(self, job: TrainingJob) -> JobResult:
        root = self.work_root / job.name
        for sub in ("model", "output/data", "checkpoints", "input/config"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        input_config = {}
        for channel, prefix in job.channels.items():
            download_dir(self.store, prefix, root / "input/data" / channel)
            input_config[channel] = {
                "TrainingInputMode": "File",
                "S3DistributionType": "FullyReplicated",
            }
        # A restarted job (spot reclaim, crash) starts from the checkpoints synced so far.
        sync_down(self.store, job.checkpoint_prefix, root / "checkpoints")
        hosts = ["algo-1"]
        resource = {
            "current_host": hosts[0],
            "current_instance_type": job.instance_type,
            "hosts": hosts,
            "network_interface_name": "lo",
        }
        config_dir = root / "input/config"
        (config_dir / "hyperparameters.json").write_text(json.dumps(job.hyperparameters, indent=2))
        (config_dir / "resourceconfig.json").write_text(json.dumps(resource, indent=2))
        (config_dir / "inputdataconfig.json").write_text(json.dumps(input_config, indent=2))
        env = training_env(root, job, resource, input_config)

        processes = job.processes_per_host * job.instance_count
        if processes > 1:
            # One process per device, as `accelerate launch` would start on a GPU host; here
            # they are CPU processes talking over gloo.
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={processes}", "-m", step_module(job.step),
            ]  # fmt: skip
        else:
            command = [sys.executable, "-m", step_module(job.step)]

        restarts = 0
        while True:
            result = self._run(
                job.name,
                command,
                {**env, **job.env},
                root / "output/failure",
                job.metric_definitions,
            )
            sync_up(self.store, root / "checkpoints", job.checkpoint_prefix)
            if result.status == "Interrupted" and restarts < job.max_restarts:
                restarts += 1
                print(
                    f"[{job.name}] interrupted; restart {restarts} of {job.max_restarts}",
                    file=self.echo,
                )
                continue
            break
        result.restarts = restarts
        if result.status == "Completed":
            upload_dir(self.store, root / "model", job.model_prefix, {"job_name": job.name})
            upload_dir(self.store, root / "output/data", job.output_prefix, {"job_name": job.name})
        self._cleanup(root, result)
        return result

    # -- running one process tree -----------------------------------------------------------

    def _run(
        self,
        name: str,
        command: list[str],
        job_env: dict[str, str],
        failure: Path,
        metric_regexes: dict[str, str],
    ) -> JobResult:
        env = {**os.environ, **JOB_ENV, **job_env}
        env["PYTHONPATH"] = os.pathsep.join([*self.python_path, env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
        secrets = secret_values(env)
        if failure.exists():
            failure.unlink()
        log_path = self.work_root / f"{name}.log"
        compiled = {k: re.compile(v) for k, v in metric_regexes.items()}
        metrics: dict[str, float] = {}
        start = time.time()
        proc = subprocess.Popen(
            command,
            cwd=str(PROJECT_ROOT),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: Ctrl-C or a kill reaches every worker
        )
        peak = {"rss": 0.0}
        stop = threading.Event()
        watcher = threading.Thread(target=_watch_memory, args=(proc.pid, peak, stop), daemon=True)
        watcher.start()
        tail: list[str] = []
        try:
            with open(log_path, "a", encoding="utf-8") as log:
                for raw in iter(proc.stdout.readline, b""):
                    line = redact(raw.decode("utf-8", errors="replace").rstrip("\n"), secrets)
                    print(f"[{name}] {line}", file=self.echo, flush=True)
                    log.write(line + "\n")
                    tail = (tail + [line])[-20:]
                    for metric, regex in compiled.items():
                        m = regex.search(line)
                        if m:
                            try:
                                metrics[metric] = float(m.group(1))
                            except ValueError:
                                pass
            code = proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
        finally:
            stop.set()
            watcher.join()
        end = time.time()
        interrupted = (failure.parent / "interrupted").exists() or code == EXIT_INTERRUPTED
        if interrupted:
            (failure.parent / "interrupted").unlink(missing_ok=True)
        if code == 0:
            status, reason = "Completed", None
        elif interrupted:
            status, reason = "Interrupted", "the job was interrupted and saved a checkpoint"
        else:
            status = "Failed"
            reason = failure.read_text().strip() if failure.exists() else ""
            if not reason:
                last = next((t for t in reversed(tail) if t.strip()), "")
                reason = f"exit code {code}: {last}"
            reason = redact(reason, secrets)
        log_key = f"{self.log_prefix}{name}.log"
        self.store.upload_file(log_path, log_key)
        return JobResult(
            name=name,
            status=status,
            failure_reason=reason,
            start_time=start,
            end_time=end,
            peak_memory_mb=round(peak["rss"] / 2**20, 1) if peak["rss"] else None,
            exit_code=code,
            log_key=log_key,
            metrics=metrics,
        )

    def close(self, succeeded: bool) -> None:
        """Remove the work root after a run whose jobs all succeeded; keep it otherwise."""
        if succeeded:
            shutil.rmtree(self.work_root, ignore_errors=True)

    def _cleanup(self, root: Path, result: JobResult) -> None:
        # A failed job's directory is kept for inspection; a finished one is removed.
        if result.status == "Completed":
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"[{result.name}] job directory kept for inspection: {root}", file=self.echo)


def training_env(
    root: Path, job: TrainingJob, resource: dict, input_config: dict
) -> dict[str, str]:
    """The variables SageMaker's training drivers export (sagemaker.train container_drivers)."""
    hps = {k: _deserialize(v) for k, v in job.hyperparameters.items()}
    channels = list(job.channels)
    env: dict[str, object] = {
        "TRAINING_JOB_NAME": job.name,
        "SM_MODEL_DIR": str(root / "model"),
        "SM_INPUT_DIR": str(root / "input"),
        "SM_INPUT_DATA_DIR": str(root / "input/data"),
        "SM_INPUT_CONFIG_DIR": str(root / "input/config"),
        "SM_OUTPUT_DIR": str(root / "output"),
        "SM_OUTPUT_FAILURE": str(root / "output/failure"),
        "SM_OUTPUT_DATA_DIR": str(root / "output/data"),
        "SM_CHECKPOINT_DIR": str(root / "checkpoints"),
        "SM_LOG_LEVEL": 20,
        "SM_CHANNELS": channels,
        "SM_HPS": hps,
        "SM_CURRENT_HOST": resource["current_host"],
        "SM_CURRENT_INSTANCE_TYPE": resource["current_instance_type"],
        "SM_HOSTS": resource["hosts"],
        "SM_HOST_COUNT": len(resource["hosts"]),
        "SM_CURRENT_HOST_RANK": 0,
        "SM_NETWORK_INTERFACE_NAME": resource["network_interface_name"],
        "SM_NUM_CPUS": os.cpu_count() or 1,
        "SM_NUM_GPUS": 0,
        "SM_RESOURCE_CONFIG": resource,
        "SM_INPUT_DATA_CONFIG": input_config,
    }
    for channel in channels:
        env[f"SM_CHANNEL_{channel.upper()}"] = str(root / "input/data" / channel)
    for key, value in hps.items():
        env[f"SM_HP_{key.replace('-', '_').upper()}"] = value
    env["SM_TRAINING_ENV"] = {
        "channel_input_dirs": {c: env[f"SM_CHANNEL_{c.upper()}"] for c in channels},
        "current_host": resource["current_host"],
        "hosts": resource["hosts"],
        "hyperparameters": hps,
        "input_data_config": input_config,
        "job_name": job.name,
        "model_dir": env["SM_MODEL_DIR"],
        "num_cpus": env["SM_NUM_CPUS"],
        "num_gpus": 0,
        "output_data_dir": env["SM_OUTPUT_DATA_DIR"],
        "resource_config": resource,
    }
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in env.items()}


def _deserialize(value: str) -> object:
    """As SageMaker's drivers do: a JSON-looking string becomes its value, others stay strings."""
    try:
        return json.loads(value)
    except (json.JSONDecodeError, TypeError):
        return value


def _watch_memory(pid: int, peak: dict, stop: threading.Event) -> None:
    """Peak resident memory of the job's whole process tree, sampled twice a second."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    while not stop.wait(0.5):
        try:
            procs = [root, *root.children(recursive=True)]
            rss = sum(p.memory_info().rss for p in procs if p.is_running())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        peak["rss"] = max(peak["rss"], rss)
