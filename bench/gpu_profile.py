"""Where a profiled run's device time goes (bench/gpu_speed.py --profile): the share of the
window the device was busy, that busy time by kind of kernel and the longest kernels; and the
device's idle time, split as Holistic Trace Analysis splits it, with the host's part by what the
host was running while the device waited.

The idle split is HTA's (facebookresearch/HolisticTraceAnalysis, docs/source/features/
idle_time_breakdown.rst; hta/analyzers/breakdown_analysis.py `_analyze_idle_time_for_stream`):
a gap before a kernel is *host wait* when the call that launched the kernel came after the
device had gone idle (the host did not queue work fast enough), *kernel wait* when it is
shorter than CONSECUTIVE_KERNEL_DELAY_US (the cost of starting the next kernel, which CUDA
graphs remove), and *other* otherwise (a wait on another stream, an event). HTA's gaps are
per stream; these are of the device as a whole, as MFU sees it.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from torch.optim.optimizer import register_optimizer_step_post_hook

# What a kernel does, from its name (cuBLAS's, CUTLASS's, PyTorch's and Inductor's Triton
# kernels; on a CPU, the ops): the first kind whose mark is in it, attention before matmul
# (PyTorch's memory-efficient attention kernels are CUTLASS's, "fmha_cutlassF..."), else
# "other": elementwise work, norms, reductions, copies.
KERNEL_KINDS = {
    "attention": ("fmha", "flash", "attention", "mem_eff", "aten::_scaled_dot"),
    "matmul": (
        "gemm",
        "cutlass",
        "cublas",
        "nvjet",
        "xmma",
        "fused_mm",
        "fused_addmm",
        "fused_bmm",
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
    ),
    "optimizer": ("adam", "multi_tensor", "foreach"),
}

# The categories of the events of the Chrome trace torch's profiler exports (libkineto's
# ActivityType.cpp names them; output_json.cpp writes them): what ran on the device; the calls
# that launched it, which share an args["correlation"] with what they launched (Inductor's
# Triton kernels are launched through the driver API); and what the host ran, ops and
# record_function spans (the DataLoader's, the optimizer's, dynamo's).
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
HOST_CATEGORIES = ("cpu_op", "user_annotation")
# HTA's default `consecutive_kernel_delay`, 30 ns: a shorter gap is the device starting the
# next kernel it already had (trace times are in microseconds).
CONSECUTIVE_KERNEL_DELAY_US = 0.03
BETWEEN_OPS = "(between ops: Python)"
LAUNCH_TO_START = "(launched, not yet started)"


@dataclass
class Profiled:
    """What a profiled run left: (kernel name, device µs) for every kernel (every op on a
    CPU), and the events of its trace."""

    kernels: list[tuple[str, float]] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)


@contextlib.contextmanager
def profiled(window):
    """The run's timed steps (`window`: bench/gpu_speed.py's Window) under torch's profiler,
    the host's ops recorded beside the device's kernels, which slows the host: what a
    profiled run says of the host is in proportion, not in milliseconds to expect unprofiled."""
    from torch.profiler import ProfilerActivity, profile, schedule

    cuda = window.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    plan = schedule(wait=window.warm - 1, warmup=1, active=window.steps, repeat=1)
    seen = Profiled()
    with profile(activities=activities, schedule=plan) as prof:
        hook = register_optimizer_step_post_hook(lambda *_: prof.step())
        try:
            yield seen
        finally:
            hook.remove()
    for event in prof.key_averages():
        time_us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if event.key.startswith("ProfilerStep"):  # the profiler's own span of each step
            continue
        if time_us > 0 and (not cuda or event.device_type.name == "CUDA"):
            seen.kernels.append((event.key, time_us))
    with tempfile.TemporaryDirectory(prefix="smpipe-trace-") as folder:
        trace = Path(folder, "trace.json")
        prof.export_chrome_trace(str(trace))
        seen.events = json.loads(trace.read_text()).get("traceEvents", [])


def kernel_shares(kernels: list[tuple[str, float]], window) -> dict:
    """Of the window's wall time, the share the device was busy, and each kind's share of
    the busy time; the five kernels that took longest; the kernels' milliseconds a step."""
    busy = sum(us for _, us in kernels) / 1e6
    kinds = collections.Counter()
    for name, us in kernels:
        low = name.lower()
        kind = next((k for k, marks in KERNEL_KINDS.items() if any(m in low for m in marks)), None)
        kinds[kind or "other"] += us / 1e6
    top = sorted(kernels, key=lambda k: -k[1])[:5]
    seconds = window.end - window.start
    return {
        "seconds": seconds,
        "busy_share": busy / seconds,
        "kernel_ms_per_step": busy * 1e3 / window.steps,
        "kinds": {k: v / busy for k, v in kinds.most_common()} if busy else {},
        "top": [(name[:80], us / 1e6 / busy) for name, us in top] if busy else [],
    }


