"""Warm start (pipeline/player/fork_server.py, fork_client.py): local jobs forked from a server that has
already imported torch and the rest keep the container contract. Each job sees exactly its own
environment, job root and shipped code; a crash of one ends only that job; a server that
cannot fork safely answers cold and the job still runs; the server ends with the driver."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from pipeline.backends.local import LocalBackend
from pipeline.jobs import ProcessingJob, TrainingJob
from pipeline.paths import ExperimentTree
from pipeline.player.fork_client import IDLE, WARM_START_VARIABLE, IdleServers, Server
from pipeline.player.fork_server import READY
from pipeline.player.job_root import OWNER, WORK_PREFIX
from pipeline.store import LocalStore, upload_dir
from tests import test_resume
from tests.conftest import ROOT, SignalAtStep, ship_code, write_settings
from tests.jobs.training_job import HPS, result
from tests.reliability.test_user_code import REST

RUN = ExperimentTree("warm").run(1)
# A step shipped with the job's code only (the project has no such module): what its process
# saw, and a crash or a wait on request.
PROBE = textwrap.dedent("""
    import os, sys
    PRELOADED = "torch" in sys.modules  # before this module imports anything: forked warm
    import json, signal, time
    import psutil
    import steps
    from steps.runtime.environment import processing_output
    from steps.runtime.step import run_step

    def main():
        args = sys.argv[1:]
        me = psutil.Process()
        seen = {"preloaded": PRELOADED, "env": dict(os.environ), "cwd": os.getcwd(),
                "file": __file__, "steps_file": steps.__file__,
                "marker": getattr(steps, "SHIPPED_MARKER", None),
                "leak_seen": "LEAKED_BY_A_JOB" in os.environ or hasattr(json, "LEAKED_BY_A_JOB"),
                "pid": me.pid, "entrypoint": me.ppid(), "server": me.parent().ppid(),
                "cmdline": me.cmdline(), "sid": os.getsid(0)}
        (processing_output("seen") / "seen.json").write_text(json.dumps(seen))
        if "--leak" in args:  # what one job does to its process must not reach the next
            os.environ["LEAKED_BY_A_JOB"] = "1"
            json.LEAKED_BY_A_JOB = True
        if "--trap" in args:
            def stop(signum, frame):
                print("probe got SIGTERM", flush=True)
                sys.exit(0)
            signal.signal(signal.SIGTERM, stop)
        print(f"probe waiting pid={me.pid} entrypoint={me.ppid()} server={seen['server']}",
              flush=True)
        if "--segv" in args:
            os.kill(os.getpid(), signal.SIGSEGV)
        if "--exit3" in args:
            os._exit(3)
        if "--kill-entrypoint" in args:  # the server's own child dies by SIGKILL
            os.kill(me.ppid(), signal.SIGKILL)
            time.sleep(60)
        if "--trap" in args or "--hang" in args:
            time.sleep(120)

    run_step("probe", main)
