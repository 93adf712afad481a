"""What no one section of the settings can check alone: the rules across sections, what the
sagemaker backend and a tuning job need of the others, and each setting that becomes a field
of a SageMaker request against that field's limits in the service model
(pipeline/service_model.py), said by section and key before any plan is made.

pipeline/config.py calls `across_sections` and `sagemaker_limits` with its sections as typed
models (`parsed`), each model's searched ranges (`spaces`: model -> its section, its ranges)
and the ranges its own section sets (`own`); a section with problems of its own is not in
`parsed`, and its rules here are skipped.
"""

from __future__ import annotations

import math
import re
import shlex

from pydantic import BaseModel

from pipeline.errors import NOT_UTF8, as_bytes, log, not_utf8
from pipeline.search_space import SECTION as HP
from pipeline.search_space import Categorical, Interval, Tunable
from pipeline.service_model import check_value, shape
from steps.hyperparameters import LORA_ONLY
from steps.metrics import DEFINITIONS as METRIC_DEFINITIONS


def across_sections(
    parsed: dict[str, BaseModel],
    spaces: dict[str, tuple[str, dict[str, Tunable]]],
    own: dict[str, dict[str, Tunable]],
    metrics: dict[str, str],
    source: str = "settings.ini",
) -> list[str]:
    """What no one section can check alone, as one flat list of rules, each a few lines (the
    backend's and the tuning job's apart). `spaces`: each model's section and searched ranges,
    `own`: the ranges its own section sets; `source`: the settings file, as the commands a
    problem suggests name it."""
    problems: list[str] = []
    if "data" in parsed:
        d = parsed["data"]
        total = d.train_fraction + d.validation_fraction + d.test_fraction
        if abs(total - 1.0) > 1e-6:
            problems.append(
                "[data] TRAIN_FRACTION + VALIDATION_FRACTION + TEST_FRACTION must sum to 1 "
                f"(got {total:g})"
            )
    problems += _sagemaker_needs(parsed, shlex.quote(source))
    problems += _tuning_needs(parsed, spaces, own)
    if "tuning" in parsed and parsed["tuning"].objective_metric not in metrics:
        problems.append(
            f"[tuning] OBJECTIVE_METRIC: {parsed['tuning'].objective_metric!r} is not a metric "
            f"(train.py prints {', '.join(METRIC_DEFINITIONS)}; [tuning.metric_definitions] "
            f"defines {', '.join(k for k in metrics if k not in METRIC_DEFINITIONS) or 'no other'})"
        )
    if "training" in parsed and "inference" in parsed:
        formats, needed = parsed["training"].exports, parsed["inference"].model_format
        if formats and needed not in formats:
            problems.append(
                f"[training] EXPORTS ({', '.join(formats)}) leaves out {needed}, the program "
                f"[inference] MODEL_FORMAT runs: add it, or leave EXPORTS empty"
            )
    if "training" in parsed:
        t = parsed["training"]
        if t.instance_count > 1 and not t.use_distributed:
            problems.append("[training] INSTANCE_COUNT > 1 needs USE_DISTRIBUTED = true")
        if t.use_spot and t.max_wait_seconds < t.max_run_seconds:
            problems.append(
                f"[training] MAX_WAIT_SECONDS ({t.max_wait_seconds}) must be at least "
                f"MAX_RUN_SECONDS ({t.max_run_seconds}): SageMaker's MaxWaitTimeInSeconds "
                "includes the run"
            )
    return problems


def lora_keys_unused(
    shared: BaseModel,
    training: dict[str, BaseModel],
    raw: dict[str, dict[str, str]],
    spaces: dict[str, tuple[str, dict[str, Tunable]]],
) -> list[str]:
    """A LORA_* key set off its default, or searched, where no model it applies to has
    FINETUNING = lora: a setting that would change nothing. `shared`: [training]; `training`:
    each model of MODEL_NAMES -> [training] with its own section applied; `raw`: the file's
    sections (keys in lower case), to know which section set a key."""
    lora = {model: t.finetuning == "lora" for model, t in training.items()}

    def changed(section: BaseModel, key: str) -> bool:
        return getattr(section, key) != type(section).model_fields[key].default

    def methods(models: list[str]) -> str:
        return ", ".join(f"{m}: {training[m].finetuning}" for m in models)

    problems = []
    for key in LORA_ONLY:
        # [training] KEY applies to each model whose own section does not set it again.
        applies = [m for m in lora if key not in raw.get(f"training.{m}", {})]
        if changed(shared, key) and applies and not any(lora[m] for m in applies):
            problems.append(
                f"[training] {key.upper()} = {getattr(shared, key)}, but no model it applies "
                f"to has FINETUNING = lora ({methods(applies)}): set FINETUNING = lora, or "
                "leave it at its default"
            )
        for model, own in training.items():
            if key in raw.get(f"training.{model}", {}) and changed(own, key) and not lora[model]:
                problems.append(
                    f"[training.{model}] {key.upper()} = {getattr(own, key)}, but {model} has "
                    f"FINETUNING = {own.finetuning}: set FINETUNING = lora, or remove it"
                )
            section, ranges = spaces.get(model, (HP, {}))
            section = section if key in raw.get(section, {}) else HP  # its own, or the shared
            if key in ranges and not lora[model]:
                problems.append(
                    f"[{section}] {key.upper()} is searched for {model}, which has FINETUNING = "
                    f"{own.finetuning}: a tuning job would vary nothing"
                )
    return problems


