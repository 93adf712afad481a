"""The files of a trained model's folder, named once: training writes them, inference reads them.

    model.safetensors (or a Hugging Face save)  the weights; adapter/ with FINETUNING = lora
    tokenizer.json, tokenizer_config.json ...   a Hugging Face model's tokenizer (save_tokenizer)
    model.torchscript.pt, model.pt2             the exports (EXPORTS), each checked
    smpipe.json                                 the model's record (RECORD)
    history.json, curves.png, README.md         each epoch's metrics, their curves, the card

Each name is a constant below, with what the file holds.
"""

from __future__ import annotations

import json
from pathlib import Path

# The model's record: keys, labels, best epoch, `max_length` (the tokens prepare cut rows to),
# and `exports`: which exports passed their check against the eager model.
RECORD = "smpipe.json"
# FINETUNING = lora: the adapters and the head as PEFT saves them (adapter_config.json,
# adapter_model.safetensors); the weights beside it are merged.
ADAPTER = "adapter"
HISTORY = "history.json"  # each epoch's metrics (train.py, export.py; the report reads them)
# The model card, in the Hugging Face Hub's format (`write_card`): what the Hub shows for a
# model, and `from_pretrained` users read.
CARD = "README.md"
CURVES = "curves.png"  # their curves, drawn once per kept model
# MODEL_FORMAT -> the file of that export: TorchScript, traced; a torch.export program.
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


def write_card(model_dir: Path, record: dict, history: list[dict], settings: dict) -> None:
    """The model card beside the weights, in the Hugging Face Hub's model-card format: a YAML
    header (the Hub's metadata: library, base model, task, tags, and `model-index` with the
    validation metric), then the labels, how it was trained and each epoch's metrics
    (huggingface_hub's ModelCard: the header between `---` lines, then markdown). The test
    metrics are the run's (inference/), made after this folder is sealed. Each header value is
    written as JSON, which is YAML too (YAML 1.2's flow style): no YAML library is needed."""
    config = model_dir / "config.json"
    base = json.loads(config.read_text()).get("_name_or_path") if config.exists() else None
    local = not base or base.startswith(("/", ".")) or Path(base).exists()
    header = card_header(record, config.exists(), None if local else base)
    # A local folder by its name only: where it lay on the training host says nothing here.
    from_base = f" from `{Path(base).name if local else base}`" if base else ""
    name, best = record["model_name"], record["best_epoch"]
    card = f"""---
{chr(10).join(f"{key}: {json.dumps(value)}" for key, value in header.items())}
---

# {name}

A text classifier finetuned{from_base} by smpipe: its best epoch by validation macro F1 (epoch
{best}, {float(record["best_validation_f1"]):.4f}) is these weights. The exports
beside them (TorchScript, torch.export) take `{", ".join(record["ordered_input_keys"])}` in that
order; `smpipe.json` records which passed their check against these weights. The test-set
metrics are the run's own (its `inference/` folder and report.html). Its rows were cut to
{record["max_length"]} tokens: give it texts so (`tokenizer(texts, truncation=True,
max_length={record["max_length"]})`, or transformers' `pipeline` with `truncation=True,
max_length={record["max_length"]}`).

## Labels

{table(["id", "label"], sorted(record["id2label"].items(), key=lambda kv: int(kv[0])))}

## Training

{table(["setting", "value"], [(k, v) for k, v in sorted(settings.items()) if v is not None])}

## Validation, by epoch

{epoch_table(history, best)}
"""
    (model_dir / CARD).write_text(card)


def card_header(record: dict, transformers: bool, hub_name: str | None) -> dict:
    """The card's metadata, as the Hub reads it: `model-index` holds the validation F1."""
    metric = {
        "type": "f1",
        "value": round(float(record["best_validation_f1"]), 4),
        "name": f"macro F1, validation, epoch {record['best_epoch']}",
    }
    result = {
        "task": {"type": "text-classification", "name": "Text Classification"},
        "dataset": {"type": "custom", "name": "the run's validation split"},
        "metrics": [metric],
    }
    lora = ["lora"] if record.get("finetuning") == "lora" else []
    return {
        **({"library_name": "transformers"} if transformers else {}),
        **({"base_model": hub_name} if hub_name else {}),
        "pipeline_tag": "text-classification",
        "tags": ["smpipe", "text-classification", *lora],
        "model-index": [{"name": record["model_name"], "results": [result]}],
    }


def table(columns: list[str], rows) -> str:
    lines = [f"| {' | '.join(columns)} |", f"|{' --- |' * len(columns)}"]
    return "\n".join(lines + [f"| {' | '.join(str(c) for c in row)} |" for row in rows])


def epoch_table(history: list[dict], best: int) -> str:
    """Each epoch's metrics, the best epoch marked."""
    metrics = sorted({k for h in history for k in h if k != "epoch"})

    def shown(value) -> str:
        return f"{value:.4f}" if isinstance(value, float) else str(value)

    rows = [
        [f"{h['epoch']}{' (best)' if h['epoch'] == best else ''}"]
        + [shown(h.get(m, "")) for m in metrics]
        for h in history
    ]
    return table(["epoch", *metrics], rows)