""")
# A training step of several processes: what each process and its parent (torchrun) are, and
# a sum across them.
RANK_PROBE = textwrap.dedent("""
    import sys
    PRELOADED = "torch" in sys.modules  # before this module imports anything: forked warm
    import json, os
    import psutil
    import torch
    import torch.distributed as dist
    from steps.runtime.environment import training_env
    from steps.runtime.step import run_step

    def main():
        rank = os.environ["RANK"]
        dist.init_process_group("gloo")
        total = torch.tensor([int(rank) + 1.0])
        dist.all_reduce(total)
        dist.destroy_process_group()
        seen = {"preloaded": PRELOADED, "parent": psutil.Process().parent().cmdline(),
                "all_reduce": total.item(), "threads": torch.get_num_threads(),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
        (training_env().model_dir / f"rank{rank}.json").write_text(json.dumps(seen))

    run_step("rank-probe", main)
""")


@pytest.fixture(scope="module")
def code(tmp_path_factory) -> tuple[Path, str]:
    """The run's code as a run ships it, with a marker in its copy of steps/ and the probe
    step; and the marker."""
    marker = uuid.uuid4().hex
    code = tmp_path_factory.mktemp("code")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "steps", code / "steps", ignore=ignore)
    with open(code / "steps/__init__.py", "a") as f:
        f.write(f"\nSHIPPED_MARKER = {marker!r}\n")
    (code / "warm_checks").mkdir()
    (code / "warm_checks/__init__.py").write_text("")
    (code / "warm_checks/probe.py").write_text(PROBE)
    (code / "warm_checks/rank_probe.py").write_text(RANK_PROBE)
    return code, marker


@pytest.fixture
def shipped(code, tmp_path) -> tuple[Path, str]:
    """A store holding the code and an input; and the code's marker."""
    store = tmp_path / "store"
    upload_dir(LocalStore(store), code[0], "code/")
    (tmp_path / "in").mkdir()
    (tmp_path / "in/a.txt").write_text("x")
    upload_dir(LocalStore(store), tmp_path / "in", "inputs/things/")
    return store, code[1]


def probe(name: str, *arguments: str) -> ProcessingJob:
    return ProcessingJob(
        name=name,
        step="warm_checks.probe",
        code="code/",
        inputs={"things": "inputs/things/"},
        outputs={"seen": f"outputs/{name}/"},
        arguments=list(arguments),
    )


def seen(store: Path, name: str) -> dict:
    return json.loads(LocalStore(store).get_bytes(f"outputs/{name}/seen.json"))


def local(store: Path, work: Path, echo=None) -> LocalBackend:
    return LocalBackend(LocalStore(store), RUN, echo=echo or io.StringIO(), work_root=str(work))


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: list[int], seconds: float = 20) -> list[int]:
    deadline = time.time() + seconds
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def test_warm_start_can_be_turned_off(shipped, tmp_path, monkeypatch):
    store, _ = shipped
    monkeypatch.setenv(WARM_START_VARIABLE, "0")
    backend = local(store, tmp_path / "work")
    results = [backend.run_processing(probe(f"cold-{i}")) for i in (1, 2)]
    backend.close(succeeded=True)
    assert [r.status for r in results] == ["Completed", "Completed"]
    assert not seen(store, "cold-1")["preloaded"] and not seen(store, "cold-2")["preloaded"]
    assert not (tmp_path / "work").exists()


def test_a_warm_job_sees_exactly_its_own_env_root_and_code(shipped, tmp_path, no_idle_servers):
    """The first job starts cold (and starts no server); the next two are forked by one server,
    and see what the first saw of the contract, their own roots and the shipped code."""
    store, marker = shipped
    echo = io.StringIO()
    warm = local(store, tmp_path / "warm", echo)
    results = [
        warm.run_processing(probe(*job)) for job in (["cold"], ["warm-1", "--leak"], ["warm-2"])
    ]
    warm.close(succeeded=True)
    assert [r.status for r in results] == ["Completed"] * 3, echo.getvalue()
    assert "starts cold" not in echo.getvalue()
    c, a, b = seen(store, "cold"), seen(store, "warm-1"), seen(store, "warm-2")
    assert not c["preloaded"] and a["preloaded"] and b["preloaded"]
    assert a["server"] == b["server"]  # one server for both jobs
    assert not b["leak_seen"]  # what job 1 did to its environment and modules died with it
    for job, s in (("warm-1", a), ("warm-2", b)):
        root = tmp_path / "warm" / job
        assert s["cwd"] == str(root)
        # Its own code: the store's copy (with the marker), laid out in its own job root.
        assert s["file"] == str(root / "processing/input/code/warm_checks/probe.py")
        assert s["steps_file"] == str(root / "processing/input/code/steps/__init__.py")
        assert s["marker"] == marker
        assert s["env"]["SMPIPE_ML_ROOT"] == str(root)
        assert s["env"]["SMPIPE_DRIVER_PID"] == str(s["server"])  # its parent follows the driver
        assert "steps.entrypoint" not in s["cmdline"] and "warm_checks.probe" in s["cmdline"]
        assert s["sid"] == s["pid"]  # a session of its own, as Popen(start_new_session) makes

    # Exactly the environment the same job has when started cold: same names, same values but
    # for its job root and its parent.
    def same(s: dict, root: Path) -> dict:
        env = {k: v.replace(str(root), "<root>") for k, v in s["env"].items()}
        return {**env, "SMPIPE_DRIVER_PID": "<parent>"}

    assert same(a, tmp_path / "warm/warm-1") == same(c, tmp_path / "warm/cold")
    assert not (tmp_path / "warm").exists()  # the servers' folder went with the work root


