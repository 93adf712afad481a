"""What else the CPU gives: each option the field uses on CPU for transformer training and
inference, timed against the project's default in the same process, interleaved, paired per
round (the ratio is the median of the rounds' default/option time: above 1, the option is
faster). MiniLM, 16 rows of real BBC text, --width tokens, torch's thread count as set.

Training step (forward, backward, AdamW step):
  compile     torch.compile(dynamic=True), inductor on CPU (the COMPILE setting); its compile
              time is printed apart and left out of the rounds
  foreach     AdamW(foreach) against the fused AdamW the training job uses
  bf16        autocast to bf16 (MIXED_PRECISION = bf16): native only with AMX or AVX512-BF16
  threads-1   one thread fewer than torch's default (the cores left to the loader)
Inference forward (the TorchScript export, as the inference step runs it):
  optimized   TorchScript's profiling executor on (the inference step turns it off)
  onednn      TorchScript with oneDNN graph fusion (torch.jit.enable_onednn_fusion)
  frozen      TorchScript frozen and optimized for inference (torch.jit.freeze, then
              torch.jit.optimize_for_inference: folded constants, oneDNN layouts)
  bf16        autocast to bf16
  exported    the torch.export program instead of TorchScript

    python bench/cpu_options.py [--rounds N] [--steps N] [--width N]

Prints a table and writes bench/cpu_options.json. Asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import AutoModelForSequenceClassification, AutoTokenizer  # noqa: E402

from steps.export import LogitsOnly  # noqa: E402
from steps.precision import cpu_bf16  # noqa: E402
from user_functions import minilm_path  # noqa: E402
from user_functions.demo_data import bbc_articles  # noqa: E402

KEYS = ["input_ids", "attention_mask"]


def batch(tokenizer, width: int, rows: int = 16) -> dict[str, torch.Tensor]:
    texts = [Path(path).read_text() for _, path in bbc_articles()[:rows]]
    return dict(
        tokenizer(texts, truncation=True, max_length=width, padding=True, return_tensors="pt")
    )


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=5)


def training_step(net, optimizer, inputs, labels, context) -> None:
    with context():
        logits = net(**inputs).logits
    torch.nn.functional.cross_entropy(logits.float(), labels).backward()
    optimizer.step()
    optimizer.zero_grad()


def trainer(option: str, inputs, labels):
    """A function doing `steps` training steps with `option` applied (or the default)."""
    net = model().train()
    fused = option != "foreach"
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-5, fused=fused, foreach=not fused)
    context = contextlib.nullcontext
    if option == "bf16":
        context = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    threads = torch.get_num_threads()
    if option == "compile":
        net = torch.compile(net, dynamic=True)
        started = time.perf_counter()
        training_step(net, optimizer, inputs, labels, context)  # compiles
        print(f"compile: first step (compiling) {time.perf_counter() - started:.1f} s", flush=True)

    def run(steps: int) -> float:
        if option == "threads-1":
            torch.set_num_threads(max(1, threads - 1))
        started = time.perf_counter()
        for _ in range(steps):
            training_step(net, optimizer, inputs, labels, context)
        seconds = time.perf_counter() - started
        torch.set_num_threads(threads)
        return seconds

    run(1)  # warm
    return run


def inferrer(option: str, inputs, work: Path):
    wrapper = LogitsOnly(model().eval(), KEYS).eval()
    args = tuple(inputs[k] for k in KEYS)
    with torch.no_grad():
        if option == "exported":
            dim = torch.export.Dim.DYNAMIC
            shapes = ({0: dim, 1: dim}, {0: dim, 1: dim})
            program = torch.export.export(wrapper, args, dynamic_shapes=(shapes,), strict=False)
            torch.export.save(program, work / "model.pt2")
            program = torch.export.load(work / "model.pt2").module()
        else:
            torch.jit.trace(wrapper, args, strict=False, check_trace=False).save(work / "ts.pt")
            program = torch.jit.load(work / "ts.pt").eval()
            if option == "frozen":
                program = torch.jit.optimize_for_inference(torch.jit.freeze(program))

    def run(steps: int) -> float:
        optimized = option == "optimized"
        torch.jit.enable_onednn_fusion(option == "onednn")
        context = (
            torch.autocast("cpu", dtype=torch.bfloat16)
            if option == "bf16"
            else contextlib.nullcontext()
        )
        started = time.perf_counter()
        with torch.inference_mode(), torch.jit.optimized_execution(optimized), context:
            for _ in range(steps):
                program(*args)
        seconds = time.perf_counter() - started
        torch.jit.enable_onednn_fusion(False)
        return seconds

    run(3)  # warm (and, with the profiling executor on, its profiling runs)
    return run


def paired(default, option, rounds: int, steps: int) -> dict:
    ratios, times = [], {"default": [], "option": []}
    for r in range(rounds):
        pair = ((default, "default"), (option, "option"))
        for fn, name in pair if r % 2 == 0 else pair[::-1]:
            times[name].append(fn(steps) / steps)
        ratios.append(times["default"][-1] / times["option"][-1])
    return {
        "default_s": statistics.median(times["default"]),
        "option_s": statistics.median(times["option"]),
        "speedup": statistics.median(ratios),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--only", default="", help="comma separated options to time")
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    inputs = batch(tokenizer, args.width)
    labels = torch.arange(len(inputs["input_ids"])) % 5
    native, why = cpu_bf16()
    cpu = platform.processor() or platform.machine()
    print(f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}; bf16: {why}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for option in ("compile", "foreach", "bf16", "threads-1"):
            if only and f"train:{option}" not in only:
                continue
            default = trainer("default", inputs, labels)
            results[f"train:{option}"] = paired(
                default, trainer(option, inputs, labels), args.rounds, args.steps
            )
            print(f"train:{option} {results[f'train:{option}']}", flush=True)
        for option in ("optimized", "onednn", "frozen", "bf16", "exported"):
            if only and f"inference:{option}" not in only:
                continue
            default = inferrer("default", inputs, work)
            results[f"inference:{option}"] = paired(
                default, inferrer(option, inputs, work), args.rounds, args.steps * 3
            )
            print(f"inference:{option} {results[f'inference:{option}']}", flush=True)
    print(f"\n{'option':<22} {'default s':>10} {'option s':>10} {'speed-up':>9}")
    for name, r in results.items():
        print(f"{name:<22} {r['default_s']:10.3f} {r['option_s']:10.3f} {r['speedup']:8.2f}x")
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": cpu, "threads": torch.get_num_threads(), "native_bf16": native},
        "settings": vars(args),
        "results": results,
    }
    (ROOT / "bench/cpu_options.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
