"""Speed against the ecosystem's own tools, every figure a ratio to a baseline measured in the
same process, interleaved, after warm-up, same model (MiniLM), rows, batch size, steps and
threads on both sides. Rates are medians of --repeat runs (training, jobs) or --rounds
(inference, prepare); a ratio is the median of the ratios taken within each round, since this
machine's speed drifts within a minute:

1. training: our training job's loop (steps/train.py) against the Hugging Face `Trainer` with
   `DataCollatorWithPadding` and `group_by_length=True`, on long texts (BBC articles) and
   short ones (their lead sentences), both at MAX_SEQUENCE_LENGTH 128;
2. inference: our inference step's batching (steps/inference.py over the TorchScript export,
   64 rows a batch, each pass held to its MAX_TOKENS_PER_PASS) against
   `transformers.pipeline("text-classification")` at batch size 64 and a one-row-at-a-time loop;
3. preparation: our prepare's encode (steps/prepare.py) against one tokenizer call over the
   whole column (the floor) and an unbatched per-row `datasets.map`;
4. orchestration: what the local backend adds to a job, and `run_pipeline.py --help` start-up.

    python bench/speed.py [--rows N] [--steps N] [--repeat N] [--rounds N]

Prints a table and writes bench/results.json. Checkpoint cost: bench/checkpoint_cost.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("SMPIPE_USER_FUNCTIONS", "user_functions")

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    pipeline,
)

from steps import inference as inference_step  # noqa: E402
from steps import prepare as prepare_step  # noqa: E402
from steps import train as train_step  # noqa: E402
from steps.batching import Batches, write_inputs  # noqa: E402
from steps.contract import TrainingEnv  # noqa: E402
from steps.hyperparameters import parse_hyperparameters  # noqa: E402
from steps.prepared_files import encoding_record, write_encoding  # noqa: E402
from steps.user_code import load_user_functions  # noqa: E402
from user_functions import minilm_path  # noqa: E402
from user_functions.demo_data import bbc_articles  # noqa: E402

MAX_LENGTH = 128
BATCH = 16
WARM = 2  # optimizer steps before the clock starts, on both sides
datasets.disable_progress_bars()


def texts(rows: int) -> dict[str, tuple[list[str], list[int]]]:
    """Long texts (whole articles) and short ones (each article's lead sentence), same labels."""
    articles = bbc_articles()
    rng = np.random.default_rng(0)
    picked = [articles[i] for i in rng.permutation(len(articles))[:rows]]
    names = sorted({label for label, _ in articles})
    long, short, labels = [], [], []
    for label, path in picked:
        lines = [
            line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()
        ]
        long.append(" ".join(" ".join(lines).split()))
        lead = lines[1] if len(lines) > 1 else lines[0]
        short.append(lead.split(". ")[0])
        labels.append(names.index(label))
    return {"long": (long, labels), "short": (short, labels)}


def median(values: list[float]) -> float:
    return statistics.median(values)


def paired_ratio(ours: list[float], theirs: list[float]) -> float:
    """The median over rounds of theirs / ours (times measured back to back in each round):
    this machine's speed drifts by up to 2x within a minute, and a ratio taken within a
    round cancels the drift that a ratio of medians keeps."""
    return median([t / o for o, t in zip(ours, theirs, strict=True)])


# -- 1. training ---------------------------------------------------------------------------


def prepared_dir(tokenizer, data: tuple[list[str], list[int]], root: Path) -> dict[str, Path]:
    """The channels our training job reads, as prepare writes them."""
    text, labels = data
    enc = tokenizer(text, truncation=True, max_length=MAX_LENGTH)
    table = datasets.Dataset.from_dict({
        "minilm_input_ids": enc["input_ids"], "minilm_attention_mask": enc["attention_mask"],
        "minilm__length": [len(x) for x in enc["input_ids"]], "label_id": labels,
    })  # fmt: skip
    table.save_to_disk(str(root / "train"))
    table.select(range(min(32, len(table)))).save_to_disk(str(root / "validation"))
    (root / "labels").mkdir(parents=True, exist_ok=True)
    (root / "labels/id2label.json").write_text(json.dumps({str(i): f"l{i}" for i in range(5)}))
    write_inputs(root / "labels", {"minilm": {"keys": ["input_ids", "attention_mask"],
                 "pad": {"input_ids": tokenizer.pad_token_id, "attention_mask": 0},
                 "sequence": ["input_ids", "attention_mask"]}})  # fmt: skip
    write_encoding(root / "labels", encoding_record(MAX_LENGTH, {"minilm": {}}))
    return {c: root / c for c in ("train", "validation", "labels")}


def ours_training(channels: dict[str, Path], root: Path, steps: int) -> dict:
    hp = parse_hyperparameters({
        "model_name": "minilm", "epochs": "1",
        "learning_rate": "1e-4", "batch_size": str(BATCH), "max_per_device_batch_size": str(BATCH),
        "warmup_ratio": "0.1", "weight_decay": "0.01",
        "seed": "42", "checkpoint_every_steps": "0", "keep_checkpoints": "1", "wandb_project": "b",
        "wandb_mode": "disabled", "max_steps": "0",
    })  # fmt: skip
    for sub in ("model", "out", "ckpt"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    env = TrainingEnv(model_dir=root / "model", output_data_dir=root / "out", checkpoint_dir=root / "ckpt",
                      failure_file=root / "failure", channels=channels, hyperparameters=hp,
                      hosts=["algo-1"], current_host="algo-1", num_gpus=torch.cuda.device_count(),
                      num_cpus=os.cpu_count() or 1, job_name="bench")  # fmt: skip
    job = train_step.set_up(hp, env)
    job.total_steps = WARM
    train_step.train_epoch(job)
    job.total_steps = WARM + steps
    started = time.perf_counter()
    train_step.train_epoch(job)
    seconds = time.perf_counter() - started
    batches = job.sampler.global_batches()[WARM : WARM + steps]
    lengths = job.sampler.lengths
    real = sum(int(lengths[b].sum()) for b in batches)
    padded = sum(len(b) * int(lengths[b].max()) for b in batches)
    return {"seconds": seconds, "examples": steps * BATCH, "real_tokens": real, "tokens": padded}


class ClockAt(TrainerCallback):
    def __init__(self, first: int, last: int):
        self.first, self.last, self.times = first, last, {}

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in (self.first, self.last):
            self.times[state.global_step] = time.perf_counter()


class CountingCollator(DataCollatorWithPadding):
    """DataCollatorWithPadding, counting real and padded tokens of the timed steps."""

    def __call__(self, features):
        batch = super().__call__(features)
        self.seen.append((int(batch["attention_mask"].sum()), batch["attention_mask"].numel()))
        return batch


def trainer_training(tokenizer, data, root: Path, steps: int) -> dict:
    text, labels = data
    enc = tokenizer(text, truncation=True, max_length=MAX_LENGTH)
    train = datasets.Dataset.from_dict({"input_ids": enc["input_ids"],
                                        "attention_mask": enc["attention_mask"], "labels": labels})  # fmt: skip
    torch.manual_seed(42)
    model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=5)
    collator = CountingCollator(tokenizer)
    collator.seen = []
    clock = ClockAt(WARM, WARM + steps)
    args = TrainingArguments(
        output_dir=str(root), per_device_train_batch_size=BATCH, train_sampling_strategy="group_by_length",
        max_steps=WARM + steps, learning_rate=1e-4, weight_decay=0.01,
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, seed=42,
    )  # fmt: skip
    Trainer(model=model, args=args, train_dataset=train, data_collator=collator,
            callbacks=[clock]).train()  # fmt: skip
    timed = collator.seen[WARM : WARM + steps]
    return {"seconds": clock.times[WARM + steps] - clock.times[WARM], "examples": steps * BATCH,
            "real_tokens": sum(r for r, _ in timed), "tokens": sum(t for _, t in timed)}  # fmt: skip


def matmul_peak() -> float:
    """FLOP/s of a float32 matmul on this machine: the ceiling for model FLOP/s."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    for _ in range(3):
        a @ b
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(10):
            a @ b
        runs.append(10 * 2 * 1024**3 / (time.perf_counter() - started))
    return max(runs)


def bench_training(corpora, tokenizer, steps: int, repeat: int, work: Path) -> dict:
    # 6 FLOPs per parameter per token for a forward and backward pass (embeddings excluded).
    model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=5)
    params = sum(p.numel() for n, p in model.named_parameters() if "embeddings" not in n)
    peak = matmul_peak()
    out = {}
    for kind, data in corpora.items():
        channels = prepared_dir(tokenizer, data, work / f"prepared-{kind}")
        ours, theirs = [], []
        for r in range(repeat):
            ours.append(ours_training(channels, work / f"ours-{kind}-{r}", steps))
            theirs.append(trainer_training(tokenizer, data, work / f"trainer-{kind}-{r}", steps))
        rate = {name: median([x["examples"] / x["seconds"] for x in runs])
                for name, runs in (("ours", ours), ("trainer", theirs))}  # fmt: skip
        tokens = {name: median([x["real_tokens"] / x["seconds"] for x in runs])
                  for name, runs in (("ours", ours), ("trainer", theirs))}  # fmt: skip
        flops = median([6 * params * x["tokens"] / x["seconds"] for x in ours])
        out[kind] = {
            "ours_examples_per_s": rate["ours"], "trainer_examples_per_s": rate["trainer"],
            "ratio": paired_ratio([x["seconds"] / x["examples"] for x in ours],
                                  [x["seconds"] / x["examples"] for x in theirs]),
            "ours_real_tokens_per_s": tokens["ours"], "trainer_real_tokens_per_s": tokens["trainer"],
            "ours_real_token_share": ours[0]["real_tokens"] / ours[0]["tokens"],
            "trainer_real_token_share": theirs[0]["real_tokens"] / theirs[0]["tokens"],
            "ours_model_flops_share_of_matmul_peak": flops / peak,
        }  # fmt: skip
    return out


TRAINER_SCRIPT = """
import sys, time
import datasets, torch
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                          Trainer, TrainerCallback, TrainingArguments)
path, data, out, steps, same_work = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"

