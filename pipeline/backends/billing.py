"""What a SageMaker job bills, read from its Describe* answer: a billing record per job, which
pipeline/cost.py prices. Read when a job ends (pipeline/backends/sagemaker.py), and by a
resumed run for the jobs its earlier driver could not read (pipeline/backends/resuming.py).
"""

from __future__ import annotations

from pipeline.cost import spot_savings


def billed(kind: str, described: dict) -> list[dict]:
    """What a job that ran bills, as its Describe* call reports it (pipeline/cost.py prices
    it). A training job: BillableTimeInSeconds ("the absolute wall-clock time ... Multiply
    BillableTimeInSeconds by the number of instances (InstanceCount)") and TrainingTimeInSeconds,
    spot savings from the two (DescribeTrainingJob, botocore's sagemaker service-2.json).
    DescribeProcessingJob reports no billable time: a processing job's is estimated as
    ProcessingEndTime - ProcessingStartTime on each of its instances. A request SageMaker
    refused, or a job that never started, bills nothing."""
    if kind == "training" and described.get("ResourceConfig"):
        resources = described["ResourceConfig"]
        billable, training = (
            described.get("BillableTimeInSeconds"),
            described.get("TrainingTimeInSeconds"),
        )
        record = {
            "job": described["TrainingJobName"],
            "use": "training",
            "instance_type": resources["InstanceType"],
            "instance_count": resources["InstanceCount"],
            "billable_seconds": billable,
            "training_seconds": training,
        }
        if described.get("EnableManagedSpotTraining"):
            record["spot_savings_percent"] = spot_savings(billable, training)
        return [record]
    cluster = (described.get("ProcessingResources") or {}).get("ClusterConfig")
    if kind == "processing" and cluster and described.get("ProcessingStartTime"):
        start, end = described["ProcessingStartTime"], described.get("ProcessingEndTime")
        seconds = max(1, round((end - start).total_seconds())) if end else None
        return [
            {
                "job": described["ProcessingJobName"],
                "use": "processing",
                "instance_type": cluster["InstanceType"],
                "instance_count": cluster["InstanceCount"],
                "billable_seconds": seconds,
                "estimated_from": "ProcessingStartTime to ProcessingEndTime",
            }
        ]
    return []


def trials_billed(backend, tuning_job: str, summaries: list[dict]) -> list[dict]:
    """A tuning job bills its training jobs: each trial's DescribeTrainingJob (the
    summaries ListTrainingJobsForHyperParameterTuningJob gives carry no billable time). A
    trial whose answer cannot be read is said and named in `backend.unbilled`: the run's
    cost is then a lower bound, never a total that leaves it out."""
    from botocore.exceptions import BotoCoreError, ClientError

    records = []
    for summary in summaries:
        trial = summary["TrainingJobName"]
        try:
            described = backend.client.describe_training_job(TrainingJobName=trial)
        except (ClientError, BotoCoreError) as e:
            backend.say(tuning_job, f"could not read what trial {trial} billed: {e}")
            backend.unbilled.append({"kind": "training", "job": trial})
            continue
        records += [{**b, "tuning_job": tuning_job} for b in billed("training", described)]
    return records
