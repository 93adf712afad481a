"""Training survives interruption: killed at random steps and resumed, it ends bitwise equal to
a run that was never interrupted; checkpoints are atomic; a corrupt one is skipped by path."""

from __future__ import annotations

import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from pipeline.backends.local import LocalBackend
from pipeline.jobs import TrainingJob
from pipeline.paths import ExperimentTree
from pipeline.player.fork_client import WarmStart
from pipeline.store import LocalStore, upload_dir
from steps import checkpointing as ckpt
from steps.hyperparameters import TUNABLE
from steps.sampler import ResumableBatchSampler
from tests.conftest import ROOT, SignalAtStep, ship_code, wait_at_gate
from tests.jobs.checkpoint_writer import CRASHES, new_state, save
from tests.jobs.training_job import HPS, Gated, job_root, result, run_to_end, start


def kill_at(
    env: dict, gates: Path, step: int, sig: int, processes: int = 1, warm: WarmStart | None = None
) -> str:
    """Start (or resume) the job and kill its whole process group in optimizer step `step`."""
    job = Gated(env, gates, step, processes, warm)
    # Every process of the job at once, as when a machine dies: the step (and torchrun's
    # workers) first, then the entrypoint.
    entrypoint = psutil.Process(job.proc.pid)
    for process in [*entrypoint.children(recursive=True), entrypoint]:
        try:
            process.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    return job.output()


def checkpointed_before(step: int) -> int:
    """The newest checkpoint a job killed in `step` leaves (HPS: every 3 optimizer steps, and
    at the end of each epoch of 8)."""
    return max(s for s in range(1, step) if s % 3 == 0 or s % 8 == 0)


def assert_same(a, b):
    (wa, ha), (wb, hb) = a, b
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{k} differs"
    assert ha == hb


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, channels):
    root, env = job_root(tmp_path_factory.mktemp("baseline"), channels)
    run_to_end(env)
    return result(root)


def test_sigkill_at_random_steps_resumes_bitwise_equal(tmp_path, channels, baseline, warm):
    root, env = job_root(tmp_path, channels)
    kill_steps = sorted(random.Random(11).sample(range(2, 23), 3))
    for step in kill_steps:
        kill_at(env, tmp_path / "gates", step, signal.SIGKILL, warm=warm)
    out = run_to_end(env, warm=warm)
    assert "resumed from" in out
    assert_same(result(root), baseline)
    report = json.loads((root / "output/data/step_metadata.json").read_text())
    assert report["resumed_from"]["step"] == checkpointed_before(kill_steps[-1])


