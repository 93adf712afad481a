"""settings.ini -> Settings: the shipped file validates; broken files list every problem."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import Categorical, ConfigError, Interval, load_settings, parse_tunable
from steps.metrics import METRICS
from tests.conftest import ROOT, write_settings


def test_shipped_settings_validate():
    settings = load_settings(ROOT / "settings.ini", env={})
    assert settings.experiment.backend == "local"
    assert settings.models.model_names == ["minilm", "bow"]
    assert settings.tunables["learning_rate"] == Interval(2e-5, 2e-4, integer=False, log=True)
    assert settings.tunables["batch_size"] == Categorical(("16", "32"))
    assert set(settings.metric_definitions) == set(METRICS)  # every printed metric, one regex each
    # The tuning example: each model its own learning rates; MiniLM's trials short.
    assert settings.tuning_space("bow")[1]["learning_rate"] == Interval(
        1e-3, 3e-2, integer=False, log=True
    )
    assert settings.tuning_space("minilm") == (
        {"epochs": "1", "max_steps": "10", "batch_size": "16"},
        {"learning_rate": Interval(2e-5, 2e-4, integer=False, log=True)},
    )


def test_tunable_syntax():
    assert parse_tunable("1->5") == Interval(1, 5, integer=True, log=False)
    assert parse_tunable("0.1->0.5") == Interval(0.1, 0.5, integer=False, log=False)
    assert parse_tunable("1e-5->1e-3 log").log
    assert parse_tunable("a, b ,c") == Categorical(("a", "b", "c"))
    assert parse_tunable("7") == "7"
    for bad, why in [("5->1", "empty interval"), ("1->", "both bounds"), ("->3", "both bounds"),
                     ("a->b", "numbers"), ("0->1 log", "log scale"), ("1->2 linear", "only 'log'"), ("a,,b", "empty")]:  # fmt: skip
        with pytest.raises(ValueError, match=why):
            parse_tunable(bad)


BROKEN = {
    "unknown key": ({"training": {"EPOCS": "3"}}, ["[training] EPOCS: unknown key"]),
    "missing key": ({"experiment": {"NAME": None}}, ["[experiment] NAME: required key is missing"]),
    "bad number": ({"training": {"LEARNING_RATE": "fast"}}, ["[training] LEARNING_RATE"]),
    "reversed interval": (
        {"tuning.hyperparameters": {"LEARNING_RATE": "5->1"}},
        ["LEARNING_RATE: '5->1': empty interval"],
    ),
    "open interval": ({"tuning.hyperparameters": {"WARMUP_RATIO": "1->"}}, ["WARMUP_RATIO: '1->'"]),
    "bad regex": (
        {"tuning.metric_definitions": {"validation:f1": "f1=([0-9"}},
        ["VALIDATION:F1", "not a valid regex"],
    ),
    "path in a model name": (
        {"models": {"MODEL_NAMES": "../x"}},
        ["[models] MODEL_NAMES", "'../x' is not a valid name"],
    ),
    "empty model names": (
        {"models": {"MODEL_NAMES": " , "}},
        ["[models] MODEL_NAMES: name at least one model"],
    ),
    "unknown section": ({"trainer": {"EPOCHS": "1"}}, ["[trainer]: unknown section"]),
    "a store's bucket with a wildcard": (
        {"experiment": {"STORE": "s3://bu*cket/x"}},
        ["[experiment] STORE", "'bu*cket' is not a bucket's name"],
    ),
    "a store's URI of another scheme": (
        {"experiment": {"STORE": "file:///tmp/x"}},
        ["[experiment] STORE", "a store is a local directory, written as a path (such as /tmp/x)"],
    ),
    "a model's section not in MODEL_NAMES is still checked": (
        {"tuning.hyperparameters.cnn": {"LEARNING_RATE": "0.2->0.1"}},
        ["[tuning.hyperparameters.cnn] LEARNING_RATE: '0.2->0.1': empty interval"],
    ),
    "MAX_SEQUENCE_LENGTH moved to [data]": (
        {"training": {"MAX_SEQUENCE_LENGTH": "64"}, "training.bow": {"MAX_SEQUENCE_LENGTH": "64"}},
        [
            "[training] MAX_SEQUENCE_LENGTH: moved to [data] MAX_SEQUENCE_LENGTH",
            "[training.bow] MAX_SEQUENCE_LENGTH: moved to [data] MAX_SEQUENCE_LENGTH",
        ],
    ),
    "a model's range out of bounds": (
        {"tuning.hyperparameters.bow": {"WEIGHT_DECAY": "0.1->50"}},
        ["[tuning.hyperparameters.bow] WEIGHT_DECAY: 50.0"],
    ),
    "fractions": ({"data": {"TEST_FRACTION": "0.3"}}, ["must sum to 1"]),
    "an export format that does not exist": (
        {"training": {"EXPORTS": "torchscript, onnx"}},
        ["[training] EXPORTS: must be 'torchscript' or 'exported' (got 'onnx')"],
    ),
    "exports without the program inference runs": (
        {"training": {"EXPORTS": "exported"}, "inference": {"MODEL_FORMAT": "torchscript"}},
        [
            "[training] EXPORTS (exported) leaves out torchscript, the program [inference] "
            "MODEL_FORMAT runs"
        ],
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_file_names_its_problem(tmp_path, case):
    overrides, expected = BROKEN[case]
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "store"), **overrides)
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    for text in expected:
        assert text in str(info.value)


def test_every_problem_is_reported_at_once(tmp_path):
    path = write_settings(
        tmp_path / "settings.ini",
        str(tmp_path / "store"),
        experiment={"NAME": "a/b", "BACKEND": "cloud"},
        training={"EPOCHS": "0", "BATCH_SIZE": "x", "COLOUR": "red"},
        models={"MODEL_NAMES": ""},
        **{
            "tuning.hyperparameters": {"LEARNING_RATE": "5->1", "DROPOUT": "0.1->0.2"},
            "tuning.metric_definitions": {"f1": "f1=("},
        },  # fmt: skip
    )
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    message = str(info.value)
    for text in ["[experiment] NAME", "[experiment] BACKEND", "[training] EPOCHS", "[training] BATCH_SIZE",
                 "[training] COLOUR: unknown key", "[models] MODEL_NAMES", "LEARNING_RATE: '5->1': empty interval",
                 "DROPOUT: not a tunable hyperparameter", "[tuning.metric_definitions] F1"]:  # fmt: skip
        assert text in message, text
    assert len(info.value.problems) == 9
    assert (
        "[experiment] BACKEND: must be 'local', 'sagemaker' or 'emulated' (got 'cloud')" in message
    )  # the allowed values are named


def test_each_model_has_its_own_tuning_ranges(tmp_path):
    from pipeline.paths import ExperimentTree
    from pipeline.sources import resolve_sources
    from pipeline.stages import build_jobs
    from pipeline.store import LocalStore

    (tmp_path / "raw").mkdir()
    (tmp_path / "raw/labels.csv").write_text("id,label\n")
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "store"), experiment={"JOB": "tune"},
                          data={"RAW_DATA": str(tmp_path / "raw")}, **{"tuning.hyperparameters.bow": {"LEARNING_RATE": "1e-3->3e-2 log", "BATCH_SIZE": "32"}})  # fmt: skip
    settings = load_settings(path, env={"SMPIPE__TUNING_HYPERPARAMETERS_BOW__EPOCHS": "2,4"})
    # The model's own keys replace the shared ones, a constant included; the rest is shared.
    assert settings.tuning_space("bow") == (
        {"batch_size": "32"},
        {
            "learning_rate": Interval(1e-3, 3e-2, integer=False, log=True),
            "epochs": Categorical(("2", "4")),
        },
    )
    assert settings.tuning_space("minilm") == ({}, dict(settings.tunables))
    tree = ExperimentTree(settings.experiment.name)
    steps = ["reconcile", "prepare", "train"]
    sources = resolve_sources(settings, LocalStore(settings.store_uri()), tree, steps)
    jobs = {
        j.trial.hyperparameters["model_name"]: j
        for j in build_jobs(settings, steps, tree.run(1), sources)
        if j.kind == "tuning"
    }
    assert jobs["bow"].ranges == settings.tuning_space("bow")[1]
    assert jobs["bow"].trial.hyperparameters["batch_size"] == "32"
    assert jobs["minilm"].ranges["learning_rate"] == Interval(2e-5, 2e-4, integer=False, log=True)
    # Grid is checked per model, each problem said once, at the section it comes from.
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={"SMPIPE__TUNING__STRATEGY": "Grid"})
    assert info.value.problems == [
        "[tuning.hyperparameters] LEARNING_RATE: STRATEGY = Grid takes categorical options only (x,y,z), not 2e-05->0.0002 log",
        "[tuning.hyperparameters.bow] LEARNING_RATE: STRATEGY = Grid takes categorical options only (x,y,z), not 0.001->0.03 log",
    ]


def test_environment_overrides_keys(tmp_path):
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "store"))
    settings = load_settings(
        path,
        env={
            "SMPIPE__TRAINING__EPOCHS": "4",
            "SMPIPE__TUNING_HYPERPARAMETERS__WARMUP_RATIO": "0->0.2",
        },
    )
    assert settings.training.epochs == 4
    assert settings.tunables["warmup_ratio"] == Interval(0, 0.2, integer=False, log=False)
    with pytest.raises(ConfigError, match=r"\[training\] EPOCHS"):
        load_settings(path, env={"SMPIPE__TRAINING__EPOCHS": "zero"})


def test_a_comment_after_a_value_is_a_comment(tmp_path):
    """`KEY = value  # why` as the shipped file writes its comments (and `; why`): the value
    is what comes before it, for a path as for a number; a '#' with no space before it stays."""
    path = write_settings(
        tmp_path / "settings.ini",
        f"{tmp_path / 'store'}  # a folder of mine",
        training={"LEARNING_RATE": "3e-4 ; the demo's", "EPOCHS": "2\t# two passes"},
        tracking={"WANDB_PROJECT": "news#2  # the second"},
    )
    settings = load_settings(path, env={})
    assert settings.experiment.store == str(tmp_path / "store")
    assert settings.training.learning_rate == 3e-4 and settings.training.epochs == 2
    assert settings.tracking.wandb_project == "news#2"


def test_a_models_own_sections_are_its_whatever_their_case(tmp_path, caplog):
    """Section names are read lower-cased: MODEL_NAMES = MiniLM is given [training.MiniLM]
    (and [training.minilm]) as its own; a section of a model not listed is named with the
    model it may have meant, whatever the case."""
    path = write_settings(
        tmp_path / "settings.ini", str(tmp_path / "store"),
        models={"MODEL_NAMES": "MiniLM, bow"},
        **{"training.MiniLM": {"LEARNING_RATE": "2e-5"},
           "tuning.hyperparameters.minilm": {"LEARNING_RATE": "1e-5->1e-4"},
           "training.Bowl": {"EPOCHS": "9"}},
    )  # fmt: skip
    settings = load_settings(path, env={})
    assert settings.model_training["MiniLM"].learning_rate == 2e-5
    assert settings.model_tunables["MiniLM"]["learning_rate"] == Interval(1e-5, 1e-4, False, False)
    assert "'bowl' is not in [models] MODEL_NAMES (MiniLM, bow); did you mean 'bow'?" in caplog.text


@pytest.mark.parametrize(
    "written, said",
    [("user_functions.py", "'user_functions', not a file's"),
     ("code/my_functions.py", "'code.my_functions', not a file's"),
     ("my functions", "as import takes it (such as user_functions)")],
)  # fmt: skip
def test_user_functions_is_a_modules_name_not_a_files(tmp_path, written, said):
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "store"),
                          experiment={"USER_FUNCTIONS": written})  # fmt: skip
    with pytest.raises(ConfigError) as raised:
        load_settings(path, env={})
    (problem,) = raised.value.problems
    assert problem.startswith("[experiment] USER_FUNCTIONS: is a module's name") and said in problem


def test_sagemaker_backend_needs_its_keys(tmp_path):
    path = write_settings(
        tmp_path / "settings.ini", str(tmp_path / "store"), experiment={"BACKEND": "sagemaker"}
    )
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    assert {"[experiment] STORE", "[experiment] ROLE_ARN", "[experiment] IMAGE_URI"} <= {
        p.split(":")[0] for p in info.value.problems
    }


def test_invalid_settings_write_nothing(tmp_path):
    store = tmp_path / "store"
    path = write_settings(tmp_path / "settings.ini", str(store), training={"EPOCHS": "-1"})
    done = subprocess.run(
        [sys.executable, str(ROOT / "run_pipeline.py"), str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert "[training] EPOCHS" in done.stderr and "Traceback" not in done.stderr
    assert not Path(store).exists()


def test_hyperparameters_are_cast_once_and_unknown_ones_refused():
    from steps.hyperparameters import DEFAULTS, parse_hyperparameters

    parsed = parse_hyperparameters(
        {"epochs": "3.0", "learning_rate": '"0.1"', "batch_size": 16, "model_name": "minilm"}
    )
    assert parsed == {**DEFAULTS, "epochs": 3, "learning_rate": 0.1, "batch_size": 16,
                      "model_name": "minilm"}  # fmt: skip
    assert parse_hyperparameters({"compile": "true", "group_by_length": "False"})["compile"] is True
    with pytest.raises(ValueError, match="compile='yes please' is not a bool"):
        parse_hyperparameters({"compile": "yes please"})
    with pytest.raises(ValueError) as info:
        parse_hyperparameters({"epochs": "2.5", "dropout": "0.1"})
    assert "hyperparameter epochs='2.5' is not a int" in str(info.value)
    assert "unknown hyperparameter 'dropout'" in str(info.value)


def test_sagemaker_settings_aws_would_refuse_are_refused_by_key(tmp_path):
    """What SageMaker refuses of a request, said at the key it comes from: an online wandb
    run with no key for the job, names and values past the service model's limits."""
    path = write_settings(
        tmp_path / "settings.ini", "s3://bucket/root",
        experiment={"BACKEND": "sagemaker", "ROLE_ARN": "arn:aws:iam::123:role/x", "IMAGE_URI": "i" * 256},
        data={"INSTANCE_TYPE": "ml.p4d.24xlarge"},  # a training type, not a processing one
        models={"MODEL_NAMES": ",".join(f"model-{i:02d}-" + "x" * 30 for i in range(8))},
        tracking={"WANDB_MODE": "online"},
        hub={"TOKEN_SECRET_ID": "h" * 257},
        **{"tuning.hyperparameters": {"BATCH_SIZE": ",".join(str(i) for i in range(1, 32))}},
    )  # fmt: skip
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    said = "\n".join(info.value.problems)
    assert "[tracking] WANDB_MODE = online on the sagemaker backend needs WANDB_SECRET_ID" in said
    assert (
        "[data] INSTANCE_TYPE: 'ml.p4d.24xlarge' is not a value SageMaker accepts for ProcessingInstanceType"
        in said
    )
    assert (
        "[experiment] ROLE_ARN: 'arn:aws:iam::123:role/x' must satisfy regular expression pattern"
        in said
    )
    assert "[experiment] IMAGE_URI:" in said and "have at most 255 characters" in said
    assert "[models] MODEL_NAMES: 319 characters with the commas" in said
    assert "[hub] TOKEN_SECRET_ID:" in said
    assert "[tuning.hyperparameters] BATCH_SIZE:" in said and "have at most 30 values" in said


