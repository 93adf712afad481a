"""Train (training job): finetune one model with Hugging Face Accelerate.

`main()` reads the container contract and casts the hyperparameters once; `training_function()`
runs the stages: set up, resume, one epoch at a time (validate, keep the best, checkpoint),
finish. The blocks beside it: training_job.py, training_blocks.py, checkpointing.py,
best_model.py, training_report.py, tracking.py.

Inputs:  train, validation  save_to_disk splits, columns prefixed by model, `<model>__length`
         labels             id2label.json, inputs.json, encoding.json
Outputs: SM_MODEL_DIR       the best model by validation F1 (steps/model_files.py)
         SM_OUTPUT_DATA_DIR the Metadata section (`seconds_outside_steps` included), wandb run
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from steps import checkpointing as ckpt
from steps.batching import Batches, read_inputs, read_split
from steps.best_model import best_model, keep_model
from steps.export import logits_of
from steps.finetuning import Finetuning, check_blocks, name_classes, prepare, skeleton
from steps.hyperparameters import LORA_ONLY, SAME_ON_RESUME
from steps.metrics import metric_line
from steps.precision import Precision, low_precision_said, trained_weights_in_fp32
from steps.prepared_files import read_encoding
from steps.runtime import names
from steps.runtime.environment import TrainingEnv, training_env
from steps.runtime.step import own_logs, run_step
from steps.tracking import start_tracking, tracked
from steps.training_blocks import (
    Diverged,
    EpochLoss,
    Interrupt,
    accelerator_for,
    batch_split,
    check_output_width,
    evaluate,
    loader_for,
    optimizer_for,
)
from steps.training_job import Job, job_hyperparameters
from steps.training_report import (
    OUTSIDE_STEPS,
    peak_memory,
    seconds_before_main,
    timed,
    write_report,
)
from steps.user_code import call, input_keys, load_user_functions


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
    training and validation rows. Rows are used whole, as prepare cut them (encoding.json
    records the length; the model's smpipe.json records it again); every batch is padded to its
    own longest row, and training batches are grouped by length."""
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


def user_model(
    functions, hp: dict, id2label: dict[int, str], precision: Precision, say: bool
) -> tuple[torch.nn.Module, Finetuning]:
    """The user's load_model, checked to be a torch module, made ready for what of it trains
    (steps/finetuning.py), its trained weights in fp32 under mixed precision (`say`: the main
    process says so)."""
    model_name, label2id = hp["model_name"], {v: k for k, v in id2label.items()}
    model = call(functions, "load_model", model_name, id2label, label2id)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"{functions.module}.load_model({model_name!r}, ...) must return a "
            f"torch.nn.Module, got {type(model).__name__}"
        )
    name_classes(model, id2label, f"{functions.module}.load_model({model_name!r}, ...)", say)
    model, finetuning = prepare(model, hp, len(id2label), functions.module)
    low = trained_weights_in_fp32(model, precision)
    if low and say:
        said = low_precision_said(low, precision)
        print(f"{functions.module}.load_model({model_name!r}, ...) built {said}")
    return model, finetuning


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
        training={  # LoRA's own only where it trains: nothing else reads them
            name: hp[name]
            for name in SAME_ON_RESUME
            if hp["finetuning"] == "lora" or name not in LORA_ONLY
        },
    )


def applied(
    hp: dict,
    precision: Precision,
    optimizer_kind: str,
    loader: DataLoader,
    multiple_of: int,
    finetuning: Finetuning,
) -> dict:
    """What the job applied, for its first line, its report and the model's card: precision,
    optimizer, compile, how batches reach the model, what of it trains, how it is shared."""
    return {
        "mixed_precision": precision.applied,
        "precision_reason": precision.reason,
        "optimizer": f"AdamW ({optimizer_kind})",
        "compile": hp["compile"],
        "group_by_length": hp["group_by_length"],
        "pad_to_multiple_of": multiple_of,
        "dataloader_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "finetuning": finetuning.method,
        "gradient_checkpointing": finetuning.gradient_checkpointing,
        "distributed_strategy": hp["distributed_strategy"],
    }


