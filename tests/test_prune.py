"""Runs end small: a completed run's checkpoints go when it completes (failed and interrupted
runs keep theirs for --resume), `smpipe runs` shows each run's size, and `smpipe prune` removes
older runs' bulky files while keeping what says what they were. Run trees are written by hand,
small, on both stores (a local folder and moto's S3)."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest

from pipeline import cli
from pipeline import metadata as md
from pipeline.config import load_settings
from pipeline.driver import ended
from pipeline.errors import PipelineError
from pipeline.history import human_bytes
from pipeline.paths import ExperimentTree, RunTree
from pipeline.prune import PruneError, prune_plan, prune_run
from pipeline.runs import driver_identity
from pipeline.sources import stopped_record
from pipeline.stages import RunContext
from pipeline.store import MANIFEST, LocalStore, S3Store, StoreError
from tests.conftest import write_settings

TREE = ExperimentTree("test-exp")
# What each hand-written run holds: key (relative to the run) -> size. The bulky ones are
# exactly what prune removes; the rest stays.
BULKY = {
    "checkpoints/bow/CURRENT": 14,
    "checkpoints/bow/ckpt-00000004/state.pt": 9000,
    "checkpoints/bow-trial-001/ckpt-00000002/state.pt": 3000,
    "models/bow/model/model.safetensors": 5000,
    "models/bow/model/model.torchscript.pt": 6000,
    "models/bow/model/model.pt2": 7000,
    f"models/bow/model/{MANIFEST}": 300,
    "tuning/bow/trial-001/model/model.safetensors": 4000,
    "tuning/bow/trial-001/output/step_metadata.json": 50,
    "jobs/training/test-exp-tune-bow-001/output/model.tar.gz": 2000,
}
KEPT = {
    "settings.ini": 40,
    "logs/test-exp-train-bow.log": 70,
    "inference/bow/overall.json": 80,
    "inference/bow/per_label.csv": 90,
    "report.html": 1000,
    "models/bow/model/history.json": 110,
    "models/bow/model/curves.png": 120,
    "models/bow/model/smpipe.json": 130,
    "models/bow/output/step_metadata.json": 140,
    "tuning/bow/tuning.json": 150,
    "tuning/bow/trials.png": 160,
    "jobs/prepare/step_metadata.json": 170,
}
CHECKPOINT_BYTES = sum(n for k, n in BULKY.items() if k.startswith("checkpoints/"))


@pytest.fixture(params=["local", "s3"])
def store_at(request, tmp_path):
    """A store and the STORE setting that names it."""
    if request.param == "s3":
        uri = f"s3://{request.getfixturevalue('bucket')}/root"
        return S3Store(uri), uri
    return LocalStore(tmp_path / "store"), str(tmp_path / "store")


def write_run(store, run_num: int, status: str | None) -> RunTree:
    """A run as a run leaves it; status None: claimed, its Metadata not written yet."""
    run = TREE.run(run_num)
    store.create(run.claim, b"{}")
    for rel, size in {**BULKY, **KEPT}.items():
        store.put_bytes(run.prefix + rel, bytes(size))
    section = md.StepSection(step="train", status="completed")
    store.put_bytes(run.step_metadata("train"), section.model_dump_json().encode())
    if status is not None:
        models = {"bow": run.model("bow") + "model/"}
        record = {"status": status, "model_version": run_num, "planned_steps": ["train"]}
        record.update(sources={}, model_artifacts=models)
        store.put_bytes(run.metadata, json.dumps(record).encode())
    if status == "running":  # its driver is alive: this process, beating now
        beat = {**driver_identity(), "time": time.time()}
        store.put_bytes(run.heartbeat, json.dumps(beat).encode())
    return run


def everything(store) -> dict[str, bytes]:
    return {key: store.get_bytes(key) for key in store.list_keys("")}


def size_of(store, run: RunTree) -> int:
    return sum(store.list_sizes(run.prefix).values())


# -- a completed run's checkpoints, removed when it completes ------------------------------------


class NoBackend:
    """What a stage reads of a backend that runs nothing: no SageMaker client, as local."""

    client = None

    def close(self, succeeded: bool) -> None:
        self.succeeded = succeeded


def end_run(tmp_path, store, status: str, **training) -> tuple[dict, RunTree]:
    """The driver's end of a run (driver.ended), as the run loop calls it."""
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "unused"), training=training)
    run = write_run(store, 1, "running")
    where = store.uri_of(run.prefix)
    base = md.Metadata(
        run_id="test-exp/0001",
        model_version=1,
        experiment_name="test-exp",
        artifact_uri=where,
        backend="local",
    )
    ctx = RunContext(load_settings(path, env={}), store, run, None, base, NoBackend())
    return ended(ctx, time.time(), status, None if status == "completed" else "why"), run


