"""Tuning on the local backend: trials are training jobs, the objective is read off their logs
with the metric definition's regex, and the best trial's model is the one tested."""

from __future__ import annotations

import json
import sys

from pipeline.config import load_settings
from pipeline.driver import parse_steps, run_pipeline
from pipeline.store import LocalStore
from tests.conftest import write_settings
from tests.test_user_functions import REVIEWS, write_module, write_reviews


def tuning_settings(tmp_path, **tuning):
    write_module(tmp_path, "reviews_tuning", REVIEWS)
    write_reviews(tmp_path / "raw")
    return write_settings(
        tmp_path / "settings.ini", str(tmp_path / "store"),
        experiment={"USER_FUNCTIONS": "reviews_tuning", "NAME": "reviews", "JOB": "tune"},
        data={"RAW_DATA": str(tmp_path / "raw")}, models={"MODEL_NAMES": "tiny"},
        training={"MAX_SEQUENCE_LENGTH": "12"},
        tuning={"STRATEGY": "Random", "MAX_JOBS": "3", "MAX_PARALLEL_JOBS": "2", **tuning},
        **{"tuning.hyperparameters": {"LEARNING_RATE": "0.001->0.1 log", "EPOCHS": "1,3", "BATCH_SIZE": None}},
    )  # fmt: skip


def test_random_search_picks_the_best_trial(tmp_path):
    settings = load_settings(tuning_settings(tmp_path), env={})
    store = LocalStore(settings.store_uri())
    record = run_pipeline(settings, store, parse_steps(None), echo=sys.stdout)
    assert record["status"] == "completed"
    tune = record["steps"]["tune"]
    # One tuning job per model, as on SageMaker; its trials are in its details.
    assert "train" not in record["steps"] and len(tune["job_names"]) == 1
    details = tune["details"]["models"]["tiny"]
    trials = details["trials"]
    assert details["ran_as"] == "Random" and len(trials) == 3
    for trial in trials:
        assert trial["status"] == "Completed" and 0 <= trial["objective"] <= 1
        assert 0.001 <= float(trial["hyperparameters"]["learning_rate"]) <= 0.1
        assert trial["hyperparameters"]["epochs"] in ("1", "3")
    best = max(trials, key=lambda t: t["objective"])
    assert details["best"] == best
    # The best trial's model is promoted to where a training job leaves a model.
    promoted = record["model_artifacts"]["tiny"]
    assert promoted == "reviews/runs/0001/models/tiny/model/"  # a key: the store may move
    best_files = store.root / best["model"]
    for name in ("model.safetensors", "model.torchscript.pt"):
        assert (best_files / name).read_bytes() == (store.root / promoted / name).read_bytes()
    # The objective read off the log is the best epoch's F1 the trial itself recorded.
    report = json.loads((best_files.parent / "output/step_metadata.json").read_text())
    assert abs(report["best_validation_f1"] - best["objective"]) < 1e-6
    assert record["steps"]["inference"]["details"]["models_from"] == "reviews/runs/0001/models/"


def test_grid_runs_every_categorical_combination(tmp_path):
    path = tuning_settings(tmp_path, STRATEGY="Grid", MAX_JOBS="10", MAX_PARALLEL_JOBS="2")
    import configparser

    parser = configparser.ConfigParser(interpolation=None, delimiters=("=",))
    parser.optionxform = str.upper
    parser.read(path)
    parser.set("tuning.hyperparameters", "LEARNING_RATE", "0.01,0.05")
    parser.set("tuning.hyperparameters", "EPOCHS", "1,2")
    with open(path, "w") as f:
        parser.write(f)
    settings = load_settings(path, env={})
    record = run_pipeline(
        settings,
        LocalStore(settings.store_uri()),
        parse_steps("reconcile,prepare,train"),
        echo=sys.stdout,
    )
    trials = record["steps"]["tune"]["details"]["models"]["tiny"]["trials"]
    combos = {
        (t["hyperparameters"]["learning_rate"], t["hyperparameters"]["epochs"]) for t in trials
    }
    assert combos == {("0.01", "1"), ("0.01", "2"), ("0.05", "1"), ("0.05", "2")}