def set_up(hp: dict, env: TrainingEnv) -> Job:
    """Everything training needs, built in order, as Accelerate's `training_function` builds
    it: the data, the user's model, the optimizer, Accelerate's wrapping."""
    model_name = hp["model_name"]
    functions = load_user_functions(os.environ[names.USER_FUNCTIONS_VARIABLE])
    keys = input_keys(functions, model_name)
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
        model, finetuning = user_model(
            functions, hp, id2label, precision, accelerator.is_main_process
        )

    sampler, train_loader = loader_for(train, hp, per_device, accumulation, accelerator, on_gpu)
    total_steps = sampler.steps_per_epoch * hp["epochs"]
    total_steps = min(total_steps, hp["max_steps"] or total_steps)
    # The train loader is not prepared: the resumable sampler shards it itself, per rank.
    model, optimizer, scheduler, optimizer_kind, frame = shared(
        model, accelerator, precision.applied, hp, total_steps, functions.module
    )
    check_output_width(accelerator, model, val, keys, len(id2label), functions.module)
    if hp["compile"]:
        model = torch.compile(model, dynamic=True, options=compile_options())
    state = training_state(accelerator, model, optimizer, scheduler, sampler, hp, env)
    settings = applied(hp, precision, optimizer_kind, train_loader, multiple_of, finetuning)
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


def compile_options() -> dict:
    """Inductor's mix-order reduction (the layer-norm backward fused into one kernel, on GPUs)
    off. On an H200 (torch 2.11, BERT-base at 512 tokens, 256 rows a step, 2026-11-28) its two
    kernels (fused wherever allowed: its non-strict mode) took 23% of the compiled step's device
    time; without it the step's kernels took 115 ms instead of 125, and MFU rose from 29.5% to
    34.7% (docs/performance.md). Off, it
    also checks no sizes on the batch's shape (torch/_inductor/scheduler.py,
    MixOrderReduction.can_fuse: rows x columns >= 5 * 2**20, rows >= 4096), each of which was a
    guard that compiled the model anew as the padded width crossed it (the same H200, 128
    rows). A torch without the option keeps its defaults."""
    from torch._inductor import config

    option = "mix_order_reduction"
    return {f"triton.{option}": False} if hasattr(config.triton, option) else {}


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
    """From the newest checkpoint in SM_CHECKPOINT_DIR that loads; every rank from the same
    one, or none."""
    accelerator, state = job.accelerator, job.state
    started = time.time()
    resumed = None
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
        removed = ckpt.settle_after_resume(job.env.checkpoint_dir, resumed)
        if removed:
            accelerator.print(f"removed {removed}: newer than the checkpoint resumed from")
    accelerator.wait_for_everyone()


def checkpoint(job: Job, new_best: dict | None = None) -> None:
    job.checkpoint_seconds.append(
        ckpt.save_checkpoint(
            job.accelerator, job.env.checkpoint_dir, job.state, new_best, job.hp["keep_checkpoints"]
        )
    )
    if job.accelerator.is_main_process:
        job.checkpoint_bytes = ckpt.size_of(ckpt.current_checkpoint(job.env.checkpoint_dir))


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
    """SIGTERM (a spot reclaim, a stop): a checkpoint after this step, the interrupted marker,
    and every process leaves with EXIT_INTERRUPTED. One process acts after the step the signal
    arrives in; several at most about 10 s of steps later (training_blocks.StopCheck)."""
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
    """The main process keeps the best model (steps/best_model.py: safetensors, the programs
    the `exports` hyperparameter names, curves, history; a tuning trial's only the weights and
    history, its study's best exported after it by steps/export.py) and writes the job's
    report; then every process leaves together (`leave`)."""
    job.accelerator.wait_for_everyone()
    final = best_model(job)
    if job.accelerator.is_main_process:
        exports, merge = keep_model(job, final)
        write_report(job, exports, merge)
    leave(job)


LET_GLOO_FINISH_SECONDS = 0.5


def leave(job: Job) -> None:
    """Every process leaves the process group at once, at the end and on SIGTERM alike. A
    process that destroyed its group while another still worked (the main one exporting, or
    writing the interrupted marker) could make that one abort at exit (gloo: "terminate called
    without an active exception", SIGABRT; seen with two processes, in CI on SIGTERM too)."""
    job.accelerator.wait_for_everyone()
    tracked(job)
    job.accelerator.end_training()
    if job.accelerator.is_main_process:
        own_logs(job.env.output_data_dir)
    if job.accelerator.num_processes > 1:
        # The gloo worker thread destroys each finished collective after the caller's wait
        # returns, and needs the GIL to drop the tensors Python made; the process group is
        # destroyed when this function's caller lets go of the model (DDP holds the group),
        # with the GIL held, joining that thread. Back to back they deadlock (py-spy:
        # ~ProcessGroupGloo in std::thread::join, the worker in ~AsyncAllgatherWork waiting
        # for the GIL; a two-process job hung at its end so, 2026-11-27): a pause that holds
        # no GIL lets the worker finish first.
        time.sleep(LET_GLOO_FINISH_SECONDS)


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
    training_function(job_hyperparameters(env), env)


if __name__ == "__main__":
    run_step("train", main)
