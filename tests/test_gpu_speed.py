"""bench/gpu_speed.py (part of `make gpu-check`): its clock and sync counter on a CPU, and what
its smoke run prints (the run itself is tests/test_gpu_check.py's). Nothing here asserts a
time."""

from __future__ import annotations

import itertools
import json
import re
import warnings
from pathlib import Path

import pytest
import torch

SIDES = ("ours", "Trainer")


class Encoder(torch.nn.Module):
    """Takes what both sides' models take: input ids and their attention mask."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(10, 4)

    def forward(self, input_ids, attention_mask):
        return (self.embedding(input_ids) * attention_mask[..., None]).sum()


def test_the_window_counts_only_its_own_steps_syncs_and_rows():
    """Three steps to warm up, two timed: the rows, real tokens and sync warnings of the timed
    two alone, though every step warns and sees a batch."""
    from bench import gpu_speed

    model = Encoder()
    optimizer = torch.optim.AdamW(model.parameters(), fused=False)
    window = gpu_speed.Window("cpu", warm=3, steps=2, count_syncs=True)
    with window.watching(model):
        for step in range(6):  # one step past the window, as a loop's last batch may be
            mask = torch.ones(2, 3, dtype=torch.long)
            mask[0, step % 3 :] = 0  # row 0 has step % 3 real tokens, row 1 has 3
            model(input_ids=torch.zeros(2, 3, dtype=torch.long), attention_mask=mask).backward()
            warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
            warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
            warnings.warn("something else", stacklevel=1)
            optimizer.step()
    figures = window.figures(lambda shapes: shapes, "fp32")
    # Steps 4 and 5 (step % 3: 0 and 1): their forwards, and the warnings given after each
    # forward up to the fifth step's end.
    assert figures["examples"] == 4 and figures["steps"] == 2
    assert figures["real_tokens"] == (0 + 3) + (1 + 3) and figures["tokens"] == 12
    assert sorted(figures["flops"]) == [(1, 0), (1, 1), (2, 3)]
    assert figures["syncs"] == 4
    # Where they were asked for: the two lines above, twice each.
    sites = figures["sync_sites"]
    assert sorted(sites.values()) == [2, 2] and all(
        at.startswith("test_gpu_speed.py:") for at in sites
    ), sites
    assert figures["seconds"] > 0


def test_a_run_that_ends_before_its_window_closes_is_an_error():
    from bench import gpu_speed

    model = Encoder()
    optimizer = torch.optim.AdamW(model.parameters(), fused=False)
    with pytest.raises(RuntimeError, match=r"ended after 2 optimizer steps, before .* \(4\)"):
        with gpu_speed.Window("cpu", warm=1, steps=3).watching(model):
            for _ in range(2):
                optimizer.step()


def table(stdout: str) -> list[list[str]]:
    """The rows of the table the script ends with, its header first."""
    lines = stdout.splitlines()
    header = max(i for i, line in enumerate(lines) if line.startswith("model  "))
    rows = []
    for line in lines[header:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) < 7:
            break
        rows.append(cells)
    return rows


def test_kernels_are_told_apart_by_their_names():
    """Attention before matmul (PyTorch's memory-efficient attention kernels are CUTLASS's),
    Inductor's matmul templates as matmuls, the rest "other"; shares of the busy time, and
    busy time over the window's."""
    from bench import gpu_profile, gpu_speed

    window = gpu_speed.Window("cuda", warm=1, steps=4)
    window.start, window.end = 0.0, 2.0
    kernels = [
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", 2e5),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 4e5),
        ("triton_tem_fused_addmm_gelu_3", 2e5),
        ("void at::native::(anonymous namespace)::fused_adamw_kernel", 1e5),
        ("triton_per_fused_native_layer_norm_7", 1e5),
    ]
    shares = gpu_profile.kernel_shares(kernels, window)
    assert shares["busy_share"] == pytest.approx(0.5)
    assert shares["kernel_ms_per_step"] == pytest.approx(250)
    assert shares["kinds"] == pytest.approx(
        {"matmul": 0.6, "attention": 0.2, "optimizer": 0.1, "other": 0.1}
    )
    assert shares["top"][0] == (kernels[1][0], pytest.approx(0.4))


def op(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}


def launched(correlation, ts, tid=1, cat="cuda_runtime"):
    return {"ph": "X", "cat": cat, "name": "cudaLaunchKernel", "ts": ts, "dur": 0.5, "tid": tid,
            "pid": 1, "args": {"correlation": correlation}}  # fmt: skip


def kernel(correlation, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": f"k{correlation}", "ts": ts, "dur": dur,
            "tid": 7, "pid": 0, "args": {"correlation": correlation}}  # fmt: skip


