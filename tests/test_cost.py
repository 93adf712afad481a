"""What every run cost ([cost] PRICES, pipeline/cost.py): the most a plan can cost, from its
requests and the shipped prices, before anything starts; the billing fields the emulated
backend plays as AWS documents them, priced into a run's Metadata, summary, report and
`smpipe runs`; a price nobody knows named, never guessed; locally CPU-seconds, not dollars."""

from __future__ import annotations

import io
import json
import logging
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline import cost
from pipeline.backends.local import LocalBackend
from pipeline.config import ConfigError, load_settings
from pipeline.console import summary_lines
from pipeline.driver import parse_steps, run_pipeline
from pipeline.jobs import ProcessingJob
from pipeline.paths import ExperimentTree
from pipeline.plan import describe, log_plan, prices_for
from pipeline.player import metering
from pipeline.sources import Sources
from pipeline.stages import build_jobs
from pipeline.store import LocalStore
from tests.conftest import ROOT, ship_code, write_settings
from tests.test_emulator import (  # noqa: F401
    RUN,
    emulator,
    inputs,
    probe_training,
    store,
    tuning_job,
)
from tests.test_service_model import S3, STEPS, sagemaker_settings

EU = "eu-west-1"  # the shipped table's region
M5, G5 = 0.257, 1.57  # its Training (and m5's Processing) prices, from AWS's bill of 2023-12


def planned(settings):
    tree = ExperimentTree(settings.experiment.name)
    return build_jobs(settings, STEPS, tree.run(1), Sources(raw=tree.raw))


def price_list(answers: dict[str, float | None], region: str = "us-east-1"):
    """A real boto3 pricing client whose GetProducts answers are botocore's Stubber's (moto has
    no Price List): for each product ("ml.g5.xlarge-Training"), in the order the plan asks,
    one product document shaped as the API returns it, or none. Each request is checked
    against the parameters the plan must send."""
    import boto3
    from botocore.stub import Stubber

    client = cost.price_list_client(boto3.Session(region_name="us-east-1"))
    stubber = Stubber(client)
    for product, usd in answers.items():
        documents = [] if usd is None else [price_document(product, usd)]
        stubber.add_response(
            "get_products",
            {"PriceList": documents, "FormatVersion": "aws_v1"},
            {
                "ServiceCode": "AmazonSageMaker",
                "Filters": [
                    {"Type": "TERM_MATCH", "Field": "instanceType", "Value": product},
                    {"Type": "TERM_MATCH", "Field": "regionCode", "Value": region},
                ],
                "MaxResults": 10,
            },
        )
    stubber.activate()
    return client, stubber


def price_document(product: str, usd: float) -> str:
    """One PriceList item as GetProducts returns it: a JSON string of product and terms (the
    shape AWS's sample reads: terms.OnDemand.*.priceDimensions.*.pricePerUnit.USD)."""
    sku = "SKU" + str(abs(hash(product)) % 10**8)
    component = product.rsplit("-", 1)[1]
    return json.dumps(
        {
            "product": {
                "productFamily": "ML Instance",
                "attributes": {
                    "instanceType": product,
                    "component": component,
                    "regionCode": "us-east-1",
                    "location": "US East (N. Virginia)",
                    "servicecode": "AmazonSageMaker",
                },
                "sku": sku,
            },
            "serviceCode": "AmazonSageMaker",
            "terms": {
                "OnDemand": {
                    f"{sku}.JRTCKXETXF": {
                        "priceDimensions": {
                            f"{sku}.JRTCKXETXF.6YS6EN2CT7": {
                                "unit": "Hrs",
                                "description": f"${usd} per {component} {product} hour",
                                "pricePerUnit": {"USD": f"{usd:.10f}"},
                            }
                        },
                        "sku": sku,
                        "offerTermCode": "JRTCKXETXF",
                    }
                }
            },
        }
    )


