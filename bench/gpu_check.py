"""The GPU path, checked end to end in one command: what only a machine with an NVIDIA GPU
can tell, through the project's real jobs (the local backend, the image's entrypoint).

    python bench/gpu_check.py [--device cuda|cpu] [--only NAMES] [--model minilm|bow]
                              [--mixed-precision auto|no|bf16|fp16] [--work DIR]

Each check is a short function below, named in CHECKS; the table at the end gives each one's
result and figures, and the exit status is 1 if any failed (0 if all passed or were skipped,
2 for arguments that cannot work here):

  peak       the matmul peak the MFU is measured against: a large bf16 matmul on the GPU, best
             of several (on a CPU: in the precision training applies there)
  training   the demo's data (a slice) through `smpipe run` on the local backend, MIXED_PRECISION
             as given (auto: bf16 on a GPU that has it), the applied precision read from the
             training job's report; examples/s, model FLOP/s and MFU
  speed      bench/gpu_speed.py: our training loop against the Trainer at its best, interleaved,
             MiniLM at 128 tokens and a BERT-base-sized model at 512 (tiny sizes on a CPU):
             examples/s, tokens/s, MFU and host syncs per step of each
  processes  two processes under torchrun (SMPIPE_PROCESSES_PER_HOST=2, as the local backend
             starts them): NCCL, one process per GPU; gloo on a CPU
  workers    DATALOADER_NUM_WORKERS = 2: the workers, (on a GPU) the pinned-memory thread and the
             autocast dtype, seen from inside the training loop's forward pass
  sigterm    SIGTERM mid-training with workers: the job checkpoints and exits 75; run again, it
             resumes from that checkpoint and completes
  compile    COMPILE = true trains, and both exported programs pass their checks
  lora       FINETUNING = lora (with gradient checkpointing on MiniLM): the merged model, its
             exports and the PEFT adapter
  fsdp       DISTRIBUTED_STRATEGY = fsdp on MiniLM (two processes on two GPUs or a CPU, a
             process group of one on one GPU): the shards of a checkpoint, a rerun resuming
             from them, the gathered model's exports
  inference  [inference] MIXED_PRECISION = bf16: the inference step and `smpipe predict` on the
             test split, each saying what it computed in, with the same labels row for row

--device cpu (the default without CUDA) runs the same checks on the CPU: gloo for two
processes, workers without pinning. The jobs are started as tests/jobs/training_job.py starts them
(a job root laid out by the local backend's own function, the entrypoint as the image runs it)
and stopped where tests/jobs/gate.py stops them: at a named optimizer step, whatever the speed.
Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import configparser
import functools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pipeline.config import load_settings  # noqa: E402
from pipeline.paths import ExperimentTree  # noqa: E402
from pipeline.player.environment import image_env  # noqa: E402
from pipeline.player.job_root import lay_out_training  # noqa: E402
from pipeline.player.processes import free_port  # noqa: E402
from steps import checkpointing as ckpt  # noqa: E402
from steps.batching import read_split  # noqa: E402
from steps.precision import resolve  # noqa: E402
from steps.runtime.names import (  # noqa: E402
    ENTRYPOINT,
    MASTER_ADDR_VARIABLE,
    MASTER_PORT_VARIABLE,
    OUTPUT_DATA_DIR,
    PROCESSES_VARIABLE,
    STEP_METADATA_FILE,
    TRAINING_FAILURE_FILE,
    USER_FUNCTIONS_VARIABLE,
    host_path,
)
from tests.jobs.gate import GATE_VARIABLE, marker  # noqa: E402

EXPERIMENT = "gpu-check"
JOB_TIMEOUT = 1800  # seconds: a job of this size that takes longer has hung
SIGTERM_STEP = 2  # the optimizer step the interrupted job is stopped in
# How much of the demo each device trains on, one epoch: on a GPU 1,000 articles at the demo's
# length and batch (128 tokens, 32 rows: 25 optimizer steps), on a CPU a slice the test suite
# can afford on 2 cores (6 steps).
SIZES = {
    "cuda": {"rows_per_label": 200, "max_length": 128, "batch": 32, "per_device": 32},
    "cpu": {"rows_per_label": 12, "max_length": 32, "batch": 8, "per_device": 4},
}
# The demo's user functions, their model made to say what its training loop runs with, once,
# in its first training forward pass: the DataLoader workers alive (children of the training
# process), whether torch's pin-memory thread runs (torch/utils/data/dataloader.py starts
# `_pin_memory_loop` as a thread when pin_memory and workers are on; Python names a thread
# after its target), and the autocast dtype. Seen from the last layer with weights: a forward
# pre-hook of the model itself runs before Accelerate's autocast wrapper of its forward is
# entered. And made to stop where SMPIPE_TEST_GATE says (tests/jobs/gate.py).
PROBE = """
import json, os, threading
from pathlib import Path

