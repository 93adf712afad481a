"""Jobs played in the image itself (`--backend emulated --image`): every job of a run, tuning
trials and `smpipe predict` included, in a container of the image `make image` built, a
container per host on a network of the job's own, reaching the embedded control plane as a job
reaches AWS. `make test` builds the image first; SMPIPE_TEST_IMAGE names another.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name
from packaging.version import Version

from pipeline.backends.choose import make_backend
from pipeline.backends.emulated import Emulator, S3View, job_plumbing
from pipeline.config import ConfigError, load_settings
from pipeline.driver import parse_steps, run_pipeline
from pipeline.paths import ExperimentTree
from pipeline.player.images import DRIVER_LABEL, Gateway, driver_tag, find_engine, image_id, sweep
from pipeline.store import LocalStore, S3Store, upload_dir
from steps.runtime.names import IMAGE_RECORD_FILE
from tests.conftest import ROOT, raw_data_bucket, ship_code, write_settings
from tests.reliability.test_lifecycle import as_from_a_terminal
from tests.test_emulator import CANARIES, IMAGE_ENV, RUN, probe_processing, probe_training
from tests.test_lock import TORCH_RELEASES, _lock_tool, pins

IMAGE = os.environ.get("SMPIPE_TEST_IMAGE", "smpipe:latest")
# The image `make image-base-torch` builds on the real base's torch release (Makefile).
BASE_TORCH = "2.9.1"
BASE_TORCH_IMAGE = os.environ.get("SMPIPE_TEST_BASE_TORCH_IMAGE", f"smpipe:torch-{BASE_TORCH}")
LOCK_SHA256 = hashlib.sha256((ROOT / "requirements.lock").read_bytes()).hexdigest()
SECRET = "wandb-image-secret-0123456789abcdef"
pytestmark = [pytest.mark.slow, pytest.mark.image]


@pytest.fixture(scope="module")
def engine() -> str:
    return find_engine()


@pytest.fixture(scope="module")
def image(engine) -> str:
    return present(engine, IMAGE, "make image")


def present(engine: str, image: str, make: str) -> str:
    try:
        image_id(engine, image)
    except Exception as e:  # noqa: BLE001 - said as the test's failure
        pytest.fail(f"{e}: `{make}` builds it (`make test` does first)")
    return image


@pytest.fixture(scope="module")
def base_torch_image(engine) -> str:
    """The image on the real base's torch release (`make image-base-torch`): the whole run
    and predict are played in it, so that an API of torch that steps/ uses and that release
    lacks fails here. The venv's own torch, which the usual image holds, runs every job of
    the local backend's tests and the other tests here."""
    return present(engine, BASE_TORCH_IMAGE, "make image-base-torch")


@pytest.fixture(scope="module")
def prepared(image, moto_endpoint, demo_raw, tmp_path_factory) -> str:
    """A bucket whose raw data a run in the image (run 1) reconciled and prepared: the runs of
    the tests that train on it reuse that output (the data steps' cache), as a user's next run
    does, and run their training step alone; the whole run in the image is the first test's."""
    with raw_data_bucket(moto_endpoint, demo_raw, "smpipe-image") as (bucket, store):
        _, settings = image_settings(tmp_path_factory.mktemp("prepared"), bucket)
        record = run_pipeline(settings, store, parse_steps("reconcile,prepare"), echo=io.StringIO())
    assert record["status"] == "completed" and record["data_version"] == 1
    logs = job_logs(store, 1)
    assert len(logs) == 2 and all(ran_in_the_image(log) for log in logs.values()), logs.keys()
    return bucket


@pytest.fixture
def staged(prepared, aws_env):
    return S3Store(f"s3://{prepared}/root")


TRAINING = parse_steps("reconcile,prepare,train")  # the data steps reuse `prepared`'s output


def image_settings(tmp_path, bucket, **overrides):
    path = write_settings(
        tmp_path / "settings.ini",
        f"s3://{bucket}/root",
        experiment={"BACKEND": "emulated", **overrides.pop("experiment", {})},
        emulated={"IMAGE": IMAGE},
        models={"MODEL_NAMES": "bow"},
        **overrides,
    )
    return path, load_settings(path, env={})


