"""Every request checked as SageMaker checks it (pipeline/service_model.py): refused field by
field where the service model or the documentation says AWS refuses it, before anything is
sent; settings that load never make a request it refuses."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pipeline.config import ConfigError, load_settings
from pipeline.jobs import (
    JOB_NAME_LIMIT,
    JOB_NAME_RE,
    KINDS,
    TUNING_JOB_NAME_LIMIT,
    job_name,
    named_for,
)
from pipeline.paths import ExperimentTree
from pipeline.plan import check_requests
from pipeline.service_model import as_if_on_s3, check, job_name_part, refused, shape
from pipeline.sources import Sources
from pipeline.stages import build_jobs
from pipeline.store import LocalStore
from steps.runtime import names
from tests.conftest import ROOT, write_settings

ROLE = "arn:aws:iam::123456789012:role/smpipe"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/smpipe:latest"
STEPS = ["reconcile", "prepare", "train", "inference"]


def sagemaker_settings(tmp_path, **overrides):
    path = write_settings(
        tmp_path / "settings.ini", "s3://bucket/root",
        experiment={"BACKEND": "sagemaker", "ROLE_ARN": ROLE, "IMAGE_URI": IMAGE, **overrides.pop("experiment", {})},
        **overrides,
    )  # fmt: skip
    return load_settings(path, env={})


class S3:
    """A store as the requests see it (nothing is read or written)."""

    uri = "s3://bucket/root"

    def uri_of(self, key: str) -> str:
        return f"{self.uri}/{key}"


def requests(settings) -> dict[str, dict]:
    """kind -> the first request of that kind the plan makes."""
    from pipeline.plan import describe

    tree = ExperimentTree(settings.experiment.name)
    jobs = build_jobs(settings, STEPS, tree.run(1), Sources(raw=tree.raw))
    found: dict[str, dict] = {}
    for job in jobs:
        found.setdefault(job.kind, describe(job, settings, S3()))
    return found


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> dict[str, dict]:
    """A valid request of each kind: processing and training (spot), and tuning."""
    tmp = tmp_path_factory.mktemp("valid")
    spot = {"USE_SPOT": "true", "MAX_RUN_SECONDS": "3600", "MAX_WAIT_SECONDS": "7200"}
    train = requests(sagemaker_settings(tmp, training=spot))
    (tmp / "tune").mkdir()
    tune = requests(sagemaker_settings(tmp / "tune", experiment={"JOB": "tune"}))
    return {**train, "tuning": tune["tuning"]}


def test_the_plans_requests_are_valid(valid):
    assert set(valid) == {"processing", "training", "tuning"}
    for kind, request in valid.items():
        assert refused(KINDS[kind].create, request) == [], kind


def _set(request: dict, path: str, value) -> None:
    """request[a][b][0][c] = value, from 'a.b[0].c'; `...` deletes it."""
    keys = [
        int(k) if k.isdigit() else k for k in path.replace("[", ".").replace("]", "").split(".")
    ]
    target = request
    for key in keys[:-1]:
        target = target[key]
    if value is ...:
        del target[keys[-1]]
    else:
        target[keys[-1]] = value


# (kind, field path, value, the path SageMaker names, words of its constraint)
REFUSED = [
    ("training", "ResourceConfig.InstanceType", "ml.g5.xlarg", "ResourceConfig.InstanceType",
     "enum value set"),
    ("processing", "ProcessingResources.ClusterConfig.InstanceType", "ml.m5.xlarge ",
     "ProcessingResources.ClusterConfig.InstanceType", "enum value set"),
    ("processing", "AppSpecification.ContainerArguments[1]", "x" * 257,
     "AppSpecification.ContainerArguments[1]", "length less than or equal to 256"),
    ("training", "TrainingJobName", "my_job", "TrainingJobName", "regular expression pattern"),
    ("training", "TrainingJobName", "j" * 64, "TrainingJobName", "less than or equal to 63"),
    ("tuning", "HyperParameterTuningJobName", "t" * 33, "HyperParameterTuningJobName",
     "less than or equal to 32"),
    ("processing", "StoppingCondition.MaxRuntimeInSeconds", 777601,
     "StoppingCondition.MaxRuntimeInSeconds", "value less than or equal to 777600"),
    ("training", "StoppingCondition.MaxRuntimeInSeconds", 28 * 86400 + 1,
     "StoppingCondition.MaxRuntimeInSeconds", "28 days"),
    ("training", "StoppingCondition.MaxWaitTimeInSeconds", 60, "StoppingCondition.MaxWaitTimeInSeconds",
     "greater than or equal to MaxRuntimeInSeconds"),
    ("training", "RoleArn", ..., "RoleArn", "must not be null"),
    ("training", "RoleArn", "arn:aws:iam::123:role/x", "RoleArn", "regular expression pattern"),
    ("training", "ResourceConfig.InstanceCount", "2", "ResourceConfig.InstanceCount", "type integer"),
    ("processing", "ProcessingResources.ClusterConfig.VolumeSizeInGB", 16385,
     "ProcessingResources.ClusterConfig.VolumeSizeInGB", "value less than or equal to 16384"),
    ("training", "HyperParameters.learning_rate", "1" * 2501, "HyperParameters.learning_rate",
     "less than or equal to 2500"),
    ("training", "HyperParameters", {f"h{i}": "1" for i in range(101)}, "HyperParameters",
     "less than or equal to 100"),
    ("training", "Environment", {"MY-VAR": "1"}, "Environment (key 'MY-VAR')", "regular expression"),
    ("processing", "Environment.SMPIPE_USER_FUNCTIONS", "m" * 257, "Environment.SMPIPE_USER_FUNCTIONS",
     "less than or equal to 256"),
    ("training", "AlgorithmSpecification.MetricDefinitions[0].Regex", "(" * 501,
     "AlgorithmSpecification.MetricDefinitions[0].Regex", "less than or equal to 500"),
    ("training", "InputDataConfig[1].ChannelName", "train/x", "InputDataConfig[1].ChannelName",
     "regular expression pattern"),
    ("training", "Surprise", 1, "Surprise", "Unknown parameter"),
    ("processing", "ProcessingOutputConfig.Outputs[0].S3Output.LocalPath", "/tmp/out",
     "ProcessingOutputConfig.Outputs[0].S3Output.LocalPath", "/opt/ml/processing/"),
    ("tuning", "HyperParameterTuningJobConfig.ParameterRanges.CategoricalParameterRanges",
     [{"Name": "batch_size", "Values": [str(i) for i in range(31)]}],
     "HyperParameterTuningJobConfig.ParameterRanges.CategoricalParameterRanges[0].Values",
     "less than or equal to 30"),
    ("tuning", "HyperParameterTuningJobConfig.ResourceLimits.MaxParallelTrainingJobs", 0,
     "HyperParameterTuningJobConfig.ResourceLimits.MaxParallelTrainingJobs", "greater than or equal to 1"),
    ("tuning", "HyperParameterTuningJobConfig.Strategy", "Hyperband",
     "HyperParameterTuningJobConfig.TrainingJobEarlyStoppingType", "Off for Strategy Hyperband"),
    ("tuning", "HyperParameterTuningJobConfig.HyperParameterTuningJobObjective.MetricName", "f2",
     "HyperParameterTuningJobConfig.HyperParameterTuningJobObjective.MetricName", "MetricDefinitions"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "path", "value", "named", "words"), REFUSED)
def test_what_aws_refuses_is_refused_by_field(valid, kind, path, value, named, words):
    request = copy.deepcopy(valid[kind])
    _set(request, path, value)
    found = check({"processing": "CreateProcessingJob", "training": "CreateTrainingJob",
                   "tuning": "CreateHyperParameterTuningJob"}[kind], request)  # fmt: skip
    assert any(v.path == named and words in v.constraint for v in found), [str(v) for v in found]
    # And in SageMaker's own words, naming the field.
    assert any(f"at '{named}' failed to satisfy constraint" in str(v) for v in found)


def test_hyperband_with_searched_epochs_names_its_maximum(tmp_path):
    settings = sagemaker_settings(
        tmp_path, experiment={"JOB": "tune"},
        tuning={"STRATEGY": "Hyperband", "EARLY_STOPPING": "Off"},
        **{"tuning.hyperparameters": {"EPOCHS": "1->5", "BATCH_SIZE": None}},
    )  # fmt: skip
    config = requests(settings)["tuning"]["HyperParameterTuningJobConfig"]
    assert config["StrategyConfig"] == {
        "HyperbandStrategyConfig": {"MinResource": 1, "MaxResource": 5}
    }
    del config["StrategyConfig"]  # what the driver sent before: AWS refuses it
    assert any("MaxResource" in v.path for v in check("CreateHyperParameterTuningJob", requests(settings)["tuning"] | {"HyperParameterTuningJobConfig": config}))  # fmt: skip


def test_the_plan_refuses_an_invalid_request_naming_job_and_field(tmp_path):
    settings = sagemaker_settings(tmp_path)
    tree = ExperimentTree(settings.experiment.name)
    jobs = build_jobs(settings, STEPS, tree.run(1), Sources(raw=tree.raw))
    jobs[0].instance_type = "ml.m5.xlarg"  # past the settings' own check, as a bug would be
    with pytest.raises(ConfigError) as error:
        check_requests(jobs, settings, S3())
    [problem] = error.value.problems
    assert problem.startswith(f"CreateProcessingJob {jobs[0].name}: Value 'ml.m5.xlarg' at "
                              "'ProcessingResources.ClusterConfig.InstanceType'")  # fmt: skip
    assert "did you mean 'ml.m5.xlarge'?" in problem


def test_an_unknown_enum_value_names_the_botocore_whose_list_it_was_checked_against(valid):
    import botocore

    request = copy.deepcopy(valid["training"])
    request["ResourceConfig"]["InstanceType"] = "ml.q9.hypothetical"  # a type newer than the list
    [violation] = check("CreateTrainingJob", request)
    assert violation.constraint.endswith(
        f"(botocore {botocore.__version__}'s list: a newer botocore may know more)"
    )


def test_smpipe_plan_refuses_a_typo_before_anything_starts(tmp_path):
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "store"),
                          training={"INSTANCE_TYPE": "ml.g5.xlarg"})  # fmt: skip
    smpipe = str(Path(sys.executable).parent / "smpipe")
    done = subprocess.run([smpipe, "plan", str(path)], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "[training] INSTANCE_TYPE: 'ml.g5.xlarg'" in done.stderr
    assert "did you mean 'ml.g5.xlarge'?" in done.stderr
    assert not (tmp_path / "store").exists()


def test_a_local_store_is_checked_as_the_bucket_it_stands_for(tmp_path):
    settings = load_settings(
        write_settings(tmp_path / "settings.ini", str(tmp_path / "store")), env={}
    )
    tree = ExperimentTree(settings.experiment.name)
    jobs = build_jobs(settings, STEPS, tree.run(1), Sources(raw=str(tmp_path / "raw")))
    check_requests(jobs, settings, LocalStore(str(tmp_path / "store")))  # no error
    request = as_if_on_s3({"ProcessingInputs": [{"S3Input": {"S3Uri": "/data/raw"}}]})
    assert request["ProcessingInputs"][0]["S3Input"]["S3Uri"] == "s3://local-store/data/raw"


def test_job_name_limits_are_the_service_models():
    assert JOB_NAME_LIMIT == shape("TrainingJobName").metadata["max"] == shape("ProcessingJobName").metadata["max"]  # fmt: skip
    assert TUNING_JOB_NAME_LIMIT == shape("HyperParameterTuningJobName").metadata["max"]


def test_names_that_shorten_alike_stay_distinct():
    """roberta-base and roberta-large shorten to the same prefix; a hash of the whole name
    keeps them apart (SageMaker refuses the second create with ResourceInUse)."""
    for limit in (TUNING_JOB_NAME_LIMIT, JOB_NAME_LIMIT):
        experiment = "bbc-news-classification-of-articles-by-topic"[: limit - 10]
        names = {job_name(experiment, "0003", "tune", m, limit=limit, stamp="112248")
                 for m in ("roberta-base", "roberta-large", "roberta-large-mnli")}  # fmt: skip
        assert len(names) == 3, names
        for name in names:
            assert len(name) <= limit and JOB_NAME_RE.match(name), name
            assert "0003-tune" in name and "112248" in name
    # A name that fits is written out whole, without a hash.
    assert job_name("bbc", "0003", "train", "bow", stamp="112248") == "bbc-0003-train-bow-112248"


EXPERIMENTS = st.text(st.sampled_from("abcXYZ019-_. "), min_size=1, max_size=70).filter(
    lambda e: any(c.isalnum() for c in e)
)


@st.composite
def another_experiment(draw, experiment: st.SearchStrategy = EXPERIMENTS) -> tuple[str, str]:
    """(ours, another's): the other free, or one whose part begins ours, or ours begins its."""
    ours = draw(experiment)
    extra = draw(st.text(st.sampled_from("abcXYZ019-"), min_size=1, max_size=30))
    cut = draw(st.integers(1, max(1, len(ours) - 1)))
    other = draw(st.sampled_from([extra, ours[:cut], f"{ours}-{extra}", f"{ours}{extra}"]))
    return ours, other


@settings(max_examples=400, deadline=None)
@given(
    pair=another_experiment(),
    run=st.integers(1, 9999),
    models=st.lists(st.text(st.sampled_from("abc-019"), max_size=40), max_size=2),
)
def test_a_run_knows_every_name_it_gives_its_jobs_and_no_other_experiments(pair, run, models):
    """What a resume lists by `-<run>-` (pipeline/backends/resuming.py) is taken for the run's
    only where `named_for` says so: every name `job_name` gives it, shortened or not, a tuning
    job's trials among them; and none of another experiment's, whose part begins ours or ours
    begins its (`news` beside `news-v2`), unless its name was shortened into a beginning of
    ours. Every name is described by a resume that takes it, which a role scoped to its own
    experiment's jobs may be refused."""
    experiment, other = pair
    label = f"{run:04d}"
    for limit, case_sensitive in ((TUNING_JOB_NAME_LIMIT, False), (JOB_NAME_LIMIT, True)):
        name = job_name(
            experiment, label, "tune", *models, limit=limit, case_sensitive=case_sensitive
        )
        assert named_for(name, experiment, label), name
        assert named_for(f"{name}-003-1f2e3d4c", experiment, label)  # a trial of it
        assert not named_for(name, experiment, f"{run + 1:04d}")
        if job_name_part(other).lower() == job_name_part(experiment).lower():
            continue  # one experiment's name to SageMaker, whose names ignore case
        theirs = job_name(other, label, "train", *models, limit=limit, stamp="112248")
        whole = job_name(other, label, "train", *models, limit=10_000, stamp="112248")
        if theirs == whole:  # not shortened: its part is whole, and not ours
            assert not named_for(theirs, experiment, label), theirs
        elif named_for(theirs, experiment, label):  # shortened into a beginning of ours
            head = theirs[: theirs.lower().find(f"-{label}-")].lower()
            assert job_name_part(experiment).lower().startswith(head), theirs


def test_another_experiments_name_is_known_unless_shortened_into_ours():
    """Fixed cases of the rule above: the name is proof where nothing was cut from it."""
    assert not named_for("news-0003-train-bow-112248", "news-v2", "0003")
    assert not named_for("news-v2-0003-train-bow-112248", "news", "0003")
    assert not named_for("0003-train-bow-112248", "news", "0003")
    assert not named_for("prob-0003-train-probe-100000", "probe", "0003")
    assert named_for("PROBE-0003-train-probe-100000", "probe", "0003")  # case: one name
    # Another experiment's long name cut at 63 characters into a beginning of ours: only its
    # folder tells them apart.
    long = "news-classification-of-articles-by-topic-in-the-bbc-corpus"
    theirs = job_name(long, "0003", "train", "bow", stamp="112248")
    assert theirs == "news-classification-of-articles-by-0003-train-bow-112248-97ca59"
    assert named_for(theirs, "news-classification-of-articles-by-bbc", "0003")
    assert not named_for(theirs, "news-classification-of-articles", "0003")  # longer than ours
    # A tuning job cut to 32 characters, and its trials; `news` is all its name keeps.
    tuning = job_name(long, "0003", "tune", "bow", limit=TUNING_JOB_NAME_LIMIT, stamp="112248")
    assert tuning == "news-0003-tune-bow-112248-a3ed83"
    assert named_for(tuning, long, "0003") and named_for(f"{tuning}-007-0a1b2c3d", long, "0003")
    assert named_for(tuning, "news-v2", "0003") and not named_for(tuning, "nexus", "0003")


@pytest.mark.parametrize(
    "models", [["roberta-base", "roberta-large"], ["m-" + "x" * 60, "n-" + "x" * 60]]
)
def test_a_plan_of_models_that_shorten_alike_has_distinct_valid_names(tmp_path, models):
    for job in ("train", "tune"):
        (tmp_path / job).mkdir()
        settings = sagemaker_settings(
            tmp_path / job, experiment={"NAME": "bbc-news-classification-experiment", "JOB": job},
            models={"MODEL_NAMES": ",".join(models)},
        )  # fmt: skip
        tree = ExperimentTree(settings.experiment.name)
        jobs = build_jobs(settings, STEPS, tree.run(3), Sources(raw=tree.raw))
        check_requests(jobs, settings, S3())
        assert len({j.name for j in jobs}) == len(jobs)


# -- settings that load make requests SageMaker accepts ---------------------------------------

PROCESSING_TYPES = ["ml.m5.xlarge", "ml.c5.xlarge", "ml.g4dn.xlarge"]
TRAINING_TYPES = ["ml.g5.xlarge", "ml.g5.12xlarge", "ml.p4d.24xlarge", "ml.m5.xlarge"]
# A typo, the EC2 name, a trailing blank, a training-only type for a processing job.
TYPOS = ["ml.g5.xlarg", "m5.xlarge", "ml.m5.xlarge ", "ml.p4d.24xlarge", "ml.c5.large"]
valid_names = st.from_regex(r"[a-z0-9][a-z0-9-]{0,62}", fullmatch=True)


# The settings that reach a request's limited fields: a valid value, and values at or past
# what SageMaker accepts.
FIELDS = {
    ("experiment", "NAME"): (valid_names, st.text("ab_-", min_size=1, max_size=70)),
    ("experiment", "ROLE_ARN"): (st.just(ROLE), st.sampled_from(["arn:aws:iam::1:role/x", ROLE + "r" * 2040])),
    ("experiment", "IMAGE_URI"): (st.just(IMAGE), st.just("i" * 256)),
    ("experiment", "USER_FUNCTIONS"): (st.just("user_functions"), st.just("u" * 257)),
    ("data", "INSTANCE_TYPE"): (st.sampled_from(PROCESSING_TYPES), st.sampled_from(TYPOS)),
    ("training", "INSTANCE_TYPE"): (st.sampled_from(TRAINING_TYPES), st.sampled_from(TYPOS[:3] + ["ml.c5.large"])),
    ("inference", "INSTANCE_TYPE"): (st.sampled_from(PROCESSING_TYPES), st.sampled_from(TYPOS)),
    ("tracking", "WANDB_SECRET_ID"): (st.sampled_from(["", "smpipe/wandb"]), st.just("s" * 257)),
    ("tracking", "SECRET_VARIABLES"): (st.sampled_from(["", "A_KEY,B_KEY"]), st.just(",".join(["V" * 30] * 9))),
    ("hub", "TOKEN_SECRET_ID"): (st.sampled_from(["", "smpipe/hf"]), st.just("h" * 257)),
    ("models", "MODEL_NAMES"): (
        st.lists(valid_names, min_size=1, max_size=4, unique=True).map(",".join),
        st.lists(valid_names, min_size=5, max_size=12, unique=True).map(",".join),
    ),
    ("tuning.hyperparameters", "BATCH_SIZE"): (
        st.lists(st.integers(1, 64).map(str), min_size=2, max_size=30, unique=True).map(",".join),
        st.lists(st.integers(1, 64).map(str), min_size=31, max_size=40, unique=True).map(",".join),
    ),
}  # fmt: skip


@st.composite
def sagemaker_files(draw) -> dict:
    """Settings sections as a user of the sagemaker backend might write them: valid, with a
    field or two at or past SageMaker's limits."""
    edges = draw(st.sets(st.sampled_from(sorted(FIELDS)), max_size=2))
    sections: dict[str, dict] = {}
    for (section, key), (valid, edge) in FIELDS.items():
        sections.setdefault(section, {})[key] = draw(edge if (section, key) in edges else valid)
    run = draw(st.integers(60, 2_419_200))
    sections["experiment"]["JOB"] = draw(st.sampled_from(["train", "tune"]))
    sections["training"] |= {
        "USE_SPOT": draw(st.sampled_from(["true", "false"])),
        "MAX_RUN_SECONDS": str(run),
        "MAX_WAIT_SECONDS": str(draw(st.integers(run, 2_419_200) | st.integers(60, 2_419_200))),
    }
    sections["tuning"] = {
        "STRATEGY": draw(st.sampled_from(["Bayesian", "Random", "Grid", "Hyperband"])),
        "EARLY_STOPPING": draw(st.sampled_from(["Off", "Off", "Auto"])),
        "MAX_PARALLEL_JOBS": str(draw(st.integers(1, 100))),
    }
    sections["tuning.hyperparameters"] |= {
        "EPOCHS": draw(st.sampled_from(["1->4", "2", "1,2,3", None])),
        "LEARNING_RATE": draw(st.sampled_from(["1e-5->1e-3 log", "1e-4", "1e-4,1e-3"])),
    }
    return sections


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(sections=sagemaker_files())
def test_settings_that_load_make_requests_sagemaker_accepts(tmp_path, sections):
    path = write_settings(tmp_path / "settings.ini", "s3://bucket/root",
                          **{**sections, "experiment": {"BACKEND": "sagemaker", **sections["experiment"]}})  # fmt: skip
    try:
        loaded = load_settings(path, env={})
    except ConfigError as e:
        assert e.problems
        event("refused by the settings")
        return
    event(f"loaded: JOB = {loaded.experiment.job}")
    tree = ExperimentTree(loaded.experiment.name)
    jobs = build_jobs(loaded, STEPS, tree.run(9999), Sources(raw=tree.raw))
    check_requests(jobs, loaded, S3())  # raises, naming each field, where config let one through


def test_the_containers_failure_limit_is_the_service_models():
    """The entrypoint cuts its failure file where SageMaker cuts FailureReason and ExitMessage
    (steps/ cannot read botocore's model; the emulator reads it there)."""
    assert (
        names.FAILURE_REASON_LIMIT
        == shape("FailureReason").metadata["max"]
        == shape("ExitMessage").metadata["max"]
    )
