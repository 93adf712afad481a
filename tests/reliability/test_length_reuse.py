"""MAX_SEQUENCE_LENGTH is applied once, by prepare, and recorded beside the data it shaped.

A run that skips prepare (`--steps train,inference`) after the length changed must not train
on rows cut at the old length (or cut them again while inference sees them whole): the data
is prepared again at the new length (or taken from the cache), and reused once it is."""

from __future__ import annotations

import json
import sys

import datasets
import pytest

from pipeline.config import load_settings
from pipeline.driver import parse_steps, run_pipeline
from pipeline.paths import ExperimentTree
from pipeline.store import LocalStore
from steps.prepared_files import ENCODING
from tests.conftest import write_settings
from user_functions import load_tokenizer

TREE = ExperimentTree("test-exp")


def run(path, steps=None):
    settings = load_settings(path, {})
    store = LocalStore(settings.store_uri())
    return run_pipeline(settings, store, parse_steps(steps), echo=sys.stdout)


def settings_at(tmp_path, demo_raw, length: int):
    return write_settings(
        tmp_path / f"s{length}.ini",
        str(tmp_path / "store"),
        # The baseline reads MiniLM's tokenizer (user_functions): the same rows, a model that
        # trains and exports in a fraction of MiniLM's time.
        models={"MODEL_NAMES": "bow"},
        data={"RAW_DATA": str(demo_raw), "MAX_SEQUENCE_LENGTH": str(length)},
        training={
            "EPOCHS": "1",
            "MAX_STEPS": "2",
            "BATCH_SIZE": "8",
            "CHECKPOINT_EVERY_STEPS": "0",
        },
    )


def rows(store_root, version: int, split: str) -> list[list[int]]:
    folder = store_root / TREE.data(version).split(split)
    return datasets.load_from_disk(str(folder))["bow_input_ids"]


@pytest.mark.slow
def test_a_new_length_with_steps_train_inference_prepares_again(demo_raw, tmp_path):
    store_root = tmp_path / "store"
    first = run(settings_at(tmp_path, demo_raw, 64))
    assert first["status"] == "completed" and first["data_version"] == 1

    # The length changes; the user asks for training and inference only.
    second = run(settings_at(tmp_path, demo_raw, 24), "train,inference")
    assert second["status"] == "completed"
    assert second["planned_steps"] == ["prepare", "train", "inference"]
    assert second["data_version"] == 2  # new prepared data, from data 0001's snapshot
    encoding = json.loads((store_root / TREE.data(2).split("labels") / ENCODING).read_text())
    assert encoding["max_length"] == 24

    # Training and inference both read data 0002, whose rows are whole at 24 tokens: a row
    # cut by prepare still ends with the tokenizer's closing token (training cuts nothing).
    run2 = TREE.run(second["model_version"])
    assert second["model_lineage"]["bow"]["data_version"] == 2
    assert second["steps"]["inference"]["details"]["data_version"] == 2
    record = json.loads((store_root / run2.model("bow") / "model" / "smpipe.json").read_text())
    assert record["max_length"] == 24
    sep = load_tokenizer("bow").sep_token_id
    for split in ("train", "test"):
        lengths = [len(r) for r in rows(store_root, 2, split)]
        assert max(lengths) == 24 and all(r[-1] == sep for r in rows(store_root, 2, split))
    assert max(len(r) for r in rows(store_root, 1, "train")) == 64

    # The same length again: the data prepared at 24 is reused as it is, nothing is prepared.
    third = run(settings_at(tmp_path, demo_raw, 24), "train,inference")
    assert third["status"] == "completed" and third["planned_steps"] == ["train", "inference"]
    assert third["data_version"] == 2
    assert third["model_lineage"]["bow"]["data_version"] == 2
