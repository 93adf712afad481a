"""Secrets in a job: keys read from Secrets Manager inside the container (`keys_from_secrets`),
and credentials masked in everything a job prints or leaves in its output (`redact`,
`scrub_files`): logs, failure files, the wandb run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from steps.runtime import names
from steps.runtime.names import host_path
from steps.runtime.variables import JobSetupError, read_config

# Keys read from Secrets Manager inside the container, never passed in the request: the
# variable naming the secret -> the variable its value becomes (and the JSON key it may sit
# under in the secret, {"WANDB_API_KEY": "..."}).
SECRETS_FROM_MANAGER = {
    names.WANDB_SECRET_VARIABLE: "WANDB_API_KEY",
    names.HF_TOKEN_SECRET_VARIABLE: "HF_TOKEN",
}
# Variables whose values are credentials: masked in everything a job prints or leaves in its
# output (logs, failure files, the wandb run). A fixed list, matched by name: a pattern such
# as "*TOKEN*" would also take TOKENIZERS_PARALLELISM and mask every "false" in a log. More
# names come from [tracking] SECRET_VARIABLES (names.EXTRA_SECRETS_VARIABLE).
SECRET_VARIABLES = (
    "WANDB_API_KEY",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "HUGGINGFACE_TOKEN",
)
REDACTED = "<redacted>"
SCRUB_LIMIT = 256 << 20  # output files larger than this are data, not logs


def secret_names(env: dict[str, str]) -> list[str]:
    extra = env.get(names.EXTRA_SECRETS_VARIABLE, "").split(",")
    return [*SECRET_VARIABLES, *(n.strip() for n in extra if n.strip())]


def secret_values(env: dict[str, str]) -> list[str]:
    """The values to mask, longest first (one may contain another); short ones are skipped:
    masking "1" would mask every digit."""
    values = {env[k] for k in secret_names(env) if len(env.get(k, "")) >= 4}
    return sorted(values, key=len, reverse=True)


def redact(text: str, secrets: list[str]) -> str:
    for value in secrets:
        text = text.replace(value, REDACTED)
    return text


def scrub_files(folders: list[Path], secrets: list[str]) -> int:
    """Mask secrets in the files a job leaves behind. The mask keeps each file's length
    (one '*' per byte), so binary records with length prefixes (wandb's .wandb log) stay
    readable. Returns how many files changed."""
    changed = 0
    needles = [v.encode() for v in secrets]
    if not needles:  # nothing to mask: the job's files (a model's gigabytes) are not read
        return 0
    for folder in folders:
        for path in folder.rglob("*") if folder.is_dir() else []:
            if not path.is_file() or path.is_symlink() or path.stat().st_size > SCRUB_LIMIT:
                continue
            data = path.read_bytes()
            masked = data
            for needle in needles:
                masked = masked.replace(needle, b"*" * len(needle))
            if masked != data:
                path.write_bytes(masked)
                changed += 1
    return changed


def job_region(root: Path) -> str | None:
    """The region the job runs in, from its own ARN: SageMaker sets TRAINING_JOB_ARN in a
    training container and writes ProcessingJobArn into processingjobconfig.json
    (your-algorithms-training-algo-running-container.html, build-your-own-processing-
    container.html), but no documented AWS_REGION (sagemaker-training-toolkit issues #12, #207)."""
    arn = os.environ.get(names.TRAINING_JOB_ARN, "")
    config = host_path(root, names.PROCESSING_CONFIG_FILE)
    if not arn and config.exists():
        arn = read_config(config).get("ProcessingJobArn", "")
    parts = arn.split(":")
    return parts[3] if len(parts) > 5 and parts[3] else None


def keys_from_secrets(root: Path) -> dict[str, str]:
    """The keys whose secrets the request names, read from Secrets Manager in the job's own
    region (a client with no region fails where the container has no AWS_REGION)."""
    wanted = {v: os.environ[v] for v in SECRETS_FROM_MANAGER if os.environ.get(v)}
    if not wanted:
        return {}
    import boto3

    region = (
        job_region(root) or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    )
    client = boto3.client("secretsmanager", region_name=region)
    keys = {}
    for variable, secret_id in wanted.items():
        key = SECRETS_FROM_MANAGER[variable]
        try:
            value = client.get_secret_value(SecretId=secret_id)["SecretString"]
        except Exception as e:  # noqa: BLE001 - denied, missing, no region, binary: said whole
            raise JobSetupError(
                f"secret {secret_id!r} ({variable}) cannot be read from Secrets Manager in "
                f"{region or 'no region'}: {type(e).__name__}: {e}"
            ) from None
        try:  # a secret stored as {"WANDB_API_KEY": "..."} or as the bare key
            value = json.loads(value)[key]
        except (ValueError, KeyError, TypeError):
            pass
        keys[key] = value
        print(f"{key}: read from Secrets Manager secret {secret_id!r}", flush=True)
    return keys
