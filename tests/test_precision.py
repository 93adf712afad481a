"""MIXED_PRECISION = auto: bf16 where the CPU computes it natively, fp32 elsewhere, in training,
inference and predict; what was applied, and why, in the model's report.

This machine's CPU has neither AMX nor AVX512-BF16, so both kinds of CPU are played through
SMPIPE_CPU_BF16 (steps/precision.py), which replaces only the detection: the jobs then really
compute in what it resolves to."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeline.config import load_settings
from pipeline.driver import parse_steps, run_pipeline
from pipeline.paths import ExperimentTree
from pipeline.sources import upload_raw
from pipeline.store import LocalStore
from steps import precision
from steps.precision import CPU_BF16_VARIABLE, resolve
from tests.conftest import write_settings


def test_auto_is_bf16_only_on_a_cpu_that_computes_it(monkeypatch):
    monkeypatch.setenv(CPU_BF16_VARIABLE, "native")
    assert resolve("auto", num_gpus=0) == precision.Precision(
        "bf16", f"auto: bf16, {CPU_BF16_VARIABLE}=native"
    )
    assert resolve("no", num_gpus=0).applied == "no"  # no keeps fp32 everywhere
    monkeypatch.setenv(CPU_BF16_VARIABLE, "none")
    assert resolve("auto", num_gpus=0).applied == "no"
    assert resolve("bf16", num_gpus=0).applied == "bf16"  # asked for: done, if slowly
    with pytest.raises(ValueError, match="fp16 needs a GPU"):
        resolve("fp16", num_gpus=0)
    monkeypatch.setenv(CPU_BF16_VARIABLE, "yes")
    with pytest.raises(ValueError, match=f"{CPU_BF16_VARIABLE}='yes': use native or none"):
        resolve("auto", num_gpus=0)


def test_without_the_override_the_detection_is_torch_s(monkeypatch):
    monkeypatch.delenv(CPU_BF16_VARIABLE, raising=False)
    native = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    applied = resolve("auto", num_gpus=0)
    assert applied.applied == ("bf16" if native else "no")
    if not native:
        assert "has neither AMX nor AVX512-BF16" in applied.reason
        assert torch.backends.cpu.get_cpu_capability() in applied.reason


@pytest.mark.parametrize(
    ("gpu", "capability", "expected"),
    [("T4 (ml.g4dn)", (7, 5), "fp16"), ("V100 (ml.p3)", (7, 0), "fp16"), ("A100", (8, 0), "bf16")],
)
def test_on_a_gpu_auto_is_bf16_only_where_the_gpu_computes_it_natively(
    gpu, capability, expected, monkeypatch
):
    """A T4 or a V100 emulates bf16, and torch's `is_bf16_supported()` counts emulation by
    default (torch 2.4 on): auto must still pick fp16 there. No CUDA here: torch's own check runs
    against a played device, which answers as one that emulates bf16 does."""
    major, minor = capability
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda device=None: SimpleNamespace(name=gpu, major=major, minor=minor),
    )
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)
    assert torch.cuda.is_bf16_supported()  # the played device emulates bf16, as a T4 does
    assert resolve("auto", num_gpus=1).applied == expected
    assert resolve("no", num_gpus=1).applied == "no"


def minilm_programs(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from steps.export import LogitsOnly
    from user_functions import minilm_path

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=5)
    texts = ["a short one", "a sentence of some length, longer than the first by far"] * 2
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    args = (encoded["input_ids"], encoded["attention_mask"])
    wrapper = LogitsOnly(model.eval(), ["input_ids", "attention_mask"]).eval()
    dim = torch.export.Dim.DYNAMIC
    with torch.no_grad():
        torch.jit.trace(wrapper, args, strict=False, check_trace=False).save(tmp_path / "ts.pt")
        shapes = ({0: dim, 1: dim}, {0: dim, 1: dim})
        exported = torch.export.export(wrapper, args, dynamic_shapes=(shapes,), strict=False)
        torch.export.save(exported, tmp_path / "model.pt2")
    programs = {
        "torchscript": torch.jit.load(tmp_path / "ts.pt"),
        "exported": torch.export.load(tmp_path / "model.pt2").module(),
    }
    return wrapper, programs, args


def test_both_exported_programs_compute_in_bf16_under_autocast(tmp_path):
    """Inference runs the exported programs under autocast: each must then compute as the
    eager model does under it (bf16 matmuls), not silently in fp32."""
    eager, programs, args = minilm_programs(tmp_path)
    bf16 = precision.Precision("bf16", "test")
    with torch.inference_mode(), torch.jit.optimized_execution(False):
        fp32 = eager(*args)
        with precision.autocast(bf16):
            low = eager(*args).float()
        for name, program in programs.items():
            with precision.autocast(bf16):
                got = program(*args)
            assert got.dtype == torch.bfloat16, name
            assert torch.allclose(got.float(), low, atol=1e-2), name
    assert (low - fp32).abs().max() > 1e-4  # bf16 really ran: it is not fp32's answer


@pytest.mark.slow
@pytest.mark.parametrize("cpu", ["native", "none"])
def test_a_run_computes_in_what_the_cpu_has_and_its_report_says_so(
    cpu, tmp_path, demo_raw, monkeypatch
):
    """Training and inference in bf16 on a CPU with native bf16, in fp32 on one without;
    Metadata and report.html say which and why, and a bf16 inference says how its predictions
    compare with fp32's on the same model."""
    monkeypatch.setenv(CPU_BF16_VARIABLE, cpu)
    path = write_settings(
        tmp_path / "settings.ini",
        str(tmp_path / "store"),
        models={"MODEL_NAMES": "bow"},  # the baseline: seconds where MiniLM takes a minute
        data={"MAX_SEQUENCE_LENGTH": "32"},
    )
    settings = load_settings(path, env={})
    store = LocalStore(tmp_path / "store")
    upload_raw(store, ExperimentTree("test-exp"), demo_raw)
    record = run_pipeline(settings, store, parse_steps(None), echo=sys.stdout)
    assert record["status"] == "completed"
    trained = record["steps"]["train"]["details"]["models"]["bow"]
    tested = record["steps"]["inference"]["details"]
    applied = "bf16" if cpu == "native" else "no"
    why = f"auto: {'bf16' if cpu == 'native' else 'fp32'}, {CPU_BF16_VARIABLE}={cpu}"
    assert (trained["mixed_precision"], trained["precision_reason"]) == (applied, why)
    assert (tested["mixed_precision"], tested["precision_reason"]) == (applied, why)
    page = (tmp_path / "store/test-exp/runs/0001/report.html").read_text()
    shown = "bf16" if cpu == "native" else "fp32"
    assert f"Computed in {shown}: {why}." in page and f"Tested in {shown}: {why}." in page
    rows = tested["holdout_performance"]["bow"]["rows"]
    if cpu == "none":
        assert tested["against_fp32"] is None and "Against fp32" not in page
        return
    # The program trained in bf16 was exported in fp32: it computes in what inference chooses
    # (traced through Accelerate's autocast wrapper, it would carry bf16 casts everywhere).
    folder = tmp_path / "store/test-exp/runs/0001/models/bow/model"
    program = torch.jit.load(folder / "model.torchscript.pt")
    ids, mask = torch.randint(1000, 2000, (2, 16)), torch.ones(2, 16, dtype=torch.long)
    with torch.inference_mode(), torch.jit.optimized_execution(False):
        assert program(ids, mask).dtype == torch.float32
        with precision.autocast(precision.Precision("bf16", "test")):
            assert program(ids, mask).dtype == torch.bfloat16
    checked = tested["against_fp32"]["bow"]
    assert checked["rows"] == rows  # a small test split is checked whole
    assert 0 <= checked["agreement"] <= 1 and 0 <= checked["max_probability_difference"] <= 1
    # bf16 really ran: its probabilities are not fp32's.
    assert checked["max_probability_difference"] > 0
    assert f"Against fp32 on {rows} test rows" in page


