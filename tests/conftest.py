"""Shared fixtures: a moto server that subprocesses reach through AWS_ENDPOINT_URL, small
settings files, and a small slice of the demo data."""

from __future__ import annotations

import collections
import contextlib
import gc
import getpass
import io
import os
import re
import signal
import sys
import tempfile
from pathlib import Path

import boto3
import pytest

from pipeline.backends import moto_server
from pipeline.player.fork_client import IDLE, WarmStart
from pipeline.stages import HUB_OFFLINE

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The suite runs on several workers (addopts: -n 2), each starting jobs whose torch would
# start a thread per core: two workers' jobs of two threads each on two cores run at half
# speed (two 8-step MiniLM jobs at once: 75 s each, against 40 s with a thread each). So each
# worker, and every job it starts, gets its share of the cores, as parallel tuning trials do
# (pipeline/backends/local_tuning.py `cores_of_a_trial`), unless the environment says.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, str(max(1, (os.cpu_count() or 1) // WORKERS)))

# A shell starts a background command (`make test &`, nohup) with SIGINT ignored, and an
# ignored signal stays ignored across exec (signal(7)): every driver a test starts would then
# shrug off the Ctrl-C that the interruption tests send it. A terminal's Ctrl-C is what they
# play, so the suite's processes take SIGINT as a fresh interpreter in a terminal does.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# What smpipe keeps in the user's cache folder (pipeline/player/environment.py
# `user_cache_folder`: the user functions' check passes, failed local jobs of an S3 store, copies
# of S3 reports), and what the libraries keep there (datasets' csv cache, matplotlib's fonts),
# goes in a folder of this session's: what a test leaves does not outlive the suite, nor reach
# the user's ~/.cache. Made once, by the process that finds none made: xdist's workers inherit
# the variables (a mkdtemp in setdefault's argument made one more folder a worker).
if "SMPIPE_TEST_CACHE" not in os.environ:
    os.environ["SMPIPE_TEST_CACHE"] = tempfile.mkdtemp(prefix="smpipe-test-cache-")
CACHE = os.environ["SMPIPE_TEST_CACHE"]
os.environ["XDG_CACHE_HOME"] = CACHE


def pytest_unconfigure(config):
    # The session's own process, its workers done; and a folder it made, not one it was given.
    if not hasattr(config, "workerinput") and Path(CACHE).name.startswith("smpipe-test-cache-"):
        import shutil

        shutil.rmtree(CACHE, ignore_errors=True)
    gc.freeze()  # the interpreter's last collection at exit then walks none of it


def pytest_collection_finish(session):
    """The test modules and all they imported (torch, transformers, moto) live as long as the
    worker: out of the collector's sight, so that its collections walk only what the tests
    make (they took about 15% of a worker's CPU; https://docs.python.org/3/library/gc.html#gc.freeze)."""
    gc.freeze()


# The modules whose tests take longest (a minute or more of one worker: docs/performance.md,
# "Where the suite's time goes"), longest first, run first: pytest-xdist's loadscope hands the
# workers whole modules in collection order, so the two end within a short module of each
# other instead of one finishing a long module alone. Only the order changes.
LONGEST_FIRST = (
    "tests/test_resume.py",
    "tests/test_image.py",
    "tests/test_emulated.py",
    "tests/test_gpu_check.py",
    "tests/test_warm_start.py",
    "tests/reliability/test_lifecycle.py",
    "tests/test_tuning.py",
    "tests/test_pipeline.py",
    "tests/test_init.py",
    "tests/reliability/test_job_runtime.py",
    "tests/test_predict.py",
)


def pytest_collection_modifyitems(items):
    rank = {module: i for i, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


# The Hugging Face libraries' offline switches, as every job of a run gets them by default
# ([hub] OFFLINE: pipeline/stages.py `job_env`): nothing here may reach the Hub, and a test that
# starts jobs on a backend directly then gives them the environment a run's jobs have. A fork
# server is chosen by what the libraries read at import, these among them
# (pipeline/player/fork_client.py): one server then serves both kinds of test.
for name in HUB_OFFLINE:
    os.environ.setdefault(name, "1")

# torch sets TORCHINDUCTOR_CACHE_DIR in os.environ the first time a process needs its compile
# cache (torch/_inductor/runtime/cache_dir_utils.py `cache_dir`), and a preloaded library reads
# it at import (test_warm_start.py traces the reads), so it is part of a fork server's key: a
# worker would need its servers anew after its first test that compiles in-process. Set from
# the start, to torch's default (`default_cache_dir`: the temporary folder's
# torchinductor_<user>).
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    os.path.join(
        tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    ),
)


