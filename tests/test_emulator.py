"""The emulated backend plays SageMaker's rules, each from AWS's own sources (the table in
docs/sagemaker.md): a container's environment, names used once, one checkpoint URI shared by
trials, reserved hyperparameters, why trials failed; and the SageMaker backend keeps following
a job through errors reading it. Small probe jobs (tests/jobs/) through the real entrypoint."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from pipeline.backends.emulated import Emulator
from pipeline.jobs import ProcessingJob, TrainingJob, TuningJob
from pipeline.paths import ExperimentTree
from pipeline.player.environment import (
    HOST_VARIABLES,
    container_home,
    dockerfile_instructions,
    fresh_container_env,
    image_env,
)
from pipeline.player.job_root import OWNER, WORK_PREFIX, gathered
from pipeline.player.transfers import fetch_input
from pipeline.search_space import Categorical
from pipeline.store import S3Store, upload_dir
from steps.runtime.names import MODEL_DIR, TRIAL_CHECKPOINTS_VARIABLE, host_path
from tests.conftest import ship_code

RUN = ExperimentTree("probe").run(1)
CANARIES = {
    "HF_TOKEN": "hf_canary_0123456789",
    "WANDB_API_KEY": "wandb-canary-0123456789",
    "MY_CANARY": "driver-only",
    "AWS_REGION": "eu-north-1",
    "HF_HOME": "/driver/hf-home",
}
# What the emulator adds that AWS does not (docs/sagemaker.md: what `emulated` plays): where
# moto is, credentials as a role gives them, the job root in place of /opt/ml, the driver to
# follow, torch's compile cache out of this machine's /tmp.
PLUMBING = {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
            "SMPIPE_ML_ROOT", "SMPIPE_DRIVER_PID", "SMPIPE_MASTER_ADDR", "SMPIPE_MASTER_PORT",
            "TORCHINDUCTOR_CACHE_DIR"}  # fmt: skip
# A new container of the image: what Docker sets, and LC_CTYPE, which the job's own Python
# sets as it coerces the C locale (PEP 538): neither the base nor docker/Dockerfile sets a locale.
FRESH_CONTAINER = {"HOME", "PATH", "LC_CTYPE", *HOST_VARIABLES}
IMAGE_ENV = {
    token.split("=", 1)[0]
    for instruction, args in dockerfile_instructions()
    if instruction == "ENV"
    for token in args.split()
}


@pytest.fixture
def store(bucket):
    store = S3Store(f"s3://{bucket}")
    ship_code(store)
    return store


@pytest.fixture
def emulator(store):
    emulator = Emulator(store, "us-east-1")
    yield emulator
    emulator.close()


def backend(emulator, echo=None, **kwargs):
    b = emulator.backend(RUN, "", "", echo or io.StringIO())
    for key, value in kwargs.items():
        setattr(b, key, value)
    return b


def probe_processing(name: str, *arguments: str, env=None) -> ProcessingJob:
    return ProcessingJob(name=name, step="tests.jobs.probe_processing", code="code/",
                         inputs={"things": "inputs/things/"}, outputs={"seen": f"outputs/{name}/"},
                         arguments=list(arguments), env=env or {"SMPIPE_USER_FUNCTIONS": "user_functions"})  # fmt: skip


def probe_training(name: str, **changes) -> TrainingJob:
    job = TrainingJob(name=name, step="tests.jobs.probe_training", code="code/", channels={"train": "data/train/"},
                      hyperparameters={"epochs": "1"}, model_prefix=f"out/{name}/model/",
                      output_prefix=f"out/{name}/output/", checkpoint_prefix="ckpt/", sagemaker_output="sm/",
                      env={"SMPIPE_USER_FUNCTIONS": "user_functions"}, instance_type="ml.m5.xlarge",
                      metric_definitions={"validation:f1": r"validation:f1=([0-9.]+)"})  # fmt: skip
    for key, value in changes.items():
        setattr(job, key, value)
    return job


@pytest.fixture
def inputs(store, tmp_path):
    (tmp_path / "things").mkdir()
    (tmp_path / "things/a.txt").write_text("hello")
    upload_dir(store, tmp_path / "things", "inputs/things/")
    (tmp_path / "train").mkdir()
    (tmp_path / "train/rows.txt").write_text("1\n2\n")
    upload_dir(store, tmp_path / "train", "data/train/")


def test_jobs_played_as_processes_start_warm_in_one_home_of_the_emulators(
    store, emulator, inputs, no_idle_servers
):
    """Without an image, a job after the first is forked by a fork server, as the local
    backend's are; every job's HOME is the emulator's one empty folder (the server imported
    the libraries with it), never the user's; torch's compile cache is beside it, removed
    with it, never in this machine's temporary folder, where nothing would remove it."""
    b = backend(emulator)
    for name in ("first", "second"):
        result = b.run_processing(probe_processing(name))
        assert result.status == "Completed", result.failure_reason
    seen = [json.loads(store.get_bytes(f"outputs/{n}/seen.json")) for n in ("first", "second")]
    assert not any("fork_server.py" in part for part in seen[0]["starter"])  # cold
    assert any("fork_server.py" in part for part in seen[1]["starter"]), seen[1]["starter"]
    assert seen[0]["home"] == seen[1]["home"] == str(container_home())
    assert Path(os.path.expanduser("~")) not in container_home().parents
    compile_cache = Path(seen[1]["env"]["TORCHINDUCTOR_CACHE_DIR"])
    assert compile_cache.parent == container_home().parent != Path(tempfile.gettempdir())


