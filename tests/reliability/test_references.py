"""What is still read is known before anything is removed, and changes to the registry are
never lost (issue 29, cases 2, 3, 4 and 10):

- `smpipe prune` keeps a model that a kept run tested (`--steps inference` on an older run's
  models), that a registered version points at (the local registry; a SageMaker model package
  on moto), or that a predict record names, and says why in the dry run and with --yes;
  `approve` refuses a version whose model is gone.
- 24 `approve`/`--reject` calls by 8 processes at once on one version all land in its history,
  on a local folder and on moto's S3.
- A stray file or a truncated record in the local registry is named and skipped by `registry`,
  `approve` and a run's register step.

Run trees and registry records are written by hand, small (tests/test_prune.py's runs)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import boto3

from pipeline import cli, registry
from pipeline import metadata as md
from pipeline.config import load_settings
from pipeline.paths import RunTree
from pipeline.predict.checks import choose_run
from pipeline.registry.records import local_versions, register_locally
from pipeline.sources import newest_models
from pipeline.stages import Register, RunContext
from pipeline.store import LocalStore, S3Store, is_complete
from tests.conftest import ROOT, write_settings
from tests.test_prune import KEPT, TREE, NoBackend, write_run
from tests.test_sagemaker_backend import IMAGE, ROLE

# -- what is still read is kept, and said ---------------------------------------------------------

GROUP = "news"
MODEL = "models/bow/model/"  # the folder of a model's weights, exports and manifest


def write_inference_run(store, run_num: int, models_of: RunTree) -> RunTree:
    """A completed `--steps inference` run: it tested `models_of`'s bow and trained nothing."""
    run = TREE.run(run_num)
    store.create(run.claim, b"{}")
    for rel in ("settings.ini", "inference/bow/overall.json", "report.html"):
        store.put_bytes(run.prefix + rel, bytes(KEPT[rel]))
    record = {"status": "completed", "model_version": run_num, "planned_steps": ["inference"]}
    sources = {"models": models_of.models, "data_version": 1, "raw": TREE.raw}
    record.update(
        sources=sources, model_artifacts={}, holdout_performance={"bow": {"macro_f1": 0.5}}
    )
    store.put_bytes(run.metadata, json.dumps(record).encode())
    return run


def weights(store, run: RunTree) -> set[str]:
    return {
        k
        for k in store.list_keys(run.prefix + MODEL)
        if k.endswith((".safetensors", ".pt", ".pt2"))
    }


def test_prune_keeps_the_model_a_kept_inference_run_tested(store_at, tmp_path, capsys):
    store, uri = store_at
    path = write_settings(tmp_path / "settings.ini", uri)
    trained = write_run(store, 1, "completed")
    write_inference_run(store, 2, trained)  # `smpipe run --steps inference`: run 1's models
    assert cli.main(["prune", str(path), "--keep", "1"]) == 0
    said = "kept models/bow/model/ (18.3 kB): run 0002 tested it (its inference read run 0001's"
    assert said in capsys.readouterr().out
    assert cli.main(["prune", str(path), "--keep", "1", "--yes"]) == 0
    out = capsys.readouterr().out
    assert said in out and "run 0001 (completed" in out
    assert len(weights(store, trained)) == 3 and is_complete(store, trained.final_model("bow"))
    assert not store.list_keys(trained.checkpoints_root)  # what nothing reads still goes
    pruned = json.loads(store.get_bytes(trained.metadata))["pruned"]
    assert MODEL not in pruned["removed"] and "run 0002 tested it" in pruned["kept"][MODEL][0]
    # A later `--steps inference` finds the model, and so does predict.
    assert newest_models(store, TREE, ["bow"])[0] == 1
    assert choose_run(store, TREE, None)[0] == 1


def write_prediction(store, run: RunTree, label: str, record: bytes | None) -> None:
    store.put_bytes(run.prediction(label).code + "steps/predict.py", b"#")
    if record is not None:
        store.put_bytes(run.prediction(label).record, record)


