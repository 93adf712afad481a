"""Train (training job): finetune one model with Hugging Face Accelerate.

Reads top to bottom, like Accelerate's examples: `main()` reads the container contract and
casts the hyperparameters once; `training_function()` runs the stages, each a short function:
set up, resume, one epoch at a time (validate, keep the best, checkpoint), finish. The job
resumes from the newest good checkpoint in SM_CHECKPOINT_DIR, and on SIGTERM (a spot reclaim)
it finishes the current step, writes a checkpoint and exits with EXIT_INTERRUPTED: after the
step it arrives in with one process, with several at most about 10 s of steps later
(training_blocks.StopCheck). Between logging steps the loop never waits for the device.

Channels: train, validation (datasets save_to_disk, every model's columns prefixed with its
name, `<model>__length` per row), labels (id2label.json, inputs.json, encoding.json). Rows
are used whole, as prepare cut them (encoding.json records the length, and the model's
smpipe.json records it again). Every batch is padded to its own longest row; training
batches are grouped by length. Output: SM_MODEL_DIR gets the
best model by validation F1 (safetensors, the programs the `exports` hyperparameter names,
curves, history; a tuning trial's only the weights and history: the study's best model is
exported after it, steps/export.py); SM_OUTPUT_DATA_DIR gets the Metadata section, where
the job's time outside its optimizer steps goes (`seconds_outside_steps`), and the wandb run.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import gc
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from steps import checkpointing as ckpt
from steps.batching import Batches, read_inputs, read_split
from steps.export import check_batches, check_exports, check_programs, logits_of, write_programs
from steps.finetuning import (
    Finetuning,
    check_blocks,
    final_model,
    load_trained_state,
    prepare,
    skeleton,
)
from steps.hyperparameters import parse_hyperparameters, reserved_hyperparameters
from steps.metrics import metric_line, plot_curves
from steps.model_files import CURVES, HISTORY, read_record, write_card, write_record
from steps.prepared_files import read_encoding
from steps.runtime import names
from steps.runtime.environment import TrainingEnv, training_env
from steps.runtime.step import run_step, write_step_metadata
from steps.training_blocks import (
    Diverged,
    EpochLoss,
    Interrupt,
    StopCheck,
    accelerator_for,
    batch_split,
    check_output_width,
    evaluate,
    loader_for,
    optimizer_for,
    save_final_model,
)
from steps.user_code import call, load_user_functions

# Where the job's time outside its optimizer steps goes, by phase (the report's
# `seconds_outside_steps`): what a job's fixed cost is made of, measured by every job.
OUTSIDE_STEPS: dict[str, float] = collections.defaultdict(float)


@contextlib.contextmanager
def timed(phase: str):
    started = time.time()
    try:
        yield
    finally:
        OUTSIDE_STEPS[phase] += time.time() - started


def seconds_before_main() -> float:
    """This process's age when main() starts: the interpreter and the imports (about 0 in a
    job forked from a warm server, which imported them before)."""
    import psutil

    return time.time() - psutil.Process().create_time()


@dataclass
class Job:
    """What the stages share: set up once, then read and advanced by each stage."""

    hp: dict
    env: TrainingEnv
    accelerator: Accelerator
    keys: list[str]
    id2label: dict[int, str]
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    state: ckpt.State
    sampler: ckpt.ResumableBatchSampler
    train_loader: DataLoader
    val_batches: Batches
    inputs: dict  # this model's padding values and sequence inputs (labels/inputs.json)
    max_length: int  # the tokens prepare cut rows to (labels/encoding.json)
    per_device: int
    accumulation: int
    total_steps: int
    wandb_on: bool
    settings: dict  # what was applied: precision, optimizer, compile, grouping
    finetuning: Finetuning  # what of the model trains (full or LoRA), gradient checkpointing
    best_weights: dict | None = None
    resumed_from: dict | None = None
    checkpoint_seconds: list[float] = field(default_factory=list)
    checkpoint_bytes: int | None = None  # the newest checkpoint's, as written (main process)
    peak_memory: list[dict] = field(default_factory=list)  # per process (`end_epoch`)
    started: float = field(default_factory=time.time)
    epoch_started: float = 0.0
    loop_seconds: float = 0.0  # in train_epoch: the optimizer steps, nothing around them
    last_finite: tuple[int, float] | None = None  # (optimizer step, its mean loss)
    stop_check: StopCheck = field(default_factory=StopCheck)  # when the processes ask (SIGTERM)
    tracking: concurrent.futures.Future | None = None  # wandb starting (start_tracking)
    # FSDP: the model on the meta device, on the main process, for the gathered final weights
    frame: torch.nn.Module | None = None


def announce(
    accelerator: Accelerator, hp: dict, per_device: int, accumulation: int, settings: dict
) -> None:
    """The job's first line: the model, how the batch splits, and what was applied."""
    effective = per_device * accelerator.num_processes * accumulation
    accelerator.print(
        f"model={hp['model_name']} processes={accelerator.num_processes} "
        f"per_device_batch={per_device} accumulation={accumulation} "
        f"effective_batch={effective} (wanted {hp['batch_size']}) "
        + " ".join(f"{k}={v}" for k, v in settings.items())
    )