def test_an_emulator_removes_the_folders_of_a_killed_driver_and_no_other(
    store, tmp_path, monkeypatch
):
    """A driver killed outright (SIGKILL) leaves its work root: the next emulated backend on
    this machine removes those whose driver is gone, keeps those of drivers still running,
    and removes its own when it closes."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    folders = {}
    for name, pid in (("gone", gone.pid), ("alive", os.getpid())):
        folders[name] = tmp_path / f"{WORK_PREFIX}{name}"
        (folders[name] / "job/home").mkdir(parents=True)
        (folders[name] / OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": pid}))
    emulator = Emulator(store, "us-east-1")
    assert not folders["gone"].exists() and folders["alive"].exists()
    assert emulator.work_root.parent == tmp_path
    assert emulator.work_root.name.startswith(WORK_PREFIX)
    emulator.close()
    assert not emulator.work_root.exists() and folders["alive"].exists()


def test_an_emulated_container_sees_nothing_of_the_drivers_environment(
    store, emulator, inputs, monkeypatch
):
    """A real container sees its image's ENV, the request's Environment and what SageMaker
    sets: no variable of the machine that sent the request (a Hugging Face cache or token,
    a wandb key, a region)."""
    for key, value in CANARIES.items():
        monkeypatch.setenv(key, value)
    job = probe_processing("env-probe")
    result = backend(emulator).run_processing(job)
    assert result.status == "Completed", result.failure_reason
    seen = json.loads(store.get_bytes("outputs/env-probe/seen.json"))
    names = set(seen["env_names"])
    sagemaker = {
        n for n in names if n.startswith(("SM_PROCESSING_INPUT_", "SM_PROCESSING_OUTPUT_"))
    }
    sagemaker |= {"SM_OUTPUT_FAILURE"}  # the entrypoint's own, from processingjobconfig.json
    allowed = IMAGE_ENV | set(job.env) | sagemaker | PLUMBING | FRESH_CONTAINER
    assert names <= allowed, sorted(names - allowed)
    assert not names & set(CANARIES)
    assert "secret check: None" in store.get_bytes(RUN.log("env-probe")).decode()
    # Home is the container's own, empty: no cache of this machine's under it.
    assert seen["home"] != os.path.expanduser("~") and seen["home"].endswith("/home")

    training = probe_training("env-train")
    result = backend(emulator).run_training(training)
    assert result.status == "Completed", result.failure_reason
    seen = json.loads(store.get_bytes(training.model_prefix + "seen-rank0.json"))
    names = set(seen["env_names"])
    documented = {"TRAINING_JOB_NAME", "TRAINING_JOB_ARN"}  # and the request's Environment
    request_env = {"SMPIPE_STEP", "SMPIPE_PROCESSES_PER_HOST", *training.env}
    exported = {n for n in names if n.startswith("SM_")} | {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT"}
    assert names <= IMAGE_ENV | request_env | documented | exported | PLUMBING | FRESH_CONTAINER, (
        sorted(names)
    )
    assert not names & set(CANARIES)
    assert seen["job_name"] == "env-train"


def test_a_job_played_as_a_process_gets_no_locale_the_image_does_not_set():
    """LANG and LC_ALL: pytorch/pytorch's Dockerfile sets neither, nor does docker/Dockerfile
    (only the stand-in base made where the real one cannot be pulled does), so a job played
    from the Dockerfile gets neither."""
    env = fresh_container_env()
    assert not {"LANG", "LC_ALL"} & set(env)
    assert not {"LANG", "LC_ALL"} & set(image_env(Path("/opt/ml")))


def test_a_name_used_before_is_refused_as_aws_refuses_it(store, emulator, inputs):
    """CreateProcessingJob with a name SageMaker has seen: ResourceInUse (moto overwrites)."""
    first = backend(emulator).run_processing(probe_processing("same-name"))
    assert first.status == "Completed", first.failure_reason
    again = backend(emulator).run_processing(probe_processing("same-name"))
    assert again.status == "Failed"
    assert "ResourceInUse" in again.failure_reason
    assert "names must be unique within an AWS account and region" in again.failure_reason


def test_trials_share_one_checkpoint_uri_as_on_sagemaker(store, emulator, inputs):
    """Everything under CheckpointConfig.S3Uri is copied into a new job's /opt/ml/checkpoints;
    a job uploads what it writes and deletes only what it deleted: another trial's files under
    the same URI stay (model-checkpoints.html)."""
    env = {"SMPIPE_USER_FUNCTIONS": "user_functions", TRIAL_CHECKPOINTS_VARIABLE: "1"}
    first = backend(emulator).run_training(probe_training("trial-a", env=env))
    assert first.status == "Completed", first.failure_reason
    assert store.list_keys("ckpt/") == ["ckpt/trial-a/ckpt-rank0.txt"]
    second = probe_training("trial-b", env=env)
    assert backend(emulator).run_training(second).status == "Completed"
    seen = json.loads(store.get_bytes(second.model_prefix + "seen-rank0.json"))
    assert seen["checkpoints_at_start"] == ["trial-a/ckpt-rank0.txt"]
    assert seen["checkpoint_dir"].endswith("checkpoints/trial-b")
    assert store.list_keys("ckpt/") == [
        "ckpt/trial-a/ckpt-rank0.txt",
        "ckpt/trial-b/ckpt-rank0.txt",
    ]


def test_a_distributed_training_job_uploads_every_hosts_model(store, emulator, inputs):
    """SageMaker gathers /opt/ml/model of every host into the one model.tar.gz (AWS's local
    mode: "Get the model artifacts from all the container nodes"), not the first host's
    only: each host's process leaves its own file there."""
    job = probe_training("two-hosts", instance_count=2)
    result = backend(emulator).run_training(job)
    assert result.status == "Completed", result.failure_reason
    seen = [json.loads(store.get_bytes(job.model_prefix + f"seen-rank{r}.json")) for r in (0, 1)]
    assert [(s["rank"], s["current_host"]) for s in seen] == [(0, "algo-1"), (1, "algo-2")]


