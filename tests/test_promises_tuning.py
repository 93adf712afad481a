"""The tuning table's promises no other test holds, through the local backend's real tuning
job (pipeline/backends/local_tuning.py) with trials that are real jobs of the image's
entrypoint (tests/jobs/probe_epochs.py: the metric line once an epoch, its scores a known
function of the learning rate): Random is Optuna's random sampler, log-uniform on a `log`
interval; Minimize promotes the smallest objective; Hyperband stops trials that fall behind
at a rung, SIGTERM and no restart; a Ctrl-C during parallel trials stops them at once."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import threading
import time

import optuna
import pytest

from pipeline.backends.local import LocalBackend
from pipeline.jobs import TrainingJob, TuningJob
from pipeline.paths import ExperimentTree
from pipeline.search_space import Interval
from pipeline.store import LocalStore, upload_dir
from steps.metrics import DEFINITIONS
from tests.conftest import ship_code
from tests.jobs.probe_epochs import quality

RUN = ExperimentTree("probe").run(1)
LEARNING_RATES = Interval(1e-4, 1e-1, integer=False, log=True)
SEED = 3


class Echo(io.StringIO):
    """The backend's echo, readable while trials write to it."""

    def count(self, text: str) -> int:
        return self.getvalue().count(text)


@pytest.fixture
def local(tmp_path, monkeypatch):
    """A local backend on a store holding the code and a channel; jobs start cold (the probe
    imports nothing a fork server would save)."""
    monkeypatch.setenv("SMPIPE_WARM_START", "0")
    store = LocalStore(tmp_path / "store")
    ship_code(store)
    (tmp_path / "train").mkdir()
    (tmp_path / "train/rows.txt").write_text("1\n")
    upload_dir(store, tmp_path / "train", "data/train/")
    echo = Echo()
    backend = LocalBackend(store, RUN, echo=echo, work_root=str(tmp_path / "work"))
    yield store, backend, echo
    backend.close(succeeded=True)


def tuning(strategy: str, objective: str, objective_type: str, trials: int, parallel: int,
           epochs: int, **static: str) -> TuningJob:  # fmt: skip
    trial = TrainingJob(
        name="probe-0001-tune-probe", step="tests.jobs.probe_epochs", code="code/",
        channels={"train": "data/train/"},
        hyperparameters={"model_name": "probe", "epochs": str(epochs), "seed": str(SEED), **static},
        model_prefix=RUN.best_trial_model("probe"), output_prefix=RUN.model("probe") + "output/",
        checkpoint_prefix=RUN.checkpoints("probe"), sagemaker_output=RUN.training_output,
        metric_definitions=DEFINITIONS,
    )  # fmt: skip
    return TuningJob(name="probe-0001-tune-probe", trial=trial,
                     ranges={"learning_rate": LEARNING_RATES}, strategy=strategy,
                     objective_metric=objective, objective_type=objective_type,
                     max_jobs=trials, max_parallel_jobs=parallel)  # fmt: skip


def learning_rate(trial: dict) -> float:
    return float(trial["hyperparameters"]["learning_rate"])


def test_random_search_minimizing_draws_log_uniform_values_and_promotes_the_smallest(local):
    store, backend, _ = local
    job = tuning("Random", "validation:loss", "Minimize", trials=4, parallel=1, epochs=1)
    result = backend.run_tuning(job)
    assert result.status == "Completed", result.failure_reason
    details = result.details
    assert (details["sampler"], details["pruner"]) == ("RandomSampler", "NopPruner")
    # The values are those Optuna's random sampler draws from a log-uniform distribution
    # with the study's seed (the trial's seed hyperparameter), in order.
    reference = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=SEED))
    log_uniform = optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)
    drawn = [
        reference.ask({"learning_rate": log_uniform}).params["learning_rate"] for _ in range(4)
    ]
    assert [learning_rate(t) for t in details["trials"]] == [float(f"{v:.6g}") for v in drawn]
    # Minimize: the smallest validation loss is promoted, the probe's highest learning rate.
    losses = {t["number"]: t["objective"] for t in details["trials"]}
    assert all(
        loss == pytest.approx(1 - quality(learning_rate(t)), abs=1e-6)
        for t, loss in zip(details["trials"], losses.values(), strict=True)
    )
    best = details["best"]
    assert best["objective"] == min(losses.values())
    assert learning_rate(best) == max(learning_rate(t) for t in details["trials"])
    assert json.loads(store.get_bytes(job.trial.model_prefix + "model.json")) == {
        "learning_rate": learning_rate(best)
    }


