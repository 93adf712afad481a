"""DISTRIBUTED_STRATEGY = fsdp: each process holds 1/N of the weights, their gradients and their
optimizer state, and gathers one transformer layer's weights at a time to compute with it.

The model is sharded with torch's FSDP2 (`shard`), checkpointed with torch.distributed.checkpoint
(`save`, `load`), and gathered whole to the main process at the end (`gathered`). One process
shards over itself (`process_group`), so a job of one process runs the same code and writes the
same checkpoints. docs/settings.md (Several processes: DDP or FSDP) says what a user sees.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

SHARDED = "sharded"  # a checkpoint's folder of the model's and the optimizer's shards
BEST = "best"  # a checkpoint's folder of the best weights' shards
# DCP names its metadata file `.metadata` (torch/distributed/checkpoint/filesystem.py), a hidden
# file. AWS documents that /opt/ml/checkpoints is synced with S3 and restored to every host
# (model-checkpoints.html), not how it treats hidden files: the metadata is also kept under a
# plain name (a hard link, no bytes more), listed in the manifest, and put back where a copy
# lacks the hidden one.
METADATA, VISIBLE_METADATA = ".metadata", "metadata"


def process_group(on_gpu: bool) -> None:
    """A process group of one for a job of one process (torchrun's jobs have theirs): FSDP and
    DCP then run as they do with several."""
    if dist.is_initialized():
        return
    backend = "nccl" if on_gpu else "gloo"
    dist.init_process_group(
        backend,
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(minutes=30),
    )


# glibc's malloc raises its mmap threshold to the largest block freed (up to 32 MB: mallopt(3),
# M_MMAP_THRESHOLD), so a CPU process that gathers and frees a layer's weights at every forward
# soon takes them from its heap, which keeps what is freed: under FSDP each process's resident
# memory grew by about 1 GB a step on a BERT-large-sized model. A fixed threshold (which also
# turns the raising off) gives every block of 1 MB or more back when freed: that model's
# training job peaked at 3.7 GB a process instead of 5.8, its steps 16% slower
# (docs/performance.md, "FSDP against DDP").
M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 2**20


def return_freed_memory() -> bool:
    """On a CPU with glibc, freed blocks of a layer's size go back to the system at once;
    whether the setting applied (another C library has no mallopt)."""
    import ctypes

    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    return bool(mallopt and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1)


def shard(model: torch.nn.Module, blocks: list[str], device, mixed_precision: str):
    """The model sharded across every process: each block, then the root, as Accelerate's FSDP
    plugin (version 2) wraps a model (accelerate/utils/fsdp_utils.py, `fsdp2_prepare_model`).
    Not through the plugin itself: Accelerate 1.15 turns FSDP on for GPU-like distributed types
    only, never for MULTI_CPU (accelerate/state.py, AcceleratorState.__init__), so its branch
    would run on a GPU and nowhere a test can run it. Accelerate keeps everything else: the
    device, autocast, gradient accumulation, the optimizer wrapper, the trackers. Under bf16 the
    weights are gathered in bf16 and the gradients reduced in fp32 (torch's FSDP2 tutorial's
    policy); autocast stays on as in every other job (train.py). Trained weights are fp32,
    as Accelerate upcasts them: FSDP2 needs one dtype per unit."""
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision == "bf16"
        else MixedPrecisionPolicy()
    )
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for name in blocks:
        fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def options(method: str) -> StateDictOptions:
    """What a checkpoint holds of the model: with LoRA, only what trains (and only that is
    loaded back: the frozen weights are load_model's)."""
    return StateDictOptions(ignore_frozen_params=method == "lora", strict=method == "full")


def plain(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's wrapper (whose step may skip)."""
    return getattr(optimizer, "optimizer", optimizer)


def trained_state(model: torch.nn.Module, method: str) -> dict:
    """This process's shards of what trains, copied on its device (the best weights)."""
    return {
        k: v.detach().clone()
        for k, v in get_model_state_dict(model, options=options(method)).items()
    }


def load_trained_state(model: torch.nn.Module, state: dict, method: str) -> None:
    set_model_state_dict(model, state, options=options(method))


def save(directory: Path, model, optimizer, method: str, best: dict | None) -> None:
    """Every process: its shards of the model and optimizer, and of new best weights. DCP
    reshards a checkpoint on load, so it loads into any number of processes
    (https://pytorch.org/docs/stable/distributed.checkpoint.html)."""
    model_state, optimizer_state = get_state_dict(model, plain(optimizer), options=options(method))
    dcp.save(
        {"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory / SHARDED
    )
    if best is not None:
        dcp.save(best, checkpoint_id=directory / BEST)
    if dist.get_rank() == 0:  # DCP's coordinator wrote the metadata before save returned
        for folder in (SHARDED, BEST) if best is not None else (SHARDED,):
            os.link(directory / folder / METADATA, directory / folder / VISIBLE_METADATA)


def restore_metadata(directory: Path) -> None:
    """The hidden metadata file put back from its plain copy, where a sync left it out."""
    for folder in (SHARDED, BEST):
        hidden, visible = directory / folder / METADATA, directory / folder / VISIBLE_METADATA
        if visible.exists() and not hidden.exists():
            try:
                os.link(visible, hidden)
            except FileExistsError:  # another process of this node put it back first
                pass


def load(directory: Path, model, optimizer, method: str) -> dict | None:
    """Every process: the model and optimizer from a checkpoint's shards, written by any number
    of processes; returns the best weights' shards, if it holds them."""
    restore_metadata(directory)
    model_state, optimizer_state = get_state_dict(model, plain(optimizer), options=options(method))
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=directory / SHARDED)
    set_state_dict(
        model,
        plain(optimizer),
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=options(method),
    )
    if not (directory / BEST).is_dir():
        return None
    best = trained_state(model, method)
    dcp.load(best, checkpoint_id=directory / BEST)
    return best


def files(directory: Path) -> list[str]:
    """The shard files a checkpoint's DCP folders are made of, as their metadata lists them:
    what a copy of it must hold (checkpointing.py's manifest)."""
    found = []
    for folder in (SHARDED, BEST):
        if (directory / folder).is_dir():
            metadata = dcp.FileSystemReader(directory / folder).read_metadata()
            names = {info.relative_path for info in metadata.storage_data.values()}
            found += [f"{folder}/{n}" for n in sorted(names | {VISIBLE_METADATA})]
    return found


def agree(ok: bool) -> bool:
    """Whether every process got this far: a collective load that some processes skip would
    hang the others."""
    flag = torch.tensor([int(ok)], device=_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )


def gathered(model: torch.nn.Module, frame: torch.nn.Module | None) -> torch.nn.Module | None:
    """Every process: the full weights gathered to the main one, one at a time, on its CPU
    (`full_state_dict` with `cpu_offload`: the other processes receive nothing), and loaded
    there into `frame` (the model's skeleton, kept on the meta device since before it was
    sharded); None on the other processes."""
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if frame is None:
        return None
    frame.load_state_dict(full, strict=True, assign=True)
    return frame
