"""A tuning trial in miniature: prints the metric line of steps/train.py once an epoch, its
scores a known function of the learning rate (higher is better: validation:f1 grows with it,
validation:loss falls), `epoch_seconds` between two epochs; leaves a model and a report."""

import json
import math
import time

from steps.metrics import metric_line
from steps.runtime.environment import training_env
from steps.runtime.step import run_step


def quality(learning_rate: float) -> float:
    """In (0, 1) on 1e-4..1e-1, higher for a higher learning rate."""
    return (math.log10(learning_rate) + 5) / 4


def main():
    env = training_env()
    hp = env.hyperparameters
    epochs, q = int(hp["epochs"]), quality(float(hp["learning_rate"]))
    for epoch in range(1, epochs + 1):
        f1 = q * epoch / epochs
        scores = {"train_loss": 1 - f1, "val_loss": 1 - f1, "accuracy": f1, "f1": f1}
        print(metric_line({"epoch": epoch, "step": epoch, **scores}), flush=True)
        if epoch < epochs:  # the next epoch's steps
            time.sleep(float(hp.get("epoch_seconds", 0)))
    (env.model_dir / "model.json").write_text(json.dumps({"learning_rate": hp["learning_rate"]}))
    (env.output_data_dir / "step_metadata.json").write_text(json.dumps({"quality": q}))


if __name__ == "__main__":
    run_step("probe-epochs", main)
