"""The files of a trained model's folder, named once: training writes them, inference reads
them, and `smpipe.json` records which exports passed their check against the eager model.

    model.safetensors (or a Hugging Face save)  the weights
    model.torchscript.pt                        TorchScript, traced      (EXPORTS torchscript)
    model.pt2                                   a torch.export program   (EXPORTS exported)
    smpipe.json                                 keys, labels, best epoch, `max_length` (the
                                                tokens prepare cut rows to), and `exports`
    adapter/                                    FINETUNING = lora: the adapters and the head in
                                                PEFT's format (the weights above are merged)
    history.json, curves.png                    each epoch's metrics, and their curves
"""

from __future__ import annotations

import json
from pathlib import Path

RECORD = "smpipe.json"
# The LoRA adapter as PEFT saves it (adapter_config.json, adapter_model.safetensors).
ADAPTER = "adapter"
HISTORY = "history.json"  # each epoch's metrics (train.py, export.py; the report reads them)
CURVES = "curves.png"  # their curves, drawn once per kept model
# MODEL_FORMAT -> the file of that export.
EXPORTS = {"torchscript": "model.torchscript.pt", "exported": "model.pt2"}


def write_record(model_dir: Path, record: dict) -> None:
    (model_dir / RECORD).write_text(json.dumps(record, indent=2, default=str))


def read_record(model_dir: Path) -> dict:
    return json.loads((model_dir / RECORD).read_text())


def usable_export(model_dir: Path, model_format: str, name: str) -> Path:
    """The file of `model_format`'s export, when training kept it because its check against
    the eager model passed; otherwise an error naming the model and why."""
    path = model_dir / EXPORTS[model_format]
    record = read_record(model_dir)
    check = record.get("exports", {}).get(model_format)
    if check is None and "exports" in record:
        written = ", ".join(record["exports"]) or "none"
        reason = f"it was not written ([training] EXPORTS: {written})"
    elif check is None:  # a folder from an older training job, which kept only passing exports
        if path.exists():
            return path
        reason = "no check was recorded"
    elif check.get("passed") and path.exists():
        return path
    elif check.get("passed"):
        reason = f"its check passed, but {path.name} is no longer in {model_dir}"
    else:
        reason = (
            check.get("error")
            or f"its check against the eager model failed ({_differences(check)})"
        )
    other = "torchscript" if model_format == "exported" else "exported"
    raise ValueError(
        f"model {name!r} has no usable {model_format} export: {reason}; "
        f"[inference] MODEL_FORMAT = {other} may have one"
    )


def _differences(check: dict) -> str:
    shown = {k: v for k, v in check.items() if k not in ("passed", "file")}
    return ", ".join(f"{k} {v}" for k, v in shown.items()) or "no detail recorded"
