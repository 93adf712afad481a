"""The run's Metadata record.

Each step owns one section and writes it to its own object (`metadata/<step>.json`), so two
steps never overwrite each other; `merge` folds every section into one `metadata.json`.
A field that was not computed stays None: nothing here is ever filled with a guess.
"""

from __future__ import annotations

import calendar
import json
import platform
import subprocess
import time
from importlib import metadata as importlib_metadata
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from pipeline.cost import run_cost
from pipeline.paths import RunTree
from pipeline.store import NotFound, Store
from steps.runtime.secrets import redact

STEP_ORDER = ("reconcile", "prepare", "train", "tune", "inference", "register")
PACKAGES = (
    "torch",
    "transformers",
    "accelerate",
    "datasets",
    "scikit-learn",
    "boto3",
    "wandb",
)


def iso(ts: float | None) -> str | None:
    return None if ts is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def seconds(iso_time: str) -> float:
    """The epoch seconds an `iso` time names (to the second it was written with)."""
    return calendar.timegm(time.strptime(iso_time, "%Y-%m-%dT%H:%M:%SZ"))


class StepSection(BaseModel):
    """One step: its jobs, how they ended, what they cost and what the step reported."""

    model_config = ConfigDict(extra="forbid")

    step: str
    status: str = "pending"  # pending | running | completed | failed | reused
    job_names: list[str] = Field(default_factory=list)
    failure_reason: str | None = None
    start_time: str | None = None
    end_time: str | None = None
    time_taken: float | None = None  # seconds
    memory_usage: float | None = None  # peak resident MB of the job's processes
    gpu_usage: dict | None = None  # reported by the job when it ran on GPUs
    restarts: int = 0
    # What its jobs used, each as its backend reports it (JobResult.billing; pipeline/cost.py).
    billing: list[dict] = Field(default_factory=list)
    details: dict = Field(default_factory=dict)  # what the step script itself reported


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_id: str
    model_version: int  # = run_num
    experiment_name: str
    artifact_uri: str  # where the run was written; everything below names store keys
    backend: str
    status: str = "running"  # running | completed | failed | interrupted | abandoned
    failure_reason: str | None = None
    start_time: str | None = None
    end_time: str | None = None
    # Seconds its driver ran it, every part of a resumed run summed (a part whose driver died
    # unrecorded aside).
    time_taken: float | None = None
    memory_usage: float | None = None  # the largest peak of any job, MB
    raw_file_size: int | None = None
    raw_format: str | None = None
    raw_path: str | None = None
    data_version: int | None = None
    data_snapshot_hash: str | None = None
    # Keys relative to the store's root (URIs are derived), so a copied or synced store works.
    model_artifacts: dict[str, str] = Field(default_factory=dict)
    # model -> the data it was trained on: data_version, data_snapshot_hash, id2label.
    model_lineage: dict[str, dict] = Field(default_factory=dict)
    holdout_performance: dict[str, dict] = Field(default_factory=dict)
    git_sha: str | None = None
    package_versions: dict[str, str] = Field(default_factory=dict)
    python_version: str = Field(default_factory=platform.python_version)
    settings: str | None = None  # the ini as applied, secrets redacted
    planned_steps: list[str] = Field(default_factory=list)  # what the run set out to do
    sources: dict | None = None  # where its steps read from (driver.Sources.record)
    # reconcile/prepare: computed or reused, the key and what it hashes (pipeline/cache.py)
    data_steps: dict[str, dict] = Field(default_factory=dict)
    resumed_at: list[str] = Field(default_factory=list)  # each --resume of the run
    # What the jobs of steps a --resume ran again had used before (their sections are then
    # replaced): paid for all the same, so counted in `cost`.
    billing_before_resume: list[dict] = Field(default_factory=list)
    # Jobs stopped with the driver (Ctrl-C, SIGTERM) before their bill could be read: kind and
    # name each. SageMaker bills them all the same; a --resume reads it once they have ended.
    unbilled_jobs: list[dict] = Field(default_factory=list)
    # The bytes of checkpoints removed when the run completed (pipeline/prune.py); None while
    # they are kept: the run did not complete, KEEP_CHECKPOINTS_AFTER_RUN, or the store refused.
    checkpoints_removed_bytes: int | None = None
    # What a run that stopped left for --resume: each checkpoint folder (a model's, a trial's)
    # -> its files, counted when it stopped; a resume finding them gone says so and stops.
    checkpoints_left: dict[str, int] | None = None
    # The image every job of the run ran in (Backend.image_record): on the emulated backend's
    # image its name, id, digest and the sha256 of the lock it holds, resolved once before the
    # first job; on sagemaker the URI the requests name; None where jobs are processes here.
    image: dict | None = None
    # `smpipe prune`: when, and what of the run it removed (a prefix of the run -> bytes).
    pruned: dict | None = None
    # The prices the run applies (cost.price_basis: region, each instance type's price and
    # where it came from, the unpriced ones), and what it cost: per job and in all, in USD on
    # sagemaker and emulated, in CPU-seconds and peak memory locally (cost.run_cost).
    prices: dict | None = None
    cost: dict | None = None
    # [registry]: the version of the model package group the run's winner became (its group,
    # version, ARN on SageMaker, model, test metrics, approval), from the register step.
    registered: dict | None = None
    steps: dict[str, StepSection] = Field(default_factory=dict)
    _secrets: list[str] = PrivateAttr(default_factory=list)  # values masked when written

    def mask(self, secrets: list[str]) -> None:
        self._secrets = list(secrets)