def plan_said(
    settings, caplog, answers: dict[str, float | None] | None = None, brief: bool = False
) -> list[str]:
    """What the plan logs, the Price List answering `answers` (none: it has no price); `brief`:
    as a run opens."""
    jobs = planned(settings)
    if answers is None:
        answers = {
            f"{instance}-{cost.PRICE_LIST['component'][use]}": None
            for use, instance in sorted(
                {u for j in jobs for u in cost.uses_of(j.kind, describe(j, settings, S3()))}
            )
            if instance not in settings.cost.prices
        }
    client, stubber = price_list(answers, settings.experiment.region)
    with caplog.at_level(logging.INFO, logger="smpipe"):
        basis = prices_for(jobs, settings, S3(), pricing=client)
        log_plan(jobs, settings, S3(), basis=basis, brief=brief)
    stubber.assert_no_pending_responses()
    return [r.getMessage() for r in caplog.records]


def test_the_plan_prints_the_most_it_can_cost_from_its_requests(tmp_path, caplog):
    settings = sagemaker_settings(
        tmp_path,
        experiment={"REGION": EU},
        cost={"PRICES": "ml.c5.xlarge: 0.2"},
        inference={"INSTANCE_TYPE": "ml.c5.xlarge"},
        training={"USE_DISTRIBUTED": "true", "INSTANCE_COUNT": "2", "MAX_RUN_SECONDS": "3600"},
    )
    reconcile, prepare, first, last, inference = (
        describe(job, settings, S3()) for job in planned(settings)
    )
    # What the requests say, read off them: processing 1 day on one instance; training 1 hour
    # on two, the first keeping its two instances 600 s for the second (a warm pool).
    for request in (reconcile, prepare, inference):
        assert request["StoppingCondition"]["MaxRuntimeInSeconds"] == 86400
        assert request["ProcessingResources"]["ClusterConfig"]["InstanceCount"] == 1
    assert first["StoppingCondition"]["MaxRuntimeInSeconds"] == 3600
    assert first["ResourceConfig"] | last["ResourceConfig"] == {
        "InstanceType": "ml.g5.xlarge",
        "InstanceCount": 2,
        "VolumeSizeInGB": 30,
        "KeepAlivePeriodInSeconds": 600,
    }
    assert "KeepAlivePeriodInSeconds" not in last["ResourceConfig"]
    by_hand = (
        2 * 86400 * 1 * M5 / 3600  # reconcile and prepare on ml.m5.xlarge, the table's
        + (3600 + 600) * 2 * G5 / 3600  # the first model and its warm pool
        + 3600 * 2 * G5 / 3600  # the last model
        + 86400 * 1 * 0.2 / 3600  # inference on ml.c5.xlarge, at [cost] PRICES
    )
    said = plan_said(settings, caplog)
    assert f"most this plan can cost: ${by_hand:,.2f} on demand" in said[-1]
    assert "[cost] PRICES" in said[-1] and f"shipped table ({EU}, 2023-12)" in said[-1]
    assert any(
        line.startswith("  train minilm: at most $")
        and "+ warm pool 600 s x 2 x ml.g5.xlarge at $1.57/h" in line
        for line in said
    )


def test_a_tuning_plan_costs_its_trials_and_a_grid_every_combination(tmp_path):
    basis = cost.price_basis(EU, {})
    for strategy, trials in (("Random", 3), ("Grid", 2 * 3)):
        (tmp_path / strategy).mkdir()
        settings = sagemaker_settings(
            tmp_path / strategy,
            experiment={"REGION": EU, "JOB": "tune"},
            tuning={"STRATEGY": strategy, "MAX_JOBS": "3", "EARLY_STOPPING": "Off"},
            models={"MODEL_NAMES": "bow"},
            **{
                "tuning.hyperparameters": {
                    "BATCH_SIZE": "8,16",
                    "EPOCHS": "1,2,3",
                    "LEARNING_RATE": "1e-3",
                }
            },
        )
        tune = next(j for j in planned(settings) if j.kind == "tuning")
        most = cost.maximum("tuning", describe(tune, settings, S3()), basis)
        assert most["usd"] == pytest.approx(trials * 86400 * G5 / 3600)
        assert most["how"].startswith(f"{trials} trials x training 86400 s x 1 x ml.g5.xlarge")


