"""`smpipe iam settings.ini` (pipeline/iam/): the driver's and the execution role's policies,
valid IAM JSON, read off the plan: every bucket and secret of the plan appears, none other
does; every action is one botocore knows; every AWS call the driver's code makes is granted."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.config import ConfigError, load_settings
from pipeline.errors import PipelineError
from pipeline.iam import _split, check_actions, planned_requests, policies
from tests.conftest import ROOT, write_settings

ROLE = "arn:aws:iam::123456789012:role/smpipe-jobs"
IMAGE = "210987654321.dkr.ecr.eu-west-1.amazonaws.com/team/smpipe:2024-06"
SAGEMAKER = {
    "SMPIPE__EXPERIMENT__BACKEND": "sagemaker",
    "SMPIPE__EXPERIMENT__STORE": "s3://ml-artifacts/smpipe",
    "SMPIPE__EXPERIMENT__ROLE_ARN": ROLE,
    "SMPIPE__EXPERIMENT__IMAGE_URI": IMAGE,
    "SMPIPE__TRACKING__WANDB_SECRET_ID": "smpipe/wandb",
    "SMPIPE__HUB__TOKEN_SECRET_ID": "arn:aws:secretsmanager:us-east-1:123456789012:secret:hf-Ab12Cd",
    "SMPIPE__REGISTRY__MODEL_PACKAGE_GROUP": "news-topics",
}
# The settings this project ships: the demo's, and the one `smpipe init` writes.
SHIPPED = [ROOT / "settings.ini", ROOT / "pipeline/project_template/settings.ini"]


def documents(text: str) -> dict[str, dict]:
    """The heading of each policy -> the policy, from what `smpipe iam` printed."""
    found, heading, body = {}, [], []
    for line in text.splitlines() + ["# end"]:
        if line.startswith("#"):
            if body:
                found[" ".join(heading)] = json.loads("\n".join(body))
                heading, body = [], []
            heading.append(line)
        elif line.strip():
            body.append(line)
    return found


def valid_policy(policy: dict) -> None:
    """The IAM JSON policy grammar (IAM JSON policy elements reference): Version, a list of
    statements, each with a unique alphanumeric Sid, Effect, Action and Resource."""
    assert set(policy) == {"Version", "Statement"} and policy["Version"] == "2012-10-17"
    sids = [s["Sid"] for s in policy["Statement"]]
    assert len(sids) == len(set(sids)) and all(re.fullmatch(r"[A-Za-z0-9]+", s) for s in sids)
    for s in policy["Statement"]:
        assert set(s) <= {"Sid", "Effect", "Action", "Resource", "Condition"}
        assert s["Effect"] == "Allow" and s["Action"]
        assert all(re.fullmatch(r"[a-z0-9-]+:[A-Za-z0-9]+", a) for a in s["Action"])
        resources = [s["Resource"]] if isinstance(s["Resource"], str) else s["Resource"]
        assert resources and all(r == "*" or r.startswith("arn:aws:") for r in resources)


def resources(policy: dict) -> list[str]:
    found = []
    for s in policy["Statement"]:
        found += [s["Resource"]] if isinstance(s["Resource"], str) else s["Resource"]
    return found


def actions(policy: dict) -> set[str]:
    return {a for s in policy["Statement"] for a in s["Action"]}


def granted(policy: dict, action: str) -> list[str]:
    return [
        r
        for s in policy["Statement"]
        if action in s["Action"]
        for r in resources({"Statement": [s]})
    ]


@pytest.mark.parametrize("shipped", SHIPPED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_smpipe_iam_prints_two_valid_policies_for_the_shipped_settings(
    shipped, monkeypatch, capsys
):
    for key, value in SAGEMAKER.items():
        monkeypatch.setenv(key, value)
    assert main(["iam", str(shipped)]) == 0
    printed = documents(capsys.readouterr().out)
    assert len(printed) == 2
    (driver_heading, driver), (role_heading, execution) = printed.items()
    assert "driver" in driver_heading and "execution role" in role_heading and ROLE in role_heading
    valid_policy(driver)
    valid_policy(execution)
    check_actions(driver)
    check_actions(execution)
    # The driver passes exactly this role, and only to SageMaker.
    [passing] = [s for s in driver["Statement"] if "iam:PassRole" in s["Action"]]
    assert passing["Resource"] == ROLE
    assert passing["Condition"] == {
        "StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}
    }
    # The role pulls from the image's own repository (its account and region), token on *.
    assert granted(execution, "ecr:BatchGetImage") == [
        "arn:aws:ecr:eu-west-1:210987654321:repository/team/smpipe"
    ]
    assert granted(execution, "ecr:GetAuthorizationToken") == ["*"]
    assert granted(execution, "logs:PutLogEvents") == [
        "arn:aws:logs:us-east-1:123456789012:log-group:/aws/sagemaker/*"
    ]
    assert "cloudwatch:PutMetricData" in actions(execution)


def sagemaker_settings(tmp_path: Path, **sections):
    path = write_settings(
        tmp_path / "settings.ini",
        "s3://ml-artifacts/smpipe",
        experiment={
            "BACKEND": "sagemaker",
            "ROLE_ARN": ROLE,
            "IMAGE_URI": IMAGE,
            **sections.pop("experiment", {}),
        },
        **sections,
    )
    return load_settings(path, env={})


def test_the_policies_name_every_bucket_and_secret_of_the_plan_and_no_other(tmp_path):
    settings = sagemaker_settings(
        tmp_path,
        tracking={"WANDB_SECRET_ID": "smpipe/wandb", "WANDB_MODE": "online"},
        hub={"TOKEN_SECRET_ID": "arn:aws:secretsmanager:us-east-1:123456789012:secret:hf-Ab12Cd"},
    )
    driver, execution = policies(settings)
    requests = planned_requests(settings)
    # What the plan names: its buckets (every S3 URI of every request) and its secrets.
    text = json.dumps([r for _, r in requests])
    buckets = {_split(u)[0] for u in re.findall(r"s3://[^\"]+", text)}
    secrets = set(re.findall(r'"SMPIPE_(?:WANDB|HF_TOKEN)_SECRET_ID": "([^"]+)"', text))
    assert buckets == {"ml-artifacts"} and secrets == {
        "smpipe/wandb",
        "arn:aws:secretsmanager:us-east-1:123456789012:secret:hf-Ab12Cd",
    }
    named_buckets = {
        r.split(":::", 1)[1].split("/", 1)[0]
        for r in resources(driver) + resources(execution)
        if r.startswith("arn:aws:s3:::")
    }
    assert named_buckets == buckets
    assert sorted(granted(execution, "secretsmanager:GetSecretValue")) == [
        "arn:aws:secretsmanager:us-east-1:123456789012:secret:hf-Ab12Cd",
        "arn:aws:secretsmanager:us-east-1:123456789012:secret:smpipe/wandb-??????",
    ]
    assert not any(a.startswith("secretsmanager:") for a in actions(driver))  # it reads none
    # Every location a job reads or writes is granted, and only those: raw data is read,
    # never written; the store beyond the experiment is nobody's.
    reads, writes = granted(execution, "s3:GetObject"), granted(execution, "s3:PutObject")
    for uri in re.findall(r"s3://[^\"]+", text):
        covered = [r for r in reads + writes if re.fullmatch(_glob(r), "arn:aws:s3:::" + uri[5:])]
        assert covered, uri
    assert "arn:aws:s3:::ml-artifacts/smpipe/test-exp/raw/*" in reads
    assert not any(
        re.fullmatch(_glob(r), "arn:aws:s3:::ml-artifacts/smpipe/test-exp/raw/x") for r in writes
    )
    assert granted(driver, "s3:DeleteObject") == ["arn:aws:s3:::ml-artifacts/smpipe/test-exp/*"]


def _glob(arn: str) -> str:
    """An IAM resource with wildcards as a regular expression (`*` any run of characters, `?`
    one character)."""
    return "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in arn)


def test_no_secret_no_registry_no_price_list_when_the_settings_need_none(tmp_path):
    settings = sagemaker_settings(
        tmp_path, cost={"PRICES": "ml.g5.xlarge: 1.4, ml.m5.xlarge: 0.23"}
    )
    driver, execution = policies(settings)
    assert not any(
        a.startswith(("secretsmanager:", "pricing:")) for a in actions(driver) | actions(execution)
    )
    assert not any("ModelPackage" in a for a in actions(driver))
    assert "sagemaker:CreateHyperParameterTuningJob" not in actions(driver)


def test_a_tuning_run_may_follow_its_trials(tmp_path):
    settings = sagemaker_settings(tmp_path, experiment={"JOB": "tune"})
    driver, _ = policies(settings)
    assert {
        "sagemaker:CreateHyperParameterTuningJob",
        "sagemaker:StopHyperParameterTuningJob",
        "sagemaker:DescribeTrainingJob",
        "sagemaker:ListTrainingJobsForHyperParameterTuningJob",
    } <= actions(driver)
    assert "arn:aws:sagemaker:us-east-1:123456789012:hyper-parameter-tuning-job/*" in granted(
        driver, "sagemaker:CreateHyperParameterTuningJob"
    )


def test_an_action_botocore_does_not_know_fails_loudly():
    known = {
        "Statement": [{"Action": ["iam:PassRole", "s3:ListBucket", "sagemaker:CreateTrainingJob"]}]
    }
    check_actions(known)
    for action in (
        "sagemaker:CreateTrainingJobs",
        "iam:PassRoles",
        "s3:ListBuckett",
        "sagemakr:Describe",
    ):
        with pytest.raises(PipelineError, match=re.escape(action)):
            check_actions({"Statement": [{"Action": [action]}]})


def test_settings_for_another_backend_or_a_non_ecr_image_are_refused(tmp_path):
    local = load_settings(
        write_settings(tmp_path / "settings.ini", str(tmp_path / "store")), env={}
    )
    with pytest.raises(ConfigError, match=r"\[experiment\] BACKEND = local"):
        policies(local)
    (tmp_path / "hub").mkdir()
    docker_hub = sagemaker_settings(
        tmp_path / "hub", experiment={"IMAGE_URI": "pytorch/pytorch:2.3"}
    )
    with pytest.raises(
        ConfigError,
        match=r"\[experiment\] IMAGE_URI: 'pytorch/pytorch:2.3' is not an Amazon ECR image",
    ):
        policies(docker_hub)


# -- every AWS call in the driver's code is granted -------------------------------------------------

CALL = re.compile(r"\b(?:client|self\.client|self\.logs|pricing)\.([a-z][a-z0-9_]+)\(")
NAMED = re.compile(r'\bcall\(client, "([A-Za-z]+)"')
PAGINATED = re.compile(r'get_paginator\("([a-z0-9_]+)"\)')
# boto3's transfer methods, as the S3 operations they make (multipart for large files).
# A managed copy (CopyObject, or UploadPartCopy in parts) reads its source and writes its key:
# s3:GetObject and s3:PutObject (S3 API reference, CopyObject, "Permissions").
TRANSFERS = {
    "upload_file": ["PutObject"],
    "download_file": ["GetObject", "HeadObject"],
    "copy": ["GetObject", "PutObject"],
}
# S3 operations -> the IAM action each needs (botocore's s3 documentation of each operation:
# HeadBucket and ListObjectsV2 "s3:ListBucket", HeadObject "s3:GetObject").
S3_ACTION = {"HeadBucket": "ListBucket", "ListObjectsV2": "ListBucket", "HeadObject": "GetObject"}


def aws_calls(paths: list[Path]) -> set[str]:
    """Each AWS operation the code at `paths` calls, as the IAM action it needs."""
    import boto3

    clients = {
        name: boto3.client(
            name, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
        )
        for name in ("sagemaker", "logs", "s3", "pricing", "secretsmanager")
    }
    wanted = set()
    for path in paths:
        text = path.read_text()
        methods = CALL.findall(text) + PAGINATED.findall(text)
        wanted |= {f"sagemaker:{op}" for op in NAMED.findall(text)}
        for method in methods:
            if method == "get_paginator":
                continue
            if method in TRANSFERS:
                wanted |= {f"s3:{S3_ACTION.get(op, op)}" for op in TRANSFERS[method]}
                continue
            for service, client in clients.items():
                operation = client.meta.method_to_api_mapping.get(method)
                if operation:
                    prefix = service
                    name = S3_ACTION.get(operation, operation) if service == "s3" else operation
                    wanted.add(f"{prefix}:{name}")
                    break
            else:
                raise AssertionError(f"{path}: {method} is no call of a client smpipe uses")
        if "get_paginator(" in text and "KINDS" in text:  # List<Jobs> by kind (resuming.py)
            from pipeline.jobs import KINDS

            wanted |= {f"sagemaker:List{k.resource}s" for k in KINDS.values()}
        if "_call(" in text and "KINDS" in text:  # the backend's Create/Describe/Stop by kind
            from pipeline.jobs import KINDS

            wanted |= {
                f"sagemaker:{getattr(k, v)}"
                for k in KINDS.values()
                for v in ("create", "describe", "stop")
            }
    return wanted


def test_every_aws_call_the_driver_makes_is_granted_to_it(tmp_path):
    sources = [
        p
        for p in (ROOT / "pipeline").rglob("*.py")
        # The emulator and the player play SageMaker's side (a job's log to CloudWatch, its
        # archives to S3); what the player asks of a store, store/s3.py spells, and it is
        # read.
        if "iam" not in p.parts and "player" not in p.parts and "emulated" not in p.parts
    ]
    called = aws_calls(sources)
    assert {
        "sagemaker:CreateTrainingJob",
        "logs:GetLogEvents",
        "s3:DeleteObject",
        "pricing:GetProducts",
    } <= called
    grants: set[str] = set()
    for job in ("train", "tune"):
        (tmp_path / job).mkdir()
        settings = sagemaker_settings(
            tmp_path / job, experiment={"JOB": job}, registry={"MODEL_PACKAGE_GROUP": "news"}
        )
        grants |= actions(policies(settings)[0])
    assert called - grants == set()


def test_every_aws_call_a_job_makes_is_granted_to_the_role(tmp_path):
    called = aws_calls(sorted((ROOT / "steps").rglob("*.py")))
    assert called == {"secretsmanager:GetSecretValue"}
    settings = sagemaker_settings(tmp_path, tracking={"WANDB_SECRET_ID": "smpipe/wandb"})
    assert called <= actions(policies(settings)[1])


# -- the raw data as reconcile reads it -------------------------------------------------------------


def reconcile_reads(settings, store) -> str:
    """The S3 URI the reconcile job of the plan reads, with its real raw version: what
    resolve_sources decides, made into the request the backend sends."""
    from pipeline.jobs import request_for
    from pipeline.paths import ExperimentTree
    from pipeline.sources import resolve_sources
    from pipeline.stages import build_jobs

    tree = ExperimentTree(settings.experiment.name)
    sources = resolve_sources(settings, store, tree, ["reconcile"])
    [job] = build_jobs(settings, ["reconcile"], tree.run(1), sources)
    request = request_for(job, IMAGE, ROLE, lambda key: f"{settings.store_uri()}/{key}")
    [raw] = [i["S3Input"]["S3Uri"] for i in request["ProcessingInputs"] if i["InputName"] == "raw"]
    return raw


def readable(policy: dict, uri: str) -> bool:
    arn = "arn:aws:s3:::" + uri.removeprefix("s3://")
    return any(re.fullmatch(_glob(r), arn) for r in granted(policy, "s3:GetObject"))


def test_a_new_projects_raw_folder_is_granted_where_its_reconcile_reads_it(
    tmp_path, bucket, monkeypatch
):
    from pipeline.project import init_project
    from pipeline.store import open_store

    init_project(tmp_path / "news")
    for key, value in {
        **SAGEMAKER,
        "SMPIPE__EXPERIMENT__STORE": f"s3://{bucket}/smpipe",
        "SMPIPE__TRACKING__WANDB_SECRET_ID": "",
        "SMPIPE__HUB__TOKEN_SECRET_ID": "",
    }.items():
        monkeypatch.setenv(key, value)
    settings = load_settings(tmp_path / "news/settings.ini")
    assert settings.raw_data_uri() == str(tmp_path / "news/data")  # the template's RAW_DATA
    read = reconcile_reads(settings, open_store(settings.store_uri()))
    assert re.fullmatch(rf"s3://{bucket}/smpipe/news/raw-versions/[0-9a-f]{{64}}/files/", read)
    _, execution = policies(settings)
    # The raw version's files are readable, whatever its digest; nothing else of raw-versions/
    # (its manifest) nor the experiment's raw/, which this project does not read.
    assert f"arn:aws:s3:::{bucket}/smpipe/news/raw-versions/*/files/*" in granted(
        execution, "s3:GetObject"
    )
    assert readable(execution, read + "bbc/business.csv")
    assert not readable(execution, read.removesuffix("files/") + "manifest.json")
    assert not readable(execution, f"s3://{bucket}/smpipe/news/raw/x.csv")


def test_raw_data_in_another_bucket_is_granted_there(tmp_path, bucket):
    settings = sagemaker_settings(tmp_path, data={"RAW_DATA": "s3://team-corpora/news/2024"})
    driver, execution = policies(settings)
    assert readable(execution, "s3://team-corpora/news/2024/labels.csv")
    assert not readable(execution, "s3://team-corpora/other/labels.csv")
    assert not any("team-corpora" in r for r in granted(execution, "s3:PutObject"))
    assert "arn:aws:s3:::team-corpora" in granted(execution, "s3:ListBucket")
    assert "arn:aws:s3:::team-corpora" in granted(driver, "s3:ListBucket")  # the cache's key
    assert not any("team-corpora" in r for r in granted(driver, "s3:GetObject"))


# -- wildcards and KMS --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("experiment", "STORE", "s3://ml-*/smpipe"),
        ("experiment", "STORE", "s3://ml-artifacts/team?"),
        ("experiment", "REGION", "us-*"),
        ("experiment", "ROLE_ARN", "arn:aws:iam::123456789012:role/*"),
        ("experiment", "IMAGE_URI", "210987654321.dkr.ecr.eu-west-1.amazonaws.com/team/*:1"),
        ("data", "RAW_DATA", "s3://corpora/*"),
        ("tracking", "WANDB_SECRET_ID", "wandb*"),
        ("hub", "TOKEN_SECRET_ID", "hf-token-?"),
        ("registry", "MODEL_PACKAGE_GROUP", "news*"),
    ],
)
def test_a_setting_that_would_be_a_wildcard_resource_is_refused_by_name(
    tmp_path, section, key, value
):
    store = value if key == "STORE" else "s3://ml-artifacts/smpipe"
    path = write_settings(
        tmp_path / "settings.ini",
        store,
        experiment={"BACKEND": "sagemaker", "ROLE_ARN": ROLE, "IMAGE_URI": IMAGE}
        | ({key: value} if section == "experiment" else {}),
        **({section: {key: value}} if section != "experiment" else {}),
    )
    with pytest.raises(ConfigError, match=re.escape(f"[{section}] {key}: {value!r} ")):
        policies(load_settings(path, env={}))  # ROLE_ARN's pattern refuses it on loading


KEY = "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"


def test_a_kms_key_is_granted_to_the_driver_and_the_role(tmp_path):
    settings = sagemaker_settings(tmp_path, experiment={"KMS_KEY_ARN": KEY})
    driver, execution = policies(settings)
    assert granted(driver, "kms:Decrypt") == granted(driver, "kms:GenerateDataKey") == [KEY]
    assert {a for a in actions(execution) if a.startswith("kms:")} == {
        "kms:Decrypt",
        "kms:Encrypt",
        "kms:GenerateDataKey",
    }
    assert granted(execution, "kms:Encrypt") == [KEY]
    check_actions(driver)
    check_actions(execution)
    (tmp_path / "none").mkdir()
    unkeyed = policies(sagemaker_settings(tmp_path / "none"))
    assert not any(a.startswith("kms:") for p in unkeyed for a in actions(p))


def test_a_kms_alias_is_refused_by_name(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"\[experiment\] KMS_KEY_ARN: .*is not a KMS key's ARN .*alias cannot be granted on",
    ):
        sagemaker_settings(
            tmp_path, experiment={"KMS_KEY_ARN": "arn:aws:kms:us-east-1:123456789012:alias/ml"}
        )


def test_iam_reads_the_store_buckets_default_key_and_says_so(tmp_path, bucket, capsys):
    import boto3

    settings_path = write_settings(
        tmp_path / "settings.ini",
        f"s3://{bucket}/smpipe",
        experiment={"BACKEND": "sagemaker", "ROLE_ARN": ROLE, "IMAGE_URI": IMAGE},
    )
    assert main(["iam", str(settings_path)]) == 0  # SSE-S3, moto's default: no key to grant
    assert "kms:" not in capsys.readouterr().out
    boto3.client("s3").put_bucket_encryption(
        Bucket=bucket,
        ServerSideEncryptionConfiguration={
            "Rules": [
                {
                    "ApplyServerSideEncryptionByDefault": {
                        "SSEAlgorithm": "aws:kms",
                        "KMSMasterKeyID": KEY.rsplit("/", 1)[1],  # a bare key id
                    }
                }
            ]
        },
    )
    assert main(["iam", str(settings_path)]) == 0
    out = capsys.readouterr().out
    assert f"Bucket {bucket} encrypts with KMS key {KEY} by default" in out
    driver, execution = documents(out).values()
    assert granted(driver, "kms:Decrypt") == granted(execution, "kms:Encrypt") == [KEY]


def test_iam_without_credentials_says_the_bucket_key_was_not_read(tmp_path, monkeypatch, capsys):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    sagemaker_settings(tmp_path)
    assert main(["iam", str(tmp_path / "settings.ini")]) == 0
    out = capsys.readouterr().out
    assert "ml-artifacts was not read (no AWS" in out and "KMS_KEY_ARN" in out