def test_a_file_several_hosts_wrote_is_the_last_hosts(tmp_path):
    """Which host's file SageMaker keeps is undocumented ("it will override duplicate files",
    AWS's local mode): here the last host's in resourceconfig.json's order, and every other
    host's files are there too."""
    roots = {host: tmp_path / host for host in ("algo-1", "algo-10", "algo-2")}
    for host, root in roots.items():
        model = host_path(root, MODEL_DIR)
        (model / "sub").mkdir(parents=True)
        (model / "sub/same.txt").write_text(host)
        (model / f"{host}.txt").write_text(host)
    merged = gathered(roots, MODEL_DIR, tmp_path / "gathered")
    assert (merged / "sub/same.txt").read_text() == "algo-2"
    assert sorted(p.name for p in merged.glob("*.txt")) == [f"{h}.txt" for h in roots]
    assert gathered({"algo-1": roots["algo-1"]}, MODEL_DIR, tmp_path / "one") == host_path(
        roots["algo-1"], MODEL_DIR
    )


def long_failure(name: str, length: int, hosts: int) -> ProcessingJob:
    return ProcessingJob(name=name, step="tests.jobs.long_failure", code="code/",
                         inputs={"things": "inputs/things/"}, outputs={"seen": f"outputs/{name}/"},
                         arguments=[str(length)], env={"SMPIPE_USER_FUNCTIONS": "user_functions"},
                         instance_count=hosts)  # fmt: skip


def said_by(host: str, length: int) -> str:
    """What tests/jobs/long_failure.py leaves in /opt/ml/output/message on `host`."""
    return f"long-failure: ValueError: {host}|" + "x" * length