def test_the_devices_idle_time_is_split_as_hta_splits_it_and_the_host_wait_by_op():
    """A gap whose kernel was launched after the device went idle is host wait, shared out
    to what the launching thread ran meanwhile (its outermost op; the profiler's step span
    and ops inside others are not counted; the time after the launch apart); a shorter gap
    than 30 ns is kernel wait; the rest other. Milliseconds a step."""
    from bench import gpu_profile

    events = [
        op("ProfilerStep#3", 0, 100, cat="user_annotation"),
        kernel(1, 0, 10),
        # The device idle from 10 to 14: 1 µs between ops, 1 µs in the optimizer's step (the
        # op inside it not counted again), launched at 12, started at 14.
        op("Optimizer.step#AdamW.step", 11, 9, cat="user_annotation"),
        op("aten::_fused_adamw_", 11.5, 0.4),
        launched(2, 12),
        kernel(2, 14, 6),
        # launched long before; 20 ns after the kernel before it: kernel wait.
        launched(3, 5),
        kernel(3, 20.02, 2),
        # launched in time, started 3 µs late (a wait on another stream): other.
        launched(4, 6),
        kernel(4, 25.02, 1),
        # launched from the backward's thread, while it ran a backward node: host wait.
        op("autograd::engine::evaluate_function: AddmmBackward0", 25, 10, tid=2),
        launched(5, 30, tid=2, cat="cuda_driver"),
        kernel(5, 30.02, 1),
    ]
    idle = gpu_profile.idle_time(events, steps=2)
    us = 1e-3 / 2  # one µs in all, in ms a step
    assert idle["kinds"] == pytest.approx(
        {"host wait": 8 * us, "kernel wait": 0.02 * us, "other": 3 * us}
    )
    assert idle["ms_per_step"] == pytest.approx(11.02 * us)
    assert idle["gaps_per_step"] == {"host wait": 1, "kernel wait": 0.5, "other": 0.5}
    assert dict(idle["host"]) == pytest.approx(
        {
            "autograd::engine::evaluate_function: AddmmBackward0": 3.98 * us,
            gpu_profile.LAUNCH_TO_START: 2.02 * us,
            gpu_profile.BETWEEN_OPS: 1 * us,
            "Optimizer.step#AdamW.step": 1 * us,
        }
    )
    assert gpu_profile.idle_time([op("aten::mm", 0, 5)], steps=1) is None  # a CPU's trace
    profile = {"busy_share": 0.5, "seconds": 1.0, "kernel_ms_per_step": 40.0, "kinds": {},
               "top": [], "idle": idle}  # fmt: skip
    said = gpu_profile.profile_lines(profile, step_seconds=0.05)
    assert "80% of a timed step's 50.0 ms" in said[0]
    assert "host wait 0.00 ms in 1 gaps" in said[1] and "Optimizer.step#AdamW.step" in said[1]


def test_the_host_ops_are_read_from_the_trace_torch_exports(tmp_path):
    """The categories and fields the idle split reads from (cpu_op, user_annotation, tid,
    ts, dur) are those of the Chrome trace this torch's profiler writes, on a CPU: an
    optimizer step's span is an outermost op of the main thread, with the ops inside it left
    to it."""
    from torch.profiler import ProfilerActivity, profile

    from bench import gpu_profile

    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    ops = gpu_profile.outermost_ops(json.loads(trace.read_text())["traceEvents"])
    names = [name for mine in ops.values() for _, _, name in mine]
    assert names.count("Optimizer.step#AdamW.step") == 2, names
    assert "aten::linear" in names and "aten::addmm" not in names  # inside aten::linear
    for mine in ops.values():
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(mine))  # none inside another


def check_smoke_run(stdout: str, figures: Path) -> None:
    """What bench/gpu_speed.py's CPU smoke run prints and writes: every model and side, each
    with its rates, MFU and no CUDA syncs. `make gpu-check`'s every-check test on a CPU runs it
    once (tests/test_gpu_check.py) and hands its log and figures here."""
    header, *rows = table(stdout)
    assert header == ["model", "side", "examples/s", "tokens/s", "MFU", "syncs/step", "real tokens"]
    sides = [(row[0].split(",")[0], row[1].split(" (")[0]) for row in rows]
    assert sides == [(model, side) for model in ("MiniLM", "BERT") for side in SIDES], stdout
    for row in rows:
        assert float(row[2]) > 0 and float(row[3]) > 0 and row[4].endswith("%")
        assert float(row[5]) == 0  # no CUDA, so no CUDA syncs
    results = json.loads(figures.read_text())
    assert list(results["models"]) == ["minilm", "bert_base"]
    for model in results["models"].values():
        assert model["ours_vs_trainer"] > 0 and model["rounds"] == 2
        for side in model["sides"].values():
            assert side["syncs_per_step"] == 0 and len(side["seconds"]) == 2
            assert 0 < side["mfu"] and 0 < side["real_token_share"] < 1
        # --profile: our side's timed steps once more, profiled (its ops, on a CPU).
        profile = model["sides"]["ours"]["profile"]
        assert 0 < profile["busy_share"] and profile["kinds"]["matmul"] > 0
        assert profile["kernel_ms_per_step"] > 0 and "idle" not in profile  # no device here
        assert abs(sum(profile["kinds"].values()) - 1) < 1e-6 and len(profile["top"]) == 5
        assert "trainer" not in model["sides"] or "profile" not in model["sides"]["trainer"]
    assert "ours/Trainer" in stdout and "no CUDA here" in stdout
