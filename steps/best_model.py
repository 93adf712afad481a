"""The training job's end, on the best epoch's weights: the model gathered plain
(`best_model`), then kept in SM_MODEL_DIR by the main process (`keep_model`): with LoRA,
merged and checked against the adapters; saved as `from_pretrained` loads it, with its record;
the programs the `exports` hyperparameter names, written and checked; its history, card and
curves."""

from __future__ import annotations

import gc
import json
import os

import torch

from steps.export import check_batches, check_exports, check_programs, logits_of, write_programs
from steps.finetuning import final_model, load_trained_state
from steps.metrics import metric_line, plot_curves
from steps.model_files import CURVES, HISTORY, read_record, write_card, write_record
from steps.prepared_files import other_tokenizer, read_encoding
from steps.runtime import names
from steps.tracking import wandb_run_of
from steps.training_blocks import save_final_model
from steps.training_job import Job
from steps.training_report import timed
from steps.user_code import call, load_user_functions


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


def keep_model(job: Job, final: torch.nn.Module) -> tuple[dict, dict]:
    """The best model, its exports, history, card and curves. Returns which exports passed
    their check, and the LoRA merge's check (empty without LoRA), for the job's report."""
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
    return exports, merge


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
    if hasattr(final, "save_pretrained"):
        save_tokenizer(job)


def save_tokenizer(job: Job) -> None:
    """The tokenizer that encoded the rows, beside a Hugging Face model, as the Trainer saves
    its processing class with the model: the folder is whole for `AutoTokenizer` and
    `pipeline("text-classification", model=folder)`, and for a later run whose functions
    load from it (without it, AutoTokenizer built a vocabulary of special tokens alone there,
    and every word became [UNK], without an error). Not saved, and said: one load_tokenizer
    now returns that is not the one encoding.json records, or that cannot be saved."""
    name = job.hp["model_name"]
    try:
        functions = load_user_functions(os.environ[names.USER_FUNCTIONS_VARIABLE])
        tokenizer = call(functions, "load_tokenizer", name)
        if not callable(getattr(tokenizer, "save_pretrained", None)):
            return
        encoding = read_encoding(job.env.channels["labels"])
        if differs := other_tokenizer(tokenizer, encoding, name):
            raise ValueError(f"it is not the one that encoded the rows ({differs})")
        # As load_tokenizer gives it, not cut at MAX_SEQUENCE_LENGTH: a later run with a longer
        # one, or a finetuning from this folder, would be cut at this run's without a word.
        # The card and smpipe.json say the length its rows were cut to.
        tokenizer.save_pretrained(job.env.model_dir)
    except Exception as e:  # noqa: BLE001 - the model stands without it
        print(f"warning: the tokenizer of model {name!r} is not saved with it: {e}", flush=True)
