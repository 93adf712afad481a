"""Each processing step's command line is declared once (steps/arguments.py): the step parses
what the driver sends, and every value comes from the settings or the job, never from a
default of the step's own."""

from __future__ import annotations

import pytest

from pipeline.config import load_settings
from pipeline.paths import ExperimentTree
from pipeline.sources import Sources
from pipeline.stages import build_jobs, step_arguments
from steps.arguments import TABLES, parse
from tests.conftest import write_settings


@pytest.fixture
def settings(tmp_path):
    path = write_settings(
        tmp_path / "settings.ini",
        str(tmp_path / "store"),
        experiment={"JOB": "tune"},  # a tuned model's export is a processing job too
        tracking={"WANDB_MODE": "offline"},
    )
    return load_settings(path, env={})


def test_every_processing_job_sends_what_its_step_parses(settings):
    tree = ExperimentTree(settings.experiment.name)
    steps = ["reconcile", "prepare", "train", "inference"]
    jobs = build_jobs(settings, steps, tree.run(1), Sources(raw=tree.raw))
    processing = [job for job in jobs if job.kind == "processing"]
    assert {job.step for job in processing} == {"reconcile", "prepare", "export", "inference"}
    for job in processing:
        parsed = vars(parse(TABLES[job.step], job.arguments))
        assert set(parsed) == {a.dest for a in TABLES[job.step]}, job.step
    inference = next(job for job in processing if job.step == "inference")
    # [tracking] WANDB_MODE reaches the step: the step has no default that could differ.
    assert vars(parse(TABLES["inference"], inference.arguments))["wandb_mode"] == "offline"


def test_an_argument_the_job_must_give_is_named_when_missing(settings):
    with pytest.raises(ValueError, match=r"EXPORT: arguments missing \['exports'\]"):
        step_arguments(settings, "export", {"model_name": "minilm"})


def test_a_step_refuses_a_missing_argument_and_a_word_its_table_does_not_take():
    line = ["--model-name", "m", "--batch-size", "8", "--mixed-precision", "auto"]
    line += ["--text-columns", "text"]
    with pytest.raises(SystemExit):  # --model-format missing: no default to fall back on
        parse(TABLES["predict"], line)
    with pytest.raises(SystemExit):
        parse(TABLES["predict"], [*line, "--model-format", "onnx"])
    parse(TABLES["predict"], [*line, "--model-format", "exported"])