def test_the_plan_asks_aws_price_list_for_what_it_uses_on_sagemaker(tmp_path, caplog):
    # The shipped settings' instance types in us-east-1, which the shipped table lacks.
    settings = sagemaker_settings(tmp_path)
    said = plan_said(
        settings, caplog, {"ml.m5.xlarge-Processing": 0.23, "ml.g5.xlarge-Training": 1.408}
    )
    by_hand = 3 * 86400 * 0.23 / 3600 + (2 * 86400 + 600) * 1.408 / 3600
    today = time.strftime("%Y-%m-%d", time.gmtime())
    assert said[-1] == (
        f"most this plan can cost: ${by_hand:,.2f} on demand (each job's MaxRuntimeInSeconds x "
        f"instances x price per instance-hour; prices: AWS Price List API (us-east-1, {today}))"
    )
    # [cost] PRICES wins and is not asked for; the emulated backend asks no one.
    settings = sagemaker_settings(tmp_path, cost={"PRICES": "ml.g5.xlarge: 2"})
    said = plan_said(settings, caplog, {"ml.m5.xlarge-Processing": 0.23})
    assert "[cost] PRICES" in said[-1] and "AWS Price List API" in said[-1]
    emulated = sagemaker_settings(tmp_path, experiment={"BACKEND": "emulated"})
    jobs = planned(emulated)
    assert prices_for(jobs, emulated, S3(), pricing=object())["price_list"] is None


def test_a_price_list_refused_falls_back_and_says_which_permission(tmp_path, caplog):
    client, stubber = price_list({})
    stubber.add_client_error(
        "get_products", service_error_code="AccessDeniedException", http_status_code=400
    )
    settings = sagemaker_settings(tmp_path, experiment={"REGION": EU})
    jobs = planned(settings)
    with caplog.at_level(logging.INFO, logger="smpipe"):
        log_plan(jobs, settings, S3(), basis=prices_for(jobs, settings, S3(), pricing=client))
    said = [r.getMessage() for r in caplog.records]
    assert (
        "the AWS Price List API (pricing:GetProducts) failed: AccessDeniedException; the "
        "shipped table and [cost] PRICES price the rest" in said
    )
    assert f"prices: shipped table ({EU}, 2023-12))" in said[-1]  # one ask, then the table
    # An answer that is not one price (none, or two) prices nothing.
    two = [price_document("ml.g5.xlarge-Training", p) for p in (1.408, 1.5)]
    assert cost.on_demand_hourly(two) is None and cost.on_demand_hourly([]) is None
    assert cost.on_demand_hourly(two[:1] * 2) == 1.408