def test_max_wait_is_a_spot_setting(tmp_path):
    wait = {"MAX_RUN_SECONDS": "7200", "MAX_WAIT_SECONDS": "3600"}
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "store"), training=wait)
    load_settings(path, env={})  # on-demand: MaxWaitTimeInSeconds is not sent
    path = write_settings(
        tmp_path / "settings.ini", str(tmp_path / "store"), training={**wait, "USE_SPOT": "true"}
    )
    with pytest.raises(
        ConfigError, match=r"MAX_WAIT_SECONDS \(3600\) must be at least MAX_RUN_SECONDS"
    ):
        load_settings(path, env={})


def test_hub_access_is_a_setting_of_the_run(tmp_path):
    from pipeline.stages import HUB_OFFLINE, job_env

    online = load_settings(
        write_settings(tmp_path / "a.ini", str(tmp_path / "s"), hub={"OFFLINE": "false"}), env={}
    )
    assert not set(HUB_OFFLINE) & set(job_env(online))
    offline = load_settings(
        write_settings(tmp_path / "b.ini", str(tmp_path / "s"), hub={"OFFLINE": "true"}), env={}
    )
    assert {k: job_env(offline)[k] for k in HUB_OFFLINE} == dict.fromkeys(HUB_OFFLINE, "1")
    # Not in the image: a job of a run that may download can.
    from pipeline.player.environment import dockerfile_instructions

    env_lines = " ".join(a for i, a in dockerfile_instructions() if i == "ENV")
    assert not any(name in env_lines for name in HUB_OFFLINE)
    emulated = load_settings(
        write_settings(tmp_path / "c.ini", str(tmp_path / "s"), experiment={"BACKEND": "emulated"},
                       hub={"TOKEN_SECRET_ID": "smpipe/hf"}), env={})  # fmt: skip
    assert job_env(emulated)["SMPIPE_HF_TOKEN_SECRET_ID"] == "smpipe/hf"
    local = load_settings(
        write_settings(tmp_path / "d.ini", str(tmp_path / "s"), hub={"TOKEN_SECRET_ID": "x"}),
        env={},
    )
    assert "SMPIPE_HF_TOKEN_SECRET_ID" not in job_env(local)  # a local job has this machine's token


