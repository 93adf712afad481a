"""How prepare splits the reconciled rows: stratified by label (scikit-learn's
train_test_split), and rows whose inputs are the same kept in one split."""

from __future__ import annotations

import sys

import datasets
import pytest

from steps import prepare

ARGUMENTS = {"--model-names": "minilm", "--max-length": "16", "--train-fraction": "0.6",
             "--validation-fraction": "0.2", "--test-fraction": "0.2", "--seed": "3"}  # fmt: skip


def prepared(tmp_path, monkeypatch, rows: list[dict]) -> dict[str, list[str]]:
    """prepare.main on `rows`, as its processing job runs it: each split's texts."""
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "snapshot/dataset"))
    monkeypatch.setenv("SM_PROCESSING_INPUT_SNAPSHOT", str(tmp_path / "snapshot"))
    for name in ("train", "validation", "test", "labels", "report"):
        monkeypatch.setenv(f"SM_PROCESSING_OUTPUT_{name.upper()}", str(tmp_path / name))
    monkeypatch.setenv("SMPIPE_USER_FUNCTIONS", "user_functions")
    monkeypatch.setattr(sys, "argv", ["prepare", *(x for kv in ARGUMENTS.items() for x in kv)])
    prepare.main()
    return {
        name: datasets.load_from_disk(str(tmp_path / name))["text"]
        for name in ("train", "validation", "test")
    }


def test_rows_with_the_same_text_are_kept_in_one_split(tmp_path, monkeypatch, capsys):
    """BBC News holds the same article under two ids; a reconcile written as the datasets docs
    show keeps both, and a stratified split of rows put one in train and one in test, where
    the model was scored on what it had memorised. Each text's rows now go to one split."""
    texts = [f"article number {i} about {'markets' if i % 2 else 'football'}" for i in range(40)]
    rows = [{"id": f"r{i}", "text": t, "label": "ab"[i % 2]} for i, t in enumerate(texts)]
    rows += [{**row, "id": f"again-{row['id']}"} for row in rows[:20]]  # twenty texts twice
    splits = prepared(tmp_path, monkeypatch, rows)
    assert sum(len(texts) for texts in splits.values()) == 60
    train = set(splits["train"])
    assert not train & set(splits["validation"]) and not train & set(splits["test"])
    assert not set(splits["validation"]) & set(splits["test"])
    said = " ".join(capsys.readouterr().out.split())
    assert "20 rows repeat the text of another row: each such group is kept in one split" in said


def test_rows_without_repeats_are_split_as_before(tmp_path, monkeypatch, capsys):
    """Data with no repeated input gets the split it always had: the same rows, by seed."""
    import argparse

    rows = [{"id": f"r{i}", "text": f"text {i}", "label": "abc"[i % 3]} for i in range(30)]
    splits = prepared(tmp_path, monkeypatch, rows)
    args = argparse.Namespace(
        validation_fraction=0.2, test_fraction=0.2, train_fraction=0.6, seed=3
    )
    labels = [i % 3 for i in range(30)]
    expected = prepare.stratified_split(labels, dict(enumerate("abc")), args)
    assert {n: [rows[i]["text"] for i in idx] for n, idx in expected.items()} == splits
    assert "repeat" not in capsys.readouterr().out


def test_too_few_distinct_inputs_for_a_label_are_refused_saying_repeats_count_once():
    import argparse

    import numpy as np

    args = argparse.Namespace(
        validation_fraction=0.2, test_fraction=0.2, train_fraction=0.6, seed=3
    )
    labels = [0] * 10 + [1] * 10
    groups = np.array(list(range(10)) + [10] * 10)  # label 1: one text, ten times
    with pytest.raises(ValueError, match=r"labels with too few rows \{'b': 1\}.*counted once"):
        prepare.grouped_split(labels, groups, {0: "a", 1: "b"}, args)