def test_a_price_nobody_knows_is_named_never_guessed(tmp_path, caplog):
    # A region the shipped table has no figures for, and the Price List has no answer.
    settings = sagemaker_settings(tmp_path, experiment={"REGION": "ap-southeast-2"})
    said = plan_said(settings, caplog)
    assert said[-2:] == [
        "most this plan can cost: unknown, no price for ml.g5.xlarge (training, ap-southeast-2); "
        "no price for ml.m5.xlarge (processing, ap-southeast-2): set [cost] PRICES",
        # The bound that holds whatever the price: MaxRuntimeInSeconds x instances, summed.
        f"most instance-hours it can use: {2 * 86400 / 3600 + 600 / 3600:,.1f} h of "
        f"ml.g5.xlarge, {3 * 86400 / 3600:,.1f} h of ml.m5.xlarge",
    ]
    billed = [
        {
            "job": "a",
            "use": "training",
            "instance_type": "ml.g5.xlarge",
            "instance_count": 1,
            "billable_seconds": 100,
        },
        {
            "job": "b",
            "use": "processing",
            "instance_type": "ml.m5.xlarge",
            "instance_count": 1,
            "billable_seconds": 10,
        },
    ]
    recorded = cost.run_cost(
        billed, cost.price_basis("ap-southeast-2", {"ml.m5.xlarge": 0.36}), "x"
    )
    assert recorded["usd"] is None and recorded["priced_usd"] == pytest.approx(10 * 0.36 / 3600)
    assert recorded["unpriced"] == ["no price for ml.g5.xlarge (training, ap-southeast-2)"]
    assert cost.as_text(recorded).startswith(
        "cost: unknown, no price for ml.g5.xlarge (training, ap-southeast-2) (set [cost] PRICES)"
    )
    # A job stopped with the driver before its bill was read: the cost is a lower bound,
    # said so by name, everywhere it is shown.
    stopped = [{"kind": "training", "job": "stopped-train"}]
    basis = cost.price_basis("ap-southeast-2", {"ml.m5.xlarge": 0.36})
    bound = cost.run_cost(billed[1:], basis, "x", stopped)
    assert bound["usd"] is None and bound["unbilled"] == ["stopped-train"]
    assert cost.as_text(bound).startswith("cost: at least $0.0010 (10 billable instance-seconds)")
    assert "not counted: stopped-train, stopped with the run" in cost.as_text(bound)
    assert "their Describe* answer says what" in cost.as_text(bound)
    # An emulated account's bill ends with its driver: no resume is promised to read it.
    emulated = cost.run_cost(billed[1:], basis, "emulated", stopped)
    assert "an emulated account bills nothing" in cost.as_text(emulated)
    assert "--resume" not in cost.as_text(emulated)
    assert cost.short(bound) == "≥$0.0010 (unbilled)"
    # A warm pool still kept when the run ended: its time is not known yet, and said so.
    kept = cost.run_cost(billed[1:], basis, "x", [{"kind": "pool", "job": "train-a"}])
    assert kept["usd"] is None and kept["unbilled"] == [] and kept["unbilled_pools"] == ["train-a"]
    assert cost.as_text(kept) == (
        "cost: at least $0.0010 (10 billable instance-seconds); nor the warm pool kept for "
        "train-a, its time not known yet when the run ended"
    )
    assert cost.short(kept) == "≥$0.0010 (unbilled)"
    # A price that is not one is refused by key, with what was meant.
    path = write_settings(
        tmp_path / "bad.ini",
        "s3://bucket/root",
        cost={"PRICES": "ml.g5.xlarg: 1.4, ml.m5.xlarge: free"},
    )
    with pytest.raises(ConfigError) as error:
        load_settings(path, env={})
    [problem] = error.value.problems
    assert problem.startswith("[cost] PRICES: 'ml.g5.xlarg' is not an instance type")
    assert "did you mean 'ml.g5.xlarge'?" in problem and "'ml.m5.xlarge: free'" in problem


