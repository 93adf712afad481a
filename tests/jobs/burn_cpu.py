"""A processing job that spends a known CPU time, half of it in a child process it waits
for: what the local backend measures of a job must count both."""

import subprocess
import sys
import time

from steps.contract import processing_output, run_step

BURN = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass"


def main():
    seconds = float(sys.argv[sys.argv.index("--seconds") + 1])
    subprocess.run([sys.executable, "-c", BURN.format(seconds=seconds / 2)], check=True)
    end = time.process_time() + seconds / 2
    while time.process_time() < end:
        pass
    (processing_output("out") / "done.txt").write_text("burnt")


if __name__ == "__main__":
    run_step("burn_cpu", main)
