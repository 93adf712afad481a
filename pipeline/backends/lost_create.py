"""A create whose answer is lost, and the job SageMaker made of it all the same
(pipeline/backends/sagemaker.py sends the creates; tests/test_lost_create.py plays it).

A Create* request is recognised in the Describe* answer of the job SageMaker holds by
`identity`: the same role, image, S3 locations, arguments, hyperparameters and environment.
"""

from __future__ import annotations

import json

from pipeline.jobs import KINDS


def ours_after_all(
    kind: str, name: str, request: dict, error: Exception, describe_job
) -> tuple[str | None, str]:
    """A create that failed, and the job SageMaker may have made of it all the same.

    The Create* calls of jobs take no client token (only CreateModelPackage has an
    idempotencyToken member in botocore's sagemaker service-2.json), and botocore's standard
    mode retries any call after a ConnectionError, an HTTPClientError (a read timeout), a 500,
    502, 503 or 504 or a throttling code (botocore/retries/standard.py). A create SageMaker
    carried out but whose answer was lost is sent again; whatever answers the last attempt
    (ResourceInUse, a 5xx, throttling, another dropped connection) ends the call, and the job
    runs and bills all the same.

    So every error that may follow a carried-out attempt leads to a Describe of the name: a
    ClientError after a retry (ResponseMetadata.RetryAttempts > 0, any code) or a 5xx, and any
    ConnectionError or HTTPClientError. An EndpointConnectionError means the last attempt
    sent nothing (botocore/httpsession.py: no TCP connection), not that no earlier one did,
    and the exception does not say how many there were: one Describe settles it. A job that
    shows this very request (`not_ours`) is adopted and followed; any other is refused, saying
    why. Returns (what to say of the adopted job, or None; the reason)."""
    from botocore import xform_name
    from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError
    from botocore.exceptions import ConnectionError as NoConnection

    response = getattr(error, "response", None) or {}
    code = response.get("Error", {}).get("Code", "")
    metadata = response.get("ResponseMetadata", {})
    if isinstance(error, ClientError):
        # botocore records how many times it resent the call (endpoint.py: "We want to share
        # num retries, not num attempts"). A 4xx to the first attempt is SageMaker refusing
        # this very request: a ResourceInUse then is a name taken before this call.
        if not metadata.get("RetryAttempts", 0) and metadata.get("HTTPStatusCode", 0) < 500:
            return None, ""
    elif not isinstance(error, NoConnection | HTTPClientError):
        return None, ""  # raised before anything was sent (credentials, parameters)
    api = KINDS[kind]
    try:
        described = describe_job(kind, name)
    except (ClientError, BotoCoreError) as e:
        # No job of that name: ResourceNotFound in the service model, ValidationException
        # ("Requested resource not found.") as DescribeTrainingJob answers it
        # (github.com/aws/aws-sdk/issues/165). Anything else (throttling, a permission)
        # leaves the question open.
        missing = getattr(e, "response", {}).get("Error", {}).get("Code")
        if missing in ("ResourceNotFound", "ValidationException"):
            return None, ""
        return None, (
            f"; whether SageMaker created it could not be read ({e}): "
            f"`aws sagemaker {xform_name(api.describe, '-')} "
            f"--{xform_name(api.name_member, '-')} {name}` tells"
        )
    differences = not_ours(kind, request, described)
    if differences:
        return None, (
            f"; the {kind} job {name} that exists is not this request ({'; '.join(differences)})"
        )
    lost = "its retry was refused" if code == "ResourceInUse" else "its answer was lost"
    return f"{kind} job created ({lost}; {api.describe} shows this very request: adopted)", ""


def identity(kind: str, message: dict) -> dict:
    """What makes a Create* request this run's own, read alike from the request and from the
    Describe* answer (which repeats the request's members under the same names, botocore's
    sagemaker service-2.json): field -> value; maps of hyperparameters and environment compared
    key by key (SageMaker may add keys of its own to what it reports, never change ours)."""
    if kind == "processing":
        app = message.get("AppSpecification") or {}
        inputs = message.get("ProcessingInputs")
        outputs = (message.get("ProcessingOutputConfig") or {}).get("Outputs")
        return {
            "RoleArn": message.get("RoleArn"),
            "AppSpecification.ImageUri": app.get("ImageUri"),
            "AppSpecification.ContainerArguments": app.get("ContainerArguments"),
            "ProcessingInputs": None
            if inputs is None
            else {i.get("InputName"): (i.get("S3Input") or {}).get("S3Uri") for i in inputs},
            "ProcessingOutputConfig.Outputs": None
            if outputs is None
            else {o.get("OutputName"): (o.get("S3Output") or {}).get("S3Uri") for o in outputs},
            "Environment": message.get("Environment"),
        }
    tuning = kind == "tuning"
    definition = (message.get("TrainingJobDefinition") or {}) if tuning else message
    channels = definition.get("InputDataConfig")
    return {
        "RoleArn": definition.get("RoleArn"),
        "AlgorithmSpecification.TrainingImage": (
            definition.get("AlgorithmSpecification") or {}
        ).get("TrainingImage"),
        "InputDataConfig": None
        if channels is None
        else {
            c.get("ChannelName"): ((c.get("DataSource") or {}).get("S3DataSource") or {}).get(
                "S3Uri"
            )
            for c in channels
        },
        "OutputDataConfig.S3OutputPath": (definition.get("OutputDataConfig") or {}).get(
            "S3OutputPath"
        ),
        "CheckpointConfig.S3Uri": (definition.get("CheckpointConfig") or {}).get("S3Uri"),
        "StaticHyperParameters" if tuning else "HyperParameters": definition.get(
            "StaticHyperParameters" if tuning else "HyperParameters"
        ),
        "Environment": definition.get("Environment"),
    }


# What a Describe* answer must report for a job to be recognised as ours at all.
IDENTIFYING = ("RoleArn", "AppSpecification.ImageUri", "AlgorithmSpecification.TrainingImage")


def not_ours(kind: str, request: dict, described: dict) -> list[str]:
    """How the job SageMaker describes differs from the request we sent; [] when it is ours.
    A member the answer does not report is no evidence either way, but the role and image
    must be there."""
    sent, seen = identity(kind, request), identity(kind, described)
    said = [f for f in IDENTIFYING if f in sent and sent[f] is not None and seen.get(f) is None]
    if said:
        return [f"{', '.join(said)} not reported"]
    differences = []
    for field, ours in sent.items():
        theirs = seen.get(field)
        if ours is None or theirs is None:
            continue
        if isinstance(ours, dict) and field in (
            "HyperParameters",
            "StaticHyperParameters",
            "Environment",
        ):
            changed = sorted(k for k, v in ours.items() if theirs.get(k) != v)
            if changed:
                differences.append(f"{field} differs at {', '.join(changed)}")
        elif ours != theirs:
            differences.append(f"{field} is {shown(theirs)}, not {shown(ours)}")
    return differences


def shown(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 120 else text[:100] + "..."