def test_processes_and_loader_workers_default_to_auto(tmp_path):
    settings = load_settings(write_settings(tmp_path / "settings.ini", str(tmp_path / "s")), env={})
    assert settings.training.processes_per_host == "auto"
    assert settings.training_hyperparameters("bow", "training")["dataloader_num_workers"] == "auto"
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "s"),
                          training={"PROCESSES_PER_HOST": "0", "DATALOADER_NUM_WORKERS": "many"})  # fmt: skip
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    assert {p.split(":")[0] for p in info.value.problems} == {
        "[training] PROCESSES_PER_HOST",
        "[training] DATALOADER_NUM_WORKERS",
    }


def test_an_unknown_key_gets_a_did_you_mean_and_names_the_variable_that_set_it(tmp_path):
    """A typo'd key is said with the key it resembles; a value an SMPIPE__ variable set is
    said with that variable, which the file does not show."""
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "store"),
                          training={"LEARNING_RAT": "0.1"})  # fmt: skip
    with pytest.raises(ConfigError, match=r"\[training\] LEARNING_RAT: unknown key \(did you mean LEARNING_RATE\? allowed: "):  # fmt: skip
        load_settings(path, env={})
    env = {"SMPIPE__TRAINING__EPOCHZ": "3", "SMPIPE__TRAINING__BATCH_SIZE": "many"}
    with pytest.raises(ConfigError) as raised:
        load_settings(write_settings(path, str(tmp_path / "store")), env=env)
    said = str(raised.value)
    assert "[training] EPOCHZ: unknown key (did you mean EPOCHS?" in said
    assert "(set by SMPIPE__TRAINING__EPOCHZ in the environment)" in said
    assert "[training] BATCH_SIZE: " in said
    assert "(set by SMPIPE__TRAINING__BATCH_SIZE in the environment)" in said
    settings = load_settings(path, env={"SMPIPE__TRAINING__EPOCHS": "2"})
    assert settings.overrides == ("SMPIPE__TRAINING__EPOCHS",)
    tuned = write_settings(tmp_path / "tuned.ini", str(tmp_path / "store"),
                           **{"tuning.hyperparameters.minilm": {"EPOCH": "2"}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"\[tuning.hyperparameters.minilm\] EPOCH: not a "
                       r"tunable hyperparameter \(did you mean EPOCHS\? allowed: "):  # fmt: skip
        load_settings(tuned, env={})


def test_an_override_of_training_reaches_every_model_and_says_so(tmp_path):
    """SMPIPE__TRAINING__EPOCHS=1, the docs' example, trains every model one epoch, the file's
    [training.bow] EPOCHS given way too and said; a model's own variable still sets it."""
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "store"),
                          models={"MODEL_NAMES": "bow, minilm"},
                          **{"training.bow": {"EPOCHS": "4", "LEARNING_RATE": "0.01"},
                             "tuning.hyperparameters.bow": {"LEARNING_RATE": "0.01"}})  # fmt: skip
    settings = load_settings(path, env={"SMPIPE__TRAINING__EPOCHS": "1"})
    epochs = lambda s: [s.model_training.get(m, s.training).epochs for m in ("bow", "minilm")]  # noqa: E731
    assert epochs(settings) == [1, 1]
    assert settings.model_training["bow"].learning_rate == 0.01  # not overridden: kept
    assert settings.given_way == (
        "SMPIPE__TRAINING__EPOCHS overrides [training.bow] EPOCHS = 4 of the file too",
    )
    assert settings.overrides == ("SMPIPE__TRAINING__EPOCHS",)
    env = {"SMPIPE__TRAINING__EPOCHS": "1", "SMPIPE__TRAINING_BOW__EPOCHS": "3",
           "SMPIPE__TUNING_HYPERPARAMETERS__LEARNING_RATE": "0.02"}  # fmt: skip
    settings = load_settings(path, env=env)
    assert epochs(settings) == [3, 1]
    assert settings.tuning_constants["learning_rate"] == "0.02"  # a training job's string
    assert "learning_rate" not in settings.model_tuning_constants.get("bow", {})
    # `smpipe plan` says it, as the user sees it, first (the plan itself is then refused here
    # for want of raw data).
    env = {**os.environ, "SMPIPE__TRAINING__EPOCHS": "1"}
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "plan", str(path), "--backend", "local"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    said = "SMPIPE__TRAINING__EPOCHS overrides [training.bow] EPOCHS = 4 of the file too"
    assert said in done.stdout + done.stderr
    # An option is said as the user gave it, not as the variable that carries it.
    said = "overridden by --backend local, SMPIPE__TRAINING__EPOCHS"
    assert said in done.stdout + done.stderr


