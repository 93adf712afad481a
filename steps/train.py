"""Train (training job): finetune one model with Hugging Face Accelerate.

Reads top to bottom, like Accelerate's examples: `main()` reads the container contract and
casts the hyperparameters once, `training_function()` builds everything, prepares it with the
Accelerator, and runs the loop. The job resumes from the newest good checkpoint in
SM_CHECKPOINT_DIR, and on SIGTERM (a spot reclaim) it finishes the current step, writes a
checkpoint and exits with EXIT_INTERRUPTED.

Channels: train, validation (datasets save_to_disk, every model's columns prefixed with its
name), labels (id2label.json). Output: SM_MODEL_DIR gets the best model by validation F1
(safetensors, TorchScript, curves, history); SM_OUTPUT_DATA_DIR gets the Metadata section and
the wandb run.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import datasets
import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin, set_seed
from sklearn.metrics import accuracy_score, f1_score
from torch.utils.data import DataLoader

from steps import checkpointing as ckpt
from steps.contract import (
    EXIT_INTERRUPTED,
    TrainingEnv,
    run_step,
    training_env,
    write_step_metadata,
)
from steps.hyperparameters import parse_hyperparameters
from steps.user_code import call, load_user_functions

METRIC_LINE = "epoch={epoch} step={step} train_loss={train_loss:.6f} validation:loss={val_loss:.6f} validation:accuracy={accuracy:.6f} validation:f1={f1:.6f}"


class Interrupt:
    """Set by SIGTERM; acted on at the next optimizer-step boundary, never mid-step."""

    requested = False

    @classmethod
    def install(cls) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(cls, "requested", True))


def logits_of(output) -> torch.Tensor:
    """Any nn.Module works: a tensor of logits, an output with `.logits`, or a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)):
        return output[0]
    raise TypeError(
        f"the model returned {type(output).__name__}; expected logits or an output with .logits"
    )


class LogitsOnly(torch.nn.Module):
    """Positional inputs in the user's order -> logits: what TorchScript traces and inference calls."""

    def __init__(self, model: torch.nn.Module, keys: list[str]):
        super().__init__()
        self.model, self.keys = model, keys

    def forward(self, *inputs):
        return logits_of(self.model(**dict(zip(self.keys, inputs, strict=True))))


def model_columns(dataset: datasets.Dataset, model_name: str, keys: list[str]) -> datasets.Dataset:
    """Select this model's columns from a comparison dataset and drop the prefix."""
    prefix = f"{model_name}_"
    missing = [k for k in keys if prefix + k not in dataset.column_names]
    if missing:
        raise ValueError(
            f"the prepared data has no columns {[prefix + k for k in missing]} (has {dataset.column_names})"
        )
    dataset = dataset.select_columns([prefix + k for k in keys] + ["label_id"])
    dataset = dataset.rename_columns({prefix + k: k for k in keys})
    return dataset.with_format("torch")


def evaluate(model, loader, accelerator, keys) -> dict:
    model.eval()
    losses, predictions, references = [], [], []
    with torch.no_grad():
        for batch in loader:
            logits = logits_of(model(**{k: batch[k] for k in keys}))
            loss = torch.nn.functional.cross_entropy(logits, batch["label_id"], reduction="none")
            # gather_for_metrics drops the samples the last batch was padded with across processes.
            loss, preds, refs = accelerator.gather_for_metrics(
                (loss, logits.argmax(-1), batch["label_id"])
            )
            losses.append(loss.cpu())
            predictions.append(preds.cpu())
            references.append(refs.cpu())
    model.train()
    predictions, references = torch.cat(predictions).numpy(), torch.cat(references).numpy()
    return {
        "val_loss": torch.cat(losses).mean().item(),
        "accuracy": accuracy_score(references, predictions),
        "f1": f1_score(references, predictions, average="macro"),
    }


