"""Inference (processing job, CPU): the exported models ([inference] MODEL_FORMAT) on the held-out
test split, each compared with the others.

Inputs:  test, labels, and models: the run's models/ folder (<name>/model/ for every model)
Outputs: results  per model: per_label.csv (sorted by F1, descending), overall.json,
                  confusion_matrix.csv/.png, predictions.csv; with several models also
                  comparison.csv and comparison.json (agreement and McNemar's exact test)
         report   step_metadata.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import tarfile
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import torch
from scipy.stats import binomtest, bootstrap
from sklearn.metrics import (
    accuracy_score,
    confusion_matrix,
    f1_score,
    precision_recall_fscore_support,
)

from steps.arguments import INFERENCE, parse
from steps.batching import Batches, by_length, read_inputs, read_split
from steps.model_artifact import log_models
from steps.model_files import RECORD, read_record, usable_export
from steps.precision import Precision, autocast, resolve
from steps.runtime.environment import processing_input, processing_output
from steps.runtime.names import PER_LABEL_FILE
from steps.runtime.step import run_step, write_step_metadata

FP32 = Precision("no", "fp32")


def parse_args() -> argparse.Namespace:
    return parse(INFERENCE)


def model_dir(name: str) -> Path:
    path = processing_input("models") / name / "model"
    if not path.is_dir():
        raise FileNotFoundError(f"no model {name!r} in {processing_input('models')}")
    archive = path / "model.tar.gz"  # a SageMaker training output kept as its tarball
    if archive.exists() and not (path / RECORD).exists():
        with tarfile.open(archive) as tar:
            tar.extractall(path, filter="data")
    return path


def load_program(directory: Path, model_format: str, name: str):
    """The model as exported by training, in `model_format`, if its check passed."""
    path = usable_export(directory, model_format, name)
    if model_format == "exported":
        return torch.export.load(str(path)).module()
    return torch.jit.load(str(path), map_location="cpu").eval()


def predict(name: str, test: pa.Table, batch_size: int, model_format: str, precision: Precision):
    """Predicted label ids and their confidence, in the test split's order; and, when the
    program ran in bf16, how its predictions compare with fp32's (`against_fp32`). The program
    (TorchScript, or the torch.export program) is loaded once and runs over the test rows
    sorted by length and padded per batch."""
    directory = model_dir(name)
    keys = read_record(directory)["ordered_input_keys"]
    inputs = read_inputs(processing_input("labels"), name, keys)
    batches = Batches(test, name, keys, inputs, labels=False)
    program = load_program(directory, model_format, name)
    logits = run_batches(program, batches, keys, batch_size, precision)
    checked = against_fp32(program, batches, keys, batch_size, logits) if precision.bf16 else None
    return logits.argmax(-1).numpy(), torch.softmax(logits, -1).max(-1).values.numpy(), checked


# Test rows run again in fp32 when inference ran in bf16: every row of a test split up to this
# many, else this many spread over the lengths (the same rows every run).
FP32_CHECK_ROWS = 512


def against_fp32(program, batches: Batches, keys: list[str], batch_size: int, logits) -> dict:
    """The bf16 predictions against the same program's in fp32 on the same rows: how often
    they agree, and the largest difference of any label's probability."""
    rows = np.arange(len(batches))
    if len(rows) > FP32_CHECK_ROWS:
        rows = np.argsort(batches.lengths, kind="stable")[
            np.linspace(0, len(rows) - 1, FP32_CHECK_ROWS).round().astype(int)
        ]
    fp32 = run_batches(program, batches, keys, batch_size, FP32, rows)
    low = logits[torch.as_tensor(rows)]
    agree = (low.argmax(-1) == fp32.argmax(-1)).float().mean().item()
    difference = (torch.softmax(low, -1) - torch.softmax(fp32, -1)).abs().max().item()
    return {"rows": len(rows), "agreement": agree, "max_probability_difference": difference}