def test_the_sagemaker_backends_missing_settings_give_an_example_and_the_next_step(tmp_path):
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "store"),
                          experiment={"BACKEND": "sagemaker"})  # fmt: skip
    with pytest.raises(ConfigError) as raised:
        load_settings(path, env={})
    said = str(raised.value)
    assert "STORE = s3://my-bucket/smpipe" in said
    # `smpipe iam` needs the role named (its policies name it): said in the order it is done.
    assert "ROLE_ARN = arn:aws:iam::123456789012:role/smpipe-jobs: create a role that " in said
    assert "name it here; then `smpipe iam" in said and "prints the policy to attach to it" in said
    assert "IMAGE_URI = 123456789012.dkr.ecr.us-east-1.amazonaws.com/smpipe:latest" in said
    assert said.count("--backend emulated") == 1
    # The commands it suggests name this settings file, whatever its name.
    assert f"`smpipe run {path} --backend emulated`" in said and f"`smpipe iam {path}`" in said


def test_a_store_and_raw_data_under_home_are_read_as_a_shell_reads_them(tmp_path, monkeypatch):
    """`STORE = ~/smpipe` is the home folder's, not a folder named `~` beside the settings;
    `${DATA}/smpipe` the variable's folder."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = write_settings(tmp_path / "settings.ini", "~/smpipe", data={"RAW_DATA": "~/raw"})
    settings = load_settings(path, env={})
    assert settings.store_uri() == str(tmp_path / "home" / "smpipe")
    assert settings.raw_data_uri() == str(tmp_path / "home" / "raw")
    # Environment variables too, never a folder named `${DATA}`; one not set is named.
    monkeypatch.setenv("DATA", str(tmp_path / "data"))
    path = write_settings(tmp_path / "s2.ini", "${DATA}/smpipe", data={"RAW_DATA": "$DATA/raw"})
    settings = load_settings(path, env={})
    assert settings.store_uri() == str(tmp_path / "data" / "smpipe")
    assert settings.raw_data_uri() == str(tmp_path / "data" / "raw")
    monkeypatch.delenv("DATA")
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    said = str(info.value)
    assert "[experiment] STORE: '${DATA}/smpipe' names ${DATA}: not set in the environment" in said
    assert "[data] RAW_DATA: '$DATA/raw' names $DATA: not set in the environment" in said
    # Quotes, as a path is quoted in a shell: they would be part of it.
    path = write_settings(tmp_path / "s3.ini", '"./artifacts"', data={"RAW_DATA": "'./raw'"})
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    said = str(info.value)
    assert "[experiment] STORE: '\"./artifacts\"' is in quotes, which would be part of" in said
    assert "[data] RAW_DATA: \"'./raw'\" is in quotes" in said


def test_a_project_in_a_folder_whose_name_is_not_utf8_is_refused_before_any_job(tmp_path):
    """`caf\xe9` (latin-1) is a folder name Linux allows. The plan passed, and the run failed
    after reconcile with a serializer's traceback, leaving a failed run and a data version
    each time it was tried."""
    folder = tmp_path / os.fsdecode(b"caf\xe9")
    folder.mkdir()
    path = write_settings(folder / "settings.ini", "./artifacts", data={"RAW_DATA": "./raw"})
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    shown = f"{tmp_path}/caf\\xe9"
    assert info.value.problems == [
        f"[experiment] STORE: {shown}/artifacts holds bytes that are not UTF-8, and a run's "
        "records, S3 keys and SageMaker's requests are UTF-8: rename it (or the folder it is in)",
        f"[data] RAW_DATA: {shown}/raw holds bytes that are not UTF-8, and a run's records, S3 "
        "keys and SageMaker's requests are UTF-8: rename it (or the folder it is in)",
    ]
    # Where the store and the data are elsewhere, the settings file may live there.
    path = write_settings(folder / "s2.ini", str(tmp_path / "store"), data={"RAW_DATA": ""})
    assert load_settings(path, env={}).store_uri() == str(tmp_path / "store")


def test_an_override_in_lower_case_applies_and_two_of_one_key_are_refused(tmp_path):
    """`smpipe__training__epochs=1` overrode nothing, without a word: pydantic-settings reads
    an environment's names in any case by default, and so do the overrides. Two variables
    that set one key would leave which wins to their order: refused, naming both."""
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "store"))
    settings = load_settings(path, env={"smpipe__training__epochs": "2"})
    assert settings.training.epochs == 2 and settings.overrides == ("smpipe__training__epochs",)
    with pytest.raises(ConfigError) as raised:
        load_settings(path, env={"SMPIPE__TRAINING__EPOCHS": "3", "smpipe__training__epochs": "2"})
    assert raised.value.problems == [
        "environment SMPIPE__TRAINING__EPOCHS and smpipe__training__epochs both set [training] "
        "EPOCHS: unset one"
    ]


def test_a_region_or_bucket_name_aws_does_not_know_is_said(tmp_path, caplog):
    """`REGION = us-esat-1` and `STORE = s3://My_Bucket/x` passed `plan` and `iam` (whose
    policies named the region) without a word; every request would then fail."""
    caplog.set_level("WARNING", logger="smpipe")
    sagemaker = {"BACKEND": "sagemaker", "REGION": "us-esat-1",
                 "ROLE_ARN": "arn:aws:iam::123456789012:role/smpipe-jobs",
                 "IMAGE_URI": "123456789012.dkr.ecr.us-east-1.amazonaws.com/smpipe:latest"}  # fmt: skip
    path = write_settings(tmp_path / "s.ini", "s3://My_Bucket/x", experiment=sagemaker,
                          tracking={"WANDB_MODE": "offline"})  # fmt: skip
    load_settings(path, env={})
    said = caplog.text
    assert "REGION = us-esat-1: botocore knows no SageMaker there (did you mean " in said
    assert " or us-east-1 or " in said
    assert "STORE: 'My_Bucket' is not a bucket name S3's naming rules allow" in said
    caplog.clear()
    fixed = {**sagemaker, "REGION": "eu-west-1"}
    load_settings(write_settings(tmp_path / "s2.ini", "s3://my-bucket/x", experiment=fixed,
                                 tracking={"WANDB_MODE": "offline"}), env={})  # fmt: skip
    assert "botocore knows no" not in caplog.text and "naming rules" not in caplog.text