def test_the_exit_messages_of_several_hosts_are_concatenated_then_cut(store, emulator, inputs):
    """ "If multiple containers exit with an ExitMessage, the content of the ExitMessage from
    each processing container is concatenated, then truncated to 1 KB" (byoc-metadata.html)."""
    job = long_failure("long-fail-two", 700, hosts=2)
    assert backend(emulator).run_processing(job).status == "Failed"
    described = emulator.client.describe_processing_job(ProcessingJobName=job.name)
    assert described["ExitMessage"] == (said_by("algo-1", 700) + said_by("algo-2", 700))[:1024]


def test_a_failure_reason_is_cut_at_what_sagemaker_returns(store, emulator, inputs):
    """FailureReason is at most 1,024 characters (botocore's service model): the step's own
    1,024 behind `AlgorithmError: ` are cut there."""
    job = long_failure("long-fail-one", 3000, hosts=1)
    assert backend(emulator).run_processing(job).status == "Failed"
    described = emulator.client.describe_processing_job(ProcessingJobName=job.name)
    assert described["FailureReason"] == ("AlgorithmError: " + said_by("algo-1", 3000))[:1024]
    assert described["ExitMessage"] == said_by("algo-1", 3000)[:1024]


def test_an_input_prefix_arrives_whole_its_manifest_included(store, tmp_path):
    """An S3Prefix input is every object under the prefix ("SageMaker uses all objects that
    match the specified key name prefix", API_S3DataSource): the store's _MANIFEST.json
    arrives with the files it lists, and so does an object it does not list."""
    (tmp_path / "folder/sub").mkdir(parents=True)
    (tmp_path / "folder/sub/rows.txt").write_text("1\n")
    upload_dir(store, tmp_path / "folder", "data/whole/")
    store.put_bytes("data/whole/later.txt", b"added after the manifest")
    fetch_input(store, store.uri_of("data/whole/"), tmp_path / "in")
    arrived = sorted(
        p.relative_to(tmp_path / "in").as_posix() for p in (tmp_path / "in").rglob("*")
    )
    assert arrived == ["_MANIFEST.json", "later.txt", "sub", "sub/rows.txt"]


def tuning_job(name: str, fail: bool = False) -> TuningJob:
    trial = probe_training(name, hyperparameters={"model_name": "probe", "epochs": "1", **({"fail": "1"} if fail else {})},
                           checkpoint_prefix=f"ckpt/{name}/")  # fmt: skip
    return TuningJob(name=name, trial=trial, ranges={"learning_rate": Categorical(("0.1", "0.2"))},
                     strategy="Grid", objective_metric="validation:f1", objective_type="Maximize",
                     max_jobs=2, max_parallel_jobs=2)  # fmt: skip


def test_a_tuning_job_name_used_before_is_refused_in_aws_words(emulator):
    """CreateHyperParameterTuningJob with a name taken (its case aside): ResourceInUse, "A
    hyperparameter tuning job with the name, X, already exists. Choose a different name." (as
    AWS answered it: github.com/aws/amazon-sagemaker-examples/pull/3353)."""
    from types import SimpleNamespace

    from botocore.exceptions import ClientError

    request = backend(emulator).request(tuning_job("tune-taken"))
    jobs = emulator.account.jobs.hyper_parameter_tuning_jobs
    jobs["Tune-Taken"] = SimpleNamespace(arn="arn:aws:sagemaker:us-east-1:123456789012:x")
    try:
        with pytest.raises(ClientError) as refused:
            emulator.client.create_hyper_parameter_tuning_job(**request)
    finally:
        del jobs["Tune-Taken"]
    error = refused.value.response["Error"]
    assert error["Code"] == "ResourceInUse"
    assert error["Message"] == (
        "A hyperparameter tuning job with the name, tune-taken, already exists. "
        "Choose a different name."
    )


