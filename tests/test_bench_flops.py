"""bench/speed.py's model FLOPs (what its MFU divides) against torch's own count of the real
MiniLM's matmuls (torch.utils.flop_counter.FlopCounterMode), forward and forward+backward."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForSequenceClassification

from user_functions import minilm_path

ROOT = Path(__file__).resolve().parent.parent
ROWS, WIDTH = 4, 128
TOLERANCE = 0.01


@pytest.fixture(scope="module")
def speed():
    spec = importlib.util.spec_from_file_location("bench_speed", ROOT / "bench/speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model():
    # Eager attention: its QK^T and AV are matmuls the counter sees. torch's fused CPU
    # attention kernel (_scaled_dot_product_flash_attention_for_cpu) has no FLOP formula in
    # FlopCounterMode, so under "sdpa" an eval forward would count no attention at all.
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_pretrained(
        minilm_path(), num_labels=5, attn_implementation="eager"
    )


def counted(model, backward: bool) -> dict[str, int]:
    """FLOPs by aten op, as torch counts them, for one batch of ROWS x WIDTH tokens."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 20000, (ROWS, WIDTH), generator=generator)
    mask = torch.ones_like(ids)
    model.train(backward)
    with FlopCounterMode(display=False) as counter:
        if backward:
            labels = torch.zeros(ROWS, dtype=torch.long)
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        else:
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)
    return {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_and_backward"])
def test_model_flops_match_torchs_count_on_minilm(speed, model, backward):
    ops = counted(model, backward)
    parts = speed.encoder_flops(model.config, [(ROWS, WIDTH)], backward=backward)
    total = speed.model_flops(model.config, [(ROWS, WIDTH)], backward=backward)
    assert total == sum(parts.values())
    assert abs(total - sum(ops.values())) / sum(ops.values()) < TOLERANCE, (parts, ops)
    # Attention's two products per head are the batched matmuls (bmm); the weights' are mm
    # and addmm. Each part is held to its own ops, so an error in one is not hidden by the
    # other.
    assert abs(parts["attention"] - ops["aten.bmm"]) / ops["aten.bmm"] < TOLERANCE, (parts, ops)


def test_attention_is_more_than_the_tolerance_at_width_128(speed, model):
    """Dropping attention from the count would fail the test above: at this width it is
    several times the tolerance of the total."""
    parts = speed.encoder_flops(model.config, [(ROWS, WIDTH)])
    assert parts["attention"] / sum(parts.values()) > 3 * TOLERANCE, parts


def test_width_enters_attention_squared(speed, model):
    """Per token, attention grows with the width a row is padded to; the weights' part does
    not: two rows of 64 cost less attention than one row of 128."""
    short = speed.encoder_flops(model.config, [(2, 64)])
    long = speed.encoder_flops(model.config, [(1, 128)])
    assert short["linear"] == long["linear"]
    assert long["attention"] == 2 * short["attention"]