def test_a_completed_run_loses_its_checkpoints_and_says_how_many_bytes(store_at, tmp_path, caplog):
    store, _ = store_at
    caplog.set_level(logging.INFO, logger="smpipe")
    record, run = end_run(tmp_path, store, "completed")
    assert record["status"] == "completed"
    assert record["checkpoints_removed_bytes"] == CHECKPOINT_BYTES
    assert (
        json.loads(store.get_bytes(run.metadata))["checkpoints_removed_bytes"] == CHECKPOINT_BYTES
    )
    assert store.list_keys(run.checkpoints_root) == []
    assert f"{human_bytes(CHECKPOINT_BYTES)} freed" in caplog.text
    # Everything else of the run stays: its model, its trials, its records.
    left = set(store.list_keys(run.prefix))
    assert {run.prefix + k for k in {**BULKY, **KEPT} if not k.startswith("checkpoints/")} <= left


@pytest.mark.parametrize("status", ["failed", "interrupted"])
def test_a_run_that_did_not_complete_keeps_its_checkpoints_for_resume(tmp_path, status):
    store = LocalStore(tmp_path / "store")
    record, run = end_run(tmp_path, store, status)
    assert record["status"] == status and record["checkpoints_removed_bytes"] is None
    assert len(store.list_keys(run.checkpoints_root)) == 3


def test_the_setting_keeps_a_completed_runs_checkpoints(tmp_path):
    store = LocalStore(tmp_path / "store")
    record, run = end_run(tmp_path, store, "completed", KEEP_CHECKPOINTS_AFTER_RUN="true")
    assert record["status"] == "completed" and record["checkpoints_removed_bytes"] is None
    assert len(store.list_keys(run.checkpoints_root)) == 3


class RefusingStore(LocalStore):
    """Deletes are denied (a bucket policy without s3:DeleteObject, say)."""

    def delete(self, key: str) -> None:
        raise StoreError(f"S3 delete of {self.uri_of(key)} failed: AccessDenied")


def test_a_removal_the_store_refuses_is_said_and_the_run_stays_completed(tmp_path, caplog):
    store = RefusingStore(tmp_path / "store")
    record, run = end_run(tmp_path, store, "completed")
    assert record["status"] == "completed" and record["checkpoints_removed_bytes"] is None
    assert json.loads(store.get_bytes(run.metadata))["status"] == "completed"
    assert "checkpoints of run 0001 could not be removed" in caplog.text
    assert "AccessDenied" in caplog.text and "completed all the same" in caplog.text


# -- smpipe runs: each run's size; smpipe prune ------------------------------------------------


def test_prune_dry_run_says_what_and_writes_nothing(store_at, tmp_path, capsys):
    store, uri = store_at
    path = write_settings(tmp_path / "settings.ini", uri)
    runs = [write_run(store, n, "completed") for n in (1, 2, 3)]
    before = everything(store)
    assert cli.main(["prune", str(path), "--keep", "1"]) == 0
    out = capsys.readouterr().out
    bulky = human_bytes(sum(BULKY.values()))
    assert f"run 0001 (completed, {human_bytes(size_of(store, runs[0]))}): would remove" in out
    assert out.count(f"would remove {bulky} in {len(BULKY)} files") == 2 and "run 0003" not in out
    assert "checkpoints/ " in out and "tuning/bow/trial-001/ " in out
    assert "nothing was removed" in out
    assert everything(store) == before


