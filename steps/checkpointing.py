"""Training State and atomic checkpoints.

A checkpoint is written to `<name>.tmp`, flushed, renamed to `<name>` (`ckpt-<step>`, a name
never written twice in a run: `checkpoint_name`), and only then named by the `CURRENT` pointer
(`save_checkpoint`): a crash at any moment leaves the previous checkpoint whole and current. The
folder is also SageMaker's copy to S3, which may lag or stop short: a checkpoint lists its files
in `meta.json` (`check_complete`), and the one before the newest stays until the next save
begins (`kept`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from steps.finetuning import load_trained_state, trained_state
from steps.sampler import ResumableBatchSampler, Unresumable

CURRENT = "CURRENT"
OBJECTS = ("model", "optimizer", "scheduler", "scaler", "sampler")
STATE_FILE = "state.pt"
BEST_FILE = "best_model.pt"
MANIFEST = "meta.json"  # the checkpoint's step, and the files it is made of
# The name's suffix for a checkpoint written after an epoch's last optimizer step and before its
# end (validation, the best model, the epoch count): a SIGTERM in that step. The epoch's end,
# at the same step, is a checkpoint of its own and sorts after it.
BEFORE_EPOCH_END = "-before-epoch-end"

# What every checkpoint's state holds (OBJECTS load through their own state dicts); a
# checkpoint also records what only later versions wrote, read where it is there: finetuning,
# strategy, training (`State.state_dict`).
# The main process writes these to state.pt; each process writes its RNG and its share of
# `epoch_loss` to rank<N>.pt.
STATE_FIELDS = (
    "model",
    "optimizer",
    "scheduler",
    "scaler",
    "epoch",
    "batch_in_epoch",
    "step",
    "history",
    "epoch_loss",
    "best_metric",
    "best_epoch",
    "sampler",
    "seed",
    "run_name",
)


class OtherMethod(Unresumable):
    """The checkpoints train another part of the model than this job, or share it among the
    processes another way (DISTRIBUTED_STRATEGY)."""


class OtherTraining(Unresumable):
    """The checkpoints were written by a job of other hyperparameters (SAME_ON_RESUME): two
    jobs given one checkpoint folder (a job cloned with its CheckpointConfig S3Uri)."""


@dataclass
class State:
    """The whole training state, after Composer's State."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    sampler: ResumableBatchSampler
    seed: int
    run_name: str
    scaler: object | None = None
    finetuning: str = "full"  # what the model holds that trains (steps/finetuning.py)
    # ddp: the model and optimizer in state.pt; fsdp: in each process's shards (steps/fsdp.py)
    strategy: str = "ddp"
    epoch: int = 0
    batch_in_epoch: int = 0
    step: int = 0
    history: list[dict] = field(default_factory=list)
    epoch_loss: list[float] = field(
        default_factory=lambda: [0.0, 0.0]
    )  # this epoch's loss sum, batches
    best_metric: float | None = None
    best_epoch: int | None = None
    # The hyperparameters that make this training the one it is (SAME_ON_RESUME), as typed.
    training: dict = field(default_factory=dict)

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp"

    @property
    def checkpoint_name(self) -> str:
        return checkpoint_name(
            self.step, before_epoch_end=self.batch_in_epoch >= self.sampler.batches_per_epoch
        )

    def trained(self) -> dict:
        """What trains, copied: the best weights (with FSDP, this process's shards of them)."""
        if self.sharded:
            from steps import fsdp

            return fsdp.trained_state(self.model, self.finetuning)
        return trained_state(self.model, self.finetuning)

    def load_trained(self, state: dict) -> None:
        if self.sharded:
            from steps import fsdp

            fsdp.load_trained_state(self.model, state, self.finetuning)
        else:
            load_trained_state(self.model, state, self.finetuning)

    def state_dict(self) -> dict:
        """What the main process writes to state.pt (with FSDP, the model and optimizer are
        every process's shards, written beside it: `save_checkpoint`)."""
        return {
            "finetuning": self.finetuning,
            "strategy": self.strategy,
            "model": None if self.sharded else trained_state(self.model, self.finetuning),
            "optimizer": None if self.sharded else self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "step": self.step,
            "history": self.history,
            "epoch_loss": list(self.epoch_loss),
            "best_metric": self.best_metric,
            "best_epoch": self.best_epoch,
            "sampler": self.sampler.state_dict(),
            "seed": self.seed,
            "run_name": self.run_name,
            "training": self.training,
        }

    def load_state_dict(self, state: dict) -> None:
        missing = [k for k in STATE_FIELDS if k not in state]
        if missing:
            raise KeyError(f"checkpoint lacks {missing}")
        # A checkpoint written before FINETUNING or DISTRIBUTED_STRATEGY existed trained every
        # weight, with DDP.
        for key, default in (("finetuning", "full"), ("strategy", "ddp")):
            written, mine = state.get(key, default), getattr(self, key)
            setting = {"finetuning": "FINETUNING", "strategy": "DISTRIBUTED_STRATEGY"}[key]
            if written != mine:
                raise OtherMethod(
                    f"the checkpoints were written with {setting} = {written} and this job has "
                    f"{setting} = {mine}: resume with {setting} = {written}, or start a new run"
                )
        self.check_same_training(state.get("training") or {})  # none before it was recorded
        # The sampler, then every key and shape, are checked before the model is touched: a
        # foreign checkpoint fails without leaving a half-loaded model behind (the previous one
        # is tried next). With FSDP, the model and optimizer load from the shards after this
        # (`load_checkpoint`).
        self.sampler.load_state_dict(state["sampler"])
        if not self.sharded:
            load_trained_state(self.model, state["model"], self.finetuning)
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        for key in STATE_FIELDS:
            if key not in OBJECTS:
                setattr(self, key, state[key])
        if self.sampler.resharded:  # the same optimizer step in this world's micro-batches
            steps = state["batch_in_epoch"] // state["sampler"]["accumulation"]
            self.batch_in_epoch = steps * self.sampler.accumulation

    def check_same_training(self, written: dict) -> None:
        """Refuse checkpoints whose training had other hyperparameters, naming each."""
        differ = [k for k in self.training if k in written and written[k] != self.training[k]]
        if differ:
            theirs = ", ".join(f"{k} = {written[k]!r}" for k in differ)
            mine = ", ".join(f"{k} = {self.training[k]!r}" for k in differ)
            raise OtherTraining(
                f"the checkpoints were written by another training ({theirs}; this job has "
                f"{mine}): two jobs were given one checkpoint folder. Give this job a "
                "checkpoint location of its own (CheckpointConfig S3Uri), or resume with the "
                "same hyperparameters"
            )


def rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def seed_rng(seed: int) -> None:
    """Every generator a rank draws from, from one seed (a rank new to a resumed run)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        # One state per GPU the writer had; an instance of another type may have fewer.
        for device, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def checkpoint_name(step: int, before_epoch_end: bool = False) -> str:
    """A checkpoint's folder: never the name of one written before it in the run, so that a
    save never replaces the checkpoint resumed from, and SageMaker's copy of the folder in S3
    never mixes two checkpoints' files under one name."""
    return f"ckpt-{step:08d}" + (BEFORE_EPOCH_END if before_epoch_end else "")


def position(name: str) -> tuple[int, bool]:
    """Where a checkpoint's name puts it in training: its step, then the epoch's end."""
    return step_of(Path(name)), not name.endswith(BEFORE_EPOCH_END)


def checkpoint_names(directory: Path) -> list[str]:
    """Complete checkpoints, oldest first."""
    names = [p.name for p in directory.glob("ckpt-*") if p.is_dir() and not p.name.endswith(".tmp")]
    return sorted(names, key=position)


def kept(keep: int) -> int:
    """How many checkpoints a folder holds at most, the one being written included: KEEP_
    CHECKPOINTS, and never fewer than two, so that the newest complete one stays while the
    next is written and copied to S3 (`KEEP_CHECKPOINTS = 1` keeps two between saves).

    SageMaker copies /opt/ml/checkpoints to S3 during training, deletions included ("If a
    checkpoint is deleted in the SageMaker AI container, it will also be deleted in the S3
    folder": model-checkpoints.html), in an order it does not document, and not when the job is
    terminated ("Writes to S3 when job is terminated: No": model-train-storage.html). A
    checkpoint is removed only once a newer one has been complete for a whole checkpoint
    interval; the job cannot see S3 (SageMaker reports nothing of its copy), so that interval is
    the assurance. The checkpoint written on SIGTERM is best effort: it may never reach S3, and
    never costs the one written before it."""
    return max(keep, 2)


def rotate(directory: Path, at_most: int) -> None:
    """Remove the oldest checkpoints beyond the newest `at_most`."""
    for name in checkpoint_names(directory)[:-at_most]:
        shutil.rmtree(directory / name, ignore_errors=True)


