"""The metrics a training job reports, once an epoch, in one line of one format.

    epoch=2 step=12 train:loss=0.412345 validation:loss=0.398765
        validation:accuracy=0.912345 validation:f1=0.905432        (one line, wrapped here)

`steps/train.py` prints it (`metric_line`); the driver reads it back with one regex per
metric, SageMaker's `MetricDefinitions` (`DEFINITIONS`): a tuning job's objective and every
local trial's metrics come from the same regexes. A user's own regex in
[tuning.metric_definitions] is checked against `SAMPLE_LINE` when the settings are loaded.
"""

from __future__ import annotations

import re
from pathlib import Path

# Metric name as printed (and as OBJECTIVE_METRIC names it) -> its key in the epoch's record.
METRICS = {
    "train:loss": "train_loss",
    "validation:loss": "val_loss",
    "validation:accuracy": "accuracy",
    "validation:f1": "f1",
}
# A number as Python prints one: 0.912345, 12, -1.5e-05, nan, inf.
NUMBER = r"(-?(?:[0-9]+\.?[0-9]*(?:[eE][-+]?[0-9]+)?|nan|inf))"
DEFINITIONS = {name: re.escape(name) + "=" + NUMBER for name in METRICS}


def metric_line(record: dict) -> str:
    values = " ".join(f"{name}={record[key]:.6f}" for name, key in METRICS.items())
    return f"epoch={record['epoch']} step={record['step']} {values}"


# What a user's regex is checked against: every metric with a distinct value.
SAMPLE = {key: 0.1 + i / 10 + 0.012345 for i, key in enumerate(METRICS.values())}
SAMPLE_LINE = metric_line({"epoch": 2, "step": 12, **SAMPLE})


def check_definition(name: str, regex: str) -> str | None:
    """Why `regex` cannot read metric `name` off the metric line, or None when it can."""
    try:
        compiled = re.compile(regex)
    except re.error as e:
        return f"{regex!r} is not a valid regex ({e})"
    if compiled.groups != 1:
        # SageMaker reads the first group; a second one is a mistake it reports as "None."
        return (
            f"{regex!r} has {compiled.groups} groups; it must capture the value in exactly one, "
            "as in f1=([0-9.]+) (write others as (?:...))"
        )
    found = compiled.search(SAMPLE_LINE)
    if found is None:
        return f"{regex!r} does not match the line train.py prints: {SAMPLE_LINE}"
    try:
        value = float(found.group(1))
    except (TypeError, ValueError):
        return f"{regex!r} captures {found.group(1)!r} from the metric line, not a number"
    if name in METRICS and abs(value - SAMPLE[METRICS[name]]) > 1e-6:
        return f"{regex!r} reads {value} for {name} from {SAMPLE_LINE!r}: another metric's value"
    return None


def plot_curves(history: list[dict], path: Path, title: str) -> None:
    """curves.png beside a kept model: loss, and validation accuracy and F1, by epoch."""
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
