"""Finding 2: a model full of NaN is never promoted. A diverging job stops at the first
non-finite loss naming the step, the epoch and the last finite loss; nothing of it is kept;
settings that would diverge it are refused before any job starts."""

from __future__ import annotations

import re

import pytest

from pipeline.config import ConfigError, load_settings
from tests.conftest import write_settings
from tests.jobs.training_job import HPS, job_root, start

# Within the table's bounds (a job refuses 1e30 by name before it trains): a step of 10 with a
# decoupled weight decay of 10 multiplies every weight by -99 a step, until it overflows. The
# loss is read after every step of an 8-step epoch, and every 3 steps of a 32-step one.
DIVERGING = {"learning_rate": "10", "weight_decay": "10"}


@pytest.mark.parametrize(
    "hps", [DIVERGING, {**DIVERGING, "batch_size": "2", "max_per_device_batch_size": "1"}]
)
def test_a_diverging_job_fails_naming_the_step_and_keeps_no_model(tmp_path, channels, hps, warm):
    root, env = job_root(tmp_path, channels, {**HPS, **hps})
    proc = start(env, 1, warm)
    log = proc.communicate(timeout=240)[0]
    assert proc.returncode != 0, log
    reason = (root / "output/failure").read_text()
    assert re.search(r"Diverged: the training loss is (nan|inf) at optimizer step", reason), reason
    assert "the last finite loss was" in reason or "no step had a finite loss" in reason
    assert "no model of this job is kept" in reason
    assert not any((root / "model").iterdir())  # nothing to upload


@pytest.mark.parametrize("key, value", [("LEARNING_RATE", "1e400"), ("WEIGHT_DECAY", "inf")])
def test_non_finite_settings_are_refused(tmp_path, key, value):
    path = write_settings(tmp_path / "s.ini", str(tmp_path / "store"), training={key: value})
    with pytest.raises(ConfigError, match=rf"\[training\] {key}: must be a finite number"):
        load_settings(path, {})
