"""What metering a job costs the machine it runs on: the CPU time of the local backend's memory
watcher (pipeline/player/metering.py `watch_memory`) against the baseline it replaced, reading
Linux's smaps_rollup (psutil memory_full_info) for every process of the tree on every 0.5 s
tick. Both watch the same process tree at the same time, each in a thread of its own, for the
same seconds; each thread's CPU time (user and system: the kernel walks the page tables) is
read from /proc.

The tree is what a warm-started training job looks like: a step that has imported torch and
transformers and holds its model's memory, and two processes forked from it (torchrun's
workers, a DataLoader's) that share its pages and allocate their own.

    python bench/metering.py [--seconds N]

Prints both watchers' CPU time and the peak each measured. Asserts nothing.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.player.metering import watch_memory  # noqa: E402

# The watched tree: imports as a training step does, 256 MiB of its own, then two forked
# children with 64 MiB each, all held for `seconds`.
TREE = """
import os, sys, time
import torch, transformers.modeling_utils
weights = bytearray(256 << 20)  # not torch's: its OpenMP pool does not survive a fork
for _ in range(2):
    if os.fork() == 0:
        own = bytearray(64 << 20)
        time.sleep(float(sys.argv[1]))
        os._exit(0)
print("ready", flush=True)
time.sleep(float(sys.argv[1]))
os.wait(); os.wait()
"""


def every_tick(pid: int, peak: dict, stop: threading.Event) -> None:
    """The baseline: smaps_rollup of every process of the tree on every tick (0.5 s)."""
    root = psutil.Process(pid)
    while not stop.wait(0.5):
        try:
            memory = [p.memory_full_info() for p in [root, *root.children(recursive=True)]]
        except psutil.Error:
            continue
        shared = max((m.rss - m.uss for m in memory), default=0)
        peak["rss"] = max(peak["rss"], sum(m.uss for m in memory) + shared)


def thread_cpu(native_id: int) -> float:
    for thread in psutil.Process().threads():
        if thread.id == native_id:
            return thread.user_time + thread.system_time
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    tree = subprocess.Popen(
        [sys.executable, "-c", TREE, str(args.seconds)], stdout=subprocess.PIPE, text=True
    )
    assert tree.stdout.readline() == "ready\n"
    stop = threading.Event()
    watchers = {
        "smaps_rollup every tick (baseline)": (every_tick, {"rss": 0}),
        "watch_memory": (watch_memory, {"rss": 0, "cpu": 0.0}),
    }
    threads = {}
    for name, (target, peak) in watchers.items():
        threads[name] = threading.Thread(target=target, args=(tree.pid, peak, stop))
        threads[name].start()
    started = time.monotonic()
    time.sleep(args.seconds - 1)  # while the whole tree is there
    used = {name: thread_cpu(thread.native_id) for name, thread in threads.items()}
    watched = time.monotonic() - started
    stop.set()
    for thread in threads.values():
        thread.join()
    tree.wait()
    print(f"a tree of 3 processes (torch imported, 384 MiB of their own), watched {watched:.0f} s")
    print(f"{'watcher':<38}{'CPU s':>8}{'% of a core':>13}{'peak MiB':>10}")
    for name, (_, peak) in watchers.items():
        share = 100 * used[name] / watched
        print(f"{name:<38}{used[name]:>8.2f}{share:>13.2f}{peak['rss'] / 2**20:>10.0f}")


if __name__ == "__main__":
    main()