import psutil
import torch

from tests.jobs.gate import gate
from user_functions import encode, load_tokenizer, ordered_input_keys, reconcile  # noqa: F401
from user_functions import load_model as demo_load_model


def load_model(model_name, id2label, label2id):
    model = gate(demo_load_model(model_name, id2label, label2id))
    last = [m for m in model.modules() if list(m.parameters(recurse=False))][-1]
    last.register_forward_pre_hook(report)
    return model


def report(module, args):
    out = Path(os.environ["GPU_CHECK_PROBE"]) / f"rank-{os.environ.get('RANK', '0')}.json"
    if not module.training or out.exists():
        return
    me, device = psutil.Process(), next(module.parameters()).device
    autocast = torch.is_autocast_enabled(device.type)
    out.write_text(json.dumps({
        "loader_workers": sum(1 for c in me.children() if c.cmdline() == me.cmdline()),
        "pin_memory_thread": any("_pin_memory_loop" in t.name for t in threading.enumerate()),
        "device": str(device),
        "autocast": str(torch.get_autocast_dtype(device.type)) if autocast else None,
    }))
"""
# What autocast computes in, by the precision a job applied (steps/precision.py: "no" is fp32).
AUTOCAST = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "no": None}
NAMES = {"no": "fp32"}


class CheckFailed(Exception):
    """What a check found wrong."""


def expect(ok: bool, message: str) -> None:
    """A check's condition (not `assert`, which `python -O` removes)."""
    if not ok:
        raise CheckFailed(message)


class Skipped(Exception):
    """A check that cannot run on this machine, and why."""


def rate(flops: float) -> str:
    """FLOP/s in words: 3 significant digits, in T, G or M."""
    scale, unit = next(
        (s, u) for s, u in ((1e12, "T"), (1e9, "G"), (1e6, "M")) if flops >= s or u == "M"
    )
    return f"{flops / scale:.3g} {unit}FLOP/s"


# -- the checks ----------------------------------------------------------------------------


def check_peak(work: Workspace) -> str:
    flops, dtype = work.peak
    return f"{rate(flops)} {dtype} matmul, best of 5"


def check_training(work: Workspace) -> str:
    job = work.run_details("train")["models"][work.model]
    applied, why = job["mixed_precision"], job["precision_reason"]
    expected = resolve(work.mixed_precision, work.gpus).applied
    expect(applied == expected, f"the job applied {applied} ({why}), not {expected}")
    if work.device == "cuda":
        if work.mixed_precision == "auto" and torch.cuda.is_bf16_supported(
            including_emulation=False  # native bf16 only, as steps/precision.py asks
        ):
            expect(applied == "bf16", f"auto applied {applied} on a GPU with bf16")
        used = job["gpu_usage"] or {}
        expect(used.get("max_memory_allocated_mb"), f"nothing allocated on a GPU: {used}")
    loop = job["train_loop_seconds"]
    examples = job["steps"] * job["per_device_batch"] * job["accumulation"] * job["processes"]
    flops = work.training_flops(epochs=job["history"][-1]["epoch"]) / loop
    peak, dtype = work.peak
    expect(flops <= peak, f"model {rate(flops)} above the {dtype} peak: a count is wrong")
    return (
        f"{NAMES.get(applied, applied)} ({why}); {job['steps']} steps, "
        f"{examples / loop:.1f} examples/s, model {rate(flops)} = {100 * flops / peak:.3g}% MFU "
        "(warm-up included)"
    )