def test_corrupt_current_checkpoint_is_named_and_the_previous_one_used(
    tmp_path, channels, baseline, warm
):
    root, env = job_root(tmp_path, channels)
    kill_at(env, tmp_path / "gates", 11, signal.SIGKILL, warm=warm)  # kept: 8 (epoch end), 9
    current = ckpt.current_checkpoint(root / "checkpoints")
    previous = ckpt.resume_candidates(root / "checkpoints")[1]
    state_file = current / ckpt.STATE_FILE
    state_file.write_bytes(state_file.read_bytes()[: state_file.stat().st_size // 2])  # truncated
    out = run_to_end(env, warm=warm)
    assert f"checkpoint {current} could not be loaded" in out
    assert f"resumed from {previous}" in out
    report = json.loads((root / "output/data/step_metadata.json").read_text())
    assert report["resumed_from"]["checkpoint"] == str(previous)
    assert_same(result(root), baseline)


@pytest.fixture(scope="module")
def baseline2(tmp_path_factory, channels):
    """Two processes shard every batch differently: their own uninterrupted reference."""
    root, env = job_root(tmp_path_factory.mktemp("baseline2"), channels)
    run_to_end(env, processes=2)
    return result(root)


def test_sigkill_with_two_processes(tmp_path, channels, baseline2, warm):
    """Killed twice and resumed under torchrun, forked as the local backend starts it (the
    agent and both workers: steps/runtime/torchrun_fork.py), against a cold baseline."""
    root, env = job_root(tmp_path, channels)
    for step in (4, 13):
        kill_at(env, tmp_path / "gates", step, signal.SIGKILL, processes=2, warm=warm)
    out = run_to_end(env, processes=2, warm=warm)
    assert "resumed from" in out and "processes=2" in out
    ckpt_files = {p.name for p in ckpt.current_checkpoint(root / "checkpoints").iterdir()}
    assert {"rank0.pt", "rank1.pt", "state.pt"} <= ckpt_files
    assert_same(result(root), baseline2)


def loader_workers(entrypoint: int) -> list[psutil.Process]:
    """DataLoader workers under a job's entrypoint: forks of a training process (same command
    line), which torchrun's workers are not."""
    found = []
    for process in psutil.Process(entrypoint).children(recursive=True):
        try:
            command, parent = process.cmdline(), process.parent().cmdline()
        except psutil.Error:
            continue
        if (
            "steps.train" in command
            and "torch.distributed.run" not in command + parent
            and "steps.train" in parent
        ):
            found.append(process)
    return found


@pytest.mark.parametrize("processes", [1, 2])
def test_sigterm_to_the_container_with_loader_workers_checkpoints_and_exits_75(
    tmp_path, channels, processes
):
    """The GPU path's loader, on CPU: two DataLoader workers beside each training process.
    SIGTERM goes to the entrypoint alone, as `docker stop` sends it to PID 1; it reaches the
    training processes and not their workers (a worker killed by it fails the training
    process's next batch): the job finishes its step, checkpoints, and exits 75, under
    torchrun too."""
    root, env = job_root(tmp_path, channels, {**HPS, "dataloader_num_workers": "2"})
    job = Gated(env, tmp_path / "gates", 4, processes)
    workers = loader_workers(job.proc.pid)
    job.proc.send_signal(signal.SIGTERM)
    log = job.output()
    assert len(workers) == 2 * processes, log[-3000:]
    assert job.proc.returncode == 75, log[-3000:]
    # The step the signal landed in (the job waited in it for the signal) is finished first.
    assert "SIGTERM: checkpoint written at step 4; exiting to be resumed" in log, log[-3000:]
    assert "killed by signal" not in log
    current = ckpt.current_checkpoint(root / "checkpoints")
    assert current is not None and current.name == f"ckpt-{4:08d}"
    assert not (root / "output/failure").exists()


def test_a_sigterm_in_an_epochs_last_step_resumes_into_its_end_and_writes_over_nothing(
    tmp_path, channels, baseline, warm
):
    """Step 8 ends the first epoch: its SIGTERM checkpoint comes before the epoch's end
    (validation, the best model), which the resumed job then does and checkpoints at the same
    step, under a name of its own: the checkpoint it resumed from is never written over (and,
    on SageMaker, its copy in S3 never mixed with the new one's files)."""
    root, env = job_root(tmp_path, channels)
    folder = root / "checkpoints"
    job = Gated(env, tmp_path / "gates", 8, warm=warm)
    job.proc.send_signal(signal.SIGTERM)
    log = job.output()
    assert job.proc.returncode == 75, log[-3000:]
    pending = ckpt.current_checkpoint(folder)
    assert pending.name == "ckpt-00000008" + ckpt.BEFORE_EPOCH_END, log[-3000:]
    written = {p.name: p.read_bytes() for p in pending.iterdir()}
    # Resumed after the epoch's 16 micro-batches (2 a step), it ends the epoch and is killed in
    # step 9, before that step's checkpoint.
    log = kill_at(env, tmp_path / "gates", 9, signal.SIGKILL, warm=warm)
    assert f"resumed from {pending} at step 8 (epoch 0, batch 16)" in log, log[-3000:]
    assert ckpt.checkpoint_names(folder) == [pending.name, "ckpt-00000008"]
    assert ckpt.current_checkpoint(folder).name == "ckpt-00000008"
    assert {p.name: p.read_bytes() for p in pending.iterdir()} == written
    manifest = json.loads((folder / "ckpt-00000008" / ckpt.MANIFEST).read_text())
    assert (manifest["epoch"], manifest["batch_in_epoch"]) == (1, 0)
    out = run_to_end(env, warm=warm)
    assert "resumed from" in out and "at step 8 (epoch 1, batch 0)" in out, out[-3000:]
    assert_same(result(root), baseline)


@pytest.mark.parametrize("processes", [1, 2])
def test_sigterm_checkpoints_exits_and_the_backend_restarts(tmp_path, channels, processes, request):
    reference = request.getfixturevalue("baseline" if processes == 1 else "baseline2")
    store = LocalStore(tmp_path / "store")
    for name, path in channels.items():
        upload_dir(store, path, f"data/{name}/")
    echo = io.StringIO()
    ship_code(store)
    backend = LocalBackend(
        store, ExperimentTree("t").run(1), work_root=str(tmp_path / "work"), echo=echo
    )
    job = TrainingJob(name="sigterm-test", step="train", code="code/", channels={c: f"data/{c}/" for c in channels},
                      hyperparameters=HPS, model_prefix="out/model/", output_prefix="out/output/",
                      checkpoint_prefix="out/checkpoints/", sagemaker_output="out/sm/",
                      max_restarts=2, processes_per_host=processes)  # fmt: skip
    with SignalAtStep(tmp_path / "gates", 7, lambda p: "steps.train" in p.cmdline()) as reclaim:
        job.env = reclaim.env
        outcome = backend.run_training(job)
    log = echo.getvalue()
    assert reclaim.sent and outcome.status == "Completed", outcome.failure_reason
    assert outcome.restarts == 1
    # The signal landed in step 7 (the job waited there for it): that step is finished first.
    assert "SIGTERM: checkpoint written at step 7;" in log, log
    assert "interrupted or killed; restart 1 of 2" in log
    assert re.search(r"resumed from \S+ckpt-0*7 at step 7 ", log), log
    (tmp_path / "final/model").mkdir(parents=True)
    for name in ("model.safetensors", "history.json"):
        store.download_file(f"out/model/{name}", tmp_path / "final/model" / name)
    assert_same(result(tmp_path / "final"), reference)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> tuple[Path, dict[str, int]]:
    """Checkpoints of steps 1 to 3, then a crash at each point of writing step 4's
    (tests/jobs/checkpoint_writer.py): each crash's folder and the status its process ended with."""
    root = tmp_path_factory.mktemp("crashed")
    done = subprocess.run(
        [sys.executable, "-m", "tests.jobs.checkpoint_writer", str(root), *CRASHES],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return root, {crash: int(status) for crash, status in map(str.split, done.stdout.splitlines())}


@pytest.mark.parametrize("crash", CRASHES)
def test_a_crash_while_writing_a_checkpoint_leaves_the_previous_one_current(crashed, crash):
    root, statuses = crashed
    directory = root / crash
    assert statuses[crash] == 9
    current = ckpt.current_checkpoint(directory)
    expected = 4 if crash == "after_pointer" else 3
    assert current.name == f"ckpt-{expected:08d}"
    # Nothing half-written is ever a candidate, and the current one loads whole.
    assert all(not p.name.endswith(".tmp") for p in ckpt.resume_candidates(directory))
    saved = torch.load(current / ckpt.STATE_FILE, weights_only=False)
    assert saved["step"] == expected and torch.all(saved["model"]["weight"] == expected)
    # The next save after the crash (a job restarted: here, this process) works and is current.
    save(directory, new_state(), 5)
    assert ckpt.current_checkpoint(directory).name == "ckpt-00000005"
    assert len(ckpt.checkpoint_names(directory)) == 2  # keep=2


def test_sampler_resumes_mid_epoch_with_the_unseen_batches():
    full = ResumableBatchSampler(50, per_device=4, accumulation=2, world=2, rank=1, seed=3)
    full.set_epoch(2)
    batches = list(full)
    assert len(batches) == full.batches_per_epoch == 8  # ceil(50 / 16) steps * 2 micro-batches
    resumed = ResumableBatchSampler(50, per_device=4, accumulation=2, world=2, rank=1, seed=3)
    resumed.load_state_dict({**full.state_dict(), "epoch": 2, "start": 5})
    assert list(resumed) == batches[5:]
    other_rank = ResumableBatchSampler(50, per_device=4, accumulation=2, world=2, rank=0, seed=3)
    other_rank.set_epoch(2)
    seen = [i for b in batches + list(other_rank) for i in b]
    assert set(seen) == set(range(50))  # every example, the padding wraps around
    with pytest.raises(ValueError, match="another run"):
        resumed.load_state_dict({**full.state_dict(), "n": 51})
    # Another number of processes (a resume after PROCESSES_PER_HOST changed): the same
    # optimizer step, in this world's micro-batches. One written before the shape was
    # recorded is refused.
    state = {**full.state_dict(), "world": 4, "per_device": 4, "accumulation": 1, "start": 3}
    resumed.load_state_dict(state)
    assert resumed.resharded == (4, 4, 1) and resumed.start == 3 * resumed.accumulation
    # Steps of other rows (the step count would mean other data), and another world from
    # before the split was recorded: refused, as no checkpoint of the run would load.
    with pytest.raises(ckpt.Unresumable, match=r"optimizer steps are 8 rows \(2 processes x 4 x 1"):
        resumed.load_state_dict({**state, "world": 2})
    old = {k: v for k, v in full.state_dict().items() if k not in ("per_device", "accumulation")}
    with pytest.raises(ckpt.Unresumable, match="written by 4 processes, by a version"):
        resumed.load_state_dict({**old, "world": 4})
    resumed.load_state_dict(old)  # the same world: loads, as before
    assert resumed.resharded is None


# The bag of embeddings with LoRA: an adapter on its embedding, its classifier in full (it has
# no repeated blocks for LORA_TARGET_MODULES = auto to find).
LORA = {**HPS, "finetuning": "lora", "lora_target_modules": "embedding"}


@pytest.fixture(scope="module")
def lora_baseline(tmp_path_factory, channels):
    root, env = job_root(tmp_path_factory.mktemp("lora-baseline"), channels, LORA)
    run_to_end(env)
    return result(root)


def test_a_lora_job_killed_at_a_step_resumes_bitwise_equal(tmp_path, channels, lora_baseline, warm):
    """A LoRA checkpoint holds only the adapters, the head and their optimizer state: the
    frozen weights come from load_model again, and the resumed job ends where one never
    interrupted ends."""
    root, env = job_root(tmp_path, channels, LORA)
    kill_at(env, tmp_path / "gates", 14, signal.SIGKILL, warm=warm)
    saved = torch.load(root / "checkpoints/ckpt-00000012/state.pt", weights_only=False)
    assert saved["finetuning"] == "lora"
    assert sorted(saved["model"]) == [
        "base_model.model.classifier.modules_to_save.default.bias",
        "base_model.model.classifier.modules_to_save.default.weight",
        "base_model.model.embedding.lora_embedding_A.default",
        "base_model.model.embedding.lora_embedding_B.default",
    ]
    out = run_to_end(env, warm=warm)
    assert "resumed from" in out and "at step 12" in out
    assert_same(result(root), lora_baseline)


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_a_job_resumed_with_another_number_of_processes_goes_on_from_the_same_step(
    tmp_path, channels, before, after, warm
):
    """A resume after PROCESSES_PER_HOST changed: the model, optimizer and scheduler are every
    process's alike, the position is taken in optimizer steps (batch 8 is 4 rows x 2 on one
    process, 4 x 1 on each of two), the epoch's loss so far is kept whole. It completes every
    epoch, from the step it was checkpointed at, and says what the checkpoint was written by."""
    root, env = job_root(tmp_path, channels, LORA)
    kill_at(env, tmp_path / "gates", 14, signal.SIGKILL, processes=before, warm=warm)
    out = run_to_end(env, processes=after, warm=warm)
    assert f"the checkpoint was written by {before} processes" in out, out[-3000:]
    report = json.loads((root / "output/data/step_metadata.json").read_text())
    assert report["processes"] == after
    # 4 steps into the second epoch, in the new world's micro-batches: 4 x its accumulation.
    resumed = report["resumed_from"]
    assert (resumed["step"], resumed["batch_in_epoch"]) == (12, 4 * (3 - after))
    assert report["resumed_from"]["written_by"] == {
        "processes": before, "per_device_batch": 4, "accumulation": 3 - before,
    }  # fmt: skip
    history = json.loads((root / "model/history.json").read_text())
    assert [h["step"] for h in history] == [8, 16, 24]
    assert all(0 < h["train_loss"] < 5 for h in history), history


def test_a_resume_of_another_method_or_training_is_refused_naming_both(tmp_path, channels, warm):
    """Checkpoints of full finetuning resumed with FINETUNING = lora (or back), or by a job of
    other hyperparameters given the same checkpoint folder (a job cloned with its
    CheckpointConfig): the job stops before its first step and says both, never hands back the
    other training's model as its own, nor trains from step 1 on the checkpoints' failure."""
    hps = {**HPS, "epochs": "1"}
    root, env = job_root(tmp_path, channels, hps)
    run_to_end(env, warm=warm)
    assert list((root / "checkpoints").glob("ckpt-*"))
    config = root / "input/config/hyperparameters.json"
    for asked, said in (
        ({**LORA, **hps}, "were written with FINETUNING = full and this job has FINETUNING = lora"),
        (
            {**hps, "epochs": "2", "learning_rate": "1e-05"},
            f"were written by another training (epochs = 1, learning_rate = "
            f"{float(HPS['learning_rate'])!r}; this job has epochs = 2, learning_rate = 1e-05): "
            "two jobs were given one checkpoint folder",
        ),
    ):
        config.write_text(json.dumps(asked))
        proc = start(env, processes=1, warm=warm)
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode != 0
        assert said in " ".join(out.split()), out[-3000:]
        assert "step=1/" not in out and "resumed from" not in out


CHANGED = {"epochs": "2", "learning_rate": "0.02", "batch_size": "4", "warmup_ratio": "0.4",
           "weight_decay": "0.5", "lora_r": "4", "lora_alpha": "32"}  # fmt: skip


def test_every_tunable_hyperparameter_changes_what_training_does(
    tmp_path, channels, baseline, lora_baseline, warm
):
    """A tuning job that searched a value training ignores would record a choice never made.
    LoRA's are compared with a LoRA job's model."""
    assert set(CHANGED) == set(TUNABLE)
    jobs = {}
    for name, value in CHANGED.items():  # all at once: each job is mostly start-up
        base = LORA if name.startswith("lora_") else HPS
        root, env = job_root(tmp_path / name, channels, {**base, name: value})
        jobs[name] = (root, start(env, processes=1, warm=warm))
    for name, (root, proc) in jobs.items():
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]
        weights, _ = result(root)
        before = lora_baseline if name.startswith("lora_") else baseline
        assert weights.keys() == before[0].keys()
        assert any(not torch.equal(weights[k], before[0][k]) for k in weights), name


# The demo's functions, their model made to fail in the 10th training forward pass of a job
# (step 5 at 2 micro-batches a step) while the file FAIL names exists: a run that fails in
# training after its checkpoint of step 4.
FAILING = """
from pathlib import Path

from user_functions import encode, load_tokenizer, ordered_input_keys, reconcile  # noqa: F401
from user_functions import load_model as demo_model

FAIL = {fail!r}


def load_model(model_name, id2label, label2id):
    model = demo_model(model_name, id2label, label2id)
    forwards = []

    def count(module, args):
        if module.training:
            forwards.append(1)
            if len(forwards) == 10 and Path(FAIL).exists():
                raise RuntimeError("failing on purpose, at step 5")

    model.register_forward_pre_hook(count)
    return model
"""


def test_a_run_resumed_with_more_processes_goes_on_from_its_checkpoint(tmp_path, demo_raw):
    """`--resume` after PROCESSES_PER_HOST changed: the driver allows the job's shape to change
    (and nothing else), and the training job loads the one-process checkpoint with two."""
    from pipeline import metadata as md
    from pipeline.config import load_settings
    from pipeline.driver import parse_steps, run_pipeline
    from pipeline.errors import PipelineError
    from tests.conftest import write_settings

    fail = tmp_path / "fail"
    fail.write_text("")
    (tmp_path / "failing_functions.py").write_text(FAILING.format(fail=str(fail)))

    def settings(**training):
        path = write_settings(
            tmp_path / "settings.ini", str(tmp_path / "store"),
            experiment={"USER_FUNCTIONS": "failing_functions"}, data={"RAW_DATA": str(demo_raw)},
            models={"MODEL_NAMES": "bow"},
            training={"CHECKPOINT_EVERY_STEPS": "2", "KEEP_CHECKPOINTS": "2", **training},
        )  # fmt: skip
        return load_settings(path, env={})

    store = LocalStore(tmp_path / "store")
    with pytest.raises(PipelineError, match="failing on purpose"):
        run_pipeline(settings(), store, parse_steps(None), echo=io.StringIO())
    fail.unlink()
    with pytest.raises(PipelineError, match=r"\[training\] EPOCHS: 1 -> 2\); resume with those"):
        run_pipeline(settings(EPOCHS="2", USE_DISTRIBUTED="true", PROCESSES_PER_HOST="2"),
                     store, parse_steps(None), echo=io.StringIO(), resume=1)  # fmt: skip
    # The run started a day before it is resumed: its time_taken is the parts' own times
    # summed, never the day between them.
    metadata = ExperimentTree(settings().experiment.name).run(1).metadata
    failed = json.loads(store.get_bytes(metadata))
    failed["start_time"] = md.iso(time.time() - 86400)
    store.put_bytes(metadata, json.dumps(failed).encode())
    echo = io.StringIO()
    record = run_pipeline(
        settings(USE_DISTRIBUTED="true", PROCESSES_PER_HOST="2"), store, parse_steps(None),
        echo=echo, resume=1,
    )  # fmt: skip
    assert record["status"] == "completed", echo.getvalue()[-3000:]
    assert failed["time_taken"] < record["time_taken"] < failed["time_taken"] + 43200
    report = record["steps"]["train"]["details"]["models"]["bow"]
    assert report["processes"] == 2 and report["resumed_from"]["step"] == 4
    assert report["resumed_from"]["written_by"]["processes"] == 1
    assert report["history"][-1]["step"] == 6


def test_a_rank_killed_by_a_signal_is_named_and_the_job_counts_as_killed(tmp_path, channels):
    """torchrun exits 1 whatever ended its worker, and the other rank then fails on a closed
    connection: the job's status is the signal's (128 + 11, which the backends' restart rule
    reads as killed: pipeline/player/exits.py) and its failure names the rank and the signal."""
    from tests.jobs.gate import marker

    root, env = job_root(tmp_path, channels)
    job = Gated(env, tmp_path / "gates", 5, processes=2)
    rank1 = marker(tmp_path / "gates", 5, rank=1)
    wait_at_gate(tmp_path / "gates", 5, lambda: job.proc.poll() is None)
    for _ in range(500):  # rank 1 reaches the same step at about the same time
        if rank1.exists():
            break
        threading.Event().wait(0.02)
    os.kill(int(rank1.read_text()), signal.SIGSEGV)
    job.output()
    assert job.proc.returncode == 128 + signal.SIGSEGV
    failure = (root / "output/failure").read_text()
    assert failure.startswith("the training step: rank 1 was killed by SIGSEGV"), failure
