"""[registry]: each completed run registers its winning model once, as a SageMaker model package
on the emulated backend (a resumed run included) and as a local record otherwise; `smpipe
registry` lists the versions and `smpipe approve` sets their status. A small task (the reviews
of tests/test_user_functions.py, a tiny model that trains in a second) keeps the runs short."""

from __future__ import annotations

import json
import logging
import sys
import typing
import uuid
from datetime import datetime

import boto3
import pytest

from pipeline import cli, registry
from pipeline.backends.choose import make_backend
from pipeline.config import ConfigError, Registry, load_settings
from pipeline.driver import parse_steps, run_pipeline
from pipeline.paths import ExperimentTree
from pipeline.registry.records import local_versions, register_locally
from pipeline.service_model import shape
from pipeline.store import MANIFEST, LocalStore, S3Store, artifact_key
from tests.conftest import write_settings
from tests.test_user_functions import REVIEWS, write_module, write_reviews


def reviews_settings(tmp_path, store: str, models="tiny", **overrides):
    """A settings file of the reviews task whose runs register in a group of their own."""
    write_module(tmp_path, "reviews_registry", REVIEWS)
    if not (tmp_path / "raw").exists():
        write_reviews(tmp_path / "raw")
    experiment = {"USER_FUNCTIONS": "reviews_registry", "NAME": f"reg-{uuid.uuid4().hex[:6]}"}
    sections = {
        "data": {"RAW_DATA": str(tmp_path / "raw"), "MAX_SEQUENCE_LENGTH": "12"},
        "models": {"MODEL_NAMES": models},
        "training": {"EPOCHS": "1", "LEARNING_RATE": "0.05"},
        "registry": {"MODEL_PACKAGE_GROUP": f"reviews-{uuid.uuid4().hex[:6]}"},
    }
    experiment |= overrides.pop("experiment", {})
    for section, values in overrides.items():
        sections[section] = sections.get(section, {}) | values
    path = write_settings(tmp_path / "settings.ini", store, experiment=experiment, **sections)
    return path, load_settings(path, env={})


def test_the_approval_statuses_are_sagemakers():
    allowed = set(typing.get_args(Registry.model_fields["approval_status"].annotation))
    assert allowed == set(shape("ModelApprovalStatus").enum)