def test_a_resumed_steps_earlier_section_is_not_billed_twice(tmp_path):
    """A --resume moves the billing of the steps it runs again into billing_before_resume; the
    earlier section stays until the step writes its own. Each record is counted once all the
    while, and the jobs the run holds a bill of are known by name, trials' tuning jobs too."""
    from pipeline import metadata as md

    train = {"job": "p-r1-train-a", "use": "training", "instance_type": "ml.m5.xlarge",
             "instance_count": 1, "billable_seconds": 100}  # fmt: skip
    trial = {**train, "job": "p-r1-tune-a-001-abc", "tuning_job": "p-r1-tune-a"}
    base = md.Metadata(run_id="r1", model_version=1, experiment_name="p", artifact_uri="x",
                       backend="sagemaker", billing_before_resume=[train, trial],
                       prices=cost.price_basis("us-east-1", {"ml.m5.xlarge": 0.36}))  # fmt: skip
    sections = {
        "prepare": md.StepSection(step="prepare", job_names=["p-r1-prepare"]),
        "train": md.StepSection(step="train", job_names=["p-r1-train-a"], billing=[train]),
    }
    assert md.billing(base, sections) == [train, trial]
    folder, run = LocalStore(str(tmp_path)), ExperimentTree("p").run(1)
    for section in sections.values():
        md.write_section(folder, run, section)
    record = md.merge(folder, run, base)
    assert record.cost["billable_instance_seconds"] == 200  # the earlier train section's once
    # A job a section names with no bill (given up unreadable, say) is read by a --resume.
    assert md.accounted_jobs(base, sections) == {
        "p-r1-train-a", "p-r1-tune-a-001-abc", "p-r1-tune-a"
    }  # fmt: skip


def test_the_emulator_plays_the_billing_fields_and_a_warm_pool_bills(store, emulator, inputs):  # noqa: F811
    backend = emulator.backend(RUN, "", "", io.StringIO())
    first = backend.run_training(probe_training("bill-a", keep_alive_seconds=60))
    time.sleep(1.6)  # the pool waits, billed, for the next job
    second = backend.run_training(probe_training("bill-b"))
    spot = backend.run_training(probe_training("bill-c", use_spot=True))
    assert [r.status for r in (first, second, spot)] == ["Completed"] * 3, spot.failure_reason
    described = emulator.client.describe_training_job(TrainingJobName="bill-a")
    wall = (described["TrainingEndTime"] - described["TrainingStartTime"]).total_seconds()
    assert (
        described["BillableTimeInSeconds"]
        == described["TrainingTimeInSeconds"]
        == max(1, round(wall))
    )
    assert first.billing == [
        {
            "job": "bill-a",
            "use": "training",
            "instance_type": "ml.m5.xlarge",
            "instance_count": 1,
            "billable_seconds": described["BillableTimeInSeconds"],
            "training_seconds": described["TrainingTimeInSeconds"],
        },
    ]
    trained, pool = second.billing
    assert trained["job"] == "bill-b" and trained["billable_seconds"] >= 1
    kept = emulator.client.describe_training_job(TrainingJobName="bill-a")["WarmPoolStatus"]
    assert kept["ReusedByJob"] == "bill-b" and kept["ResourceRetainedBillableTimeInSeconds"] >= 1
    assert pool == {
        "job": "bill-a",
        "use": "warm pool",
        "instance_type": "ml.m5.xlarge",
        "instance_count": 1,
        "billable_seconds": kept["ResourceRetainedBillableTimeInSeconds"],
    }
    # Spot savings by AWS's formula: none, as the emulator bills spot time as trained.
    [spent] = spot.billing
    assert spent["spot_savings_percent"] == 0.0 and spent["billable_seconds"] >= 1
    priced = cost.run_cost(first.billing + second.billing, cost.price_basis(EU, {}), "emulated")
    seconds = sum(b["billable_seconds"] for b in first.billing + second.billing)
    assert priced["usd"] == pytest.approx(seconds * M5 / 3600, abs=1e-6)  # a pool at the
    # training rate


def test_a_tuning_job_bills_each_of_its_trials_failed_ones_too(store, emulator, inputs):  # noqa: F811
    result = emulator.backend(RUN, "", "", io.StringIO()).run_tuning(tuning_job("bill-t", True))
    assert result.status == "Failed"  # every trial failed: each still ran, and bills
    trials = [t["job_name"] for t in result.details["trials"]]
    assert len(trials) == 2 and [b["job"] for b in result.billing] == trials
    for billed in result.billing:
        described = emulator.client.describe_training_job(TrainingJobName=billed["job"])
        assert billed["tuning_job"] == "bill-t" and billed["use"] == "training"
        assert billed["billable_seconds"] == described["BillableTimeInSeconds"] >= 1