class Loop(TrainerCallback):  # the training steps alone, as our job's train_loop_seconds
    first = last = None
    def on_step_begin(self, args, state, control, **kwargs):
        self.first = self.first or time.perf_counter()
    def on_step_end(self, args, state, control, **kwargs):
        self.last = time.perf_counter()

def compute_metrics(prediction):
    from sklearn.metrics import accuracy_score, f1_score
    predicted = prediction.predictions.argmax(-1)
    return {"accuracy": accuracy_score(prediction.label_ids, predicted),
            "f1": f1_score(prediction.label_ids, predicted, average="macro")}

tokenizer = AutoTokenizer.from_pretrained(path)
train = datasets.load_from_disk(data)
model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=5)
# What our job also does: validate each epoch, checkpoint, keep the best model by F1.
work = dict(eval_strategy="epoch", save_strategy="epoch", load_best_model_at_end=True,
            metric_for_best_model="f1", save_total_limit=1) if same_work else dict(save_strategy="no")
args = TrainingArguments(output_dir=out, per_device_train_batch_size=16, per_device_eval_batch_size=16,
                         max_steps=steps, train_sampling_strategy="group_by_length", report_to=[],
                         logging_strategy="no", disable_tqdm=True, use_cpu=True, learning_rate=1e-4, **work)