def read_data(env: TrainingEnv, model_name: str, keys: list[str], multiple_of: int):
    """The label map, the model's input columns, the length prepare cut rows to, and the
    training and validation rows, padded per batch."""
    labels_dir = env.channels["labels"]
    id2label = {
        int(k): v for k, v in json.loads((labels_dir / "id2label.json").read_text()).items()
    }
    inputs = read_inputs(labels_dir, model_name, keys)
    max_length = read_encoding(labels_dir)["max_length"]
    train, val = (
        Batches(read_split(env.channels[split]), model_name, keys, inputs, max_length, multiple_of)
        for split in ("train", "validation")
    )
    return id2label, inputs, max_length, train, val


def user_model(functions, model_name: str, id2label: dict[int, str]) -> torch.nn.Module:
    """The user's load_model, checked to be a torch module."""
    label2id = {v: k for k, v in id2label.items()}
    model = call(functions, "load_model", model_name, id2label, label2id)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"{functions.module}.load_model({model_name!r}, ...) must return a "
            f"torch.nn.Module, got {type(model).__name__}"
        )
    return model


def training_state(accelerator, model, optimizer, scheduler, sampler, hp, env) -> ckpt.State:
    """What a checkpoint holds: with LoRA, only the adapters and the head of the model. The
    gradient scaler exists only under fp16 mixed precision (Accelerate owns it); None
    otherwise."""
    return ckpt.State(
        finetuning=hp["finetuning"],
        strategy=hp["distributed_strategy"],
        model=accelerator.unwrap_model(model, keep_torch_compile=False),
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=sampler,
        seed=hp["seed"],
        run_name=env.job_name,
        scaler=accelerator.scaler,
    )


def loading(hp: dict, loader: DataLoader, multiple_of: int) -> dict:
    """How batches reach the model, for the job's report."""
    return {
        "group_by_length": hp["group_by_length"],
        "pad_to_multiple_of": multiple_of,
        "dataloader_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
    }


def set_up(hp: dict, env: TrainingEnv) -> Job:
    """Everything training needs, built in order, as Accelerate's `training_function` builds
    it: the data, the user's model, the optimizer, Accelerate's wrapping."""
    model_name = hp["model_name"]
    functions = load_user_functions(os.environ[names.USER_FUNCTIONS_VARIABLE])
    keys = list(call(functions, "ordered_input_keys", model_name))
    on_gpu = env.num_gpus > 0

    per_device, accumulation = batch_split(hp)
    accelerator, precision, wandb_on = accelerator_for(hp, env, accumulation)
    set_seed(hp["seed"])
    if hp["distributed_strategy"] == "fsdp" and not on_gpu:  # before the model is built
        return_freed_memory()

    # On a GPU, widths padded to a multiple of 8 keep the tensor cores' tiles full.
    multiple_of = 8 if on_gpu else 1
    with timed("data"):
        id2label, inputs, max_length, train, val = read_data(env, model_name, keys, multiple_of)
    # We build the model after seeding so that the seed also controls new weights' initialization.
    with timed("model"):
        model = user_model(functions, model_name, id2label)
        model, finetuning = prepare(model, hp, len(id2label), functions.module)

    sampler, train_loader = loader_for(train, hp, per_device, accumulation, accelerator, on_gpu)
    total_steps = sampler.steps_per_epoch * hp["epochs"]
    total_steps = min(total_steps, hp["max_steps"] or total_steps)
    # The train loader is not prepared: the resumable sampler shards it itself, per rank.
    model, optimizer, scheduler, optimizer_kind, frame = shared(
        model, accelerator, precision.applied, hp, total_steps, functions.module
    )
    check_output_width(accelerator, model, val, keys, len(id2label), functions.module)
    compiled = False
    if hp["compile"]:
        model, compiled = torch.compile(model, dynamic=True), True
    state = training_state(accelerator, model, optimizer, scheduler, sampler, hp, env)
    settings = {
        "mixed_precision": precision.applied,
        "precision_reason": precision.reason,
        "optimizer": f"AdamW ({optimizer_kind})",
        "compile": compiled,
        **loading(hp, train_loader, multiple_of),
        "finetuning": finetuning.method,
        "gradient_checkpointing": finetuning.gradient_checkpointing,
        "distributed_strategy": hp["distributed_strategy"],
    }
    announce(accelerator, hp, per_device, accumulation, settings)
    return Job(
        hp=hp,
        env=env,
        accelerator=accelerator,
        keys=keys,
        id2label=id2label,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        state=state,
        sampler=sampler,
        train_loader=train_loader,
        val_batches=val,
        inputs=inputs,
        max_length=max_length,
        per_device=per_device,
        accumulation=accumulation,
        total_steps=total_steps,
        wandb_on=wandb_on,
        settings=settings,
        finetuning=finetuning,
        frame=frame,
    )


