"""The container contract's promises the other contract tests leave open: the values of the SM_*
variables (not only their names), SIGINT passed on to the step, the reason a step that was
killed leaves, a Hugging Face token masked with a mask that keeps a binary file's length, and
every AWS client of the driver retrying the same way."""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

from steps.runtime.names import ENTRYPOINT, ML_ROOT_VARIABLE, TRIAL_CHECKPOINTS_VARIABLE
from steps.runtime.secrets import REDACTED
from steps.runtime.variables import training_variables
from tests.conftest import ROOT
from tests.test_contract import CORPUS, corpus, training_root

PROBE = "tests.jobs.probe_signal"


def test_the_sm_variables_hold_the_values_sagemakers_framework_containers_give(
    tmp_path, monkeypatch
):
    """Each value as aws/sagemaker-training-toolkit's ENVIRONMENT_VARIABLES.md describes it
    (paths under the job root in place of /opt/ml; JSON-encoded lists and objects; SM_HP_<NAME>
    the decoded value; SM_TRAINING_ENV everything in one object), read from the corpus's
    config files as SageMaker writes them."""
    root = training_root(tmp_path, "resourceconfig.docs.json", "hyperparameters.sdk-trial.json")
    monkeypatch.setenv("TRAINING_JOB_NAME", "corpus-job")
    monkeypatch.delenv(TRIAL_CHECKPOINTS_VARIABLE, raising=False)
    import steps.runtime.variables as variables

    monkeypatch.setattr(variables.glob, "glob", lambda pattern: [])  # a CPU instance
    env = training_variables(root)
    paths = {
        "SM_MODEL_DIR": "model",
        "SM_INPUT_DIR": "input",
        "SM_INPUT_DATA_DIR": "input/data",
        "SM_INPUT_CONFIG_DIR": "input/config",
        "SM_OUTPUT_DIR": "output",
        "SM_OUTPUT_DATA_DIR": "output/data",
        "SM_OUTPUT_FAILURE": "output/failure",
        "SM_CHECKPOINT_DIR": "checkpoints",
        "SM_CHANNEL_TRAIN": "input/data/train",
        "SM_CHANNEL_VALIDATION": "input/data/validation",
    }
    assert {k: env[k] for k in paths} == {k: str(root / v) for k, v in paths.items()}
    resource = corpus("training/resourceconfig.docs.json")
    assert json.loads(env["SM_RESOURCE_CONFIG"]) == resource
    assert json.loads(env["SM_INPUT_DATA_CONFIG"]) == corpus("training/inputdataconfig.docs.json")
    assert env["SM_HOST_COUNT"] == "3" and env["SM_CURRENT_HOST_RANK"] == "0"
    assert env["SM_NUM_GPUS"] == "0" and env["SM_NUM_CPUS"] == str(os.cpu_count())
    assert env["SM_LOG_LEVEL"] == "20"  # logging.INFO, the toolkit's default
    # SM_HP_<NAME>: the value, JSON-decoded where it is JSON ('"neo"' is neo, "100" is 100).
    assert env["SM_HP_TRAINING_STEPS"] == "100" and env["SM_HP_SAGEMAKER_JOB_NAME"] == "neo"
    assert env["SM_HP__TUNING_OBJECTIVE_METRIC"] == "Validation-accuracy"
    assert env["SM_HP_SAGEMAKER_ENABLE_CLOUDWATCH_METRICS"] == "false"
    training = json.loads(env["SM_TRAINING_ENV"])
    assert training == {
        "channel_input_dirs": {
            c: str(root / "input/data" / c) for c in ("evaluation", "train", "validation")
        },
        "current_host": "algo-1",
        "hosts": resource["hosts"],
        "hyperparameters": json.loads(env["SM_HPS"]),
        "job_name": "corpus-job",
        "model_dir": str(root / "model"),
        "output_data_dir": str(root / "output/data"),
        "num_cpus": os.cpu_count(),
        "num_gpus": 0,
    }
    assert json.loads(env["SM_HPS"])["training_steps"] == 100
    # A tuning trial keeps its checkpoints in a folder of its own (trials share one S3 URI).
    monkeypatch.setenv(TRIAL_CHECKPOINTS_VARIABLE, "1")
    assert training_variables(root)["SM_CHECKPOINT_DIR"] == str(root / "checkpoints/corpus-job")


def processing_root(tmp_path: Path) -> Path:
    """A processing job's root with one output, `seen`, laid out as SageMaker describes it
    (build-your-own-processing-container: config/processingjobconfig.json)."""
    root = tmp_path / "root"
    (root / "config").mkdir(parents=True)
    shutil.copy(CORPUS / "processing/resourceconfig.docs.json", root / "config/resourceconfig.json")
    output = {"OutputName": "seen", "S3Output": {"LocalPath": "/opt/ml/processing/output/seen",
              "S3Uri": "s3://bucket/seen", "S3UploadMode": "EndOfJob"}}  # fmt: skip
    config = {"ProcessingInputs": [], "ProcessingOutputConfig": {"Outputs": [output]}}
    (root / "config/processingjobconfig.json").write_text(json.dumps(config))
    return root