@pytest.fixture
def no_idle_servers():
    """The test starts with no fork server an earlier backend of this worker left
    (fork_client.IDLE), so that its first job starts cold. Those servers are set aside, not
    stopped: the tests after it take them, as a run takes the one its process's last run left
    (a preload is seconds of CPU); what the test itself leaves is stopped."""
    with IDLE._lock:
        aside, IDLE._servers = IDLE._servers, collections.OrderedDict()
    yield
    IDLE.close()
    with IDLE._lock:
        IDLE._servers = aside


@pytest.fixture(scope="session")
def moto_endpoint():
    server, endpoint = moto_server.serve()
    yield endpoint
    server.stop()


def moto_env(endpoint: str) -> dict[str, str]:
    """Credentials and endpoint for moto at `endpoint` (any credentials reach it)."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


@contextlib.contextmanager
def raw_data_bucket(endpoint: str, raw: Path, prefix: str):
    """Within: moto's environment, and a new bucket (its name starting with `prefix`) whose
    store, s3://BUCKET/root, holds `raw` as experiment test-exp's raw data; yields both. For a
    module's fixture that prepares data once (conftest's `bucket` is a new one per test)."""
    import uuid

    from pipeline.paths import ExperimentTree
    from pipeline.sources import upload_raw
    from pipeline.store import S3Store

    with pytest.MonkeyPatch.context() as env:
        for name, value in moto_env(endpoint).items():
            env.setenv(name, value)
        bucket = f"{prefix}-{uuid.uuid4().hex[:8]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        store = S3Store(f"s3://{bucket}/root")
        upload_raw(store, ExperimentTree("test-exp"), raw)
        yield bucket, store


@pytest.fixture
def aws_env(moto_endpoint, monkeypatch):
    """Credentials and endpoint for moto, in this process and every job it starts."""
    for name, value in moto_env(moto_endpoint).items():
        monkeypatch.setenv(name, value)
    return moto_endpoint


@pytest.fixture
def bucket(aws_env, request):
    """A fresh bucket per test."""
    import re
    import uuid

    name = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower())[:40].strip("-")
    name = f"smpipe-{name}-{uuid.uuid4().hex[:8]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


def write_settings(path: Path, store: str, **overrides: dict[str, str]) -> Path:
    """A small, fast settings file: the shipped one with sections overridden."""
    import configparser

    parser = configparser.ConfigParser(interpolation=None, delimiters=("=",))
    parser.optionxform = str.upper
    parser.read(ROOT / "settings.ini")
    # MiniLM's checkpoint (weights and AdamW's moments) is 270 MB, written by the job and
    # uploaded to the store when it ends: epoch ends only, one kept, unless a test checkpoints.
    small = {
        "experiment": {"STORE": store, "NAME": "test-exp"},
        "data": {"MAX_SEQUENCE_LENGTH": "32"},
        "training": {"EPOCHS": "1", "BATCH_SIZE": "8", "MAX_PER_DEVICE_BATCH_SIZE": "4",
                     "CHECKPOINT_EVERY_STEPS": "0", "KEEP_CHECKPOINTS": "1", "MAX_RESTARTS": "0"},
        "tracking": {"WANDB_MODE": "disabled"},
    }  # fmt: skip
    for section, values in list(small.items()) + list(overrides.items()):
        if not parser.has_section(section):
            parser.add_section(section)
        for key, value in values.items():
            if value is None:
                parser.remove_option(section, key)
            else:
                parser.set(section, key, value)
    for section in parser.sections():  # the demo's per-model settings are not for small tests
        per_model = section.startswith(("training.", "tuning.hyperparameters."))
        if per_model and section not in overrides:
            parser.remove_section(section)
    with open(path, "w") as f:
        parser.write(f)
    return path


@pytest.fixture(scope="session")
def demo_raw(tmp_path_factory) -> Path:
    """Twelve articles per topic, staged like the demo's raw data (with its defects)."""
    from user_functions.demo_data import write_demo

    out = tmp_path_factory.mktemp("demo_raw")
    write_demo(out, per_label=12)
    return out


@pytest.fixture(scope="module")
def channels(tmp_path_factory) -> dict[str, Path]:
    """Small prepared splits for a training job (tests/jobs/training_job.py): the label is
    given away by which marker token a row holds."""
    from tests.jobs.prepared import write_small_splits

    return write_small_splits(tmp_path_factory.mktemp("prepared"))