def test_the_trials_of_a_tuning_job_the_account_does_not_hold_are_resource_not_found(emulator):
    """A resumed run asks what an earlier driver's tuning job billed: that account is gone, and
    the emulator raised a KeyError from its hook, which failed every `--resume` of an
    interrupted emulated tuning run. SageMaker answers the error its service model lists,
    which the driver says and goes on from."""
    from types import SimpleNamespace

    from botocore.exceptions import ClientError

    from pipeline.backends.resuming import bill_of
    from pipeline.service_model import service_model

    operation = "ListTrainingJobsForHyperParameterTuningJob"
    listed = [e.name for e in service_model().operation_model(operation).error_shapes]
    # moto's records are the process's: an earlier emulator's tuning job stays in them.
    jobs = emulator.account.jobs.hyper_parameter_tuning_jobs
    jobs["p-0004-tune-bow-053057"] = SimpleNamespace(arn="arn:aws:sagemaker:us-east-1:1:x")
    try:
        with pytest.raises(ClientError) as refused:
            emulator.client.list_training_jobs_for_hyper_parameter_tuning_job(
                HyperParameterTuningJobName="p-0004-tune-bow-053057"
            )
    finally:
        del jobs["p-0004-tune-bow-053057"]
    assert listed == ["ResourceNotFound"]
    assert refused.value.response["Error"]["Code"] == "ResourceNotFound"
    echo = io.StringIO()
    assert bill_of(backend(emulator, echo), "tuning", "p-0004-tune-bow-053057", set()) is None
    assert "could not read what it billed" in echo.getvalue()


def test_a_tuning_job_described_while_its_create_is_answered_is_not_moto_s_fake(emulator, store):
    """moto makes a tuning job Completed, one trial counted, and the emulator sets it going
    once the create is answered. A Describe from another thread in between waits for that:
    SageMaker's answer to a job just made is InProgress with nothing counted."""
    request = backend(emulator).request(tuning_job("tune-race"))
    events, arrived = emulator.client.meta.events, threading.Event()

    def slow_answer(**_):  # before the emulator takes the job: moto's own is all there is
        arrived.set()
        time.sleep(1)

    events.register_first("after-call.sagemaker.CreateHyperParameterTuningJob", slow_answer)
    creating = threading.Thread(
        target=emulator.client.create_hyper_parameter_tuning_job, kwargs=request
    )
    creating.start()
    try:
        assert arrived.wait(30)
        seen = emulator.client.describe_hyper_parameter_tuning_job(
            HyperParameterTuningJobName="tune-race"
        )
    finally:
        creating.join()
        emulator.client.stop_hyper_parameter_tuning_job(HyperParameterTuningJobName="tune-race")
    assert seen["HyperParameterTuningJobStatus"] == "InProgress"
    assert seen["TrainingJobStatusCounters"]["Completed"] == 0
    assert "BestTrainingJob" not in seen


def test_a_create_waits_for_a_describe_in_flight_so_it_never_sees_moto_s_fake(emulator, store):
    """The other order: a Describe sent just before the create, answered after moto made the
    job, would see moto's fake all the same. The create waits for the reads in flight."""
    from botocore.exceptions import ClientError

    request = backend(emulator).request(tuning_job("tune-race-2"))
    events, reading = emulator.client.meta.events, threading.Event()

    def slow_read(**_):  # the Describe is sent, and the create goes meanwhile
        reading.set()
        time.sleep(1)

    events.register("before-call.sagemaker.DescribeHyperParameterTuningJob", slow_read)
    creating = threading.Thread(
        target=lambda: (
            reading.wait(30),
            emulator.client.create_hyper_parameter_tuning_job(**request),
        )
    )
    creating.start()
    try:
        seen = emulator.client.describe_hyper_parameter_tuning_job(
            HyperParameterTuningJobName="tune-race-2"
        )
    except ClientError as e:  # not made yet: the create waited
        seen = {"error": e.response["Error"]["Code"]}
    finally:
        creating.join()
        events.unregister("before-call.sagemaker.DescribeHyperParameterTuningJob", slow_read)
        emulator.client.stop_hyper_parameter_tuning_job(HyperParameterTuningJobName="tune-race-2")
    assert seen.get("HyperParameterTuningJobStatus", "InProgress") == "InProgress", seen
    assert (seen.get("TrainingJobStatusCounters") or {}).get("Completed", 0) == 0, seen


