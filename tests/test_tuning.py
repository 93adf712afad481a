"""Tuning on the local backend: trials are training jobs, the objective is read off their logs
with the metric definition's regex, and the best trial's model is the one tested."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import sys
from types import SimpleNamespace

import pytest

from pipeline.config import load_settings
from pipeline.driver import PipelineError, parse_steps, run_pipeline
from pipeline.store import LocalStore
from tests.conftest import write_settings
from tests.test_user_functions import REVIEWS, write_module, write_reviews


def tuning_settings(tmp_path, training=None, data=None, **tuning):
    write_module(tmp_path, "reviews_tuning", REVIEWS)
    if not (tmp_path / "raw").exists():
        write_reviews(tmp_path / "raw")
    return write_settings(
        tmp_path / "settings.ini", str(tmp_path / "store"), training=training or {},
        experiment={"USER_FUNCTIONS": "reviews_tuning", "NAME": "reviews", "JOB": "tune"},
        data={"RAW_DATA": str(tmp_path / "raw"), "MAX_SEQUENCE_LENGTH": "12", **(data or {})}, models={"MODEL_NAMES": "tiny"},
        tuning={"STRATEGY": "Random", "MAX_JOBS": "3", "MAX_PARALLEL_JOBS": "2", "EARLY_STOPPING": "Off", **tuning},
        **{"tuning.hyperparameters": {"LEARNING_RATE": "0.001->0.1 log", "EPOCHS": "1,2", "BATCH_SIZE": None}},
    )  # fmt: skip


# The reviews model, except that a trial with WARMUP_RATIO = 0.5 crashes (a trial that runs
# out of memory, say): the job sees its hyperparameters as SM_HP_* variables.
FLAKY = (
    REVIEWS
    + """
import os as _os

_load_model = load_model


def load_model(model_name, id2label, label2id):
    if _os.environ.get("SM_HP_WARMUP_RATIO") == "0.5":
        raise MemoryError("this trial runs out of memory, on purpose")
    return _load_model(model_name, id2label, label2id)
"""
)


def tune(tmp_path, steps="reconcile,prepare,train", **settings_of):
    path = tune_settings(tmp_path, **settings_of)
    settings = load_settings(path, env={})
    store = LocalStore(settings.store_uri())
    return run_pipeline(settings, store, parse_steps(steps), echo=sys.stdout), store


def tune_settings(tmp_path, hyperparameters=None, flaky=False, training=None, data=None, **tuning):
    path = tuning_settings(tmp_path, training, data, **tuning)
    if hyperparameters or flaky:
        import configparser

        parser = configparser.ConfigParser(interpolation=None, delimiters=("=",))
        parser.optionxform = str.upper
        parser.read(path)
        if hyperparameters:
            parser.remove_section("tuning.hyperparameters")
            parser.add_section("tuning.hyperparameters")
            for key, value in hyperparameters.items():
                parser.set("tuning.hyperparameters", key, value)
        if flaky:
            write_module(tmp_path, "reviews_flaky", FLAKY)
            parser.set("experiment", "USER_FUNCTIONS", "reviews_flaky")
        with open(path, "w") as f:
            parser.write(f)
    return path


def trial_models(store) -> set[str]:
    """The trials whose model files are still in the run tree."""
    return {
        k.split("/")[5] for k in store.list_keys("reviews/runs/0001/tuning/tiny/") if "/model/" in k
    }


def journal_entry(store, number: int) -> dict:
    """Trial `number` as the study's journal keeps it: with where its model and output went."""
    journal = json.loads((store.root / "reviews/runs/0001/tuning/tiny/trials.json").read_text())
    return {t["number"]: t for t in journal["trials"]}[number]