# Tokens in one forward pass at most (rows x width; BATCH_SIZE rows at most). 64 rows of 128
# tokens make attention tensors of 50 MB, above the largest threshold at which glibc's malloc
# maps big blocks (32 MB): each is mapped and unmapped on every pass and its pages faulted in
# again. MiniLM, 2 cores, a fresh process, 7 rounds: 39 rows/s in passes of 64 rows, 49 in
# passes of 1024 tokens (1.17x the transformers pipeline at batch size 64, paired), 51 for
# both when malloc is told to keep big blocks. A 128-token row already fills a CPU's matrix
# units, so the smaller passes cost nothing else.
MAX_TOKENS_PER_PASS = 1024


def run_batches(
    model,
    batches: Batches,
    keys: list[str],
    batch_size: int,
    precision: Precision = FP32,
    rows: np.ndarray | None = None,
) -> torch.Tensor:
    """Logits (fp32) for every row, or for `rows` in their order: rows sorted by length, each
    batch padded to its longest row and held to MAX_TOKENS_PER_PASS tokens, the results put
    back in order. In bf16 the program runs under autocast (steps/precision.py)."""
    rows = np.arange(len(batches)) if rows is None else np.asarray(rows)
    logits = None
    # TorchScript's profiling executor re-optimizes for every new input shape, and every batch
    # here has a width of its own: measured on 2 CPU cores it costs 10% on 128-token batches.
    with (
        torch.inference_mode(),
        torch.jit.optimized_execution(False),
        autocast(precision),
    ):
        for chunk in by_length(batches.lengths[rows], batch_size, MAX_TOKENS_PER_PASS):
            batch = batches(rows[chunk].tolist())
            out = model(*(batch[k] for k in keys)).float()
            if logits is None:
                logits = torch.empty(len(rows), out.shape[-1])
            logits[chunk] = out
    return logits


def statistics(
    y_true: np.ndarray, y_pred: np.ndarray, id2label: dict[int, str]
) -> tuple[pd.DataFrame, dict]:
    labels = sorted(id2label)
    precision, recall, f1, support = precision_recall_fscore_support(
        y_true, y_pred, labels=labels, zero_division=0
    )
    cm = confusion_matrix(y_true, y_pred, labels=labels)
    rows = cm.sum(axis=1)
    per_label = pd.DataFrame(
        {
            "label": [id2label[i] for i in labels],
            "precision": precision,
            "recall": recall,
            "f1": f1,
            # per-label accuracy: of this label's rows, the share predicted right (= recall);
            # kept under its own name because that is what people look for in the table
            "accuracy": [cm[i, i] / rows[i] if rows[i] else 0.0 for i in range(len(labels))],
            "support": support.astype(int),
        }
    )
    per_label = per_label.sort_values("f1", ascending=False, kind="stable")
    overall = {
        "rows": int(len(y_true)),
        "accuracy": float(accuracy_score(y_true, y_pred)),
        "macro_f1": float(
            f1_score(y_true, y_pred, average="macro", labels=labels, zero_division=0)
        ),
        "weighted_f1": float(
            f1_score(y_true, y_pred, average="weighted", labels=labels, zero_division=0)
        ),
    }
    return per_label, overall


# Up to this many labels the confusion matrix is drawn whole, a number in each cell; past it
# a figure of cells would grow with the square of the labels (1,000 labels: a million cells,
# gigabytes of image), so the most frequent confusions are drawn instead, and the whole
# matrix stays in confusion_matrix.csv.
MATRIX_LABELS = 25
TOP_CONFUSIONS = 20