def fork_servers() -> list[psutil.Process]:
    """The fork servers this process has started that still run."""
    return [p for p in psutil.Process().children() if "fork_server.py" in " ".join(p.cmdline())]


def test_jobs_sure_to_follow_find_a_server_started_beside_the_first(
    shipped, tmp_path, no_idle_servers
):
    """Within expecting_more (a study's trials), the first job still starts cold, but its
    environment's server starts beside it: the job after it is forked by that server."""
    store, _ = shipped
    echo = io.StringIO()
    set_aside = {p.pid for p in fork_servers()}  # earlier tests' (no_idle_servers)
    warm = local(store, tmp_path / "early", echo)
    with warm.warm.expecting_more():
        first = warm.run_processing(probe("first"))
        servers = [p for p in fork_servers() if p.pid not in set_aside]
        second = warm.run_processing(probe("second"))
    warm.close(succeeded=True)
    assert [first.status, second.status] == ["Completed", "Completed"], echo.getvalue()
    assert not seen(store, "first")["preloaded"] and seen(store, "second")["preloaded"]
    # The server was already there when the first job ended, and it is the one that forked the
    # second (outside expecting_more, no server exists before a second job asks).
    assert [p.pid for p in servers] == [seen(store, "second")["server"]]
    assert wait_gone([p.pid for p in servers], seconds=1) == [servers[0].pid]  # kept for the next
    IDLE.close()
    assert wait_gone([p.pid for p in servers]) == []


def test_a_closed_backends_server_starts_the_next_runs_first_job_warm(
    shipped, tmp_path, monkeypatch
):
    """A backend that closes leaves its server to the next backend of the process whose jobs
    have the same environment but for what no library reads at import (other credentials,
    another test): that run's first job is forked by it, from the same preloaded state (a job
    of the first run leaked into its own process, not into the server), with its own
    environment; the server holds no credentials."""
    store, _ = shipped
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "first-run")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    first = local(store, tmp_path / "run-1")
    first.run_processing(probe("cold"))
    first.run_processing(probe("warm", "--leak"))
    first.close(succeeded=True)
    server = seen(store, "warm")["server"]
    assert alive(server)
    assert "AWS_ACCESS_KEY_ID" not in psutil.Process(server).environ()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "second-run")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test (call)")
    second = local(store, tmp_path / "run-2")
    result = second.run_processing(probe("next-run"))
    second.close(succeeded=True)
    assert result.status == "Completed"
    after = seen(store, "next-run")
    assert after["preloaded"] and after["server"] == server and not after["leak_seen"]
    assert after["cwd"] == str(tmp_path / "run-2/next-run")
    assert after["env"]["AWS_DEFAULT_REGION"] == "eu-west-1"  # (the key's value is masked)
    assert after["env"]["PYTEST_CURRENT_TEST"] == "another test (call)"


# User functions that say, when imported, whether torch was already there and which process
# imported them; and leave a mark on the json module of that process.
CHECKED = (
    textwrap.dedent("""
    import sys
    PRELOADED = "torch" in sys.modules  # before this module imports anything
    import json
    from pathlib import Path
    import psutil

    me = psutil.Process()
    Path(__file__).with_suffix(".json").write_text(
        json.dumps({"preloaded": PRELOADED, "parent": me.ppid(), "pid": me.pid}))
    json.LEAKED_BY_A_JOB = True

    def reconcile(raw_dir):
        return None, {}
""")
    + REST
)


def owned_check(root: Path) -> bool:
    """Whether `root` is a work root of a user-function check this process made."""
    try:
        owner = json.loads((root / OWNER).read_text())
    except (OSError, ValueError):  # gone meanwhile, or another's half written
        return False
    return owner.get("pid") == os.getpid() and "check" in owner.get("for", "")