@pytest.mark.slow
def test_an_emulated_run_prints_its_cost_in_summary_report_and_runs(demo_raw, tmp_path, caplog):
    path = write_settings(
        tmp_path / "settings.ini",
        str(tmp_path / "store"),
        experiment={"BACKEND": "emulated", "REGION": EU},
        data={"RAW_DATA": str(demo_raw)},
        models={"MODEL_NAMES": "bow"},
        training={"MAX_STEPS": "2"},
    )
    settings = load_settings(path, env={})
    from pipeline.backends.emulated import open_emulated_store

    with caplog.at_level(logging.INFO, logger="smpipe"):
        record = run_pipeline(
            settings, open_emulated_store(settings), parse_steps(None), echo=io.StringIO()
        )
    assert record["status"] == "completed"
    jobs = record["cost"]["jobs"]
    assert [j["use"] for j in jobs] == ["processing", "processing", "training", "processing"]
    trained = jobs[2]
    assert trained["billable_seconds"] == trained["training_seconds"] >= 1
    train_section = record["steps"]["train"]
    assert trained["billable_seconds"] <= train_section["time_taken"] + 1
    assert all(j["estimated_from"] for j in jobs if j["use"] == "processing")
    by_hand = sum(j["billable_seconds"] * (G5 if j["use"] == "training" else M5) for j in jobs)
    assert record["cost"]["usd"] == pytest.approx(by_hand / 3600, abs=1e-5)
    said = f"cost: ${record['cost']['usd']:,.4f} ("
    assert any(r.getMessage().startswith(said) for r in caplog.records)  # the summary
    report = (tmp_path / "store/test-exp/runs/0001/report.html").read_text()
    assert said in report and trained["job"] in report and "ml.g5.xlarge" in report
    smpipe = str(Path(sys.executable).parent / "smpipe")
    runs = subprocess.run([smpipe, "runs", str(path)], cwd=ROOT, capture_output=True, text=True)
    assert runs.returncode == 0, runs.stderr
    assert f"${record['cost']['usd']:,.4f}" in runs.stdout and "cost" in runs.stdout


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_a_local_job_reports_its_cpu_seconds_children_included(start, tmp_path, monkeypatch):
    """Cold, the driver reads the exited entrypoint's time before reaping it; warm, the fork
    server reaps the job and sends its wait4 figure. Either counts the child the step waited for.
    Warm: the second job of a backend starts warm (the first may, from a server left idle)."""
    monkeypatch.setenv("SMPIPE_WARM_START", "0" if start == "cold" else "1")
    # The driver's samples of the job's CPU time as sparse as its memory samples (0.5 s): the
    # job's last half second is then in no sample, and only its exit figure can count it.
    monkeypatch.setattr(metering, "CPU_SAMPLE_SECONDS", 10)
    here = LocalStore(str(tmp_path / "store"))
    ship_code(here)

    def job(name: str) -> ProcessingJob:
        return ProcessingJob(
            name=name,
            step="tests.jobs.burn_cpu",
            code="code/",
            inputs={},
            outputs={"out": f"outputs/{name}/"},
            arguments=["--seconds", "1.2"],
            env={"SMPIPE_USER_FUNCTIONS": "user_functions"},
        )

    echo = io.StringIO()
    backend = LocalBackend(here, RUN, echo=echo, work_root=str(tmp_path / "work"))
    try:
        results = [backend.run_processing(job(name)) for name in ("burn-1", "burn-2")]
    finally:
        backend.close(succeeded=True)
    for result in results:
        assert result.status == "Completed", result.failure_reason
    assert (tmp_path / "store/outputs/burn-2/started.txt").read_text() == start, echo.getvalue()
    for result in results:
        [used] = result.billing
        # 1.2 s burnt, half in a child the step waited for; plus the interpreter's own start.
        assert 1.2 <= used["cpu_seconds"] < 1.2 + 15 and used["peak_memory_mb"] > 0
    recorded = cost.run_cost(result.billing, None, "local")
    assert recorded["measure"] == "CPU-seconds" and "usd" not in recorded
    lines = summary_lines(
        {"cost": recorded, "time_taken": 3.0, "model_version": 1, "status": "completed"}, "x"
    )
    assert lines[-2].startswith(f"used: {used['cpu_seconds']:,.1f} CPU-seconds, peak memory ")
    assert "nothing billed" in lines[-2] and "$" not in lines[-2]