loop = Loop()
trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=DataCollatorWithPadding(tokenizer),
                  eval_dataset=train.select(range(32)) if same_work else None,
                  compute_metrics=compute_metrics if same_work else None, callbacks=[loop])
trainer.train()
trainer.save_model(out + "/model")
if same_work:  # and the program our job writes by default (TorchScript), as the PyTorch docs write it
    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model
        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits
    wrapper = Logits(trainer.model.eval())
    sample = tokenizer(["a short one", "a somewhat longer sentence than that"], padding=True, return_tensors="pt")
    example = (sample["input_ids"], sample["attention_mask"])
    with torch.no_grad():
        torch.jit.trace(wrapper, example, strict=False).save(out + "/model.torchscript.pt")
print("LOOP", loop.last - loop.first)
"""


def bench_fixed_cost(tokenizer, data, steps: int, repeat: int, work: Path) -> dict:
    """Wall time of a whole training job minus its training loop: imports, data and model
    loading, export, teardown. Ours through the image's entrypoint (what every backend runs,
    including its validation and the export [inference] MODEL_FORMAT needs), started cold (a
    fresh interpreter, as in a container) and warm (forked by the local backend's fork server,
    which imported the libraries before), against a Trainer script that trains the same
    steps and saves the model (the issue's yardstick), and one that also does our job's work:
    validates, checkpoints, keeps the best model by F1, writes TorchScript (the program
    [inference] MODEL_FORMAT needs by default, all ours writes then).
    The loop is the training steps alone on every side (ours: train_loop_seconds; the
    Trainer's: its first step's start to its last step's end)."""
    from pipeline.backends.container import image_env, lay_out_training
    from pipeline.backends.warm_start import WarmStart
    from steps.entrypoint import ENTRYPOINT

    channels = prepared_dir(tokenizer, data, work / "fixed-prepared")
    text, labels = data
    enc = tokenizer(text, truncation=True, max_length=MAX_LENGTH)
    datasets.Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                                "labels": labels}).save_to_disk(str(work / "fixed-hf"))  # fmt: skip
    (work / "trainer.py").write_text(TRAINER_SCRIPT)
    hps = {"model_name": "minilm", "epochs": "1",
           "learning_rate": "1e-4", "batch_size": str(BATCH), "max_per_device_batch_size": str(BATCH),
           "warmup_ratio": "0.1", "weight_decay": "0.01",
           "seed": "42", "checkpoint_every_steps": "0", "keep_checkpoints": "1", "wandb_project": "b",
           "wandb_mode": "disabled", "max_steps": str(steps)}  # fmt: skip

    def link(uri: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        local.symlink_to(uri, target_is_directory=True)

    def job(name: str, steps_: int) -> tuple[Path, dict]:
        root = work / name
        request = {"InputDataConfig": [{"ChannelName": c, "DataSource": {"S3DataSource": {"S3Uri": str(p)}}}
                                       for c, p in channels.items()],
                   "ResourceConfig": {"InstanceType": "local", "InstanceCount": 1}}  # fmt: skip
        lay_out_training(
            request, root, "algo-1", ["algo-1"], link, {**hps, "max_steps": str(steps_)}
        )
        env = {**os.environ, **image_env(root), "SMPIPE_USER_FUNCTIONS": "user_functions",
               "PYTHONPATH": str(ROOT), "TRAINING_JOB_NAME": "fixed-cost"}  # fmt: skip
        return root, env

    argv = [sys.executable, *ENTRYPOINT[1:], "train"]

    def run(env: dict, warm: bool) -> None:
        """The job, through the entrypoint: cold (a fresh interpreter) or warm (forked)."""
        proc = starter.start(argv, env, ROOT) if warm else None
        if proc is None:
            subprocess.run(argv, env=env, cwd=ROOT, check=True, capture_output=True)
            return
        proc.stdout.read()
        if proc.wait() != 0:
            sys.exit(f"a warm-started job failed: {env['SMPIPE_ML_ROOT']}")

    # The local backend's warm start (pipeline/backends/warm_start.py): its first job of an
    # environment starts cold and its second starts the server; two one-step jobs do that
    # here, untimed, so the timed warm jobs start from a server that is up, as a run's later
    # jobs do.
    starter = WarmStart(work / "warm-start")
    for n in range(2):
        run(job(f"fixed-prime-{n}", 1)[1], warm=True)
    runs = {"ours": [], "ours_warm": [], "trainer": [], "trainer_same_work": []}
    phases = {"ours": [], "ours_warm": []}
    for r in range(repeat):
        for name, warm in (("ours", False), ("ours_warm", True)):
            root, env = job(f"fixed-{name}-{r}", steps)
            started = time.perf_counter()
            run(env, warm)
            wall = time.perf_counter() - started
            report = json.loads((root / "output/data/step_metadata.json").read_text())
            runs[name].append((wall, report["train_loop_seconds"]))
            phases[name].append(report["seconds_outside_steps"])

        for name, same_work in (("trainer", "0"), ("trainer_same_work", "1")):
            started = time.perf_counter()
            done = subprocess.run([sys.executable, str(work / "trainer.py"), minilm_path(), str(work / "fixed-hf"),
                                   str(work / f"fixed-{name}-{r}"), str(steps), same_work],
                                  check=True, capture_output=True, text=True)  # fmt: skip
            wall = time.perf_counter() - started
            loop = next(line for line in done.stdout.splitlines() if line.startswith("LOOP"))
            runs[name].append((wall, float(loop.split()[1])))
    starter.close()
    out = {}
    for name, times in runs.items():
        out[f"{name}_fixed_s"] = median([wall - loop for wall, loop in times])
        out[f"{name}_loop_s"] = median([loop for _, loop in times])
    for name, reports in phases.items():  # where our fixed cost goes, phase by phase
        out[f"{name}_phases_s"] = {k: median([p[k] for p in reports]) for k in reports[0]}
    return out


# -- 2. inference ----------------------------------------------------------------------------


def bench_inference(corpora, tokenizer, repeat: int, work: Path, batch_size: int = 64) -> dict:
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=5).eval()
    keys = ["input_ids", "attention_mask"]
    sample = tokenizer(["a short one", "a somewhat longer sentence than that"], padding=True,
                       return_tensors="pt")  # fmt: skip
    traced_path = work / "model.torchscript.pt"
    with torch.no_grad():
        wrapper = train_step.LogitsOnly(model, keys).eval()
        torch.jit.trace(wrapper, tuple(sample[k] for k in keys), strict=False).save(
            str(traced_path)
        )
    traced = torch.jit.load(str(traced_path))
    classify = pipeline("text-classification", model=model, tokenizer=tokenizer, device=-1,
                        batch_size=batch_size, truncation=True, max_length=MAX_LENGTH)  # fmt: skip
    inputs = {"keys": keys, "pad": {"input_ids": tokenizer.pad_token_id, "attention_mask": 0},
              "sequence": keys}  # fmt: skip
    out = {}
    for kind, (text, _) in corpora.items():
        runs = {"ours": [], "pipeline": [], "one_at_a_time": []}
        for _ in range(repeat + 1):  # the first round is warm-up
            started = time.perf_counter()
            enc = tokenizer(text, truncation=True, max_length=MAX_LENGTH)
            table = pa.table({
                "m_input_ids": enc["input_ids"], "m_attention_mask": enc["attention_mask"],
                "m__length": [len(x) for x in enc["input_ids"]],
            })  # fmt: skip
            batches = Batches(table, "m", keys, inputs, labels=False)
            ours = inference_step.run_batches(traced, batches, keys, batch_size).argmax(-1)
            runs["ours"].append(time.perf_counter() - started)

            started = time.perf_counter()
            theirs = [int(r["label"].split("_")[-1]) for r in classify(text)]
            runs["pipeline"].append(time.perf_counter() - started)

            started = time.perf_counter()
            with (
                torch.inference_mode()
            ):  # the seed's loop: one row at a time, padded to the maximum
                single = [int(traced(*(tokenizer(t, truncation=True, max_length=MAX_LENGTH,
                                                 padding="max_length", return_tensors="pt")[k]
                                       for k in keys)).argmax(-1))
                          for t in text]  # fmt: skip
            runs["one_at_a_time"].append(time.perf_counter() - started)
            assert ours.tolist() == theirs == single, "the three disagree on a prediction"
        rate = {name: len(text) / median(times[1:]) for name, times in runs.items()}
        out[kind] = {
            **{f"{name}_examples_per_s": r for name, r in rate.items()},
            "ratio_vs_pipeline": paired_ratio(runs["ours"][1:], runs["pipeline"][1:]),
            "ratio_vs_one_at_a_time": paired_ratio(runs["ours"][1:], runs["one_at_a_time"][1:]),
            "identical_predictions": True,
        }
    return out


