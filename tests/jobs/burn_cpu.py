"""A processing job that spends a known CPU time, half of it in a child process it waits
for: what the local backend measures of a job must count both. It writes how it was started
(`warm`: forked by a warm-start server, pipeline/player/fork_server.py; else `cold`)."""

import subprocess
import sys
import time

import psutil

from steps.runtime.environment import processing_output
from steps.runtime.step import run_step

BURN = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass"


def main():
    seconds = float(sys.argv[sys.argv.index("--seconds") + 1])
    subprocess.run([sys.executable, "-c", BURN.format(seconds=seconds / 2)], check=True)
    end = time.process_time() + seconds / 2
    while time.process_time() < end:
        pass
    # A warm-started entrypoint's parent is the server: `python .../fork_server.py FD PID`.
    commands = [p.cmdline()[1:2] for p in psutil.Process().parents()]
    warm = any(c and c[0].endswith("player/fork_server.py") for c in commands)
    (processing_output("out") / "started.txt").write_text("warm" if warm else "cold")


if __name__ == "__main__":
    run_step("burn_cpu", main)