def test_prune_removes_only_bulky_files_and_records_it(store_at, tmp_path, capsys):
    store, uri = store_at
    path = write_settings(tmp_path / "settings.ini", uri)
    runs = [write_run(store, n, "completed") for n in (1, 2, 3)]
    data = TREE.data(1).split("train") + "data-00000-of-00001.arrow"
    store.put_bytes(data, bytes(20_000))  # a data version: never touched
    whole = size_of(store, runs[0])
    assert cli.main(["runs", str(path)]) == 0
    assert capsys.readouterr().out.count(f" {human_bytes(whole)} ") == 3  # the size column
    before = everything(store)

    assert cli.main(["prune", str(path), "--keep", "2", "--yes"]) == 0
    out = capsys.readouterr().out
    assert f"run 0001 (completed, {human_bytes(whole)}): removed" in out and "run 0002" not in out
    after = everything(store)
    assert set(after) == set(before) - {runs[0].prefix + k for k in BULKY}
    assert all(after[k] == before[k] for k in after if k != runs[0].metadata)
    pruned = json.loads(after[runs[0].metadata])["pruned"]
    assert pruned["removed_bytes"] == sum(BULKY.values()) and pruned["keep"] == 2
    assert pruned["removed"]["checkpoints/"] == CHECKPOINT_BYTES
    assert pruned["removed"]["models/bow/model/"] == 18_300  # weights, exports, manifest
    # `smpipe predict` with its model says why it is gone.
    from pipeline.predict.checks import choose

    problems = choose(load_settings(path, env={}), store, 1, "bow")[1]
    assert "model 'bow' of run 0001 is no longer complete at " in problems[0]
    assert f"(the run was pruned at {pruned['time']}: smpipe prune)" in problems[0]
    # The size column says what is left; a second prune finds nothing more to remove.
    left = size_of(store, runs[0])
    assert left < whole - sum(BULKY.values()) + 1000
    assert cli.main(["runs", str(path)]) == 0
    listed = capsys.readouterr().out
    assert f" {human_bytes(left)} " in listed
    # The pruned run is marked so in its status, the others not.
    assert listed.count("completed, pruned") == 1 and listed.count("completed") == 3
    assert cli.main(["prune", str(path), "--keep", "2", "--yes"]) == 0
    assert "nothing to prune" in capsys.readouterr().out


def test_a_prune_stopped_half_way_leaves_the_run_marked_and_the_next_finishes_it(
    tmp_path, capsys, monkeypatch
):
    """Ctrl-C as the first run's model manifest went: the run stayed `completed` with its model
    half gone, and the message was the one a stopped `run` gives. Now the run is recorded as
    pruned before anything of it goes, `runs` says it is half pruned, prune says what it left,
    and the next prune finishes it."""
    store = LocalStore(tmp_path / "store")
    path = write_settings(tmp_path / "settings.ini", str(store.root))
    runs = [write_run(store, n, "completed") for n in (1, 2)]
    delete = LocalStore.delete

    def stopped_after_the_first(self, key):
        delete(self, key)
        raise KeyboardInterrupt

    monkeypatch.setattr(LocalStore, "delete", stopped_after_the_first)
    assert cli.main(["prune", str(path), "--keep", "1", "--yes"]) == 130
    err = capsys.readouterr().err
    assert "interrupted: stopped by the user (Ctrl-C); a run it had begun to prune is marked" in err
    half = json.loads(store.get_bytes(runs[0].metadata))["pruned"]
    assert half["unfinished"] and half["keep"] == 1
    assert cli.main(["runs", str(path)]) == 0
    assert "completed, half pruned (`smpipe prune` finishes it)" in capsys.readouterr().out

    # Finished by the next prune, whatever it keeps; what the stopped one removed counted.
    monkeypatch.setattr(LocalStore, "delete", delete)
    assert cli.main(["prune", str(path), "--keep", "5", "--yes"]) == 0
    done = json.loads(store.get_bytes(runs[0].metadata))["pruned"]
    assert "unfinished" not in done and done["keep"] == 5
    assert done["removed_files"] == len(BULKY) and done["removed_bytes"] == sum(BULKY.values())
    assert not [k for k in store.list_keys(runs[0].prefix) if k[len(runs[0].prefix) :] in BULKY]


def test_prune_never_touches_a_run_that_may_be_running(tmp_path):
    store = LocalStore(tmp_path / "store")
    statuses = {1: "running", 2: "failed", 3: None, 4: "completed", 5: "completed"}
    runs = {n: write_run(store, n, status) for n, status in statuses.items()}
    before = everything(store)
    plan = prune_plan(store, TREE, keep=1)
    assert [(r.run.run_num, r.status) for r in plan] == [(2, "failed"), (4, "completed")]
    for removal in plan:
        prune_run(store, removal, keep=1)
    after = everything(store)
    for n in (1, 3, 5):  # live, claimed (no Metadata yet), kept
        assert {k: v for k, v in after.items() if k.startswith(runs[n].prefix)} == {
            k: v for k, v in before.items() if k.startswith(runs[n].prefix)
        }
    assert not store.list_keys(runs[2].checkpoints_root)