# -- 3. preparation --------------------------------------------------------------------------


def bench_prepare(corpora, tokenizer, repeat: int) -> dict:
    functions = load_user_functions("user_functions")
    out = {}
    for kind, (text, labels) in corpora.items():
        table = datasets.Dataset.from_dict({"text": text, "label_id": labels})
        runs = {"ours": [], "one_call": [], "load_and_one_call": [], "unbatched_map": []}
        for _ in range(repeat + 1):
            started = time.perf_counter()
            tokenizer(text, truncation=True, max_length=MAX_LENGTH)
            runs["one_call"].append(time.perf_counter() - started)

            # Ours loads the tokenizer (the user's load_tokenizer) before it encodes: so here.
            started = time.perf_counter()
            AutoTokenizer.from_pretrained(minilm_path())(
                text, truncation=True, max_length=MAX_LENGTH
            )
            runs["load_and_one_call"].append(time.perf_counter() - started)

            started = time.perf_counter()
            with open(os.devnull, "w") as quiet:
                stdout, sys.stdout = sys.stdout, quiet
                try:
                    prepare_step.encode_for(table, functions, "minilm", MAX_LENGTH)
                finally:
                    sys.stdout = stdout
            runs["ours"].append(time.perf_counter() - started)

            started = time.perf_counter()
            table.map(lambda r: tokenizer(r["text"], truncation=True, max_length=MAX_LENGTH),
                      load_from_cache_file=False)  # fmt: skip
            runs["unbatched_map"].append(time.perf_counter() - started)
        rate = {name: len(text) / median(times[1:]) for name, times in runs.items()}
        out[kind] = {**{f"{name}_rows_per_s": r for name, r in rate.items()},
                     **{f"ratio_vs_{name}": paired_ratio(runs["ours"][1:], runs[name][1:])
                        for name in ("one_call", "load_and_one_call", "unbatched_map")}}  # fmt: skip
    return out