def return_freed_memory() -> None:
    """FSDP on a CPU: freed layers go back to the system (steps/fsdp.py says why). Its module
    is imported here only: DCP's import costs a job that does not shard 0.7 s."""
    from steps import fsdp

    fsdp.return_freed_memory()


def shared(model, accelerator: Accelerator, mixed_precision: str, hp, total_steps, module: str):
    """The model as DISTRIBUTED_STRATEGY shares it among the processes, and its optimizer:
    with ddp, both prepared by Accelerate (its DDP wrapper); with fsdp, the model sharded
    first, each layer its own unit, so that the optimizer holds the shards, and not prepared
    (Accelerate would wrap it in DDP), its skeleton kept on the main process for the final
    weights (steps/fsdp.py). Returns the model, the optimizer, its schedule, which AdamW runs,
    and the skeleton (None but on FSDP's main process)."""
    if hp["distributed_strategy"] != "fsdp":
        optimizer, scheduler, kind = optimizer_for(model, hp, total_steps)
        model, optimizer = accelerator.prepare(model, optimizer)
        return model, optimizer, scheduler, kind, None
    from steps import fsdp

    blocks = check_blocks(model, hp["model_name"], module)
    fsdp.process_group(accelerator.device.type == "cuda")
    frame = skeleton(model, hp["model_name"], module) if accelerator.is_main_process else None
    model = fsdp.shard(model, blocks, accelerator.device, mixed_precision)
    optimizer, scheduler, kind = optimizer_for(model, hp, total_steps)
    return model, accelerator.prepare(optimizer), scheduler, kind, frame


def resume(job: Job) -> None:
    """From the newest checkpoint that loads; every rank from the same one, or none."""
    accelerator, state = job.accelerator, job.state
    started = time.time()
    failed, resumed = [], None
    for candidate in ckpt.resume_candidates(job.env.checkpoint_dir):
        try:
            job.best_weights = ckpt.load_checkpoint(candidate, state, accelerator.process_index)
        except ckpt.Unresumable:  # every checkpoint of the run is so: none will load
            raise
        except Exception as e:  # a truncated or foreign checkpoint: say which, try the one before
            accelerator.print(
                f"checkpoint {candidate} could not be loaded ({type(e).__name__}: {e}); "
                "trying the previous one"
            )
            failed.append(candidate)
            continue
        resumed = candidate
        job.resumed_from = {
            "checkpoint": str(candidate),
            "step": state.step,
            "epoch": state.epoch,
            "batch_in_epoch": state.batch_in_epoch,
            "seconds": round(time.time() - started, 3),
        }
        accelerator.print(
            f"resumed from {candidate} at step {state.step} "
            f"(epoch {state.epoch}, batch {state.batch_in_epoch})"
        )
        if state.sampler.resharded:
            world, per_device, accumulation = state.sampler.resharded
            job.resumed_from["written_by"] = {
                "processes": world,
                "per_device_batch": per_device,
                "accumulation": accumulation,
            }
            accelerator.print(
                f"the checkpoint was written by {world} processes of {per_device} rows x "
                f"{accumulation}, this job has {accelerator.num_processes} of "
                f"{state.sampler.per_device} x {state.sampler.accumulation}: it goes on from "
                "the same optimizer "
                f"step, the rest of epoch {state.epoch + 1} drawn in this job's order"
            )
        break
    if accelerator.num_processes > 1:
        steps = accelerator.gather(torch.tensor([state.step], device=accelerator.device))
        if len(set(steps.tolist())) != 1:
            raise RuntimeError(
                f"processes resumed from different checkpoints: steps {steps.tolist()}"
            )
    if accelerator.is_local_main_process:
        removed = ckpt.settle_after_resume(job.env.checkpoint_dir, resumed, failed)
        if removed:
            accelerator.print(
                f"removed {removed}: newer than the checkpoint resumed from, and not loadable"
            )
    accelerator.wait_for_everyone()