def plot_curves(history: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epochs = [h["epoch"] for h in history]
    fig, (ax_loss, ax_score) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(epochs, [h["train_loss"] for h in history], marker="o", label="train")
    ax_loss.plot(epochs, [h["val_loss"] for h in history], marker="o", label="validation")
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy", title="loss")
    ax_score.plot(epochs, [h["accuracy"] for h in history], marker="o", label="accuracy")
    ax_score.plot(epochs, [h["f1"] for h in history], marker="o", label="macro F1")
    ax_score.set(xlabel="epoch", ylim=(0, 1.02), title="validation")
    for ax in (ax_loss, ax_score):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def export_torchscript(model, keys, sample, check_batch, path: Path) -> dict:
    """Trace with a real training sample; check against the eager model on validation rows."""
    wrapper = LogitsOnly(model, keys).eval()
    # Tracing warns about every Python branch it freezes; the check below is what tells.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(
            wrapper, tuple(sample[k] for k in keys), strict=False, check_trace=False
        )
        traced.save(str(path))
        reloaded = torch.jit.load(str(path))
        eager = wrapper(*(check_batch[k] for k in keys))
        scripted = reloaded(*(check_batch[k] for k in keys))
    max_diff = (eager - scripted).abs().max().item()
    return {
        "rows_checked": int(eager.shape[0]),
        "max_abs_diff": max_diff,
        "same_predictions": bool((eager.argmax(-1) == scripted.argmax(-1)).all()),
        "passed": bool(max_diff < 1e-4),
    }


def save_final_model(model, model_dir: Path, info: dict) -> None:
    """The output is the same kind of thing as the input: loadable weights, no optimizer state."""
    from safetensors.torch import save_model

    if hasattr(model, "save_pretrained"):
        model.save_pretrained(
            model_dir
        )  # config.json + model.safetensors: from_pretrained loads it
    else:
        save_model(model, str(model_dir / "model.safetensors"))  # load with the user's load_model
    (model_dir / "smpipe.json").write_text(json.dumps(info, indent=2, default=str))


