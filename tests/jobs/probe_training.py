"""A training job that reports what each of its processes saw, and talks across them."""

import json
import os
import socket

import torch
import torch.distributed as dist

from steps.runtime.environment import training_env
from steps.runtime.step import run_step


def main():
    env = training_env()
    if env.hyperparameters.get("hang"):  # a load_model that never returns, say
        import time

        time.sleep(600)
    at_start = sorted(
        p.relative_to(
            env.checkpoint_dir.parent
            if env.checkpoint_dir.parent.name == "checkpoints"
            else env.checkpoint_dir
        ).as_posix()
        for p in (
            env.checkpoint_dir.parent
            if env.checkpoint_dir.parent.name == "checkpoints"
            else env.checkpoint_dir
        ).rglob("*")
        if p.is_file()
    )
    model_at_start = sorted(p.name for p in env.model_dir.iterdir())
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    total = torch.tensor([rank + 1.0])
    if world > 1:
        dist.init_process_group("gloo")
        dist.all_reduce(total)
    seen = {
        "rank": rank,
        "world": world,
        "all_reduce": total.item(),
        "hyperparameters": env.hyperparameters,
        "hp_types": {k: type(v).__name__ for k, v in env.hyperparameters.items()},
        "channels": {k: sorted(p.name for p in v.iterdir()) for k, v in env.channels.items()},
        "hosts": env.hosts,
        "current_host": env.current_host,
        "hostname": socket.gethostname(),
        "num_gpus": env.num_gpus,
        "model_dir": str(env.model_dir),
        "checkpoint_dir": str(env.checkpoint_dir),
        "job_name": env.job_name,
        "sm_env": sorted(k for k in os.environ if k.startswith("SM_")),
        "env_names": sorted(os.environ),
        "checkpoints_at_start": at_start,
        "model_at_start": model_at_start,
    }
    (env.model_dir / f"seen-rank{rank}.json").write_text(json.dumps(seen))
    (env.checkpoint_dir / f"ckpt-rank{rank}.txt").write_text("state")
    (env.checkpoint_dir / f".hidden-rank{rank}").write_text("not uploaded")
    if rank == 0:
        (env.output_data_dir / "report.json").write_text(json.dumps({"ok": True}))
        # A trial's objective, where a tuning job searches it as a hyperparameter.
        print(f"validation:f1={float(env.hyperparameters.get('f1', 0.75)):.6f}")
    sleep(env.hyperparameters, restarted=bool(at_start))
    if world > 1:
        dist.destroy_process_group()
    if env.hyperparameters.get("fail"):
        raise ValueError("asked to fail")


def sleep(hyperparameters: dict, restarted: bool) -> None:
    """A trial that a tuning job may be stopped in (`sleep` seconds); a spot job reclaimed in
    its first attempt (`sleep_once`); one that ends well (0) within its stop's grace
    (`finish_on_stop`)."""
    if not hyperparameters.get("sleep") or (hyperparameters.get("sleep_once") and restarted):
        return
    import signal
    import threading

    stopped = threading.Event()
    if hyperparameters.get("finish_on_stop"):
        signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    stopped.wait(float(hyperparameters["sleep"]))


if __name__ == "__main__":
    run_step("probe-train", main)
