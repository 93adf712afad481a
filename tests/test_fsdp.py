"""DISTRIBUTED_STRATEGY = fsdp on CPU (gloo), as it runs on GPUs (NCCL): a small BERT sharded
across two processes trains, validates with as many forwards on each process, checkpoints its
shards (DCP), resumes after SIGTERM to the same losses, resumes at another number of processes,
and gathers its final model to the main process; with LoRA too. Refusals name the setting."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from steps import checkpointing as ckpt
from steps.finetuning import FinetuningError, check_models
from steps.hyperparameters import DEFAULTS
from steps.user_code import load_user_functions
from tests.jobs.prepared import write_small_splits
from tests.jobs.training_job import HPS, Gated, job_root, result, run_to_end, start

FSDP = {**HPS, "distributed_strategy": "fsdp"}
TINY_BERT = {"SMPIPE_USER_FUNCTIONS": "tests.jobs.tiny_bert"}


@pytest.fixture(scope="module")
def channels(tmp_path_factory) -> dict[str, Path]:
    """17 validation rows: two processes get 9 and 8, in 3 and 2 batches of 4 (the FSDP job
    makes a spare forward on the second, or both would wait forever)."""
    return write_small_splits(tmp_path_factory.mktemp("prepared"), validation=17)


def fsdp_root(tmp: Path, channels, hps: dict = FSDP):
    root, env = job_root(tmp, channels, hps)
    return root, {**env, **TINY_BERT}


def report(root: Path) -> dict:
    return json.loads((root / "output/data/step_metadata.json").read_text())


def history(root: Path) -> list[dict]:
    return result(root)[1]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, channels):
    """Two processes, never interrupted, started cold: the jobs the tests interrupt and resume
    are forked by a fork server (`warm`, as the local backend starts them), so a resumed warm
    job is compared with a cold one."""
    root, env = fsdp_root(tmp_path_factory.mktemp("fsdp-baseline"), channels)
    run_to_end(env, processes=2)
    return root


def test_two_processes_train_sharded_and_gather_the_model_to_the_main_one(baseline):
    done = report(baseline)
    assert done["distributed_strategy"] == "fsdp" and done["processes"] == 2
    assert [h["step"] for h in history(baseline)] == [8, 16, 24]
    assert done["exports"]["torchscript"]["passed"], done["exports"]
    assert len(done["peak_memory"]) == 2
    # The saved model is the whole one, as from_pretrained loads it, and is the best epoch's.
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(baseline / "model")
    assert sum(p.numel() for p in model.parameters()) == done["parameters"]


def test_sigterm_mid_epoch_then_resume_gives_the_same_losses(tmp_path, channels, baseline, warm):
    """SIGTERM to the entrypoint alone, as `docker stop` and a spot reclaim send it: both
    processes finish step 13, write their shards and exit 75; the job run again resumes from
    them and ends where the uninterrupted one ended."""
    root, env = fsdp_root(tmp_path, channels)
    job = Gated(env, tmp_path / "gates", 13, processes=2, warm=warm)
    job.proc.send_signal(signal.SIGTERM)
    out = job.output()
    assert job.proc.returncode == 75, out[-3000:]
    assert "SIGTERM: checkpoint written at step 13" in out
    shards = ckpt.current_checkpoint(root / "checkpoints")
    manifest = json.loads((shards / ckpt.MANIFEST).read_text())["files"]
    assert {"sharded/__0_0.distcp", "sharded/__1_0.distcp", "sharded/metadata"} <= set(manifest)
    out = run_to_end(env, processes=2, warm=warm)
    assert "resumed from" in out and "at step 13" in out
    for resumed, uninterrupted in zip(history(root), history(baseline), strict=True):
        for key in ("train_loss", "val_loss"):
            assert resumed[key] == pytest.approx(uninterrupted[key], abs=1e-5), key
    weights, expected = result(root)[0], result(baseline)[0]
    for name in expected:
        torch.testing.assert_close(weights[name], expected[name], rtol=0, atol=1e-5)


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_shards_resume_at_another_number_of_processes(tmp_path, channels, before, after, warm):
    root, env = fsdp_root(tmp_path, channels)
    job = Gated(env, tmp_path / "gates", 13, processes=before, warm=warm)
    job.proc.send_signal(signal.SIGTERM)
    assert "SIGTERM: checkpoint written" in job.output()
    out = run_to_end(env, processes=after, warm=warm)
    assert f"the checkpoint was written by {before} processes" in out, out[-3000:]
    done = report(root)
    assert done["processes"] == after and done["resumed_from"]["step"] == 13
    steps = history(root)
    assert [h["step"] for h in steps] == [8, 16, 24]
    assert all(0 < h["train_loss"] < 5 for h in steps), steps


def test_lora_under_fsdp_checkpoints_only_what_trains(tmp_path, channels, warm):
    hps = {**FSDP, "finetuning": "lora", "epochs": "2"}
    root, env = fsdp_root(tmp_path, channels, hps)
    run_to_end(env, processes=2, warm=warm)
    done = report(root)
    assert done["finetuning"] == "lora" and done["lora_merge"]["passed"]
    checkpoint = ckpt.checkpoint_names(root / "checkpoints")[-1]
    metadata = dcp.FileSystemReader(root / "checkpoints" / checkpoint / "sharded").read_metadata()
    saved = {
        k.removeprefix("model.") for k in metadata.state_dict_metadata if k.startswith("model.")
    }
    assert saved and all("lora_" in k or "modules_to_save" in k for k in saved), sorted(saved)
    assert (root / "model/adapter/adapter_config.json").exists()


def test_a_resume_with_another_strategy_is_refused_naming_both(tmp_path, channels, warm):
    root, env = fsdp_root(tmp_path, channels, {**HPS, "epochs": "1"})
    run_to_end(env, warm=warm)
    (root / "input/config/hyperparameters.json").write_text(json.dumps({**FSDP, "epochs": "1"}))
    proc = start(env, processes=1, warm=warm)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0
    assert (
        "the checkpoints were written with DISTRIBUTED_STRATEGY = ddp and this job has "
        "DISTRIBUTED_STRATEGY = fsdp" in out
    ), out[-3000:]
    assert "step=1/" not in out


def test_fsdp_on_a_model_without_layers_is_refused_before_any_job():
    """The demo's bag of embeddings has no layer to shard: said by name, before any job."""
    functions = load_user_functions("user_functions")
    hp = {**DEFAULTS, "distributed_strategy": "fsdp"}
    problems = check_models(functions, {"bow": hp, "minilm": hp})
    assert len(problems) == 1, problems
    assert "DISTRIBUTED_STRATEGY = fsdp: model 'bow'" in problems[0]
    assert "_no_split_modules" in problems[0]
    with pytest.raises(FinetuningError):
        from steps.finetuning import check_blocks

        check_blocks(torch.nn.Linear(2, 2), "x", "m")


LOCKED = """
import threading

from tests.jobs.tiny_bert import encode, load_tokenizer, ordered_input_keys, reconcile  # noqa
from tests.jobs.tiny_bert import load_model as tiny


def load_model(model_name, id2label, label2id):
    model = tiny(model_name, id2label, label2id)
    model.lock = threading.Lock()  # what a copy of the model cannot take
    return model
"""


def test_a_model_that_cannot_be_copied_is_refused_before_any_job(tmp_path, monkeypatch):
    """The final model is gathered into a copy of the model made before it is sharded: one
    holding a lock is refused by name before any job, not in the training job's set-up."""
    (tmp_path / "locked_functions.py").write_text(LOCKED)
    monkeypatch.syspath_prepend(str(tmp_path))
    functions = load_user_functions("locked_functions")
    problems = check_models(functions, {"bert": {**DEFAULTS, "distributed_strategy": "fsdp"}})
    assert len(problems) == 1, problems
    assert (
        "DISTRIBUTED_STRATEGY = fsdp: model 'bert' (locked_functions.load_model) cannot be copied"
        in problems[0]
    )
    assert "lock" in problems[0]
