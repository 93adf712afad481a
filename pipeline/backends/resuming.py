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

A job is the run's when its name is one jobs.job_name gives this experiment's run
("<experiment>-<run>-<step>-...": jobs.named_for), so that no other experiment's job is
described (but one whose name was cut to SageMaker's length into a beginning of ours), and
it writes under the run's folder: the account holds every experiment's run of
that number, from every store.
"""

from __future__ import annotations

import copy
import time

from pipeline import tuning_record
from pipeline.backend import Earlier
from pipeline.backends.billing import billed, trials_billed
from pipeline.backends.following import TERMINAL, Followed, Following
from pipeline.backends.lost_create import identity, not_ours
from pipeline.errors import PipelineError
from pipeline.jobs import KINDS, named_for

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


def made_after(earlier: Earlier):
    """The time the run's jobs were all made after, by AWS's clock: within five minutes of
    ours, or no request is taken ("a request must reach AWS within five minutes of the time
    stamp in the request", IAM User Guide, reference_aws-signing.html); an hour of margin all
    the same. Another run that once had this number (its folder removed, the number taken
    again) made its jobs before."""
    from datetime import UTC, datetime

    return datetime.fromtimestamp(earlier.started - 3600, UTC)


def uncounted(backend, earlier: Earlier) -> list[tuple[str, str, bool]]:
    """(kind, name, still running) of each job of the run (named for it, `jobs.named_for`,
    and writing under its folder) that the run holds no bill of (`earlier.counted`): one left
    running, and one that ended while no driver followed it; and ("pool", name, False) for each
    of its training jobs that kept a warm pool the run holds no bill of (`earlier.pools`: a driver
    records it when the next training job ends). A tuning job's trials are its own: they stop
    with it, and its bill is theirs."""
    run, counted = backend.run, earlier.counted
    after = made_after(earlier)
    entries: list[tuple[str, str, bool]] = []
    tuning: list[str] = []
    for kind in KINDS:
        summaries = listed(
            backend.client, kind, NameContains=f"-{run.label}-", CreationTimeAfter=after
        )
        for summary in summaries:
            name = summary[KINDS[kind].name_member]
            if not named_for(name, run.experiment, run.label):
                continue  # another experiment's run of this number: not described
            tuning += [name] if kind == "tuning" else []
            running = summary[KINDS[kind].status_member] not in TERMINAL
            if running or name not in counted:
                entries.append((kind, name, running))
            if kind == "training" and not running and name not in earlier.pools:
                entries.append(("pool", name, False))
    found, seen = [], {}
    for kind, name, running in entries:
        # "This name is the prefix for the names of all training jobs that this tuning job
        # launches" (HyperParameterTuningJobName, botocore's sagemaker service-2.json).
        if kind in ("training", "pool") and any(name.startswith(f"{t}-") for t in tuning):
            continue
        api = "training" if kind == "pool" else kind
        if name not in seen:
            seen[name] = backend.describe_job(api, name)
        if kind == "pool" and not kept_pool(seen[name]):
            continue
        if writes_under(api, seen[name], backend.store.uri_of(run.prefix)):
            found.append((kind, name, running))
    return found


def kept_pool(described: dict) -> bool:
    """Whether a training job kept a warm pool: still Available, or kept for a time
    (WarmPoolStatus, API_WarmPoolStatus.html)."""
    status = described.get("WarmPoolStatus") or {}
    return status.get("Status") == "Available" or bool(pool_bill(described))


def pool_bill(described: dict) -> list[dict]:
    """The warm pool a training job left, billed as training compute for the seconds it was
    kept ("ResourceRetainedBillableTimeInSeconds * InstanceCount", WarmPoolStatus in botocore's
    sagemaker service-2.json), as SageMakerBackend's WarmPools records it; [] while none is
    known (none kept, or still Available)."""
    kept = (described.get("WarmPoolStatus") or {}).get("ResourceRetainedBillableTimeInSeconds")
    if not kept:
        return []
    resources = described["ResourceConfig"]
    return [
        {
            "job": described["TrainingJobName"],
            "use": "warm pool",
            "instance_type": resources["InstanceType"],
            "instance_count": resources["InstanceCount"],
            "billable_seconds": kept,
        }
    ]


def resumed(backend, earlier: Earlier) -> list[dict]:
    """What a resumed run's earlier driver left on SageMaker (SageMakerBackend.resumed): each
    job still running asked to stop and waited for, all first, before the run starts a job
    beside them; then the bill read of every job the run holds no record of
    (`earlier.counted`): those, the ones that ended while no driver followed them, and the
    `earlier.unbilled` ones (stopped with their driver). One that cannot be read stays in
    `backend.unbilled`."""
    from botocore.exceptions import BotoCoreError, ClientError

    run, unbilled = backend.run, earlier.unbilled
    try:
        found = uncounted(backend, earlier)
    except (ClientError, BotoCoreError) as e:
        raise PipelineError(
            f"--resume {run.run_num}: the run's jobs that SageMaker may still run "
            f"could not be listed ({e}); a resumed run would start its jobs beside them"
        ) from None
    left = [(kind, name) for kind, name, running in found if running]
    unbilled_names = {job["job"] for job in unbilled}
    named = unbilled_names | {name for _, name in left}  # said of already
    fresh = [{"kind": k, "job": n} for k, n, _ in found]
    waiting = [*unbilled, *(job for job in fresh if job not in unbilled)]
    bills, read, asked = [], [], []
    try:
        for kind, name in left:  # every one asked first: none bills on while another drains
            backend.say(name, f"{kind} job still running from before the run was resumed: stopping")
            backend.stop_job(name, kind)
            asked.append((kind, name))  # a Ctrl-C in the call may land before its request left
        for kind, name in left:
            following = Following(backend, kind, name, time.time())
            following.logs_off = True  # its log so far is SageMaker's, read where it is
            backend.say(name, f"ended {following.to_the_end().status}")
        for job in waiting:
            bill = bill_of(backend, job["kind"], job["job"], earlier.counted | unbilled_names)
            read += [job] if bill is not None else []  # else: the cost stays a lower bound
            bills += bill or []
            if job["kind"] == "pool":
                said = "its warm pool's kept time, recorded by no driver, read now"
                said = said if bill else "its warm pool is still kept: its time is not known yet"
                backend.say(job["job"], said)
            elif bill and job["job"] not in named:
                backend.say(job["job"], "ended while no driver followed it: its bill read now")
    except BaseException:  # Ctrl-C: each is asked to stop, as the driver's own jobs are
        backend.unbilled += waiting  # none is billed yet; said first, should another Ctrl-C come
        for kind, name in left:  # the one whose call was cut, again: asking twice is harmless
            if (kind, name) not in asked:
                backend.stop_job(name, kind)
        raise
    backend.unbilled += [job for job in waiting if job not in read]
    return bills


def bill_of(backend, kind: str, name: str, known: set[str]) -> list[dict] | None:
    """What a job billed, now that it has ended (a tuning job's: those of its trials not
    `known`, which the run holds a record of or names unbilled, each read on its own; a
    "pool": the time a training job's warm pool was kept); None, said, where it cannot be read
    (an emulated account's job after its driver ended; a pool still kept)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        if kind == "pool":  # None while it is kept: its time is not known yet
            described = backend.describe_job("training", name)
            return pool_bill(described) or None
        if kind == "tuning":
            trials = trial_summaries(backend.client, name)
            fresh = [s for s in trials if s["TrainingJobName"] not in known]
            return trials_billed(backend, name, fresh)
        return billed(kind, backend.describe_job(kind, name))
    except (ClientError, BotoCoreError) as e:
        backend.say(name, f"could not read what it billed: {e}")
        return None


def warm_started(backend, job, request: dict) -> tuple[dict | None, list[dict]]:
    """A resumed run's tuning job (`warm_start`): the checkpoints of the trials its earlier
    tuning jobs left are removed (nothing resumes a trial), and its request warm-started from
    them, or None where they searched it all; and the parents it draws on."""
    for key in backend.store.list_keys(job.trial.checkpoint_prefix):
        backend.store.delete(key)
    parents = ended_tuning_jobs(backend, job.name, backend.earlier, request)
    request, parents, said = warm_start(request, parents)
    backend.say(job.name, said)
    return request, parents


def ended_tuning_jobs(backend, name: str, earlier: Earlier, request: dict) -> list[dict]:
    """The DescribeHyperParameterTuningJob answers of the tuning jobs this run started before
    with this very request (the same model, data, image, role and static hyperparameters:
    lost_create.not_ours) that have ended Completed or Stopped, newest first."""
    summaries = listed(
        backend.client,
        "tuning",
        NameContains=f"-{backend.run.label}-tune-",
        CreationTimeAfter=made_after(earlier),
        SortBy="CreationTime",
        SortOrder="Descending",
    )
    names = [
        s["HyperParameterTuningJobName"]
        for s in summaries
        if s["HyperParameterTuningJobName"] != name
        and named_for(s["HyperParameterTuningJobName"], backend.run.experiment, backend.run.label)
        and s["HyperParameterTuningJobStatus"] in ("Completed", "Stopped")
    ]
    described = (backend.describe_job("tuning", n) for n in names)
    return [d for d in described if not not_ours("tuning", request, d)]


def searched_before(job, parents: list[dict]) -> Followed:
    """A resumed run's tuning job whose parents searched it all (`warm_start` gave no
    request): no tuning job is created, and the one among them whose best trial is best is
    adopted as if it had just ended (its Describe answer untouched; Completed: its trials ran)."""
    adopted = tuning_record.best_answer(parents, job.objective_type)  # warm_start found one
    said = f"adopted the best trial of {adopted['HyperParameterTuningJobName']}: no trial ran again"
    return Followed("Completed", adopted, time.time(), log=[said])


def warm_start(request: dict, parents: list[dict]) -> tuple[dict | None, list[dict], str]:
    """The tuning request warm-started from `parents` (ended_tuning_jobs) with the trials
    they completed taken off its budget, the parents it names, and what to say of it. None
    where they searched it all (one of them Completed: the search ran to its end; or they
    completed every trial asked): their best is adopted and no trial runs again. The request as
    it is, no parent, where it cannot be warm-started (none ended; a Grid or Hyperband search)."""
    config = request["HyperParameterTuningJobConfig"]
    if not parents:
        return (
            request,
            [],
            "no earlier tuning job of this model ended in this account: all trials run",
        )
    limits = config["ResourceLimits"]
    asked = limits.get("MaxNumberOfTrainingJobs")  # a Grid search may leave it out
    why = searched_all(request, parents, asked)
    if why:
        return (
            None,
            parents,
            f"not searched again: {why}; the best trial of {_names(parents)} is adopted",
        )
    parents = parents[:MOST_PARENTS]
    if config["Strategy"] not in WARM_STRATEGIES:
        only = " and ".join(WARM_STRATEGIES)
        return (
            request,
            [],
            (
                f"a {config['Strategy']} search is not warm-started (only {only} are): "
                f"all trials run again, {_names(parents)} left as they ended"
            ),
        )
    done = sum((p.get("TrainingJobStatusCounters") or {}).get("Completed", 0) for p in parents)
    # At least one: MaxNumberOfTrainingJobs' shape has min 1 (botocore's service-2.json), and
    # parents that completed every trial with no best one are searched again.
    left = max(1, asked - done)
    warmed = copy.deepcopy(request)
    warmed_limits = warmed["HyperParameterTuningJobConfig"]["ResourceLimits"]
    warmed_limits["MaxNumberOfTrainingJobs"] = left
    warmed_limits["MaxParallelTrainingJobs"] = min(limits["MaxParallelTrainingJobs"], left)
    # IDENTICAL_DATA_AND_ALGORITHM: "the same input data and training image as the parent
    # tuning jobs", and OverallBestTrainingJob then names the best of all their trials
    # (WarmStartType and OverallBestTrainingJob in botocore's sagemaker service-2.json).
    warmed["WarmStartConfig"] = {
        "ParentHyperParameterTuningJobs": [
            {"HyperParameterTuningJobName": p["HyperParameterTuningJobName"]} for p in parents
        ],
        "WarmStartType": "IdenticalDataAndAlgorithm",
    }
    said = (
        f"warm-started from {_names(parents)} ({done} trials completed there): "
        f"{left} of {asked} trials left to run"
    )
    return warmed, parents, said


def searched_all(request: dict, parents: list[dict], asked: int | None) -> str | None:
    """Why `parents` searched it all (one ended Completed: its search ran to its end; or they
    completed every trial asked), where one of them found a best trial; None otherwise: a
    parent that completed with no best would fail every resume the same way."""
    done = sum((p.get("TrainingJobStatusCounters") or {}).get("Completed", 0) for p in parents)
    ended = [
        p["HyperParameterTuningJobName"]
        for p in parents
        if p["HyperParameterTuningJobStatus"] == "Completed"
    ]
    if not tuning_record.best_answer(parents, _objective_type(request)):
        return None
    if ended:
        return f"{ended[0]} completed its search"
    return f"{done} of {asked} trials completed" if asked and done >= asked else None


def _objective_type(request: dict) -> str:
    return request["HyperParameterTuningJobConfig"]["HyperParameterTuningJobObjective"]["Type"]


def _names(parents: list[dict]) -> str:
    return ", ".join(p["HyperParameterTuningJobName"] for p in parents)
