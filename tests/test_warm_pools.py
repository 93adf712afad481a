"""SageMaker managed warm pools ([training] KEEP_ALIVE_SECONDS): the request asks for one only
where SageMaker takes it, within the service model's range, refused by key; the emulated
account plays the lifecycle train-warm-pools.html describes (kept, reused by a matching job,
not by another, Terminated when its time is up)."""

from __future__ import annotations

import copy
import io
import time
from types import SimpleNamespace

import pytest

from pipeline.config import ConfigError, load_settings
from pipeline.jobs import keep_alive_refused, request_for
from pipeline.paths import ExperimentTree
from pipeline.player import warm_pools
from pipeline.player.warm_pools import WarmPools
from pipeline.service_model import check, shape
from pipeline.sources import Sources
from pipeline.stages import build_jobs
from tests.conftest import ROOT, write_settings
from tests.test_emulator import RUN, emulator, inputs, probe_training, store  # noqa: F401
from tests.test_service_model import IMAGE, ROLE, S3, STEPS, sagemaker_settings

KEY = "[training] KEEP_ALIVE_SECONDS"


def training_requests(settings) -> list[tuple]:
    """(job, request) of each training or tuning job the plan makes, in order."""
    tree = ExperimentTree(settings.experiment.name)
    jobs = build_jobs(settings, STEPS, tree.run(1), Sources(raw=tree.raw))
    trained = [job for job in jobs if job.kind in ("training", "tuning")]
    return [(job, request_for(job, IMAGE, ROLE, S3().uri_of)) for job in trained]


def test_the_default_is_shipped_and_each_training_job_asks_for_it(tmp_path):
    assert load_settings(ROOT / "settings.ini", env={}).training.keep_alive_seconds == 600
    made = training_requests(sagemaker_settings(tmp_path, models={"MODEL_NAMES": "bow, minilm"}))
    assert len(made) == 2  # consecutive jobs of one run, on the same resources: a match
    (first, asks), (last, last_asks) = made
    assert asks["ResourceConfig"]["KeepAlivePeriodInSeconds"] == 600
    # The run's last training job has no next one to start on its instances: no pool.
    assert "KeepAlivePeriodInSeconds" not in last_asks["ResourceConfig"]
    for job, request in made:
        assert keep_alive_refused(job) is None and check("CreateTrainingJob", request) == []
    assert asks["ResourceConfig"] == {
        **last_asks["ResourceConfig"],
        "KeepAlivePeriodInSeconds": 600,
    }


def test_zero_spot_and_tuning_send_none_and_say_why_by_key(tmp_path):
    (job, request), *_ = training_requests(
        sagemaker_settings(tmp_path, training={"KEEP_ALIVE_SECONDS": "0"})
    )
    assert "KeepAlivePeriodInSeconds" not in request["ResourceConfig"]
    assert keep_alive_refused(job) is None
    (tmp_path / "spot").mkdir()
    spot = {"USE_SPOT": "true", "MAX_RUN_SECONDS": "3600", "MAX_WAIT_SECONDS": "7200"}
    (job, request), *_ = training_requests(sagemaker_settings(tmp_path / "spot", training=spot))
    assert "KeepAlivePeriodInSeconds" not in request["ResourceConfig"]
    assert KEY in keep_alive_refused(job) and "spot" in keep_alive_refused(job)
    (tmp_path / "tune").mkdir()
    (job, request), *_ = training_requests(
        sagemaker_settings(tmp_path / "tune", experiment={"JOB": "tune"})
    )
    assert job.kind == "tuning"
    assert "KeepAlivePeriodInSeconds" not in request["TrainingJobDefinition"]["ResourceConfig"]
    assert KEY in keep_alive_refused(job) and "tuning" in keep_alive_refused(job)
    # The tuning shape that replaces ResourceConfig has no such member at all.
    assert "KeepAlivePeriodInSeconds" not in shape("HyperParameterTuningResourceConfig").members


def test_the_service_models_range_is_enforced_by_field_and_by_key(tmp_path):
    limits = shape("KeepAlivePeriodInSeconds").metadata
    assert (limits["min"], limits["max"]) == (0, 21600)  # botocore's sagemaker service-2.json
    (_, request), *_ = training_requests(sagemaker_settings(tmp_path))
    for value, words in ((21601, "less than or equal to 21600"), (-1, "greater than or equal")):
        bad = copy.deepcopy(request)
        bad["ResourceConfig"]["KeepAlivePeriodInSeconds"] = value
        found = [str(v) for v in check("CreateTrainingJob", bad)]
        assert any("ResourceConfig.KeepAlivePeriodInSeconds" in f and words in f for f in found)
    for value, words in (("21601", "21600"), ("-5", "greater than or equal to 0"), ("1h", "")):
        path = write_settings(
            tmp_path / "s.ini", "s3://b/r", training={"KEEP_ALIVE_SECONDS": value}
        )
        with pytest.raises(ConfigError) as info:
            load_settings(path, env={})
        assert any(p.startswith(KEY) and words in p for p in info.value.problems), info.value


# -- the emulated account's warm pools, step by step ---------------------------------------------