# A process that grows in two steps and then holds its memory: 64 MiB, then 128 MiB more, each
# page written (own pages: USS), then a flat stretch.
GROWING = """
import sys, time
held = [bytearray(64 << 20)]
time.sleep(1.0)
held.append(bytearray(128 << 20))
print("grown", flush=True)
time.sleep(float(sys.argv[1]))
"""


def test_peak_memory_reads_smaps_while_a_tree_grows_and_not_on_every_tick(monkeypatch):
    """smaps_rollup walks a process's page tables (milliseconds for one that imported torch), so
    the watcher reads it where the tree has grown, and otherwise within a budget: here a budget
    so small that only growth can make it read, and the peak is still the tree's own memory."""
    import psutil

    monkeypatch.setattr(metering, "READ_SHARE", 1e-6)
    reads, ticks = [], []
    full, cheap = psutil.Process.memory_full_info, psutil.Process.memory_info
    monkeypatch.setattr(psutil.Process, "memory_full_info", lambda p: reads.append(1) or full(p))
    monkeypatch.setattr(psutil.Process, "memory_info", lambda p: ticks.append(1) or cheap(p))
    proc = subprocess.Popen([sys.executable, "-c", GROWING, "3"], stdout=subprocess.PIPE, text=True)
    peak, done = {"rss": 0, "cpu": 0.0}, threading.Event()
    watcher = threading.Thread(target=metering.watch_memory, args=(proc.pid, peak, done))
    watcher.start()
    try:
        assert proc.stdout.readline() == "grown\n"
        proc.wait(timeout=60)
    finally:
        done.set()
        watcher.join(timeout=10)
    assert peak["rss"] >= (64 + 128) << 20  # both allocations, own pages of the one process
    assert len(ticks) >= 8 and len(reads) <= len(ticks) // 2, (len(reads), len(ticks))


def test_a_run_opens_with_a_line_a_job_and_the_most_it_can_cost(tmp_path, caplog):
    """The plan `smpipe plan` prints names every input and output; a run opens with a line a
    job and the plan's most, and points at the plan for the rest."""
    settings = sagemaker_settings(
        tmp_path, cost={"PRICES": "ml.m5.xlarge: 0.23, ml.g5.xlarge: 1.4"}
    )
    full = plan_said(settings, caplog)
    caplog.clear()
    brief = plan_said(settings, caplog, brief=True)
    jobs = planned(settings)
    assert sum(line.lstrip().startswith(("input ", "output ")) for line in full) > len(jobs)
    assert not any(line.lstrip().startswith(("input ", "output ")) for line in brief)

    def headers(lines):  # each job's line, its name's time stamp left out (two plans, two times)
        numbered = tuple(f"  {n}. " for n in range(1, 10))
        return [re.sub(r"-\d{6}\)$", ")", line) for line in lines if line.startswith(numbered)]

    assert headers(brief) == headers(full) and len(headers(brief)) == len(jobs)
    assert any(line.startswith("most this plan can cost: $") for line in brief)
    assert not any(": at most $" in line for line in brief)
    # The settings file named as the user named it.
    said = (
        f"(`smpipe plan {shlex.quote(settings.source)}` says each job's inputs, outputs and costs)"
    )
    assert brief[-1] == said
    assert len(brief) <= len(jobs) + 3
