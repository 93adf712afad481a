"""Findings 1 and 6: a model is tested only on the test split of the data version it was
trained on, a combination whose label maps differ is refused by name, and Metadata records
store keys, so a store copied elsewhere still finds its models."""

from __future__ import annotations

import csv
import json
import shutil
import sys

import pytest

from pipeline.config import load_settings
from pipeline.driver import PipelineError, parse_steps, run_pipeline
from pipeline.paths import ExperimentTree
from pipeline.store import LocalStore
from tests.conftest import write_settings

TREE = ExperimentTree("test-exp")


def run(path, steps=None):
    settings = load_settings(path, {})
    return run_pipeline(
        settings, LocalStore(settings.store_uri()), parse_steps(steps), echo=sys.stdout
    )


def with_new_label(demo_raw, out):
    """The raw data again, with twelve articles of a label the first models never saw."""
    shutil.copytree(demo_raw, out)
    articles = sorted((out / "articles").glob("*.txt"))[:12]
    with open(out / "labels.csv", "a", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        for i, article in enumerate(articles):
            new = out / "articles" / f"zoo-{i}.txt"
            new.write_text("aardvark " * 20 + article.read_text())
            writer.writerow([new.stem, "aardvark"])
    return out


@pytest.mark.slow
def test_reused_models_are_tested_on_their_own_data_even_in_a_moved_store(demo_raw, tmp_path):
    store = tmp_path / "store"
    path = write_settings(tmp_path / "s.ini", str(store), models={"MODEL_NAMES": "bow"},
                          data={"RAW_DATA": str(demo_raw)}, training={"CHECKPOINT_EVERY_STEPS": "2"})  # fmt: skip
    first = run(path)
    # A completed run keeps no resume state: its checkpoints went when it completed.
    assert first["checkpoints_removed_bytes"] > 0
    assert not (store / TREE.run(1).checkpoints_root).exists()
    assert first["model_lineage"]["bow"]["data_version"] == 1
    assert len(first["model_lineage"]["bow"]["id2label"]) == 5
    assert first["model_artifacts"] == {"bow": "test-exp/runs/0001/models/bow/model/"}

    # New data with a sixth label: data 0002, no new model.
    newer = write_settings(tmp_path / "s2.ini", str(store), models={"MODEL_NAMES": "bow"},
                           data={"RAW_DATA": str(with_new_label(demo_raw, tmp_path / "raw2"))})  # fmt: skip
    assert run(newer, "reconcile,prepare")["status"] == "completed"
    labels2 = json.loads((store / TREE.data(2).split("labels") / "id2label.json").read_text())
    assert "aardvark" in labels2.values()

    # Inference alone: run 1's model on data 0001's test split, never on 0002's.
    again = run(newer, "inference")
    assert again["data_version"] == 1
    assert again["holdout_performance"] == first["holdout_performance"]
    predictions = (
        store / TREE.run(again["model_version"]).inference / "bow/predictions.csv"
    ).read_text()
    assert "aardvark" not in predictions
    with pytest.raises(PipelineError, match="would be tested on data they were not trained on"):
        run(newer, "prepare,inference")

    # The store copied elsewhere: its records name keys, so the models are found there.
    moved = tmp_path / "moved"
    shutil.copytree(store, moved)
    shutil.rmtree(store)
    there = write_settings(tmp_path / "s3.ini", str(moved), models={"MODEL_NAMES": "bow"})
    record = run(there, "inference")
    assert record["status"] == "completed" and record["data_version"] == 1
    assert record["holdout_performance"] == first["holdout_performance"]

    # A record that pairs the model with data labelled otherwise is refused, naming both.
    meta = moved / TREE.run(1).metadata
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "data_version": 2}))
    for later in range(2, record["model_version"] + 1):  # leave run 1 the newest with models
        (moved / TREE.run(later).metadata).unlink()
    with pytest.raises(
        PipelineError,
        match=r"model 'bow' of run 0001 knows labels \[.*\], but data 0002 has \[.*'aardvark'",
    ):
        run(there, "inference")
