"""report.html, one run on one page, and experiment.html, every run on one page.

Both are read from the store alone, inline their images as data: URIs and load nothing (no
script, font or CDN), so they open offline. The driver writes both when a run ends; `smpipe
report settings.ini [run_num]` writes them again.
"""

from __future__ import annotations

import base64
import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path

from pipeline import cost, tuning_record
from pipeline.history import age, run_rows
from pipeline.paths import ExperimentTree, RunTree, run_label
from pipeline.store import NotFound, Store, artifact_key
from steps.model_files import CURVES, HISTORY
from steps.runtime.names import PER_LABEL_FILE, STEP_METADATA_FILE

# Templates beside this module (package data: pyproject.toml).
TEMPLATE, EXPERIMENT_TEMPLATE = "report.html.j2", "experiment.html.j2"
# The page's sections, in order: (id, title). The browser test checks each one rendered.
SECTIONS = (
    ("summary", "Summary"),
    ("data", "Data"),
    ("training", "Training"),
    ("results", "Test results"),
    ("comparison", "Comparison"),
    ("tuning", "Tuning"),
    ("timings", "Timings"),
    ("settings", "Settings"),
    ("metadata", "Metadata"),
)


def _json(store: Store, key: str):
    try:
        return json.loads(store.get_bytes(key))
    except (NotFound, ValueError):
        return None


def _image(store: Store, key: str) -> str | None:
    try:
        return "data:image/png;base64," + base64.b64encode(store.get_bytes(key)).decode()
    except NotFound:
        return None


def _csv(store: Store, key: str) -> list[dict]:
    try:
        return list(csv.DictReader(io.StringIO(store.get_bytes(key).decode())))
    except NotFound:
        return []


# What the Timings table shows of each step's Metadata section.
TIMING_FIELDS = ("status", "time_taken", "memory_usage", "gpu_usage", "restarts", "job_names")


def context(store: Store, tree: ExperimentTree, run_num: int) -> dict:
    """What the page shows, read from the run tree; a part the run never made is None."""
    from pipeline.history import read_record

    run = tree.run(run_num)
    record = read_record(store, tree, run_num)  # one that cannot be read is named, and why
    steps = record.get("steps") or {}
    train = steps.get("train") or steps.get("tune") or {}
    trained = (train.get("details") or {}).get("models") or {}
    inference = (steps.get("inference") or {}).get("details") or {}
    version = record.get("data_version")
    # The snapshot of the run's data version, or of the one its prepared data was made from.
    versions = ([version] if isinstance(version, int) else []) + _reconciled_version(record)
    snapshots = (_json(store, tree.data(v).snapshot_info) for v in versions)
    snapshot = next(filter(None, snapshots), None)
    results = run.inference if inference else None
    tuned = train.get("step") == "tune"
    names = record.get("model_artifacts") or sorted(record.get("holdout_performance") or {})
    models = [
        _model_view(store, run, record, name, trained, results, tuned, inference) for name in names
    ]
    # The prepare report of the run that made the data (an earlier run's when it was reused).
    reports = [
        _json(store, tree.run(n).report("prepare") + STEP_METADATA_FILE)
        for n in [run_num] + ([version] if isinstance(version, int) else [])
    ]
    splits = next((r["split_sizes"] for r in reports if r and "split_sizes" in r), None)
    comparison = inference.get("comparison")  # its `winner` as inference named it
    try:
        settings = store.get_bytes(run.settings).decode()
    except NotFound:
        settings = record.get("settings") or ""
    return {
        "sections": SECTIONS,
        "record": record,
        "title": f"{record.get('experiment_name')} run {run_label(run_num)}",
        "started": age(record.get("start_time")),
        "artifact_uri": store.uri_of(run.prefix),
        "snapshot": snapshot,
        "splits": splits,
        "data_steps": record.get("data_steps") or {},
        "models": models,
        "ranked": sorted(
            [m for m in models if m["performance"]], key=lambda m: -m["performance"]["macro_f1"]
        ),
        "comparison": comparison,
        "timings": [
            {
                "step": name,
                **{k: section.get(k) for k in TIMING_FIELDS},
            }
            for name, section in steps.items()
        ],
        "settings": settings,
        "metadata": json.dumps(record, indent=2),
    }


