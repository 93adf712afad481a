"""SageMaker managed warm pools, as the emulated backend plays them for the training jobs moto
accepts. Every rule here is the developer guide's (https://docs.aws.amazon.com/sagemaker/
latest/dg/train-warm-pools.html, "How it works" and "Considerations") or the API reference's
(API_WarmPoolStatus.html; botocore's sagemaker service-2.json, WarmPoolStatus), read from AWS
and never from this project's driver:

- a training job whose ResourceConfig has KeepAlivePeriodInSeconds > 0 leaves its instances
  Available that long once it ends, whether it completed, was stopped, or failed by its
  algorithm or a client error ("Warm pool creation");
- the next training job that matches it ("Matching training jobs") starts on them: the pool
  "moves from the first training job to the second", the first's WarmPoolStatus becomes
  Reused (ReusedByJob, ResourceRetainedBillableTimeInSeconds) and the second's InUse; the
  pool then lives on with the second job's own KeepAlivePeriodInSeconds, and spins down when
  that job has none;
- a pool no job reused in time is Terminated, with the seconds it was kept; so is one whose
  instances have run consecutive jobs for 28 days ("Maximum warm pool duration");
- spot jobs and heterogeneous clusters neither leave nor take a pool ("Considerations").

Not played: the account's warm pool quota (AWS's default is 0, "a warm pool is not retained"
until an increase is granted), UpdateTrainingJob (moto has none), and the start-up a reused
pool saves: the emulator provisions nothing for any job, and SageMaker documents no
SecondaryStatusTransitions of its own for a reused pool (status messages "are subject to
change", API_SecondaryStatusTransition.html). A tuning job's trials take no part: "Hyperparameter
tuning jobs use warm pools by default" (HyperParameterTuningResourceConfig), by rules of their
own the documentation does not give.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

# "the maximum length of time that a warm pool cluster can continue running consecutive
# training jobs" (train-warm-pools.html, Maximum warm pool duration: 28 days on the live page;
# its 2023 text in awsdocs/amazon-sagemaker-developer-guide said 7).
POOL_LIFETIME_SECONDS = 28 * 24 * 3600
MATCHED_RESOURCES = ("InstanceCount", "InstanceType", "VolumeKmsKeyId", "VolumeSizeInGB")


def pool_match(request: dict) -> tuple:
    """What a later training job must repeat to start on a job's pool. "The next training job
    is a match if the following values are identical: RoleArn; ResourceConfig values:
    InstanceCount, InstanceType, VolumeKmsKeyId, VolumeSizeInGB; VpcConfig values:
    SecurityGroupIds, Subnets; EnableInterContainerTrafficEncryption; EnableNetworkIsolation"
    (train-warm-pools.html, Matching training jobs)."""
    resources, vpc = request["ResourceConfig"], request.get("VpcConfig") or {}
    return (
        request.get("RoleArn"),
        *(resources.get(key) for key in MATCHED_RESOURCES),
        tuple(vpc.get("SecurityGroupIds", ())),
        tuple(vpc.get("Subnets", ())),
        bool(request.get("EnableInterContainerTrafficEncryption")),
        bool(request.get("EnableNetworkIsolation")),
    )


def pools_apply(request: dict) -> bool:
    """Whether a job takes part: warm pools "cannot be used with heterogeneous cluster
    training" nor "with spot instances" (train-warm-pools.html, Considerations)."""
    spot = request.get("EnableManagedSpotTraining")
    return not spot and not request["ResourceConfig"].get("InstanceGroups")


@dataclass
class Pool:
    match: tuple  # pool_match of the job that left it
    kept_since: float  # when that job ended
    keep_alive: int  # that job's KeepAlivePeriodInSeconds
    launched: float  # when its instances were provisioned, for the first job of the chain


class WarmPools:
    """The emulated account's warm pools, each held by the training job that left it; the
    WarmPoolStatus of moto's records is set as DescribeTrainingJob reports it."""

    def __init__(self, jobs: dict) -> None:
        self._jobs = jobs  # moto's training jobs, by name
        self._kept: dict[str, Pool] = {}  # job -> the Available pool it left
        self._launched: dict[str, float] = {}  # running job -> when its instances came up
        self._lock = threading.Lock()

    def start(self, name: str, request: dict) -> None:
        """A training job starts: on the oldest Available pool that matches it, else on new
        instances (the first job of a chain "cold-starts a cluster with typical startup
        times", Warm pool lifecycle)."""
        if not pools_apply(request):
            return
        now, match = time.time(), pool_match(request)
        with self._lock:
            self._expire(now)
            held = next((h for h, pool in self._kept.items() if pool.match == match), None)
            if held is None:
                self._launched[name] = now
                return
            pool = self._kept.pop(held)
            self._launched[name] = pool.launched
            self._jobs[held].warm_pool_status = {
                "Status": "Reused",
                "ReusedByJob": name,
                "ResourceRetainedBillableTimeInSeconds": round(now - pool.kept_since),
            }
            self._jobs[name].warm_pool_status = {"Status": "InUse"}

    def end(self, name: str, request: dict) -> None:
        """A training job ends: its instances kept, Available, for its KeepAlivePeriodInSeconds
        when it asks for more than 0; else a pool it started on spins down ("If no
        KeepAlivePeriodInSeconds is specified, then the warm pool spins down after the
        training job completes", Maximum warm pool duration)."""
        keep = request["ResourceConfig"].get("KeepAlivePeriodInSeconds") or 0
        with self._lock:
            launched, job = self._launched.pop(name, None), self._jobs[name]
            if launched is not None and keep > 0:
                self._kept[name] = Pool(pool_match(request), time.time(), keep, launched)
                job.warm_pool_status = {"Status": "Available"}
            elif getattr(job, "warm_pool_status", None):
                job.warm_pool_status = {
                    "Status": "Terminated",
                    "ResourceRetainedBillableTimeInSeconds": 0,
                }

    def expire(self) -> None:
        """Before any look at the jobs (DescribeTrainingJob, ListTrainingJobs): the pools whose
        time is up are Terminated by then."""
        with self._lock:
            self._expire(time.time())

    def _expire(self, now: float) -> None:
        """Terminated: "terminated for exceeding the specified KeepAlivePeriodInSeconds"
        (API_WarmPoolStatus.html), or past POOL_LIFETIME_SECONDS; its billable time is how long
        it was kept."""
        for held, pool in list(self._kept.items()):
            ends = min(pool.kept_since + pool.keep_alive, pool.launched + POOL_LIFETIME_SECONDS)
            if now >= ends:
                del self._kept[held]
                self._jobs[held].warm_pool_status = {
                    "Status": "Terminated",
                    "ResourceRetainedBillableTimeInSeconds": round(ends - pool.kept_since),
                }
