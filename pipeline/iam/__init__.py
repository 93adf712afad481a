"""`smpipe iam settings.ini`: the least-privilege IAM policies a SageMaker run needs, read off
its plan.

Two identities act in a run on the sagemaker backend: the driver, whoever runs `smpipe`
(`driver_policy`), and the execution role SageMaker assumes to run each job (`role_policy`).
Both come from the very jobs `smpipe plan` builds (`planned_requests`), so a bucket, prefix or
secret the plan does not name never appears; every action is checked against botocore's service
models (`check_actions`). Sources are cited where each statement is made.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pipeline.config import ConfigError, Settings
from pipeline.errors import PipelineError
from pipeline.iam.keys import ROLE, bucket_key
from pipeline.jobs import KINDS

VERSION = "2012-10-17"  # the IAM policy language's current version (IAM JSON policy reference)
# IAM's service prefix -> botocore's service name (botocore/data/<name>/<version>/service-2.json).
SERVICES = {
    "sagemaker": "sagemaker",
    "s3": "s3",
    "logs": "logs",
    "ecr": "ecr",
    "cloudwatch": "cloudwatch",
    "pricing": "pricing",
    "secretsmanager": "secretsmanager",
    "iam": "iam",
    "kms": "kms",
}
# Permission-only actions: no operation of that name, but the operation named here documents
# that it needs the action (its text in botocore's service model, checked by check_actions).
PERMISSION_ONLY = {
    # CreateTrainingJob's RoleArn: "To be able to pass this role to SageMaker, the caller of
    # this API must have the iam:PassRole permission."
    "iam:PassRole": ("sagemaker", "CreateTrainingJob"),
    # HeadBucket: "you must have permissions to perform the s3:ListBucket action"; so must
    # ListObjectsV2; HeadObject answers 404 for a missing key only with s3:ListBucket (403
    # otherwise, which the store reports as an error, not as "absent").
    "s3:ListBucket": ("s3", "HeadBucket"),
}
# SageMaker's own service principal: what iam:PassedToService names (sagemaker-roles.html,
# "Passing Roles", and its trust policy's "Service": "sagemaker.amazonaws.com").
SAGEMAKER_PRINCIPAL = "sagemaker.amazonaws.com"
# The CloudWatch Logs groups SageMaker writes a job's output to, by kind (the backend reads
# them: pipeline/backends/sagemaker.py LOG_GROUPS); a tuning job's trials are training jobs.
LOG_GROUP_OF = {
    "training": "/aws/sagemaker/TrainingJobs",
    "tuning": "/aws/sagemaker/TrainingJobs",
    "processing": "/aws/sagemaker/ProcessingJobs",
}
ECR_IMAGE = re.compile(
    r"^(?P<account>\d{12})\.dkr\.ecr(?:-fips)?\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(?:\.cn)?"
    r"/(?P<repository>[^:@]+)"
)


@dataclass(frozen=True)
class Where:
    """What every ARN of a run is built from: the role's partition and account (SageMaker runs
    the jobs in the account that creates them; the role is that account's), the region."""

    partition: str
    account: str
    region: str

    def arn(self, service: str, resource: str) -> str:
        return f"arn:{self.partition}:{service}:{self.region}:{self.account}:{resource}"

    def s3(self, bucket: str, key: str | None = None) -> str:
        return f"arn:{self.partition}:s3:::{bucket}" + (f"/{key}" if key is not None else "")


# -- the plan -------------------------------------------------------------------------------------

RUN = "*"  # the run number and data version of every run: the policies hold for all of them