class Exits:
    """make_backend, keeping every container's exit as the image player read it."""

    def __init__(self, then=None):
        self.backend, self.exits = None, []
        self.by_job: dict[str, list] = {}
        self.then = then  # called once the backend is made, before the first job

    def __call__(self, settings, store, run, echo):
        self.backend = make_backend(settings, store, run, echo)
        if self.then:
            self.then()
        containers = self.backend.emulator.containers
        run_one = containers.run

        def run_and_keep(*args, **kwargs):
            done = run_one(*args, **kwargs)
            self.exits.append((kwargs.get("job", ""), done))
            self.by_job.setdefault(kwargs.get("job", ""), []).append(done)
            return done

        containers.run = run_and_keep
        return self.backend


def job_logs(store, run: int) -> dict[str, str]:
    prefix = ExperimentTree("test-exp").run(run).logs
    return {
        key.rsplit("/", 1)[-1]: store.get_bytes(key).decode() for key in store.list_keys(prefix)
    }


def ran_in_the_image(log: str) -> bool:
    """The image's record (docker/Dockerfile writes it; the entrypoint logs it): only a job
    started in the image has it, with the lock this checkout holds."""
    return f"lock_sha256={LOCK_SHA256}" in log


def networks(engine: str) -> set[str]:
    listed = subprocess.run(
        [engine, "network", "ls", "--format", "{{.Name}}"], capture_output=True, text=True
    )
    return {name for name in listed.stdout.split() if name.startswith("smpipe-")}


def test_every_job_of_a_run_and_predict_run_in_the_image(
    engine, base_torch_image, aws_env, demo_raw, tmp_path, monkeypatch
):
    image = base_torch_image
    assert not Path(IMAGE_RECORD_FILE).exists()  # this machine has no image record of its own
    before = networks(engine)
    # The run names the image by a tag of its own, which moves to another image once the run
    # has resolved it: every job still runs the image the run started with.
    tag = f"localhost/smpipe-moved:{os.getpid()}"
    assert subprocess.run([engine, "tag", image, tag]).returncode == 0
    built = json.loads(in_the_image(engine, image, f"print(open({IMAGE_RECORD_FILE!r}).read())"))
    # On one host: torch across two containers is test_fsdp_with_lora_across_two_containers's
    # case, and a second container here would add a cold training job's imports.
    # The transformer beside bow: its exports are torch's most of all.
    models, hosts = "bow,minilm", 1
    assert built["torch"].startswith(BASE_TORCH), built
    exits = Exits(then=lambda: subprocess.run([engine, "tag", built["base"], tag], check=True))
    # A local STORE (the emulated jobs see it as a bucket): `smpipe predict`, a process of its
    # own with an embedded moto of its own, finds the run there.
    path = write_settings(
        tmp_path / "settings.ini", str(tmp_path / "store"),
        experiment={"BACKEND": "emulated"}, emulated={"IMAGE": tag},
        data={"RAW_DATA": str(demo_raw)}, models={"MODEL_NAMES": models},
        training={"USE_DISTRIBUTED": str(hosts > 1).lower(), "INSTANCE_COUNT": str(hosts)},
        tracking={"WANDB_SECRET_ID": "smpipe/wandb"},
    )  # fmt: skip
    # The wandb key as a secret of the emulated account: every job reads it from Secrets
    # Manager at start, through the relay to the embedded control plane, or fails.
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    store = LocalStore(tmp_path / "store")
    echo = io.StringIO()
    try:
        record = run_pipeline(
            load_settings(path, env={}), S3View(store), parse_steps(None), echo=echo,
            make_backend=exits,
        )  # fmt: skip
    finally:
        subprocess.run([engine, "rmi", tag], capture_output=True)
    assert record["status"] == "completed", echo.getvalue()[-3000:]
    # What ran, named: the image by id (the tag's, before it moved), digest and lock.
    assert record["image"] == {
        "name": tag, "id": image_id(engine, image), "digest": record["image"]["digest"],
        "lock_sha256": LOCK_SHA256,
    }  # fmt: skip
    logs = job_logs(store, 1)
    trained = len(models.split(","))
    assert len(logs) == 3 + trained, logs.keys()
    assert all(ran_in_the_image(log) for log in logs.values()), logs.keys()
    # A container a host (each job's network went with them), torchrun across two.
    assert [len(done) for done in exits.by_job.values()] == [1, 1, *[hosts] * trained, 1]
    assert all(d.code == 0 for done in exits.by_job.values() for d in done)
    train_logs = [log for name, log in logs.items() if "-train-" in name]
    assert len(train_logs) == trained
    assert all(("algo-1" in log and "algo-2" in log) == (hosts == 2) for log in train_logs)
    assert SECRET not in echo.getvalue() and not any(SECRET in log for log in logs.values())
    assert networks(engine) == before

    # smpipe predict: a processing job, in the image too.
    source = tmp_path / "to_predict.csv"
    source.write_text("id,text\n1,The team won the cup final\n2,Shares fell on the market\n")
    out = tmp_path / "predictions.csv"
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "predict", str(path), str(source), str(out),
         "--image", image, "--quiet"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(out.read_text().splitlines()) == 3
    said = json.loads(out.with_name(out.name + ".json").read_text())
    log = store.get_bytes(ExperimentTree("test-exp").run(int(said["run"])).log(said["job_name"]))
    assert ran_in_the_image(log.decode())