def begin_checkpoint(directory: Path, name: str, keep: int | None = None) -> Path:
    """Main process: a fresh, empty directory for the checkpoint `name`. Given KEEP_
    CHECKPOINTS, room is made first: the oldest go now, so the folder never holds more than
    `kept(keep)` checkpoints, this one included, and the newest complete one stays."""
    if keep is not None and directory.is_dir():
        rotate(directory, kept(keep) - 1)
        # A save cut short left its `.tmp` (a save is collective: none is being written now).
        for stale in directory.glob("ckpt-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = directory / f"{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def write_rank_state(tmp: Path, rank: int, state: State) -> None:
    """Every process writes what is its own: its RNG (dropout differs per rank) and its share
    of the running epoch loss."""
    _save({"rng": rng_state(), "epoch_loss": list(state.epoch_loss)}, tmp / f"rank{rank}.pt")


def point_current(directory: Path, checkpoint: Path) -> None:
    """CURRENT names `checkpoint`: written aside, flushed, renamed over the old pointer."""
    pointer = directory / f".{CURRENT}.tmp"
    with open(pointer, "w") as f:
        f.write(checkpoint.name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, directory / CURRENT)
    _fsync_dir(directory)


def finish_checkpoint(
    directory: Path, tmp: Path, state: State, best_weights: dict | None, keep: int
) -> Path:
    """Main process: write the State and the manifest, then make it current atomically; the
    folder keeps `kept(keep)` checkpoints (the one before this one among them)."""
    _save(state.state_dict(), tmp / STATE_FILE)
    previous = current_checkpoint(directory)
    if best_weights is not None:
        _save(best_weights, tmp / BEST_FILE)
    elif previous is not None and (previous / BEST_FILE).exists():
        os.link(previous / BEST_FILE, tmp / BEST_FILE)  # unchanged best: share the file
    # Last, once every file of this node is in place (the processes wrote their rank files and
    # shards before): what a copy of this checkpoint must hold to be loaded.
    files = {str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file()}
    if state.sharded:  # every process's shards, on whichever node wrote them
        from steps import fsdp

        files = {f for f in files if not f.endswith("/" + fsdp.METADATA)} | set(fsdp.files(tmp))
    files = sorted(files)
    (tmp / MANIFEST).write_text(
        json.dumps(
            {
                "step": state.step,
                "epoch": state.epoch,
                "batch_in_epoch": state.batch_in_epoch,
                "files": files,
            }
        )
    )
    _fsync_dir(tmp)
    final = directory / tmp.name.removesuffix(".tmp")
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    point_current(directory, final)
    rotate(directory, kept(keep))
    return final


def finish_rank_files(directory: Path, tmp: Path, keep: int) -> None:
    """A node other than the main one: put its rank files in place under the same name; the
    main node's CURRENT pointer is the one that makes the checkpoint current."""
    _fsync_dir(tmp)
    final = directory / tmp.name.removesuffix(".tmp")
    if final.exists():  # a shared file system: the main node already renamed its part
        for path in tmp.iterdir():
            os.replace(path, final / path.name)
        tmp.rmdir()
    else:
        os.rename(tmp, final)
    rotate(directory, kept(keep))


def save_checkpoint(
    accelerator, directory: Path, state: State, new_best: dict | None, keep: int
) -> float:
    """Every process takes part: each node's first process makes the directory, every process
    writes its own RNG and loss, the main process writes the State and makes it current. On
    other nodes (multi-node SageMaker) the rank files are renamed into place too; SageMaker
    syncs every node's checkpoint folder to the same S3 prefix. Returns the seconds taken."""
    started = time.time()
    name = state.checkpoint_name
    tmp = directory / f"{name}.tmp"
    if accelerator.is_local_main_process:
        begin_checkpoint(directory, name, keep)
    accelerator.wait_for_everyone()
    write_rank_state(tmp, accelerator.process_index, state)
    if state.sharded:
        from steps import fsdp

        fsdp.save(tmp, state.model, state.optimizer, state.finetuning, new_best)
        if new_best is None and accelerator.is_local_main_process:
            link_best(directory, tmp / fsdp.BEST)
        new_best = None  # in the shards
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        finish_checkpoint(directory, tmp, state, new_best, keep)
    elif accelerator.is_local_main_process:
        finish_rank_files(directory, tmp, keep)
    accelerator.wait_for_everyone()
    return time.time() - started


def link_best(directory: Path, best: Path) -> None:
    """Sharded best weights unchanged since the previous checkpoint: each node shares that one's
    files of them (the main node's previous is CURRENT's; another node has no CURRENT)."""
    names = checkpoint_names(directory)
    previous = current_checkpoint(directory) or (directory / names[-1] if names else None)
    if previous is None or not (previous / best.name).is_dir():
        return
    best.mkdir(exist_ok=True)
    for path in (previous / best.name).iterdir():
        os.link(path, best / path.name)


def size_of(checkpoint: Path | None) -> int | None:
    """A checkpoint's bytes on disk (its files; the best weights counted though shared)."""
    if checkpoint is None:
        return None
    return sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())


def current_checkpoint(directory: Path) -> Path | None:
    pointer = directory / CURRENT
    if not pointer.exists():
        return None
    path = directory / pointer.read_text().strip()
    return path if path.is_dir() else None


def resume_candidates(directory: Path) -> list[Path]:
    """The current checkpoint first, then older complete ones, newest first."""
    current = current_checkpoint(directory)
    others = [directory / n for n in reversed(checkpoint_names(directory))]
    ordered = ([current] if current else []) + [p for p in others if p != current]
    return ordered


def step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.split("-")[1])