def outermost_ops(events: list[dict]) -> dict[int, list[tuple[float, float, str]]]:
    """Each host thread's outermost ops and spans, (start, end, name) in time order, none
    inside another: what that thread was running at any moment. The profiler's own span of
    each step (ProfilerStep#N) holds everything and is left out."""
    threads = collections.defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in HOST_CATEGORIES:
            continue
        if e["name"].startswith("ProfilerStep#"):
            continue
        threads[e["tid"]].append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
    outermost = {}
    for tid, ops in threads.items():
        ops.sort(key=lambda op: (op[0], -op[1]))
        mine: list[tuple[float, float, str]] = []
        for op in ops:
            if not mine or op[0] >= mine[-1][1]:  # not inside the one before
                mine.append(op)
        outermost[tid] = mine
    return outermost


def running(ops: list[tuple[float, float, str]], ends: list[float], start: float, end: float):
    """(name, µs) of what a thread ran between `start` and `end`, the time between its ops
    under BETWEEN_OPS."""
    spent = collections.Counter()
    covered = 0.0
    i = bisect.bisect_right(ends, start)  # the first op to end after `start`
    while i < len(ops) and ops[i][0] < end:
        overlap = min(ops[i][1], end) - max(ops[i][0], start)
        if overlap > 0:
            spent[ops[i][2]] += overlap
            covered += overlap
        i += 1
    if end - start > covered:
        spent[BETWEEN_OPS] += end - start - covered
    return spent


def idle_time(events: list[dict], steps: int) -> dict | None:
    """The device's idle time a step between its first kernel and its last, by HTA's kinds
    (host wait, kernel wait, other) with their gaps a step, and the host wait by what the
    launching thread ran from the moment the device went idle to the launch (then
    LAUNCH_TO_START, to the kernel's start): milliseconds a step, the six largest. None
    without device events (a CPU)."""
    device = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e.get("args", {}).get("correlation"))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES
    )
    if not device:
        return None
    launches = {
        e["args"]["correlation"]: (e["ts"], e["tid"])
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") in LAUNCH_CATEGORIES
        and "correlation" in e.get("args", {})
    }
    ops = outermost_ops(events)
    ends = {tid: [op[1] for op in mine] for tid, mine in ops.items()}
    kinds, gaps, host = collections.Counter(), collections.Counter(), collections.Counter()
    idle_since = device[0][1]
    for start, end, correlation in device[1:]:
        if start > idle_since:
            gap = start - idle_since
            launch = launches.get(correlation)
            if launch is not None and launch[0] > idle_since:
                kind = "host wait"
                launched, tid = min(launch[0], start), launch[1]
                host.update(running(ops.get(tid, []), ends.get(tid, []), idle_since, launched))
                host[LAUNCH_TO_START] += start - launched
            elif gap < CONSECUTIVE_KERNEL_DELAY_US:
                kind = "kernel wait"
            else:
                kind = "other"
            kinds[kind] += gap
            gaps[kind] += 1
        idle_since = max(idle_since, end)
    per_step = 1e3 * steps  # µs in all to ms a step
    order = ("host wait", "kernel wait", "other")
    return {
        "ms_per_step": sum(kinds.values()) / per_step,
        "kinds": {k: kinds[k] / per_step for k in order},
        "gaps_per_step": {k: gaps[k] / steps for k in order},
        "host": [(name[:70], us / per_step) for name, us in host.most_common(6)],
    }


def profile_lines(profile: dict, step_seconds: float) -> list[str]:
    """The profile in words; `step_seconds`: a timed (unprofiled) step of the same side, which
    the kernels' time a step is set against."""
    kinds = ", ".join(f"{k} {v:.0%}" for k, v in profile["kinds"].items())
    top = "; ".join(f"{v:.0%} {name}" for name, v in profile["top"])
    kernel_ms = profile["kernel_ms_per_step"]
    lines = [
        f"busy {profile['busy_share']:.0%} of {profile['seconds']:.2f} s profiled; kernels "
        f"{kernel_ms:.1f} ms a step, {kernel_ms / 1e3 / step_seconds:.0%} of a timed step's "
        f"{step_seconds * 1e3:.1f} ms: {kinds}. Top: {top}"
    ]
    idle = profile.get("idle")
    if idle:
        split = ", ".join(
            f"{k} {ms:.2f} ms in {idle['gaps_per_step'][k]:.0f} gaps"
            for k, ms in idle["kinds"].items()
        )
        host = "; ".join(f"{ms:.2f} ms {name}" for name, ms in idle["host"])
        lines.append(f"idle {idle['ms_per_step']:.2f} ms a step profiled: {split}. Host: {host}")
    return lines
