"""Export (processing job, CPU): the programs inference runs, written once, for the model that
is kept, and each checked against the eager model before it is kept.

A training job exports its own model at its end (steps/train.py `finish`, with these
functions). A tuning trial exports nothing: trials train and validate, and most of their
models are deleted. After a study this step exports the best trial's model:

Inputs:  model       the best trial's model folder (weights, smpipe.json, curves)
         validation  the prepared validation split, for the check batches
         labels      the prepared labels folder (inputs.json: pad values and sequence keys)
Outputs: model       the same folder with the programs `--exports` names, and smpipe.json
                     recording each program's check (steps/model_files.py)

The weights are loaded as the training job saved them: `from_pretrained` for a Hugging Face
model (its `save_pretrained` folder), else `safetensors.torch.load_model` into what the
user's `load_model` builds.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

from steps.arguments import EXPORT, parse
from steps.batching import Batches, read_inputs, read_split
from steps.metrics import plot_curves
from steps.model_files import EXPORTS, read_record, write_record
from steps.runtime import names
from steps.runtime.environment import processing_input, processing_output
from steps.runtime.step import run_step
from steps.user_code import call, load_user_functions

# Rows in each of the two check batches (the shortest rows, the longest): a width or batch
# size the program mishandles shows in a few rows, and each row checked costs a forward pass
# of eager and of the program.
EXPORT_CHECK_ROWS = 4
# The store's manifest of the input folder (pipeline/store.py MANIFEST): it lists the input's
# files, not the output's, which gets its own when it is uploaded.
STORE_MANIFEST = "_MANIFEST.json"


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
    """Positional inputs in the user's order -> logits: what the exports trace and inference
    calls."""

    def __init__(self, model: torch.nn.Module, keys: list[str]):
        super().__init__()
        self.model, self.keys = model, keys

    def forward(self, *inputs):
        return logits_of(self.model(**dict(zip(self.keys, inputs, strict=True))))


def check_batches(batches: Batches) -> list[dict]:
    """Two batches of different widths: the shortest validation rows and the longest."""
    order = np.argsort(batches.lengths, kind="stable")
    n = max(1, min(len(order) // 2, EXPORT_CHECK_ROWS))
    return [batches(order[:n].tolist()), batches(order[-n:].tolist())]


def compare(program, checks: list[tuple[list, torch.Tensor]]) -> dict:
    """A program against the eager model's logits on each check batch."""
    diffs, same, widths = [], True, []
    with torch.no_grad():
        for args, eager in checks:
            got = program(*args)
            diffs.append((eager - got).abs().max().item())
            same &= bool((eager.argmax(-1) == got.argmax(-1)).all())
            widths.append(int(args[0].shape[-1]) if args[0].dim() > 1 else 1)
    return {
        "rows_checked": sum(len(eager) for _, eager in checks),
        "widths": widths,
        "max_abs_diff": max(diffs),
        "same_predictions": same,
        "passed": bool(max(diffs) < 1e-4 and same),
    }


def torchscript(wrapper, args: tuple, keys: list[str], inputs: dict, path: Path):
    """TorchScript traced on two rows of different lengths; the program as loaded back."""
    torch.jit.trace(wrapper, args, strict=False, check_trace=False).save(str(path))
    return torch.jit.load(str(path))


def exported(wrapper, args: tuple, keys: list[str], inputs: dict, path: Path):
    """A torch.export program with dynamic batch and sequence dimensions, as loaded back."""
    dim = torch.export.Dim.DYNAMIC
    shapes = tuple({0: dim, 1: dim} if k in inputs["sequence"] else {0: dim} for k in keys)
    program = torch.export.export(wrapper, args, dynamic_shapes=(shapes,), strict=False)
    torch.export.save(program, str(path))
    return torch.export.load(str(path)).module()


# [training] EXPORTS names these; steps/model_files.py names their files.
WRITERS = {"torchscript": torchscript, "exported": exported}


