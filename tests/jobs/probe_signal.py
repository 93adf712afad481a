"""A processing step for the container contract's promises about signals, deaths and secrets:

--wait      say "waiting", then wait for SIGINT or SIGTERM; write which came to the
            output `seen` and finish (a step that stops cleanly on the signal it is sent)
--die       print three lines, then kill itself with SIGKILL (the out-of-memory killer)
--leak      print the Hugging Face token and leave it in a text file and in a binary file
            whose records are length-prefixed, as wandb's run log is
"""

import os
import signal
import struct
import sys
import time

from steps.runtime.environment import processing_output
from steps.runtime.step import run_step


def main():
    out = processing_output("seen")
    if "--wait" in sys.argv:
        came = []
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda s, _frame: came.append(signal.Signals(s).name))
        print("waiting", flush=True)
        deadline = time.time() + 120
        while not came and time.time() < deadline:
            time.sleep(0.05)
        (out / "signal.txt").write_text(",".join(came) or "none")
    if "--die" in sys.argv:
        for line in ("first line", "second line", "last words"):
            print(line, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if "--leak" in sys.argv:
        token = os.environ["HF_TOKEN"]
        print(f"token: {token}", flush=True)
        (out / "debug.txt").write_text(f"HF_TOKEN={token}\n")
        records = [b"header", f"console: {token}".encode(), b"trailer"]
        (out / "run.bin").write_bytes(b"".join(struct.pack("<H", len(r)) + r for r in records))


if __name__ == "__main__":
    run_step("probe-signal", main)