def _model_view(
    store: Store,
    run: RunTree,
    record: dict,
    name: str,
    trained: dict,
    results: str | None,
    tuned: bool,
    inference: dict,
) -> dict:
    """One model's part of the page: where it is, its curves, test results and tuning."""
    recorded = (record.get("model_artifacts") or {}).get(name)
    where = (recorded and artifact_key(store, recorded)) or run.model(name) + "model"
    where = where.rstrip("/") + "/"
    details = trained.get(name) or {}
    per_label = _csv(store, f"{results}{name}/{PER_LABEL_FILE}") if results else []
    confusion = _image(store, f"{results}{name}/confusion_matrix.png") if results else None
    return {
        "name": name,
        "where": store.uri_of(where),
        "details": details,
        "history": details.get("history") or _json(store, where + HISTORY) or [],
        "curves": _image(store, where + CURVES),
        "performance": (record.get("holdout_performance") or {}).get(name),
        "per_label": sorted(per_label, key=lambda r: -float(r["f1"])),
        "confusion": confusion,
        "tuning": _tuning(store, run, name, tuned),
        "trained_as": trained_as(details),
        # What the test ran in and why, and bf16's predictions against fp32's when it ran bf16.
        "tested_in": inference.get("mixed_precision"),
        "tested_in_because": inference.get("precision_reason"),
        "against_fp32": (inference.get("against_fp32") or {}).get(name),
    }


def trained_as(details: dict) -> str | None:
    """How a model trained, in a line: what of it (full or LoRA, with its settings), gradient
    checkpointing, the parameters trained, the processes, the peak memory and checkpoint size
    (steps/train.py's report; None for a report from before these were recorded)."""
    if "finetuning" not in details:
        return None
    lora = details.get("lora") or {}
    if details["finetuning"] == "lora" and "r" in lora:
        method = (
            f"LoRA (r {lora['r']}, alpha {lora['alpha']}, dropout {lora['dropout']:g}; adapters on "
            f"{', '.join(lora['target_modules'])}; in full: {', '.join(lora['modules_to_save'])})"
        )
    else:
        method = "LoRA (the adapters load_model made)" if lora else "every weight"
    said = [method + (", gradient checkpointing" if details.get("gradient_checkpointing") else "")]
    said.append(
        f"{details['trained_parameters']:,} of {details['parameters']:,} parameters trained"
    )
    processes = details.get("processes", 1)
    sharded = details.get("distributed_strategy") == "fsdp"
    strategy = " (FSDP, sharded)" if sharded else " (DDP)" if processes > 1 else ""
    said.append(f"{processes} process{'es' if processes > 1 else ''}{strategy}")
    peaks = [max(v for k, v in p.items() if k != "process") for p in details.get("peak_memory", [])]
    if peaks:
        said.append(f"peak memory {max(peaks) / 2**20:,.0f} MB a process")
    if details.get("checkpoint_bytes"):
        said.append(f"checkpoint {details['checkpoint_bytes'] / 2**20:,.1f} MB")
    return "; ".join(said)


def _reconciled_version(record: dict) -> list[int]:
    reconciled = (record.get("sources") or {}).get("reconciled")
    label = reconciled.rstrip("/").rsplit("/", 1)[-1] if reconciled else ""
    return [int(label)] if label.isdigit() else []


def _tuning(store: Store, run, model: str, tuned: bool) -> dict | None:
    """A tuned model's study, from its tuning record alone (one shape on every backend):
    the record, its trials, and its chart drawn from it."""
    if not tuned:
        return None
    record = _json(store, run.tuning_record(model)) or {}
    png = tuning_record.chart(record, f"tuning {model}")
    return {
        "record": record,
        "trials": record.get("trials") or [],
        "chart": "data:image/png;base64," + base64.b64encode(png).decode() if png else None,
    }