# -- 4. orchestration ------------------------------------------------------------------------


def bench_orchestration(repeat: int, work: Path) -> dict:
    import configparser

    from pipeline.backends.local import LocalBackend
    from pipeline.code_bundle import ship_code
    from pipeline.config import load_settings
    from pipeline.paths import ExperimentTree
    from pipeline.sources import upload_raw
    from pipeline.stages import build_jobs
    from pipeline.store import LocalStore
    from user_functions.demo_data import write_demo

    shipped = configparser.ConfigParser(interpolation=None, delimiters=("=",))
    shipped.optionxform = str.upper
    shipped.read(ROOT / "settings.ini")
    shipped.set("experiment", "STORE", str(work / "store"))
    with open(work / "settings.ini", "w") as f:
        shipped.write(f)
    settings = load_settings(work / "settings.ini", env={})
    store = LocalStore(settings.store_uri())
    tree = ExperimentTree(settings.experiment.name)
    write_demo(work / "raw", per_label=5)
    upload_raw(store, tree, work / "raw")
    overhead = []
    for r in range(repeat):
        run = tree.run(900 + r)
        ship_code(settings, store, run.code)
        from pipeline.sources import Sources

        sources = Sources(raw=tree.raw)
        job = build_jobs(settings, ["reconcile"], run, sources)[0]
        backend = LocalBackend(
            store, run, echo=open(os.devnull, "w"), work_root=str(work / f"jobs{r}")
        )
        started = time.perf_counter()
        result = backend.run_processing(job)
        wall = time.perf_counter() - started
        assert result.status == "Completed", result.failure_reason
        overhead.append(wall - result.seconds)
    helps = []
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run([sys.executable, str(ROOT / "run_pipeline.py"), "--help"], check=True,
                       capture_output=True)  # fmt: skip
        helps.append(time.perf_counter() - started)
    python = []
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        python.append(time.perf_counter() - started)
    return {"local_job_overhead_s": median(overhead), "help_startup_s": median(helps),
            "bare_python_startup_s": median(python)}  # fmt: skip