def check_processes(work: Workspace) -> str:
    if work.device == "cuda" and work.gpus < 2:
        raise Skipped(f"{work.gpus} GPU: NCCL refuses two ranks on one device")
    # NCCL_DEBUG=VERSION: each NCCL rank prints its version once, proof that NCCL ran.
    job = work.job("processes", {}, processes=2, env={"NCCL_DEBUG": "VERSION"})
    job.expect_exit(0)
    report = job.report()
    expect(report["processes"] == 2, f"{report['processes']} processes trained")
    backend = "gloo"
    if work.device == "cuda":
        version = re.search(r"NCCL version (\S+)", job.log())
        expect(version, "no NCCL version line in the job's log: NCCL did not run")
        backend = f"NCCL {version.group(1)}"
    return (
        f"2 processes ({backend}), {report['steps']} steps, validation F1 "
        f"{report['best_validation_f1']:.3f}"
    )


def check_workers(work: Workspace) -> str:
    job = work.job("workers", {"dataloader_num_workers": "2"}, probe=True)
    job.expect_exit(0)
    seen, applied = job.probe(), job.report()["mixed_precision"]
    pinned = work.device == "cuda"  # steps/train.py loader_for: pin_memory=on_gpu
    expect(seen["loader_workers"] == 2, f"{seen['loader_workers']} loader workers, not 2")
    expect(seen["pin_memory_thread"] == pinned, f"pin-memory thread: {seen['pin_memory_thread']}")
    expect(seen["device"].startswith(work.device), f"the model was on {seen['device']}")
    expect(seen["autocast"] == AUTOCAST[applied], f"{applied}, autocast {seen['autocast']}")
    return (
        f"2 workers, {'pinned memory' if pinned else 'no pinning (CPU)'}; the loop's forward "
        f"on {seen['device']}, autocast {seen['autocast'] or 'off'} "
        f"({NAMES.get(applied, applied)})"
    )


def check_sigterm(work: Workspace) -> str:
    gates = work.root / "gates"
    hps, gate = {"dataloader_num_workers": "2"}, {GATE_VARIABLE: f"{gates}:{SIGTERM_STEP}"}
    job = work.job("sigterm", hps, env=gate, probe=True)
    job.wait_for(lambda: marker(gates, SIGTERM_STEP).exists())  # it waits in that step
    workers = job.probe()["loader_workers"]
    job.proc.send_signal(signal.SIGTERM)  # to the entrypoint alone, as `docker stop` sends it
    job.expect_exit(75)
    expect(workers == 2, f"{workers} loader workers when SIGTERM came, not 2")
    said = f"SIGTERM: checkpoint written at step {SIGTERM_STEP}; exiting to be resumed"
    expect(said in job.log(), f"not in the job's log: {said!r}")
    current = ckpt.current_checkpoint(job.root / "checkpoints")
    expect(current and current.name == f"ckpt-{SIGTERM_STEP:08d}", f"CURRENT is {current}")
    again = work.job("sigterm", hps, env=gate, probe=True, again=True)  # a restart, same root
    again.expect_exit(0)
    report = again.report()
    resumed = (report["resumed_from"] or {}).get("step")
    expect(resumed == SIGTERM_STEP, f"the rerun resumed from {report['resumed_from']}")
    return (
        f"exit 75 with 2 workers, checkpoint at step {SIGTERM_STEP}; the rerun resumed "
        f"there and ended at step {report['steps']}"
    )


def check_compile(work: Workspace) -> str:
    job = work.job("compile", {"compile": "true", "exports": "torchscript,exported"})
    job.expect_exit(0)
    report = job.report()
    expect(report["compile"] is True, "the job did not compile its model")
    failed = [name for name, e in report["exports"].items() if not e.get("passed")]
    expect(not failed, f"exports that failed their check: {failed}")
    return (
        f"compiled, {report['steps']} steps in {report['train_loop_seconds']:.1f} s "
        f"(compilation included); exports passed: {', '.join(report['exports'])}"
    )


def check_inference(work: Workspace) -> str:
    details = work.run_details("inference")
    expect(details["mixed_precision"] == "bf16", f"inference in {details['mixed_precision']}")
    against = details["against_fp32"][work.model]
    predicted, computed = work.predict_test_split()
    expect(computed == "bf16", f"predict computed in {computed}")
    inferred = work.inference_predictions()
    expect(list(predicted["id"]) == list(inferred["id"]), "predict's rows are not the test's")
    differ = int((predicted["predicted"] != inferred["predicted"]).sum())
    expect(not differ, f"predict and inference differ on {differ} of {len(inferred)} labels")
    probabilities = predicted[[c for c in predicted if c.startswith("probability_")]]
    confidence = (probabilities.max(axis=1) - inferred["confidence"]).abs().max()
    auto = resolve("auto", 0)
    return (
        f"bf16 in both; inference against fp32 on {against['rows']} rows: "
        f"{against['agreement']:.1%} the same label, probabilities within "
        f"{against['max_probability_difference']:.2g}; predict = inference on "
        f"{len(inferred)} rows (confidence within {confidence:.2g}); auto on this CPU: "
        f"{auto.applied} ({auto.reason})"
    )


