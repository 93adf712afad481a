"""What a resumed run finds on SageMaker of the jobs its earlier driver started
(pipeline/backends/sagemaker.py asks, before the resumed run's first job and before each tuning
job).

A driver that dies (killed, its machine asleep or gone) stops nothing: SageMaker runs its jobs
on. A `--resume` that started new jobs beside them would pay twice, and two training jobs would
write one checkpoint folder. So the run's jobs that have not ended are asked to stop and waited
for (`left_running`): a training job checkpoints on the SIGTERM StopTrainingJob sends (SIGKILL
follows 120 s later, API_StopTrainingJob.html), and the resumed one goes on from there.

A tuning job's trials never go on from checkpoints: each is a training job of its own, which
nothing restarts. What the stopped tuning job's trials found is carried into the new one by
warm start instead (`warm_start`): the developer guide names "the previous hyperparameter
tuning job was stopped early or stopped unexpectedly" among its reasons
(automatic-model-tuning-warm-start.html).

A job is the run's when its name carries the run's label (jobs.job_name keeps it whole:
"<experiment>-<run>-<step>-...") and it writes under the run's folder: the account holds every
experiment's run of that number, from every store.
"""

from __future__ import annotations

import copy

from pipeline.backends.following import TERMINAL
from pipeline.backends.lost_create import identity, not_ours
from pipeline.jobs import KINDS

# CreateHyperParameterTuningJob's WarmStartConfig (HyperParameterTuningJobWarmStartConfig,
# botocore's sagemaker service-2.json): "Minimum number of 1 item. Maximum number of 5 items."
MOST_PARENTS = 5
# "Hyperparameter tuning uses either Bayesian or random search" in a warm start tuning job
# (automatic-model-tuning-warm-start.html): Grid and Hyperband tuning jobs start whole.
WARM_STRATEGIES = ("Bayesian", "Random")


def listed(client, kind: str, **filters) -> list[dict]:
    """Every summary List<Jobs> gives (ListTrainingJobs, ListProcessingJobs,
    ListHyperParameterTuningJobs: TrainingJobSummaries and so on), page after page."""
    from botocore import xform_name

    resource = KINDS[kind].resource
    pages = client.get_paginator(xform_name(f"List{resource}s")).paginate(**filters)
    return [s for page in pages for s in page.get(f"{resource}Summaries", [])]


def trial_summaries(client, name: str) -> list[dict]:
    """ListTrainingJobsForHyperParameterTuningJob of the tuning job `name`, every page
    (botocore's paginator; 100 a page, the most MaxResults takes)."""
    paginator = client.get_paginator("list_training_jobs_for_hyper_parameter_tuning_job")
    pages = paginator.paginate(HyperParameterTuningJobName=name, PaginationConfig={"PageSize": 100})
    return [s for page in pages for s in page.get("TrainingJobSummaries", [])]


def writes_under(kind: str, described: dict, uri: str) -> bool:
    """Whether the job a Describe* answer shows writes under `uri` (the run's folder)."""
    seen = identity(kind, described)
    if kind == "processing":
        written = list((seen["ProcessingOutputConfig.Outputs"] or {}).values())
    else:
        written = [seen["OutputDataConfig.S3OutputPath"]]
    return any(isinstance(w, str) and w.startswith(uri) for w in written)


def left_running(backend, run_uri: str, label: str) -> list[tuple[str, str]]:
    """(kind, name) of each job of the run (`label`, writing under `run_uri`) that SageMaker
    has not ended. A tuning job's trials are left out: they stop with it."""
    running: dict[str, str] = {}
    tuning: list[str] = []
    for kind in KINDS:
        for summary in listed(backend.client, kind, NameContains=f"-{label}-"):
            name = summary[KINDS[kind].name_member]
            tuning += [name] if kind == "tuning" else []
            if summary[KINDS[kind].status_member] not in TERMINAL:
                running[name] = kind
    found = []
    for name, kind in running.items():
        # "This name is the prefix for the names of all training jobs that this tuning job
        # launches" (HyperParameterTuningJobName, botocore's sagemaker service-2.json).
        if kind == "training" and any(name.startswith(f"{t}-") for t in tuning):
            continue
        if writes_under(kind, backend.describe_job(kind, name), run_uri):
            found.append((kind, name))
    return found


def ended_tuning_jobs(backend, name: str, label: str, request: dict) -> list[dict]:
    """The DescribeHyperParameterTuningJob answers of the tuning jobs this run started before
    with this very request (the same model, data, image, role and static hyperparameters:
    lost_create.not_ours) that have ended Completed or Stopped, newest first."""
    summaries = listed(
        backend.client,
        "tuning",
        NameContains=f"-{label}-tune-",
        SortBy="CreationTime",
        SortOrder="Descending",
    )
    earlier = [
        s["HyperParameterTuningJobName"]
        for s in summaries
        if s["HyperParameterTuningJobName"] != name
        and s["HyperParameterTuningJobStatus"] in ("Completed", "Stopped")
    ]
    described = (backend.describe_job("tuning", n) for n in earlier)
    return [d for d in described if not not_ours("tuning", request, d)]


def warm_start(request: dict, parents: list[dict]) -> tuple[dict, str]:
    """The tuning request warm-started from `parents` (ended_tuning_jobs) with the trials
    they completed taken off its budget, and what to say of it; the request as it is where
    it cannot be (no parents; a Grid or Hyperband search)."""
    config = request["HyperParameterTuningJobConfig"]
    if not parents:
        return request, "no earlier tuning job of this model ended in this account: all trials run"
    names = [p["HyperParameterTuningJobName"] for p in parents[:MOST_PARENTS]]
    if config["Strategy"] not in WARM_STRATEGIES:
        only = " and ".join(WARM_STRATEGIES)
        return request, (
            f"a {config['Strategy']} search is not warm-started (only {only} are): "
            f"all trials run again, {', '.join(names)} left as they ended"
        )
    done = sum(
        (p.get("TrainingJobStatusCounters") or {}).get("Completed", 0)
        for p in parents[:MOST_PARENTS]
    )
    limits = config["ResourceLimits"]
    asked = limits["MaxNumberOfTrainingJobs"]
    # At least one: MaxNumberOfTrainingJobs' shape has min 1 (botocore's service-2.json).
    left = max(1, asked - done)
    warmed = copy.deepcopy(request)
    warmed_limits = warmed["HyperParameterTuningJobConfig"]["ResourceLimits"]
    warmed_limits["MaxNumberOfTrainingJobs"] = left
    warmed_limits["MaxParallelTrainingJobs"] = min(limits["MaxParallelTrainingJobs"], left)
    # IDENTICAL_DATA_AND_ALGORITHM: "the same input data and training image as the parent
    # tuning jobs", and OverallBestTrainingJob then names the best of all their trials
    # (WarmStartType and OverallBestTrainingJob in botocore's sagemaker service-2.json).
    warmed["WarmStartConfig"] = {
        "ParentHyperParameterTuningJobs": [{"HyperParameterTuningJobName": n} for n in names],
        "WarmStartType": "IdenticalDataAndAlgorithm",
    }
    said = (
        f"warm-started from {', '.join(names)} ({done} trials completed there): "
        f"{left} of {asked} trials left to run"
    )
    return warmed, said