def plot_confusion(cm: np.ndarray, names: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len(names) > MATRIX_LABELS:
        fig = _plot_top_confusions(plt, cm, names, title)
    else:
        fig, ax = plt.subplots(figsize=(1.2 * len(names) + 2, 1.2 * len(names) + 1.5))
        ax.imshow(cm, cmap="Blues")
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
        ax.set_yticks(range(len(names)), names)
        ax.set(xlabel="predicted", ylabel="true", title=title)
        for i, j in itertools.product(range(len(names)), repeat=2):
            color = "white" if cm[i, j] > cm.max() / 2 else "black"
            ax.text(j, i, int(cm[i, j]), ha="center", va="center", color=color)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def top_confusions(cm: np.ndarray, k: int = TOP_CONFUSIONS) -> list[tuple[int, int, int]]:
    """(true, predicted, rows) of the k most frequent confusions, most first: linear in the
    matrix, whatever the number of labels."""
    off = cm.copy()
    np.fill_diagonal(off, 0)
    flat = off.ravel()
    k = min(k, int((flat > 0).sum()))
    if k == 0:
        return []
    best = np.argpartition(flat, -k)[-k:]
    best = best[np.argsort(-flat[best], kind="stable")]
    return [(int(i // cm.shape[1]), int(i % cm.shape[1]), int(flat[i])) for i in best]


def _plot_top_confusions(plt, cm: np.ndarray, names: list[str], title: str):
    pairs = top_confusions(cm)
    fig, ax = plt.subplots(figsize=(9, 1.5 + 0.3 * max(1, len(pairs))))
    labels = [f"{names[t]} -> {names[p]}" for t, p, _ in pairs]
    ax.barh(range(len(pairs)), [n for _, _, n in pairs], color="C0")
    ax.set_yticks(range(len(pairs)), labels, fontsize=8)
    ax.invert_yaxis()
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    heading = f"{title}: the {len(pairs)} most frequent confusions of {len(names)} labels"
    ax.set(xlabel="test rows (true -> predicted)", title=heading + " (all: confusion_matrix.csv)")
    ax.title.set_fontsize(9)
    return fig


def mcnemar(correct_a: np.ndarray, correct_b: np.ndarray) -> dict:
    """McNemar's exact test on the rows where exactly one of the two models is right."""
    only_a = int((correct_a & ~correct_b).sum())
    only_b = int((~correct_a & correct_b).sum())
    p = binomtest(min(only_a, only_b), only_a + only_b, 0.5).pvalue if only_a + only_b else 1.0
    return {
        "only_first_right": only_a,
        "only_second_right": only_b,
        "p_value": float(p),
        "significant_at_0.05": bool(p < 0.05),
    }


def accuracy_difference_ci(
    correct_a: np.ndarray, correct_b: np.ndarray, seed: int = 0
) -> list[float]:
    """A 95% paired bootstrap interval of accuracy(a) - accuracy(b): test rows resampled with
    replacement, both models judged on the same resampled rows (scipy's percentile bootstrap)."""
    if correct_a.size < 2 or (correct_a == correct_b).all():
        difference = float(correct_a.mean() - correct_b.mean()) if correct_a.size else 0.0
        return [difference, difference]  # nothing varies between resamples
    result = bootstrap(
        (correct_a.astype(float), correct_b.astype(float)),
        lambda a, b, axis: a.mean(axis=axis) - b.mean(axis=axis),
        paired=True,
        vectorized=True,
        n_resamples=2000,
        confidence_level=0.95,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    return [float(result.confidence_interval.low), float(result.confidence_interval.high)]


def compare(
    names: list[str], performance: dict, predictions: dict, y_true: np.ndarray, out: Path
) -> dict:
    """Every pair of models on the same test rows: agreement, the accuracy difference with
    its bootstrap interval, McNemar's test; comparison.csv and comparison.json."""
    table = (
        pd.DataFrame(performance).T.rename_axis("model").sort_values("macro_f1", ascending=False)
    )
    table["rows"] = table["rows"].astype(int)
    table.to_csv(out / "comparison.csv", float_format="%.4f")
    pairs = []
    for a, b in itertools.combinations(names, 2):
        agree = predictions[a] == predictions[b]
        right_a, right_b = predictions[a] == y_true, predictions[b] == y_true
        pairs.append(
            {
                "models": [a, b],
                "agree": int(agree.sum()),
                "disagree": int((~agree).sum()),
                "agree_and_right": int((agree & right_a).sum()),
                "accuracy_difference": performance[a]["accuracy"] - performance[b]["accuracy"],
                "accuracy_difference_ci95": accuracy_difference_ci(right_a, right_b),
                "mcnemar": mcnemar(right_a, right_b),
            }
        )
    comparison = {
        "test": "McNemar's exact test (two-sided binomial on discordant rows)",
        "interval": (
            "95% paired bootstrap (2000 resamples of the test rows) of the accuracy difference"
        ),
        "winner": str(table.index[0]),  # by test macro-F1
        "pairs": pairs,
    }
    (out / "comparison.json").write_text(json.dumps(comparison, indent=2))
    print(table.to_string(float_format=lambda x: f"{x:.4f}"))
    for pair in pairs:
        m, (low, high) = pair["mcnemar"], pair["accuracy_difference_ci95"]
        verdict = "significant" if m["significant_at_0.05"] else "not significant"
        print(
            f"{pair['models'][0]} vs {pair['models'][1]}: "
            f"agree on {pair['agree']}/{len(y_true)} rows; "
            f"McNemar p={m['p_value']:.4g} ({verdict} at 0.05); "
            f"accuracy difference {pair['accuracy_difference']:+.4f}, "
            f"95% CI [{low:+.4f}, {high:+.4f}]"
        )
    return comparison


def check_labels_match(names: list[str], id2label: dict[int, str]) -> None:
    """A model is only ever tested on data labelled the way its training data was."""
    for name in names:
        own = model_dir(name) / "id2label.json"
        trained = json.loads(own.read_text()) if own.exists() else None
        if trained is not None and trained != {str(k): v for k, v in id2label.items()}:
            raise ValueError(
                f"model {name!r} was trained on labels {sorted(trained.values())}, "
                f"but the test data has {sorted(id2label.values())}: they cannot be compared"
            )


def write_results(folder: Path, name: str, y_true, y_pred, confidence, ids: list, id2label) -> dict:
    """One model's per-label table, overall scores, confusion matrix and predictions."""
    per_label, overall = statistics(y_true, y_pred, id2label)
    folder.mkdir(parents=True, exist_ok=True)
    per_label.to_csv(folder / PER_LABEL_FILE, index=False, float_format="%.4f")
    (folder / "overall.json").write_text(json.dumps(overall, indent=2))
    label_names = [id2label[i] for i in sorted(id2label)]
    cm = confusion_matrix(y_true, y_pred, labels=sorted(id2label))
    pd.DataFrame(cm, index=label_names, columns=label_names).to_csv(folder / "confusion_matrix.csv")
    plot_confusion(
        cm, label_names, folder / "confusion_matrix.png", f"{name}: test confusion matrix"
    )
    pd.DataFrame(
        {
            "id": ids,
            "label": [id2label[i] for i in y_true],
            "predicted": [id2label[i] for i in y_pred],
            "confidence": confidence,
            "correct": y_true == y_pred,
        }
    ).to_csv(folder / "predictions.csv", index=False)
    print(
        f"{name}: accuracy={overall['accuracy']:.4f} macro_f1={overall['macro_f1']:.4f} "
        f"weighted_f1={overall['weighted_f1']:.4f}"
    )
    print(per_label.to_string(index=False, float_format=lambda x: f"{x:.4f}"))
    return overall


def main() -> None:
    args = parse_args()
    names = [n for n in args.model_names.split(",") if n]
    test = read_split(processing_input("test"))
    labels_file = processing_input("labels") / "id2label.json"
    id2label = {int(k): v for k, v in json.loads(labels_file.read_text()).items()}
    check_labels_match(names, id2label)
    out = processing_output("results")
    y_true = np.asarray(test.column("label_id"))
    ids = test.column("id").to_pylist() if "id" in test.column_names else list(range(len(test)))

    precision = resolve(args.mixed_precision, num_gpus=0)
    print(f"inference computes in {precision.applied}: {precision.reason}")
    performance, predictions, checked = {}, {}, {}
    for name in names:
        y_pred, confidence, checked[name] = predict(
            name, test, args.batch_size, args.model_format, precision
        )
        if checked[name]:
            print(f"{name}: bf16 against fp32 on {checked[name]}")
        predictions[name] = y_pred
        performance[name] = write_results(
            out / name, name, y_true, y_pred, confidence, ids, id2label
        )

    comparison = compare(names, performance, predictions, y_true, out) if len(names) > 1 else None
    winner = comparison["winner"] if comparison else names[0]
    folders = {name: model_dir(name) for name in names}
    report = processing_output("report")
    logged = log_models(folders, performance, winner, args.wandb_mode, args.wandb_project, report)
    write_step_metadata(
        report,
        {
            "holdout_performance": performance,
            "comparison": comparison,
            "model_format": args.model_format,
            "mixed_precision": precision.applied,
            "precision_reason": precision.reason,
            "against_fp32": checked if precision.bf16 else None,
            "wandb_artifacts": logged,
        },
    )


if __name__ == "__main__":
    run_step("inference", main)
