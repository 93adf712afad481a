"""What a training job makes of the model it is given: torch.compile trains the same model
and exports it, a model with the wrong number of outputs is refused before training, and one
built with num_labels alone is saved naming the data's labels."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import ROOT
from tests.jobs.training_job import HPS, job_root, result, run_to_end, start

NO_DROPOUT = """
from user_functions import encode, load_tokenizer, ordered_input_keys, reconcile  # noqa: F401
from user_functions import load_model as _load_model


def load_model(model_name, id2label, label2id):
    model = _load_model(model_name, id2label, label2id)
    model.dropout.p = 0.0  # nothing random in the forward pass
    return model
"""


def test_compile_trains_the_same_model_and_exports_it(tmp_path, channels, warm):
    """torch.compile changes how the forward pass is computed, not what it computes: without
    dropout (whose compiled kernel draws random numbers of its own), the compiled job ends
    with the eager job's weights and metrics, up to float rounding, and its exports pass."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code/no_dropout.py").write_text(NO_DROPOUT)
    jobs = {}
    for compiled, exports in (("false", "torchscript"), ("true", "torchscript,exported")):
        root, env = job_root(
            tmp_path / compiled, channels, {**HPS, "compile": compiled, "exports": exports}
        )
        env = {**env, "SMPIPE_USER_FUNCTIONS": "no_dropout",
               "PYTHONPATH": f"{tmp_path / 'code'}{os.pathsep}{ROOT}"}  # fmt: skip
        jobs[compiled] = (root, start(env, processes=1, warm=warm))  # both at once
    for _, proc in jobs.values():
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]
    report = json.loads((jobs["true"][0] / "output/data/step_metadata.json").read_text())
    assert report["compile"] is True
    assert report["exports"]["torchscript"]["passed"] and report["exports"]["exported"]["passed"]
    (eager, eager_history), (compiled, history) = (result(root) for root, _ in jobs.values())
    assert eager.keys() == compiled.keys()
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], rtol=1e-4, atol=1e-5)
    assert [h["epoch"] for h in history] == [h["epoch"] for h in eager_history] == [1, 2, 3]
    for ours, theirs in zip(history, eager_history, strict=True):
        assert (ours["accuracy"], ours["f1"]) == (theirs["accuracy"], theirs["f1"])
        assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-4)
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-4)


def test_compile_options_name_inductor_settings_this_torch_has():
    """COMPILE's Inductor options (steps/train.py `compile_options`): on the lock's torch, the
    mix-order reduction off, under the name Inductor's config gives it; a misspelt name would
    be dropped as "not in this torch", silently."""
    from torch._inductor import config

    from steps.train import compile_options

    options = compile_options()
    assert options == {"triton.mix_order_reduction": False}
    # Inductor's default on GPUs (TORCHINDUCTOR_MIX_ORDER_REDUCTION may say otherwise here)
    with config.patch({"triton.mix_order_reduction": True}), config.patch(options):
        assert config.triton.mix_order_reduction is False  # as torch.compile applies them


WIDE = """
from user_functions import encode, load_tokenizer, ordered_input_keys, reconcile
from user_functions.baseline import BagOfEmbeddings


def load_model(model_name, id2label, label2id):
    return BagOfEmbeddings(30522, len(id2label) + 5)  # ten outputs for five labels, say
"""


def test_a_model_with_the_wrong_number_of_outputs_is_refused_before_training(
    tmp_path, channels, warm
):
    """load_model with more outputs than labels: refused by name before the first step, not
    trained and saved to fail in inference."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code/wide_functions.py").write_text(WIDE)
    root, env = job_root(tmp_path / "root", channels)
    env = {
        **env,
        "SMPIPE_USER_FUNCTIONS": "wide_functions",
        "PYTHONPATH": f"{tmp_path / 'code'}:{ROOT}",
    }
    proc = start(env, 1, warm)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1
    reason = (root / "output/failure").read_text()
    assert reason == ("train: ValueError: wide_functions.load_model returned a model with 8 outputs "
                      "for 3 labels: give it one output per label (num_labels=len(id2label))")  # fmt: skip
    assert "step=1/" not in out and not list((root / "model").iterdir())


# A transformers model built as its docs build one for a new head, with num_labels alone.
NUM_LABELS_ONLY = """
from user_functions import encode, load_tokenizer, ordered_input_keys, reconcile  # noqa: F401


def load_model(model_name, id2label, label2id):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, num_labels=len(id2label))
    return BertForSequenceClassification(config)
"""


# The transformers tutorial's way: a class map of the user's own, here in another order.
OWN_NAMES = NUM_LABELS_ONLY.replace(
    "num_labels=len(id2label))",
    "id2label={0: 'c', 1: 'b', 2: 'a'}, label2id={'c': 0, 'b': 1, 'a': 2})",
)


@pytest.mark.parametrize("source", [NUM_LABELS_ONLY, OWN_NAMES], ids=["num-labels", "own-map"])
def test_a_model_built_with_num_labels_alone_is_saved_naming_the_datas_labels(
    tmp_path, channels, warm, source
):
    """Its config says LABEL_0, LABEL_1...: the config.json the job saves names the classes
    as id2label.json does, for transformers' pipeline and whoever else reads it. A map of the
    user's own that differs is replaced so too, and said."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code/plain_head.py").write_text(source)
    root, env = job_root(tmp_path / "root", channels, {**HPS, "epochs": "1", "max_steps": "2"})
    env = {**env, "SMPIPE_USER_FUNCTIONS": "plain_head",
           "PYTHONPATH": f"{tmp_path / 'code'}:{ROOT}"}  # fmt: skip
    out = " ".join(run_to_end(env, warm=warm).split())
    config = json.loads((root / "model/config.json").read_text())
    assert config["id2label"] == {"0": "a", "1": "b", "2": "c"}
    assert config["label2id"] == {"a": 0, "b": 1, "c": 2}
    said = (
        "warning: plain_head.load_model('bow', ...) built a model whose config names its classes "
        "{0: 'c', 1: 'b', 2: 'a'}; the data's class ids are {0: 'a', 1: 'b', 2: 'c'}"
    )
    assert (said in out) == (source is OWN_NAMES), out[-3000:]
