"""One metric contract: the line train.py prints, the regexes that read it (SageMaker's
MetricDefinitions and every local trial's), and the check of a user's own regex."""

from __future__ import annotations

import re
import warnings

import hypothesis
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from sklearn.metrics import accuracy_score, f1_score

from pipeline.config import ConfigError, load_settings
from steps.metrics import DEFINITIONS, METRICS, SAMPLE_LINE, metric_line
from steps.training_blocks import accuracy_and_f1
from tests.conftest import write_settings


def test_every_metric_train_prints_is_read_back_by_its_definition():
    record = {
        "epoch": 3,
        "step": 18,
        "train_loss": 0.5,
        "val_loss": 1e-7,
        "accuracy": 1.0,
        "f1": float("nan"),
    }
    line = metric_line(record)
    assert line.startswith("epoch=3 step=18 train:loss=0.500000 validation:loss=0.000000")
    for name, key in METRICS.items():
        value = float(re.search(DEFINITIONS[name], line).group(1))
        assert value == pytest.approx(round(record[key], 6), nan_ok=True), name
    # The "best" line train.py ends with is read the same way (the tuner's final objective).
    assert re.search(DEFINITIONS["validation:f1"], "best " + SAMPLE_LINE)


@pytest.mark.parametrize(
    "section, key, value, expected",
    [
        ("tuning.metric_definitions", "f1", "(f1)=([0-9.]+)", "has 2 groups; it must capture the value in exactly one"),
        ("tuning.metric_definitions", "f1", "macro_f1=([0-9.]+)", "does not match the line train.py prints"),
        ("tuning.metric_definitions", "f1", "validation:(f1)=", "captures 'f1' from the metric line, not a number"),
        ("tuning.metric_definitions", "validation:f1", "validation:accuracy=([0-9.]+)", "another metric's value"),
        ("tuning", "OBJECTIVE_METRIC", "validation:f2", "'validation:f2' is not a metric (train.py prints train:loss"),
    ],
)  # fmt: skip
def test_a_regex_or_objective_that_cannot_read_the_metric_line_is_refused(
    tmp_path, section, key, value, expected
):
    path = write_settings(tmp_path / "s.ini", str(tmp_path / "store"), **{section: {key: value}})
    with pytest.raises(ConfigError) as e:
        load_settings(path, {})
    assert any(expected in p for p in e.value.problems), e.value.problems


def test_a_users_own_definition_is_added_beside_the_defaults(tmp_path):
    path = write_settings(tmp_path / "s.ini", str(tmp_path / "store"),
                          **{"tuning.metric_definitions": {"f1": r"validation:f1=([0-9.]+)"},
                             "tuning": {"OBJECTIVE_METRIC": "f1"}})  # fmt: skip
    settings = load_settings(path, {})
    assert set(settings.metric_definitions) == {*METRICS, "f1"}


@given(
    st.lists(st.tuples(st.integers(0, 6), st.integers(0, 7)), min_size=1, max_size=80),
)
@hypothesis.settings(max_examples=300, deadline=None)
def test_validation_accuracy_and_f1_are_scikit_learns(pairs):
    """Training counts them itself (sklearn.metrics costs every job 1.2 s to import); they must
    be the numbers scikit-learn gives, labels missing on one side included."""
    reference, predicted = (np.array(side) for side in zip(*pairs, strict=True))
    got = accuracy_and_f1(reference, predicted)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sklearn warns where a label is never predicted
        assert got["f1"] == f1_score(reference, predicted, average="macro")
    assert got["accuracy"] == accuracy_score(reference, predicted)