def checkpoint(job: Job, new_best: dict | None = None) -> None:
    job.checkpoint_seconds.append(
        ckpt.save_checkpoint(
            job.accelerator, job.env.checkpoint_dir, job.state, new_best, job.hp["keep_checkpoints"]
        )
    )
    if job.accelerator.is_main_process:
        job.checkpoint_bytes = ckpt.size_of(ckpt.current_checkpoint(job.env.checkpoint_dir))


def peak_memory(accelerator: Accelerator) -> tuple[str, int]:
    """This process's peak memory so far, and what it is: the GPU's allocated bytes on a GPU
    (what the model, its gradients, optimizer state and activations took), the host's
    resident set on a CPU."""
    if accelerator.device.type == "cuda":
        return "gpu_max_allocated_bytes", torch.cuda.max_memory_allocated(accelerator.device)
    import resource

    # ru_maxrss is in kilobytes on Linux (getrusage(2)).
    return "host_max_rss_bytes", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def check_finite(job: Job, steps: list[tuple[int, float, float]]) -> None:
    """Stop at the first optimizer step whose loss is inf or nan (diverged, or non-finite
    gradients from the step before): a model past it is never checkpointed or promoted.
    `steps`: (step, the epoch's loss sum after it, its mean loss), as `EpochLoss.read` gives
    them after a logging step, before a checkpoint and at the epoch's end, so the step is
    found there (said when later than the step it names), at no cost of its own."""
    for step, total, loss in steps:
        if math.isfinite(total):
            job.last_finite = (step, loss)
            continue
        hp, last, now = job.hp, job.last_finite, job.state.step
        found = f", found after step {now}" if now != step else ""
        raise Diverged(
            f"the training loss is {loss} at optimizer step {step} "
            f"(epoch {job.state.epoch + 1}{found}); "
            + (
                f"the last finite loss was {last[1]:.4f} at step {last[0]}. "
                if last
                else "no step had a finite loss. "
            )
            + f"Lower LEARNING_RATE ({hp['learning_rate']:g}) or "
            f"WEIGHT_DECAY ({hp['weight_decay']:g}), "
            "or check the data and load_model; no model of this job is kept"
        )


def read_loss(job: Job, losses: EpochLoss) -> float | None:
    """The epoch's loss sums read to the host (`state.epoch_loss`, what a checkpoint and the
    epoch's record hold), every step since the last read checked to be finite; the last of
    those steps' mean loss (None if none)."""
    job.state.epoch_loss, steps = losses.read()
    check_finite(job, steps)
    return steps[-1][2] if steps else None