def test_bayesian_search_of_six_trials_two_at_once_promotes_the_best(tmp_path):
    record, store = tune(
        tmp_path, steps=None, STRATEGY="Bayesian", MAX_JOBS="6", MAX_PARALLEL_JOBS="2"
    )
    assert record["status"] == "completed"
    tune_section = record["steps"]["tune"]
    # One tuning job per model, as on SageMaker, its trials in its details; then the export.
    assert "train" not in record["steps"] and len(tune_section["job_names"]) == 2
    details = tune_section["details"]["models"]["tiny"]
    assert (details["strategy"], details["sampler"]) == ("Bayesian", "TPESampler")
    trials = details["trials"]
    with open(store.root / "reviews/runs/0001/tuning/tiny/trials.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(trials) == 6 and {r["status"] for r in rows} == {"Completed"}
    for row, trial in zip(rows, trials, strict=True):
        assert 0 <= float(row["objective"]) <= 1 and float(row["objective"]) == trial["objective"]
        assert 0.001 <= float(row["learning_rate"]) <= 0.1 and row["epochs"] in ("1", "2")
    best = max(trials, key=lambda t: t["objective"])
    assert details["best"] == best
    # The best trial's model is exported once, after the study, and kept once: where a
    # training job leaves a model. No trial's model or checkpoints are left; their records
    # stay. Trials wrote no programs and drew no curves; the kept model has both.
    promoted = record["model_artifacts"]["tiny"]
    assert promoted == "reviews/runs/0001/models/tiny/model/"  # a key: the store may move
    kept = json.loads((store.root / promoted / "smpipe.json").read_text())
    assert abs(kept["best_validation_f1"] - best["objective"]) < 1e-6
    assert kept["exports"]["torchscript"]["passed"] and list(kept["exports"]) == ["torchscript"]
    assert details["exports"] == kept["exports"] and details["export_job_seconds"] > 0
    files = {p.name for p in (store.root / promoted).iterdir()}
    assert {"model.safetensors", "model.torchscript.pt", "curves.png"} <= files
    assert "model.pt2" not in files  # [inference] MODEL_FORMAT needs TorchScript only
    kept_as = journal_entry(store, best["number"])
    assert trial_models(store) == set() and kept_as["model"].endswith("/models/tiny/best-trial/")
    assert not store.list_keys(kept_as["model"])  # exported into model/: no second copy
    assert not store.list_keys("reviews/runs/0001/checkpoints/")
    assert [j.split("-")[2] for j in tune_section["job_names"]] == ["tune", "export"]
    assert (store.root / "reviews/runs/0001/tuning/tiny/trials.png").stat().st_size > 10_000
    # The objective read off the log is the best epoch's F1 the trial itself recorded.
    report = json.loads((store.root / kept_as["output"] / "step_metadata.json").read_text())
    assert abs(report["best_validation_f1"] - best["objective"]) < 1e-6
    # Two trials at once share this machine's cores, a thread pool each of half of them
    # (unless this machine's environment sizes the pools itself).
    share = os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // 2)
    assert report["cpu_threads"] == int(share)
    # The run's report shows the search: strategy, each trial, the chart.
    page = (store.root / "reviews/runs/0001/report.html").read_text()
    assert "Bayesian (TPESampler, NopPruner)" in page
    assert page.count("<td>Completed</td>") == 6 and 'alt="tiny tuning trials"' in page
    # Inference ran on the promoted model, unchanged.
    assert record["steps"]["inference"]["details"]["models_from"] == "reviews/runs/0001/models/"
    assert "tiny" in record["holdout_performance"]


def seed_visiting_first(path, model: str, name: str, value: str) -> int:
    """The first study seed ([data] SEED) with which this Optuna's brute-force sampler, built
    as the local backend builds it for these settings (local_tuning.search), draws `value` of
    `name` first. Optuna promises no order (one release's is not the next one's): ask it."""
    import optuna

    from pipeline.backends.local_tuning import distributions, search, suggest, value_of

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    settings = load_settings(path, env={})
    ranges = settings.tuning_space(model)[1]
    job = SimpleNamespace(strategy="Grid", max_jobs=1, ranges=ranges, early_stopping="Off")
    for seed in range(100):
        study = optuna.create_study(sampler=search(job, seed)[0])
        trial = study.ask()
        drawn = {n: suggest(trial, n, space) for n, space in distributions(ranges).items()}
        if value_of(drawn[name]) == value:
            return seed
    raise AssertionError(f"no seed below 100 draws {name} = {value} first")


def test_early_stopping_stops_a_trial_that_falls_behind(tmp_path):
    # One good learning rate and two that learn nothing in three epochs, one trial at a time.
    # The study's seed is one with which the sampler visits the good one first, so the others
    # have a median to fall behind.
    # The run's own checkpoints are kept (KEEP_CHECKPOINTS_AFTER_RUN): what is gone, every
    # trial removed when it ended.
    options = {"LEARNING_RATE": "0.000001,0.05,0.0000001", "EPOCHS": "3"}
    path = tune_settings(tmp_path, hyperparameters=options, STRATEGY="Grid")
    seed = seed_visiting_first(path, "tiny", "learning_rate", "0.05")
    record, store = tune(tmp_path, STRATEGY="Grid", MAX_JOBS="3", MAX_PARALLEL_JOBS="1", EARLY_STOPPING="Auto",
                         hyperparameters=options, data={"SEED": str(seed)},
                         training={"KEEP_CHECKPOINTS_AFTER_RUN": "true"})  # fmt: skip
    details = record["steps"]["tune"]["details"]["models"]["tiny"]
    assert details["pruner"] == "MedianPruner"
    assert details["trials"][0]["hyperparameters"]["learning_rate"] == "0.05", "seeded order"
    stopped = [t for t in details["trials"] if t["status"] == "Stopped"]
    assert stopped and details["counters"]["Stopped"] == len(stopped)
    for t in stopped:
        assert len(t["epochs"]) < 3 and t["stop_reason"].startswith(
            "early stopping: validation:f1="
        )
    assert details["best"]["status"] == "Completed" and record["status"] == "completed"
    assert not store.list_keys("reviews/runs/0001/checkpoints/"), "stopped or completed"
    # Grid: each option exactly once (a stopped trial counts as visited).
    rates = sorted(t["hyperparameters"]["learning_rate"] for t in details["trials"])
    assert rates == sorted(["0.05", "0.000001", "0.0000001"])


def test_a_failing_trial_is_recorded_and_only_all_failing_fails_the_step(tmp_path):
    record, store = tune(tmp_path, STRATEGY="Grid", MAX_JOBS="2", MAX_PARALLEL_JOBS="2", flaky=True,
                         hyperparameters={"WARMUP_RATIO": "0.1,0.5"})  # fmt: skip
    details = record["steps"]["tune"]["details"]["models"]["tiny"]
    failed = [t for t in details["trials"] if t["status"] == "Failed"]
    assert len(failed) == 1 and "runs out of memory, on purpose" in failed[0]["stop_reason"]
    assert details["best"]["hyperparameters"]["warmup_ratio"] == "0.1"
    assert details["counters"]["Failed"] == 1
    assert record["model_artifacts"]["tiny"] == "reviews/runs/0001/models/tiny/model/"

    # Every trial failing (the same prepared data, reused): one paragraph, nothing promoted.
    with pytest.raises(PipelineError) as e:
        tune(tmp_path, steps="train", STRATEGY="Grid", MAX_JOBS="2", MAX_PARALLEL_JOBS="2", flaky=True,
             hyperparameters={"WARMUP_RATIO": "0.5", "EPOCHS": "1,2"})  # fmt: skip
    message = str(e.value)
    assert (
        "step 'tune' failed" in message and "no trial of 2 completed with validation:f1" in message
    )
    assert message.count("runs out of memory, on purpose") == 2 and "\n" not in message
    assert not store.list_keys("reviews/runs/0002/models/")


def study_of_two(tmp_path, functions: str = "reviews_tuning"):
    """Settings and store of a Grid study of two learning rates, both trials at once."""
    tuning_settings(tmp_path, STRATEGY="Grid", MAX_JOBS="2", MAX_PARALLEL_JOBS="2")
    env = {
        "SMPIPE__TUNING_HYPERPARAMETERS__LEARNING_RATE": "0.02,0.05",
        "SMPIPE__EXPERIMENT__USER_FUNCTIONS": functions,
    }
    settings = load_settings(tmp_path / "settings.ini", env=env)
    return settings, LocalStore(settings.store_uri())


# The reviews model, except that its export job fails while a marker file exists (MARKER: its
# path, written into the module, not set in the environment, which would give the jobs a fork
# server of their own): a study that completed, then failed exporting its best model (a full
# disk, say). The export, a processing job, sees its inputs as SM_PROCESSING_INPUT_* variables;
# the trials and the driver's check of every model see none.
EXPORT_FAILS = (
    REVIEWS
    + """
import os as _os

_load_model = load_model


def load_model(model_name, id2label, label2id):
    # The export job only: a processing job (its inputs' variables), not a trial and not the
    # driver's check of every model.
    export = any(k.startswith("SM_PROCESSING_INPUT_") for k in _os.environ)
    if export and _os.path.exists(MARKER):
        raise OSError("no space left on the export's disk, on purpose")
    return _load_model(model_name, id2label, label2id)
"""
)


def test_a_study_whose_export_failed_resumes_with_the_export_alone(tmp_path):
    marker = tmp_path / "export-fails"
    marker.touch()
    write_module(
        tmp_path, "reviews_export_fails", EXPORT_FAILS.replace("MARKER", repr(str(marker)))
    )
    settings, store = study_of_two(tmp_path, "reviews_export_fails")
    with pytest.raises(PipelineError, match="no space left on the export's disk, on purpose"):
        run_pipeline(settings, store, parse_steps(None), echo=sys.stdout)
    run = "reviews/runs/0001/"
    trials = store.get_bytes(run + "tuning/tiny/trials.json")
    assert store.list_keys(run + "models/tiny/best-trial/")  # the study's result, kept
    assert not store.list_keys(run + "models/tiny/model/")

    marker.unlink()
    record = run_pipeline(settings, store, parse_steps(None), echo=sys.stdout, resume=1)
    assert record["status"] == "completed" and "tiny" in record["holdout_performance"]
    assert store.get_bytes(run + "tuning/tiny/trials.json") == trials  # not tuned again
    tune_section = record["steps"]["tune"]
    assert [n.split("-")[2] for n in tune_section["job_names"]] == ["export"]
    details = tune_section["details"]["models"]["tiny"]
    assert details["exports"]["torchscript"]["passed"] and details["best"]["status"] == "Completed"
    assert not store.list_keys(run + "models/tiny/best-trial/")  # kept once, exported


def test_a_run_stopped_between_a_study_and_its_record_resumes_with_the_export(
    tmp_path, monkeypatch
):
    """The study is done and its best model in place, and the run stops before the step's
    section says so (here: its chart cannot be drawn). The resumed run does not tune again,
    records the study from what it left, and exports its model."""
    from pipeline import tuning_record

    def no_chart(*_):
        raise OSError("the chart could not be written, on purpose")

    monkeypatch.setattr(tuning_record, "chart", no_chart)
    settings, store = study_of_two(tmp_path)
    with pytest.raises(Exception, match="the chart could not be written, on purpose"):
        run_pipeline(settings, store, parse_steps(None), echo=sys.stdout)
    run = "reviews/runs/0001/"
    trials = store.get_bytes(run + "tuning/tiny/trials.json")
    assert store.list_keys(run + "models/tiny/best-trial/")

    monkeypatch.undo()
    record = run_pipeline(settings, store, parse_steps(None), echo=sys.stdout, resume=1)
    assert record["status"] == "completed" and "tiny" in record["holdout_performance"]
    assert store.get_bytes(run + "tuning/tiny/trials.json") == trials  # not tuned again
    details = record["steps"]["tune"]["details"]["models"]["tiny"]
    assert details["best"]["status"] == "Completed" and len(details["trials"]) == 2
    assert details["exports"]["torchscript"]["passed"] and details["best_validation_f1"] > 0
    assert record["model_artifacts"]["tiny"] == run + "models/tiny/model/"
    assert not store.list_keys(run + "models/tiny/best-trial/")


def test_trials_at_once_share_the_cores_unless_the_environment_says(monkeypatch):
    from pipeline.backends.local_tuning import cores_of_a_trial

    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert cores_of_a_trial(1) == {}  # one trial at a time: the machine is its own
    assert cores_of_a_trial(2) == {"OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4"}
    assert cores_of_a_trial(3) == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    assert cores_of_a_trial(16)["OMP_NUM_THREADS"] == "1"  # never none
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cores_of_a_trial(2) == {}  # the user's own setting stands


def test_hyperband_stops_trials_that_fall_behind_at_a_rung():
    """The study Hyperband runs as (our pruner settings, over epochs), fed the epochs a trial
    reports: trials whose learning rate is too small are stopped, before their last epoch,
    the good ones never. (The stopping itself is the one early stopping uses, tested above.)"""
    import optuna

    from pipeline.backends.local_tuning import distributions, search
    from pipeline.search_space import Interval

    job = SimpleNamespace(  # what search() reads of a TuningJob
        strategy="Hyperband", max_jobs=12, early_stopping="Off",
        ranges={"learning_rate": Interval(1e-4, 1e-1, integer=False, log=True)},
        trial=SimpleNamespace(hyperparameters={"epochs": "9"}), max_epochs=9,
    )  # fmt: skip
    sampler, pruner, n_trials = search(job, seed=42)
    # Hyperband puts trials in brackets by a hash of the study's name: a fixed name, a fixed
    # assignment (an unnamed study gets a random one).
    study = optuna.create_study(
        direction="maximize", sampler=sampler, pruner=pruner, study_name="hyperband"
    )
    space = distributions(job.ranges)["learning_rate"]

    def objective(t):
        good = t.suggest_float("learning_rate", space.low, space.high, log=True) > 1e-2
        for epoch in range(1, 10):
            t.report((0.9 if good else 0.3) * epoch / 9, epoch)
            if t.should_prune():
                raise optuna.TrialPruned()
        return 0.9 if good else 0.3

    study.optimize(objective, n_trials=n_trials)
    pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    assert pruned and all(t.params["learning_rate"] <= 1e-2 for t in pruned)
    assert any(len(t.intermediate_values) < 9 for t in pruned)  # its epochs not all run


# The reviews model, waiting in one trial's second epoch for the driver's stop (tests/jobs/gate.py,
# shipped beside it as stop_gate.py).
GATED = (
    REVIEWS
    + """
from stop_gate import gate as _gate

_load_model = load_model


def load_model(model_name, id2label, label2id):
    return _gate(_load_model(model_name, id2label, label2id))
"""
)


def stopped_in_trial_2(tmp_path, monkeypatch, strategy: str, max_jobs: str, **hps: str):
    """A study of the gated reviews model, one trial at a time, stopped (SIGTERM to its
    driver) while trial 2 waits in its second epoch, its first done and checkpointed (the
    resumed one finds it stopped there once, and goes on). The settings and the folder the
    driver ran in, for its --resume."""
    from tests.conftest import ROOT, wait_at_gate
    from tests.jobs.gate import GATE_VARIABLE
    from tests.reliability.test_lifecycle import Driver

    path = tuning_settings(tmp_path)
    write_module(tmp_path, "reviews_gated", GATED)
    shutil.copy(ROOT / "tests/jobs/gate.py", tmp_path / "stop_gate.py")
    write_settings(path, str(tmp_path / "store"), experiment={"USER_FUNCTIONS": "reviews_gated", "NAME": "reviews", "JOB": "tune"},
                   data={"RAW_DATA": str(tmp_path / "raw"), "MAX_SEQUENCE_LENGTH": "12"}, models={"MODEL_NAMES": "tiny"},
                   tuning={"STRATEGY": strategy, "MAX_JOBS": max_jobs, "MAX_PARALLEL_JOBS": "1", "EARLY_STOPPING": "Off"},
                   **{"tuning.hyperparameters": {**hps, "BATCH_SIZE": None}})  # fmt: skip
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv(GATE_VARIABLE, f"{tmp_path / 'gates'}:epoch2:-002")
    driver = Driver(path, tmp, "--steps", "reconcile,prepare,train")
    wait_at_gate(tmp_path / "gates", "epoch2", lambda: driver.proc.poll() is None)
    driver.proc.send_signal(signal.SIGTERM)
    assert driver.finish() == 130, driver.output
    return path, tmp


@pytest.mark.slow
def test_an_interrupted_study_resumes_with_its_finished_trials(tmp_path, monkeypatch):
    from tests.reliability.test_lifecycle import Driver

    path, tmp = stopped_in_trial_2(
        tmp_path, monkeypatch, "Grid", "2", LEARNING_RATE="0.05,0.02", EPOCHS="3"
    )
    trials_json = tmp_path / "store/reviews/runs/0001/tuning/tiny/trials.json"
    before = {t["number"]: t for t in json.loads(trials_json.read_text())["trials"]}
    assert [before[n]["status"] for n in sorted(before)] == ["Completed", "Interrupted"]
    assert [len(before[n]["epochs"]) for n in sorted(before)] == [3, 1]
    assert (tmp_path / "store/reviews/runs/0001/checkpoints/tiny-trial-002").exists()

    again = Driver(path, tmp, "--resume", "1")
    assert again.finish() == 0, again.output
    after = {t["number"]: t for t in json.loads(trials_json.read_text())["trials"]}
    assert [after[n]["status"] for n in sorted(after)] == ["Completed"] * 2
    # Told to the sampler again, not run again; where its model is changed when the study
    # ended (the best's moved to best-trial/, the others' deleted).
    assert {**after[1], "model": None} == {**before[1], "model": None}
    # The interrupted trial went on from its checkpoint with its own values; Grid still
    # visited each option exactly once.
    assert after[2]["hyperparameters"] == before[2]["hyperparameters"]
    # Its log before the stop and its log after (a resumed job is a new job, a new name).
    logs = list((tmp_path / "store/reviews/runs/0001/logs").glob("*tune-tiny-002*.log"))
    assert len(logs) == 2 and any("resumed from" in log.read_text() for log in logs)
    assert sorted(t["hyperparameters"]["learning_rate"] for t in after.values()) == ["0.02", "0.05"]
    assert "1 done before this run was resumed" in again.output
    record = json.loads((tmp_path / "store/reviews/runs/0001/metadata.json").read_text())
    assert record["status"] == "completed" and record["model_artifacts"]["tiny"]


@pytest.mark.slow
def test_a_resumed_random_study_draws_new_values_for_the_trials_left(tmp_path, monkeypatch):
    """Trials told again do not advance a seeded sampler: a resumed study seeded as before drew
    its first trial's values again for the next (seen: trial 3 = trial 1). It is seeded past
    the trials it is told."""
    from tests.reliability.test_lifecycle import Driver

    path, tmp = stopped_in_trial_2(
        tmp_path, monkeypatch, "Random", "3", LEARNING_RATE="0.001->0.1 log", EPOCHS="2"
    )
    again = Driver(path, tmp, "--resume", "1")
    assert again.finish() == 0, again.output
    trials_json = tmp_path / "store/reviews/runs/0001/tuning/tiny/trials.json"
    rates = [
        t["hyperparameters"]["learning_rate"] for t in json.loads(trials_json.read_text())["trials"]
    ]
    assert len(rates) == 3 and len(set(rates)) == 3, rates


# The reviews model with a hidden layer between its bag of embeddings and its head: a linear
# layer for LoRA's adapters (PEFT adapts no EmbeddingBag).
REVIEWS_HIDDEN = REVIEWS.replace(
    "        self.out = nn.Linear(16, n)",
    "        self.mid = nn.Linear(16, 16)\n        self.classifier = nn.Linear(16, n)",
).replace(
    "return self.out(self.emb(token_ids, per_sample_weights=mask.float()))",
    "return self.classifier(torch.relu(self.mid(self.emb(token_ids, per_sample_weights=mask.float()))))",
)


def test_a_study_searches_lora_r_and_its_best_model_keeps_its_adapter(tmp_path):
    """FINETUNING = lora under a tuning job: each trial trains adapters of the rank it drew,
    and the study's best model is merged and exported as any, with its PEFT adapter beside it."""
    assert "self.mid" in REVIEWS_HIDDEN
    path = tune_settings(
        tmp_path, hyperparameters={"LORA_R": "2,16"}, STRATEGY="Grid", MAX_JOBS="2",
        training={"FINETUNING": "lora", "LORA_TARGET_MODULES": "mid", "LEARNING_RATE": "0.05"},
    )  # fmt: skip
    write_module(tmp_path, "reviews_hidden", REVIEWS_HIDDEN)
    text = path.read_text().replace(
        "USER_FUNCTIONS = reviews_tuning", "USER_FUNCTIONS = reviews_hidden"
    )
    path.write_text(text)
    settings = load_settings(path, env={})
    store = LocalStore(settings.store_uri())
    record = run_pipeline(settings, store, parse_steps("reconcile,prepare,train"), echo=sys.stdout)
    assert record["status"] == "completed"
    trials = record["steps"]["tune"]["details"]["models"]["tiny"]["trials"]
    with open(store.root / "reviews/runs/0001/tuning/tiny/trials.csv") as f:
        assert sorted(row["lora_r"] for row in csv.DictReader(f)) == ["16", "2"]
    best = journal_entry(store, max(trials, key=lambda t: t["objective"])["number"])
    report = json.loads((store.root / best["output"] / "step_metadata.json").read_text())
    assert report["finetuning"] == "lora" and report["lora"]["target_modules"] == ["mid"]
    promoted = store.root / record["model_artifacts"]["tiny"]
    kept = json.loads((promoted / "smpipe.json").read_text())
    assert kept["finetuning"] == "lora" and kept["exports"]["torchscript"]["passed"]
    adapter = json.loads((promoted / "adapter/adapter_config.json").read_text())
    assert adapter["r"] == kept["lora"]["r"] == report["lora"]["r"]
    assert adapter["target_modules"] == ["mid"] and adapter["modules_to_save"] == ["classifier"]
    # What trained: the adapter on `mid` (A: r x 16, B: 16 x r) and the head, in full.
    assert report["trained_parameters"] == 32 * report["lora"]["r"] + 16 * 3 + 3