def check_lora(work: Workspace) -> str:
    # The bag of embeddings has no repeated blocks to find adapters' targets in, nor gradient
    # checkpointing: its embedding is named, and checkpointing is left to MiniLM.
    # A checkpoint before the epoch's end, for its size (what LoRA keeps of the model).
    hps = {"finetuning": "lora", "exports": "torchscript,exported", "checkpoint_every_steps": "2"}
    if work.model == "bow":
        hps["lora_target_modules"] = "embedding"
    else:
        hps["gradient_checkpointing"] = "true"
    job = work.job("lora", hps)
    job.expect_exit(0)
    report = job.report()
    expect(report["finetuning"] == "lora", f"the job trained {report['finetuning']}")
    expect(report["lora_merge"]["passed"], f"the merged model disagrees: {report['lora_merge']}")
    failed = [name for name, e in report["exports"].items() if not e.get("passed")]
    expect(not failed, f"merged exports that failed their check: {failed}")
    expect((job.root / "model/adapter/adapter_config.json").exists(), "no PEFT adapter written")
    peak = report["peak_memory"][0]
    memory = peak.get("gpu_max_allocated_bytes") or peak["host_max_rss_bytes"]
    where = "GPU allocated" if "gpu_max_allocated_bytes" in peak else "host RSS"
    saved = report["checkpoint_bytes"]  # None: one epoch, whose end needs no checkpoint
    return (
        f"{report['trained_parameters']:,} of {report['parameters']:,} parameters trained, "
        f"gradient checkpointing {'on' if report['gradient_checkpointing'] else 'off'}; "
        f"merged within {report['lora_merge']['max_abs_difference']:.2g}, exports passed; "
        f"peak {memory / 2**20:.0f} MB {where}, "
        + (f"checkpoint {saved:,} B" if saved is not None else "no checkpoint written")
    )


def check_fsdp(work: Workspace) -> str:
    if work.model == "bow":
        raise Skipped("the bag of embeddings has no layers to shard (--model minilm)")
    # Two processes where there are two GPUs (or on a CPU); on one GPU a process group of one,
    # NCCL all the same: the sharded parameters, the mixed-precision policy on CUDA, DCP.
    processes = 1 if work.device == "cuda" and work.gpus < 2 else 2
    hps = {"distributed_strategy": "fsdp", "checkpoint_every_steps": "2"}
    hps["exports"] = "torchscript,exported"
    job = work.job("fsdp", hps, processes=processes)
    job.expect_exit(0)
    report = job.report()
    expect(
        report["distributed_strategy"] == "fsdp", f"the job ran {report['distributed_strategy']}"
    )
    failed = [name for name, e in report["exports"].items() if not e.get("passed")]
    expect(not failed, f"exports of the gathered model that failed their check: {failed}")
    current = ckpt.current_checkpoint(job.root / "checkpoints")
    shards = sorted(p.name for p in (current / "sharded").glob("*.distcp")) if current else []
    expect(len(shards) == processes, f"shards in {current}: {shards}")
    # The same job again, as a restart: it resumes from those shards (DCP reads them back).
    again = work.job("fsdp", hps, processes=processes, again=True)
    again.expect_exit(0)
    resumed = again.report()["resumed_from"] or {}
    expect(resumed.get("checkpoint") == str(current), f"the rerun resumed from {resumed}")
    peak = report["training_peak_memory"][0]
    memory = peak.get("gpu_max_allocated_bytes") or peak["host_max_rss_bytes"]
    where = "GPU allocated" if "gpu_max_allocated_bytes" in peak else "host RSS"
    return (
        f"{processes} process{'es' if processes > 1 else ''}, {len(shards)} shard files a "
        f"checkpoint, resumed from step {resumed.get('step')}; the gathered model's exports "
        f"passed; training peak {memory / 2**20:.0f} MB {where} a process"
    )