def test_gpus_torch_cannot_use_stop_the_job_saying_why_and_what_to_do(monkeypatch):
    """A GPU host whose driver is older than the image's CUDA (SageMaker documents no driver):
    the job stops before Accelerate, naming the GPUs, torch's CUDA and torch's own reason."""
    from steps.training_blocks import accelerator_for

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def too_old():
        raise RuntimeError("The NVIDIA driver on your system is too old (found version 11040).")

    monkeypatch.setattr(torch.cuda, "init", too_old)
    env = SimpleNamespace(num_gpus=4, output_data_dir=Path("/tmp"))
    hp = {"wandb_mode": "disabled", "mixed_precision": "auto"}
    with pytest.raises(RuntimeError) as raised:
        accelerator_for(hp, env, accumulation=1)
    said = str(raised.value)
    assert said.startswith(f"this host has 4 GPU(s), and torch {torch.__version__} (CUDA ")
    assert "The NVIDIA driver on your system is too old (found version 11040)" in said
    assert "forward-compatibility package" in said


def test_trained_weights_built_in_bf16_train_in_fp32_and_frozen_ones_keep_their_dtype():
    """A model load_model built in bf16 (`from_pretrained(..., dtype=torch.bfloat16)`): under
    mixed precision its trained weights are upcast, its frozen ones (a LoRA base) stay bf16;
    without, nothing is cast. In bf16 an AdamW step at a finetuning rate would leave the
    weights as they were."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 2)).bfloat16()
    model[0].weight.requires_grad_(False)
    with torch.no_grad():
        model[1].weight.uniform_(0.25, 1.0)  # bf16's step there: 2**-9 to 2**-7
    kept_bf16 = torch.nn.Linear(4, 2).bfloat16()
    kept_bf16.load_state_dict(model[1].state_dict())

    fp32, bf16 = precision.Precision("no", "test"), precision.Precision("bf16", "test")
    assert precision.trained_weights_in_fp32(model, fp32) == {"bfloat16": 4 * 2 + 2}
    assert model[1].weight.dtype == torch.bfloat16  # without mixed precision: as built
    assert precision.trained_weights_in_fp32(model, bf16) == {"bfloat16": 4 * 2 + 2}
    assert model[1].weight.dtype == torch.float32 and model[1].bias.dtype == torch.float32
    assert model[0].weight.dtype == torch.bfloat16
    assert precision.trained_weights_in_fp32(model, bf16) == {}  # nothing left to upcast

    def step(linear: torch.nn.Linear) -> torch.Tensor:
        before = linear.weight.detach().float().clone()
        optimizer = torch.optim.AdamW(linear.parameters(), lr=2e-5, weight_decay=0.0)
        x = torch.randn(16, 4, dtype=linear.weight.dtype)
        linear(x).sum().backward()
        optimizer.step()
        return linear.weight.detach().float() != before

    assert step(model[1]).all()  # every fp32 weight moved
    assert not step(kept_bf16).any()  # every bf16 update rounded away


BF16_FUNCTIONS = """
import torch