def test_fsdp_with_lora_across_two_containers(image, staged, prepared, tmp_path):
    """DISTRIBUTED_STRATEGY = fsdp with LoRA, one process in each of two containers: torchrun
    across them by network alias, each writing its own shards; the model gathered in the
    first, merged, exported and tested, all in the image."""
    from tests.test_emulated import FSDP_FUNCTIONS

    (tmp_path / "fsdp_functions.py").write_text(FSDP_FUNCTIONS)
    # The demo's package beside it, as a project's own modules are (the code a run ships).
    shutil.copytree(ROOT / "user_functions", tmp_path / "user_functions")
    _, settings = image_settings(
        tmp_path, prepared, experiment={"USER_FUNCTIONS": "fsdp_functions"},
        training={"USE_DISTRIBUTED": "true", "INSTANCE_COUNT": "2", "DISTRIBUTED_STRATEGY": "fsdp",
                  "FINETUNING": "lora", "EPOCHS": "2", "LEARNING_RATE": "1e-3"},
    )  # fmt: skip
    exits, echo = Exits(), io.StringIO()
    record = run_pipeline(settings, staged, parse_steps(None), echo=echo, make_backend=exits)
    assert record["status"] == "completed", echo.getvalue()[-3000:]
    report = record["steps"]["train"]["details"]["models"]["bow"]
    assert report["distributed_strategy"] == "fsdp" and report["processes"] == 2
    assert report["lora_merge"]["passed"] and report["exports"]["torchscript"]["passed"]
    [train] = [done for job, done in exits.by_job.items() if "-train-" in job]
    assert len(train) == 2 and all(d.code == 0 for d in train)
    logs = job_logs(staged, record["model_version"])
    [train_log] = [log for name, log in logs.items() if "-train-" in name]
    assert ran_in_the_image(train_log) and "algo-2" in train_log
    assert "holdout_performance" in record and "bow" in record["holdout_performance"]


