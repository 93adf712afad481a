"""Two-host emulated training, again and again: does any run hang?

    python bench/two_hosts.py [--runs 20] [--timeout 600]

A local store (the emulated backend's bucket) and the demo's raw data (12 articles a topic) as
RAW_DATA, reconciled and prepared once. Then `smpipe run --steps train` of the bag-of-embeddings model
on two emulated hosts (INSTANCE_COUNT = 2, one process each: torchrun across two hosts, gloo)
runs `--runs` times in a row, each a driver of its own. The baseline, in the same run: the
same training on one host, once, before them. A run that has not ended after `--timeout`
seconds is a hang: py-spy (where installed) dumps every process of its tree, then the tree is
killed, and the count says so. Run it beside the suite (`make test`) to load the machine.

Prints each run's wall time and status, and the count; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import write_settings  # noqa: E402
from user_functions.demo_data import write_demo  # noqa: E402


def settings_file(folder: Path, store: Path, raw: Path, hosts: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    training = {"USE_DISTRIBUTED": str(hosts > 1).lower(), "INSTANCE_COUNT": str(hosts),
                "PROCESSES_PER_HOST": "1"}  # fmt: skip
    return write_settings(folder / "settings.ini", str(store),
                          experiment={"BACKEND": "emulated"}, models={"MODEL_NAMES": "bow"},
                          data={"RAW_DATA": str(raw)}, training=training)  # fmt: skip


def dump(pid: int) -> str:
    """py-spy's stacks of every Python process under `pid` (the hang's where)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return "(py-spy is not installed: no stacks)"
    import psutil

    stacks = []
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        done = subprocess.run([spy, "dump", "--pid", str(proc.pid)], capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        stacks.append(f"--- pid {proc.pid} {' '.join(proc.cmdline())[:160]}\n{done.stdout}")
    return "\n".join(stacks)


def one_run(
    settings: Path, env: dict, timeout: float, log: Path, steps: str = "train"
) -> tuple[str, float]:
    """(status, wall seconds) of one `smpipe run --steps STEPS`."""
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "run", str(settings), "--steps", steps],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with open(log.with_suffix(".stacks"), "w") as stacks:
                stacks.write(dump(proc.pid))
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "HUNG", time.perf_counter() - started
    return ("completed" if code == 0 else f"exit {code}"), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    work = Path(tempfile.mkdtemp(prefix="two-hosts-"))
    try:
        write_demo(work / "raw", per_label=12)
        one = settings_file(work / "one", work / "store", work / "raw", 1)
        two = settings_file(work / "two", work / "store", work / "raw", 2)
        status, _ = one_run(one, env, args.timeout, work / "data.log", "reconcile,prepare")
        assert status == "completed", (work / "data.log").read_text()[-2000:]
        status, baseline = one_run(one, env, args.timeout, work / "one.log")
        print(f"baseline, one host: {status} in {baseline:.1f} s")
        results = []
        for i in range(1, args.runs + 1):
            status, wall = one_run(two, env, args.timeout, work / f"two-{i:02d}.log")
            results.append((status, wall))
            print(f"two hosts, run {i:2d}: {status} in {wall:.1f} s", flush=True)
        walls = [w for s, w in results if s == "completed"]
        hung = sum(s == "HUNG" for s, _ in results)
        failed = len(results) - len(walls) - hung
        print(f"\n{len(walls)} of {len(results)} two-host runs completed, {hung} hung "
              f"(> {args.timeout:.0f} s), {failed} failed")  # fmt: skip
        if walls:
            print(f"wall: median {statistics.median(walls):.1f} s, max {max(walls):.1f} s; "
                  f"one host {baseline:.1f} s")  # fmt: skip
        if hung or failed:
            print(f"logs and stacks kept in {work}")
            work = None
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