def entrypoint(root: Path, *arguments: str, **env: str) -> subprocess.Popen:
    """The image's entrypoint running the probe step, as SageMaker starts it (PID 1 of its
    own: signals sent to it alone, never to its group)."""
    return subprocess.Popen(
        [sys.executable, *ENTRYPOINT[1:], "process", PROBE, *arguments],
        cwd=ROOT,
        env={**os.environ, ML_ROOT_VARIABLE: str(root), "PYTHONPATH": str(ROOT), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def test_sigint_to_the_entrypoint_reaches_the_step(tmp_path):
    """StopProcessingJob sends SIGINT (build-your-own-processing-container: "SIGINT and
    SIGKILL signals, which Processing uses to stop processing jobs"): the entrypoint passes it
    on, and a step that stops on it finishes cleanly."""
    root = processing_root(tmp_path)
    proc = entrypoint(root, "--wait")
    assert proc.stdout.readline().strip() == "waiting"
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    assert (root / "processing/output/seen/signal.txt").read_text() == "SIGINT"


def test_a_killed_step_leaves_the_reason_and_its_last_lines(tmp_path):
    """A step that dies without a word (SIGKILL, as the out-of-memory killer sends) cannot
    write its failure file: the entrypoint writes it, with the status and the last lines,
    where SageMaker reads ExitMessage (/opt/ml/output/message; build-your-own-processing-
    container), and exits 128 + the signal."""
    root = processing_root(tmp_path)
    proc = entrypoint(root, "--die")
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + signal.SIGKILL, out
    message = (root / "output/message").read_text()
    assert message == (f"step {PROBE} exited with status -9: first line | second line | last words")


def length_prefixed(data: bytes) -> list[bytes]:
    """The records of a file of (2-byte length, bytes) records; an error if they do not
    tile the file exactly."""
    records, at = [], 0
    while at < len(data):
        (size,) = struct.unpack_from("<H", data, at)
        records.append(data[at + 2 : at + 2 + size])
        at += 2 + size
    assert at == len(data), "the records no longer tile the file"
    return records


def test_a_hugging_face_token_is_masked_in_what_a_job_prints_and_leaves(tmp_path):
    """HF_TOKEN is on the fixed list; in a binary file the mask keeps the length, so the
    length-prefixed records of a log such as wandb's still read."""
    token = "hf_" + "x1y2z3" * 6
    root = processing_root(tmp_path)
    proc = entrypoint(root, "--leak", HF_TOKEN=token)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    assert token not in out and f"token: {REDACTED}" in out
    seen = root / "processing/output/seen"
    assert (seen / "debug.txt").read_text() == f"HF_TOKEN={'*' * len(token)}\n"
    records = length_prefixed((seen / "run.bin").read_bytes())
    assert records == [b"header", b"console: " + b"*" * len(token), b"trailer"]


def test_the_hugging_face_token_is_read_from_secrets_manager_in_the_jobs_region(
    aws_env, tmp_path, monkeypatch
):
    """[hub] TOKEN_SECRET_ID names a secret, read inside the job in the region of its own ARN
    (a container has no documented AWS_REGION), stored bare or as {"HF_TOKEN": ...}."""
    import boto3

    from steps.runtime.names import HF_TOKEN_SECRET_VARIABLE, WANDB_SECRET_VARIABLE
    from steps.runtime.secrets import keys_from_secrets

    client = boto3.client("secretsmanager", region_name="eu-west-3")
    client.create_secret(Name="hub/bare", SecretString="hf_bare_token_0123")
    client.create_secret(Name="hub/json", SecretString=json.dumps({"HF_TOKEN": "hf_json_4567"}))
    monkeypatch.delenv("AWS_DEFAULT_REGION")  # only the ARN says where the job runs
    monkeypatch.delenv(WANDB_SECRET_VARIABLE, raising=False)
    monkeypatch.setenv(
        "TRAINING_JOB_ARN", "arn:aws:sagemaker:eu-west-3:123456789012:training-job/j"
    )
    for secret, token in (("hub/bare", "hf_bare_token_0123"), ("hub/json", "hf_json_4567")):
        monkeypatch.setenv(HF_TOKEN_SECRET_VARIABLE, secret)
        assert keys_from_secrets(tmp_path) == {"HF_TOKEN": token}


def test_every_aws_client_of_the_driver_retries_the_same_way():
    """Every boto3 client pipeline/ makes is given pipeline/store/s3.py's `aws_config`
    (botocore's standard retry mode, 10 attempts): read off the source, so a client added
    without it fails here."""
    from pipeline.store import aws_config

    assert aws_config().retries == {"max_attempts": 10, "mode": "standard"}
    clients = []
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            called = node.func if isinstance(node, ast.Call) else None
            if isinstance(called, ast.Attribute) and called.attr == "client":
                config = next((k.value for k in node.keywords if k.arg == "config"), None)
                given = (
                    isinstance(config, ast.Call)
                    and isinstance(config.func, ast.Name)
                    and config.func.id == "aws_config"
                )
                clients.append((f"{path.relative_to(ROOT)}:{node.lineno}", given))
    assert len(clients) >= 4, clients  # S3, SageMaker, CloudWatch Logs, Secrets Manager
    assert [where for where, given in clients if not given] == []