def test_tuning_trials_run_in_the_image(image, staged, prepared, tmp_path):
    """Trials with LoRA (PEFT from the image's lock) searching its rank, and the export of the
    best one's merged model, all in the image; its PEFT adapter reaches the run tree."""
    _, settings = image_settings(
        tmp_path, prepared, experiment={"JOB": "tune"},
        training={"USE_DISTRIBUTED": "false", "INSTANCE_COUNT": "1", "FINETUNING": "lora",
                  "LORA_TARGET_MODULES": "embedding"},
        tuning={"STRATEGY": "Random", "MAX_JOBS": "2", "MAX_PARALLEL_JOBS": "2"},
        **{"tuning.hyperparameters": {"LEARNING_RATE": "1e-4->1e-2 log", "LORA_R": "2,8",
                                      "BATCH_SIZE": None}},
    )  # fmt: skip
    exits, echo = Exits(), io.StringIO()
    record = run_pipeline(settings, staged, TRAINING, echo=echo, make_backend=exits)
    assert record["status"] == "completed", echo.getvalue()[-3000:]
    assert record["data_steps"]["prepare"]["status"] == "reused"
    details = record["steps"]["tune"]["details"]["models"]["bow"]
    assert details["counters"]["Completed"] == 2
    trials = [done for job, done in exits.exits if job.startswith(details["tuning_job"] + "-")]
    assert len(trials) == 2 and all(done.code == 0 for done in trials)
    # The export's log in the run tree; the trials' in CloudWatch, where SageMaker writes them.
    logs = {k: v for k, v in job_logs(staged, record["model_version"]).items() if "-tune-" not in k}
    cloudwatch = exits.backend.emulator.logs
    for trial in details["trials"]:
        events = cloudwatch.filter_log_events(
            logGroupName="/aws/sagemaker/TrainingJobs", logStreamNamePrefix=trial["job_name"]
        )["events"]
        logs[trial["job_name"]] = "\n".join(e["message"] for e in events)
    missing = [name for name, log in logs.items() if not ran_in_the_image(log)]
    assert len(logs) == 3 and not missing, (missing, list(logs))
    model = record["model_artifacts"]["bow"]
    adapter = json.loads(staged.get_bytes(model + "adapter/adapter_config.json"))
    kept = json.loads(staged.get_bytes(model + "smpipe.json"))
    assert kept["finetuning"] == "lora" and adapter["r"] == kept["lora"]["r"] in (2, 8)
    assert kept["exports"]["torchscript"]["passed"]


def in_the_image(engine: str, image: str, code: str) -> str:
    """What `python3 -c code` prints in a container of the image."""
    done = subprocess.run(
        [engine, "run", "--rm", "--entrypoint", "python3", image, "-c", code],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_image_holds_the_locks_versions_and_its_bases_torch(engine, image):
    installed = json.loads(
        in_the_image(
            engine, image,
            "import importlib.metadata as m, json;"
            "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))",
        )
    )  # fmt: skip
    installed = {canonicalize_name(name): version for name, version in installed.items()}
    differ = [
        f"{name}: {installed.get(name, 'nothing')} in the image, {version} locked"
        for name, version in pins(ROOT / "requirements.lock").items()
        if installed.get(name) != version
    ]
    assert differ == []
    # torch is the base's, and the image's record names it with the base.
    record = json.loads(in_the_image(engine, image, f"print(open({IMAGE_RECORD_FILE!r}).read())"))
    assert record["torch"] == installed["torch"] and record["base"]
    assert Version(record["torch"]).public in TORCH_RELEASES
    # The lock's markers were decided for the image's Python (tools/lock.py PYTHON_VERSION).
    assert record["python"].startswith(_lock_tool.PYTHON_VERSION + ".")
    assert record["lock_sha256"] == LOCK_SHA256


def test_torch_compile_builds_its_cpu_kernels_in_the_image(engine, image):
    """COMPILE = true on a CPU instance: inductor writes its CPU kernels as C++ and builds them
    with g++ against Python's headers at the first step; an image without either fails there."""
    code = (
        "import torch; x = torch.randn(8); f = torch.compile(lambda x: (2 * x).sin().sum());"
        "print(torch.allclose(f(x), (2 * x).sin().sum()))"
    )
    assert in_the_image(engine, image, code).strip() == "True"


class ReclaimAt(io.StringIO):
    """Once the job reports step `step`, AWS takes the spot instance back: SIGTERM to the
    container (the engine's kill), then the job restarted from its checkpoints."""

    def __init__(self, step: int, exits: Exits):
        super().__init__()
        self.step, self.exits, self.reclaimed = step, exits, []

    def write(self, text):
        backend = self.exits.backend
        if not self.reclaimed and backend is not None and f"] step={self.step}/" in text:
            self.reclaimed = backend.emulator.reclaim()
        return super().write(text)


def test_a_reclaimed_container_with_loader_workers_checkpoints_exits_75_and_resumes(
    image, staged, prepared, tmp_path
):
    _, settings = image_settings(
        tmp_path, prepared,
        training={"USE_DISTRIBUTED": "false", "INSTANCE_COUNT": "1", "USE_SPOT": "true",
                  "EPOCHS": "6", "DATALOADER_NUM_WORKERS": "2"},
    )  # fmt: skip
    exits = Exits()
    echo = ReclaimAt(step=5, exits=exits)
    record = run_pipeline(settings, staged, TRAINING, echo=echo, make_backend=exits)
    log = echo.getvalue()
    assert echo.reclaimed and record["status"] == "completed", log[-3000:]
    trainings = [done for job, done in exits.exits if "-train-" in job]
    assert [done.code for done in trainings] == [75, 0]
    assert trainings[0].interrupted
    assert "SIGTERM: checkpoint written at step" in log and "resumed from" in log
    report = record["steps"]["train"]["details"]["models"]["bow"]
    assert report["resumed_from"]["step"] >= 5
    assert [h["epoch"] for h in report["history"]] == [1, 2, 3, 4, 5, 6]


def test_an_image_that_is_not_there_is_said_before_a_run_is_claimed(engine, tmp_path, bucket):
    from pipeline.cli import open_experiment

    path = write_settings(
        tmp_path / "settings.ini", str(tmp_path / "store"),
        experiment={"BACKEND": "emulated"}, emulated={"IMAGE": "smpipe:no-such-tag"},
    )  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"\[emulated\] IMAGE: .* has no image 'smpipe:no-such-tag'"
    ):
        open_experiment(str(path))
    assert not (tmp_path / "store").exists()
    with pytest.raises(ConfigError, match="--image: .*emulated backend only .*BACKEND is local"):
        open_experiment(str(path), backend="local", image=IMAGE)


