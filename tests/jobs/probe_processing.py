"""A processing job that reports what it saw of the contract."""

import json
import os
import sys

import psutil

from steps.runtime.environment import processing_input, processing_output
from steps.runtime.step import run_step


def main():
    src = processing_input("things")
    out = processing_output("seen")
    starter = psutil.Process().parent().parent()
    files = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
    (out / "seen.json").write_text(
        json.dumps(
            {
                "argv": sys.argv[1:],
                "files": files,
                "content": (src / "a.txt").read_text(),
                "module_file": __file__,
                "env": {
                    k: v
                    for k, v in os.environ.items()
                    if k.startswith(("SM_", "PROCESSING_")) or k == "TORCHINDUCTOR_CACHE_DIR"
                },
                "env_names": sorted(os.environ),
                "home": os.path.expanduser("~"),
                # step -> entrypoint -> what started the entrypoint (a fork server, warm; the
                # driver, cold; nothing in a container, where the entrypoint is PID 1)
                "starter": starter.cmdline() if starter else [],
            }
        )
    )
    print(
        "secret check:",
        os.environ.get("WANDB_API_KEY"),
        os.environ.get("AWS_SECRET_ACCESS_KEY"),
        os.environ.get("TOKENIZERS_PARALLELISM"),
    )
    # What a careless job leaves in its files (a debug dump, a tracker's console copy).
    leaked = [os.environ.get(k, "") for k in ("WANDB_API_KEY", "MY_DB_PASSWORD")]
    (out / "debug.log").write_text(f"env: {leaked}\n")
    if "--hang" in sys.argv:  # a step that takes no notice of SIGTERM or SIGINT
        import signal
        import time

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("hanging", flush=True)
        time.sleep(600)
    if "--fail" in sys.argv:
        raise ValueError("asked to fail" + (f" with {leaked}" if any(leaked) else ""))


if __name__ == "__main__":
    run_step("probe", main)
