"""One tuning record, whichever backend tuned: the report reads the same shape from a local
study (Optuna playing the tuning job), from SageMaker's own tuning job (its Describe and List
answers, shaped as botocore's service model says) and from the emulated one (tests/
test_emulated.py::test_tune_emulated)."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime, timedelta

import boto3
from botocore.awsrequest import AWSResponse
from botocore.validate import validate_parameters

from pipeline import report, tuning_record
from pipeline.paths import ExperimentTree
from pipeline.service_model import service_model
from pipeline.store import S3Store
from pipeline.tuning_record import RECORD_FIELDS, TRIAL_FIELDS
from tests.test_promises_tuning import RUN, local, tuning  # noqa: F401 (local: a fixture)
from tests.test_sagemaker_backend import backend_for, jobs_of, sagemaker_settings, tarball


def assert_the_report_reads_the_record(store, tree: ExperimentTree, run_num: int, model: str):
    """The report's tuning part of `model` is its tuning record as saved, in the one shape:
    every trial numbered in order with the same fields, the best one of them, the table and
    chart drawn from it, a row of the page per trial. Returns the record."""
    run = tree.run(run_num)
    saved = json.loads(store.get_bytes(run.tuning_record(model)))
    assert tuple(saved) == RECORD_FIELDS
    trials = saved["trials"]
    assert trials and all(tuple(t) == TRIAL_FIELDS for t in trials)
    assert [t["number"] for t in trials] == list(range(1, len(trials) + 1))
    assert saved["best"] in trials and saved["best"]["status"] == "Completed"
    assert sum(saved["counters"].values()) == len(trials)
    table = csv.DictReader(io.StringIO(store.get_bytes(run.trials(model, "csv")).decode()))
    assert [r["job_name"] for r in table] == [t["job_name"] for t in trials]
    assert store.get_bytes(run.trials(model, "png")).startswith(b"\x89PNG")

    values = report.context(store, tree, run_num)
    view = next(m for m in values["models"] if m["name"] == model)["tuning"]
    assert view["record"] == saved and view["trials"] == trials
    assert view["chart"].startswith("data:image/png;base64,")
    page = report.render(values)
    section = page[page.index('<section id="tuning">') :]
    section = section[: section.index("</section>")]
    assert section.count("<tr><td>") == len(trials) and section.count("★") == 1
    assert f"{model}: {saved['strategy']}" in section
    return saved


def tuned_run(store, tree: ExperimentTree, run_num: int, model: str, details: dict) -> None:
    """What the tune stage leaves when a tuning job ends: the record saved, and Metadata whose
    tune section holds it."""
    run = tree.run(run_num)
    tuning_record.save(store, run, model, details)
    section = {"step": "tune", "status": "completed", "details": {"models": {model: details}}}
    metadata = {
        "experiment_name": tree.experiment,
        "steps": {"tune": section},
        "model_artifacts": {model: run.final_model(model)},
    }
    store.put_bytes(run.metadata, json.dumps(metadata).encode())


def test_the_report_reads_a_local_study_s_tuning_record(local):  # noqa: F811
    store, backend, _ = local
    job = tuning("Random", "validation:f1", "Maximize", trials=2, parallel=2, epochs=2)
    result = backend.run_tuning(job)
    assert result.status == "Completed", result.failure_reason
    tuned_run(store, ExperimentTree(RUN.experiment), 1, "probe", result.details)
    saved = assert_the_report_reads_the_record(store, ExperimentTree(RUN.experiment), 1, "probe")
    # Played here: Optuna's sampler and pruner said, each trial's epochs as it reported them.
    assert (saved["sampler"], saved["pruner"]) == ("RandomSampler", "NopPruner")
    assert all(len(t["epochs"]) == 2 and t["seconds"] > 0 for t in saved["trials"])
    assert saved["best"]["objective"] == max(t["objective"] for t in saved["trials"])


def summary(job, number: int, status: str, rate: str, objective=None, **more) -> dict:
    """A trial's HyperParameterTrainingJobSummary, as ListTrainingJobsForHyperParameter-
    TuningJob answers (botocore's sagemaker service-2.json)."""
    created = datetime(2025, 1, 1, tzinfo=UTC) + timedelta(minutes=number)
    said = {
        "TrainingJobName": f"{job.name}-{number:03d}-0123abc{number}",
        "TrainingJobArn": f"arn:aws:sagemaker:us-east-1:123456789012:training-job/t{number}",
        "TuningJobName": job.name,
        "CreationTime": created,
        "TrainingStartTime": created + timedelta(seconds=30),
        "TrainingEndTime": created + timedelta(seconds=150),
        "TrainingJobStatus": status,
        "TunedHyperParameters": {"learning_rate": rate},
        "ObjectiveStatus": "Succeeded" if objective is not None else "Failed",
        **more,
    }
    if objective is not None:
        said["FinalHyperParameterTuningJobObjectiveMetric"] = {
            "Type": "Maximize",
            "MetricName": job.objective_metric,
            "Value": objective,
        }
    return said


def test_the_report_reads_a_sagemaker_tuning_record(tmp_path, bucket, aws_env):
    """moto creates the tuning job and its trials' training jobs and runs nothing: SageMaker's
    answers about the trials (ListTrainingJobsForHyperParameterTuningJob, which moto lacks, and
    DescribeHyperParameterTuningJob's BestTrainingJob) are given as the service model shapes
    them: a trial that completed, one stopped early with the latest objective it emitted,
    one that failed without one, listed by name, not in the order they were created."""
    client = boto3.client("sagemaker")
    settings = sagemaker_settings(tmp_path, bucket, experiment={"JOB": "tune"})
    store = S3Store(settings.store_uri())
    run, jobs = jobs_of(settings)
    job = next(j for j in jobs if j.kind == "tuning")
    model = job.trial.hyperparameters["model_name"]
    backend = backend_for(settings, store, run, client)
    summaries = [
        summary(job, 2, "Completed", "0.001", 0.61),
        summary(job, 1, "Stopped", "0.0001", 0.3),
        summary(job, 3, "Failed", "0.1", FailureReason="AlgorithmError: out of memory"),
    ]
    listed = {"TrainingJobSummaries": summaries}
    answers = service_model().operation_model("ListTrainingJobsForHyperParameterTuningJob")
    validate_parameters(listed, answers.output_shape)
    for s in summaries:  # the trials' training jobs, the best one's archives where SageMaker
        trial = {**backend.request(job.trial), "TrainingJobName": s["TrainingJobName"]}
        client.create_training_job(**trial)
    best = summaries[0]["TrainingJobName"]  # leaves them (API_OutputDataConfig)
    output = f"{job.trial.sagemaker_output}{best}/output/"
    store.put_bytes(output + "model.tar.gz", tarball({"model.json": b"{}"}))
    store.put_bytes(output + "output.tar.gz", tarball({"step_metadata.json": b"{}"}))

    def best_training_job(parsed, **_):
        parsed["BestTrainingJob"] = summaries[0]

    events = client.meta.events
    events.register("after-call.sagemaker.DescribeHyperParameterTuningJob", best_training_job)
    events.register(
        "before-call.sagemaker.ListTrainingJobsForHyperParameterTuningJob",
        lambda **_: (AWSResponse(None, 200, {}, None), listed),
    )
    result = backend.run_tuning(job)
    assert result.status == "Completed", result.failure_reason
    tuned_run(store, ExperimentTree(settings.experiment.name), 1, model, result.details)
    saved = assert_the_report_reads_the_record(store, ExperimentTree(run.experiment), 1, model)
    # SageMaker's own search: no sampler of ours; the trials as SageMaker summarised them.
    assert (saved["sampler"], saved["pruner"]) == (None, None)
    assert [(t["status"], t["objective"], t["seconds"]) for t in saved["trials"]] == [
        ("Stopped", 0.3, 120.0),
        ("Completed", 0.61, 120.0),
        ("Failed", None, 120.0),
    ]
    assert saved["trials"][2]["stop_reason"] == "AlgorithmError: out of memory"
    assert saved["best"]["job_name"] == best and saved["best"]["number"] == 2
    assert saved["counters"] == {"Completed": 1, "Failed": 1, "Stopped": 1}
    assert all(t["epochs"] == {} for t in saved["trials"])
