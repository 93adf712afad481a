"""The store bucket's own KMS key, for `smpipe iam`: read with GetBucketEncryption where
[experiment] KMS_KEY_ARN names none, so that its use is granted to the driver and the role."""

from __future__ import annotations

import re

from pipeline.config import Settings

# An execution role's ARN, whose partition and account a bare key id belongs to.
ROLE = re.compile(r"^arn:(?P<partition>aws[a-z-]*):iam::(?P<account>\d{12}):role/")
KEY_ID = re.compile(r"^(?:mrk-)?[0-9a-f-]{32,36}$")  # a key id, single- or multi-Region


def bucket_key(settings: Settings) -> tuple[str | None, list[str]]:
    """The customer-managed KMS key the store bucket encrypts new objects with by default, read
    with GetBucketEncryption where [experiment] KMS_KEY_ARN names no key and AWS answers: (its
    ARN or None, comment lines saying what was read or why nothing was)."""
    e = settings.experiment
    if e.kms_key_arn or not settings.store_uri().startswith("s3://"):
        return None, []
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    from pipeline.store import aws_config

    bucket = settings.store_uri().removeprefix("s3://").partition("/")[0]
    set_it = (
        "if it, or a secret the jobs read, is encrypted under a customer-managed KMS key, "
        "set [experiment] KMS_KEY_ARN to that key's ARN"
    )
    session = boto3.Session(region_name=e.region)
    if session.get_credentials() is None:
        return None, [
            f"# The default encryption of bucket {bucket} was not read (no AWS",
            f"# credentials here): {set_it}.",
        ]
    client = session.client("s3", config=aws_config(attempts=2, connect_timeout=5, read_timeout=10))
    try:
        rules = client.get_bucket_encryption(Bucket=bucket)["ServerSideEncryptionConfiguration"][
            "Rules"
        ]
    except (ClientError, BotoCoreError) as error:
        code = getattr(error, "response", {}).get("Error", {}).get("Code")
        if code == "ServerSideEncryptionConfigurationNotFoundError":
            return None, []
        return None, [
            f"# The default encryption of bucket {bucket} was not read",
            f"# ({error}): {set_it}.",
        ]
    return customer_key(rules, settings, bucket)


def customer_key(rules: list[dict], settings: Settings, bucket: str) -> tuple[str | None, list]:
    """The customer-managed key a bucket's default encryption rules name, as an ARN a policy
    grants on, and what to say of it."""
    e = settings.experiment
    for rule in rules:
        default = rule.get("ApplyServerSideEncryptionByDefault") or {}
        key = default.get("KMSMasterKeyID", "")
        # SSE-S3 (AES256) and the AWS managed key aws/s3 need no grant: its key policy lets the
        # account's principals use it through S3 (KMS developer guide, "AWS managed keys").
        if not default.get("SSEAlgorithm", "").startswith("aws:kms") or not key:
            continue
        if key.endswith("alias/aws/s3"):
            continue
        role = ROLE.match(e.role_arn)
        if KEY_ID.match(key) and role:  # a bare id is a key of the bucket's own account
            key = f"arn:{role['partition']}:kms:{e.region}:{role['account']}:key/{key}"
        if "alias/" in key or not key.startswith("arn:"):
            return None, [
                f"# Bucket {bucket} encrypts with KMS key {key!r} by default: an alias cannot",
                "# be granted on; set [experiment] KMS_KEY_ARN to the ARN of the key it names.",
            ]
        return key, [
            f"# Bucket {bucket} encrypts with KMS key {key} by default: its use is granted",
            "# below ([experiment] KMS_KEY_ARN names a key of your choosing instead).",
        ]
    return None, []