def test_prune_keeps_a_model_a_predict_record_names(tmp_path, capsys):
    store = LocalStore(tmp_path / "store")
    path = write_settings(tmp_path / "settings.ini", str(store.root))
    runs = [write_run(store, n, "completed") for n in (1, 2, 3, 4, 5)]
    named = json.dumps({"model": "bow", "model_artifact": runs[0].final_model("bow")})
    write_prediction(store, runs[0], "bow-20250101T000000Z-a1b2c3", named.encode())
    write_prediction(store, runs[1], "bow-20250102T000000Z-d4e5f6", None)  # running, or killed
    write_prediction(store, runs[2], "bow-20250103T000000Z-0a0b0c", b'{"model": "bo')
    failed = json.dumps({"model": "bow", "status": "failed", "reason": "the job failed"})
    write_prediction(store, runs[3], "bow-20250104T000000Z-9f8e7d", failed.encode())
    assert cli.main(["prune", str(path), "--keep", "1", "--yes"]) == 0
    out = capsys.readouterr().out
    for run in runs[:3]:
        assert len(weights(store, run)) == 3
    assert not weights(store, runs[3])  # its predict failed: it made nothing that needs it
    assert "the predict record predictions/bow-20250101T000000Z-a1b2c3/record.json names it" in out
    assert "predictions/bow-20250102T000000Z-d4e5f6/ has no record: a predict that may be" in out
    assert "record.json cannot be read, it may name it" in out


def register_version(store, settings, run: RunTree) -> dict:
    """Run `run`'s bow registered in the local registry, as its register step does."""
    entry = {
        "group": GROUP,
        "experiment": TREE.experiment,
        "run": run.label,
        "model": "bow",
        "test_metrics": {"macro_f1": 0.5},
        "data_version": 1,
        "data_snapshot_hash": None,
        "model_artifact": run.final_model("bow"),
        "token": f"run {run.label}",
    }
    return register_locally(store, TREE, entry, settings.registry.approval_status)


def test_prune_keeps_a_registered_model_and_approve_refuses_one_gone(store_at, tmp_path, capsys):
    store, uri = store_at
    path = write_settings(tmp_path / "settings.ini", uri, registry={"MODEL_PACKAGE_GROUP": GROUP})
    settings = load_settings(path, env={})
    runs = [write_run(store, n, "completed") for n in (1, 2, 3)]
    register_version(store, settings, runs[0])
    assert cli.main(["prune", str(path), "--keep", "1"]) == 0
    said = f"kept models/bow/model/ (18.3 kB): version 1 of model package group {GROUP!r} "
    assert said + "(PendingManualApproval) points at it" in capsys.readouterr().out
    assert cli.main(["prune", str(path), "--keep", "1", "--yes"]) == 0
    assert said in capsys.readouterr().out
    assert len(weights(store, runs[0])) == 3 and not weights(store, runs[1])
    assert cli.main(["approve", str(path), "1"]) == 0
    assert "is Approved" in capsys.readouterr().out

    # A version whose model went otherwise (by hand) is not approved; it can be rejected.
    register_version(store, settings, runs[1])
    assert cli.main(["approve", str(path), "2"]) == 2
    err = capsys.readouterr().err
    assert "version 2 of 'news' has no model that can be served (" in err
    assert "is no longer complete)" in err  # pruned whole: its manifest too
    assert cli.main(["approve", str(path), "2", "--reject"]) == 0


def test_prune_keeps_what_a_sagemaker_model_package_points_at(bucket, tmp_path, capsys):
    uri = f"s3://{bucket}/root"
    store = S3Store(uri)
    experiment = {"BACKEND": "sagemaker", "ROLE_ARN": ROLE, "IMAGE_URI": IMAGE}
    path = write_settings(
        tmp_path / "settings.ini",
        uri,
        experiment=experiment,
        registry={"MODEL_PACKAGE_GROUP": GROUP},
    )
    runs = [write_run(store, n, "completed") for n in (1, 2, 3)]
    archive = runs[0].training_output + "test-exp-tune-bow-001/output/model.tar.gz"
    client = boto3.client("sagemaker", region_name="us-east-1")
    client.create_model_package_group(ModelPackageGroupName=GROUP)
    client.create_model_package(
        ModelPackageGroupName=GROUP,
        InferenceSpecification={
            "Containers": [{"Image": IMAGE, "ModelDataUrl": store.uri_of(archive)}],
            "SupportedContentTypes": ["application/json"],
            "SupportedResponseMIMETypes": ["application/json"],
        },
        # The model folder the version was registered from, as register_package says it.
        CustomerMetadataProperties={"smpipe:model-artifact": runs[0].final_model("bow")},
    )
    assert cli.main(["prune", str(path), "--keep", "1", "--yes"]) == 0
    out = capsys.readouterr().out
    assert f"kept jobs/training/ (2.0 kB): version 1 of model package group {GROUP!r}" in out
    assert f"kept models/bow/model/ (18.3 kB): version 1 of model package group {GROUP!r}" in out
    assert store.exists(archive) and len(weights(store, runs[0])) == 3
    assert not store.list_keys(runs[1].training_output) and not weights(store, runs[1])

    store.delete(archive)  # gone otherwise: approving it is refused
    assert cli.main(["approve", str(path), "1"]) == 2
    err = capsys.readouterr().err
    assert "has no model that can be served (" in err and f"{store.uri_of(archive)} is gone" in err


