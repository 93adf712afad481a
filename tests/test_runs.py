"""run_num allocation: drivers started at once never share a run_num or overwrite a run."""

from __future__ import annotations

import json
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