def test_an_image_built_from_another_lock_is_refused_before_a_run_is_claimed(
    engine, image, tmp_path, monkeypatch
):
    from pipeline import code_bundle
    from pipeline.cli import open_experiment
    from pipeline.player.images import ImageUnavailable, resolve_image

    other = tmp_path / "checkout" / "requirements.lock"
    other.parent.mkdir()
    other.write_text("torch==0.0.1 --hash=sha256:00\n")
    theirs = hashlib.sha256(other.read_bytes()).hexdigest()
    with pytest.raises(ImageUnavailable, match=rf"sha256 {LOCK_SHA256[:12]}, and this checkout's is {theirs[:12]}"):  # fmt: skip
        resolve_image(engine, image, other)
    monkeypatch.setattr(code_bundle, "PROJECT_ROOT", other.parent)
    path = write_settings(
        tmp_path / "settings.ini", str(tmp_path / "store"),
        experiment={"BACKEND": "emulated"}, emulated={"IMAGE": IMAGE},
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"was built from a requirements\.lock .*`make image`"):
        open_experiment(str(path))
    assert not (tmp_path / "store").exists()


def test_podman_on_another_network_backend_is_said_before_any_job(engine, tmp_path, monkeypatch):
    from pipeline.player.images import ImageUnavailable

    if engine != "podman":
        pytest.skip("a podman setting")
    settings = tmp_path / "containers.conf"  # `make engine`'s, without its [network] section
    text = (ROOT / "docker/containers.conf").read_text()
    settings.write_text(text[: text.index("[network]")])
    monkeypatch.setenv("CONTAINERS_CONF", str(settings))
    with pytest.raises(ImageUnavailable, match=rf"network backend is 'cni'.* in {settings}"):
        find_engine("podman")


