"""What `smpipe predict` checks before anything runs (pipeline/predict/checks.py): the run and
model it uses, read from run records written by hand, and its INPUT and OUTPUT; each refusal
says why and what would do."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipeline.config import load_settings
from pipeline.paths import ExperimentTree
from pipeline.predict.checks import check_files, choose
from pipeline.store import LocalStore
from tests.conftest import write_settings

TREE = ExperimentTree("test-exp")


def test_a_run_that_did_not_complete_is_refused(tmp_path):
    store = LocalStore(tmp_path / "store")
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "store"))
    store.put_bytes(
        TREE.run(1).metadata,
        json.dumps({"status": "failed", "model_artifacts": {"bow": "x/"}}).encode(),
    )
    settings = load_settings(path, env={})
    assert choose(settings, store, 1, None)[1] == [
        "--run 1: run 0001 is failed, not completed: predict uses its models"]  # fmt: skip
    assert choose(settings, store, None, None)[1] == [
        f"no completed run of 'test-exp' in {store.uri} has trained a model (smpipe runs)"]  # fmt: skip


def test_a_run_that_only_tested_names_the_run_whose_models_it_tested(tmp_path):
    """`--steps inference` tests an earlier run's models and trains none. `--run` of it said
    "records no winner (its inference step did not compare ): name one with --model", and
    with --model, "its models: none"."""
    store = LocalStore(tmp_path / "store")
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "store"))
    trained = {"status": "completed", "model_artifacts": {"bow": TREE.run(1).model("bow")}}
    tested = {
        "status": "completed",
        "experiment_name": "test-exp",
        "sources": {"models": TREE.run(1).models},
        "holdout_performance": {"bow": {"macro_f1": 0.5}},
    }
    for run_num, record in ((1, trained), (2, tested)):
        store.put_bytes(TREE.run(run_num).metadata, json.dumps(record).encode())
    settings = load_settings(path, env={})
    said = [
        "--run 2: run 0002 trained no model: it tested bow of run 0001 (--run 1 predicts with it)"
    ]
    assert choose(settings, store, 2, None)[1] == said
    assert choose(settings, store, 2, "bow")[1] == said
    # By default, the newest completed run that trained a model: run 0001.
    assert choose(settings, store, None, "bow")[0].run == TREE.run(1)


def test_an_input_or_output_whose_name_is_not_utf8_is_refused_by_name(tmp_path):
    """A Linux file name may hold any byte: `in\xe9.csv` (latin-1). Predict read it, then
    failed writing its record with a UnicodeEncodeError traceback."""
    source = tmp_path / os.fsdecode(b"in\xe9.csv")
    source.write_text("id,text\n1,Shares rose sharply today.\n")
    output = Path(os.fsdecode(bytes(tmp_path) + b"/out\xe9.csv"))
    problems = check_files(source, output, ["text"])[2]
    assert problems == [
        f"INPUT {tmp_path}/in\\xe9.csv holds bytes that are not UTF-8, and a run's records, S3 "
        "keys and SageMaker's requests are UTF-8: rename it (or the folder it is in)",
        f"OUTPUT {tmp_path}/out\\xe9.csv holds bytes that are not UTF-8, and a run's records, "
        "S3 keys and SageMaker's requests are UTF-8: rename it (or the folder it is in)",
    ]
