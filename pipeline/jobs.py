"""What a job is, once, independent of where it runs; and the SageMaker request it becomes.

The driver builds each job once (image entry, code, inputs, outputs, hyperparameters,
resources, environment). `--dry-run` prints these very objects, and every backend runs them
through the same request: the SageMaker backend sends it, the emulated backend sends it to
moto and plays the container, the local backend plays it against the store directly.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pipeline.config import Data, Training
from pipeline.player.exits import Status
from pipeline.search_space import Tunable, most_epochs, parameter_ranges
from pipeline.service_model import job_name_part
from steps.runtime.names import (
    CHECKPOINT_DIR,
    ENTRYPOINT,
    PROCESSES_VARIABLE,
    PROCESSING_CODE_DIR,
    PROCESSING_INPUT_DIR,
    PROCESSING_OUTPUT_DIR,
    STEP_VARIABLE,
    TRIAL_CHECKPOINTS_VARIABLE,
)

JOB_NAME_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")  # SageMaker's rule
# The service model's maximum lengths of TrainingJobName / ProcessingJobName and of
# HyperParameterTuningJobName (botocore's sagemaker service-2.json; a test reads them there).
# SageMaker names each trial <tuning job>-NNN-<8 hex>, which fits 63 from 32.
JOB_NAME_LIMIT = 63
TUNING_JOB_NAME_LIMIT = 32
VOLUME_GB = 30
DIGEST_LENGTH = 6
# No setting bounds a processing job's run: each gets SageMaker's default
# StoppingCondition.MaxRuntimeInSeconds, "The default value is 1 day" (API_StoppingCondition.html).
PROCESSING_MAX_RUNTIME = 24 * 3600


def _setting(section, key: str):
    """The default of a setting, read off its section (pipeline/config_sections.py, the defaults
    settings.ini lists): a job built without that value is built as the settings would build
    it, with one default, in one place."""
    return section.model_fields[key].default


def job_name(
    experiment: str,
    run: str,
    step: str,
    *detail: str,
    limit: int = JOB_NAME_LIMIT,
    stamp: str | None = None,
    case_sensitive: bool = True,
) -> str:
    """A valid, traceable job name: experiment, run, step, model, trial, and a time stamp.

    When it is too long the experiment is shortened first, then the details, and six hex
    digits of a hash of the whole name are added: names that differ before shortening differ
    after it (`roberta-base` and `roberta-large` both shorten to `roberta`). SageMaker refuses
    a name used before in the account and region (ResourceInUse), and a job's CloudWatch log
    streams are named after it. The run, the step and the stamp are always kept whole.

    `case_sensitive=False`, for a name SageMaker compares without case (a tuning job's: "The
    name is not case sensitive", CreateHyperParameterTuningJob's HyperParameterTuningJobName in
    botocore's sagemaker service-2.json): a name with a capital letter carries the hash too, so
    experiments `News` and `news` never ask for the same name."""
    stamp = stamp or time.strftime("%H%M%S", time.gmtime())
    flexible = [job_name_part(p) for p in (experiment, *detail)]
    fixed = [job_name_part(run), job_name_part(step), stamp]

    def joined(suffix: str = "") -> str:
        parts = [flexible[0], *fixed[:2], *flexible[1:], fixed[2], suffix]
        return "-".join(p for p in parts if p)

    whole = joined()
    if len(whole) <= limit and (case_sensitive or whole == whole.lower()):
        return whole
    digest = hashlib.sha256(whole.encode()).hexdigest()[:DIGEST_LENGTH]
    while len(joined(digest)) > limit:
        longest = max(range(len(flexible)), key=lambda i: (len(flexible[i]), i == 0))
        if not flexible[longest]:
            raise ValueError(f"no valid job name fits {limit} characters")
        flexible[longest] = flexible[longest][:-1].rstrip("-")
    return joined(digest)


# What `job_name` ends a name it shortened with: the stamp, then the whole name's hash.
SHORTENED = re.compile(rf"-\d{{6}}-[0-9a-f]{{{DIGEST_LENGTH}}}$")


def named_for(name: str, experiment: str, run: str) -> bool:
    """Whether `name` can be one `job_name` gave a job of this experiment's run: the
    experiment's part, then the run's. The part may be cut from its end only in a name
    `job_name` shortened: one at its limit (or one under: a cut takes a hyphen with it) that
    ends in the stamp and the hash. A tuning job's trials are named after it ("This name is the
    prefix for the names of all training jobs that this tuning job launches",
    HyperParameterTuningJobName in botocore's sagemaker service-2.json): a trial of a shortened
    one begins with such a name. Another experiment whose part begins ours (`news` beside
    `news-v2`) is then known by its name, unless its own was shortened into ours: its folder
    decides (pipeline/backends/resuming.py).

    Compared without case: SageMaker compares a tuning job's name so ("The name is not case
    sensitive", ibid.), and has lowercased the names in its ARNs, which an IAM policy scoped
    to an experiment's jobs matches (boto/boto3#4606, aws/sagemaker-experiments#172)."""
    part, lowered = job_name_part(experiment).lower(), name.lower()
    marker = f"-{job_name_part(run)}-".lower()
    limits = (JOB_NAME_LIMIT, TUNING_JOB_NAME_LIMIT)
    cut = any(
        SHORTENED.search(lowered[:n])
        for limit in limits
        for n in (limit - 1, limit)
        if len(lowered) >= n
    )
    at = lowered.find(marker)
    while at > 0:
        head = lowered[:at]
        if head == part or (cut and part.startswith(head)):
            return True
        at = lowered.find(marker, at + 1)
    return False


@dataclass
class ProcessingJob:
    name: str
    step: str  # the module the entrypoint runs: steps/<step>.py (a dotted name: any module)
    code: str  # store prefix of the code the job runs (steps/ and the user functions)
    inputs: dict[str, str]  # input name -> store prefix (or an external URI: raw data)
    outputs: dict[str, str]  # output name -> store prefix it is uploaded to
    arguments: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # [data] INSTANCE_TYPE; inference's jobs take [inference]'s (the same default)
    instance_type: str = _setting(Data, "instance_type")
    max_run_seconds: int = PROCESSING_MAX_RUNTIME
    model: str = ""  # the model a per-model step works on (export)
    instance_count: int = 1
    # Inputs split across the instances by S3 key (`smpipe predict`'s texts); the others are
    # copied whole to every instance.
    sharded_inputs: tuple[str, ...] = ()

    kind = "processing"


@dataclass
class TrainingJob:
    name: str
    step: str
    code: str
    channels: dict[str, str]  # channel -> store prefix of a manifested directory
    hyperparameters: dict[str, str]
    model_prefix: str  # where the model directory lands in the run tree
    output_prefix: str  # where the output data directory lands
    checkpoint_prefix: str  # synced with /opt/ml/checkpoints
    sagemaker_output: str  # OutputDataConfig: SageMaker's <job>/output/model.tar.gz go here
    env: dict[str, str] = field(default_factory=dict)
    instance_type: str = _setting(Training, "instance_type")
    instance_count: int = _setting(Training, "instance_count")
    # [training] PROCESSES_PER_HOST where USE_DISTRIBUTED is true (false by default), else 1.
    processes_per_host: int | Literal["auto"] = 1
    use_spot: bool = _setting(Training, "use_spot")
    max_run_seconds: int = _setting(Training, "max_run_seconds")
    max_wait_seconds: int = _setting(Training, "max_wait_seconds")
    max_restarts: int = _setting(Training, "max_restarts")
    metric_definitions: dict[str, str] = field(default_factory=dict)
    # [training] KEEP_ALIVE_SECONDS: the warm pool it leaves
    keep_alive_seconds: int = _setting(Training, "keep_alive_seconds")

    kind = "training"


@dataclass
class TuningJob:
    name: str
    trial: TrainingJob  # what every trial runs, before the searched values are set
    ranges: dict[str, Tunable]  # hyperparameter -> its searched values (search_space.py)
    strategy: str
    objective_metric: str
    objective_type: str
    max_jobs: int
    max_parallel_jobs: int
    early_stopping: str = "Off"  # Off | Auto

    kind = "tuning"

    @property
    def max_epochs(self) -> int:
        """The most epochs a trial trains: Hyperband's largest resource, whether EPOCHS is a
        constant or searched."""
        return most_epochs(self.ranges, self.trial.hyperparameters.get("epochs", "1"))


# -- the SageMaker requests -----------------------------------------------------------------

UriOf = Callable[[str], str]


def processing_request(job: ProcessingJob, image: str, role: str, uri_of: UriOf) -> dict:
    """CreateProcessingJob: the image's entrypoint runs `process <step> <arguments>`."""

    def s3_input(name: str, uri: str, local: str) -> dict:
        # ShardedByS3Key: "the data from Amazon S3 is sharded by Amazon S3 key, downloading one
        # shard of data to each processing instance"; FullyReplicated: all of it to every one
        # (API_ProcessingS3Input.html; botocore's ProcessingS3DataDistributionType enum).
        sharded = name in job.sharded_inputs
        s3 = {
            "S3Uri": uri,
            "LocalPath": local,
            "S3DataType": "S3Prefix",
            "S3InputMode": "File",
            "S3DataDistributionType": "ShardedByS3Key" if sharded else "FullyReplicated",
        }
        return {"InputName": name, "S3Input": s3}

    inputs = [s3_input("code", uri_of(job.code), PROCESSING_CODE_DIR)]
    for name, source in job.inputs.items():
        inputs.append(
            s3_input(
                name,
                source if "://" in source or source.startswith("/") else uri_of(source),
                f"{PROCESSING_INPUT_DIR}/{name}",
            )
        )
    outputs = [
        {
            "OutputName": name,
            "S3Output": {
                "S3Uri": uri_of(prefix),
                "LocalPath": f"{PROCESSING_OUTPUT_DIR}/{name}",
                "S3UploadMode": "EndOfJob",
            },
        }
        for name, prefix in job.outputs.items()
    ]
    return {
        "ProcessingJobName": job.name,
        "RoleArn": role,
        "AppSpecification": {
            "ImageUri": image,
            "ContainerEntrypoint": list(ENTRYPOINT),
            "ContainerArguments": ["process", job.step, *job.arguments],
        },
        "ProcessingResources": {
            "ClusterConfig": {
                "InstanceCount": job.instance_count,
                "InstanceType": job.instance_type,
                "VolumeSizeInGB": VOLUME_GB,
            }
        },
        "ProcessingInputs": inputs,
        "ProcessingOutputConfig": {"Outputs": outputs},
        "Environment": dict(job.env),
        "StoppingCondition": {"MaxRuntimeInSeconds": job.max_run_seconds},
    }


def _definition(job: TrainingJob, image: str, role: str, uri_of: UriOf) -> dict:
    """What a training job and a tuning job's trials have in common."""

    def channel(name: str, prefix: str) -> dict:
        s3 = {
            "S3DataType": "S3Prefix",
            "S3Uri": uri_of(prefix),
            "S3DataDistributionType": "FullyReplicated",
        }
        return {"ChannelName": name, "InputMode": "File", "DataSource": {"S3DataSource": s3}}

    stopping = {"MaxRuntimeInSeconds": job.max_run_seconds}
    if job.use_spot:
        stopping["MaxWaitTimeInSeconds"] = job.max_wait_seconds
    return {
        "AlgorithmSpecification": {
            "TrainingImage": image,
            "TrainingInputMode": "File",
            "MetricDefinitions": [
                {"Name": k, "Regex": v} for k, v in job.metric_definitions.items()
            ],
        },
        "RoleArn": role,
        "InputDataConfig": [
            channel("code", job.code),
            *(channel(c, p) for c, p in job.channels.items()),
        ],
        "OutputDataConfig": {"S3OutputPath": uri_of(job.sagemaker_output)},
        "ResourceConfig": {
            "InstanceType": job.instance_type,
            "InstanceCount": job.instance_count,
            "VolumeSizeInGB": VOLUME_GB,
        },
        "StoppingCondition": stopping,
        "EnableManagedSpotTraining": job.use_spot,
        "CheckpointConfig": {
            "S3Uri": uri_of(job.checkpoint_prefix),
            "LocalPath": CHECKPOINT_DIR,
        },
        "Environment": {
            STEP_VARIABLE: job.step,
            PROCESSES_VARIABLE: str(job.processes_per_host),
            **job.env,
        },
    }


# SageMaker managed warm pools (https://docs.aws.amazon.com/sagemaker/latest/dg/
# train-warm-pools.html): a training job whose ResourceConfig has KeepAlivePeriodInSeconds > 0
# leaves its instances up that long, billed, for the next training job with the same RoleArn,
# ResourceConfig (InstanceCount, InstanceType, VolumeKmsKeyId, VolumeSizeInGB), VpcConfig and
# network flags; each job of the chain must ask again. Training jobs only: the Considerations
# exclude spot instances (and heterogeneous clusters, not sent here), and a tuning job's trials
# use warm pools by default, with no KeepAlivePeriodInSeconds ("HyperParameterTuningResourceConfig
# supports the capabilities of ResourceConfig with the exception of KeepAlivePeriodInSeconds",
# botocore's sagemaker service-2.json). Processing jobs have no such member.
def keep_alive_refused(job) -> str | None:
    """Why [training] KEEP_ALIVE_SECONDS is not sent with `job`; None when it is (or is 0)."""
    trial = job.trial if job.kind == "tuning" else job
    if job.kind == "processing" or not trial.keep_alive_seconds:
        return None
    if job.kind == "tuning":
        return (
            "[training] KEEP_ALIVE_SECONDS is not sent with a tuning job: SageMaker reuses "
            "instances between its trials by itself and takes no KeepAlivePeriodInSeconds there"
        )
    if job.use_spot:
        return (
            "[training] KEEP_ALIVE_SECONDS is not sent with USE_SPOT = true: SageMaker's warm "
            "pools cannot be used with spot instances (train-warm-pools.html)"
        )
    return None


def training_request(job: TrainingJob, image: str, role: str, uri_of: UriOf) -> dict:
    """CreateTrainingJob: SageMaker runs the image with `train`, as for any training image;
    with a warm pool kept after it when [training] KEEP_ALIVE_SECONDS asks for one."""
    request = {
        "TrainingJobName": job.name,
        "HyperParameters": dict(job.hyperparameters),
        **_definition(job, image, role, uri_of),
    }
    if job.keep_alive_seconds and keep_alive_refused(job) is None:
        request["ResourceConfig"]["KeepAlivePeriodInSeconds"] = job.keep_alive_seconds
    return request


def tuning_request(job: TuningJob, image: str, role: str, uri_of: UriOf) -> dict:
    """CreateHyperParameterTuningJob: every trial is the training job above with the searched
    hyperparameters set, and its checkpoints in a folder of its own."""
    limits = {"MaxParallelTrainingJobs": job.max_parallel_jobs}
    if job.strategy != "Grid":  # a grid search runs every combination; SageMaker counts them
        limits["MaxNumberOfTrainingJobs"] = job.max_jobs
    # Hyperband's resource is epochs (a trial reports its objective once an epoch). AWS infers
    # MaxResource from a static `epochs` hyperparameter, and refuses the job when epochs is
    # searched and none is given (API_HyperbandStrategyConfig.html): it is always given.
    hyperband = {}
    if job.strategy == "Hyperband":
        resources = {"MinResource": 1, "MaxResource": job.max_epochs}
        hyperband = {"StrategyConfig": {"HyperbandStrategyConfig": resources}}
    definition = _definition(job.trial, image, role, uri_of)
    definition["Environment"][TRIAL_CHECKPOINTS_VARIABLE] = "1"
    definition["StaticHyperParameters"] = {
        k: v for k, v in job.trial.hyperparameters.items() if k not in job.ranges
    }
    return {
        "HyperParameterTuningJobName": job.name,
        "HyperParameterTuningJobConfig": {
            "Strategy": job.strategy,
            "HyperParameterTuningJobObjective": {
                "Type": job.objective_type,
                "MetricName": job.objective_metric,
            },
            "ResourceLimits": limits,
            "ParameterRanges": parameter_ranges(job.ranges),
            "TrainingJobEarlyStoppingType": job.early_stopping,
            **hyperband,
        },
        "TrainingJobDefinition": definition,
    }


@dataclass(frozen=True)
class Kind:
    """One kind of job as SageMaker's API names it: its request, and the resource whose name
    every operation and member on it carries (botocore's sagemaker service-2.json:
    CreateTrainingJob, DescribeTrainingJob, StopTrainingJob, TrainingJobName,
    TrainingJobStatus). A client's method is the operation in snake case (botocore.xform_name:
    create_training_job); the AWS CLI's, in kebab case."""

    build: Callable[..., dict]  # (job, image, role, uri_of) -> the Create* request
    resource: str  # TrainingJob

    @property
    def create(self) -> str:
        return f"Create{self.resource}"

    @property
    def describe(self) -> str:
        return f"Describe{self.resource}"

    @property
    def stop(self) -> str:
        return f"Stop{self.resource}"

    @property
    def name_member(self) -> str:
        return f"{self.resource}Name"

    @property
    def status_member(self) -> str:
        return f"{self.resource}Status"


KINDS = {
    "processing": Kind(processing_request, "ProcessingJob"),
    "training": Kind(training_request, "TrainingJob"),
    "tuning": Kind(tuning_request, "HyperParameterTuningJob"),
}


def request_for(job, image: str, role: str, uri_of: UriOf) -> dict:
    """The request a job of any kind becomes: every backend sends or plays this one."""
    return KINDS[job.kind].build(job, image, role, uri_of)


# -- what a job reports back ------------------------------------------------------------------


@dataclass
class JobResult:
    name: str
    status: Status
    failure_reason: str | None
    start_time: float
    end_time: float
    peak_memory_mb: float | None = None
    restarts: int = 0
    log_key: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    details: dict = field(default_factory=dict)  # what a tuning job reports of its trials
    # What it used, one record per billed thing (a job, a tuning trial, a warm pool): the
    # backend's own terms, priced in pipeline/cost.py.
    billing: list[dict] = field(default_factory=list)
    # A failed local job's folder, kept on this machine for inspection (backends/local.py).
    kept_folder: str | None = None

    @property
    def seconds(self) -> float:
        return round(self.end_time - self.start_time, 3)


class JobFailed(RuntimeError):
    def __init__(self, result: JobResult, step: str):
        self.result = result
        self.step = step
        super().__init__(f"step '{step}': job {result.name} failed: {result.failure_reason}")
