"""Runs you can trust, and training that survives interruption: the promises no other test
holds. No bad model promoted (a non-finite validation loss, a TorchScript export that does not
match: nothing reaches the store); a driver that cleans up (Ctrl-C on the local and the
emulated backend, where the stop is SageMaker's StopProcessingJob; the 10-minute heartbeat
rule; changed settings refused on --resume); a checkpoint of another model, or one that lacks
keys, refused before it touches the model; the final model loaded with `from_pretrained`."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import socket
import time

import psutil
import pytest
import torch

from pipeline import cli
from pipeline.backends.local import LocalBackend
from pipeline.jobs import ProcessingJob, TrainingJob
from pipeline.paths import ExperimentTree
from pipeline.runs import SILENT_FOR, mark_abandoned, silent_driver
from pipeline.store import LocalStore, is_complete, upload_dir
from steps import checkpointing as ckpt
from steps.sampler import ResumableBatchSampler
from tests.conftest import ROOT, ship_code, write_settings
from tests.jobs.training_job import HPS
from tests.reliability.test_lifecycle import Driver
from tests.test_user_functions import REVIEWS, write_module, write_reviews

TREE = ExperimentTree("reviews")

# The demo's functions, but a model that goes wrong the way BAD_MODEL says: `nan`, its
# logits are NaN once it is evaluated (its training loss stays finite); `drift`, its answer
# depends on a Python counter, which a trace bakes in as a constant.
BAD_MODELS = """
import os

import torch
from user_functions import encode, load_tokenizer, ordered_input_keys, reconcile  # noqa: F401
from user_functions.baseline import BagOfEmbeddings


class Bad(BagOfEmbeddings):
    calls = 0

    def forward(self, input_ids, attention_mask):
        logits = super().forward(input_ids, attention_mask)
        if os.environ["BAD_MODEL"] == "nan" and not self.training:
            return logits * float("nan")
        if os.environ["BAD_MODEL"] == "drift":
            self.calls += 1
            return logits + self.calls  # the same softmax: it trains as well as the rest
        return logits


def load_model(model_name, id2label, label2id):
    return Bad(30522, len(id2label), dim=16)
"""


@pytest.fixture
def bad_code(tmp_path):
    """The store with the run's code: steps/, the demo's functions and the bad models."""
    store = LocalStore(tmp_path / "store")
    code = tmp_path / "code"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in ("steps", "user_functions"):
        shutil.copytree(ROOT / package, code / package, ignore=ignore)
    (code / "bad_models.py").write_text(BAD_MODELS)
    upload_dir(store, code, "code/")
    return store


def test_no_bad_model_reaches_the_store(bad_code, channels, tmp_path):  # noqa: F811
    store = bad_code
    for name, path in channels.items():
        upload_dir(store, path, f"data/{name}/")
    backend = LocalBackend(store, TREE.run(1), echo=io.StringIO(), work_root=str(tmp_path / "w"))
    failures = {}
    for bad in ("nan", "drift"):
        job = TrainingJob(
            name=f"bad-{bad}", step="train", code="code/", channels={c: f"data/{c}/" for c in channels},
            hyperparameters={**HPS, "epochs": "1", "exports": "torchscript"},
            model_prefix=f"{bad}/model/", output_prefix=f"{bad}/output/",
            checkpoint_prefix=f"{bad}/checkpoints/", sagemaker_output=f"{bad}/sm/",
            env={"SMPIPE_USER_FUNCTIONS": "bad_models", "BAD_MODEL": bad},
        )  # fmt: skip
        result = backend.run_training(job)
        assert result.status == "Failed", result
        failures[bad] = result.failure_reason
        # Nothing of the job is promoted: no model, no report; only its log is kept.
        assert store.list_keys(f"{bad}/model/") == store.list_keys(f"{bad}/output/") == []
        assert store.exists(TREE.run(1).log(job.name))
    backend.close(succeeded=True)
    assert "the validation loss is nan after optimizer step 8 (epoch 1)" in failures["nan"]
    assert "no model is kept" in failures["nan"]
    assert "the torchscript export does not match the eager model" in failures["drift"]
    assert "[training] EXPORTS" in failures["drift"]


def test_a_job_that_completes_with_an_empty_output_fails_and_nothing_is_kept(tmp_path):
    """An empty output would be cached and reused by every later run: the job fails, naming
    where it wrote nothing, and no manifest seals the output."""
    store = LocalStore(tmp_path / "store")
    ship_code(store)
    job = ProcessingJob(name="empty-1", step="tests.jobs.probe_signal", code="code/", inputs={},
                        outputs={"seen": "outputs/seen/"})  # fmt: skip
    backend = LocalBackend(store, TREE.run(1), echo=io.StringIO(), work_root=str(tmp_path / "w"))
    result = backend.run_processing(job)
    backend.close(succeeded=False)
    assert result.status == "Failed"
    assert result.failure_reason == (
        f"the job completed but wrote nothing to {store.uri_of('outputs/seen/')}"
    )
    assert not is_complete(store, "outputs/seen/") and store.list_keys("outputs/") == []


# The reviews' functions, with a reconcile that takes its time (a big raw folder, say) and
# leaves a note of the signal that stopped it, where the test reads it.
SLOW = (
    REVIEWS
    + """