# -- the local registry under hostile use: changes at once, stray and broken files ----------------


# One process of `smpipe approve`s: it says it is ready, waits for the gate (so that all start
# at once), then makes its calls in turn; a call that fails ends it with that call's status.
APPROVING = """
import sys, time
from pathlib import Path
from pipeline import cli
settings, ready, gate, *calls = sys.argv[1:]
Path(ready).touch()
deadline = time.monotonic() + 120
while not Path(gate).exists():
    if time.monotonic() > deadline:
        sys.exit("the gate never opened")
    time.sleep(0.002)
for call in calls:
    code = cli.main(["approve", settings, "1", *(["--reject"] if call == "reject" else [])])
    if code:
        sys.exit(code)
"""


def test_approvals_made_at_once_are_all_kept(store_at, tmp_path):
    """Eight processes approve and reject one version at once: every change is recorded, none
    lost to another's write."""
    store, uri = store_at
    path = write_settings(tmp_path / "settings.ini", uri, registry={"MODEL_PACKAGE_GROUP": GROUP})
    register_version(store, load_settings(path, env={}), write_run(store, 1, "completed"))
    gate = tmp_path / "gate"
    calls = [["approve", "reject", "approve"], ["reject", "approve", "reject"]] * 4  # 12 and 12
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", APPROVING, str(path), str(tmp_path / f"ready-{i}"), str(gate)]
            + each,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, each in enumerate(calls)
    ]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready-*"))) < len(calls) and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.touch()  # 8 processes, 3 calls each, all at once
    ended = [p.communicate(timeout=300) for p in processes]
    assert [p.returncode for p in processes] == [0] * 8, [err for _, err in ended]
    [version] = local_versions(store, TREE, GROUP)
    history = [h["approval_status"] for h in version["history"]]
    # Every call that changed the status is kept: 24 calls, each said as a change or as the
    # status the version had already (which writes nothing), and no change lost.
    said = "".join(out for out, _ in ended)
    changed, already = said.count("is Approved") + said.count("is Rejected"), said.count("already")
    assert changed + already == 24 and len(history) == 1 + changed, said
    assert history[0] == registry.PENDING and version["approval_status"] == history[-1]
    assert changed >= 2 and registry.APPROVED in history and registry.REJECTED in history


def test_stray_and_broken_registry_files_are_named_and_skipped(tmp_path, capsys, caplog):
    store = LocalStore(tmp_path / "store")
    path = write_settings(
        tmp_path / "settings.ini", str(store.root), registry={"MODEL_PACKAGE_GROUP": GROUP}
    )
    settings = load_settings(path, env={})
    runs = [write_run(store, n, "completed") for n in (1, 2)]
    register_version(store, settings, runs[0])
    store.put_bytes(TREE.registry(GROUP) + "NOTES.txt", b"version 1 is the good one\n")
    store.put_bytes(TREE.registry_version(GROUP, 2), b'{"version": 2, "approval_st')  # by hand
    assert cli.main(["registry", str(path)]) == 0
    assert "test-exp run 0001: bow" in capsys.readouterr().out
    folder = store.uri_of(TREE.registry(GROUP))
    assert f"registry: skipped {folder}/NOTES.txt: not a version" in caplog.text
    assert f"registry: skipped {folder}/0002.json: not JSON (Unterminated string" in caplog.text
    assert cli.main(["approve", str(path), "1"]) == 0
    store.put_bytes(TREE.registry_change(GROUP, 1, 5), b'["Approved"]')  # a change, broken
    assert cli.main(["approve", str(path), "1", "--reject"]) == 0
    [version] = local_versions(store, TREE, GROUP)
    assert version["approval_status"] == registry.REJECTED and len(version["history"]) == 3
    change = store.uri_of(TREE.registry_change(GROUP, 1, 5))
    assert f"registry: skipped {change}: not an approval change" in caplog.text

    # A run's register step: it completes, as the next version past the one the broken file took.
    inference = md.StepSection(
        step="inference",
        status="completed",
        details={
            "models_from": runs[1].models,
            "comparison": {"winner": "bow"},
            "holdout_performance": {"bow": {"accuracy": 0.6, "macro_f1": 0.5, "weighted_f1": 0.5}},
        },
    )
    md.write_section(store, runs[1], inference)
    base = md.Metadata(
        run_id="test-exp/0002",
        model_version=2,
        experiment_name="test-exp",
        artifact_uri=store.uri_of(runs[1].prefix),
        backend="local",
    )
    Register().run(RunContext(settings, store, runs[1], None, base, NoBackend()), [])
    section = md.read_sections(store, runs[1])["register"]
    assert section.status == "completed" and section.details["registered"]["version"] == 3