def experiment_context(store: Store, tree: ExperimentTree) -> dict:
    """What experiment.html shows: a row per run (the settings that differ between runs, each
    model's test metrics, the data) linked to its report, and each model's validation curves
    of every run overlaid."""
    rows = run_rows(store, tree)
    for row in rows:
        report = tree.run(row["run_num"]).report_html
        row["report"] = report.removeprefix(tree.root) if store.exists(report) else None
        row["started"] = age(row["started"])
    models = sorted({m for r in rows for m in [*r["macro_f1"], *r["validation"]]})
    return {
        "title": f"{tree.experiment}: every run",
        "uri": store.uri_of(tree.root),
        "rows": rows,
        "keys": list(dict.fromkeys(key for r in rows for key in r["settings"])),
        "models": models,
        "snapshots": len({r["snapshot"] for r in rows if r["macro_f1"]}),
        "charts": {m: chart for m in models if (chart := overlaid_curves(m, rows))},
    }


def overlaid_curves(model: str, rows: list[dict]) -> str | None:
    """`model`'s validation macro-F1 and loss by epoch, a line per run that trained it, as a
    PNG data: URI (None when no run did)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = [(r["run"], r["validation"][model]) for r in rows if r["validation"].get(model)]
    if not runs:
        return None
    figure, (f1, loss) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=90)
    for label, history in runs:
        epochs = [h["epoch"] for h in history]
        f1.plot(epochs, [h.get("f1") for h in history], marker="o", label=f"run {label}")
        loss.plot(epochs, [h.get("val_loss") for h in history], marker="o", label=f"run {label}")
    for axes, name in ((f1, "validation macro-F1"), (loss, "validation loss")):
        axes.set_xlabel("epoch")
        axes.set_title(name)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(alpha=0.3)
    f1.legend(fontsize=8)
    figure.tight_layout()
    png = io.BytesIO()
    figure.savefig(png, format="png")
    plt.close(figure)
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def render(values: dict, template: str = TEMPLATE) -> str:
    import jinja2

    # Records of older runs lack newer fields: a missing one renders empty.
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent),
        autoescape=True,
        undefined=jinja2.ChainableUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["cost"] = lambda recorded: cost.as_text(recorded or None)  # pipeline/cost.py
    env.filters["num"] = lambda x, digits=4: (
        "" if x is None or isinstance(x, jinja2.Undefined) else f"{float(x):.{digits}f}"
    )
    return env.get_template(template).render(**values)


def write_report(store: Store, tree: ExperimentTree, run_num: int) -> str:
    """Render run `run_num`'s report.html into its run tree; returns its key."""
    key = tree.run(run_num).report_html
    store.put_bytes(key, render(context(store, tree, run_num)).encode())
    return key


def write_experiment_page(store: Store, tree: ExperimentTree) -> str:
    """Render experiment.html beside the runs; returns its key."""
    key = tree.experiment_html
    store.put_bytes(key, render(experiment_context(store, tree), EXPERIMENT_TEMPLATE).encode())
    return key


def where_to_open(store: Store, key: str, beside: Sequence[str] = ()) -> str:
    """What a browser opens of the page at `key`: its file where the store is this machine's
    (a folder, or the emulated bucket over one); else a copy here of the one in S3, which no
    browser opens by its s3:// URI (the emulated backend's embedded S3 is gone once the
    driver ends), said with the original. The pages at `beside` (those it links to) are
    copied with it, at the same places relative to it. The copies are kept in the user's
    cache folder (smpipe/reports/<bucket>/<prefix>/<key>, each run's own), where the user
    opens them after the command; never in the system's temporary folder, where nothing
    would remove them."""
    from pipeline.player.environment import user_cache_folder

    here = store.folder_of(key) or store.uri_of(key)
    if "://" not in here:
        return here

    def copy_of(each: str) -> Path:  # bucket/prefix/key: another store's pages apart
        return user_cache_folder("reports", store.uri_of(each).split("://", 1)[-1])

    try:
        for each in (key, *beside):
            store.download_file(each, copy_of(each))
    except OSError as e:  # a cache folder that cannot be written (a read-only home): said
        return f"{here} (no copy here to open: {e})"
    return f"{copy_of(key)} (a copy of {here})"