import signal as _signal
import time as _time

_reconcile = reconcile


def _stopped(signum, frame):
    Path(NOTE).write_text(_signal.Signals(signum).name)
    raise SystemExit(1)


def reconcile(raw_dir):
    for signum in (_signal.SIGINT, _signal.SIGTERM):
        _signal.signal(signum, _stopped)
    print("reconcile: reading a big raw folder", flush=True)
    _time.sleep(120)
    return _reconcile(raw_dir)
"""
)


def slow_settings(tmp_path, backend: str, **data):
    write_module(tmp_path, "reviews_slow", SLOW + f"\nNOTE = {str(tmp_path / 'stopped-by')!r}\n")
    if not (tmp_path / "raw").exists():
        write_reviews(tmp_path / "raw", n=30)
    return write_settings(tmp_path / "settings.ini", str(tmp_path / "store"),
                          experiment={"USER_FUNCTIONS": "reviews_slow", "NAME": "reviews",
                                      "BACKEND": backend},
                          data={"RAW_DATA": str(tmp_path / "raw"), "MAX_SEQUENCE_LENGTH": "12", **data},
                          models={"MODEL_NAMES": "tiny"})  # fmt: skip


def test_ctrl_c_stops_the_jobs_with_stop_requests_and_marks_the_run_interrupted(tmp_path, capsys):
    """Ctrl-C (SIGINT) to the driver, on the emulated backend: its job is stopped as on
    SageMaker, with StopProcessingJob, which the step sees as SIGINT (the emulator plays
    build-your-own-processing-container's "SIGINT and SIGKILL"; a driver that merely died
    would end it with SIGTERM), the job's processes end, the run is marked interrupted
    (SIGTERM on the local backend: tests/reliability/test_lifecycle.py). A --resume with other
    settings is then refused, each change named, and nothing runs; so is one with edited user
    code."""
    settings = slow_settings(tmp_path, "emulated")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    driver = Driver(settings, tmp, "--steps", "reconcile")
    driver.wait_for("reconcile: reading a big raw folder", timeout=180)
    started = psutil.Process(driver.proc.pid).children(recursive=True)
    driver.proc.send_signal(signal.SIGINT)
    assert driver.finish(timeout=120) == 130, driver.output
    assert "run 0001 interrupted" in driver.output and "--resume 1 continues it" in driver.output
    assert re.search(r"\[reviews-0001-reconcile-\d{6}\] stop requested", driver.output)
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    assert (tmp_path / "stopped-by").read_text() == "SIGINT"
    record = json.loads((tmp_path / "store" / TREE.run(1).metadata).read_text())
    assert record["status"] == "interrupted"
    fractions = {"TRAIN_FRACTION": "0.7", "TEST_FRACTION": "0.2"}
    changed = slow_settings(tmp_path, "emulated", SEED="7", **fractions)
    assert cli.main(["run", str(changed), "--resume", "1"]) == 2  # refused before anything runs
    error = capsys.readouterr().err
    assert "--resume 1: the settings differ from the ones run 0001 started with" in error
    assert "([data] SEED: 42 -> 7; [data] TEST_FRACTION: 0.1 -> 0.2; " in error
    assert "[data] TRAIN_FRACTION: 0.8 -> 0.7)" in error
    # The same settings, the user functions edited since (a fix, say): the resume would run
    # the run's own code/, not the edit, and is refused naming the file.
    same = slow_settings(tmp_path, "emulated")
    edited = (tmp_path / "reviews_slow.py").read_text() + "\nFIXED = True\n"
    write_module(tmp_path, "reviews_slow", edited)
    assert cli.main(["run", str(same), "--resume", "1"]) == 2
    error = capsys.readouterr().err
    assert "--resume 1: your code differs from the code run 0001 started with" in error
    assert "(reviews_slow.py: changed)" in error and "start a new run" in error
    assert json.loads((tmp_path / "store" / TREE.run(1).metadata).read_text()) == record


def test_what_editors_leave_beside_a_package_of_user_functions_is_neither_shipped_nor_told(
    tmp_path,
):
    """A backup, a swap file, notebook checkpoints, Finder's record: not code, so not shipped
    with the run's code/, and no reason to refuse a --resume; a data file of the package is."""
    from pipeline.code_bundle import user_files
    from pipeline.config import load_settings

    package = tmp_path / "mine"
    (package / ".ipynb_checkpoints").mkdir(parents=True)
    (package / "__init__.py").write_text(REVIEWS)
    (package / "vocab.json").write_text("{}")
    for junk in ("__init__.py~", ".__init__.py.swp", ".DS_Store", ".ipynb_checkpoints/a.py"):
        (package / junk).write_text("not code")
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "store"),
                          experiment={"USER_FUNCTIONS": "mine"})  # fmt: skip
    assert sorted(user_files(load_settings(path, env={}))) == [
        "mine/__init__.py",
        "mine/vocab.json",
    ]


