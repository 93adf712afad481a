"""SageMaker's rules for tuning jobs and prices, said when the settings load, naming the key:
automatic model tuning's limits (750 training jobs per tuning job for Bayesian, Hyperband and
Grid, Random up to 10,000; Hyperband's MaxResource at most 20,000), tuning job names that
differ without case, and one price per instance type in [cost] PRICES."""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import pytest

from pipeline.config import ConfigError, load_settings
from pipeline.paths import ExperimentTree
from pipeline.service_model import check
from pipeline.sources import Sources
from pipeline.stages import build_jobs
from tests.conftest import write_settings

ROLE = "arn:aws:iam::123456789012:role/smpipe"
STEPS = ["reconcile", "prepare", "train", "inference"]


def tune(tmp_path, tuning=None, env=None, experiment=None, **sections):
    """Settings of a tuning run on the sagemaker backend."""
    sagemaker = {"BACKEND": "sagemaker", "ROLE_ARN": ROLE, "IMAGE_URI": "i:1", "JOB": "tune"}
    path = write_settings(
        tmp_path / "settings.ini",
        "s3://bucket/root",
        experiment=sagemaker | (experiment or {}),
        tuning={"EARLY_STOPPING": "Off", **(tuning or {})},
        **sections,
    )
    return load_settings(path, env=env or {})