def test_the_user_functions_check_is_forked_from_a_kept_server_of_its_environment(
    shipped, tmp_path, no_idle_servers, monkeypatch
):
    """With no kept server, the driver checks the user functions in a new interpreter. Once a
    closed backend has left one whose jobs have the check's environment, the check is forked
    from it, with torch already imported; what the import did stays in the check's process
    (the server's next job sees none of it)."""
    from pipeline.config import load_settings
    from pipeline.user_check import CHECK_AGAIN, check_user_functions

    store, _ = shipped
    monkeypatch.setenv(CHECK_AGAIN, "1")  # checked twice: a kept pass would answer the second
    (tmp_path / "project").mkdir()
    (tmp_path / "project/checked_functions.py").write_text(CHECKED)
    settings = load_settings(
        write_settings(tmp_path / "project/settings.ini", str(store),
                       experiment={"USER_FUNCTIONS": "checked_functions"}), env={}
    )  # fmt: skip
    said = tmp_path / "project/checked_functions.json"
    data_steps = ["reconcile", "prepare"]  # nothing trains the stand-in model of REST
    check_user_functions(settings, data_steps)
    cold = json.loads(said.read_text())
    assert not cold["preloaded"] and cold["parent"] == os.getpid(), cold
    first = local(store, tmp_path / "run-1")
    first.run_processing(probe("cold"))
    first.run_processing(probe("warm"))
    first.close(succeeded=True)
    server = seen(store, "warm")["server"]
    check_user_functions(settings, data_steps)
    warm = json.loads(said.read_text())
    assert warm["preloaded"] and warm["parent"] == server, warm
    assert not alive(warm["pid"])
    # The request and answer went with their folder (a work root: HOSTILE-USE, leftovers).
    # This process's only: another test worker may be checking its own functions right now.
    checks = [root for root in Path(tempfile.gettempdir()).glob(WORK_PREFIX + "*")
              if owned_check(root)]  # fmt: skip
    assert checks == [], checks
    second = local(store, tmp_path / "run-2")
    second.run_processing(probe("after"))
    second.close(succeeded=True)
    after = seen(store, "after")
    assert after["server"] == server and not after["leak_seen"], after


# Reads of os.environ during a preload, in a fresh interpreter: each key read and the library
# file that read it, and the files that iterated the whole environment.
TRACE_READS = textwrap.dedent("""
    import json, os, sys, traceback
    reads, iterated = set(), set()
    def reader():
        frames = [f for f in traceback.extract_stack() if "site-packages" in f.filename]
        return frames[-1].filename.split("site-packages/")[1] if frames else "?"
    Environ = type(os.environ)
    get, contains, iterate = Environ.__getitem__, Environ.__contains__, Environ.__iter__
    def traced_get(self, key):
        reads.add((key, reader()))
        return get(self, key)
    def traced_contains(self, key):
        reads.add((key, reader()))
        return contains(self, key)
    def traced_iter(self):
        iterated.add(reader())
        return iterate(self)
    Environ.__getitem__, Environ.__contains__ = traced_get, traced_contains
    Environ.__iter__ = traced_iter
    from pipeline.player.fork_server import preload
    preload()
    print(json.dumps({"reads": sorted(reads), "iterated": sorted(iterated)}))
""")
# Libraries that iterate the environment at import, and the one prefix each keeps.
READS_BY_PREFIX = {"tqdm/utils.py": "TQDM_", "fsspec/config.py": "FSSPEC_"}