def check_speed(work: Workspace) -> str:
    """bench/gpu_speed.py: ours against the Trainer, in a process of its own (its models and
    Accelerate's state apart from the checks'), against this peak; its table printed here."""
    results, log = work.root / "speed.json", work.root / "logs/speed.log"
    log.parent.mkdir(exist_ok=True)
    command = [sys.executable, str(ROOT / "bench/gpu_speed.py"), "--device", work.device]
    command += ["--profile"]  # where our loop's device time goes, beside its rates
    if work.mixed_precision == "auto":  # the bench trains in what auto applies
        command += ["--peak", repr(work.peak[0])]
    print(f"  bench/gpu_speed.py ... (log: {log})", flush=True)
    with open(log, "w") as out:
        done = subprocess.run(
            [*command, "--json", str(results)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=JOB_TIMEOUT,
        )
    said = log.read_text(errors="replace")
    expect(done.returncode == 0, f"bench/gpu_speed.py exited {done.returncode}: {said[-2000:]}")
    print(said[said.rindex("\ngpu speed:") :].strip())
    figures = []
    for model in json.loads(results.read_text())["models"].values():
        sides = [
            f"{name} {f['examples_per_s']:.1f} examples/s, {f['mfu']:.2%} MFU, "
            f"{f['syncs_per_step']:.2f} syncs/step"
            for name, f in (
                ("ours", model["sides"]["ours"]),
                ("Trainer", model["sides"]["trainer"]),
            )
        ]
        figures.append(
            f"{model['model']} at {model['max_length']} tokens: {'; '.join(sides)}; "
            f"ours/Trainer {model['ours_vs_trainer']:.2f}x"
        )
    return " | ".join(figures)


# The table: each check's name (for --only) and its function, in the order they run.
CHECKS = {
    "peak": check_peak,
    "training": check_training,
    "speed": check_speed,
    "processes": check_processes,
    "workers": check_workers,
    "sigterm": check_sigterm,
    "compile": check_compile,
    "lora": check_lora,
    "fsdp": check_fsdp,
    "inference": check_inference,
}


# -- what the checks share: one small project, its run, and jobs on its data -----------------


@dataclass
class Job:
    """A training job started through the image's entrypoint, in its own job root."""

    root: Path
    proc: subprocess.Popen
    log_path: Path

    def wait_for(self, condition) -> None:
        deadline = time.monotonic() + JOB_TIMEOUT
        while not condition():
            if self.proc.poll() is not None:
                raise CheckFailed(f"the job ended (exit {self.proc.returncode}): {self.log_path}")
            if time.monotonic() > deadline:
                raise CheckFailed(f"the job did not get there in {JOB_TIMEOUT} s: {self.log_path}")
            time.sleep(0.05)

    def expect_exit(self, status: int) -> None:
        try:
            code = self.proc.wait(timeout=JOB_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            raise CheckFailed(f"no exit in {JOB_TIMEOUT} s; log: {self.log_path}") from None
        if code != status:
            failure = host_path(self.root, TRAINING_FAILURE_FILE)
            why = failure.read_text() if failure.exists() else self.log()[-2000:]
            raise CheckFailed(f"exit {code}, not {status}: {why} (log: {self.log_path})")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the job and what it started
        self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def report(self) -> dict:
        metadata = host_path(self.root, OUTPUT_DATA_DIR) / STEP_METADATA_FILE
        return json.loads(metadata.read_text())

    def probe(self) -> dict:
        return json.loads((self.root / "probe/rank-0.json").read_text())


class Workspace:
    """A project in a folder of its own: the demo's data, a settings file, one `smpipe run`
    (made when a check first needs it), and training jobs on that run's prepared data."""

    def __init__(self, root: Path, device: str, model: str, mixed_precision: str):
        self.root, self.device, self.model = root, device, model
        self.mixed_precision = mixed_precision
        self.gpus = torch.cuda.device_count() if device == "cuda" else 0
        self.size = SIZES[device]
        self.store = root / "store"
        self.tree = ExperimentTree(EXPERIMENT)
        self.settings_path = root / "settings.ini"
        self.code = root / "code"  # the probe's user functions
        self.code.mkdir(parents=True)
        (self.code / "gpu_check_probe.py").write_text(PROBE)
        self.started: list[Job] = []

    @functools.cached_property
    def peak(self) -> tuple[float, str]:
        """FLOP/s of a large matmul in the precision training applies here: the MFU's
        denominator (`matmul_peak`)."""
        dtype = peak_dtype(self.mixed_precision, self.gpus)
        return matmul_peak(self.device, dtype), str(dtype).removeprefix("torch.")

    @functools.cached_property
    def run(self) -> dict:
        """The demo's slice through every step of `smpipe run` on the local backend: its
        Metadata (each step's section says whether it completed, and why not)."""
        from user_functions.demo_data import write_demo

        write_demo(self.root / "raw", per_label=self.size["rows_per_label"])
        self.write_settings()
        log = self.root / "logs/run.log"
        log.parent.mkdir(exist_ok=True)
        command = [sys.executable, "-m", "pipeline.cli", "run", str(self.settings_path)]
        print(f"  smpipe run ... (log: {log})", flush=True)
        with open(log, "w") as out:
            done = subprocess.run(
                command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=JOB_TIMEOUT
            )
        metadata = self.store / self.tree.run(1).metadata
        if metadata.exists():
            return json.loads(metadata.read_text())
        # Refused before it began (settings, user functions): said once, for every check.
        said = log.read_text(errors="replace").strip()
        said = said[said.find("error:") :] if "error:" in said else said  # the lines before: notes
        said = said[-2000:]
        return {"steps": {}, "failure_reason": f"smpipe run exited {done.returncode}: {said}"}

    def write_settings(self) -> None:
        """The shipped settings.ini, made small, one model, the precisions the checks ask for."""
        parser = configparser.ConfigParser(interpolation=None, delimiters=("=",))
        parser.optionxform = str.upper
        parser.read(ROOT / "settings.ini")
        for section in parser.sections():  # per-model sections name the demo's two models
            if section.startswith(("training.", "tuning.hyperparameters.")):
                parser.remove_section(section)
        size = self.size
        values = {
            "experiment": {
                "NAME": EXPERIMENT,
                "STORE": str(self.store),
                "BACKEND": "local",
                "JOB": "train",
            },
            "data": {
                "RAW_DATA": str(self.root / "raw"),
                "MAX_SEQUENCE_LENGTH": str(size["max_length"]),
            },
            "models": {"MODEL_NAMES": self.model},
            # One process: MFU is one GPU's model FLOP/s over one GPU's peak.
            "training": {
                "EPOCHS": "1",
                "BATCH_SIZE": str(size["batch"]),
                "MAX_PER_DEVICE_BATCH_SIZE": str(size["per_device"]),
                "PROCESSES_PER_HOST": "1",
                "CHECKPOINT_EVERY_STEPS": "0",
                "KEEP_CHECKPOINTS": "1",
                "MAX_RESTARTS": "0",
                "MIXED_PRECISION": self.mixed_precision,
            },
            "inference": {"MIXED_PRECISION": "bf16"},
            "tracking": {"WANDB_MODE": "disabled"},
        }
        for section, keys in values.items():
            for key, value in keys.items():
                parser.set(section, key, value)
        with open(self.settings_path, "w") as f:
            parser.write(f)

    def run_details(self, step: str) -> dict:
        """A step's section of the run's Metadata; the step's reason if it did not complete."""
        section = self.run["steps"].get(step)
        if section is None:
            raise CheckFailed(f"the run has no {step} step: {self.run['failure_reason']}")
        if section["status"] != "completed":
            raise CheckFailed(f"{step} {section['status']}: {section['failure_reason']}")
        return section["details"]

    def split(self, name: str) -> Path:
        """A split of the data the run prepared."""
        self.run_details("prepare")
        return self.store / self.tree.data(self.run["data_version"]).split(name)

    def training_flops(self, epochs: int) -> float:
        """The model FLOPs of `epochs` epochs of training, forward and backward, counted on
        the rows' real tokens: padding is work no model needs, so the MFU is the useful share.
        Every row once an epoch (the sampler's wrap-around repeats at most one batch's rows).
        An encoder with a Hugging Face config (MiniLM): bench/speed.py's count, attention
        included (tests/test_bench_flops.py holds it to torch's FlopCounterMode); another
        model: 6 FLOPs per non-embedding parameter per token (Kaplan et al. 2020, "Scaling
        Laws for Neural Language Models", section 2.1)."""
        lengths = read_split(self.split("train")).column(f"{self.model}__length").to_pylist()
        model_dir = self.store / self.tree.run(1).model(self.model) / "model"
        if (model_dir / "config.json").exists():
            from transformers import AutoConfig

            from bench.speed import model_flops

            config = AutoConfig.from_pretrained(model_dir)
            return epochs * model_flops(config, [(1, n) for n in lengths], backward=True)
        from safetensors import safe_open

        with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
            shapes = [f.get_slice(k).get_shape() for k in f.keys() if "embedding" not in k]
        return epochs * 6 * sum(math.prod(shape) for shape in shapes) * sum(lengths)

    def job(
        self,
        name: str,
        overrides: dict[str, str],
        processes: int = 1,
        env: dict | None = None,
        probe: bool = False,
        again: bool = False,
    ) -> Job:
        """A training job on the run's prepared data, with the hyperparameters the run's own
        training job got (settings.training_hyperparameters) and `overrides`. `probe`: with
        the probe's user functions (PROBE), whose hooks a compiled model would trace; `again`:
        in the same job root, as a restart after an interruption."""
        root = self.root / "jobs" / name
        if not again:
            channels = {c: self.split(c) for c in ("train", "validation", "labels")}
            settings = load_settings(self.settings_path, env={})
            hps = {**settings.training_hyperparameters(self.model, "training"), **overrides}
            request = {
                "InputDataConfig": [
                    {"ChannelName": c, "DataSource": {"S3DataSource": {"S3Uri": str(p)}}}
                    for c, p in channels.items()
                ],
                "ResourceConfig": {"InstanceType": "local", "InstanceCount": 1},
            }
            lay_out_training(request, root, "algo-1", ["algo-1"], link, hps)
        (root / "probe").mkdir(exist_ok=True)
        job_env = {
            **os.environ,
            **image_env(root),
            "TRAINING_JOB_NAME": f"{EXPERIMENT}-{name}",
            USER_FUNCTIONS_VARIABLE: "gpu_check_probe" if probe else "user_functions",
            "PYTHONPATH": f"{self.code}{os.pathsep}{ROOT}",
            "GPU_CHECK_PROBE": str(root / "probe"),
            PROCESSES_VARIABLE: str(processes),
            MASTER_ADDR_VARIABLE: "127.0.0.1",
            MASTER_PORT_VARIABLE: str(free_port()),
            **(env or {}),
        }
        log = self.root / "logs" / f"{name}{'-again' if again else ''}.log"
        log.parent.mkdir(exist_ok=True)
        print(f"  job {name} ... (log: {log})", flush=True)
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, *ENTRYPOINT[1:], "train"],
                cwd=ROOT,
                env=job_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started.append(Job(root, proc, log))
        return self.started[-1]

    def stop_jobs(self) -> None:
        """A job a failed check left running (waiting at its gate, say) ends with the check."""
        for job in self.started:
            if job.proc.poll() is None:
                job.kill()

    def predict_test_split(self):
        """`smpipe predict` on the test split's texts: its predictions and the precision its
        job says it computed in."""
        import pandas as pd

        test = read_split(self.split("test"))
        source, output = self.root / "test_texts.csv", self.root / "predicted.csv"
        pd.DataFrame({c: test.column(c).to_pylist() for c in ("id", "text")}).to_csv(
            source, index=False
        )
        log = self.root / "logs/predict.log"
        command = [sys.executable, "-m", "pipeline.cli", "predict", str(self.settings_path)]
        print(f"  smpipe predict ... (log: {log})", flush=True)
        with open(log, "w") as out:
            done = subprocess.run(
                [*command, str(source), str(output)],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=JOB_TIMEOUT,
            )
        said = log.read_text(errors="replace")
        if done.returncode != 0:
            raise CheckFailed(f"smpipe predict exited {done.returncode}: {said[-2000:]}")
        computed = re.search(r"computed in (\w+):", said)
        expect(computed, f"predict's job did not say what it computed in (log: {log})")
        return pd.read_csv(output, dtype={"id": str}), computed.group(1)

    def inference_predictions(self):
        import pandas as pd

        key = f"{self.tree.run(1).inference}{self.model}/predictions.csv"
        return pd.read_csv(self.store / key, dtype={"id": str})


def peak_dtype(mixed_precision: str, gpus: int) -> torch.dtype:
    """What training's matmuls compute in, MIXED_PRECISION applied here (bf16 on any GPU that
    has it, fp32 on a CPU without native bf16)."""
    applied = resolve(mixed_precision, gpus).applied
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(applied, torch.float32)


def matmul_peak(device: str, dtype: torch.dtype) -> float:
    """The most FLOP/s a large square matmul in `dtype` reaches here, best of 5 runs of 10: on
    a GPU 8192 x 8192, on a CPU 1024 x 1024 (bench/speed.py searches several sizes and layouts
    for a CPU's best)."""
    n = 8192 if device == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    for _ in range(3):  # warm-up: cuBLAS picks its kernel, the clocks ramp up
        a @ b
    sync()
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(10):
            a @ b
        sync()
        runs.append(10 * 2 * n**3 / (time.perf_counter() - started))
    return max(runs)


def link(uri: str, local: Path) -> None:
    """A channel of the job root, as the local backend lays out a local store's folder."""
    local.parent.mkdir(parents=True, exist_ok=True)
    local.symlink_to(uri, target_is_directory=True)


# -- running them ------------------------------------------------------------------------------


def run_checks(work: Workspace, names: list[str]) -> list[tuple[str, str, str]]:
    """Each check in turn: (name, result, figures); a failure's reason is its figures."""
    rows = []
    for name in names:
        print(f"{name}: running", flush=True)
        started = time.monotonic()
        try:
            figures, result = CHECKS[name](work), "passed"
        except Skipped as e:
            figures, result = f"skipped: {e}", "skipped"
        except CheckFailed as e:
            figures, result = str(e), "FAILED"
        except Exception as e:  # noqa: BLE001 - any error is this check's failure, said in full
            figures, result = f"{type(e).__name__}: {e}", "FAILED"
        finally:
            work.stop_jobs()
        rows.append((name, result, figures))
        print(f"{name}: {result} in {time.monotonic() - started:.0f} s: {figures}", flush=True)
    return rows


def print_table(rows: list[tuple[str, str, str]]) -> None:
    """One line a check; a long reason is cut here, and whole in the check's line above."""
    widths = [max(len(r[i]) for r in [("check", "result", ""), *rows]) for i in range(2)]
    print(f"\n{'check':<{widths[0]}}  {'result':<{widths[1]}}  figures")
    for name, result, figures in rows:
        figures = " ".join(figures.split())
        figures = figures if len(figures) <= 400 else figures[:397] + "..."
        print(f"{name:<{widths[0]}}  {result:<{widths[1]}}  {figures}")


def parse_args() -> argparse.Namespace:
    """The arguments, refused (exit 2) where they cannot work on this machine."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda where torch sees a GPU, else cpu",
    )
    parser.add_argument(
        "--only", help=f"comma-separated checks, of {', '.join(CHECKS)} (default: all)"
    )
    parser.add_argument(
        "--model",
        default="minilm",
        choices=["minilm", "bow"],
        help="the demo's model to train: the pretrained MiniLM, or the quick bag of embeddings",
    )
    parser.add_argument(
        "--mixed-precision",
        default="auto",
        choices=["auto", "no", "bf16", "fp16"],
        help="[training] MIXED_PRECISION (auto: bf16 on a GPU that has it)",
    )
    parser.add_argument("--work", type=Path, help="a new or empty folder to keep everything in")
    args = parser.parse_args()
    args.only = [n.strip() for n in (args.only or ",".join(CHECKS)).split(",") if n.strip()]
    unknown = [n for n in args.only if n not in CHECKS]
    if unknown or not args.only:
        parser.error(f"--only: unknown check(s) {unknown}; choose from {', '.join(CHECKS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU on this machine")
    if args.device == "cpu" and any(Path("/dev").glob("nvidia[0-9]*")):
        # The entrypoint counts GPUs as SageMaker's containers do, from /dev/nvidia*
        # (steps/runtime/variables.py training_variables): every job here would train on them.
        parser.error("--device cpu: this machine has GPUs, and every job would train on them")
    if args.work and args.work.exists() and any(args.work.iterdir()):
        parser.error(f"--work {args.work}: not empty (nothing is written over)")
    return args


def main() -> int:
    args = parse_args()
    root = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"gpu check on {args.device} ({torch.cuda.device_count()} GPU), in {root}")
    work = Workspace(root.resolve(), args.device, args.model, args.mixed_precision)
    rows = run_checks(work, args.only)
    print_table(rows)
    failed = any(result == "FAILED" for _, result, _ in rows)
    if failed or args.work:
        print(f"\nlogs and job folders: {root}")
    else:
        shutil.rmtree(root)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
