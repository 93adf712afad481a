"""How prepare splits the reconciled rows: stratified by label (scikit-learn's
train_test_split), and rows whose inputs are the same kept in one split."""

from __future__ import annotations

import sys

import datasets
import pytest

from steps import prepare
from steps.splits import grouped_split, repeats_together, stratified_split

ARGUMENTS = {"--model-names": "minilm", "--max-length": "16", "--train-fraction": "0.6",
             "--validation-fraction": "0.2", "--test-fraction": "0.2", "--seed": "3"}  # fmt: skip


def prepared(
    tmp_path, monkeypatch, rows: list[dict], functions: str = "user_functions", column="text"
) -> dict[str, list]:
    """prepare.main on `rows`, as its processing job runs it: each split's `column`."""
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "snapshot/dataset"))
    monkeypatch.setenv("SM_PROCESSING_INPUT_SNAPSHOT", str(tmp_path / "snapshot"))
    for name in ("train", "validation", "test", "labels", "report"):
        monkeypatch.setenv(f"SM_PROCESSING_OUTPUT_{name.upper()}", str(tmp_path / name))
    monkeypatch.setenv("SMPIPE_USER_FUNCTIONS", functions)
    monkeypatch.setattr(sys, "argv", ["prepare", *(x for kv in ARGUMENTS.items() for x in kv)])
    prepare.main()
    return {
        name: datasets.load_from_disk(str(tmp_path / name))[column]
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
    assert "20 rows repeat, for their label, what a model's encode reads of another row" in said


def test_rows_without_repeats_are_split_as_before(tmp_path, monkeypatch, capsys):
    """Data with no repeated input gets the split it always had: the same rows, by seed."""
    import argparse

    rows = [{"id": f"r{i}", "text": f"text {i}", "label": "abc"[i % 3]} for i in range(30)]
    splits = prepared(tmp_path, monkeypatch, rows)
    args = argparse.Namespace(
        validation_fraction=0.2, test_fraction=0.2, train_fraction=0.6, seed=3
    )
    labels = [i % 3 for i in range(30)]
    expected = stratified_split(labels, dict(enumerate("abc")), args)
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
    with pytest.raises(
        ValueError, match=r"too few rows \{'b': 1\}.*counting once the rows of one label"
    ):
        grouped_split(labels, groups, {0: "a", 1: "b"}, args)


def test_a_label_copying_another_labels_texts_reaches_every_split_and_cut_texts_stay_apart(
    tmp_path, monkeypatch, capsys
):
    """Rows of one text and another label (label noise) are not grouped with it: grouped by
    the first row's label, such a label never reached train. Texts alike only once cut to
    MAX_SEQUENCE_LENGTH (a long common header) are not one input: grouping them refused to
    split a label whose twelve articles began with the same twenty words."""
    texts = [f"article number {i} about {'markets' if i % 2 else 'football'}" for i in range(40)]
    rows = [{"id": f"r{i}", "text": t, "label": "ab"[i % 2]} for i, t in enumerate(texts)]
    rows += [{**row, "id": f"again-{row['id']}"} for row in rows[:20]]
    rows += [{"id": f"d{i}", "text": texts[2 * i], "label": "d"} for i in range(10)]
    header = "aardvark " * 40  # past the 16 tokens rows are cut to (ARGUMENTS)
    rows += [{"id": f"z{i}", "text": f"{header}article {i}", "label": "z"} for i in range(10)]
    splits = prepared(tmp_path, monkeypatch, rows)
    copied = {texts[2 * i] for i in range(10)}  # in two labels: no memory would score them
    assert not (set(splits["train"]) & (set(splits["validation"]) | set(splits["test"]))) - copied
    labels = {name: datasets.load_from_disk(str(tmp_path / name))["label"] for name in splits}
    for label in "dz":  # 0.6/0.2/0.2 of ten rows, as any label
        assert [labels[n].count(label) for n in labels] == [6, 2, 2], label
    assert "20 rows repeat" in capsys.readouterr().out


WORDS = """
from user_functions import load_model, reconcile  # noqa: F401 - prepare calls neither


def load_tokenizer(model_name):
    from user_functions import load_tokenizer

    return load_tokenizer("minilm")


def encode(batch, tokenizer, model_name, max_length):  # words already split, as NER data is
    return tokenizer(batch["words"], is_split_into_words=True, truncation=True, max_length=max_length)


def ordered_input_keys(model_name):
    return ["input_ids", "attention_mask"]
"""


def test_an_encode_that_reads_a_list_column_is_split(tmp_path, monkeypatch, capsys):
    """Pre-split words, a list per row: grouping by Arrow's dictionary encoding of the column
    failed prepare ("no kernel matching input types (list<item: string>)")."""
    (tmp_path / "words_functions.py").write_text(WORDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"id": f"r{i}", "words": ["word", str(i), "ab"[i % 2]], "label": "ab"[i % 2]}
            for i in range(40)]  # fmt: skip
    rows += [{**rows[0], "id": "again"}]
    splits = prepared(tmp_path, monkeypatch, rows, "words_functions", column="words")
    assert sum(len(part) for part in splits.values()) == 41
    assert "1 rows repeat" in capsys.readouterr().out


def test_a_large_group_that_pulls_a_split_far_from_its_fraction_is_said(capsys):
    """One text repeated 60 times among 90 others stays in one split: where that is validation
    or test, the split is far from its fraction, and the run says so, naming a row of it."""
    import argparse

    ids = [[101, i, 102] for i in range(90)] + [[101, 7000, 102]] * 60
    labels = [i % 3 for i in range(90)] + [0] * 60
    dataset = datasets.Dataset.from_dict({"m_input_ids": ids})
    warned = []
    for seed in range(10):
        args = argparse.Namespace(
            train_fraction=0.6, validation_fraction=0.2, test_fraction=0.2, seed=seed
        )
        parts = repeats_together(
            dataset, [["m_input_ids"]], labels, dict(enumerate("abc")), args, {}
        )
        out = " ".join(capsys.readouterr().out.split())
        sizes = [len(parts[n]) / 150 for n in ("train", "validation", "test")]
        far = max(abs(a - b) for a, b in zip(sizes, (0.6, 0.2, 0.2), strict=True)) > 0.05
        assert ("far from the fractions asked: a group of 60 rows" in out) == far, out
        if far:
            warned.append(out)
    assert warned and all("(row 90 and its copies)" in out for out in warned)