def test_hyperband_stops_the_trials_that_fall_behind_at_a_rung_and_never_restarts_them(local):
    """Six trials of three epochs, one at a time: the study is named after the run and model,
    so Hyperband's brackets (drawn from the name) and the seeded sampler's values are the same
    every time, and trials that fall behind at the first rung are stopped there: SIGTERM, half
    a second before their next epoch ends, and no restart."""
    store, backend, echo = local
    job = tuning("Hyperband", "validation:f1", "Maximize", trials=6, parallel=1, epochs=3,
                 epoch_seconds="0.5")  # fmt: skip
    result = backend.run_tuning(job)
    assert result.status == "Completed", result.failure_reason
    details = result.details
    assert details["pruner"] == "HyperbandPruner" and details["sampler"] == "TPESampler"
    stopped = [t for t in details["trials"] if t["status"] == "Stopped"]
    completed = [t for t in details["trials"] if t["status"] == "Completed"]
    assert stopped and len(stopped) + len(completed) == 6
    for trial in stopped:  # at a rung, by the pruner, never again
        epochs = {int(k): v for k, v in trial["epochs"].items()}
        said = re.fullmatch(
            r"early stopping: validation:f1=(\S+) at epoch (\d)", trial["stop_reason"]
        )
        assert said and said[1] == f"{epochs[int(said[2])]:.4f}", trial["stop_reason"]
        # The last objective it reported, as SageMaker's FinalHyperParameterTuningJob-
        # ObjectiveMetric is for a stopped trial (pipeline/backends/local_tuning.py).
        assert trial["objective"] == epochs[max(epochs)]
        assert echo.count(f"[{trial['job_name']}] interrupted or killed; restart") == 0
    # Stopped at the first rung (epoch 1): the trial never trained its last epoch.
    first_rung = [t for t in stopped if t["stop_reason"].endswith(" at epoch 1")]
    assert first_rung and all(len(t["epochs"]) < 3 for t in first_rung)
    # Each finished trial's objective is its last epoch's, as the regex read it off its log.
    for trial in completed:
        assert trial["objective"] == pytest.approx(quality(learning_rate(trial)), abs=1e-6)
    assert details["best"]["objective"] == max(t["objective"] for t in completed)
    assert store.list_keys(RUN.checkpoints_root) == []


def test_ctrl_c_during_parallel_trials_stops_them_at_once(local):
    """Two trials at once, each waiting 120 s after its first epoch: Ctrl-C (KeyboardInterrupt
    in the driver's main thread, as SIGINT raises it) stops both within seconds, and their
    records say Interrupted (a resumed run continues them)."""
    store, backend, echo = local
    job = tuning("Random", "validation:f1", "Maximize", trials=2, parallel=2, epochs=2,
                 epoch_seconds="120")  # fmt: skip
    both_running, ended = threading.Event(), threading.Event()

    def interrupt_once_both_train():
        while echo.count("] epoch=1 ") < 2 and not ended.wait(0.05):
            pass
        if not ended.is_set():  # never into the next test
            both_running.set()
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C

    # The driver's process has Python's own SIGINT handler; a test runner's may not.
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt_once_both_train, daemon=True).start()
        started = time.time()
        with pytest.raises(KeyboardInterrupt):
            backend.run_tuning(job)
        took = time.time() - started
    finally:
        ended.set()
        signal.signal(signal.SIGINT, handler)
    assert both_running.is_set() and echo.count("] epoch=1 ") == 2
    assert took < 60, took  # not after the trials' 120 s
    assert echo.count("] epoch=2 ") == 0
    trials = json.loads(store.get_bytes(RUN.tuning("probe") + "trials.json"))["trials"]
    assert [t["status"] for t in trials] == ["Interrupted", "Interrupted"]