def test_prune_refuses_to_keep_no_run(tmp_path, capsys):
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "store"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["prune", str(path), "--keep", "0"])
    assert exit_.value.code == 2 and "keep at least 1 completed run" in capsys.readouterr().err
    with pytest.raises(PruneError, match="keep at least 1"):
        prune_plan(LocalStore(tmp_path / "store"), TREE, keep=0)


def test_a_pruned_run_is_not_resumed(tmp_path):
    store = LocalStore(tmp_path / "store")
    run = write_run(store, 1, "failed")
    for n in (2, 3):
        write_run(store, n, "completed")
    path = write_settings(tmp_path / "settings.ini", str(store.root))
    assert cli.main(["prune", str(path), "--keep", "1", "--yes"]) == 0
    with pytest.raises(PipelineError, match="was pruned at .*start a new run"):
        stopped_record(store, run)


# -- a --resume and a prune never act on one run at once ---------------------------------------------


def test_a_run_being_resumed_is_not_pruned(tmp_path, capsys):
    """A resume holds the run from the moment it reads its record: a prune --yes run meanwhile
    (between the resume's "not pruned" check and its first step) leaves it whole."""
    from pipeline.runs import lease

    store = LocalStore(tmp_path / "store")
    run = write_run(store, 1, "failed")
    for n in (2, 3):
        write_run(store, n, "completed")
    path = write_settings(tmp_path / "settings.ini", str(store.root))
    before = {k: v for k, v in everything(store).items() if k.startswith(run.prefix)}
    with lease(store, run, "resumed"):
        assert cli.main(["prune", str(path), "--keep", "1", "--yes"]) == 0
        out = capsys.readouterr().out
        stopped_record(store, run)  # still resumable: not pruned
    assert f"run 0001: not pruned: run 0001 is being resumed by pid {os.getpid()}" in out
    assert "run 0002 (completed" in out and "freed" in out
    after = {k: v for k, v in everything(store).items() if k.startswith(run.prefix)}
    assert after == before  # the lease is gone with the resume, nothing else changed
    assert not store.list_keys(TREE.run(2).checkpoints_root)


def test_a_resume_is_refused_while_a_prune_holds_the_run(tmp_path, monkeypatch):
    from pipeline.driver import run_pipeline
    from pipeline.runs import RunBusy, lease

    store = LocalStore(tmp_path / "store")
    run = write_run(store, 1, "failed")
    path = write_settings(tmp_path / "settings.ini", str(store.root))
    monkeypatch.setattr("pipeline.driver.check_user_functions", lambda settings, steps: {})
    with lease(store, run, "pruned"), pytest.raises(RunBusy, match="run 0001 is being pruned by"):
        run_pipeline(load_settings(path, env={}), store, ["train"], resume=1)
    assert store.list_keys(run.checkpoints_root)


def test_a_plan_made_before_a_resume_started_prunes_nothing(tmp_path):
    store = LocalStore(tmp_path / "store")
    run = write_run(store, 1, "failed")
    for n in (2, 3):
        write_run(store, n, "completed")
    [removal, _] = prune_plan(store, TREE, keep=1)
    write_run(store, 1, "running")  # a resume started after the plan (its driver: this one)
    assert (
        prune_run(store, removal, keep=1) == "it is running now (it was failed when prune looked)"
    )
    assert store.list_keys(run.checkpoints_root)


def test_a_lease_whose_holder_is_gone_is_taken_over(tmp_path):
    import socket
    import subprocess
    import sys

    from pipeline.runs import lease

    store = LocalStore(tmp_path / "store")
    run = write_run(store, 1, "failed")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    held = {"host": socket.gethostname(), "pid": int(dead), "doing": "pruned", "time": time.time()}
    store.create(run.lease, json.dumps(held).encode())
    assert prune_run(store, prune_plan_of(store, run), keep=1) is None
    assert not store.list_keys(run.checkpoints_root) and not store.list_keys(run.lease)
    with lease(store, TREE.run(9), "resumed"):  # no such run: nothing is made for it
        assert not store.list_keys(TREE.run(9).prefix)


def prune_plan_of(store, run: RunTree):
    for n in (2, 3):
        write_run(store, n, "completed")
    return next(r for r in prune_plan(store, TREE, keep=1) if r.run == run)


# -- a resume whose checkpoints are gone -------------------------------------------------------------


