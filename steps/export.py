"""Export (processing job, CPU): the programs inference runs, each checked against the eager model
before it is kept. A training job exports its own model at its end (steps/best_model.py
`keep_model`, with these functions); after a study, this job exports the best trial's model.

Inputs:  model       the best trial's model folder (weights, smpipe.json, curves)
         validation  the prepared validation split, for the check batches
         labels      the prepared labels folder (inputs.json: pad values and sequence keys)
Outputs: model       the same folder with the programs `--exports` names, and smpipe.json
                     recording each program's check (steps/model_files.py)
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from steps.arguments import EXPORT, parse
from steps.batching import Batches, read_inputs, read_split
from steps.metrics import plot_curves
from steps.model_files import CURVES, EXPORTS, HISTORY, read_record, write_record
from steps.runtime import names
from steps.runtime.environment import processing_input, processing_output
from steps.runtime.step import run_step
from steps.user_code import call, load_user_functions

# Rows in each of the two check batches (the shortest rows, the longest): a width or batch
# size the program mishandles shows in a few rows, and each row checked costs a forward pass
# of eager and of the program.
EXPORT_CHECK_ROWS = 4
# The store's manifest of the input folder (pipeline/store/manifests.py MANIFEST): it lists the
# input's files, not the output's, which gets its own when it is uploaded.
STORE_MANIFEST = "_MANIFEST.json"


def logits_of(output) -> torch.Tensor:
    """Any nn.Module works: a tensor of logits, an output with `.logits` (a transformers
    model's), a dict with "logits" (as a ModelOutput also reads), or a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, Mapping) and "logits" in output:
        return output["logits"]
    if isinstance(output, (tuple, list)):
        return output[0]
    raise TypeError(
        f"the model load_model built returned {type(output).__name__} from forward(); expected "
        "the logits, an output with .logits, a dict with 'logits', or a tuple of the logits first"
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


def write_torchscript(wrapper, args: tuple, keys: list[str], inputs: dict, path: Path) -> None:
    """TorchScript, traced on two rows of different lengths."""
    torch.jit.trace(wrapper, args, strict=False, check_trace=False).save(str(path))


def write_exported(wrapper, args: tuple, keys: list[str], inputs: dict, path: Path) -> None:
    """A torch.export program with dynamic batch and sequence dimensions."""
    dim = torch.export.Dim.DYNAMIC
    shapes = tuple({0: dim, 1: dim} if k in inputs["sequence"] else {0: dim} for k in keys)
    program = torch.export.export(wrapper, args, dynamic_shapes=(shapes,), strict=False)
    torch.export.save(program, str(path))


# [training] EXPORTS names these; steps/model_files.py names their files. Each program is
# checked as inference loads it.
WRITERS = {"torchscript": write_torchscript, "exported": write_exported}
LOADERS = {
    "torchscript": lambda path: torch.jit.load(str(path)),
    "exported": lambda path: torch.export.load(str(path)).module(),
}


def write_programs(
    model, keys: list[str], inputs: dict, batches: Batches, model_dir: Path, formats: list[str]
) -> tuple[dict, list]:
    """Each program of `formats` written from the eager model, and the eager model's logits on
    two check batches of different widths: all `check_programs` needs, so that the eager model
    can be gone by then (a program loaded back beside it would hold a large model's weights
    twice). Returns the formats that could not be written, with why, and the checks."""
    if not formats:  # a tuning trial: nothing to write, nothing to check against
        return {}, []
    wrapper = LogitsOnly(model, keys).eval()
    with torch.no_grad():  # eager's logits once, for every program
        arguments = [[batch[k] for k in keys] for batch in check_batches(batches)]
        checks = [(args, wrapper(*args)) for args in arguments]
    order = np.argsort(batches.lengths, kind="stable")
    sample = batches([int(order[0]), int(order[-1])])
    args = tuple(sample[k] for k in keys)
    failed = {}
    for name in formats:
        # Tracing warns about every Python branch it freezes; the check is what tells.
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                WRITERS[name](wrapper, args, keys, inputs, model_dir / EXPORTS[name])
            except Exception as e:  # noqa: BLE001 - recorded, and the job fails on it
                failed[name] = {"passed": False, "error": f"{type(e).__name__}: {str(e)[:500]}"}
    return failed, checks


def check_programs(failed: dict, checks: list, model_dir: Path, formats: list[str]) -> dict:
    """Each written program loaded back, one at a time, and checked against the eager logits;
    one that fails (or that torch could not write: not every model exports yet) is recorded
    with why and never kept."""
    results = {}
    for name in formats:
        path = model_dir / EXPORTS[name]
        if name in failed:
            results[name] = failed[name]
        else:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    results[name] = {"file": path.name, **compare(LOADERS[name](path), checks)}
                except Exception as e:  # noqa: BLE001 - recorded, and the job fails on it
                    error = f"{type(e).__name__}: {str(e)[:500]}"
                    results[name] = {"passed": False, "error": error}
        if not results[name]["passed"]:  # a program that disagrees is never kept
            path.unlink(missing_ok=True)
    return results


def export_programs(
    model, keys: list[str], inputs: dict, batches: Batches, model_dir: Path, formats: list[str]
) -> dict:
    """Each program of `formats` written and checked against eager (`write_programs`, then
    `check_programs`), for a caller that keeps the eager model anyway."""
    failed, checks = write_programs(model, keys, inputs, batches, model_dir, formats)
    return check_programs(failed, checks, model_dir, formats)


def check_exports(exports: dict) -> None:
    """A model whose export is wrong is never promoted: the job fails, naming the setting (and
    telling a program that disagrees from one that could not be written or loaded back)."""
    failed = {name: result for name, result in exports.items() if not result["passed"]}
    if not failed:
        return
    unmade = {name: r["error"] for name, r in failed.items() if "error" in r}
    wrong = {name: r for name, r in failed.items() if "error" not in r}
    said = [
        f"the {name} export could not be written or loaded back: {e}" for name, e in unmade.items()
    ]
    said += [f"the {name} export does not match the eager model: {r}" for name, r in wrong.items()]
    raise RuntimeError(
        "; ".join(said) + "; [training] EXPORTS names the programs written ([inference] "
        "MODEL_FORMAT's must be among them)"
    )


def trained_model(directory: Path, model_name: str, record: dict) -> torch.nn.Module:
    """The model as the training job saved it, in eval mode on the CPU: `from_pretrained` for
    a Hugging Face model (its `save_pretrained` folder), else `safetensors.torch.load_model`
    into what the user's `load_model` builds."""
    id2label = {int(k): v for k, v in record["id2label"].items()}
    functions = load_user_functions(os.environ[names.USER_FUNCTIONS_VARIABLE])
    label2id = {v: k for k, v in id2label.items()}
    model = call(functions, "load_model", model_name, id2label, label2id)
    if hasattr(model, "from_pretrained") and (directory / "config.json").exists():
        model = type(model).from_pretrained(directory)  # as save_pretrained wrote it
    else:
        from safetensors.torch import load_model

        # Into fp32 weights, as they were saved: a model load_model builds in bf16 would
        # round them on the way in.
        load_model(model.float(), str(directory / "model.safetensors"))
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
    history = out / HISTORY  # a trial draws no curves: most trials' models are deleted
    if history.exists() and not (out / CURVES).exists():
        title = f"{args.model_name} (best trial)"
        plot_curves(json.loads(history.read_text()), out / CURVES, title)
    model = trained_model(out, args.model_name, record)
    keys = record["ordered_input_keys"]
    labels = processing_input("labels")
    inputs = read_inputs(labels, args.model_name, keys)
    table = read_split(processing_input("validation"))
    batches = Batches(table, args.model_name, keys, inputs, record["max_length"])
    failed, checks = write_programs(model, keys, inputs, batches, out, formats)
    del model  # each program is loaded back beside the eager logits only
    record["exports"] = check_programs(failed, checks, out, formats)
    write_record(out, record)
    for name, result in record["exports"].items():
        print(f"{name}: {result}")
    check_exports(record["exports"])


if __name__ == "__main__":
    run_step("export", main)