def test_what_a_killed_driver_left_is_removed_by_the_next(engine, image):
    """A driver killed outright leaves its containers and networks running: the next driver's
    image player removes those of drivers of this machine that are gone, and no other."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    tags = {"gone": f"{socket.gethostname()}:{gone.pid}", "alive": driver_tag()}
    made = []
    try:
        for who, tag in tags.items():
            name = f"smpipe-sweep-{who}-{os.getpid()}"
            label = ["--label", f"{DRIVER_LABEL}={tag}"]
            subprocess.run(
                [engine, "network", "create", *label, name], check=True, capture_output=True
            )
            subprocess.run(
                [engine, "run", "-d", "--name", name, "--network", name, *label,
                 "--entrypoint", "sleep", image, "600"],
                check=True, capture_output=True,
            )  # fmt: skip
            made.append(name)
        removed = sweep(engine)
        assert sorted(n for n in removed if "sweep" in n) == [made[0], made[0]]
        still = subprocess.run(
            [engine, "ps", "--format", "{{.Names}}"], capture_output=True, text=True
        )
        assert made[1] in still.stdout.split() and made[0] not in still.stdout.split()
    finally:
        for name in made:
            subprocess.run([engine, "rm", "-f", name], capture_output=True)
            subprocess.run([engine, "network", "rm", "-f", name], capture_output=True)


def test_the_relay_to_the_control_plane_serves_the_job_networks_only():
    """The containers reach moto through a relay listening on every address: a connection
    from an address outside the job networks (this machine's own, not loopback) is closed."""
    with socket.create_server(("127.0.0.1", 0)) as upstream:
        gateway = Gateway(upstream.getsockname()[1])
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect(("10.255.255.255", 1))  # no packet sent: the route's address
                own = probe.getsockname()[0]
            assert not own.startswith("127.")
            with socket.create_connection((own, gateway.port), timeout=5) as client:
                client.settimeout(5)
                assert client.recv(1) == b""  # closed, never relayed
            gateway.allow(f"{own}/32")
            with socket.create_connection((own, gateway.port), timeout=5) as client:
                upstream.settimeout(5)
                relayed, _ = upstream.accept()
                client.sendall(b"ping")
                assert relayed.recv(4) == b"ping"
                relayed.close()
        finally:
            gateway.close()


def probe_store(bucket: str, tmp_path: Path) -> S3Store:
    """A bucket with the code the probe jobs run (tests/jobs/) and their inputs."""
    store = S3Store(f"s3://{bucket}")
    ship_code(store)
    for folder, name, text in (("things", "a.txt", "hello"), ("train", "rows.txt", "1\n2\n")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_text(text)
    upload_dir(store, tmp_path / "things", "inputs/things/")
    upload_dir(store, tmp_path / "train", "data/train/")
    return store


def test_a_container_that_ignores_its_stop_is_killed_after_the_grace(image, bucket, tmp_path):
    """Stopped as SageMaker stops a job: SIGTERM to the container's PID 1, then SIGKILL when the
    grace is over (120 s on SageMaker; 1 s here), by the engine, whatever the step does."""
    emulator = Emulator(probe_store(bucket, tmp_path), "us-east-1", image=IMAGE)
    emulator.containers.grace_seconds = 1
    results = []
    try:
        backend = emulator.backend(RUN, "", "", io.StringIO())
        hang = probe_processing("hang-image", "--hang")
        thread = threading.Thread(target=lambda: results.append(backend.run_processing(hang)))
        thread.start()
        started = time.time()
        while not emulator.containers._running and time.time() - started < 60:
            time.sleep(0.1)
        time.sleep(5)  # the step is up and ignoring signals
        emulator.containers.stop()
        thread.join(timeout=60)
        assert not thread.is_alive() and results[0].status != "Completed"
        running = subprocess.run(
            [emulator.containers.launcher.engine, "ps", "--format", "{{.Names}}"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert "hang-image" not in running  # the container itself, not only the engine's client
    finally:
        emulator.close()


def test_a_container_of_the_image_sees_only_the_image_the_request_and_sagemaker(
    image, bucket, tmp_path, monkeypatch
):
    """In the image, the environment is the image's (its base's ENV and docker/Dockerfile's,
    as the engine gives them), the request's Environment, what SageMaker sets, and the
    emulator's plumbing to moto; nothing of the driver's, and none of the process player's
    own variables (the job root's place, the driver's pid, torchrun's master)."""
    store = probe_store(bucket, tmp_path)
    for key, value in CANARIES.items():
        monkeypatch.setenv(key, value)
    emulator = Emulator(store, "us-east-1", image=IMAGE)
    plumbing = set(job_plumbing("http://moto"))
    # A new container's: Docker's (HOME, PATH, HOSTNAME) and the image's ENV, its base's
    # included (the real base's NVIDIA_* and LD_LIBRARY_PATH);
    # not podman's own TERM and `container`, which docker does not set.
    inspected = subprocess.run(
        [find_engine(), "image", "inspect", "--format", "{{json .Config.Env}}", IMAGE],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    engine_given = {"HOME", "HOSTNAME", *(e.split("=", 1)[0] for e in json.loads(inspected.stdout))}
    engine_given.add("LC_CTYPE")  # set by the job's own Python, in the C locale (PEP 538)
    try:
        backend = emulator.backend(RUN, "", "", io.StringIO())
        job = probe_processing("env-probe-image")
        result = backend.run_processing(job)
        assert result.status == "Completed", result.failure_reason
        seen = json.loads(store.get_bytes("outputs/env-probe-image/seen.json"))
        names = set(seen["env_names"])
        sagemaker = {n for n in names if n.startswith(("SM_PROCESSING_", "SM_OUTPUT_FAILURE"))}
        allowed = IMAGE_ENV | set(job.env) | sagemaker | plumbing | engine_given
        assert names <= allowed, sorted(names - allowed)
        assert not names & set(CANARIES) and seen["home"] == "/root"

        training = probe_training("env-train-image")
        result = backend.run_training(training)
        assert result.status == "Completed", result.failure_reason
        seen = json.loads(store.get_bytes(training.model_prefix + "seen-rank0.json"))
        # SageMaker's hostname, not the host's name (algo-1), which only the network knows.
        assert seen["hostname"] == "aws" and seen["current_host"] == "algo-1"
        names = set(seen["env_names"])
        documented = {"TRAINING_JOB_NAME", "TRAINING_JOB_ARN"}
        request_env = {"SMPIPE_STEP", "SMPIPE_PROCESSES_PER_HOST", *training.env}
        exported = {n for n in names if n.startswith("SM_")} | {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT"}
        allowed = IMAGE_ENV | request_env | documented | exported | plumbing | engine_given
        assert names <= allowed, sorted(names - allowed)
        assert not names & set(CANARIES)
    finally:
        emulator.close()


def test_ctrl_c_twice_as_a_training_container_starts_stops_it_and_leaves_nothing(
    engine, image, demo_raw, tmp_path
):
    """Ctrl-C the moment the training job is created (its container starting), and again 0.3 s
    later: the container is stopped within the grace, and neither its network, nor a container,
    nor the run's work folder is left (the second Ctrl-C is said, not obeyed)."""
    path = write_settings(
        tmp_path / "settings.ini", str(tmp_path / "store"),
        experiment={"BACKEND": "emulated"}, emulated={"IMAGE": IMAGE},
        data={"RAW_DATA": str(demo_raw)}, models={"MODEL_NAMES": "bow"},
        training={"EPOCHS": "30"},
    )  # fmt: skip
    staged = LocalStore(tmp_path / "store")
    before = networks(engine)
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", str(path)],
        cwd=ROOT, env={**os.environ, "TMPDIR": str(temp)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, preexec_fn=as_from_a_terminal,
    )  # fmt: skip
    out = []
    for line in proc.stdout:
        out.append(line)
        if "training job created" in line:
            proc.send_signal(signal.SIGINT)
            time.sleep(0.3)
            proc.send_signal(signal.SIGINT)
            break
    rest, _ = proc.communicate(timeout=300)
    said = "".join(out) + rest
    assert proc.returncode == 130 and "still stopping" in said, said[-3000:]
    record = json.loads(staged.get_bytes(ExperimentTree("test-exp").run(
        int(re.search(r"run (\d+) interrupted", said)[1])).metadata))  # fmt: skip
    assert record["status"] == "interrupted" and "train" not in record["steps"]
    assert networks(engine) == before
    running = subprocess.run([engine, "ps", "-a", "--format", "{{.Names}}"], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    assert "-train-" not in running
    assert [p.name for p in temp.iterdir() if p.name.startswith("smpipe")] == []