def training_function(hp: dict, env: TrainingEnv) -> None:
    start = time.time()
    model_name = hp["model_name"]
    functions = load_user_functions(os.environ["SMPIPE_USER_FUNCTIONS"])
    keys = list(call(functions, "ordered_input_keys", model_name))

    # How the wanted batch splits into devices and accumulation: the per-device batch never
    # exceeds what one device can hold, and accumulation makes up the rest.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    accumulation = math.ceil(hp["batch_size"] / (world * hp["max_per_device_batch_size"]))
    per_device = math.ceil(hp["batch_size"] / (world * accumulation))

    wandb_on = hp["wandb_mode"] != "disabled"
    if wandb_on:
        os.environ.setdefault(
            "WANDB_MODE", "online" if os.environ.get("WANDB_API_KEY") else "offline"
        )
        os.environ.setdefault("WANDB_DIR", str(env.output_data_dir))
        os.environ.setdefault("WANDB_SILENT", "true")
    accelerator = Accelerator(
        cpu=env.num_gpus == 0,
        log_with="wandb" if wandb_on else None,
        # Accumulation groups line up with epochs by construction (see ResumableBatchSampler),
        # so syncing on the step count alone is exact, and resumable.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=accumulation, sync_with_dataloader=False
        ),
    )
    others = [m for m in hp["model_names"].split(",") if m and m != model_name]
    accelerator.print(
        f"model={model_name} job_kind={hp['job_kind']}"
        f"{f' (comparison with {len(others)} other model(s))' if others else ''} processes={accelerator.num_processes} "
        f"per_device_batch={per_device} accumulation={accumulation} "
        f"effective_batch={per_device * accelerator.num_processes * accumulation} (wanted {hp['batch_size']})"
    )
    set_seed(hp["seed"])

    id2label = {
        int(k): v
        for k, v in json.loads((env.channels["labels"] / "id2label.json").read_text()).items()
    }
    label2id = {v: k for k, v in id2label.items()}
    train_data = model_columns(
        datasets.load_from_disk(str(env.channels["train"])), model_name, keys
    )
    val_data = model_columns(
        datasets.load_from_disk(str(env.channels["validation"])), model_name, keys
    )

    # We build the model after seeding so that the seed also controls new weights' initialization.
    model = call(functions, "load_model", model_name, id2label, label2id)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"{functions.module}.load_model must return a torch.nn.Module, got {type(model).__name__}"
        )

    sampler = ckpt.ResumableBatchSampler(
        len(train_data),
        per_device,
        accumulation,
        accelerator.num_processes,
        accelerator.process_index,
        hp["seed"],
    )
    # Loaders get generators of their own: creating an iterator must not draw from the global
    # RNG, or a job resumed mid-epoch would see different dropout than the one it replaces.
    train_loader = DataLoader(train_data, batch_sampler=sampler, generator=torch.Generator())
    val_loader = DataLoader(val_data, batch_size=per_device, generator=torch.Generator())
    total_steps = sampler.steps_per_epoch * hp["epochs"]
    if hp["max_steps"]:
        total_steps = min(total_steps, hp["max_steps"])
    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight", "norm.weight")
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)],
            "weight_decay": hp["weight_decay"],
        },
        {
            "params": [p for n, p in model.named_parameters() if n.endswith(no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(groups, lr=hp["learning_rate"])
    warmup = int(hp["warmup_ratio"] * total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            (s + 1) / max(1, warmup)
            if s < warmup
            else max(0.0, (total_steps - s) / max(1, total_steps - warmup))
        ),
    )
    # The train loader is not prepared: the resumable sampler shards it itself, per rank.
    model, optimizer, val_loader = accelerator.prepare(model, optimizer, val_loader)

    # The gradient scaler exists only under fp16 mixed precision (Accelerate owns it); None on CPU.
    state = ckpt.State(model=accelerator.unwrap_model(model), optimizer=optimizer, scheduler=scheduler,
                       sampler=sampler, seed=hp["seed"], run_name=env.job_name, scaler=accelerator.scaler)  # fmt: skip
    best_weights, resumed_from = None, None
    checkpoint_dir = env.checkpoint_dir
    resume_start = time.time()
    for candidate in ckpt.resume_candidates(checkpoint_dir):
        try:
            best_weights = ckpt.load_checkpoint(candidate, state, accelerator.process_index)
            resumed_from = {
                "checkpoint": str(candidate),
                "step": state.step,
                "epoch": state.epoch,
                "batch_in_epoch": state.batch_in_epoch,
                "seconds": round(time.time() - resume_start, 3),
            }
            accelerator.print(
                f"resumed from {candidate} at step {state.step} (epoch {state.epoch}, batch {state.batch_in_epoch})"
            )
            break
        except Exception as e:  # a truncated or foreign checkpoint: say which, try the one before
            accelerator.print(
                f"checkpoint {candidate} could not be loaded ({type(e).__name__}: {e}); trying the previous one"
            )
    # Each rank must resume from the same checkpoint, or none.
    if accelerator.num_processes > 1:
        steps = accelerator.gather(torch.tensor([state.step]))
        if len(set(steps.tolist())) != 1:
            raise RuntimeError(
                f"processes resumed from different checkpoints: steps {steps.tolist()}"
            )

    if wandb_on:
        accelerator.init_trackers(
            hp["wandb_project"],
            config=hp,
            init_kwargs={"wandb": {"name": env.job_name, "dir": str(env.output_data_dir)}},
        )
    Interrupt.install()

    def save_checkpoint(new_best: dict | None) -> None:
        """All processes take part: each node's first process makes the directory, every
        process writes its own RNG and loss, the main process writes the State and makes it
        current. On other nodes (multi-node SageMaker) the rank files are renamed into place
        too; SageMaker syncs every node's checkpoint folder to the same S3 prefix."""
        started = time.time()
        tmp = checkpoint_dir / f"ckpt-{state.step:08d}.tmp"
        if accelerator.is_local_main_process:
            ckpt.begin_checkpoint(checkpoint_dir, state.step)
        accelerator.wait_for_everyone()
        ckpt.write_rank_state(tmp, accelerator.process_index, state)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            ckpt.finish_checkpoint(checkpoint_dir, tmp, state, new_best, hp["keep_checkpoints"])
        elif accelerator.is_local_main_process:
            ckpt.finish_rank_files(checkpoint_dir, tmp, hp["keep_checkpoints"])
        accelerator.wait_for_everyone()
        checkpoint_seconds.append(time.time() - started)

    def interrupted() -> bool:
        flag = torch.tensor([1 if Interrupt.requested else 0])
        if accelerator.num_processes > 1:
            flag = accelerator.reduce(flag, reduction="sum")
        return bool(flag.item())

    checkpoint_seconds: list[float] = []
    model.train()
    log_every = max(1, sampler.steps_per_epoch // 10)  # about ten progress lines an epoch
    while state.epoch < hp["epochs"]:
        if state.step >= total_steps and state.batch_in_epoch == 0:
            break  # MAX_STEPS reached, and that epoch already validated
        epoch_start = time.time()
        sampler.set_epoch(state.epoch, state.batch_in_epoch)
        accelerator.step = state.batch_in_epoch % accumulation
        for batch in train_loader:
            if state.step >= total_steps:
                break
            with accelerator.accumulate(model):
                logits = logits_of(model(**{k: batch[k] for k in keys}))
                loss = torch.nn.functional.cross_entropy(logits, batch["label_id"])
                accelerator.backward(loss)
                optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad()
            state.epoch_loss[0] += loss.item()
            state.epoch_loss[1] += 1
            state.batch_in_epoch += 1
            sampler.start = state.batch_in_epoch
            if not accelerator.sync_gradients:
                continue
            state.step += 1
            if state.step % log_every == 0:
                accelerator.print(
                    f"step={state.step}/{total_steps} epoch={state.epoch + 1} loss={loss.item():.4f}"
                )
            if interrupted():
                save_checkpoint(None)
                accelerator.print(
                    f"SIGTERM: checkpoint written at step {state.step}; exiting to be resumed"
                )
                if accelerator.is_main_process:
                    Path(env.failure_file).parent.joinpath("interrupted").write_text(
                        str(state.step)
                    )
                accelerator.end_training()
                sys.exit(EXIT_INTERRUPTED)
            if state.batch_in_epoch == sampler.batches_per_epoch or state.step >= total_steps:
                break  # the epoch-end checkpoint follows validation
            if hp["checkpoint_every_steps"] and state.step % hp["checkpoint_every_steps"] == 0:
                save_checkpoint(None)

        # Epoch end (or max_steps): validate, keep the best by F1, checkpoint.
        scores = evaluate(model, val_loader, accelerator, keys)
        losses = (
            accelerator.gather(torch.tensor(state.epoch_loss).reshape(1, 2)).reshape(-1, 2).sum(0)
        )
        train_loss = (losses[0] / losses[1].clamp(min=1)).item()
        record = {"epoch": state.epoch + 1, "step": state.step, "train_loss": train_loss, **scores,
                  "learning_rate": scheduler.get_last_lr()[0], "seconds": round(time.time() - epoch_start, 3)}  # fmt: skip
        state.history.append(record)
        accelerator.print(METRIC_LINE.format(**record))
        accelerator.log({k: v for k, v in record.items() if k != "epoch"}, step=state.step)
        new_best = None
        if state.best_metric is None or scores["f1"] > state.best_metric:
            state.best_metric, state.best_epoch = scores["f1"], state.epoch + 1
            new_best = {
                k: v.detach().cpu().clone()
                for k, v in accelerator.unwrap_model(model).state_dict().items()
            }
            best_weights = new_best
        state.epoch += 1
        state.batch_in_epoch = 0
        state.epoch_loss = [0.0, 0.0]
        save_checkpoint(new_best)

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        model_dir, out_dir = env.model_dir, env.output_data_dir
        final = accelerator.unwrap_model(model)
        if best_weights is not None:
            final.load_state_dict(best_weights)
        final.eval()
        save_final_model(final, model_dir, {
            "model_name": model_name, "id2label": id2label, "ordered_input_keys": keys,
            "best_epoch": state.best_epoch, "best_validation_f1": state.best_metric,
            "max_sequence_length": hp["max_sequence_length"],
        })  # fmt: skip
        (model_dir / "id2label.json").write_text(
            json.dumps({str(k): v for k, v in id2label.items()}, indent=2)
        )
        sample = train_data[:2]
        check = val_data[: min(len(val_data), 32)]
        trace_check = export_torchscript(
            final, keys, sample, check, model_dir / "model.torchscript.pt"
        )
        accelerator.print(f"TorchScript export: {trace_check}")
        # The last metric line is the best epoch's: a tuner reading the final value sees the model it gets.
        best = next(h for h in state.history if h["epoch"] == state.best_epoch)
        accelerator.print("best " + METRIC_LINE.format(**best))
        if not trace_check["same_predictions"]:
            raise RuntimeError(f"the traced model disagrees with the eager model: {trace_check}")
        (model_dir / "history.json").write_text(json.dumps(state.history, indent=2))
        plot_curves(state.history, model_dir / "curves.png", f"{model_name} ({env.job_name})")
        gpu = None
        if torch.cuda.is_available():
            gpu = {
                "devices": torch.cuda.device_count(),
                "max_memory_allocated_mb": torch.cuda.max_memory_allocated() / 2**20,
            }
        write_step_metadata(out_dir, {
            "model_name": model_name, "best_epoch": state.best_epoch, "best_validation_f1": state.best_metric,
            "history": state.history, "trace_check": trace_check, "resumed_from": resumed_from,
            "steps": state.step, "processes": accelerator.num_processes, "per_device_batch": per_device,
            "accumulation": accumulation, "checkpoints_written": len(checkpoint_seconds),
            "checkpoint_seconds_total": round(sum(checkpoint_seconds), 3), "seconds": round(time.time() - start, 3),
            "gpu_usage": gpu,
        })  # fmt: skip
    accelerator.end_training()


def main() -> None:
    env = training_env()
    hp = parse_hyperparameters(env.hyperparameters)
    training_function(hp, env)


if __name__ == "__main__":
    run_step("train", main)