def _sagemaker_needs(parsed: dict[str, BaseModel], source: str) -> list[str]:
    """What the sagemaker backend needs of the other sections."""
    problems: list[str] = []
    if not ("experiment" in parsed and parsed["experiment"].backend == "sagemaker"):
        return problems
    e = parsed["experiment"]
    if not e.store.startswith("s3://"):
        problems.append(
            "[experiment] STORE: the sagemaker backend needs an s3:// store, e.g. STORE = "
            "s3://my-bucket/smpipe"
        )
    if not e.role_arn.startswith("arn:"):
        problems.append(
            "[experiment] ROLE_ARN: the sagemaker backend needs the IAM role its jobs run as, "
            "e.g. ROLE_ARN = arn:aws:iam::123456789012:role/smpipe-jobs: create a role that "
            "sagemaker.amazonaws.com may assume and name it here; then `smpipe iam "
            f"{source}` prints the policy to attach to it, and the driver's"
        )
    if not e.image_uri:
        problems.append(
            "[experiment] IMAGE_URI: the sagemaker backend needs the image every job runs in, "
            "pushed to ECR, e.g. IMAGE_URI = 123456789012.dkr.ecr.us-east-1.amazonaws.com/"
            "smpipe:latest: build it from smpipe's docker/Dockerfile (docs/sagemaker.md, \"The "
            'image")'
        )
    if problems:  # the next step, said once
        problems[-1] += (
            "; to try the sagemaker backend's requests and jobs here first, with no AWS: "
            f"`smpipe run {source} --backend emulated`"
        )
    for warning in names_aws_does_not_know(e):
        log.warning(f"warning: {warning}")
    tracking = parsed.get("tracking")
    if tracking and tracking.wandb_mode == "online" and not tracking.wandb_secret_id:
        problems.append(
            "[tracking] WANDB_MODE = online on the sagemaker backend needs WANDB_SECRET_ID: "
            "a SageMaker job has no WANDB_API_KEY of its own (set the secret, or "
            "WANDB_MODE = offline)"
        )
    return problems


