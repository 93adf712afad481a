"""The building blocks steps/train.py builds a training job from, with Hugging Face Accelerate:
the optimizer and its schedule, the Accelerator, how the batch splits across devices, the
resumable loader, the epoch's loss on the device, validation, the SIGTERM flag and when the
processes ask each other about it, and the saved model. Each is a plain function (or a small
object) of what it needs; steps/train.py reads top to bottom and calls them in order.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin, gather_object
from torch.utils.data import DataLoader

from steps.batching import Batches, by_length
from steps.export import logits_of
from steps.model_files import write_record
from steps.precision import Precision, resolve
from steps.runtime.environment import TrainingEnv
from steps.sampler import ResumableBatchSampler


class Diverged(RuntimeError):
    """The loss is no longer a finite number: nothing after this step is a model."""


class Interrupt:
    """Set by SIGTERM; acted on at an optimizer-step boundary, never mid-step (`StopCheck`)."""

    requested = False

    @classmethod
    def install(cls) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(cls, "requested", True))


# SageMaker sends SIGKILL 120 s after SIGTERM ("SageMaker sends the algorithm the SIGTERM
# signal, which delays job termination for 120 seconds": API_StopTrainingJob). Processes that
# ask each other about SIGTERM this often leave the rest of that time to the checkpoint.
STOP_CHECK_SECONDS = 10.0


class StopCheck:
    """Whether any process got SIGTERM, asked after an optimizer step every process agrees on.

    One process reads its own flag after every step: a Python bool, nothing waits. Several
    all-reduce their flags, and reading the result waits for the device to finish every step
    queued before it; so they ask after a logging step, after the epoch's last step, and
    otherwise once about STOP_CHECK_SECONDS of steps have passed since they last asked. That
    pace is the slowest process's seconds a step, all-reduced with the flags, so every process
    computes the same next step to ask at. They first ask after the job's first step, to
    measure it. So SIGTERM is acted on after the step it arrives in with one process, and with
    several at most max(1 step, about STOP_CHECK_SECONDS of steps) later."""

    def __init__(self) -> None:
        self.next = 1  # no pace yet: after the first step, whatever step the job resumed at
        self.since = (time.monotonic(), 0)

    def restart(self, step: int) -> None:
        """An epoch begins after `step`: the time since the last ask held validation."""
        self.since = (time.monotonic(), step)

    def stop(self, accelerator: Accelerator, step: int, agreed: bool) -> bool:
        """Whether to checkpoint and exit after `step`; `agreed`: a step after which every
        process asks anyway (a logging step, the epoch's last)."""
        if accelerator.num_processes == 1:
            return Interrupt.requested
        if not (agreed or step >= self.next):
            return False
        then, at = self.since
        pace = (time.monotonic() - then) / max(1, step - at)
        asked = torch.tensor(
            [float(Interrupt.requested), pace], dtype=torch.float64, device=accelerator.device
        )
        torch.distributed.all_reduce(asked, op=torch.distributed.ReduceOp.MAX)
        requested, pace = asked.tolist()
        self.since = (time.monotonic(), step)
        self.next = step + max(1, int(STOP_CHECK_SECONDS / max(pace, 1e-6)))
        return requested > 0


class EpochLoss:
    """This process's loss sum and micro-batch count for the epoch, on the device, and the sums
    as each optimizer step left them. Adding to them never waits for the device; reading them
    (`read`) does, so the loop reads them only after a logging step, before a checkpoint and at
    the epoch's end."""

    def __init__(self, epoch_loss: list[float], device: torch.device) -> None:
        self.sums = torch.tensor(epoch_loss, dtype=torch.float64, device=device)
        self.last_read = list(epoch_loss)
        self.steps: list[tuple[int, torch.Tensor]] = []  # (optimizer step, the sums after it)
        self.added = False  # micro-batches since the last read

    def add(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss."""
        self.sums[0] += loss.detach()
        self.sums[1] += 1
        self.added = True

    def step_taken(self, step: int) -> None:
        self.steps.append((step, self.sums.clone()))

    def read(self) -> tuple[list[float], list[tuple[int, float, float]]]:
        """The epoch's sums, and for each optimizer step since the last read: its number, the
        epoch's loss sum after it and the step's mean loss over this process's micro-batches.
        One copy to the host, none if nothing was added since."""
        if not self.added:
            return list(self.last_read), []
        values = torch.cat([self.sums, *(sums for _, sums in self.steps)]).tolist()
        steps, (total, count) = [], self.last_read
        for i, (step, _) in enumerate(self.steps, start=1):
            after, batches = values[2 * i : 2 * i + 2]
            steps.append((step, after, (after - total) / max(1.0, batches - count)))
            total, count = after, batches
        self.last_read, self.steps, self.added = values[:2], [], False
        return list(self.last_read), steps


def adamw(groups: list[dict], lr: float) -> tuple[torch.optim.Optimizer, str]:
    """The fused AdamW where this build has it (CUDA, and CPU in recent PyTorch): one kernel
    for every parameter instead of a loop of small ones."""
    try:
        return torch.optim.AdamW(groups, lr=lr, fused=True), "fused"
    except (RuntimeError, ValueError, TypeError):
        return torch.optim.AdamW(groups, lr=lr), "foreach"


def optimizer_for(model: torch.nn.Module, hp: dict, total_steps: int):
    """AdamW without weight decay on biases and norms, linear warmup then linear decay (the
    Trainer's defaults): the optimizer, its scheduler, and which AdamW implementation runs."""
    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight", "norm.weight")
    # What trains (all of it, or LoRA's adapters and the head): a frozen weight gets no state.
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {
            "params": [p for n, p in named if not n.endswith(no_decay)],
            "weight_decay": hp["weight_decay"],
        },
        {"params": [p for n, p in named if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer, kind = adamw(groups, hp["learning_rate"])
    warmup = int(hp["warmup_ratio"] * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor), kind


def cuda_unusable(gpus: int) -> str:
    """Why torch cannot use the host's GPUs, said with what to do. The NVIDIA driver on
    SageMaker's training hosts is not documented (its inference guide lists 470 as the default
    on g4dn, g5 and p4d hosts); a CUDA 12 build of torch (the real base's is 12.8) needs a
    driver of 525 or newer (CUDA's minor-version compatibility), or the CUDA forward-
    compatibility package, which AWS's own PyTorch containers set up at start
    (aws/deep-learning-containers, start_cuda_compat.sh) and the pytorch/pytorch runtime base
    does not carry."""
    try:
        torch.cuda.init()
        reason = "torch.cuda.is_available() is False"
    except Exception as e:  # noqa: BLE001 - its words are the reason
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (
        f"this host has {gpus} GPU(s), and torch {torch.__version__} (CUDA "
        f"{torch.version.cuda or 'none'}) cannot use them: {reason}. Where the NVIDIA driver is "
        "older than the image's CUDA needs, build the image on a base whose CUDA release it "
        "runs, add the CUDA forward-compatibility package (cuda-compat) to it, or build on "
        "AWS's PyTorch training container, which sets that package up itself"
    )


def accelerator_for(
    hp: dict, env: TrainingEnv, accumulation: int
) -> tuple[Accelerator, Precision, bool]:
    """Accelerate for this job: the device, mixed precision, wandb, and gradient accumulation
    by step count. Returns it, the precision applied, and whether wandb logs."""
    on_gpu = env.num_gpus > 0
    wandb_on = hp["wandb_mode"] != "disabled"
    if wandb_on:
        # The settings' mode wins over the environment: a key that happens to be set must not
        # send an offline run online (in an isolated network that hangs, then fails the job).
        os.environ["WANDB_MODE"] = hp["wandb_mode"]
        os.environ.setdefault("WANDB_DIR", str(env.output_data_dir))
        os.environ.setdefault("WANDB_SILENT", "true")
    if on_gpu and not torch.cuda.is_available():
        raise RuntimeError(cuda_unusable(env.num_gpus))
    precision = resolve(hp["mixed_precision"], env.num_gpus)
    if on_gpu:  # TF32 matmuls on Ampere and later (ignored before)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    accelerator = Accelerator(
        cpu=not on_gpu,
        mixed_precision=precision.applied,  # on a CPU, bf16 is torch.autocast("cpu", bfloat16)
        log_with="wandb" if wandb_on else None,
        # Accumulation groups line up with epochs by construction (see ResumableBatchSampler),
        # so syncing on the step count alone is exact, and resumable.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=accumulation, sync_with_dataloader=False
        ),
    )
    return accelerator, precision, wandb_on


def batch_split(hp: dict) -> tuple[int, int]:
    """How the wanted batch splits into devices and accumulation: the per-device batch never
    exceeds what one device can hold, and accumulation makes up the rest."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    accumulation = math.ceil(hp["batch_size"] / (world * hp["max_per_device_batch_size"]))
    return math.ceil(hp["batch_size"] / (world * accumulation)), accumulation


def loader_for(
    train: Batches,
    hp: dict,
    per_device: int,
    accumulation: int,
    accelerator: Accelerator,
    on_gpu: bool,
) -> tuple[ResumableBatchSampler, DataLoader]:
    """This rank's training batches: the resumable sampler (grouped by length, sharded per
    rank) and the loader that pads each batch."""
    sampler = ResumableBatchSampler(
        len(train),
        per_device,
        accumulation,
        accelerator.num_processes,
        accelerator.process_index,
        hp["seed"],
        lengths=train.lengths if hp["group_by_length"] else None,
    )
    # The loader gets a generator of its own: creating an iterator must not draw from the
    # global RNG, or a job resumed mid-epoch would see different dropout than the one it replaces.
    workers = hp["dataloader_num_workers"]
    workers = (2 if on_gpu else 0) if workers == "auto" else int(workers)
    train_loader = DataLoader(
        range(len(train)),
        batch_sampler=sampler,
        collate_fn=train,
        generator=torch.Generator(),
        pin_memory=on_gpu,  # page-locked host memory only where a copy to a GPU follows
        # SIGTERM is this process's cue to checkpoint; the entrypoint sends it here and not to
        # the workers. A worker leaves on a SIGTERM from this process (when it exits) and dies
        # of one from anywhere else, failing the next batch (torch's worker signal handler);
        # ignoring it would hang the exit, whose cleanup terminates the workers with it.
        num_workers=workers,
    )
    return sampler, train_loader


def check_output_width(accelerator, model, batches, keys, labels: int, module: str) -> None:
    """One logit per label, checked on two rows before the first step: a model of 10 outputs
    for 5 labels would train and save, and fail only in inference. In eval mode, so no dropout
    draws from the seeded RNG and training is what it would have been."""
    plain = accelerator.unwrap_model(model)
    rows = batches(list(range(min(2, len(batches)))))
    was_training = plain.training
    plain.eval()
    with torch.no_grad():
        width = logits_of(plain(**{k: rows[k].to(accelerator.device) for k in keys})).shape[-1]
    plain.train(was_training)
    if width != labels:
        raise ValueError(
            f"{module}.load_model returned a model with {width} outputs for {labels} labels: "
            "give it one output per label (num_labels=len(id2label))"
        )


def evaluate(
    model,
    batches: Batches,
    keys: list[str],
    accelerator: Accelerator,
    batch_size: int,
    sharded: bool = False,
) -> dict:
    """Validation rows split across processes, each process's rows sorted by length and padded
    per batch; per-row results gathered on every process. The unwrapped model runs, so
    processes with one batch more or less never wait on each other; a sharded one (FSDP)
    gathers its weights with the others at every forward, so there each process makes as many
    forwards as the one with the most rows, the extra ones on a spare row, their results
    dropped."""
    model = accelerator.unwrap_model(model, keep_torch_compile=False).eval()
    world = accelerator.num_processes
    share = [np.arange(len(batches))[rank::world] for rank in range(world)]
    rows = share[accelerator.process_index]
    plan = [rows[chunk].tolist() for chunk in by_length(batches.lengths[rows], batch_size)]
    mine = len(plan)
    if sharded:
        plan += [[0]] * (max(len(by_length(batches.lengths[r], batch_size)) for r in share) - mine)
    losses, predictions, references = [], [], []
    with torch.no_grad(), accelerator.autocast():
        for i, chunk in enumerate(plan):
            batch = batches(chunk)
            batch = {k: v.to(accelerator.device, non_blocking=True) for k, v in batch.items()}
            logits = logits_of(model(**{k: batch[k] for k in keys})).float()
            if i >= mine:
                continue
            losses.append(
                torch.nn.functional.cross_entropy(logits, batch["label_id"], reduction="none").cpu()
            )
            predictions.append(logits.argmax(-1).cpu())
            references.append(batch["label_id"].cpu())
    model.train()
    mine = [torch.cat(x).numpy() if x else np.zeros(0) for x in (losses, predictions, references)]
    parts = gather_object([mine]) if accelerator.num_processes > 1 else [mine]
    loss, predicted, reference = (np.concatenate([p[i] for p in parts]) for i in range(3))
    return {"val_loss": float(loss.mean()), **accuracy_and_f1(reference, predicted)}


def accuracy_and_f1(reference: np.ndarray, predicted: np.ndarray) -> dict:
    """Accuracy and macro-F1 over the labels either side names, as scikit-learn's
    accuracy_score and f1_score(average="macro") count them (a test holds them equal); from
    the confusion counts here, because importing sklearn.metrics costs every training job
    and every tuning trial about a second (docs/performance.md)."""
    labels, index = np.unique(np.concatenate([reference, predicted]), return_inverse=True)
    if not len(labels):
        return {"accuracy": 0.0, "f1": 0.0}
    truth, guess = index[: len(reference)], index[len(reference) :]
    count = functools.partial(np.bincount, minlength=len(labels))
    # F1 = 2TP / (2TP + FP + FN) = 2TP / (true count + predicted count); every label here
    # occurs on one side at least, so no denominator is 0.
    f1 = 2 * count(truth[truth == guess]) / (count(truth) + count(guess))
    return {"accuracy": float(np.mean(truth == guess)), "f1": float(f1.mean())}


def save_final_model(model, model_dir: Path, info: dict) -> None:
    """The output is the same kind of thing as the input: loadable weights, no optimizer state."""
    from safetensors.torch import save_model

    if hasattr(model, "save_pretrained"):
        model.save_pretrained(
            model_dir
        )  # config.json + model.safetensors: from_pretrained loads it
    else:
        save_model(model, str(model_dir / "model.safetensors"))  # load with the user's load_model
    write_record(model_dir, info)