def export_programs(
    model, keys: list[str], inputs: dict, batches: Batches, model_dir: Path, formats: list[str]
) -> dict:
    """Each program of `formats` written and checked against eager on two batches of
    different widths; one that fails (or that torch cannot write: not every model exports
    yet) is recorded with why and never kept."""
    if not formats:  # a tuning trial: nothing to write, nothing to check against
        return {}
    wrapper = LogitsOnly(model, keys).eval()
    with torch.no_grad():  # eager's logits once, for every program
        arguments = [[batch[k] for k in keys] for batch in check_batches(batches)]
        checks = [(args, wrapper(*args)) for args in arguments]
    order = np.argsort(batches.lengths, kind="stable")
    sample = batches([int(order[0]), int(order[-1])])
    args = tuple(sample[k] for k in keys)
    results = {}
    for name in formats:
        path = model_dir / EXPORTS[name]
        # Tracing warns about every Python branch it freezes; the check is what tells.
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                program = WRITERS[name](wrapper, args, keys, inputs, path)
                results[name] = {"file": path.name, **compare(program, checks)}
            except Exception as e:  # noqa: BLE001 - recorded, and the job fails on it
                results[name] = {"passed": False, "error": f"{type(e).__name__}: {str(e)[:500]}"}
        if not results[name]["passed"]:  # a program that disagrees is never kept
            path.unlink(missing_ok=True)
    return results


def check_exports(exports: dict) -> None:
    """A model whose export is wrong is never promoted: the job fails, naming the setting."""
    failed = {name: result for name, result in exports.items() if not result["passed"]}
    if failed:
        raise RuntimeError(
            f"the {' and '.join(failed)} export does not match the eager model: {failed}; "
            "[training] EXPORTS names the programs written ([inference] MODEL_FORMAT's must "
            "be among them)"
        )


def trained_model(directory: Path, model_name: str, record: dict) -> torch.nn.Module:
    """The model as the training job saved it, in eval mode on the CPU."""
    id2label = {int(k): v for k, v in record["id2label"].items()}
    functions = load_user_functions(os.environ[names.USER_FUNCTIONS_VARIABLE])
    label2id = {v: k for k, v in id2label.items()}
    model = call(functions, "load_model", model_name, id2label, label2id)
    if hasattr(model, "from_pretrained") and (directory / "config.json").exists():
        model = type(model).from_pretrained(directory)  # as save_pretrained wrote it
    else:
        from safetensors.torch import load_model

        load_model(model, str(directory / "model.safetensors"))
    return model.float().eval().cpu()


def main() -> None:
    args = parse(EXPORT)
    formats = [f for f in args.exports.split(",") if f]
    unknown = [f for f in formats if f not in EXPORTS]
    if unknown or not formats:
        raise ValueError(f"--exports {args.exports!r}: name one or more of {', '.join(EXPORTS)}")
    out = processing_output("model")
    source = processing_input("model")
    for path in sorted(source.rglob("*")):
        if path.is_file() and path.name != STORE_MANIFEST:
            target = out / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    record = read_record(out)
    history = out / "history.json"  # a trial draws no curves: most trials' models are deleted
    if history.exists() and not (out / "curves.png").exists():
        title = f"{args.model_name} (best trial)"
        plot_curves(json.loads(history.read_text()), out / "curves.png", title)
    model = trained_model(out, args.model_name, record)
    keys = record["ordered_input_keys"]
    labels = processing_input("labels")
    inputs = read_inputs(labels, args.model_name, keys)
    table = read_split(processing_input("validation"))
    batches = Batches(table, args.model_name, keys, inputs, record["max_length"])
    record["exports"] = export_programs(model, keys, inputs, batches, out, formats)
    write_record(out, record)
    for name, result in record["exports"].items():
        print(f"{name}: {result}")
    check_exports(record["exports"])


if __name__ == "__main__":
    run_step("export", main)