def planned_requests(settings: Settings) -> list[tuple[str, dict]]:
    """(kind, request) of every job of a whole run and of `smpipe predict`, as pipeline/driver.py
    builds them for `smpipe plan` (pipeline/stages.py `build_jobs`), with `*` for the run and
    its data version: a bucket, prefix or secret these requests do not name never appears in a
    policy; every one they name does."""
    from pipeline.backend import identity
    from pipeline.jobs import request_for
    from pipeline.paths import ExperimentTree
    from pipeline.predict.checks import Chosen
    from pipeline.predict.job import predict_job
    from pipeline.sources import Sources, raw_read_by_jobs
    from pipeline.stages import STEPS, build_jobs

    tree = ExperimentTree(settings.experiment.name)
    run = tree.run(RUN)
    # Where reconcile reads raw data, as resolve_sources decides it: RAW_DATA's s3:// URI, a
    # local RAW_DATA's raw version (any content: its digest is `*` too), or the experiment's raw/.
    raw = raw_read_by_jobs(settings, tree, RUN)
    jobs = build_jobs(settings, list(STEPS), run, Sources(raw=raw))
    data = tree.data(RUN)
    for model in settings.models.model_names:  # `smpipe predict` with any model of any run
        chosen = Chosen(
            run=run,
            model=model,
            why="",
            model_key=run.final_model(model),
            data_version=0,
            data=data,
            snapshot=None,
            text_columns=["text"],
            user_functions=settings.experiment.user_functions,
        )
        jobs.append(predict_job(settings, chosen, run.prediction(RUN), instance_count=1))
    image, role = identity(settings)
    store = settings.store_uri().rstrip("/")
    return [(job.kind, request_for(job, image, role, lambda key: f"{store}/{key}")) for job in jobs]


def _locations(kind: str, request: dict) -> tuple[set[str], set[str], set[str]]:
    """The S3 URIs a job reads, writes, and keeps its checkpoints at (read, written, removed:
    SageMaker copies checkpoints both ways and deletes what the job deleted,
    model-checkpoints.html)."""
    if kind == "processing":
        reads = {i["S3Input"]["S3Uri"] for i in request["ProcessingInputs"]}
        writes = {o["S3Output"]["S3Uri"] for o in request["ProcessingOutputConfig"]["Outputs"]}
        return reads, writes, set()
    definition = request["TrainingJobDefinition"] if kind == "tuning" else request
    reads = {c["DataSource"]["S3DataSource"]["S3Uri"] for c in definition["InputDataConfig"]}
    writes = {definition["OutputDataConfig"]["S3OutputPath"]}
    checkpoints = (
        {definition["CheckpointConfig"]["S3Uri"]} if "CheckpointConfig" in definition else set()
    )
    return reads, writes, checkpoints


def _environment(kind: str, request: dict) -> dict[str, str]:
    definition = request.get("TrainingJobDefinition", request) if kind == "tuning" else request
    return definition.get("Environment") or {}