def ship_code(store, prefix: str = "code/") -> str:
    """The code a job runs, in the store as a run ships it: steps/, the demo's user functions,
    and the probe jobs of tests/jobs."""
    import shutil
    import tempfile

    from pipeline.store import upload_dir

    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    with tempfile.TemporaryDirectory() as tmp:
        for package in ("steps", "user_functions", "tests/jobs"):
            shutil.copytree(ROOT / package, Path(tmp) / package, ignore=ignore)
        shutil.copy(ROOT / "tests/__init__.py", Path(tmp) / "tests/__init__.py")
        upload_dir(store, tmp, prefix)
    return prefix


class SigtermAt(io.StringIO):
    """A backend's echo stream: once the job reports optimizer step `step`, SIGTERM (or
    `sig`) goes to every process of this test whose command line `target` accepts (a spot
    reclaim; SIGKILL: the out-of-memory killer)."""

    def __init__(self, step: int, target, sig: int = signal.SIGTERM):
        super().__init__()
        self.step, self.target, self.sig, self.sent = step, target, sig, False

    def write(self, text):
        if not self.sent and f"] step={self.step}/" in text:
            import psutil

            for child in psutil.Process().children(recursive=True):
                if self.target(child.cmdline()):
                    child.send_signal(self.sig)
                    self.sent = True
        return super().write(text)


def gated(folder: Path, step: int, functions: str = "tests.jobs.gated") -> dict[str, str]:
    """A training job's environment that makes it wait in optimizer step `step` until it gets
    SIGTERM (tests/jobs/gate.py), with the demo's user functions (tests/jobs/gated.py) or
    others whose model is gated."""
    from tests.jobs.gate import GATE_VARIABLE

    return {"SMPIPE_USER_FUNCTIONS": functions, GATE_VARIABLE: f"{folder}:{step}"}


def wait_at_gate(folder: Path, step: int | str, running, timeout: float = 300) -> None:
    """Until the job says it waits in step `step` (its marker file), while `running()`."""
    import time

    from tests.jobs.gate import marker

    end = time.monotonic() + timeout
    while not marker(folder, step).exists():
        assert running(), f"the job ended before it reached step {step}"
        assert time.monotonic() < end, f"the job did not reach step {step} in {timeout} s"
        time.sleep(0.02)


class SignalAtStep:
    """Signals a training job in optimizer step `step`, however fast this machine runs it:
    the job, `env` in its environment, waits in that step (`gated`); once it says so, `sig`
    goes to every process of this test that `target` accepts (SIGTERM, a spot
    reclaim: the step finishes and is checkpointed; SIGKILL: the out-of-memory killer).
    A context: the watcher ends with the block."""

    def __init__(self, folder: Path, step: int, target, sig: int = signal.SIGTERM):
        import threading

        self.step, self.target, self.sig, self.sent = step, target, sig, False
        self.env = gated(folder, step)
        self.done = threading.Event()
        self.watcher = threading.Thread(target=self.watch, args=(folder,), daemon=True)

    def __enter__(self):
        self.watcher.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.watcher.join(10)

    def watch(self, folder: Path) -> None:
        import psutil

        try:
            wait_at_gate(folder, self.step, lambda: not self.done.is_set())
        except AssertionError:
            return  # the block ended first: its own asserts say why
        for child in psutil.Process().children(recursive=True):
            try:
                if self.target(child):
                    child.send_signal(self.sig)
                    self.sent = True
            except psutil.Error:
                pass


@pytest.fixture
def warm(tmp_path):
    """Starts jobs as the local backend does, forked by a fork server (fork_client.WarmStart:
    each job exactly its own environment, root and code, tests/test_warm_start.py), for tests
    of what a step does, where a cold start of each job would cost seconds of imports
    (tests/jobs/training_job.py `start`). Their baselines start cold, so that a resumed warm job is
    compared with a cold one. One starter a test, as a run has one backend: it takes the
    server an earlier test or run of this worker left (fork_client.IDLE) and leaves it to the
    next, the local backends of other tests included. Where there is none, it starts beside
    the first job (as a study's trials are sure to follow), so that a test of one job leaves
    one too."""
    starter = WarmStart(tmp_path / "warm", echo=io.StringIO())
    with starter.expecting_more():
        yield starter
    starter.close()
