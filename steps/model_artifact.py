"""The tested models, logged to wandb as `model` artifacts of the runs that trained them.

Test metrics exist only once inference has run, so the inference job logs each model
(`log_models`) when [tracking] WANDB_MODE is online or offline: it resumes the training job's
wandb run and logs one `model` artifact per model, its files as references to the store
(`artifact`), the winner aliased `winner`. docs/outputs.md (wandb) says what a user sees.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from steps.model_files import RECORD, read_record
from steps.runtime import names
from steps.runtime.environment import ml_root
from steps.runtime.step import own_logs

# The store's manifest of a folder (pipeline/store/manifests.py MANIFEST): the store's, not
# the model's.
STORE_MANIFEST = "_MANIFEST.json"


def input_uri(name: str) -> str:
    """Where a processing input was read from: its S3Uri in the job's own config,
    /opt/ml/config/processingjobconfig.json (build-your-own-processing-container.html);
    a local store's folder on the local backend, written as a file:// URI."""
    config = json.loads(names.host_path(ml_root(), names.PROCESSING_CONFIG_FILE).read_text())
    for item in config.get("ProcessingInputs", []):
        if item["InputName"] == name:
            uri = item["S3Input"]["S3Uri"].rstrip("/")
            return uri if "://" in uri else f"file://{uri}"
    raise RuntimeError(f"processingjobconfig.json names no input {name!r}")


def log_models(
    models: dict[str, Path], performance: dict, winner: str | None, mode: str, project: str, where
) -> dict[str, dict]:
    """Each of `models` (name -> its folder, as inference read it) logged with its test
    `performance`, the wandb runs written under `where`; what was logged, for Metadata.

    Each resumes the wandb run of the training job that made the model (its id is in the
    model's record, steps/tracking.py: `wandb.init(id=..., resume="allow")`, W&B's way to add
    to a run that has ended), logs one version of a `model` artifact named after the model
    (`wandb.Artifact(type="model")`, `run.log_artifact`), and puts the test metrics and the
    artifact's name in the run's summary. Offline, the run is written under `where`
    (jobs/inference/wandb/) for a later `wandb sync`; a model trained with wandb off gets a run
    of its own."""
    if mode == "disabled":
        return {}
    import wandb

    # The settings' mode wins over the environment, as in training (steps/train.py).
    os.environ["WANDB_MODE"] = mode
    os.environ.setdefault("WANDB_SILENT", "true")
    stored, logged = input_uri("models"), {}
    for name, directory in models.items():
        record = read_record(directory)
        trained = record.get("wandb_run") or {}
        run = wandb.init(
            project=trained.get("project") or project,
            id=trained.get("id"),
            resume="allow" if trained.get("id") else None,
            name=None if trained.get("id") else f"{name} (tested)",
            dir=str(where),
        )
        aliases = ["latest", *(["winner"] if name == winner else [])]
        run.log_artifact(
            artifact(wandb, name, directory, record, performance[name], stored), aliases=aliases
        )
        run.summary.update(
            {
                "model_artifact": f"{name}:latest",
                **{f"test/{k}": v for k, v in performance[name].items()},
            }
        )
        run.finish()
        print(f"{name}: logged to wandb as model artifact {name} of run {run.id} ({mode})")
        logged[name] = {"artifact": name, "aliases": aliases, "run": run.id, "project": run.project}
    own_logs(Path(where))  # its runs ended: links out of the report become copies
    return logged


def artifact(wandb, name: str, directory: Path, record: dict, test: dict, stored: str):
    """The `model` artifact of one model: its files as references to `stored`/<name>/model/
    (W&B's reference artifacts: a URI per file, nothing copied), with the sha256 the store's
    manifest of the folder gives each. A copy would double the run tree, and an offline run
    syncs from anywhere, where a copied file would be looked for inside the job's finished
    container. Its metadata: the test metrics, the formats kept, id2label, the lineage record
    (the model's smpipe.json) and each file's sha256. wandb does not checksum the
    references itself (checksum=False): that would read the store from the job, which only the
    backend does (the emulated store is a folder the emulator reads on a job's behalf)."""
    exports = record.get("exports") or {}
    manifest = directory / STORE_MANIFEST
    hashes = json.loads(manifest.read_text())["files"] if manifest.exists() else {}
    files = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    files = [f for f in files if f != STORE_MANIFEST]
    logged = wandb.Artifact(
        name=name,
        type="model",
        description=f"{name}, test macro-F1 {test.get('macro_f1', 0):.4f}",
        metadata={
            "test": test,
            "formats": ["safetensors", *(f for f, check in exports.items() if check.get("passed"))],
            "id2label": record.get("id2label"),
            "lineage": {k: v for k, v in record.items() if k != "wandb_run"},
            "lineage_file": RECORD,
            "sha256": {f: hashes[f]["sha256"] for f in files if f in hashes},
        },
    )
    for rel in files:
        logged.add_reference(f"{stored}/{name}/model/{rel}", name=rel, checksum=False)
    return logged
