"""Which precision a job computes in, and why: one answer for training, inference and predict.

`MIXED_PRECISION = auto` is bf16 where the hardware computes bf16 natively (`resolve`: a GPU from
Ampere on, a CPU with AMX or AVX512-BF16: `cpu_bf16`), fp16 on an older GPU, fp32 on any other
CPU. `autocast` is the context a forward pass runs in. docs/performance.md (Precision) has the
measurements behind the rule.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from steps.hyperparameters import PRECISION_CHOICES
from steps.runtime.names import (  # overrides the CPU detection (cpu_bf16)
    CPU_BF16_CHOICES,
    CPU_BF16_VARIABLE,
)


@dataclass(frozen=True)
class Precision:
    """What a job computes in (`no`: fp32, `bf16`, `fp16`), and why, in words for its report."""

    applied: str
    reason: str

    @property
    def bf16(self) -> bool:
        return self.applied == "bf16"


def cpu_bf16() -> tuple[bool, str]:
    """Whether this CPU computes bf16 natively, and what says so.

    Native means AMX or AVX512-BF16 (Intel Sapphire Rapids and later: AWS's m7i, c7i, r7i). A
    CPU without them runs bf16 matmuls through conversions to fp32 and back, many times slower
    than fp32 (docs/performance.md, Precision), so "auto" must not pick it there. The ability is
    read from what torch exposes of the CPU it dispatches on: `_is_amx_tile_supported` and
    `_is_avx512_bf16_supported` (cpuinfo's flags, as torch's inductor reads them to pick AMX
    kernels: torch/_inductor/cpu_vec_isa.py). `get_cpu_capability()` cannot tell: it names the
    vector ISA ("AVX512"), not whether bf16 is in it; and `torch.ops.mkldnn.
    _is_mkldnn_bf16_supported()` is true on any AVX512 core, where oneDNN emulates bf16.

    `SMPIPE_CPU_BF16` = `native` or `none` overrides the detection: for a test to play either
    CPU, and for a CPU torch misjudges (an ARM core with BF16, which torch does not report)."""
    forced = os.environ.get(CPU_BF16_VARIABLE, "")
    if forced:
        if forced not in CPU_BF16_CHOICES:
            raise ValueError(f"{CPU_BF16_VARIABLE}={forced!r}: use native or none")
        return forced == "native", f"{CPU_BF16_VARIABLE}={forced}"
    found = [
        name
        for name, check in (
            ("AMX", torch.cpu._is_amx_tile_supported),
            ("AVX512-BF16", torch.cpu._is_avx512_bf16_supported),
        )
        if check()
    ]
    if found:
        return True, f"this CPU has {' and '.join(found)}"
    capability = torch.backends.cpu.get_cpu_capability()
    return False, f"this CPU ({capability}) has neither AMX nor AVX512-BF16"


def resolve(setting: str, num_gpus: int) -> Precision:
    """The precision MIXED_PRECISION asks for, on this machine."""
    if setting not in PRECISION_CHOICES:
        raise ValueError(f"MIXED_PRECISION = {setting}: use one of {', '.join(PRECISION_CHOICES)}")
    if num_gpus:
        if setting != "auto":
            return Precision(setting, f"MIXED_PRECISION = {setting}")
        # Native only: compute capability 8.0, Ampere on (A10G, A100, L4, H100). A T4 (ml.g4dn)
        # or V100 (ml.p3) only emulates bf16, which is_bf16_supported counts by default
        # (`including_emulation=True`, torch 2.4 on: torch/cuda/__init__.py).
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return Precision("bf16", "auto: the GPU computes bf16")
        return Precision("fp16", "auto: the GPU has no native bf16, fp16 with a loss scaler")
    if setting == "fp16":
        raise ValueError("MIXED_PRECISION = fp16 needs a GPU (use bf16 or no on CPU)")
    if setting != "auto":
        return Precision(setting, f"MIXED_PRECISION = {setting}")
    native, why = cpu_bf16()
    if native:
        return Precision("bf16", f"auto: bf16, {why}")
    return Precision("no", f"auto: fp32, {why}")


def trained_weights_in_fp32(model: torch.nn.Module, precision: Precision) -> dict[str, int]:
    """Under mixed precision, the weights that train upcast to fp32 where load_model built
    them in bf16 or fp16 (`from_pretrained(..., dtype=torch.bfloat16)`, as the transformers
    docs load a large model). AdamW moves a weight by about the learning rate a step, which at
    finetuning's rates is under bf16's resolution (2**-8 of the weight) for most weights: in
    bf16 the updates would round away. Mixed precision keeps fp32 weights for the optimizer and
    computes in bf16 or fp16 under `autocast`, which also casts a frozen bf16 base model's
    activations for an fp32 head; Accelerate upcasts a sharded model's on the same condition
    (accelerate/utils/fsdp_utils.py, fsdp2_prepare_model: `mixed_precision != "no"`). Frozen
    weights (the base model under LoRA) keep their dtype and its memory. Without mixed
    precision nothing is cast: the model computes as built. Returns {dtype: weights upcast}."""
    upcast: dict[str, int] = {}
    for p in model.parameters():
        if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16):
            name = str(p.dtype).removeprefix("torch.")
            upcast[name] = upcast.get(name, 0) + p.numel()
            if precision.applied != "no":
                p.data = p.data.float()
    return upcast


def low_precision_said(low: dict[str, int], precision: Precision) -> str:
    """What `trained_weights_in_fp32` found and did, in words for the job's log."""
    built = ", ".join(f"{n:,} trained weights in {dtype}" for dtype, n in low.items())
    if precision.applied != "no":
        return (
            f"{built}: they train in fp32, computed in {precision.applied} (an optimizer step "
            "in bf16 or fp16 would round most finetuning updates away)"
        )
    return (
        f"{built}: MIXED_PRECISION applies none, so they train as built, and most finetuning "
        "updates round away: build the model in fp32, or set [training] MIXED_PRECISION = bf16"
    )


def autocast(precision: Precision, device: str = "cpu"):
    """The context a forward pass runs in: autocast to bf16 or fp16, or nothing for fp32.

    Under autocast weights and optimizer state stay fp32, matmuls run in bf16, and reductions
    (softmax, layer norm, the loss) stay fp32 by autocast's own op lists. The exported programs
    (TorchScript and torch.export) run under it too: both dispatch their aten ops through the
    autocast key (their logits under it match eager's under it exactly: tests)."""
    if precision.applied in ("bf16", "fp16"):
        dtype = torch.bfloat16 if precision.applied == "bf16" else torch.float16
        return torch.autocast(device, dtype=dtype)
    return contextlib.nullcontext()