def test_trials_get_the_objective_and_leave_only_the_best(store, emulator, inputs):
    job = tuning_job("tune-probe")
    result = backend(emulator).run_tuning(job)
    assert result.status == "Completed", result.failure_reason
    trials = result.details["trials"]
    assert len(trials) == 2 and {t["status"] for t in trials} == {"Completed"}
    best = result.details["best"]["job_name"]
    seen = json.loads(store.get_bytes(job.trial.model_prefix + "seen-rank0.json"))
    # As AWS sends it: the objective's name, as is.
    assert seen["hyperparameters"]["_tuning_objective_metric"] == "validation:f1"
    assert seen["hyperparameters"]["learning_rate"] in (0.1, 0.2)
    assert store.list_keys("ckpt/tune-probe/") == []  # every trial ended: its folder went
    # Each trial's log is kept in the run tree, as a local trial's is; the tuning job's own is
    # its progress (SageMaker logs nothing for it).
    for trial in trials:
        assert "validation:f1=0.750000" in store.get_bytes(RUN.log(trial["job_name"])).decode()
    assert "Completed (trials: Completed 2)" in store.get_bytes(RUN.log(job.name)).decode()
    # The best trial's model is unpacked where the export job reads it (`seen` above came from
    # there), and kept there only: no trial's archive stays.
    assert best.startswith("tune-probe-") and store.list_keys("sm/") == []


def test_a_failed_tuning_job_says_why_its_trials_failed(store, emulator, inputs):
    result = backend(emulator).run_tuning(tuning_job("tune-fail", fail=True))
    assert result.status == "Failed"
    reason = result.failure_reason
    assert "No training job succeeded" in reason
    assert reason.count("failed: AlgorithmError: probe-train: ValueError: asked to fail") == 2
    assert "last log lines:" in reason


class Flaky:
    """Answers a botocore call with an error the first `times` times (throttling beyond
    botocore's own retries, a permission missing)."""

    def __init__(self, code: str, times: int):
        self.code, self.times = code, times

    def __call__(self, **_):
        from pipeline.backends.emulated.control_plane import error_response

        if self.times <= 0:
            return None
        self.times -= 1
        return error_response(400, self.code, f"{self.code} (injected)")


def test_following_a_job_goes_on_through_errors_reading_it(store, emulator, inputs):
    echo = io.StringIO()
    b = backend(emulator, echo, poll_seconds=0.2)
    b.client.meta.events.register(
        "before-call.sagemaker.DescribeProcessingJob", Flaky("ThrottlingException", 3)
    )
    b.logs.meta.events.register(
        "before-call.logs.DescribeLogStreams", Flaky("AccessDeniedException", 100)
    )
    result = b.run_processing(probe_processing("flaky"))
    assert result.status == "Completed", result.failure_reason
    said = echo.getvalue()
    assert said.count("could not read its status") == 1 and "ThrottlingException" in said
    assert said.count("could not read its CloudWatch log") == 1 and "AccessDeniedException" in said


def test_a_job_whose_status_cannot_be_read_is_given_up_and_stopped(store, emulator, inputs):
    echo = io.StringIO()
    emulator.containers.grace_seconds = 1  # the stop it is sent ends it quickly
    b = backend(emulator, echo, poll_seconds=0.2, patience_seconds=1.5)
    b.client.meta.events.register(
        "before-call.sagemaker.DescribeProcessingJob", Flaky("ExpiredTokenException", 10**6)
    )
    result = b.run_processing(probe_processing("lost", "--hang"))
    assert result.status == "Failed"
    assert "status could not be read for" in result.failure_reason
    assert (
        "aws sagemaker describe-processing-job --processing-job-name lost" in result.failure_reason
    )
    assert "stop requested" in echo.getvalue()


def until(check, seconds: float = 60):
    """`check()`'s first true answer within `seconds`, polled as a driver polls."""
    deadline = time.time() + seconds
    while not (answer := check()) and time.time() < deadline:
        time.sleep(0.1)
    assert answer, f"not within {seconds} s"
    return answer


def test_a_training_job_without_checkpoint_config_runs(store, emulator, inputs):
    """CheckpointConfig is optional in CreateTrainingJob (botocore's service model); the
    emulator failed such a job with "could not run the job: 'CheckpointConfig'"."""
    from pipeline.service_model import service_model

    create = service_model().operation_model("CreateTrainingJob").input_shape
    assert "CheckpointConfig" not in create.required_members
    request = backend(emulator).request(probe_training("no-checkpoints"))
    del request["CheckpointConfig"]
    emulator.client.create_training_job(**request)
    describe = emulator.client.describe_training_job
    ended = until(
        lambda: (
            (d := describe(TrainingJobName="no-checkpoints"))["TrainingJobStatus"]
            not in ("InProgress", "Stopping")
            and d
        )
    )
    assert ended["TrainingJobStatus"] == "Completed", ended.get("FailureReason")