def print_fixed_cost(f: dict, steps: int) -> None:
    print(
        f"  training job outside its loop ({steps} steps): ours {f['ours_fixed_s']:.1f}s "
        f"(loop {f['ours_loop_s']:.1f}s), Trainer script {f['trainer_fixed_s']:.1f}s "
        f"(loop {f['trainer_loop_s']:.1f}s); ratio {f['ours_fixed_s'] / f['trainer_fixed_s']:.2f}x"
    )
    print(
        f"  the same, ours warm-started (the local backend): {f['ours_warm_fixed_s']:.1f}s "
        f"(loop {f['ours_warm_loop_s']:.1f}s); ratio "
        f"{f['ours_warm_fixed_s'] / f['trainer_fixed_s']:.2f}x"
    )
    for name in ("ours", "ours_warm"):
        said = ", ".join(f"{k} {v:.2f}" for k, v in f[f"{name}_phases_s"].items())
        print(f"    {name} outside its steps, by phase (s): {said}")
    print(
        f"  the same, against a Trainer script doing our job's work (validation, checkpoint, best model, "
        f"TorchScript): {f['trainer_same_work_fixed_s']:.1f}s "
        f"(loop {f['trainer_same_work_loop_s']:.1f}s); ratio "
        f"{f['ours_fixed_s'] / f['trainer_same_work_fixed_s']:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", type=int, default=256, help="texts per corpus for inference (default 256)"
    )
    parser.add_argument(
        "--train-rows",
        type=int,
        default=1779,
        help="texts per corpus training draws its batches from (default 1779, the demo's training split)",
    )
    parser.add_argument(
        "--prepare-rows",
        type=int,
        default=2225,
        help="texts per corpus for prepare (default all 2225)",
    )
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps (default 8)")
    parser.add_argument(
        "--repeat", type=int, default=3, help="training and job repetitions, median (default 3)"
    )
    parser.add_argument(
        "--rounds", type=int, default=9, help="inference and prepare rounds, median (default 9)"
    )
    parser.add_argument(
        "--only-fixed-cost",
        action="store_true",
        help="measure only the training job's fixed cost (updates that part of results.json)",
    )
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    work = Path(tempfile.mkdtemp(prefix="smpipe-speed-"))
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    corpora = texts(args.rows)
    if args.only_fixed_cost:
        results = json.loads((ROOT / "bench/results.json").read_text())
        results["training_job_fixed_cost"] = bench_fixed_cost(
            tokenizer, texts(args.rows)["long"], args.steps, args.repeat, work
        )
        (ROOT / "bench/results.json").write_text(json.dumps(results, indent=2))
        print_fixed_cost(results["training_job_fixed_cost"], args.steps)
        return
    results = {
        "machine": {
            "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch": torch.__version__,
        },  # fmt: skip
        "settings": vars(args) | {"batch": BATCH, "max_length": MAX_LENGTH},
        # Inference first, in a process that has not trained: as the inference job runs. After
        # training, glibc's malloc has raised its mmap threshold and a pass's big tensors no
        # longer cost page faults, which hides what holding passes to a token budget saves.
        "inference": bench_inference(corpora, tokenizer, args.rounds, work),
        "training": bench_training(
            texts(args.train_rows), tokenizer, args.steps, args.repeat, work
        ),
        "prepare": bench_prepare(texts(args.prepare_rows), tokenizer, args.rounds),
        "orchestration": bench_orchestration(args.repeat, work),
        "training_job_fixed_cost": bench_fixed_cost(
            tokenizer, texts(args.rows)["long"], args.steps, args.repeat, work
        ),
    }
    (ROOT / "bench/results.json").write_text(json.dumps(results, indent=2))
    t, i, p, o = (results[k] for k in ("training", "inference", "prepare", "orchestration"))
    print(f"\nspeed: MiniLM, max length {MAX_LENGTH}, batch {BATCH}, texts per corpus: training "
          f"{args.train_rows}, inference {args.rows}, prepare {args.prepare_rows}; median of "
          f"{args.repeat} (training, jobs) or {args.rounds} rounds (bench/results.json)")  # fmt: skip
    print(f"  {'measure':<52}{'long':>10}{'short':>10}")
    rows = [
        ("training examples/s, ours", t, "ours_examples_per_s", "{:.1f}"),
        ("training examples/s, Trainer (grouped, dyn. padding)", t, "trainer_examples_per_s", "{:.1f}"),
        ("  ratio ours / Trainer", t, "ratio", "{:.2f}x"),
        ("real tokens per batch, ours", t, "ours_real_token_share", "{:.1%}"),
        ("real tokens per batch, Trainer", t, "trainer_real_token_share", "{:.1%}"),
        ("model FLOP/s as share of matmul peak, ours", t, "ours_model_flops_share_of_matmul_peak", "{:.1%}"),
        ("inference examples/s, ours", i, "ours_examples_per_s", "{:.1f}"),
        ("inference examples/s, transformers pipeline", i, "pipeline_examples_per_s", "{:.1f}"),
        ("inference examples/s, one at a time padded to 128", i, "one_at_a_time_examples_per_s", "{:.1f}"),
        ("  ratio ours / pipeline", i, "ratio_vs_pipeline", "{:.2f}x"),
        ("  ratio ours / one at a time", i, "ratio_vs_one_at_a_time", "{:.2f}x"),
        ("prepare rows/s, ours", p, "ours_rows_per_s", "{:.0f}"),
        ("prepare rows/s, one tokenizer call (floor)", p, "one_call_rows_per_s", "{:.0f}"),
        ("prepare rows/s, unbatched map", p, "unbatched_map_rows_per_s", "{:.0f}"),
        ("prepare rows/s, loading the tokenizer + one call", p, "load_and_one_call_rows_per_s", "{:.0f}"),
        ("  ratio ours / one call", p, "ratio_vs_one_call", "{:.2f}x"),
        ("  ratio ours / loading the tokenizer + one call", p, "ratio_vs_load_and_one_call", "{:.2f}x"),
    ]  # fmt: skip
    for label, table, key, fmt in rows:
        print(
            f"  {label:<52}{fmt.format(table['long'][key]):>10}{fmt.format(table['short'][key]):>10}"
        )
    print_fixed_cost(results["training_job_fixed_cost"], args.steps)
    print(f"  local backend overhead per job: {o['local_job_overhead_s']:.2f}s; "
          f"run_pipeline.py --help {o['help_startup_s']:.2f}s (bare python {o['bare_python_startup_s']:.2f}s)")  # fmt: skip


if __name__ == "__main__":
    main()