def _split(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


def _objects(where: Where, uris: set[str]) -> list[str]:
    """Every object under each URI's prefix, and none elsewhere; a prefix inside another is
    already covered by it."""
    prefixes = sorted({_split(u)[0] + "/" + _split(u)[1].rstrip("/") + "/" for u in uris})
    kept = [p for p in prefixes if not any(p != q and p.startswith(q) for q in prefixes)]
    return [where.s3(*p.split("/", 1)) + "*" for p in kept]


# -- the policies ---------------------------------------------------------------------------------


def statement(sid: str, actions: list[str], resources: list[str] | str, **condition) -> dict:
    made = {
        "Sid": sid,
        "Effect": "Allow",
        "Action": sorted(set(actions)),
        "Resource": resources if isinstance(resources, str) else sorted(set(resources)),
    }
    if condition:
        made["Condition"] = condition
    return made


# Characters an IAM policy's Resource reads as wildcards ("You can use wildcard characters (*
# and ?) within any ARN segment", IAM JSON policy elements: Resource): a setting holding one
# would grant on resources it does not name.
WILDCARDS = "*?"


def wildcard_settings(settings: Settings) -> list[str]:
    """Each setting that becomes part of a policy's resource and holds a wildcard character."""
    e = settings.experiment
    named = {
        "[experiment] STORE": e.store if e.store.startswith("s3://") else "",
        "[experiment] REGION": e.region,
        "[experiment] ROLE_ARN": e.role_arn,
        # Its repository (a tag or digest never becomes part of a resource).
        "[experiment] IMAGE_URI": e.image_uri.split("@")[0].rsplit(":", 1)[0],
        "[data] RAW_DATA": settings.data.raw_data if "://" in settings.data.raw_data else "",
        "[tracking] WANDB_SECRET_ID": settings.tracking.wandb_secret_id,
        "[hub] TOKEN_SECRET_ID": settings.hub.token_secret_id,
        "[registry] MODEL_PACKAGE_GROUP": settings.registry.model_package_group,
    }
    whole = {"[experiment] IMAGE_URI": e.image_uri}
    return [
        f"{key}: {whole.get(key, value)!r} holds "
        f"{' and '.join(repr(c) for c in WILDCARDS if c in value)}, "
        "which an IAM policy reads as a wildcard: the policy would grant on resources this "
        "setting does not name"
        for key, value in named.items()
        if any(c in value for c in WILDCARDS)
    ]


def policies(settings: Settings, store_key: str | None = None) -> tuple[dict, dict]:
    """(the driver's policy, the execution role's policy), each a whole IAM policy document,
    every action checked against botocore's service models. `store_key`: the store bucket's
    default KMS key, where [experiment] KMS_KEY_ARN names none (`bucket_key`)."""
    e = settings.experiment
    problems = wildcard_settings(settings)
    if e.backend != "sagemaker":
        problems.append(
            f"[experiment] BACKEND = {e.backend}: `smpipe iam` prints what a run on the sagemaker "
            "backend needs; set BACKEND = sagemaker (or SMPIPE__EXPERIMENT__BACKEND=sagemaker)"
        )
    role = ROLE.match(e.role_arn)
    image = ECR_IMAGE.match(e.image_uri)
    if e.backend == "sagemaker" and not role:
        problems.append(f"[experiment] ROLE_ARN: {e.role_arn!r} is not an IAM role ARN")
    if e.backend == "sagemaker" and not image:
        problems.append(
            f"[experiment] IMAGE_URI: {e.image_uri!r} is not an Amazon ECR image "
            "(<account>.dkr.ecr.<region>.amazonaws.com/<repository>[:tag]): its repository "
            "cannot be named"
        )
    if problems:
        raise ConfigError(problems, settings.source)
    where = Where(role["partition"], role["account"], e.region)
    requests = planned_requests(settings)
    key = e.kms_key_arn or store_key
    driver, execution = (
        driver_policy(settings, where, requests, key),
        role_policy(settings, where, requests, image, key),
    )
    check_actions(driver)
    check_actions(execution)
    return driver, execution


def driver_policy(
    settings: Settings, where: Where, requests: list[tuple[str, dict]], key: str | None
) -> dict:
    """The driver's: whoever runs `smpipe run` (or `predict`, `registry`, `approve`, `prune`)
    passes the execution role to SageMaker, creates, describes, stops and lists the jobs, reads
    their CloudWatch logs, reads, writes and removes the experiment's files in the store, asks
    the AWS Price List API, and registers the winning model. Where AWS documents a narrower
    resource than the one used here, the narrower one is used."""
    kinds = sorted({kind for kind, _ in requests})
    statements = [
        *_job_statements(settings, where, kinds),
        *_listing_and_registry(settings, where, kinds),
        *_store_statements(settings, where, key),
    ]
    if _asks_prices(settings, requests):
        # pipeline/cost.py ask_price_list: the Price List API names no resource.
        statements.append(statement("AskTheDaysPrices", ["pricing:GetProducts"], "*"))
    return {"Version": VERSION, "Statement": statements}


def _job_statements(settings: Settings, where: Where, kinds: list[str]) -> list[dict]:
    """Passing the role, creating, following and stopping the run's jobs, reading their logs."""
    # Resource types as the service model writes each job's ARN (TrainingJobArn
    # "...:training-job/...", ProcessingJobArn "...:processing-job/...",
    # HyperParameterTuningJobArn "...:hyper-parameter-tuning-job/..."): every job name of
    # every run, in this account and region (a job's name carries its run and a time stamp).
    jobs = [where.arn("sagemaker", f"{_resource_type(kind)}/*") for kind in kinds]
    actions = [
        f"sagemaker:{getattr(KINDS[k], verb)}"
        for k in kinds
        for verb in ("create", "describe", "stop")
    ]
    if "tuning" in kinds:  # each trial's DescribeTrainingJob (billing, the best trial's model)
        actions.append("sagemaker:DescribeTrainingJob")
        jobs.append(where.arn("sagemaker", f"{_resource_type('training')}/*"))
    groups = sorted({LOG_GROUP_OF[k] for k in kinds})
    return [
        # sagemaker-roles.html, "Passing Roles": iam:PassRole with iam:PassedToService.
        statement(
            "PassTheExecutionRoleToSageMaker",
            ["iam:PassRole"],
            settings.experiment.role_arn,
            StringEquals={"iam:PassedToService": SAGEMAKER_PRINCIPAL},
        ),
        statement("RunAndFollowJobs", actions, jobs),
        statement(
            "ReadJobLogs",  # DescribeLogStreams, then GetLogEvents per stream (following.py)
            ["logs:DescribeLogStreams", "logs:GetLogEvents"],
            [where.arn("logs", f"log-group:{g}:*") for g in groups],
        ),
    ]


def _listing_and_registry(settings: Settings, where: Where, kinds: list[str]) -> list[dict]:
    """The run's jobs and a tuning job's trials listed; the run's winner registered,
    `registry`, `approve`."""
    statements = []
    # A resumed run lists the jobs of every kind its earlier driver may have left running
    # (pipeline/backends/resuming.py), whatever kinds this run sends.
    listing = [f"sagemaker:List{KINDS[k].resource}s" for k in sorted(KINDS)]
    if "tuning" in kinds:
        listing.append("sagemaker:ListTrainingJobsForHyperParameterTuningJob")
    group = settings.registry.model_package_group
    if group:  # pipeline/registry/
        listing.append("sagemaker:ListModelPackages")
        # Written as the settings name it, and in lower case too: how SageMaker cases a group
        # in its ARNs is not stated in botocore's model, and a policy's ARN is matched as written.
        names = sorted({group, group.lower()})
        statements.append(
            statement(
                "RegisterTheWinningModel",
                [
                    "sagemaker:CreateModelPackage",
                    "sagemaker:CreateModelPackageGroup",
                    "sagemaker:DescribeModelPackage",
                    "sagemaker:DescribeModelPackageGroup",
                    "sagemaker:UpdateModelPackage",
                ],
                [where.arn("sagemaker", f"model-package-group/{n}") for n in names]
                + [where.arn("sagemaker", f"model-package/{n}/*") for n in names],
            )
        )
    # A List action is granted on "*": it names no single job or package, and a resource
    # type the action does not take would deny it.
    statements.append(statement("ListJobsTrialsAndVersions", listing, "*"))
    return statements


def _store_statements(settings: Settings, where: Where, key: str | None) -> list[dict]:
    """The experiment's keys read, written and pruned; the store (and an s3:// RAW_DATA) listed;
    the store's KMS key used."""
    bucket, prefix = _split(settings.store_uri())
    experiment = (
        f"{prefix.strip('/') + '/' if prefix.strip('/') else ''}{settings.experiment.name}/*"
    )
    statements = [
        # pipeline/store/s3.py S3Store: get, head, put (also conditional, IfNoneMatch), upload
        # and download (multipart: "You must be allowed to perform the s3:PutObject action on
        # an object to create a multipart upload request", and s3:AbortMultipartUpload to abort
        # one, https://docs.aws.amazon.com/AmazonS3/latest/userguide/mpuoverview.html
        # #mpuAndPermissions), delete (prune, tidied trials): only the experiment's own keys.
        statement(
            "ReadWriteAndPruneTheExperiment",
            ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
            [where.s3(bucket, experiment)],
        ),
        # HeadBucket (the store's reachability check, before anything is written) takes no
        # prefix, so the listing cannot be narrowed to one with an s3:prefix condition. An
        # s3:// RAW_DATA is listed too, for the cache's key (pipeline/cache.py raw_digest).
        statement(
            "ListTheStore",
            ["s3:ListBucket"],
            [where.s3(bucket)] + [where.s3(b) for b in _raw_buckets(settings)],
        ),
    ]
    if key:
        # Reading an object under SSE-KMS needs kms:Decrypt, writing one kms:GenerateDataKey
        # (S3 user guide, UsingKMSEncryption.html, "Permissions"; a multipart upload needs
        # both, mpuoverview.html#mpuAndPermissions).
        statements.append(
            statement("UseTheStoreKey", ["kms:Decrypt", "kms:GenerateDataKey"], [key])
        )
    return statements


def _resource_type(kind: str) -> str:
    """`training-job` from the service model's TrainingJobArn pattern, and so on."""
    from pipeline.service_model import shape

    pattern = shape(f"{KINDS[kind].resource}Arn").metadata["pattern"]
    return re.search(r":\[0-9\]\{12\}:([a-z-]+)/", pattern)[1]


def _asks_prices(settings: Settings, requests: list[tuple[str, dict]]) -> bool:
    """Whether the driver asks the Price List API: for an instance type [cost] PRICES does not
    price (pipeline/plan.py prices_for)."""
    from pipeline.cost import uses_of

    used = {instance for kind, request in requests for _, instance in uses_of(kind, request)}
    return bool(used - set(settings.cost.prices))


def _raw_buckets(settings: Settings) -> list[str]:
    raw = settings.raw_data_uri()
    return [_split(raw)[0]] if raw.startswith("s3://") else []


def role_policy(
    settings: Settings, where: Where, requests: list[tuple[str, dict]], image, key: str | None
) -> dict:
    """The execution role's, as sagemaker-roles.html lists it for CreateTrainingJob,
    CreateProcessingJob and CreateHyperParameterTuningJob ("Execution Role Permissions"):
    cloudwatch:PutMetricData, the logs writes, s3:GetObject, s3:PutObject, s3:ListBucket and the
    ECR pulls, scoped as that page scopes them ("Scope the s3:ListBucket permission to the
    specific bucket ..., s3:GetObject, s3:PutObject, and s3:DeleteObject ... to ... S3Uri ...
    S3OutputPath"; "Scope Amazon ECR permissions to the registry path"; "The cloudwatch and
    logs actions are applicable for "*" resources", narrowed here to SageMaker's log groups);
    and the secrets the jobs read (steps/runtime/secrets.py keys_from_secrets)."""
    from steps.runtime.secrets import SECRETS_FROM_MANAGER

    secrets: set[str] = set()
    for kind, request in requests:
        env = _environment(kind, request)
        secrets |= {env[v] for v in SECRETS_FROM_MANAGER if env.get(v)}
    # The image's own registry: its account and region, which may differ from the run's.
    repository = (
        f"arn:{where.partition}:ecr:{image['region']}:{image['account']}:"
        f"repository/{image['repository']}"
    )
    pulls = ["ecr:BatchCheckLayerAvailability", "ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer"]
    statements = [
        *_job_data_statements(where, requests),
        # GetAuthorizationToken names no repository ("Resource": "*" on that page too).
        statement("PullTheImageToken", ["ecr:GetAuthorizationToken"], "*"),
        statement("PullTheImage", pulls, [repository]),
        statement(
            "WriteJobLogs",
            [
                "logs:CreateLogGroup",
                "logs:CreateLogStream",
                "logs:DescribeLogStreams",
                "logs:PutLogEvents",
            ],
            [where.arn("logs", "log-group:/aws/sagemaker/*")],
        ),
        statement("PutJobMetrics", ["cloudwatch:PutMetricData"], "*"),
    ]
    if secrets:
        statements.append(
            statement(
                "ReadTheNamedSecrets",
                ["secretsmanager:GetSecretValue"],
                [_secret_arn(where, s) for s in sorted(secrets)],
            )
        )
    if key:
        # The inputs' and checkpoints' reads need kms:Decrypt and the writes
        # kms:GenerateDataKey (UsingKMSEncryption.html); "the SageMaker execution role must
        # include permissions to call kms:Encrypt" (OutputDataConfig's KmsKeyId, botocore's
        # sagemaker model); a secret under the key is read with kms:Decrypt (Secrets Manager
        # user guide, security-encryption.html).
        statements.append(
            statement(
                "UseTheStoreKey", ["kms:Decrypt", "kms:Encrypt", "kms:GenerateDataKey"], [key]
            )
        )
    return {"Version": VERSION, "Statement": statements}


def _job_data_statements(where: Where, requests: list[tuple[str, dict]]) -> list[dict]:
    """What the jobs read, write and sync of S3, object by object as their requests name it,
    and the buckets those are in."""
    reads, writes, checkpoints = set(), set(), set()
    for kind, request in requests:
        read, written, kept = _locations(kind, request)
        reads |= read
        writes |= written
        checkpoints |= kept
    buckets = sorted({_split(u)[0] for u in reads | writes | checkpoints})
    statements = [
        statement("ReadJobInputs", ["s3:GetObject"], _objects(where, reads)),
        statement("WriteJobOutputs", ["s3:PutObject"], _objects(where, writes)),
    ]
    if checkpoints:
        statements.append(
            statement(
                "SyncCheckpoints",
                ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
                _objects(where, checkpoints),
            )
        )
    statements.append(
        statement("ListJobBuckets", ["s3:ListBucket"], [where.s3(b) for b in buckets])
    )
    return statements


def _secret_arn(where: Where, secret: str) -> str:
    """A secret named by ARN, as it is; by name, its ARN with the six characters Secrets Manager
    appends matched by '??????' ("Using '??????' as a wildcard to match the 6 random characters
    assigned by Secrets Manager avoids a problem that occurs if you use the '*' wildcard",
    https://docs.aws.amazon.com/secretsmanager/latest/userguide/permissions_grant-limited-resources.html)."""
    if secret.startswith("arn:"):
        return secret
    return where.arn("secretsmanager", f"secret:{secret}-??????")


# -- every action checked against botocore --------------------------------------------------------


def check_actions(policy: dict) -> None:
    """Raise PipelineError naming each action botocore does not know: its service prefix maps to
    no service model, or its name is no operation of that service and no permission-only
    action whose operation's documentation names it."""
    import botocore.session

    session = botocore.session.get_session()
    unknown = []
    for action in sorted({a for s in policy["Statement"] for a in s["Action"]}):
        prefix, _, name = action.partition(":")
        if prefix not in SERVICES:
            unknown.append(f"{action}: no botocore service for the prefix {prefix!r}")
            continue
        model = session.get_service_model(SERVICES[prefix])
        if name in model.operation_names:
            continue
        evidence = PERMISSION_ONLY.get(action)
        if evidence and action in _documentation(session, *evidence):
            continue
        unknown.append(
            f"{action}: {name} is no operation of botocore's {SERVICES[prefix]} service model"
        )
    if unknown:
        raise PipelineError("IAM actions botocore does not know: " + "; ".join(unknown))


def _documentation(session, service: str, operation: str) -> str:
    """An operation's documentation and its input members' in botocore's model."""
    op = session.get_service_model(service).operation_model(operation)
    members = op.input_shape.members.values() if op.input_shape else ()
    return " ".join([op.documentation or "", *(m.documentation or "" for m in members)])


def policies_text(settings: Settings) -> str:
    """What `smpipe iam` prints: each policy under a heading, after what was read of the store
    bucket's encryption."""
    key, read = bucket_key(settings)
    driver, execution = policies(settings, key)
    e = settings.experiment
    return "\n".join(
        [
            *read,
            "# The driver's policy: attach it to whoever runs `smpipe run`, `plan`, `predict`,",
            "# `registry`, `approve` and `prune` for this experiment.",
            json.dumps(driver, indent=2),
            "",
            f"# The execution role's policy: attach it to {e.role_arn}, whose trust policy lets",
            f"# {SAGEMAKER_PRINCIPAL} assume it (sts:AssumeRole, sagemaker-roles.html).",
            json.dumps(execution, indent=2),
        ]
    )