class Progress:
    """About ten progress lines an epoch, after each step whose number is a multiple of
    `every` (the same on every process), with the examples a second since the line before."""

    def __init__(self, job: Job) -> None:
        self.every = max(1, job.sampler.steps_per_epoch // 10)
        self.rows = job.sampler.per_device * job.accumulation * job.accelerator.num_processes
        self.since = (time.time(), job.state.step)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def say(self, job: Job, loss: float) -> None:
        """The line: `loss` is the step's mean over the main process's micro-batches."""
        now, (then, at) = time.time(), self.since
        rate = (job.state.step - at) * self.rows / max(now - then, 1e-9)
        self.since = (now, job.state.step)
        job.accelerator.print(
            f"step={job.state.step}/{job.total_steps} epoch={job.state.epoch + 1} "
            f"loss={loss:.4f} examples/s={rate:.1f}"
        )


def train_epoch(job: Job) -> None:
    """Optimizer steps until the epoch ends (or MAX_STEPS); exits the job on SIGTERM. A step
    queues its work on the device and goes on: only a logging step, a checkpoint, the
    processes' SIGTERM check (`StopCheck`) and the epoch's end wait for the device, to read
    the loss (`EpochLoss`) or the processes' flags."""
    accelerator, state = job.accelerator, job.state
    loop_started = time.time()
    job.sampler.set_epoch(state.epoch, state.batch_in_epoch)
    accelerator.step = state.batch_in_epoch % job.accumulation
    losses, progress = EpochLoss(state.epoch_loss, accelerator.device), Progress(job)
    job.stop_check.restart(state.step)
    # Accelerate's prepare makes a DDP model's forward autocast; a sharded model is not
    # prepared (set_up). Its gradients are reduce-scattered at every micro-batch: kept whole
    # until the last (set_requires_gradient_sync(False)), they would take a whole model's room.
    autocast = accelerator.autocast if state.sharded else contextlib.nullcontext
    job.model.train()
    for batch in job.train_loader:
        if state.step >= job.total_steps:
            break
        losses.add(micro_batch(job, batch, autocast))
        state.batch_in_epoch += 1
        job.sampler.start = state.batch_in_epoch
        if accelerator.sync_gradients and after_step(job, losses, progress):
            break  # the epoch-end checkpoint follows validation
    read_loss(job, losses)
    job.loop_seconds += time.time() - loop_started


def micro_batch(job: Job, batch: dict, autocast) -> torch.Tensor:
    """One forward and backward pass; the optimizer steps after the last of an accumulation
    group (Accelerate's `accumulate`). Its loss, on the device."""
    accelerator, model = job.accelerator, job.model
    batch = {k: v.to(accelerator.device, non_blocking=True) for k, v in batch.items()}
    with accelerator.accumulate(model):
        with autocast():
            logits = logits_of(model(**{k: batch[k] for k in job.keys}))
        loss = torch.nn.functional.cross_entropy(logits.float(), batch["label_id"])
        accelerator.backward(loss)
        job.optimizer.step()
        if accelerator.sync_gradients:
            job.scheduler.step()
        job.optimizer.zero_grad()
    return loss


def after_step(job: Job, losses: EpochLoss, progress: Progress) -> bool:
    """An optimizer step's bookkeeping: the progress line, SIGTERM, CHECKPOINT_EVERY_STEPS,
    each decided on step numbers, Python ints every process has alike. Whether the epoch ends
    here."""
    state, every = job.state, job.hp["checkpoint_every_steps"]
    state.step += 1
    losses.step_taken(state.step)
    last = state.batch_in_epoch == job.sampler.batches_per_epoch or state.step >= job.total_steps
    logging = progress.due(state.step)
    if logging:
        progress.say(job, read_loss(job, losses))
    if job.stop_check.stop(job.accelerator, state.step, logging or last):
        stop(job, losses)
    if last:
        return True
    if every and state.step % every == 0:
        read_loss(job, losses)  # what the checkpoint holds; never one past a non-finite loss
        checkpoint(job)
    return False


def stop(job: Job, losses: EpochLoss) -> None:
    """SIGTERM: a checkpoint after this step, the interrupted marker, and every process leaves
    with EXIT_INTERRUPTED."""
    read_loss(job, losses)
    checkpoint(job)
    job.accelerator.print(
        f"SIGTERM: checkpoint written at step {job.state.step}; exiting to be resumed"
    )
    if job.accelerator.is_main_process:
        marker = job.env.failure_file.parent.joinpath(names.INTERRUPTED)
        marker.write_text(str(job.state.step))
    leave(job)
    sys.exit(names.EXIT_INTERRUPTED)


def end_epoch(job: Job) -> None:
    """Validate, log, keep the best by F1, checkpoint."""
    accelerator, state = job.accelerator, job.state
    with timed("validation"):
        scores = evaluate(
            job.model, job.val_batches, job.keys, accelerator, job.per_device, state.sharded
        )
    if not math.isfinite(scores["val_loss"]):  # the last step's update broke the weights
        raise Diverged(
            f"the validation loss is {scores['val_loss']} after optimizer step {state.step} "
            f"(epoch {state.epoch + 1}); the weights are no longer finite and no model is kept"
        )
    # Each process's loss sum and batches, and its peak memory so far, in the one gather an
    # epoch makes anyway: no collective of its own near the job's end (`leave` says why).
    kind, peak = peak_memory(accelerator)
    mine = torch.tensor([*state.epoch_loss, float(peak)], dtype=torch.float64)
    rows = accelerator.gather(mine.to(accelerator.device).reshape(1, 3)).reshape(-1, 3).cpu()
    job.peak_memory = [{"process": i, kind: int(row[2])} for i, row in enumerate(rows)]
    losses = rows[:, :2].sum(0)
    train_loss = (losses[0] / losses[1].clamp(min=1)).item()
    record = {
        "epoch": state.epoch + 1,
        "step": state.step,
        "train_loss": train_loss,
        **scores,
        "learning_rate": job.scheduler.get_last_lr()[0],
        "seconds": round(time.time() - job.epoch_started, 3),
    }
    state.history.append(record)
    accelerator.print(metric_line(record))
    tracked(job)
    accelerator.log({k: v for k, v in record.items() if k != "epoch"}, step=state.step)
    new_best = None
    if state.best_metric is None or scores["f1"] > state.best_metric:
        state.best_metric, state.best_epoch = scores["f1"], state.epoch + 1
        new_best = state.trained()
        job.best_weights = new_best
    state.epoch += 1
    state.batch_in_epoch = 0
    state.epoch_loss = [0.0, 0.0]
    # The last epoch's end needs no resume point: the job finishes from here in seconds (a
    # SIGTERM only sets a flag nothing after this reads, and SageMaker gives 120 s), and a
    # completed run's checkpoints are removed. A short tuning trial spent most of its checkpoint
    # time on this one, which it deleted when it ended (docs/performance.md).
    if state.epoch < job.hp["epochs"] and state.step < job.total_steps:
        checkpoint(job, new_best)


def finish(job: Job) -> None:
    """The main process keeps the model; then every process leaves together (`leave`)."""
    job.accelerator.wait_for_everyone()
    final = best_model(job)
    if job.accelerator.is_main_process:
        keep_model(job, final)
    leave(job)


def best_model(job: Job) -> torch.nn.Module | None:
    """The best epoch's model, plain, on the main process (None on the others). Without
    Accelerate's mixed-precision wrapper: a program traced through it would carry its casts,
    computing in bf16 wherever it ran (inference chooses its own precision). With FSDP every
    process takes part: each loads its shards of the best weights, and the whole model is
    gathered to the main process, into the skeleton it kept (steps/fsdp.py)."""
    accelerator, state = job.accelerator, job.state
    # The optimizer's state (two values a trained weight) is not read past the last step: gone
    # before the model is gathered or exported.
    getattr(job.optimizer, "optimizer", job.optimizer).state.clear()
    if state.sharded:
        from steps import fsdp

        if job.best_weights is not None:
            state.load_trained(job.best_weights)
            job.best_weights = None
        return fsdp.gathered(job.model, job.frame)
    if not accelerator.is_main_process:
        return None
    final = accelerator.unwrap_model(job.model, keep_fp32_wrapper=False, keep_torch_compile=False)
    if job.best_weights is not None:
        load_trained_state(final, job.best_weights, job.finetuning.method)
    return final


LET_GLOO_FINISH_SECONDS = 0.5


def leave(job: Job) -> None:
    """Every process leaves the process group at once, at the end and on SIGTERM alike. A
    process that destroyed its group while another still worked (the main one exporting, or
    writing the interrupted marker) could make that one abort at exit (gloo: "terminate called
    without an active exception", SIGABRT; seen with two processes, in CI on SIGTERM too)."""
    job.accelerator.wait_for_everyone()
    tracked(job)
    job.accelerator.end_training()
    if job.accelerator.num_processes > 1:
        # The gloo worker thread destroys each finished collective after the caller's wait
        # returns, and needs the GIL to drop the tensors Python made; the process group is
        # destroyed when this function's caller lets go of the model (DDP holds the group),
        # with the GIL held, joining that thread. Back to back they deadlock (py-spy:
        # ~ProcessGroupGloo in std::thread::join, the worker in ~AsyncAllgatherWork waiting
        # for the GIL; a two-process job hung at its end so, 2026-11-27): a pause that holds
        # no GIL lets the worker finish first.
        time.sleep(LET_GLOO_FINISH_SECONDS)


def keep_model(job: Job, final: torch.nn.Module) -> None:
    """The best model, its exports and curves, and the Metadata section."""
    accelerator, state, hp, env = job.accelerator, job.state, job.hp, job.env
    # A tuning trial exports and draws nothing (hp exports = none): most trials' models are
    # deleted; the study's best is exported, and its curves drawn, once, after it
    # (steps/export.py).
    kept = hp["exports"] != "none"
    final = final.float().eval().cpu()
    final, merge = merged(final, job)
    formats = hp["exports"].split(",") if kept else []
    with timed("exports"):
        failed, checks = write_programs(
            final, job.keys, job.inputs, job.val_batches, env.model_dir, formats
        )
    with timed("save"):
        save_model(job, final)
    # The eager model's last use: each program is loaded back beside its logits only, so a
    # large model's weights are never held twice (a 1B model's 4 GB, docs/performance.md).
    # With several processes the model stays: its DDP wrapper holds the process group, which
    # every process then lets go of at the same point, at the end, as before. (A two-process
    # job hung at its end once in the suite, 2026-11-27, after its main process had let go
    # early; whether that was the cause is not established.)
    del final
    if accelerator.num_processes == 1:
        release_model(job)
    with timed("exports"):
        exports = check_programs(failed, checks, env.model_dir, formats)
    record_exports(env.model_dir, exports)
    for name, result in exports.items():
        accelerator.print(f"{name} export: {result}")
    # The last metric line is the best epoch's: a tuner reading the final value sees the model
    # it gets.
    best = next(h for h in state.history if h["epoch"] == state.best_epoch)
    accelerator.print("best " + metric_line(best))
    check_exports(exports)
    (env.model_dir / HISTORY).write_text(json.dumps(state.history, indent=2))
    write_card(env.model_dir, read_record(env.model_dir), state.history, {**hp, **job.settings})
    if kept:
        with timed("plots"):
            title = f"{hp['model_name']} ({env.job_name})"
            plot_curves(state.history, env.model_dir / CURVES, title)
    write_report(job, exports, merge)


# How far the merged model's logits may be from the adapters' (fp32, on the CPU), relative to
# the largest logit (at least 1): merging adds B @ A * alpha / r to each weight once, so only
# the order of float additions differs.
MERGE_TOLERANCE = 1e-4


def merged(final: torch.nn.Module, job: Job) -> tuple[torch.nn.Module, dict]:
    """With LoRA: the adapter written in PEFT's format, then merged into the weights, and the
    merged model checked against the adapters on the export check's rows (a merge that changed
    what the model computes is never kept). Without LoRA: the model, unchanged."""
    if job.finetuning.method != "lora":
        return final, {}
    rows = check_batches(job.val_batches)
    with torch.no_grad(), timed("merge"):
        before = [logits_of(final(**{k: b[k] for k in job.keys})) for b in rows]
        final = final_model(final, job.env.model_dir)
        after = [logits_of(final(**{k: b[k] for k in job.keys})) for b in rows]
    difference = max(float((a - b).abs().max()) for a, b in zip(after, before, strict=True))
    allowed = MERGE_TOLERANCE * max([1.0] + [float(b.abs().max()) for b in before])
    if difference > allowed:
        raise RuntimeError(
            f"the merged model's logits differ from the adapters' by {difference:.3g} "
            f"(at most {allowed:.3g}): no model of this job is kept"
        )
    return final, {"max_abs_difference": difference, "passed": True}


def release_model(job: Job) -> None:
    """Nothing of the job holds the model, its optimizer or its best weights any more (the
    main process, once its model is saved)."""
    job.accelerator.free_memory()
    job.model = job.state.model = job.optimizer = job.state.optimizer = None
    job.scheduler = job.state.scheduler = job.best_weights = None
    gc.collect()


def record_exports(model_dir, exports: dict) -> None:
    """Which exports passed their check, in the model's record (steps/model_files.py)."""
    write_record(model_dir, {**read_record(model_dir), "exports": exports})


def save_model(job: Job, final: torch.nn.Module) -> None:
    """The model as `from_pretrained` loads it, with the record of what it is (which exports
    passed is added once they are checked: `record_exports`)."""
    model_dir, state = job.env.model_dir, job.state
    record = {
        "model_name": job.hp["model_name"],
        "id2label": job.id2label,
        "ordered_input_keys": job.keys,
        "best_epoch": state.best_epoch,
        "best_validation_f1": state.best_metric,
        "max_length": job.max_length,  # as prepare recorded it (encoding.json)
        "exports": {},  # record_exports
        "wandb_run": wandb_run_of(job),
        **job.finetuning.record(),
    }
    save_final_model(final, model_dir, record)
    labels = {str(k): v for k, v in job.id2label.items()}
    (model_dir / "id2label.json").write_text(json.dumps(labels, indent=2))


def wandb_run_of(job: Job) -> dict | None:
    """This job's wandb run, kept in the model's record: inference logs the model, with its
    test metrics, as a `model` artifact of this run (steps/model_artifact.py)."""
    if not job.wandb_on:
        return None
    tracked(job)
    run = job.accelerator.get_tracker("wandb", unwrap=True)
    return {"id": run.id, "project": run.project}


def write_report(job: Job, exports: dict, merge: dict) -> None:
    """The job's section of the run's Metadata (step_metadata.json in output/data)."""
    accelerator, state, env = job.accelerator, job.state, job.env
    gpu = None
    if torch.cuda.is_available():
        gpu = {
            "devices": torch.cuda.device_count(),
            "max_memory_allocated_mb": torch.cuda.max_memory_allocated() / 2**20,
        }
    write_step_metadata(
        env.output_data_dir,
        {
            "model_name": job.hp["model_name"],
            "best_epoch": state.best_epoch,
            "best_validation_f1": state.best_metric,
            "history": state.history,
            "exports": exports,
            "resumed_from": job.resumed_from,
            "steps": state.step,
            "processes": accelerator.num_processes,
            "cpu_threads": torch.get_num_threads(),  # OMP_NUM_THREADS: a local trial's share
            "per_device_batch": job.per_device,
            "accumulation": job.accumulation,
            **job.settings,
            **job.finetuning.record(),
            "lora_merge": merge or None,
            # Each process's peak at its last epoch's end (end_epoch); the main one's read again
            # now, its saving and exports in.
            "peak_memory": [
                {"process": 0, **dict([peak_memory(accelerator)])},
                *[p for p in job.peak_memory if p["process"] != 0],
            ],
            "training_peak_memory": job.peak_memory,  # every process's, at the last epoch's end
            "checkpoint_bytes": job.checkpoint_bytes,
            "checkpoints_written": len(job.checkpoint_seconds),
            "checkpoint_seconds_total": round(sum(job.checkpoint_seconds), 3),
            "seconds": round(time.time() - job.started, 3),
            "train_loop_seconds": round(job.loop_seconds, 3),
            "seconds_outside_steps": {
                **{phase: round(t, 3) for phase, t in OUTSIDE_STEPS.items()},
                "checkpoints": round(sum(job.checkpoint_seconds), 3),
            },
            "gpu_usage": gpu,
            "sagemaker_hyperparameters": reserved_hyperparameters(env.hyperparameters),
        },
    )


def start_tracking(accelerator: Accelerator, hp: dict, env: TrainingEnv):
    """wandb's run, started beside the first epoch's steps: wandb.init starts its service
    process and waits for it (docs/performance.md), which nothing before the
    first metric line needs. `tracked` waits for it. Accelerate's init_trackers, which runs
    on the main process only, is called as in the foreground; an error it raises is raised by
    `tracked`. What wandb's console capture misses (the step lines printed before it is up)
    is in the job's own log."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="wandb-init")
    started = pool.submit(
        accelerator.init_trackers,
        hp["wandb_project"],
        config=hp,
        init_kwargs={"wandb": {"name": env.job_name, "dir": str(env.output_data_dir)}},
    )
    pool.shutdown(wait=False)
    return started


def tracked(job: Job) -> None:
    """The wandb run is up (its start's error raised here): before a log, and before the end."""
    if job.tracking is not None:
        with timed("tracking"):  # the part of wandb's start the steps did not hide
            job.tracking.result()


def training_function(hp: dict, env: TrainingEnv) -> None:
    job = set_up(hp, env)
    resume(job)
    if job.wandb_on:
        job.tracking = start_tracking(job.accelerator, hp, env)
    Interrupt.install()
    state = job.state
    while state.epoch < hp["epochs"]:
        if state.step >= job.total_steps and state.batch_in_epoch == 0:
            break  # MAX_STEPS reached, and that epoch already validated
        job.epoch_started = time.time()
        train_epoch(job)
        end_epoch(job)
    finish(job)


def main() -> None:
    OUTSIDE_STEPS["start"] = seconds_before_main()
    env = training_env()
    hp = parse_hyperparameters(env.hyperparameters)
    training_function(hp, env)


if __name__ == "__main__":
    run_step("train", main)
