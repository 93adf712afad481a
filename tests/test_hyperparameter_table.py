"""One table of hyperparameters (steps/hyperparameters.py): the settings schema, the shipped
settings.ini, what a training job receives and how train.py reads it all come from it."""

from __future__ import annotations

import logging
import re

import pytest
from pydantic_core import PydanticUndefined

from pipeline.config import SECTIONS, ConfigError, Training, load_settings
from steps.hyperparameters import (
    DEFAULTS,
    HYPERPARAMETERS,
    PER_MODEL,
    TABLE,
    TUNABLE,
    parse_hyperparameters,
)
from tests.conftest import ROOT, write_settings

SHIPPED = ROOT / "settings.ini"
# A key the demo sets otherwise than its default says so on the line just above it.
DEMO = re.compile(r"^# demo: \S")


def shipped_keys() -> dict[tuple[str, str], str | None]:
    """(section, key) -> the comment line just above the key in the shipped file."""
    keys, section, above = {}, None, None
    for line in SHIPPED.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            section, above = stripped[1:-1].lower(), None
        elif stripped.startswith("#"):
            above = stripped
        elif "=" in stripped and section in SECTIONS:
            keys[section, stripped.split("=", 1)[0].strip().lower()] = above
            above = None
        else:
            above = None
    return keys


def test_the_shipped_file_holds_the_defaults_or_says_why_not():
    """settings.ini says it lists every key with its default: a value of its own is marked
    `# demo: ...` on the line above the key, and a marked value differs from the default."""
    settings = load_settings(SHIPPED, env={})
    wrong = []
    for (section, key), above in shipped_keys().items():
        default = SECTIONS[section].model_fields[key].default
        if default is PydanticUndefined:  # a required key: no default to hold
            continue
        value = getattr(getattr(settings, section), key)
        marked = bool(above and DEMO.match(above))
        if value != default and not marked:
            wrong.append(f"[{section}] {key.upper()} = {value!r}, default {default!r}: unmarked")
        if value == default and marked:
            wrong.append(f"[{section}] {key.upper()} is the default but marked {above!r}")
    assert not wrong


def test_the_shipped_file_lists_every_key():
    listed = set(shipped_keys())
    missing = [
        f"[{section}] {key.upper()}"
        for section, model in SECTIONS.items()
        for key in model.model_fields
        if (section, key) not in listed
    ]
    assert not missing


def test_the_settings_schema_comes_from_the_table():
    for h in TABLE:
        if h.section == "run":  # the driver's, per job
            continue
        field = SECTIONS[h.section].model_fields[h.name]
        assert field.default == h.default and field.description == h.help, h.name
    for h in (h for h in TABLE if h.section == "training" and h.bounds()):
        for bound, limit in h.bounds().items():  # each bound refused one step past it
            beyond = {"ge": -1, "gt": 0, "le": 1, "lt": 0}[bound] * (1 if h.type is int else 1e-9)
            with pytest.raises(ValueError):
                Training(**{h.name: limit + beyond})
    assert set(TUNABLE) <= set(PER_MODEL) <= {h.name for h in TABLE if h.section == "training"}
    assert "max_sequence_length" not in HYPERPARAMETERS  # prepare's, in [data]


def test_a_job_receives_every_hyperparameter_as_strings_and_reads_them_back(tmp_path):
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "s"),
                          training={"COMPILE": "true", "DATALOADER_NUM_WORKERS": "3"},
                          **{"training.bow": {"LEARNING_RATE": "0.02"}})  # fmt: skip
    settings = load_settings(path, env={})
    sent = settings.training_hyperparameters("bow", "training")
    assert list(sent) == [h.name for h in TABLE]
    assert all(isinstance(v, str) for v in sent.values())
    assert sent["compile"] == "true" and sent["learning_rate"] == "0.02"
    read = parse_hyperparameters(sent)
    training = settings.model_training["bow"]
    for h in TABLE:
        if h.section == "training":
            assert read[h.name] == getattr(training, h.name), h.name
    assert read["seed"] == settings.data.seed and read["dataloader_num_workers"] == 3
    assert read["wandb_mode"] == settings.tracking.wandb_mode
    assert {k: v for k, v in parse_hyperparameters({}).items()} == DEFAULTS


def test_a_job_refuses_values_outside_the_table():
    with pytest.raises(ValueError) as info:
        parse_hyperparameters(
            {"epochs": "0", "mixed_precision": "fp8", "max_sequence_length": "64"}
        )
    said = str(info.value)
    assert "hyperparameter epochs='0' must be >= 1" in said
    assert "mixed_precision='fp8' is not one of auto, no, bf16, fp16" in said
    assert "unknown hyperparameter 'max_sequence_length'" in said


def test_a_section_of_a_model_not_in_the_list_is_checked_and_not_applied(tmp_path, caplog):
    """The shipped file with one of its models: its other model's sections are a warning,
    and a likely misspelling names the model it could mean."""
    with caplog.at_level(logging.WARNING, logger="smpipe"):
        settings = load_settings(SHIPPED, env={"SMPIPE__MODELS__MODEL_NAMES": "minilm"})
    assert settings.models.model_names == ["minilm"] and "bow" not in settings.model_training
    assert "bow" not in settings.model_tuning_constants | settings.model_tunables
    warned = [r.getMessage() for r in caplog.records]
    assert any("[training.bow] is checked but not applied: 'bow' is not in [models] "
               "MODEL_NAMES (minilm)" in w for w in warned), warned  # fmt: skip
    assert any("[tuning.hyperparameters.bow]" in w for w in warned)

    caplog.clear()
    path = write_settings(tmp_path / "s.ini", str(tmp_path / "s"), training={"EPOCHS": "1"},
                          **{"training.minlm": {"EPOCHS": "2"}})  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="smpipe"):
        settings = load_settings(path, env={})
    assert settings.model_training == {}
    assert "did you mean 'minilm'?" in caplog.text

    # Checked as fully as any: a key or value it may not have is an error.
    path = write_settings(tmp_path / "s.ini", str(tmp_path / "s"),
                          **{"training.minlm": {"EPOCHS": "0", "INSTANCE_TYPE": "ml.p3.2xlarge"}})  # fmt: skip
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    assert {p.split(":")[0] for p in info.value.problems} == {
        "[training.minlm] EPOCHS",
        "[training.minlm] INSTANCE_TYPE",
    }
