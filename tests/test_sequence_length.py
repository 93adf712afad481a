"""MAX_SEQUENCE_LENGTH is applied once, by prepare, and recorded beside the data it shaped
(labels/encoding.json); nothing after prepare cuts a row, and a row longer than the record
is an error, never a silent cut."""

from __future__ import annotations

import json
import sys

import datasets
import pyarrow as pa
import pytest

from steps.batching import Batches, read_split
from steps.prepared_files import (
    ENCODING,
    encoding_record,
    parse_encoding,
    read_encoding,
    tokenizer_identity,
)
from user_functions import load_tokenizer

INPUTS = {"keys": ["input_ids"], "pad": {"input_ids": 0}, "sequence": ["input_ids"]}


def table(lengths: list[int]) -> pa.Table:
    ids = [[101] + [7] * (n - 2) + [102] for n in lengths]
    return pa.table({"m_input_ids": ids, "m__length": lengths, "label_id": [0] * len(lengths)})


def test_rows_are_used_whole_and_one_longer_than_the_record_is_an_error():
    batches = Batches(table([4, 16, 9]), "m", ["input_ids"], INPUTS, max_length=16)
    assert batches.lengths.tolist() == [4, 16, 9]  # never cut
    assert batches([1])["input_ids"].shape == (1, 16)
    with pytest.raises(ValueError, match=r"row 1 of model 'm' has 20 tokens, more than the 16"):
        Batches(table([4, 20, 9]), "m", ["input_ids"], INPUTS, max_length=16)


def test_the_record_is_read_back_or_its_absence_said(tmp_path):
    with pytest.raises(FileNotFoundError, match="encoding.json is missing.*run prepare again"):
        read_encoding(tmp_path)
    (tmp_path / ENCODING).write_text(json.dumps({"models": {}}))
    with pytest.raises(ValueError, match="records no max_length"):
        read_encoding(tmp_path)
    record = encoding_record(64, {"m": {"tokenizer": {"name_or_path": "x", "class": "y"}}})
    assert parse_encoding(json.dumps(record).encode()) == {
        "max_length": 64,
        "models": {"m": {"tokenizer": {"name_or_path": "x", "class": "y"}}},
    }


def test_prepare_records_the_length_and_each_tokenizer_beside_the_data(tmp_path, monkeypatch):
    from steps import prepare

    rows = [{"id": f"r{i}", "text": f"row{i} " + "word " * (3 + 5 * i), "label": "ab"[i % 2]}
            for i in range(30)]  # fmt: skip
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "snapshot/dataset"))
    monkeypatch.setenv("SM_PROCESSING_INPUT_SNAPSHOT", str(tmp_path / "snapshot"))
    for name in ("train", "validation", "test", "labels", "report"):
        monkeypatch.setenv(f"SM_PROCESSING_OUTPUT_{name.upper()}", str(tmp_path / name))
    monkeypatch.setenv("SMPIPE_USER_FUNCTIONS", "user_functions")
    arguments = {"--model-names": "minilm,bow", "--max-length": "16", "--train-fraction": "0.8",
                 "--validation-fraction": "0.1", "--test-fraction": "0.1", "--seed": "1"}  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["prepare", *(x for kv in arguments.items() for x in kv)])
    prepare.main()

    record = read_encoding(tmp_path / "labels")
    assert record["max_length"] == 16 and set(record["models"]) == {"minilm", "bow"}
    # The columns of the snapshot each model's encode read, id and label aside: predict's.
    assert [record["models"][m]["reads"] for m in ("minilm", "bow")] == [["text"], ["text"]]
    tokenizer = record["models"]["minilm"]["tokenizer"]
    assert tokenizer["name_or_path"].endswith("model") and tokenizer["class"].startswith(
        "transformers."
    )
    # The same tokenizer, before or after a call sets its truncation: the same identity.
    loaded = load_tokenizer("minilm")
    loaded(["a b c"], truncation=True, max_length=4)
    assert tokenizer_identity(loaded) == tokenizer
    split = read_split(tmp_path / "train")
    assert max(split.column("minilm__length").to_pylist()) == 16  # cut here, once
    Batches(split, "minilm", ["input_ids"], {**INPUTS, "pad": {"input_ids": 0}}, max_length=16)


def test_another_tokenizer_than_the_one_that_encoded_the_rows_is_told_apart():
    """predict refuses, and the training job does not save, a tokenizer load_tokenizer returns
    now that is not the one encoding.json records; one of the two without a hash is not
    compared (steps/prepared_files.py `other_tokenizer`, their one check)."""
    from steps.prepared_files import other_tokenizer
    from user_functions import load_tokenizer

    tokenizer = load_tokenizer("minilm")
    record = {"models": {"m": {"tokenizer": tokenizer_identity(tokenizer)}}}
    assert other_tokenizer(tokenizer, record, "m") is None
    record["models"]["m"]["tokenizer"]["sha256"] = "0" * 16
    assert other_tokenizer(tokenizer, record, "m").endswith(f"records {'0' * 16} for " + repr(
        tokenizer.name_or_path))  # fmt: skip
    assert other_tokenizer(tokenizer, {"models": {}}, "m") is None