def request(keep: int | None = 60, **changes) -> dict:
    resources = {"InstanceType": "ml.g5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 30}
    if keep is not None:
        resources["KeepAlivePeriodInSeconds"] = keep
    return {"RoleArn": ROLE, "ResourceConfig": resources, **changes}


class Clock:
    def __init__(self, monkeypatch):
        self.now = 1000.0
        monkeypatch.setattr(warm_pools.time, "time", lambda: self.now)


@pytest.fixture
def pools(monkeypatch):
    jobs = {name: SimpleNamespace() for name in "abcdef"}
    return WarmPools(jobs), jobs, Clock(monkeypatch)


def status(jobs, name):
    return getattr(jobs[name], "warm_pool_status", None)


def test_a_pool_moves_to_the_next_matching_job_and_is_billed_until_then(pools):
    account, jobs, clock = pools
    account.start("a", request())
    assert status(jobs, "a") is None  # the first job cold-starts its instances
    account.end("a", request())
    assert status(jobs, "a") == {"Status": "Available"}
    clock.now += 42
    account.start("b", request(keep=30))
    assert status(jobs, "a") == {
        "Status": "Reused",
        "ReusedByJob": "b",
        "ResourceRetainedBillableTimeInSeconds": 42,
    }
    assert status(jobs, "b") == {"Status": "InUse"}
    account.end("b", request(keep=30))  # kept on, with b's own period
    clock.now += 31
    account.expire()
    assert status(jobs, "b") == {
        "Status": "Terminated",
        "ResourceRetainedBillableTimeInSeconds": 30,
    }


def resources(**changes) -> dict:
    return {"ResourceConfig": {**request()["ResourceConfig"], **changes}}


@pytest.mark.parametrize(
    "changes",
    [
        {"RoleArn": ROLE + "-other"},
        resources(InstanceType="ml.g5.2xlarge"),
        resources(InstanceCount=2),
        resources(VolumeSizeInGB=31),
        resources(VolumeKmsKeyId="alias/other"),
        {"VpcConfig": {"SecurityGroupIds": ["sg-1"], "Subnets": ["subnet-1"]}},
        {"EnableNetworkIsolation": True},
        {"EnableInterContainerTrafficEncryption": True},
        {"EnableManagedSpotTraining": True},
    ],
)
def test_a_job_that_does_not_match_starts_cold_and_leaves_the_pool(pools, changes):
    account, jobs, _ = pools
    account.start("a", request())
    account.end("a", request())
    other = {**request(), **changes}
    account.start("b", other)
    assert status(jobs, "a") == {"Status": "Available"} and status(jobs, "b") is None


def test_no_pool_without_keep_alive_nor_with_spot_and_a_reused_one_spins_down(pools):
    account, jobs, _ = pools
    for name, asked in (("a", request(keep=None)), ("b", request(keep=0))):
        account.start(name, asked)
        account.end(name, asked)
        assert status(jobs, name) is None
    spot = request(EnableManagedSpotTraining=True)
    account.start("c", spot)
    account.end("c", spot)
    assert status(jobs, "c") is None
    account.start("d", request())
    account.end("d", request())
    account.start("e", request(keep=None))  # matches d's pool, asks for none after itself
    account.end("e", request(keep=None))
    assert status(jobs, "e") == {"Status": "Terminated", "ResourceRetainedBillableTimeInSeconds": 0}
    account.start("f", request())
    assert status(jobs, "f") is None  # nothing left to start on


def test_a_pool_expires_when_its_time_is_up_or_after_28_days_of_jobs(pools):
    account, jobs, clock = pools
    account.start("a", request())
    account.end("a", request(keep=60))
    clock.now += 60
    account.start("b", request())  # too late: a's pool is gone, b cold-starts
    assert status(jobs, "a") == {
        "Status": "Terminated",
        "ResourceRetainedBillableTimeInSeconds": 60,
    }
    assert status(jobs, "b") is None
    clock.now += warm_pools.POOL_LIFETIME_SECONDS - 10  # b's instances run jobs for 28 days
    account.end("b", request(keep=3600))
    clock.now += 10
    account.start("c", request())
    assert status(jobs, "b") == {
        "Status": "Terminated",
        "ResourceRetainedBillableTimeInSeconds": 10,
    }
    assert status(jobs, "c") is None


# -- real emulated jobs through the SageMaker backend ----------------------------------------------


def test_emulated_jobs_reuse_a_matching_pool_and_not_another(store, emulator, inputs):  # noqa: F811
    """Three probe jobs in a row on one backend, as a run's models train: the second matches
    the first and starts on its pool; the third (another instance type) does not, and its own
    short pool is Terminated once its time is up."""
    echo = io.StringIO()
    backend = emulator.backend(RUN, "", "", echo)
    jobs = [
        probe_training("pool-a", keep_alive_seconds=60),
        probe_training("pool-b", keep_alive_seconds=60),
        probe_training("pool-c", keep_alive_seconds=2, instance_type="ml.c5.xlarge"),
    ]
    results = [backend.run_training(job) for job in jobs]
    assert [r.status for r in results] == ["Completed"] * 3, [r.failure_reason for r in results]
    described = {
        j.name: emulator.client.describe_training_job(TrainingJobName=j.name) for j in jobs
    }
    assert described["pool-a"]["ResourceConfig"]["KeepAlivePeriodInSeconds"] == 60
    assert described["pool-a"]["WarmPoolStatus"]["Status"] == "Reused"
    assert described["pool-a"]["WarmPoolStatus"]["ReusedByJob"] == "pool-b"
    assert described["pool-b"]["WarmPoolStatus"] == {"Status": "Available"}
    assert results[1].details["warm_pool"]["started_on_pool_of"] == "pool-a"
    assert "started_on_pool_of" not in results[0].details["warm_pool"]
    assert "started_on_pool_of" not in results[2].details["warm_pool"]
    assert results[2].details["warm_pool"]["pool_status_at_end"] == "Available"
    time.sleep(2.1)
    after = emulator.client.describe_training_job(TrainingJobName="pool-c")["WarmPoolStatus"]
    assert after == {"Status": "Terminated", "ResourceRetainedBillableTimeInSeconds": 2}
    said = echo.getvalue()
    assert "[pool-b] started on the warm pool pool-a left" in said
    assert "[pool-a] warm pool Available" in said and KEY in said
