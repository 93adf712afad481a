"""run_num allocation: drivers started at once never share a run_num or overwrite a run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipeline.paths import ExperimentTree
from pipeline.runs import claim_run_num, existing_run_nums
from pipeline.store import LocalStore, S3Store
from tests.conftest import ROOT

CLAIMER = """
import json, os, sys, time
from pipeline.paths import ExperimentTree
from pipeline.runs import claim_run_num
from pipeline.store import open_store

store = open_store(sys.argv[1])
tree = ExperimentTree("exp")
while time.time() < float(sys.argv[2]):  # start together
    time.sleep(0.001)
run_num = claim_run_num(store, tree)
store.put_bytes(tree.run(run_num).prefix + "owner.json", json.dumps({"pid": os.getpid()}).encode())
print(run_num)
"""


def claim_concurrently(uri: str, drivers: int) -> list[tuple[int, int]]:
    import time

    start = time.time() + 3
    procs = [subprocess.Popen([sys.executable, "-c", CLAIMER, uri, str(start)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
             for _ in range(drivers)]  # fmt: skip
    claimed = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        claimed.append((int(out.strip()), p.pid))
    return claimed


@pytest.mark.parametrize("kind", ["s3", "local"])
def test_eight_drivers_claim_eight_distinct_runs(kind, request, tmp_path):
    if kind == "s3":
        uri = f"s3://{request.getfixturevalue('bucket')}"
        store = S3Store(uri)
    else:
        uri = str(tmp_path / "store")
        store = LocalStore(uri)
    claimed = claim_concurrently(uri, 8)
    nums = sorted(n for n, _ in claimed)
    assert nums == list(range(1, 9))
    tree = ExperimentTree("exp")
    # Every run's files are its own driver's: nobody wrote into another's run.
    for run_num, pid in claimed:
        assert json.loads(store.get_bytes(tree.run(run_num).prefix + "owner.json"))["pid"] == pid
    assert existing_run_nums(store, tree) == nums


def test_claim_skips_taken_numbers_and_never_reuses(tmp_path):
    store = LocalStore(tmp_path)
    tree = ExperimentTree("exp")
    assert claim_run_num(store, tree) == 1
    claim = store.get_bytes(tree.run(1).claim)
    store.put_bytes(tree.run(3).claim, b"{}")  # a run someone else made
    assert claim_run_num(store, tree) == 4
    assert store.get_bytes(tree.run(1).claim) == claim


def test_a_run_whose_driver_ended_before_its_record_is_abandoned_not_claimed_for_good(
    tmp_path, capsys
):
    """A driver killed between claiming a run_num and writing the run's Metadata (the store
    failing there, a SIGKILL) leaves a claim and no record. It stayed `claimed` for good:
    `runs` showed it as live, prune kept every raw version for it, and `--resume` said there
    was no such run. Its driver gone, it is abandoned: nothing is kept for it, and --resume
    says why it cannot continue; one whose driver is alive is still being started."""
    import socket
    import time

    from pipeline import cli
    from pipeline.history import run_rows
    from pipeline.prune import raw_versions_read
    from tests.conftest import write_settings

    store, tree = LocalStore(tmp_path / "store"), ExperimentTree("test-exp")
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    for run_num, pid in ((1, int(ended.stdout)), (2, os.getpid())):
        claim = {"host": socket.gethostname(), "pid": pid, "claimed_at": time.time()}
        assert store.create(tree.run(run_num).claim, json.dumps(claim).encode())

    assert [row["status"] for row in run_rows(store, tree)] == ["abandoned", "claimed"]
    settings = write_settings(tmp_path / "s.ini", str(store.root))
    assert cli.main(["run", str(settings), "--resume", "1"]) == 2
    err = capsys.readouterr().err
    assert "--resume 1: run 0001 never started (its driver (pid " in err
    assert "nothing ran, so there is nothing to continue" in err
    assert cli.main(["run", str(settings), "--resume", "2"]) == 2
    assert "--resume 2: run 0002 is starting (its driver is alive)" in capsys.readouterr().err
    # A live claim may read any raw version: none is known to be unread; a dead one reads none.
    assert raw_versions_read(store, tree) is None
    assert raw_versions_read(store, tree, pruning={2}) == {}
