"""A trained model's exports: one that disagrees with the eager model is never kept, and
inference refuses a model whose chosen export failed its check, naming the model and why.
The record of the checks is written by training and read by inference through one module
(steps/model_files.py)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import torch

from steps.batching import Batches
from steps.export import check_exports, export_programs
from steps.model_files import EXPORTS, RECORD, usable_export, write_record

INPUTS = {"keys": ["input_ids"], "pad": {"input_ids": 0}, "sequence": ["input_ids"]}


def batches() -> Batches:
    ids = [[101, 7, 8, 102], [101, 9, 102], [101, 5, 6, 7, 8, 102], [101, 4, 102]]
    table = pa.table(
        {"m_input_ids": ids, "m__length": [len(i) for i in ids], "label_id": [0, 1, 0, 1]}
    )
    return Batches(table, "m", ["input_ids"], INPUTS)


class Drifting(torch.nn.Module):
    """Its answer depends on how often it was called: a Python counter that a trace or an
    export bakes in as a constant, so the programs disagree with the eager model."""

    def __init__(self):
        super().__init__()
        self.embedding, self.calls = torch.nn.Embedding(200, 2), 0

    def forward(self, input_ids):
        self.calls += 1
        return self.embedding(input_ids).mean(1) + self.calls


def test_an_export_that_disagrees_with_the_model_is_not_kept(tmp_path):
    results = export_programs(
        Drifting().eval(), ["input_ids"], INPUTS, batches(), tmp_path, list(EXPORTS)
    )
    assert results["exported"]["passed"] is False and results["exported"]["max_abs_diff"] >= 1
    assert not (tmp_path / EXPORTS["exported"]).exists()
    assert results["torchscript"]["passed"] is False
    with pytest.raises(
        RuntimeError,
        match=r"the torchscript export does not match .*; the exported export does not match",
    ):
        check_exports(results)  # the job fails: nothing wrong is promoted


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(200, 2)

    def forward(self, input_ids):
        return self.embedding(input_ids).mean(1)


def test_exports_that_agree_are_kept_and_recorded(tmp_path):
    results = export_programs(
        Plain().eval(), ["input_ids"], INPUTS, batches(), tmp_path, list(EXPORTS)
    )
    write_record(tmp_path, {"ordered_input_keys": ["input_ids"], "exports": results})
    for model_format in EXPORTS:
        assert usable_export(tmp_path, model_format, "m") == tmp_path / EXPORTS[model_format]


def test_inference_refuses_an_export_that_failed_its_check(tmp_path):
    failed = {"passed": False, "max_abs_diff": 2.5, "same_predictions": False}
    write_record(tmp_path, {"exports": {"torchscript": {"passed": True}, "exported": failed}})
    (tmp_path / EXPORTS["torchscript"]).write_bytes(b"x")
    (tmp_path / EXPORTS["exported"]).write_bytes(b"x")  # left there by hand, say
    with pytest.raises(ValueError) as refused:
        usable_export(tmp_path, "exported", "minilm")
    message = str(refused.value)
    assert message.startswith(
        "model 'minilm' has no usable exported export: its check against the eager model failed"
    )
    assert "max_abs_diff 2.5" in message and "MODEL_FORMAT = torchscript may have one" in message
    record = json.loads((tmp_path / RECORD).read_text())
    record["exports"]["exported"] = {
        "passed": False,
        "error": "Unsupported: data-dependent control flow",
    }
    (tmp_path / RECORD).write_text(json.dumps(record))
    (tmp_path / EXPORTS["exported"]).unlink()
    with pytest.raises(
        ValueError, match="no usable exported export: Unsupported: data-dependent control flow"
    ):
        usable_export(tmp_path, "exported", "minilm")


def test_inference_says_why_the_export_it_wants_is_missing(tmp_path):
    """Through inference's own loader: the reason training recorded, never "no reason"."""
    from steps.inference import load_program

    write_record(
        tmp_path,
        {
            "exports": {
                "torchscript": {"file": EXPORTS["torchscript"], "passed": True},
                "exported": {"passed": False, "error": "Unsupported: data-dependent control flow"},
            }
        },
    )
    with pytest.raises(ValueError) as refused:
        load_program(tmp_path, "exported", "minilm")
    assert str(refused.value) == (
        "model 'minilm' has no usable exported export: Unsupported: data-dependent control "
        "flow; [inference] MODEL_FORMAT = torchscript may have one"
    )
    # Its check passed, and its file went missing since.
    with pytest.raises(ValueError, match=r"its check passed, but model\.torchscript\.pt is no"):
        load_program(tmp_path, "torchscript", "minilm")


def test_an_export_that_could_not_be_written_or_loaded_back_is_said_so():
    """A program torch could not write or load back (out of memory, an unsupported model) is
    not called a mismatch: the job's error says which it was."""
    exports = {
        "torchscript": {"passed": False, "error": "RuntimeError: can't allocate memory"},
        "exported": {"passed": False, "max_abs_diff": 0.5, "same_predictions": False},
    }
    with pytest.raises(RuntimeError) as raised:
        check_exports(exports)
    message = str(raised.value)
    assert (
        "the torchscript export could not be written or loaded back: RuntimeError: can't allocate memory"
        in message
    )
    assert "the exported export does not match the eager model" in message
    assert "[training] EXPORTS" in message