# S3's rules for a general purpose bucket's name (docs.aws.amazon.com/AmazonS3/latest/userguide/
# bucketnamingrules.html): 3 to 63 lowercase letters, digits, dots and hyphens, a letter or digit
# at each end, no two dots side by side, not an IP address. Said, not refused: a bucket made in
# us-east-1 before March 2018 may have an older name (capitals, '_'), which S3 still serves.
BUCKET_NAME = re.compile(r"(?!\d+\.\d+\.\d+\.\d+$)(?!.*\.\.)[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def names_aws_does_not_know(e) -> list[str]:
    """A REGION botocore knows no SageMaker in (every partition's), with the nearest it knows;
    a STORE whose bucket name S3's naming rules do not allow. Warnings: botocore's list grows
    with its releases, and an old bucket may have an old name."""
    import difflib

    import boto3

    session, warnings = boto3.session.Session(), []
    regions = {
        region
        for partition in session.get_available_partitions()
        for region in session.get_available_regions("sagemaker", partition_name=partition)
    }
    if e.region not in regions:
        near = difflib.get_close_matches(e.region, sorted(regions), n=3)
        mean = f" (did you mean {' or '.join(near)}?)" if near else ""
        warnings.append(
            f"[experiment] REGION = {e.region}: botocore knows no SageMaker there{mean}; "
            "every request would fail to reach it"
        )
    bucket = e.store.removeprefix("s3://").split("/", 1)[0]
    if e.store.startswith("s3://") and not BUCKET_NAME.fullmatch(bucket):
        warnings.append(
            f"[experiment] STORE: {bucket!r} is not a bucket name S3's naming rules allow (3-63 "
            "lowercase letters, digits, '.' and '-'); only a bucket made before March 2018 may "
            "have such a name"
        )
    return warnings


def _tuning_needs(
    parsed: dict[str, BaseModel],
    spaces: dict[str, tuple[str, dict[str, Tunable]]],
    own: dict[str, dict[str, Tunable]],
) -> list[str]:
    """What JOB = tune needs of the ranges and of [tuning]."""
    problems: list[str] = []
    if not ("experiment" in parsed and parsed["experiment"].job == "tune"):
        return problems
    grid = "tuning" in parsed and parsed["tuning"].strategy == "Grid"
    for model, (section, tunables) in spaces.items():
        if not tunables:
            problems.append(
                f"[{HP}]: JOB = tune needs at least one tunable (a->b or x,y,z) for {model}"
            )
        ranges = [(k, v) for k, v in tunables.items() if isinstance(v, Interval)]
        for key, value in ranges if grid else ():
            where = section if key in own.get(model, {}) else HP
            problem = (
                f"[{where}] {key.upper()}: STRATEGY = Grid takes categorical options only "
                f"(x,y,z), not {value.render()}"
            )
            if problem not in problems:  # a shared range is one problem, not one per model
                problems.append(problem)
    if (
        "tuning" in parsed
        and parsed["tuning"].strategy == "Hyperband"
        and parsed["tuning"].early_stopping == "Auto"
    ):
        problems.append(
            "[tuning] EARLY_STOPPING: Hyperband stops trials early by itself; set "
            "EARLY_STOPPING = Off (SageMaker refuses both)"
        )
    if "tuning" in parsed:
        problems += _tuning_limits(parsed["tuning"], spaces, own)
    return problems


# Automatic model tuning's resource limits (https://docs.aws.amazon.com/sagemaker/latest/dg/
# automatic-model-tuning-limits.html; pipeline/service_model.py TRAINING_JOBS_LIMIT checks the
# request too): "Number of training jobs per hyperparameter tuning job" is 750 for "[Bayesian
# optimization]", "[Hyperband]" and "[Grid] ..., either specified explicitly or inferred from
# the search space", none of them increasable; "[Random search]" 750, "Can be increased to"
# 10000 ([tuning] MAX_JOBS's own bound). Checked on every backend, as every SageMaker limit
# is: the same settings run anywhere. Hyperband's MaxResource ("The maximum value is 20,000
# epochs") is a trial's most epochs, which [training] EPOCHS bounds at 10,000.
TRAINING_JOBS_PER_TUNING_JOB = 750
RANDOM_TRAINING_JOBS_PER_TUNING_JOB = 10_000
LIMITS_PAGE = "automatic-model-tuning-limits.html"


def _tuning_limits(
    tuning: BaseModel,
    spaces: dict[str, tuple[str, dict[str, Tunable]]],
    own: dict[str, dict[str, Tunable]],
) -> list[str]:
    """[tuning] MAX_JOBS, and a grid's combinations, against SageMaker's training jobs per
    tuning job; a Random search past 750 is said to need a quota increase."""
    problems: list[str] = []
    limit, strategy = TRAINING_JOBS_PER_TUNING_JOB, tuning.strategy
    if strategy in ("Bayesian", "Hyperband") and tuning.max_jobs > limit:
        problems.append(
            f"[tuning] MAX_JOBS: {tuning.max_jobs}; with STRATEGY = {strategy} SageMaker runs at "
            f"most {limit} training jobs per hyperparameter tuning job, a limit that cannot be "
            f"increased ({LIMITS_PAGE}); STRATEGY = Random goes up to "
            f"{RANDOM_TRAINING_JOBS_PER_TUNING_JOB:,} with a quota increase"
        )
    if strategy == "Random" and tuning.max_jobs > limit:
        log.warning(
            f"warning: [tuning] MAX_JOBS = {tuning.max_jobs}: SageMaker's default limit is "
            f'{limit} training jobs per tuning job with Random search; it "can be increased to" '
            f"{RANDOM_TRAINING_JOBS_PER_TUNING_JOB:,} (Service Quotas, {LIMITS_PAGE})"
        )
    for model, (section, tunables) in spaces.items() if strategy == "Grid" else ():
        options = {k: v.options for k, v in tunables.items() if isinstance(v, Categorical)}
        combinations = math.prod(len(o) for o in options.values())
        if combinations > limit:
            keys = " x ".join(
                f"[{section if k in own.get(model, {}) else HP}] {k.upper()} ({len(o)})"
                for k, o in options.items()
            )
            problems.append(
                f"{keys}: STRATEGY = Grid runs every combination, {combinations:,} for {model}; "
                f"SageMaker runs at most {limit} training jobs per hyperparameter tuning job, "
                f'"either specified explicitly or inferred from the search space" '
                f"({LIMITS_PAGE}): fewer options, or STRATEGY = Random"
            )
    return problems


# Settings that become one field of a SageMaker request: (section, key, the field's shape in
# the service model, how the request writes the value). Every Environment value of a
# processing job is at most 256 characters; each of these reaches the jobs as one.
LIMITED = (
    ("data", "instance_type", "ProcessingInstanceType", str),
    ("inference", "instance_type", "ProcessingInstanceType", str),
    ("training", "instance_type", "TrainingInstanceType", str),
    ("training", "keep_alive_seconds", "KeepAlivePeriodInSeconds", int),
    ("experiment", "role_arn", "RoleArn", str),
    ("experiment", "image_uri", "AlgorithmImage", str),
    ("experiment", "user_functions", "ProcessingEnvironmentValue", str),
    ("tracking", "wandb_secret_id", "ProcessingEnvironmentValue", str),
    ("tracking", "secret_variables", "ProcessingEnvironmentValue", ",".join),
    ("hub", "token_secret_id", "ProcessingEnvironmentValue", str),
    ("registry", "model_package_group", "EntityName", str),  # CreateModelPackageGroup's name
)


def sagemaker_limits(
    parsed: dict[str, BaseModel],
    spaces: dict[str, tuple[str, dict[str, Tunable]]],
    own: dict[str, dict[str, Tunable]],
    metrics: dict[str, str],
) -> list[str]:
    """Settings that become fields of a SageMaker request, against the limits of those fields
    in the service model (pipeline/service_model.py): said here by key, before a plan is made.
    `smpipe plan` checks the whole requests again."""
    checks = [
        (f"[{section}] {key.upper()}", kind, write(getattr(parsed[section], key)))
        for section, key, kind, write in LIMITED
        if section in parsed and getattr(parsed[section], key)  # empty: not sent
    ]
    for model, (section, tunables) in spaces.items():
        for key, value in tunables.items():
            if isinstance(value, Categorical):  # one problem per section that says it
                where = section if key in own.get(model, {}) else HP
                checks.append((f"[{where}] {key.upper()}", "ParameterValues", list(value.options)))
    for name, regex in metrics.items():
        checks.append((f"[tuning.metric_definitions] {name.upper()}", "MetricName", name))
        checks.append((f"[tuning.metric_definitions] {name.upper()}", "MetricRegex", regex))
    problems = [
        f"{where}: {v.value!r} {_as_sentence(v.constraint, kind, v.value)}"
        for where, kind, value in checks
        for v in check_value(kind, value, where)
    ]
    if "models" in parsed:  # prepare and inference take the list as one ContainerArguments entry
        joined, limit = (
            ",".join(parsed["models"].model_names),
            shape("ContainerArgument").metadata["max"],
        )
        if len(joined) > limit:
            problems.append(
                f"[models] MODEL_NAMES: {len(joined)} characters with the commas; SageMaker passes "
                f"them to a job as one argument of at most {limit}"
            )
    if len(metrics) > 20:  # a tuning job's quota (automatic-model-tuning-limits.html)
        problems.append(
            f"[tuning.metric_definitions]: {len(metrics)} metrics; SageMaker's tuning jobs take "
            "at most 20"
        )
    return list(dict.fromkeys(problems))


def _as_sentence(constraint: str, shape_name: str, value: object = None) -> str:
    """SageMaker's "Member must ..." as a sentence about a setting (`value`: a string's length
    is in characters, a list's in values)."""
    if constraint.startswith("Member must satisfy enum value set"):
        # The close match and the botocore release whose list it was checked against.
        tail = constraint[constraint.rindex("]") + 1 :].strip()
        return f"is not a value SageMaker accepts for {shape_name} {tail}".rstrip()
    said = constraint.replace("Member must", "must", 1)
    unit = "characters" if isinstance(value, str) else "values"
    return re.sub(r"have length less than or equal to (\d+)", rf"have at most \1 {unit}", said)


def paths_not_utf8(settings) -> list[str]:
    """Each folder a run records whose path holds bytes that are not UTF-8 (a Linux name may
    hold any byte; Python reads one that is not UTF-8 as a lone surrogate). Every record is
    JSON in UTF-8, and S3 keys and SageMaker's requests are UTF-8: such a run failed after
    its first job with a serializer's traceback."""
    problems = []
    for key, path in (
        ("[experiment] STORE", settings.store_uri()),
        ("[data] RAW_DATA", settings.raw_data_uri()),
    ):
        if not_utf8(path):
            problems.append(f"{key}: {as_bytes(path)} {NOT_UTF8}")
    return problems
