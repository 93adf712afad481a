"""bench/gpu_check.py (`make gpu-check`) on this machine's CPU, as a subprocess: each check of
the GPU path through the real jobs, as a CPU plays it (gloo for two processes, loader workers
without pinning), the table naming every check; a check that fails for real fails the
command. The bag-of-embeddings model stands in for MiniLM, whose compilation alone takes
minutes on 2 cores; the script runs MiniLM by default."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from steps.precision import resolve
from tests.conftest import ROOT
from tests.test_gpu_speed import check_smoke_run

SCRIPT = ROOT / "bench/gpu_check.py"
CHECKS = [
    "peak",
    "training",
    "speed",
    "processes",
    "workers",
    "sigterm",
    "compile",
    "lora",
    "fsdp",
    "inference",
]

# The entrypoint counts GPUs from /dev/nvidia* (as SageMaker's containers do), so a job there
# trains on them whatever the script is told: `--device cpu` is refused on such a machine.
on_cpu_only = pytest.mark.skipif(
    any(Path("/dev").glob("nvidia[0-9]*")),
    reason="this machine has GPUs: `make gpu-check` runs the checks on them",
)


def gpu_check(work: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--model", "bow"]
    return subprocess.run(
        [*command, "--work", str(work), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )


def table(stdout: str) -> dict[str, tuple[str, str]]:
    """The table the script ends with: check -> (result, figures), in its order."""
    lines = stdout.splitlines()
    header = max(i for i, line in enumerate(lines) if re.match(r"check\s+result\s+figures$", line))
    rows = {}
    for line in lines[header + 1 :]:
        if not line.strip():
            break
        name, result, figures = re.split(r"\s{2,}", line, maxsplit=2)
        rows[name] = (result, figures)
    return rows


@pytest.mark.slow
@on_cpu_only
def test_every_check_runs_on_cpu_and_passes(tmp_path):
    done = gpu_check(tmp_path / "work")
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-4000:]
    rows = table(done.stdout)
    assert list(rows) == CHECKS, said[-4000:]
    # FSDP shards layers the bag of embeddings does not have (tests/test_fsdp.py runs it on CPU).
    expected = {**dict.fromkeys(CHECKS, "passed"), "fsdp": "skipped"}
    assert {name: result for name, (result, _) in rows.items()} == expected
    figures = {name: text for name, (_, text) in rows.items()}
    # The peak is measured in what training applies here: bf16 on a CPU that computes it
    # natively (AMX or AVX512-BF16), fp32 on others; CI runs on either kind.
    applied = resolve("auto", 0).applied
    assert ("bfloat16 matmul" if applied == "bf16" else "float32 matmul") in figures["peak"]
    assert "MFU" in figures["training"]
    # bench/gpu_speed.py's smoke run: its summary here, its own table and figures as kept.
    assert figures["speed"].count("ours/Trainer") == 2 and "syncs/step" in figures["speed"]
    check_smoke_run((tmp_path / "work/logs/speed.log").read_text(), tmp_path / "work/speed.json")
    assert figures["processes"].startswith("2 processes (gloo)")
    assert figures["workers"].startswith("2 workers, no pinning (CPU)")
    assert figures["sigterm"].startswith("exit 75 with 2 workers, checkpoint at step 2")
    assert "exports passed: torchscript, exported" in figures["compile"]
    assert "exports passed" in figures["lora"] and "parameters trained" in figures["lora"]
    assert figures["inference"].startswith("bf16 in both")
    # With --work, what the jobs left is kept: the interrupted job's log says why it stopped.
    log = (tmp_path / "work/logs/sigterm.log").read_text()
    assert "SIGTERM: checkpoint written at step 2" in log


@pytest.mark.slow
@on_cpu_only
def test_a_check_that_fails_makes_the_command_fail(tmp_path):
    """fp16 needs a GPU: on a CPU the driver refuses it before any job, and the check says why."""
    done = gpu_check(tmp_path / "work", "--only", "training", "--mixed-precision", "fp16")
    assert done.returncode == 1, (done.stdout + done.stderr)[-4000:]
    result, figures = table(done.stdout)["training"]
    assert result == "FAILED"
    assert "MIXED_PRECISION = fp16 needs a GPU" in figures
    assert f"logs and job folders: {tmp_path / 'work'}" in done.stdout


def test_arguments_that_cannot_work_are_refused(tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used/something").write_text("")
    for args, said in (
        (["--only", "training,nccl"], "--only: unknown check(s) ['nccl']"),
        (["--work", str(tmp_path / "used")], "not empty (nothing is written over)"),
    ):
        done = subprocess.run(
            [sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True
        )
        assert done.returncode == 2 and said in done.stderr, done.stderr
    assert (tmp_path / "used/something").exists()