def test_no_preloaded_library_reads_at_import_what_a_server_leaves_out():
    """A server's environment leaves out variables no preloaded library reads when imported
    (fork_client.NOT_READ_AT_IMPORT): the preload's os.environ reads, traced, touch none of
    them, and the libraries that iterate the environment keep only a prefix of their own.
    (Reads from C, OMP_NUM_THREADS by libgomp, cannot be traced: those stay in the key.)"""
    from pipeline.player.fork_client import NOT_READ_AT_IMPORT, NOT_READ_AT_IMPORT_PREFIXES

    env = {**dict.fromkeys(NOT_READ_AT_IMPORT, "x"), "SMPIPE_X": "x", "PYTEST_X": "x"}
    out = subprocess.run(
        [sys.executable, "-c", TRACE_READS],
        env={**os.environ, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    traced = json.loads(out.stdout.strip().splitlines()[-1])
    read = [
        key
        for key, where in traced["reads"]
        # a library that iterates the environment reads each value, and keeps its prefix's
        if where not in READS_BY_PREFIX or key.startswith(READS_BY_PREFIX[where])
    ]
    assert "HF_HUB_OFFLINE" in read  # the trace sees what huggingface_hub reads
    # Paths under HOME kept from the import: why the containers a process plays share one HOME
    # (environment.container_home).
    assert {"HOME", "HF_HOME"} <= set(read)
    left_out = [
        key
        for key in read
        if key in NOT_READ_AT_IMPORT or key.startswith(NOT_READ_AT_IMPORT_PREFIXES)
    ]
    assert left_out == []
    assert set(traced["iterated"]) <= set(READS_BY_PREFIX), (
        "a preloaded library iterates the environment: check what it reads at import",
        traced["iterated"],
    )


def test_idle_servers_keep_the_newest_and_stop_the_rest(tmp_path):
    """At most `limit` idle servers: the oldest is stopped when another is kept, a kept one
    is taken once, and a server that has ended is never handed out."""
    # A server as far as the backend's side sees one: says it is ready, ends when its
    # control socket closes (as warm_start.serve does).
    launcher = [
        sys.executable,
        "-c",
        f"import socket, sys; s = socket.socket(fileno=int(sys.argv[1])); s.send({READY!r}); "
        "s.recv(1)",
    ]
    servers = [Server({}, tmp_path / f"server-{i}.log", launcher) for i in range(3)]
    idle = IdleServers(limit=2)
    for i, server in enumerate(servers):
        idle.keep(("env", i), server)
    assert servers[0].process.poll() is not None  # the oldest, stopped
    assert idle.take(("env", 0)) is None
    servers[1].process.kill()
    servers[1].process.wait()
    assert idle.take(("env", 1)) is None  # ended: not handed out
    assert idle.take(("env", 2)) is servers[2] and idle.take(("env", 2)) is None
    idle.keep(("env", 2), servers[2])
    idle.close()
    assert servers[2].process.wait(timeout=10) == 0


@pytest.mark.parametrize(
    "crash,status",
    [("--segv", -signal.SIGSEGV), ("--exit3", 3), ("--kill-entrypoint", -signal.SIGKILL)],
)
def test_a_crash_fails_only_its_job_and_the_server_serves_the_next(
    shipped, tmp_path, crash, status
):
    """The step segfaults or calls os._exit(3), or the warm-started entrypoint itself is
    SIGKILLed: that job is Failed with its status, and the same server starts the next."""
    store, _ = shipped
    echo = io.StringIO()
    backend = local(store, tmp_path / "work", echo)
    backend.run_processing(probe("first"))  # cold, or forked by a server an earlier test left
    before = backend.run_processing(probe("before"))
    crashed = backend.run_processing(probe("crashed", crash))
    after = backend.run_processing(probe("after"))
    backend.close(succeeded=False)
    assert before.status == after.status == "Completed", echo.getvalue()
    assert crashed.status == "Failed"
    if crash == "--kill-entrypoint":  # the entrypoint itself: its status as Popen reports it
        assert crashed.failure_reason.startswith(f"exit status {status}: killed by SIG")
    else:  # the step: the entrypoint reports it
        assert f"exited with status {status}" in crashed.failure_reason, crashed.failure_reason
    assert seen(store, "before")["preloaded"] and seen(store, "after")["preloaded"]
    assert seen(store, "before")["server"] == seen(store, "after")["server"]


def test_the_server_reports_a_jobs_exit_with_its_cpu_time_children_included():
    """The server, not the driver, is a warm job's parent and reaps it: it sends the job's
    status and its CPU time with that of the processes the job waited for (wait4), which the
    driver can no longer read once the job is reaped."""
    from pipeline.player.fork_client import WarmProcess
    from pipeline.player.fork_server import report_exit

    burn = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass"
    pid = os.fork()
    if pid == 0:  # the job: a child that burns 0.4 s, waited for; then 0.4 s of its own; exit 3
        try:
            subprocess.run([sys.executable, "-c", burn], check=True)
            end = time.process_time() + 0.4
            while time.process_time() < end:
                pass
        finally:
            os._exit(3)
    server_side, driver_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    report_exit(pid, server_side)
    job = WarmProcess(driver_side, pid, ["job"], io.BytesIO())
    assert job.wait(timeout=10) == 3
    assert 0.8 <= job.cpu_seconds < 0.8 + 5, job.cpu_seconds


def test_a_warm_multi_process_job_forks_torchrun_and_its_workers(
    shipped, tmp_path, monkeypatch, no_idle_servers
):
    """In a warm job, torchrun's agent is forked from the entrypoint and forks its training
    processes in turn (steps/runtime/torchrun_fork.py): each starts with torch imported, has
    its rank, and the two reduce across gloo. Each computes with the threads torchrun gives a
    worker of several on a host, one where OMP_NUM_THREADS is unset, though the server's
    torch was loaded with every core (the suite sets it for its workers: unset here, so the
    server is one of this test's own, stopped after it)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    store, _ = shipped
    backend = local(store, tmp_path / "work")
    backend.run_processing(probe("first"))  # cold: the server starts with the next job
    job = TrainingJob(
        name="ranks", step="warm_checks.rank_probe", code="code/",
        channels={"things": "inputs/things/"}, hyperparameters={}, model_prefix="outputs/ranks/",
        output_prefix="outputs/ranks-output/", checkpoint_prefix="outputs/ranks-checkpoints/",
        sagemaker_output="outputs/ranks-sagemaker/", processes_per_host=2,
    )  # fmt: skip
    result = backend.run_training(job)
    backend.close(succeeded=True)
    assert result.status == "Completed", result.failure_reason
    for rank in (0, 1):
        seen = json.loads(LocalStore(store).get_bytes(f"outputs/ranks/rank{rank}.json"))
        assert seen["parent"][1:3] == ["-m", "steps.runtime.torchrun_fork"], seen
        assert seen["preloaded"] and seen["all_reduce"] == 3.0, seen
        assert seen["OMP_NUM_THREADS"] == "1" and seen["threads"] == 1, seen


def test_sigterm_to_a_warm_job_reaches_its_step(shipped, tmp_path):
    """Stopping a job (`docker stop`'s SIGTERM to its entrypoint) reaches the forked step."""
    store, _ = shipped

    class StopWhenWaiting(io.StringIO):
        def write(self, text):
            # The trapped job's own line: a stop of a job stops it from the moment it starts,
            # and the first job's line would stop this one before its trap is set.
            if "[trapped] probe waiting" in text:
                backend.containers.stop("trapped")
            return super().write(text)

    echo = StopWhenWaiting()
    backend = local(store, tmp_path / "work", echo)
    backend.run_processing(probe("first"))  # cold, or forked by a server an earlier test left
    result = backend.run_processing(probe("trapped", "--trap"))
    backend.close(succeeded=False)
    assert "[trapped] probe got SIGTERM" in echo.getvalue(), echo.getvalue()
    assert result.end_time - result.start_time < 60  # not the probe's 120 s wait


def test_a_server_that_is_not_single_threaded_answers_cold_and_the_job_runs(
    shipped, tmp_path, no_idle_servers
):
    """A server with a thread of unknown safety (here one the test starts beside it) must not
    fork: the job starts cold, and the backend says why, once."""
    from pipeline.player import fork_server

    store, _ = shipped
    threaded = (
        "import runpy, sys, threading, time; "
        "threading.Thread(target=time.sleep, args=(3600,), daemon=True).start(); "
        f"runpy.run_path({fork_server.__file__!r}, run_name='__main__')"
    )
    echo = io.StringIO()
    backend = local(store, tmp_path / "work", echo)
    backend.warm.launcher = [sys.executable, "-c", threaded]
    results = [backend.run_processing(probe(f"cold-{i}")) for i in (1, 2, 3)]
    backend.close(succeeded=False)
    assert [r.status for r in results] == ["Completed"] * 3, echo.getvalue()
    assert not any(seen(store, f"cold-{i}")["preloaded"] for i in (1, 2, 3))
    said = re.findall(
        r"warm start: the fork server runs 1 thread\(s\) of unknown safety", echo.getvalue()
    )
    assert len(said) == 1, echo.getvalue()


DRIVER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from pipeline.backends.local import LocalBackend
    from pipeline.paths import ExperimentTree
    from pipeline.store import LocalStore
    from tests.test_warm_start import probe

    backend = LocalBackend(LocalStore({store!r}), ExperimentTree("warm").run(1), echo=sys.stdout,
                           work_root={work!r})
    backend.run_processing(probe("first"))  # cold: the server starts with the next job
    backend.run_processing(probe("orphaned", "--hang"))
""")


def test_the_server_and_its_jobs_end_when_the_driver_is_killed(shipped, tmp_path):
    """A SIGKILLed driver cannot stop anything: the server sees it go and ends, and the job,
    whose parent it was, gets SIGTERM and ends too."""
    store, _ = shipped
    script = DRIVER.format(root=str(ROOT), store=str(store), work=str(tmp_path / "work"))
    driver = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        for line in driver.stdout:
            found = re.search(
                r"\[orphaned\] probe waiting pid=(\d+) entrypoint=(\d+) server=(\d+)", line
            )
            if found:
                break
        else:
            pytest.fail("the job never started")
        step, entrypoint, server = (int(g) for g in found.groups())
        assert psutil.Process(server).cmdline()[1].endswith("fork_server.py")
        driver.kill()
        driver.wait()
        assert wait_gone([server, entrypoint, step]) == []
    finally:
        driver.kill()
        driver.wait()


# The resume tests' uninterrupted, cold-started job on the small prepared splits (`channels`).
baseline = test_resume.baseline


def test_sigterm_to_a_warm_training_step_checkpoints_and_the_restart_trains_the_same(
    tmp_path, channels, baseline
):
    """A spot reclaim of a warm training job: SIGTERM reaches the forked step, which
    checkpoints and exits 75; the backend restarts it (warm) and the model is bitwise the one
    an uninterrupted cold run trains."""
    store = LocalStore(tmp_path / "store")
    for name, path in channels.items():
        upload_dir(store, path, f"data/{name}/")
    ship_code(store)

    parents: list[str] = []  # the command line of the signalled step's entrypoint's parent

    def training_step(process: psutil.Process) -> bool:
        if "steps.train" not in process.cmdline():
            return False
        parents[:] = psutil.Process(process.ppid()).parent().cmdline()
        return True

    echo = io.StringIO()
    backend = LocalBackend(store, RUN, work_root=str(tmp_path / "work"), echo=echo)

    def job(name: str, **hyperparameters: str) -> TrainingJob:
        return TrainingJob(
            name=name,
            step="train",
            code="code/",
            channels={c: f"data/{c}/" for c in channels},
            hyperparameters={**HPS, **hyperparameters},
            model_prefix=f"{name}/model/",
            output_prefix=f"{name}/output/",
            checkpoint_prefix=f"{name}/checkpoints/",
            sagemaker_output=f"{name}/sm/",
            env={"SMPIPE_USER_FUNCTIONS": "user_functions"},
            max_restarts=2,
        )

    with SignalAtStep(tmp_path / "gates", 7, training_step) as reclaim:
        # The same environment (the gate's) for both: a server forks the second job (it starts
        # with it, or an earlier test of this worker left it).
        first = backend.run_training(replace(job("first", max_steps="1"), env=reclaim.env))
        assert first.status == "Completed"
        outcome = backend.run_training(replace(job("sigterm-test"), env=reclaim.env))
    backend.close(succeeded=True)
    log = echo.getvalue()
    assert reclaim.sent and outcome.status == "Completed" and outcome.restarts == 1, log
    assert parents[1].endswith("fork_server.py"), parents  # the step was warm
    assert "SIGTERM: checkpoint written at step 7;" in log, log
    (tmp_path / "final/model").mkdir(parents=True)
    for name in ("model.safetensors", "history.json"):
        store.download_file(f"sigterm-test/model/{name}", tmp_path / "final/model" / name)
    test_resume.assert_same(result(tmp_path / "final"), baseline)
