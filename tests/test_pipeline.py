"""The whole pipeline on a small slice of real data, with the real pretrained model, the store
on moto's S3 server and every job a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline.config import ConfigError, load_settings
from pipeline.driver import PipelineError, parse_steps, run_pipeline
from pipeline.paths import ExperimentTree
from pipeline.sources import upload_raw
from pipeline.store import S3Store, download_dir, is_complete, read_manifest
from tests.conftest import ROOT, write_settings

SECRET = "wandb-secret-abcdef0123456789"


def run(settings_path, steps=None, store=None):
    settings = load_settings(settings_path)
    store = store or S3Store(settings.store_uri())
    return run_pipeline(settings, store, parse_steps(steps), echo=sys.stdout), store


@pytest.fixture
def staged(bucket, demo_raw):
    store = S3Store(f"s3://{bucket}/root")
    upload_raw(store, ExperimentTree("test-exp"), demo_raw)
    return store


@pytest.mark.slow
def test_two_models_end_to_end(staged, bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    path = write_settings(tmp_path / "settings.ini", f"s3://{bucket}/root", tracking={"WANDB_MODE": "offline"},
                          data={"MAX_SEQUENCE_LENGTH": "32"}, training={"EPOCHS": "2", "BATCH_SIZE": "8", "MAX_PER_DEVICE_BATCH_SIZE": "4",
                                    # MiniLM's state is 270 MB: epoch-end checkpoints only, one kept
                                    "CHECKPOINT_EVERY_STEPS": "0", "KEEP_CHECKPOINTS": "1"})  # fmt: skip
    monkeypatch.setenv("WANDB_MODE", "offline")  # never reach wandb's servers from a test
    record, store = run(path)
    tree = ExperimentTree("test-exp")
    run1, data1 = tree.run(1), tree.data(1)
    assert record["status"] == "completed" and record["model_version"] == 1

    # Reconciled snapshot and its manifest: hash, rows, labels, what was dropped.
    snapshot = json.loads(store.get_bytes(data1.reconciled + "snapshot.json"))
    assert snapshot["rows"] == 59 and len(snapshot["label_counts"]) == 5
    assert snapshot["dropped"] == {"label_without_article": ["bbc-99999"], "article_without_label": ["bbc-00001"],
                                   "duplicate_label": ["bbc-00003"], "empty_article": []}  # fmt: skip
    assert (
        record["data_snapshot_hash"] == snapshot["snapshot_hash"]
        and len(snapshot["snapshot_hash"]) == 64
    )
    assert is_complete(store, data1.reconciled)

    # Prepared splits with every model's columns prefixed, and id2label.
    import datasets

    download_dir(store, data1.prepared + "test/", tmp_path / "test")
    test = datasets.load_from_disk(str(tmp_path / "test"))
    for column in (
        "minilm_input_ids",
        "minilm_attention_mask",
        "bow_input_ids",
        "bow_attention_mask",
        "label_id",
    ):
        assert column in test.column_names
    id2label = json.loads(store.get_bytes(data1.prepared + "labels/id2label.json"))
    assert sorted(id2label.values()) == ["business", "entertainment", "politics", "sports", "tech"]

    # Per model: curves, TorchScript, loadable weights, history; inference stats. The
    # checkpoints are gone: a completed run is not resumed.
    assert store.list_keys(run1.checkpoints_root) == [] and record["checkpoints_removed_bytes"]
    for model in ("minilm", "bow"):
        keys = store.list_keys(run1.model(model) + "model/")
        for name in (
            "model.safetensors",
            "model.torchscript.pt",
            "curves.png",
            "history.json",
            "smpipe.json",
        ):
            assert run1.model(model) + "model/" + name in keys
        history = json.loads(store.get_bytes(run1.model(model) + "model/history.json"))
        assert [h["epoch"] for h in history] == [1, 2]
        train = record["steps"]["train"]["details"]["models"][model]
        assert train["exports"]["torchscript"]["passed"] and train["best_epoch"] in (1, 2)
        overall = json.loads(store.get_bytes(run1.inference + f"{model}/overall.json"))
        assert overall["rows"] == len(test) and record["holdout_performance"][model] == overall
        per_label = store.get_bytes(run1.inference + f"{model}/per_label.csv").decode().splitlines()
        assert per_label[0] == "label,precision,recall,f1,accuracy,support"
        f1s = [float(line.split(",")[3]) for line in per_label[1:]]
        assert f1s == sorted(f1s, reverse=True)
    comparison = json.loads(store.get_bytes(run1.inference + "comparison.json"))
    assert comparison["pairs"][0]["agree"] + comparison["pairs"][0]["disagree"] == len(test)
    assert "McNemar" in comparison["test"]

    # The TorchScript file, loaded in a fresh process, predicts what inference reported.
    download_dir(store, run1.model("minilm") + "model/", tmp_path / "minilm")
    predictions = (
        store.get_bytes(run1.inference + "minilm/predictions.csv").decode().splitlines()[1:]
    )
    reported = [line.split(",")[2] for line in predictions]
    script = (
        "import sys, json, torch, datasets\n"
        "m = torch.jit.load(sys.argv[1] + '/model.torchscript.pt')\n"
        "t = datasets.load_from_disk(sys.argv[2]).with_format('torch')[:]\n"
        "ids = json.load(open(sys.argv[1] + '/id2label.json'))\n"
        "out = m(t['minilm_input_ids'], t['minilm_attention_mask']).argmax(-1).tolist()\n"
        "print(json.dumps([ids[str(i)] for i in out]))\n"
    )
    fresh = subprocess.run([sys.executable, "-c", script, str(tmp_path / "minilm"), str(tmp_path / "test")],
                           capture_output=True, text=True, check=True)  # fmt: skip
    assert json.loads(fresh.stdout.strip().splitlines()[-1]) == reported

    # The best model's weights load again into the user's model.
    from safetensors.torch import load_model

    from user_functions import load_model as user_load_model

    model = user_load_model(
        "bow", {int(k): v for k, v in id2label.items()}, {v: int(k) for k, v in id2label.items()}
    )
    download_dir(store, run1.model("bow") + "model/", tmp_path / "bow")
    load_model(model, str(tmp_path / "bow/model.safetensors"))

    # A model card beside each model, as the Hub reads one (huggingface_hub's ModelCard): its
    # metadata, then the labels, the training settings and each epoch's metrics.
    from huggingface_hub import ModelCard

    for name, folder in (("bow", tmp_path / "bow"), ("minilm", tmp_path / "minilm")):
        card = ModelCard.load(folder / "README.md")
        best = json.loads((folder / "smpipe.json").read_text())
        assert card.data.pipeline_tag == "text-classification" and "smpipe" in card.data.tags
        [result] = card.data.eval_results
        assert result.metric_type == "f1" and result.metric_value == round(
            best["best_validation_f1"], 4
        )
        assert all(f"| {label} |" in card.text for label in id2label.values())
        assert "| learning_rate |" in card.text and "| mixed_precision |" in card.text
        assert f"| {best['best_epoch']} (best) |" in card.text, name
    assert ModelCard.load(tmp_path / "minilm/README.md").data.library_name == "transformers"

    # Metadata: every step's section, its own object too; nothing fabricated.
    for step in ("reconcile", "prepare", "train", "inference"):
        section = record["steps"][step]
        assert (
            section["status"] == "completed" and section["job_names"] and section["time_taken"] > 0
        )
        assert json.loads(store.get_bytes(run1.step_metadata(step)))["step"] == step
    assert record["raw_file_size"] > 0 and record["raw_format"] == "csv:1,txt:60"
    assert record["steps"]["train"]["gpu_usage"] is None  # no GPU here: not invented
    assert set(record["model_artifacts"]) == {"minilm", "bow"}

    # Secrets never reach the store: settings copy, Metadata, logs, wandb files.
    for key in store.list_keys("test-exp/"):
        assert SECRET.encode() not in store.get_bytes(key), key

    # A second run: run 2 beside run 1, nothing of run 1 touched.
    before = {
        k: read_manifest(store, k.rsplit("/", 1)[0])
        for k in store.list_keys(run1.prefix)
        if k.endswith("_MANIFEST.json")
    }
    record2, _ = run(path, steps="inference")
    assert record2["model_version"] == 2 and record2["data_version"] == 1
    after = {k: read_manifest(store, k.rsplit("/", 1)[0]) for k in before}
    assert before == after
    assert store.list_keys(tree.run(2).inference)


def test_one_model_and_reuse_of_earlier_steps(staged, bucket, tmp_path):
    path = write_settings(
        tmp_path / "settings.ini", f"s3://{bucket}/root", models={"MODEL_NAMES": "bow"}
    )
    record, store = run(path)
    assert record["status"] == "completed" and list(record["holdout_performance"]) == ["bow"]
    assert not store.exists(ExperimentTree("test-exp").run(1).inference + "comparison.json")
    # Inference alone reuses run 1's model and data, and says so.
    record2, _ = run(path, steps="inference")
    assert record2["model_version"] == 2
    assert record2["steps"]["inference"]["details"]["models_from"].endswith("runs/0001/models/")
    assert record2["holdout_performance"] == record["holdout_performance"]


def test_skipping_steps_with_nothing_to_reuse_fails_before_writing(bucket, tmp_path):
    path = write_settings(tmp_path / "settings.ini", f"s3://{bucket}/root")
    store = S3Store(f"s3://{bucket}/root")
    with pytest.raises(PipelineError, match="no complete prepared data"):
        run(path, steps="train", store=store)
    with pytest.raises(ConfigError, match="no raw data"):
        run(path, store=store)
    assert store.list_keys("") == []


def test_dry_run_launches_nothing(staged, bucket, tmp_path):
    path = write_settings(tmp_path / "settings.ini", f"s3://{bucket}/root")
    before = staged.list_keys("")
    done = subprocess.run([sys.executable, str(ROOT / "run_pipeline.py"), str(path), "--dry-run"],
                          capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "1. reconcile (processing job test-exp-next-run-num-reconcile-" in done.stdout
    assert "3. train [minilm] (training job test-exp-next-run-num-train-minilm-" in done.stdout
    assert "test-exp/runs/<next run_num>/models/bow/" in done.stdout
    # The plan lists every input each job receives: inference reads the labels too.
    inference = done.stdout.split("5. inference")[1]
    for channel in ("code", "test", "labels", "models"):
        assert f"input  {channel}" in inference, channel
    assert staged.list_keys("") == before


def test_a_missing_raw_data_folder_is_named_before_anything_is_written(tmp_path):
    path = write_settings(
        tmp_path / "settings.ini", str(tmp_path / "store"), data={"RAW_DATA": "no_such_folder"}
    )
    done = subprocess.run(
        [sys.executable, str(ROOT / "run_pipeline.py"), str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 2  # a settings problem
    assert f"[data] RAW_DATA: {tmp_path / 'no_such_folder'}: no such folder" in done.stderr
    assert not list((tmp_path / "store").rglob("*.json"))