def problems_of(tmp_path, **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as error:
        tune(tmp_path, **kwargs)
    return error.value.problems


# -- D: automatic model tuning's limits -----------------------------------------------------------


@pytest.mark.parametrize("strategy", ["Bayesian", "Hyperband"])
def test_more_than_750_trials_are_refused_naming_max_jobs(tmp_path, strategy):
    [problem] = problems_of(tmp_path, tuning={"STRATEGY": strategy, "MAX_JOBS": "751"})
    assert problem.startswith("[tuning] MAX_JOBS: 751;")
    assert f"STRATEGY = {strategy}" in problem and "at most 750 training jobs" in problem
    assert "cannot be increased" in problem and "automatic-model-tuning-limits" in problem


def test_750_trials_load(tmp_path):
    assert tune(tmp_path, tuning={"MAX_JOBS": "750"}).tuning.max_jobs == 750


def test_random_search_past_750_needs_a_quota_increase_and_stops_at_10000(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="smpipe"):
        settings = tune(tmp_path, tuning={"STRATEGY": "Random", "MAX_JOBS": "5000"})
    assert settings.tuning.max_jobs == 5000
    assert "can be increased to" in caplog.text and "10,000" in caplog.text
    [problem] = problems_of(tmp_path, tuning={"STRATEGY": "Random", "MAX_JOBS": "10001"})
    assert problem.startswith("[tuning] MAX_JOBS:")


def test_a_grid_of_more_than_750_combinations_is_refused_naming_its_keys(tmp_path):
    rates = ",".join(f"{i}e-5" for i in range(1, 29))  # 28 options
    sizes = ",".join(str(i) for i in range(1, 29))  # x 28 = 784 combinations
    ranges = {"LEARNING_RATE": rates, "BATCH_SIZE": sizes}
    problems = problems_of(
        tmp_path,
        tuning={"STRATEGY": "Grid"},
        **{
            "tuning.hyperparameters": ranges,
            "tuning.hyperparameters.bow": {"LEARNING_RATE": "1e-3"},
        },
    )
    [problem] = [p for p in problems if "combination" in p]
    assert "[tuning.hyperparameters] LEARNING_RATE (28)" in problem
    assert "[tuning.hyperparameters] BATCH_SIZE (28)" in problem
    assert "784 for minilm" in problem and "at most 750 training jobs" in problem
    assert "inferred from the search space" in problem


def test_the_requests_are_held_to_the_same_limits(tmp_path):
    """pipeline/service_model.py checks the request itself: MaxNumberOfTrainingJobs, a grid's
    combinations, Hyperband's MaxResource ("The maximum value is 20,000 epochs")."""
    from pipeline.plan import describe

    settings = tune(tmp_path, tuning={"STRATEGY": "Hyperband"})
    tree = ExperimentTree(settings.experiment.name)
    jobs = build_jobs(settings, STEPS, tree.run(1), Sources(raw=tree.raw))
    job = next(j for j in jobs if j.kind == "tuning")

    class S3:
        def uri_of(self, key):
            return f"s3://bucket/{key}"

    request = describe(job, settings, S3())
    assert check("CreateHyperParameterTuningJob", request) == []
    config = request["HyperParameterTuningJobConfig"]
    too_many = copy.deepcopy(request)
    too_many["HyperParameterTuningJobConfig"]["ResourceLimits"]["MaxNumberOfTrainingJobs"] = 751
    assert any(
        "at most 750" in v.constraint for v in check("CreateHyperParameterTuningJob", too_many)
    )
    resource = config["StrategyConfig"]["HyperbandStrategyConfig"]
    resource["MaxResource"] = 20_001
    found = check("CreateHyperParameterTuningJob", request)
    assert any(v.path.endswith("MaxResource") and "20000" in v.constraint for v in found)
    grid = copy.deepcopy(request)
    grid_config = grid["HyperParameterTuningJobConfig"]
    grid_config.update(Strategy="Grid", TrainingJobEarlyStoppingType="Off")
    del grid_config["StrategyConfig"], grid_config["ResourceLimits"]["MaxNumberOfTrainingJobs"]
    grid_config["ParameterRanges"] = {
        "CategoricalParameterRanges": [
            {"Name": name, "Values": [str(i) for i in range(28)]} for name in ("a", "b")
        ]
    }
    found = check("CreateHyperParameterTuningJob", grid)
    assert any(v.path.endswith("CategoricalParameterRanges") and v.value == 784 for v in found)


def test_epochs_cannot_ask_hyperband_for_more_than_its_maximum_resource():
    """A trial's most epochs become MaxResource (jobs.TuningJob.max_epochs): EPOCHS' bound
    keeps it within SageMaker's 20,000, and both checks use one limit."""
    from pipeline import config_checks, service_model
    from steps.hyperparameters import HYPERPARAMETERS

    assert HYPERPARAMETERS["epochs"].le <= service_model.HYPERBAND_MAX_RESOURCE
    assert (
        config_checks.TRAINING_JOBS_PER_TUNING_JOB == service_model.TRAINING_JOBS_LIMIT["Bayesian"]
    )
    assert (
        config_checks.RANDOM_TRAINING_JOBS_PER_TUNING_JOB
        == service_model.TRAINING_JOBS_LIMIT["Random"]
    )


# -- C: tuning job names without case -------------------------------------------------------------


def test_tuning_job_names_of_experiments_that_differ_in_case_differ_without_case(
    tmp_path, monkeypatch
):
    """SageMaker: the tuning job's name "is not case sensitive". Two experiments whose names
    differ only in case, run in the same second, must not ask for the same tuning job."""
    import pipeline.jobs

    monkeypatch.setattr(pipeline.jobs.time, "strftime", lambda *_: "120000")
    names = []
    for experiment in ("News", "news"):
        (tmp_path / experiment).mkdir()
        settings = tune(tmp_path / experiment, experiment={"NAME": experiment})
        tree = ExperimentTree(settings.experiment.name)
        jobs = build_jobs(settings, STEPS, tree.run(1), Sources(raw=tree.raw))
        names.append(sorted(j.name for j in jobs if j.kind == "tuning"))
    upper, lower = names
    assert {n.lower() for n in upper}.isdisjoint(n.lower() for n in lower), names
    assert all(len(n) <= 32 for n in upper + lower)
    assert lower == sorted(f"news-0001-tune-{m}-120000" for m in ("minilm", "bow"))  # unchanged


def test_the_emulator_refuses_a_tuning_name_taken_with_other_case():
    """The emulated SageMaker answers as SageMaker does: ResourceInUse."""
    from pipeline.backends.emulated.control_plane import refuse_used_name

    moto = SimpleNamespace(
        processing_jobs={},
        training_jobs={},
        hyper_parameter_tuning_jobs={"news-0001-tune-bow-120000": SimpleNamespace(arn="arn:x")},
    )
    create = "CreateHyperParameterTuningJob"
    taken = {"HyperParameterTuningJobName": "News-0001-tune-bow-120000"}
    answer = refuse_used_name(moto, create, taken)
    assert answer is not None and answer[1]["Error"]["Code"] == "ResourceInUse"
    fresh = {"HyperParameterTuningJobName": "other-0001-tune-bow-120000"}
    assert refuse_used_name(moto, create, fresh) is None


# -- F: [cost] PRICES names each instance type once ------------------------------------------------


def test_an_instance_type_priced_twice_is_refused_naming_it(tmp_path):
    path = write_settings(
        tmp_path / "settings.ini",
        str(tmp_path / "store"),
        cost={"PRICES": "ml.g5.xlarge: 1.408, ml.m5.xlarge: 0.23, ml.g5.xlarge: 2"},
    )
    with pytest.raises(ConfigError) as error:
        load_settings(path, env={})
    [problem] = error.value.problems
    assert problem.startswith("[cost] PRICES:")
    assert "'ml.g5.xlarge' is priced twice (1.408 and 2)" in problem