def winner(record: dict) -> str | None:
    """The run's best model by test macro-F1, as its inference step named it (comparison.json's
    `winner`); the one model a single-model run tested; None when nothing was tested."""
    inference = (record.get("steps") or {}).get("inference") or {}
    comparison = (inference.get("details") or {}).get("comparison") or {}
    if comparison.get("winner"):
        return comparison["winner"]
    tested = record.get("holdout_performance") or {}
    return max(tested, key=lambda m: tested[m].get("macro_f1", -1)) if tested else None


def git_sha(directory: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            pass
    return versions


def write_section(store: Store, run: RunTree, section: StepSection) -> None:
    store.put_bytes(run.step_metadata(section.step), section.model_dump_json(indent=2).encode())


def read_sections(store: Store, run: RunTree) -> dict[str, StepSection]:
    sections = {}
    for step in STEP_ORDER:
        try:
            sections[step] = StepSection.model_validate_json(
                store.get_bytes(run.step_metadata(step))
            )
        except NotFound:
            continue
    return sections


def billing(base: Metadata, sections: dict[str, StepSection]) -> list[dict]:
    """Every billing record of the run, each once: a step run again by a --resume keeps its
    earlier section, whose records billing_before_resume holds too, until it writes its own."""
    records: list[dict] = []
    for record in [*base.billing_before_resume, *(b for s in sections.values() for b in s.billing)]:
        if record not in records:
            records.append(record)
    return records


def accounted_jobs(base: Metadata, sections: dict[str, StepSection]) -> set[str]:
    """The jobs the run holds a bill of: each named in a billing record (a trial's tuning job
    too). A job a section names without one (given up unreadable, say) is not: a --resume
    reads its bill."""
    named = {b.get(key) for b in billing(base, sections) for key in ("job", "tuning_job")}
    return named - {None}


def accounted_pools(base: Metadata, sections: dict[str, StepSection]) -> set[str]:
    """The training jobs whose warm pool's kept time the run holds a bill of."""
    return {b["job"] for b in billing(base, sections) if b.get("use") == "warm pool"}


def merge(store: Store, run: RunTree, base: Metadata) -> Metadata:
    """Fold every step's section into the run record and write metadata.json."""
    sections = read_sections(store, run)
    record = base.model_copy(update={"steps": sections})
    reconcile = sections.get("reconcile")
    if reconcile:
        d = reconcile.details
        record.raw_file_size = d.get("raw_file_size")
        record.raw_format = d.get("raw_format")
        record.raw_path = d.get("raw_path")
        record.data_snapshot_hash = d.get("snapshot_hash")
    for name in ("train", "tune"):
        if name in sections:
            details = sections[name].details
            record.model_artifacts.update(details.get("model_artifacts", {}))
            record.model_lineage.update(details.get("lineage", {}))
    if "inference" in sections:
        record.holdout_performance = sections["inference"].details.get("holdout_performance", {})
    if "register" in sections:
        record.registered = sections["register"].details.get("registered")
    peaks = [s.memory_usage for s in sections.values() if s.memory_usage is not None]
    record.memory_usage = max(peaks) if peaks else None
    record.cost = run_cost(billing(base, sections), base.prices, base.backend, base.unbilled_jobs)
    text = redact(json.dumps(record.model_dump(), indent=2), base._secrets)
    store.put_bytes(run.metadata, text.encode())
    return record