def test_a_run_whose_driver_is_silent_for_ten_minutes_is_abandoned(tmp_path):
    """The heartbeat rule, on a driver that may live on another machine (its pid cannot be
    asked): silent for SILENT_FOR seconds, and it is taken for gone."""
    store = LocalStore(tmp_path / "store")
    assert SILENT_FOR == 600
    run = TREE.run(1)
    store.put_bytes(run.claim, b"{}")
    store.put_bytes(run.metadata, json.dumps({"status": "running"}).encode())
    now = time.time()
    beat = {"host": "another-machine", "pid": os.getpid(), "time": now - SILENT_FOR + 5}
    store.put_bytes(run.heartbeat, json.dumps(beat).encode())
    assert silent_driver(store, run, now) is None
    mark_abandoned(store, TREE)
    assert json.loads(store.get_bytes(run.metadata))["status"] == "running"
    # Ten minutes without a beat: abandoned, even with a pid that is alive here.
    beat.update(time=now - SILENT_FOR - 5, host=socket.gethostname())
    store.put_bytes(run.heartbeat, json.dumps(beat).encode())
    assert "has been silent since" in silent_driver(store, run, now)
    mark_abandoned(store, TREE)
    record = json.loads(store.get_bytes(run.metadata))
    assert record["status"] == "abandoned" and "has been silent since" in record["failure_reason"]


def state_of(model: torch.nn.Module) -> ckpt.State:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    sampler = ResumableBatchSampler(20, 4, 1, 1, 0, seed=1)
    return ckpt.State(model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler,
                      seed=1, run_name="r")  # fmt: skip


def write_checkpoint(directory, state: ckpt.State, step: int):
    state.step = step
    tmp = ckpt.begin_checkpoint(directory, ckpt.checkpoint_name(step))
    ckpt.write_rank_state(tmp, 0, state)
    return ckpt.finish_checkpoint(directory, tmp, state, None, keep=3)


@pytest.mark.parametrize("foreign", ["another model", "missing keys"])
def test_a_checkpoint_that_is_not_this_jobs_is_refused_before_it_touches_the_model(
    tmp_path, foreign
):
    """Refused whole, naming why, with the model as it was: the job (steps/train.py `resume`)
    names the checkpoint's path and tries the one before it."""
    torch.manual_seed(0)
    mine = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 3))
    write_checkpoint(tmp_path, state_of(mine), 4)
    if foreign == "another model":
        other = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 3))
        current = write_checkpoint(tmp_path, state_of(other), 8)
        expected = (
            "checkpoint is for another model: missing [], unexpected [], other shapes ['0.weight'"
        )
    else:
        current = write_checkpoint(tmp_path, state_of(mine), 8)
        saved = torch.load(current / ckpt.STATE_FILE, weights_only=False)
        del saved["optimizer"], saved["sampler"]
        torch.save(saved, current / ckpt.STATE_FILE)
        expected = "checkpoint lacks ['optimizer', 'sampler']"
    assert ckpt.resume_candidates(tmp_path)[0] == current
    torch.manual_seed(1)
    fresh = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 3))
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    state = state_of(fresh)
    with pytest.raises(KeyError, match=re.escape(expected)):
        ckpt.load_checkpoint(current, state, rank=0)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    assert state.step == 0
    previous = ckpt.resume_candidates(tmp_path)[1]
    ckpt.load_checkpoint(previous, state, rank=0)  # the one before it loads
    assert state.step == 4 and torch.equal(fresh[1].weight, mine[1].weight)


def test_the_final_model_of_a_hugging_face_model_loads_with_from_pretrained(tmp_path):
    """A transformers model is saved as save_pretrained saves it, with no optimizer state:
    AutoModelForSequenceClassification.from_pretrained gives back the same model."""
    from transformers import AutoModelForSequenceClassification, BertConfig
    from transformers import BertForSequenceClassification as Bert

    from steps.training_blocks import save_final_model

    config = BertConfig(vocab_size=99, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, num_labels=3, id2label={0: "a", 1: "b", 2: "c"},
                        label2id={"a": 0, "b": 1, "c": 2})  # fmt: skip
    torch.manual_seed(0)
    model = Bert(config).eval()
    save_final_model(model, tmp_path, {"model_name": "tiny-bert"})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json", "model.safetensors", "smpipe.json",
    ]  # fmt: skip
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert type(loaded) is Bert and loaded.config.id2label == config.id2label
    ids = torch.tensor([[2, 5, 7, 3], [2, 9, 3, 0]])
    mask = (ids != 0).long()
    with torch.no_grad():
        assert torch.equal(model(ids, mask).logits, loaded(ids, mask).logits)