def test_bad_registry_settings_are_named_before_anything_runs(tmp_path):
    path, _ = reviews_settings(tmp_path, str(tmp_path / "store"))
    for env, said in [
        ({"SMPIPE__REGISTRY__MODEL_PACKAGE_GROUP": "my_models"}, "[registry] MODEL_PACKAGE_GROUP: "
         "'my_models' must satisfy regular expression pattern"),
        ({"SMPIPE__REGISTRY__MODEL_PACKAGE_GROUP": "m" * 64}, "[registry] MODEL_PACKAGE_GROUP: "
         f"'{'m' * 64}' must have at most 63 characters"),
        ({"SMPIPE__REGISTRY__APPROVAL_STATUS": "Approve"}, "[registry] APPROVAL_STATUS: must be "
         "'PendingManualApproval', 'Approved' or 'Rejected' (got 'Approve')"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError) as info:
            load_settings(path, env=env)
        assert said in str(info.value)
    assert not (tmp_path / "store").exists()


def test_the_registry_commands_name_the_key_when_no_group_is_set(tmp_path, capsys):
    path, _ = reviews_settings(
        tmp_path, str(tmp_path / "store"), registry={"MODEL_PACKAGE_GROUP": ""}
    )
    assert cli.main(["registry", str(path)]) == 2
    assert "[registry] MODEL_PACKAGE_GROUP is empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["approve", str(path), "0"])
    assert "'0' is not a version" in capsys.readouterr().err


def test_the_plan_says_what_is_registered(tmp_path, caplog):
    _, settings = reviews_settings(tmp_path, str(tmp_path / "store"))
    store, group = LocalStore(settings.store_uri()), settings.registry.model_package_group
    caplog.set_level(logging.INFO, logger="smpipe")
    run_pipeline(settings, store, parse_steps(None), dry_run=True)
    assert f"  5. register: the winner by test macro-F1 becomes a new version of model package " \
           f"group {group!r}, PendingManualApproval: a record in {store.uri}/" in caplog.text  # fmt: skip
    caplog.clear()
    run_pipeline(settings, store, parse_steps("reconcile,prepare"), dry_run=True)
    assert "plan for experiment" in caplog.text and "register" not in caplog.text


def group_packages(group: str) -> list[dict]:
    client = boto3.client("sagemaker", region_name="us-east-1")
    listed = client.list_model_packages(ModelPackageGroupName=group)["ModelPackageSummaryList"]
    return [client.describe_model_package(ModelPackageName=p["ModelPackageArn"]) for p in listed]


def losing_the_first_answer(settings, store, run, echo):
    """The emulated backend, whose first CreateModelPackage reaches SageMaker but whose answer
    never comes back (a dropped connection): the package exists, and the driver does not know."""
    backend = make_backend(settings, store, run, echo)
    lost = []

    def lose(**_):
        if not lost:
            lost.append(True)
            raise ConnectionError("the connection dropped before CreateModelPackage's answer")

    backend.client.meta.events.register("after-call.sagemaker.CreateModelPackage", lose)
    return backend


@pytest.mark.slow
def test_an_emulated_run_registers_its_winner_once_even_resumed(tmp_path, bucket):
    _, settings = reviews_settings(
        tmp_path, f"s3://{bucket}/root", experiment={"BACKEND": "emulated"}
    )
    store, group = S3Store(f"s3://{bucket}/root"), settings.registry.model_package_group
    run1 = ExperimentTree(settings.experiment.name).run(1)
    with pytest.raises(ConnectionError):
        run_pipeline(
            settings,
            store,
            parse_steps(None),
            echo=sys.stdout,
            make_backend=losing_the_first_answer,
        )
    failed = json.loads(store.get_bytes(run1.metadata))
    assert failed["status"] == "failed" and failed["steps"]["register"]["status"] == "failed"
    assert failed["registered"] is None and len(group_packages(group)) == 1  # made, unanswered

    # Resumed, the run sends the same request with the same ClientToken: SageMaker answers with
    # the package the first one made, and nothing else is created.
    record = run_pipeline(settings, store, parse_steps(None), echo=sys.stdout, resume=1)
    assert record["status"] == "completed" and record["planned_steps"][-1] == "register"
    [package] = group_packages(group)
    registered = record["registered"]
    assert registered["arn"] == package["ModelPackageArn"] and registered["version"] == 1
    assert registered["model"] == "tiny" and registered["run"] == "0001"
    assert package["ModelApprovalStatus"] == "PendingManualApproval"
    assert "run 0001: tiny, test macro-F1" in package["ModelPackageDescription"]
    # The model as its training job left it, and its test metrics as ModelMetrics.
    job = record["steps"]["train"]["job_names"][0]
    trained = boto3.client("sagemaker", region_name="us-east-1").describe_training_job(
        TrainingJobName=job
    )
    [container] = package["InferenceSpecification"]["Containers"]
    assert container["ModelDataUrl"] == trained["ModelArtifacts"]["S3ModelArtifacts"]
    statistics = package["ModelMetrics"]["ModelQuality"]["Statistics"]
    assert statistics["S3Uri"] == store.uri_of(run1.model_quality("tiny"))
    quality = json.loads(store.get_bytes(run1.model_quality("tiny")))[
        "multiclass_classification_metrics"
    ]
    assert quality["macro_f1"]["value"] == record["holdout_performance"]["tiny"]["macro_f1"]

    # The next completed run is the next version; listed and approved through SageMaker's API.
    second = run_pipeline(settings, store, parse_steps("inference"), echo=sys.stdout)
    assert second["registered"]["version"] == 2 and len(group_packages(group)) == 2
    client = boto3.client("sagemaker", region_name="us-east-1")
    rows = registry.versions(settings, store, client)
    assert [(r["version"], r["approval_status"]) for r in rows] == [
        (1, "PendingManualApproval"), (2, "PendingManualApproval")]  # fmt: skip
    assert "run 0002: tiny" in rows[1]["description"]
    registry.set_status(settings, store, 2, registry.APPROVED, client)
    assert [p["ModelApprovalStatus"] for p in group_packages(group)] == [
        "PendingManualApproval",
        "Approved",
    ]


def test_a_model_whose_weights_were_removed_by_hand_is_no_model_to_approve(tmp_path):
    """Its manifest left, the weights gone: approved, since only the manifest was looked for."""
    from pipeline.registry.records import LocalRegistry
    from pipeline.store import upload_dir

    store, tree = LocalStore(tmp_path / "store"), ExperimentTree("test-exp")
    (tmp_path / "model").mkdir()
    for name in ("model.safetensors", "id2label.json"):
        (tmp_path / "model" / name).write_text(name)
    model = tree.run(1).final_model("tiny")
    upload_dir(store, tmp_path / "model", model)
    registry = LocalRegistry(store, tree, "group", "PendingManualApproval")
    row = {"model_artifact": store.uri_of(model)}
    assert registry.missing_model(row) is None
    store.delete(model + "model.safetensors")
    assert registry.missing_model(row) == f"{store.uri_of(model)} lost model.safetensors"


def test_the_local_registry_lists_and_approves(tmp_path, capsys):
    path, settings = reviews_settings(tmp_path, str(tmp_path / "store"), models="tiny, small")
    store, group = LocalStore(settings.store_uri()), settings.registry.model_package_group
    tree = ExperimentTree(settings.experiment.name)
    record = run_pipeline(settings, store, parse_steps(None), echo=sys.stdout)
    winner = record["steps"]["inference"]["details"]["comparison"]["winner"]
    registered = record["registered"]
    assert registered["version"] == 1 and registered["model"] == winner
    assert (
        registered["test_metrics"]["macro_f1"] == record["holdout_performance"][winner]["macro_f1"]
    )
    assert registered["data_snapshot_hash"] == record["data_snapshot_hash"]
    assert json.loads(store.get_bytes(tree.registry_version(group, 1))) == registered

    capsys.readouterr()
    assert cli.main(["registry", str(path)]) == 0
    listed = capsys.readouterr().out
    assert "PendingManualApproval" in listed and f"run 0001: {winner}, test macro-F1" in listed
    assert cli.main(["approve", str(path), "1"]) == 0
    assert "is Approved" in capsys.readouterr().out
    assert cli.main(["approve", str(path), "1", "--reject"]) == 0
    capsys.readouterr()
    # Rejecting it again changes nothing, says so, and writes no record.
    assert cli.main(["approve", str(path), "1", "--reject"]) == 0
    assert f"version 1 of model package group {group!r} is already Rejected" in (
        capsys.readouterr().out
    )
    [kept] = local_versions(store, tree, group)
    assert kept["approval_status"] == "Rejected"
    assert [h["approval_status"] for h in kept["history"]] == [
        "PendingManualApproval",
        "Approved",
        "Rejected",
    ]
    assert cli.main(["approve", str(path), "7"]) == 2
    assert (
        f"no version 7 in model package group {group!r} (versions 1-1)" in capsys.readouterr().err
    )
    # Its model pruned away (its manifest gone with it): approving it is refused, naming where.
    model = artifact_key(store, registered["model_artifact"])
    store.delete(model + MANIFEST)
    assert cli.main(["approve", str(path), "1"]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert f"has no model that can be served ({store.uri_of(model)} is no longer complete)" in said

    # The same run and model again (a driver that died before Metadata said so): the record it
    # made. Another registration takes the next version, past one another driver just took.
    entry = {
        k: v
        for k, v in registered.items()
        if k not in ("version", "approval_status", "registered_at", "history")
    }
    status = settings.registry.approval_status
    assert register_locally(store, tree, entry, status)["version"] == 1
    racing = Racing(settings.store_uri(), tree.registry_version(group, 2))
    other = register_locally(racing, tree, {**entry, "token": "another run"}, status)
    assert other["version"] == 3 and store.exists(tree.registry_version(group, 3))
    assert not store.exists(tree.registry_version(group, 4))
    assert json.loads(store.get_bytes(tree.registry_version(group, 2)))["token"] == "another driver"


class Racing(LocalStore):
    """A store where another driver takes version `key` between this one's look and its write."""

    def __init__(self, root, key: str):
        super().__init__(root)
        self.key = key

    def create(self, key: str, data: bytes) -> bool:
        if key == self.key and not self.exists(key):
            super().create(key, json.dumps({"version": 2, "token": "another driver"}).encode())
        return super().create(key, data)


def test_an_emulated_accounts_registry_outlives_each_command(tmp_path, aws_env):
    """An emulated account lasts one command (its moto ends with it); with a local STORE its
    model registry does not: what a run registered, `smpipe registry` in a later process
    lists, with its first CreationTime, and `smpipe approve` approves, kept for the next. A
    command keeps only what it changed: a run that registers while another approves loses
    neither."""
    from pipeline.backends.emulated import open_emulated_store
    from pipeline.backends.emulated.account import KEEPER, REGISTRY, moto_records
    from tests.test_init import smpipe

    path, settings = reviews_settings(
        tmp_path, str(tmp_path / "store"), experiment={"BACKEND": "emulated"}
    )
    store = open_emulated_store(settings)  # this process's moto: a driver's account
    client = boto3.client("sagemaker", region_name="us-east-1")
    group = settings.registry.model_package_group

    def register(run: str, token: str) -> str:
        return client.create_model_package(
            ModelPackageGroupName=group,
            ModelPackageDescription=f"run {run}: tiny, test macro-F1 0.9",
            InferenceSpecification={
                "Containers": [{"Image": "smpipe:emulated", "ModelDataUrl": "s3://b/m.tar.gz"}]
            },
            ModelApprovalStatus="PendingManualApproval",
            ClientToken=token,
        )["ModelPackageArn"]

    client.create_model_package_group(ModelPackageGroupName=group)
    first = register("0001", "registered-once")
    version = f"{REGISTRY}{group}/0001.json"
    assert store.exists(f"{REGISTRY}{group}/group.json") and store.exists(version)
    # Registered long ago, as a later command must still say (moto keeps UTC, with no zone).
    moto_records("us-east-1").model_packages[first].creation_time = datetime(2026, 1, 2, 3, 4)
    [keeper] = KEEPER  # this command's, which wrote version 1
    keeper.keep()

    listed = smpipe("registry", str(path), cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "PendingManualApproval" in listed.stdout and "run 0001: tiny" in listed.stdout
    assert "2026-01-02 03:04" in listed.stdout
    approved = smpipe("approve", str(path), "1", cwd=tmp_path)
    assert approved.returncode == 0, approved.stderr
    assert f"version 1 of model package group {group!r} is Approved" in approved.stdout
    # Meanwhile this process (a run) registers version 2: it keeps that, not its own view of 1.
    register("0002", "registered-later")
    again = smpipe("registry", str(path), cwd=tmp_path)
    rows = [line for line in again.stdout.splitlines() if "run 000" in line]
    assert len(rows) == 2, again.stdout + again.stderr
    assert "Approved" in rows[0] and "PendingManualApproval" in rows[1], again.stdout
    kept = json.loads(store.get_bytes(version))
    assert kept["client_token"] == "registered-once"
    assert kept["request"]["ModelApprovalStatus"] == "Approved"
    # A stray file in the registry's folder is named and skipped.
    store.put_bytes(f"{REGISTRY}{group}/0003.json", b"{not json")
    listed = smpipe("registry", str(path), cwd=tmp_path)
    assert listed.returncode == 0 and "0003.json: not a record of the registry" in listed.stderr
    # A version whose record is broken stands in as a Rejected version that says so: the
    # versions after it keep their numbers, and the record is left as it is.
    store.put_bytes(version, b'{"request": ')
    listed = smpipe("registry", str(path), cwd=tmp_path)
    rows = " ".join(listed.stdout.split())
    assert "0001.json: not a record of the registry" in listed.stderr
    assert "│ 1 │ Rejected" in rows and "could not be read" in rows
    assert "│ 2 │ PendingManualApproval" in rows and "run 0002: tiny" in rows
    assert store.get_bytes(version) == b'{"request": '
    # The stand-in names no model: it is never approved.
    refused = smpipe("approve", str(path), "1", cwd=tmp_path)
    said = " ".join(refused.stderr.split())
    assert refused.returncode == 2 and "has no model that can be served" in said
    assert "it names no model (no ModelDataUrl): its record" in said
    assert store.get_bytes(version) == b'{"request": '
    local = smpipe("registry", str(path), "--backend", "local", cwd=tmp_path)
    said = " ".join(local.stdout.split())  # as the terminal's width wrapped it
    assert f"no versions of model package group {group!r} in the local backend's registry" in said
    assert "--backend sagemaker or emulated lists another's" in said


def test_two_calls_that_change_an_emulated_registry_at_once_keep_both(tmp_path, aws_env, caplog):
    """moto's server answers each request in a thread of its own: a run's register and an
    approve at the same moment keep the registry one after the other. The gap is widened: the
    first keep's write of the new version takes a while, and the approval's keep starts
    meanwhile; it must take that write for its own command's, not another command's."""
    import threading
    import time

    from pipeline.backends.emulated import open_emulated_store
    from pipeline.backends.emulated.account import KEEPER, REGISTRY, moto_records

    path, settings = reviews_settings(
        tmp_path, str(tmp_path / "store"), experiment={"BACKEND": "emulated"}
    )
    store = open_emulated_store(settings)
    group = settings.registry.model_package_group
    client = boto3.client("sagemaker", region_name="us-east-1")
    client.create_model_package_group(ModelPackageGroupName=group)
    [keeper] = KEEPER
    version = f"{REGISTRY}{group}/0001.json"

    class Slow:  # the store, whose first write of a version takes a while
        def __init__(self, inner):
            self.inner = inner

        def create(self, key: str, data: bytes) -> bool:
            time.sleep(0.5)
            return self.inner.create(key, data)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    keeper.store = Slow(keeper.store)
    KEEPER.clear()  # the calls below keep nothing themselves: the test's threads do
    try:
        arn = client.create_model_package(
            ModelPackageGroupName=group,
            InferenceSpecification={
                "Containers": [{"Image": "smpipe:emulated", "ModelDataUrl": "s3://b/m.tar.gz"}]
            },
            ModelApprovalStatus="PendingManualApproval",
        )["ModelPackageArn"]
        registering = threading.Thread(target=keeper.keep)
        registering.start()
        time.sleep(0.2)  # inside the register's write
        moto_records("us-east-1").model_packages[arn].model_approval_status = "Approved"
        with caplog.at_level(logging.WARNING):
            keeper.keep()  # the approve's
        registering.join()
    finally:
        KEEPER[:] = [keeper]
    assert "another command kept this version" not in caplog.text
    kept = json.loads(store.get_bytes(version))
    assert kept["request"]["ModelApprovalStatus"] == "Approved"