import user_functions
from user_functions import encode, load_tokenizer, ordered_input_keys, reconcile  # noqa: F401


def load_model(model_name, id2label, label2id):
    return user_functions.load_model(model_name, id2label, label2id).to(torch.bfloat16)
"""


@pytest.mark.parametrize("cpu", ["native", "none"])
def test_a_job_whose_model_was_built_in_bf16_says_how_it_trains_it(tmp_path, cpu):
    """Under bf16 mixed precision (a CPU that computes bf16) its weights train in fp32; on a
    CPU without, MIXED_PRECISION = auto applies none, and the job says what that costs and
    what to do. Either way it trains."""
    from tests.jobs.prepared import write_small_splits
    from tests.jobs.training_job import HPS, job_root, run_to_end

    (tmp_path / "code").mkdir()
    (tmp_path / "code/bf16_functions.py").write_text(BF16_FUNCTIONS)
    splits = write_small_splits(tmp_path / "prepared")
    root, env = job_root(tmp_path / "job", splits, {**HPS, "epochs": "1"})
    env = {**env, "SMPIPE_USER_FUNCTIONS": "bf16_functions", CPU_BF16_VARIABLE: cpu,
           "PYTHONPATH": f"{env['PYTHONPATH']}:{tmp_path / 'code'}"}  # fmt: skip
    out = run_to_end(env)
    said = re.findall(r"^bf16_functions\.load_model\('bow', \.\.\.\) built (.*)$", out, re.M)
    how = (
        "they train in fp32, computed in bf16 (an optimizer step in bf16 or fp16 would round "
        "most finetuning updates away)"
        if cpu == "native"
        else "MIXED_PRECISION applies none, so they train as built, and most finetuning "
        "updates round away: build the model in fp32, or set [training] MIXED_PRECISION = bf16"
    )
    assert said == [f"3,907,203 trained weights in bfloat16: {how}"], out[-3000:]
    assert (root / "model/model.safetensors").exists(), out[-3000:]


def test_weights_trained_in_fp32_load_whole_into_a_model_built_in_bf16(tmp_path, monkeypatch):
    """The export job (after tuning) loads the saved fp32 weights into what load_model builds:
    built in bf16, they are loaded as saved, not rounded to bf16 first."""
    from safetensors.torch import save_model

    from steps.export import trained_model
    from steps.runtime.names import USER_FUNCTIONS_VARIABLE

    (tmp_path / "bf16_functions.py").write_text(BF16_FUNCTIONS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(USER_FUNCTIONS_VARIABLE, "bf16_functions")
    import user_functions

    id2label = {0: "a", 1: "b"}
    saved = user_functions.load_model("bow", id2label, {"a": 0, "b": 1})
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(1e-4)  # fp32 values bf16 cannot hold
    save_model(saved, str(tmp_path / "model.safetensors"))
    loaded = trained_model(tmp_path, "bow", {"id2label": {"0": "a", "1": "b"}})
    got = loaded.state_dict()
    assert got.keys() == saved.state_dict().keys()
    for name, want in saved.state_dict().items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want), name