def test_a_stopped_run_records_its_checkpoints_and_a_resume_without_them_stops(tmp_path):
    store = LocalStore(tmp_path / "store")
    record, run = end_run(tmp_path, store, "interrupted")
    assert record["checkpoints_left"] == {"bow": 2, "bow-trial-001": 1}
    record["planned_steps"] = ["train"]
    record["sources"] = {"raw": "raw/", "reconciled": None, "prepared": None}
    record["sources"] |= {"data_version": 1, "models": None}
    record["steps"] = {"train": {"step": "train", "status": "interrupted"}}
    store.put_bytes(run.metadata, json.dumps(record).encode())
    for key in store.list_keys(run.checkpoints("bow")):
        store.delete(key)
    from pipeline.sources import resumed_run

    settings = load_settings(tmp_path / "settings.ini", env={})
    store.put_bytes(run.settings, settings.applied_ini.encode())
    with pytest.raises(PipelineError, match=r"--resume 1: the checkpoints run 0001 left are gone "
                       r"\(bow, under .*\): resuming would train from step 1"):  # fmt: skip
        resumed_run(settings, store, TREE, 1, None)


# -- the end of a run: KEEP_RUNS, and what the run and the experiment hold ----------------------------


def test_a_completed_run_says_its_size_and_keep_runs_prunes_the_older_ones(tmp_path, caplog):
    from pipeline.driver import kept_small

    store = LocalStore(tmp_path / "store")
    runs = [write_run(store, n, "completed") for n in (1, 2, 3)]
    path = write_settings(tmp_path / "settings.ini", str(store.root))
    with caplog.at_level(logging.INFO, logger="smpipe"):
        kept_small(load_settings(path, env={}), store, runs[-1])
    said = caplog.text
    size = human_bytes(sum(store.list_sizes(runs[-1].prefix).values()))
    assert f"run 0003 holds {size}; experiment 'test-exp' holds " in said
    assert "in 3 runs (`smpipe prune" in said and "KEEP_RUNS does it after each run" in said
    assert store.list_keys(runs[0].checkpoints_root)  # KEEP_RUNS = 0: nothing pruned
    caplog.clear()
    path = write_settings(tmp_path / "settings.ini", str(store.root), experiment={"KEEP_RUNS": "2"})
    with caplog.at_level(logging.INFO, logger="smpipe"):
        kept_small(load_settings(path, env={}), store, runs[-1])
    assert "KEEP_RUNS = 2: run 0001 (completed" in caplog.text and "freed " in caplog.text
    assert not store.list_keys(runs[0].checkpoints_root)
    assert json.loads(store.get_bytes(runs[0].metadata))["pruned"]["keep"] == 2
    for kept in runs[1:]:
        assert store.list_keys(kept.checkpoints_root)


def test_a_run_whose_record_cannot_be_read_is_not_pruned(tmp_path):
    """A Metadata cut short (a partial copy of the store): `runs` called the run `claimed`; what
    it is, and what it reads, is not known, so prune leaves it whole."""
    store = LocalStore(tmp_path / "store")
    runs = [write_run(store, n, "completed") for n in (1, 2, 3)]
    store.put_bytes(runs[0].metadata, store.get_bytes(runs[0].metadata)[:20])
    from pipeline.history import run_rows

    assert [r["status"] for r in run_rows(store, TREE)] == ["unreadable", "completed", "completed"]
    assert [r.run.run_num for r in prune_plan(store, TREE, keep=1)] == [2]


def test_a_prune_stopped_after_its_last_removal_is_finished_by_the_next(tmp_path, capsys):
    """Stopped between its last removal and its final record: nothing left to remove, and the
    next prune skipped the run, which stayed "half pruned" for good."""
    store = LocalStore(tmp_path / "store")
    path = write_settings(tmp_path / "settings.ini", str(store.root))
    runs = [write_run(store, n, "completed") for n in (1, 2)]
    record = json.loads(store.get_bytes(runs[0].metadata))
    going = {"files": len(BULKY), "bytes": sum(BULKY.values()), "removed": {}}
    record["pruned"] = {"time": "2026-11-29T00:00:00Z", "keep": 1, "unfinished": going}
    store.put_bytes(runs[0].metadata, json.dumps(record).encode())
    for rel in BULKY:
        store.delete(runs[0].prefix + rel)
    assert cli.main(["prune", str(path), "--keep", "1", "--yes"]) == 0
    done = json.loads(store.get_bytes(runs[0].metadata))["pruned"]
    assert "unfinished" not in done and done["removed_files"] == len(BULKY), done
