"""The container contract against files SageMaker itself writes (tests/contract/, each
transcribed from AWS's documentation or a published job, with its source): the image's
entrypoint starts and behaves on each, and the local and emulated players write the same
shapes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.player.job_root import (
    lay_out_processing,
    lay_out_training,
    processing_hosts,
    processing_job_config,
    training_hosts,
)
from steps.hyperparameters import parse_hyperparameters, reserved_hyperparameters
from steps.runtime import names
from steps.runtime.environment import training_env
from steps.runtime.launch import processes_per_host, training_command
from steps.runtime.names import ENTRYPOINT, ML_ROOT_VARIABLE, PROCESSES_VARIABLE
from steps.runtime.secrets import job_region
from steps.runtime.variables import processing_variables, training_variables
from tests.conftest import ROOT

CORPUS = ROOT / "tests/contract"
TRAINING = sorted(p.name for p in (CORPUS / "training").glob("resourceconfig.*.json"))
HYPERPARAMETERS = sorted(p.name for p in (CORPUS / "training").glob("hyperparameters.*.json"))


def corpus(path: str) -> dict:
    return json.loads((CORPUS / path).read_text())


def training_root(tmp_path: Path, resource: str, hyperparameters: str) -> Path:
    """A job root as SageMaker lays one out, its config files copied from the corpus."""
    config = tmp_path / "input/config"
    config.mkdir(parents=True)
    shutil.copy(CORPUS / "training" / resource, config / "resourceconfig.json")
    shutil.copy(CORPUS / "training" / hyperparameters, config / "hyperparameters.json")
    shutil.copy(CORPUS / "training/inputdataconfig.docs.json", config / "inputdataconfig.json")
    for channel in corpus("training/inputdataconfig.docs.json"):
        (tmp_path / "input/data" / channel).mkdir(parents=True)
        (tmp_path / "input/data" / channel / "part-0.txt").write_text(channel)
    return tmp_path


@pytest.mark.parametrize("resource", TRAINING)
@pytest.mark.parametrize("hyperparameters", HYPERPARAMETERS)
def test_the_entrypoint_reads_every_training_config_sagemaker_writes(
    tmp_path, monkeypatch, resource, hyperparameters
):
    root = training_root(tmp_path, resource, hyperparameters)
    monkeypatch.setenv("TRAINING_JOB_NAME", "corpus-job")
    env = training_variables(root)
    written = corpus(f"training/{resource}")
    assert json.loads(env["SM_HOSTS"]) == written["hosts"]
    assert env["SM_CURRENT_HOST"] == written["current_host"]
    assert env["SM_NETWORK_INTERFACE_NAME"] == written["network_interface_name"]
    assert json.loads(env["SM_CHANNELS"]) == ["evaluation", "train", "validation"]
    assert env["SM_CHANNEL_EVALUATION"] == str(root / "input/data/evaluation")
    # SageMaker's containers decode JSON-looking values; `_tuning_objective_metric` is not JSON.
    hps = json.loads(env["SM_HPS"])
    raw = corpus(f"training/{hyperparameters}")
    assert set(hps) == set(raw)
    if "sagemaker_program" in raw:
        assert hps["sagemaker_program"] == "iris-dnn-classifier.py"
        assert hps["_tuning_objective_metric"] == "Validation-accuracy"
    # Every host of the file in one torchrun world, this one at its own rank, the first host
    # (sorted, as SageMaker sorts `hosts`) the master.
    monkeypatch.setenv(PROCESSES_VARIABLE, "1")
    command = training_command(env)
    hosts = written["hosts"]
    if len(hosts) > 1:
        assert f"--nnodes={len(hosts)}" in command
        assert f"--node_rank={hosts.index(written['current_host'])}" in command
        assert f"--master_addr={hosts[0]}" in command
    else:
        assert command[1:] == ["-m", "steps.train"]


def test_the_reserved_hyperparameters_of_a_trial_are_accepted_and_recorded():
    trial = corpus("training/hyperparameters.sdk-trial.json")
    ours = {"model_name": "bow", "epochs": "2", "learning_rate": "0.01"}
    reserved = {k: v for k, v in trial.items() if k.startswith(("_", "sagemaker_"))}
    assert "_tuning_objective_metric" in reserved
    values = parse_hyperparameters({**ours, **reserved})
    assert values["epochs"] == 2 and not set(reserved) & set(values)
    assert reserved_hyperparameters({**ours, **reserved}) == reserved
    # A name that is neither ours nor SageMaker's is still refused, naming it.
    with pytest.raises(ValueError, match="unknown hyperparameter 'training_steps'"):
        parse_hyperparameters({**ours, "training_steps": trial["training_steps"]})


def test_a_trial_from_the_corpus_runs_through_the_real_entrypoint(tmp_path):
    """A probe training job, started as SageMaker starts the image, on the config files of
    a published single-host job and an SDK tuning trial's hyperparameters."""
    root = training_root(
        tmp_path / "root", "resourceconfig.c5-topology.json", "hyperparameters.sdk-trial.json"
    )
    for sub in ("model", "output/data", "checkpoints"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, ML_ROOT_VARIABLE: str(root), "PYTHONPATH": str(ROOT),
           "TRAINING_JOB_NAME": "corpus-trial", "SMPIPE_STEP": "tests.jobs.probe_training"}  # fmt: skip
    done = subprocess.run([sys.executable, *ENTRYPOINT[1:], "train"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    seen = json.loads((root / "model/seen-rank0.json").read_text())
    assert seen["hosts"] == ["algo-1"] and seen["current_host"] == "algo-1"
    assert seen["hyperparameters"]["_tuning_objective_metric"] == "Validation-accuracy"
    assert seen["channels"] == {c: ["part-0.txt"] for c in ("evaluation", "train", "validation")}
    assert not (root / "output/failure").exists()


def test_processes_per_host_auto_is_one_per_gpu(monkeypatch):
    """PROCESSES_PER_HOST = auto on a multi-GPU instance: the instance's GPUs, read as
    SageMaker's containers read them (SM_NUM_GPUS); one on a CPU instance."""
    monkeypatch.setenv(PROCESSES_VARIABLE, "auto")
    assert processes_per_host({"SM_NUM_GPUS": "8"}) == 8
    assert processes_per_host({"SM_NUM_GPUS": "0"}) == 1
    env = {"SM_HOSTS": '["algo-1", "algo-2"]', "SM_CURRENT_HOST": "algo-2", "SM_NUM_GPUS": "4"}
    command = training_command(env)
    assert "--nproc_per_node=4" in command and "--node_rank=1" in command
    monkeypatch.setenv(PROCESSES_VARIABLE, "2")
    assert processes_per_host({"SM_NUM_GPUS": "8"}) == 2


def test_nccl_uses_the_interface_resourceconfig_names(tmp_path, monkeypatch):
    root = training_root(tmp_path, "resourceconfig.docs.json", "hyperparameters.empty.json")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    import steps.runtime.variables as variables

    monkeypatch.setattr(variables.glob, "glob", lambda pattern: ["/dev/nvidia0", "/dev/nvidia1"])
    env = training_variables(root)
    assert env["SM_NUM_GPUS"] == "2" and env["NCCL_SOCKET_IFNAME"] == "eth1"
    monkeypatch.setattr(variables.glob, "glob", lambda pattern: [])
    assert "NCCL_SOCKET_IFNAME" not in training_variables(root)  # gloo on CPU: not NCCL's


def test_gloo_uses_the_interface_resourceconfig_names_across_hosts(tmp_path, monkeypatch):
    """Gloo binds to what the hostname resolves to, else to loopback; on SageMaker the hostname
    is `aws` on every host, so across hosts it is told the interface, GPU or not (gloo is CPU
    training's backend, and a GPU job's for its CPU tensors)."""
    root = training_root(tmp_path, "resourceconfig.docs.json", "hyperparameters.empty.json")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv(names.MASTER_ADDR_VARIABLE, raising=False)  # hosts apart, as on SageMaker
    import steps.runtime.variables as variables

    for gpus in ([], ["/dev/nvidia0"]):
        monkeypatch.setattr(variables.glob, "glob", lambda pattern, gpus=gpus: gpus)
        assert training_variables(root)["GLOO_SOCKET_IFNAME"] == "eth1"
    assert "GLOO_SOCKET_IFNAME" not in variables.distributed_variables("eth1", hosts=1, gpus=0)
    # Hosts played as processes of this machine (their master on loopback): gloo finds its own.
    monkeypatch.setenv(names.MASTER_ADDR_VARIABLE, "127.0.0.1")
    assert "GLOO_SOCKET_IFNAME" not in training_variables(root)
    monkeypatch.delenv(names.MASTER_ADDR_VARIABLE)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ens5")  # the user's own: kept
    assert "GLOO_SOCKET_IFNAME" not in training_variables(root)


def test_the_entrypoint_reads_the_documented_processing_config(tmp_path):
    (tmp_path / "config").mkdir()
    shutil.copy(
        CORPUS / "processing/processingjobconfig.docs.json",
        tmp_path / "config/processingjobconfig.json",
    )
    shutil.copy(
        CORPUS / "processing/resourceconfig.docs.json", tmp_path / "config/resourceconfig.json"
    )
    env = processing_variables(tmp_path)
    assert env["SM_PROCESSING_INPUT_INPUT_1"] == str(tmp_path / "processing/input/dataset")
    assert env["SM_PROCESSING_OUTPUT_OUTPUT_1"] == str(tmp_path / "processing/output/dataset")
    assert job_region(tmp_path) is None  # the documented example's ARN is a placeholder


def test_a_job_finds_its_region_in_its_own_arn(tmp_path, monkeypatch):
    monkeypatch.setenv(
        "TRAINING_JOB_ARN", "arn:aws:sagemaker:eu-west-3:123456789012:training-job/x"
    )
    assert job_region(tmp_path) == "eu-west-3"
    monkeypatch.delenv("TRAINING_JOB_ARN")
    (tmp_path / "config").mkdir()
    (tmp_path / "config/processingjobconfig.json").write_text(
        json.dumps({"ProcessingJobArn": "arn:aws:sagemaker:ap-south-1:1:processing-job/y"})
    )
    assert job_region(tmp_path) == "ap-south-1"


# -- the players write what SageMaker writes --------------------------------------------------


def shape_of(value) -> object:
    """The keys of a JSON document, all the way down (a list of objects by its first item; a
    list of strings is a value, as null is where the documented example has none)."""
    if isinstance(value, dict):
        return {k: shape_of(v) for k, v in value.items()}
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return [shape_of(value[0])]
    return None


def test_the_players_processingjobconfig_has_the_documented_shape(tmp_path):
    documented = corpus("processing/processingjobconfig.docs.json")
    request = {k: v for k, v in documented.items() if k not in ("ProcessingJobArn",)}
    request["AppSpecification"] = {"ImageUri": "image", "ContainerEntrypoint": list(ENTRYPOINT),
                                   "ContainerArguments": ["process", "prepare"]}  # fmt: skip
    request["ProcessingInputs"] = [
        {"InputName": "input-1", "S3Input": {k: v for k, v in documented["ProcessingInputs"][0]["S3Input"].items()
                                              if k not in ("S3CompressionType", "S3DownloadMode")}}]  # fmt: skip
    request["ProcessingOutputConfig"] = {"Outputs": documented["ProcessingOutputConfig"]["Outputs"]}
    request["ProcessingResources"] = {"ClusterConfig": {"InstanceCount": 1, "InstanceType": "ml.m5.xlarge", "VolumeSizeInGB": 30}}  # fmt: skip
    written = processing_job_config(
        request, "arn:aws:sagemaker:us-east-1:123456789012:processing-job/x"
    )
    assert shape_of(written) == shape_of(documented)
    lay_out_processing(
        request, tmp_path, lambda uri, local, shard: local.mkdir(parents=True), "arn:x"
    )
    assert shape_of(json.loads((tmp_path / "config/resourceconfig.json").read_text())) == shape_of(
        corpus("processing/resourceconfig.docs.json")
    )


def test_the_players_training_configs_have_the_shapes_sagemaker_writes(tmp_path):
    request = {
        "InputDataConfig": [{"ChannelName": "train", "InputMode": "File",
                             "DataSource": {"S3DataSource": {"S3Uri": "s3://b/t", "S3DataDistributionType": "FullyReplicated"}}}],
        "ResourceConfig": {"InstanceType": "ml.p4d.24xlarge", "InstanceCount": 2},
        "CheckpointConfig": {"S3Uri": "s3://b/ckpt/", "LocalPath": "/opt/ml/checkpoints"},
    }  # fmt: skip
    lay_out_training(request, tmp_path, "algo-2", ["algo-1", "algo-2"], lambda uri, local: local.mkdir(parents=True), {"epochs": "2"})  # fmt: skip
    config = tmp_path / "input/config"
    observed = corpus("training/resourceconfig.p4d-algo-2.json")
    written = json.loads((config / "resourceconfig.json").read_text())
    assert shape_of(written) == shape_of(observed)
    assert written["hosts"] == sorted(written["hosts"])
    assert {k: written[k] for k in ("current_host", "current_group_name", "current_instance_type")} == {
        k: observed[k] for k in ("current_host", "current_group_name", "current_instance_type")}  # fmt: skip
    documented = corpus("training/inputdataconfig.docs.json")["validation"]
    assert json.loads((config / "inputdataconfig.json").read_text()) == {"train": documented}
    assert json.loads((config / "hyperparameters.json").read_text()) == {"epochs": "2"}
    # A channel's ContentType as the documented example has it; one without InputMode takes
    # the job's TrainingInputMode (Channel's InputMode in the service model). The player wrote
    # no ContentType and "File" for such a channel.
    request["InputDataConfig"][0] |= {"ContentType": "trainingContentType"}
    request["InputDataConfig"].append({"ChannelName": "evaluation", "ContentType": "evalContentType",
                                       "DataSource": request["InputDataConfig"][0]["DataSource"]})  # fmt: skip
    request["AlgorithmSpecification"] = {"TrainingInputMode": "File"}
    lay_out_training(request, tmp_path, "algo-2", ["algo-1", "algo-2"], lambda uri, local: local.mkdir(parents=True, exist_ok=True), {})  # fmt: skip
    both = corpus("training/inputdataconfig.docs.json")
    assert json.loads((config / "inputdataconfig.json").read_text()) == {
        "train": both["train"], "evaluation": both["evaluation"]}  # fmt: skip
    request["AlgorithmSpecification"] = {"TrainingInputMode": "FastFile"}
    lay_out_training(request, tmp_path, "algo-2", ["algo-1", "algo-2"], lambda uri, local: local.mkdir(parents=True, exist_ok=True), {})  # fmt: skip
    written = json.loads((config / "inputdataconfig.json").read_text())
    assert (written["train"]["TrainingInputMode"], written["evaluation"]["TrainingInputMode"]) == (
        "File", "FastFile")  # fmt: skip


def test_the_players_list_ten_hosts_as_sagemaker_sorts_them(tmp_path, monkeypatch):
    """resourceconfig.json's `hosts` are "sorted lexicographically" (AWS's training toolkit,
    sagemaker-training-toolkit environment.py): ten hosts are algo-1, algo-10, algo-2, ...;
    algo-1 stays the first, torchrun's master, and each host's node rank is its place in the
    file."""
    ten = ["algo-1", "algo-10", *(f"algo-{i}" for i in range(2, 10))]
    request = {
        "InputDataConfig": [],
        "ResourceConfig": {"InstanceType": "ml.g5.xlarge", "InstanceCount": 10},
        "ProcessingResources": {"ClusterConfig": {"InstanceCount": 10}},
    }
    assert training_hosts(request) == processing_hosts(request) == ten
    lay_out_training(request, tmp_path, "algo-10", training_hosts(request), None, {})
    assert json.loads((tmp_path / "input/config/resourceconfig.json").read_text())["hosts"] == ten
    monkeypatch.setenv("TRAINING_JOB_NAME", "ten-hosts")
    monkeypatch.setenv(PROCESSES_VARIABLE, "1")
    command = training_command(training_variables(tmp_path))
    assert "--master_addr=algo-1" in command and "--node_rank=1" in command


def test_the_image_looks_for_the_code_where_sagemaker_mounts_it():
    """docker/Dockerfile's PYTHONPATH names the code input's two places, as names.py does."""
    import shlex

    from pipeline.player.environment import dockerfile_instructions

    env = dict(
        token.partition("=")[::2]
        for kind, args in dockerfile_instructions()
        if kind == "ENV"
        for token in shlex.split(args)
    )
    assert env["PYTHONPATH"].split(":") == [names.TRAINING_CODE_DIR, names.PROCESSING_CODE_DIR]


def test_a_channel_named_with_a_dash_is_read_where_the_entrypoint_put_it(tmp_path, monkeypatch):
    """One rule spells a channel's variable on both sides: the step once upper-cased the name
    alone (SM_CHANNEL_TRAIN-DATA) where the entrypoint exports SM_CHANNEL_TRAIN_DATA."""
    root = training_root(tmp_path, TRAINING[0], HYPERPARAMETERS[0])
    config = root / "input/config/inputdataconfig.json"
    config.write_text(json.dumps({"train-data": {"TrainingInputMode": "File"}}))
    (root / "input/data/train-data").mkdir(parents=True)
    env = training_variables(root)
    assert env["SM_CHANNEL_TRAIN_DATA"] == str(root / "input/data/train-data")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert training_env().channels == {"train-data": root / "input/data/train-data"}


def test_a_container_path_lies_under_the_job_root_and_nothing_else_does(tmp_path):
    assert names.host_path(tmp_path, names.MODEL_DIR) == tmp_path / "model"
    assert names.host_path(tmp_path, names.CONTAINER_ROOT) == tmp_path
    with pytest.raises(ValueError, match="'/opt/mlx/model' is not a container path under"):
        names.host_path(tmp_path, "/opt/mlx/model")