def settle_after_resume(directory: Path, resumed: Path | None) -> list[str]:
    """After a resume from `resumed` (None: from the start), each node's first process removes
    the checkpoints newer than it: one that failed to load (cut short on its way to S3, the
    SIGTERM one say), or one CURRENT never came to name (the job ended between its rename and
    the pointer's). Left, it would count as the newest when the folder is rotated, and the one
    resumed from would be removed before it; and training writes that point anew, under the
    same name. CURRENT names the one resumed from, so that the next checkpoint shares its best
    model. Returns the names removed."""
    after = position(resumed.name) if resumed is not None else (-1, False)
    removed = []
    for name in checkpoint_names(directory):
        if position(name) > after:
            shutil.rmtree(directory / name, ignore_errors=True)
            removed.append(name)
    if resumed is not None and current_checkpoint(directory) != resumed:
        point_current(directory, resumed)
    return removed


def check_complete(path: Path) -> None:
    """A checkpoint holds every file its manifest lists: a copy cut short on its way to S3 or
    back is refused, never loaded in part. S3 may hold a checkpoint with some of its files, each
    whole ("Amazon S3 never adds partial objects": PutObject in botocore's s3 service-2.json;
    "there is no way to make atomic updates across keys": the S3 User Guide's consistency
    model), or a CURRENT naming one it lacks (SageMaker copies nothing once the job is
    terminated: `kept`). A checkpoint written before manifests listed files passes on its
    manifest alone."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise FileNotFoundError(f"{manifest} is missing: the checkpoint is incomplete")
    missing = [
        n for n in json.loads(manifest.read_text()).get("files", []) if not (path / n).is_file()
    ]
    if missing:
        raise FileNotFoundError(f"{path} is incomplete: {missing} of its {MANIFEST} missing")


def load_checkpoint(path: Path, state: State, rank: int) -> dict | None:
    """Load a checkpoint into `state` and this rank's RNG; return the best weights, if any.
    One written by another number of processes loads too: the model, optimizer and scheduler
    are every process's alike (DDP), the position is taken in optimizer steps
    (ResumableBatchSampler.load_state_dict), the epoch's loss so far goes to rank 0 whole, and
    a rank the checkpoint did not have starts its RNG from the seed, its rank and the step.
    With FSDP the model and optimizer come from every process's shards, resharded by DCP to
    this job's processes (steps/fsdp.py)."""
    if state.sharded:  # every process reads, or none goes on to the collective load
        from steps import fsdp

        saved, own = agreed(fsdp.agree, lambda: read_checkpoint(path, state, rank))
    else:
        saved, own = read_checkpoint(path, state, rank)
    state.load_state_dict(saved)
    if state.sharded:
        best = fsdp.load(path, state.model, state.optimizer, state.finetuning)
    if saved["sampler"]["world"] == state.sampler.world:
        state.epoch_loss = own[rank]["epoch_loss"]
        set_rng_state(own[rank]["rng"])
    else:
        losses = [o["epoch_loss"] for o in own.values()]
        state.epoch_loss = (
            [sum(x[0] for x in losses), sum(x[1] for x in losses)] if rank == 0 else [0.0, 0.0]
        )
        if rank in own:
            set_rng_state(own[rank]["rng"])
        else:
            seed_rng(state.seed * 1000003 + state.step * 101 + rank)
    if state.sharded:
        return best
    best = path / BEST_FILE
    return torch.load(best, map_location="cpu", weights_only=False) if best.exists() else None


def read_checkpoint(path: Path, state: State, rank: int) -> tuple[dict, dict]:
    """A checkpoint's state.pt and the rank files this rank reads, every file checked to be
    there: nothing is loaded into the job yet."""
    check_complete(path)
    saved = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    written = saved.get("sampler", {}).get("world", state.sampler.world)  # checked in load
    ranks = [rank] if written == state.sampler.world else list(range(written))
    missing = [path / f"rank{r}.pt" for r in ranks if not (path / f"rank{r}.pt").exists()]
    if missing:
        raise FileNotFoundError(f"{missing[0]} is missing: the checkpoint is incomplete")
    own = {
        r: torch.load(path / f"rank{r}.pt", map_location="cpu", weights_only=False) for r in ranks
    }
    return saved, own


def agreed(agree, read):
    """`read()` on every process, its error raised on every process: what comes after is a
    collective load, which a process that failed alone would leave the others waiting in."""
    try:
        result, error = read(), None
    except Exception as e:  # noqa: BLE001 - raised again below, on every process
        result, error = None, e
    if not agree(error is None):
        raise error or FileNotFoundError("another process could not read this checkpoint")
    return result
