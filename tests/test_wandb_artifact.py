"""With wandb on, every tested model is logged as a `model` artifact of the wandb run that trained
it: its files (the formats kept, id2label, the lineage record smpipe.json) as references to
where the store keeps them, its test metrics in the artifact's metadata and the run's summary.
Offline, the run's wandb folder holds it for a later `wandb sync`, and no secret."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

from pipeline.driver import parse_steps, run_pipeline
from pipeline.paths import ExperimentTree
from pipeline.store import LocalStore, file_sha256
from tests.reliability.test_secrets import SECRETS, files_holding
from tests.test_registry import reviews_settings


def wandb_records(path: Path):
    """The records of a run's .wandb file: LevelDB's log format (32 KiB blocks, each record
    a 7-byte header: CRC, length, type FULL/FIRST/MIDDLE/LAST) after wandb's 7-byte file header
    (":W&B", magic, version), each record one wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    data, position, block, pending = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B", path
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def test_an_offline_run_logs_each_tested_model_as_an_artifact_of_its_training_run(
    tmp_path, monkeypatch
):
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("WANDB_MODE", "offline")  # never reach wandb's servers from a test
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))  # the user's, here
    monkeypatch.delenv("WANDB_CACHE_DIR", raising=False)
    _, settings = reviews_settings(
        tmp_path, str(tmp_path / "store"),
        tracking={"WANDB_MODE": "offline", "SECRET_VARIABLES": "MY_DB_PASSWORD"},
        registry={"MODEL_PACKAGE_GROUP": ""},
    )  # fmt: skip
    store = LocalStore(settings.store_uri())
    record = run_pipeline(settings, store, parse_steps(None), echo=sys.stdout)
    assert record["status"] == "completed" and "register" not in record["steps"]
    run1 = ExperimentTree(settings.experiment.name).run(1)
    model = Path(store.uri_of(run1.final_model("tiny")))
    trained = json.loads((model / "smpipe.json").read_text())["wandb_run"]

    [logged] = Path(store.uri_of(run1.report("inference"))).glob("wandb/offline-run-*/*.wandb")
    records = list(wandb_records(logged))
    [run] = [r.run for r in records if r.HasField("run")]
    assert run.run_id == trained["id"] and run.project == trained["project"]
    said = record["steps"]["inference"]["details"]["wandb_artifacts"]["tiny"]
    assert said == {"artifact": "tiny", "aliases": ["latest", "winner"], "run": trained["id"],
                    "project": trained["project"]}  # fmt: skip
    [artifact] = [r.artifact for r in records if r.HasField("artifact")]
    assert artifact.type == "model" and artifact.name == "tiny" and "winner" in artifact.aliases
    files = {c.path: c.ref for c in artifact.manifest.contents}
    assert {"model.safetensors", "model.torchscript.pt", "id2label.json", "smpipe.json"} <= set(
        files
    )
    assert files["model.safetensors"] == f"file://{model}/model.safetensors"
    assert "_MANIFEST.json" not in files
    metadata = json.loads(artifact.metadata)
    assert metadata["test"] == record["holdout_performance"]["tiny"]
    assert metadata["formats"] == ["safetensors", "torchscript"]
    assert metadata["id2label"] == json.loads((model / "id2label.json").read_text())
    assert metadata["lineage"]["max_length"] == 12 and metadata["lineage_file"] == "smpipe.json"
    assert metadata["sha256"]["model.safetensors"] == file_sha256(model / "model.safetensors")
    summary = {u.key: json.loads(u.value_json) for r in records if r.HasField("summary")
               for u in r.summary.update}  # fmt: skip
    assert summary["model_artifact"] == "tiny:latest"
    assert summary["test/macro_f1"] == record["holdout_performance"]["tiny"]["macro_f1"]
    # No secret anywhere the run wrote: the wandb runs of training and inference included.
    assert files_holding(Path(store.uri_of(run1.prefix)), SECRETS.values()) == []
    # wandb-core's debug log is the run's (a copy in each job's wandb run), never left in the
    # user's cache folder: each local job added one to ~/.cache/wandb/logs, never removed.
    [core_log, *_] = Path(store.uri_of(run1.prefix)).rglob("offline-run-*/logs/debug-core.log")
    assert not core_log.is_symlink() and "starting server" in core_log.read_text()
    assert not list((tmp_path / "user-cache").rglob("core-debug-*.log"))


def test_links_out_of_a_jobs_output_become_copies_of_what_they_held(tmp_path):
    """wandb links its service's debug log into the run's folder from a file of the user's
    cache named by the second: two jobs started in one second share it, and one job's output
    would be sealed while the other still writes it. The output keeps a copy; a link inside
    the folder stays a link, one that leads nowhere goes."""
    from steps.runtime.step import own_logs

    shared = tmp_path / "cache/core-debug-20261129-010203.log"
    shared.parent.mkdir()
    shared.write_text("this job's lines\n")
    logs = tmp_path / "output/wandb/offline-run-1/logs"
    logs.mkdir(parents=True)
    (logs / "debug-core.log").symlink_to(shared)
    (logs / "debug.log").write_text("own\n")
    (logs / "latest.log").symlink_to(logs / "debug.log")
    (logs / "gone.log").symlink_to(tmp_path / "nowhere.log")
    own_logs(tmp_path / "output")
    shared.write_text("this job's lines\nthe other job's\n")  # written on after the seal
    assert not (logs / "debug-core.log").is_symlink()
    assert (logs / "debug-core.log").read_text() == "this job's lines\n"
    assert (logs / "latest.log").is_symlink() and not (logs / "gone.log").exists()
    assert not (logs / "gone.log").is_symlink()
