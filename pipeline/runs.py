"""run_num allocation that two drivers can never collide on (`claim_run_num`), the heartbeat that
tells a live run from one whose driver died without a word (`heartbeat`, `mark_abandoned`), and
the lease that lets one command at a time act on an ended run (`lease`).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from contextlib import contextmanager

from pipeline.errors import Refused, log
from pipeline.paths import ExperimentTree, RunTree, parse_run_label
from pipeline.store import NotFound, Store, StoreError


def existing_run_nums(store: Store, tree: ExperimentTree) -> list[int]:
    nums = (parse_run_label(name) for name in store.list_children(tree.runs_root))
    return sorted(n for n in nums if n is not None)


def claim_run_num(store: Store, tree: ExperimentTree, max_attempts: int = 1000) -> int:
    """Claim the next free run_num and return it: by creating `runs/<run_num>/CLAIM` with a
    conditional write (S3 `IfNoneMatch='*'`, a hard link on disk, which fails if the name
    exists). The one that creates it owns the number; the others see the create fail and try
    the next one. Nothing of an existing run is touched."""
    taken = existing_run_nums(store, tree)
    candidate = (taken[-1] + 1) if taken else 1
    body = json.dumps(
        {"host": socket.gethostname(), "pid": os.getpid(), "claimed_at": time.time()}
    ).encode()
    for _ in range(max_attempts):
        if store.create(tree.run(candidate).claim, body):
            return candidate
        candidate += 1
    raise StoreError(f"could not claim a run_num under {store.uri_of(tree.runs_root)}")


# -- a driver's heartbeat -----------------------------------------------------------------------

HEARTBEAT_SECONDS = 30
# A run still `running` whose heartbeat is this old has lost its driver, wherever it ran.
SILENT_FOR = 10 * 60


def driver_identity() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid()}


@contextmanager
def heartbeat(store: Store, key: str, every: float = HEARTBEAT_SECONDS):
    """While the block runs, `key` holds this driver's identity and the time, rewritten
    every `every` seconds, so another driver can tell a live run from an orphaned one."""
    stop = threading.Event()

    def beat() -> None:
        while True:
            try:
                store.put_bytes(
                    key, json.dumps({**driver_identity(), "time": time.time()}).encode()
                )
            except Exception:  # noqa: BLE001 - a missed beat is retried; the run goes on
                pass
            if stop.wait(every):
                return

    thread = threading.Thread(target=beat, name="smpipe-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def silent_driver(store: Store, run: RunTree, now: float | None = None) -> str | None:
    """Why the driver of a `running` run is gone, or None while it may be alive: its process
    no longer exists on this machine, or its heartbeat stopped SILENT_FOR seconds ago. Before
    its first beat, its claim of the run is what it last said."""
    said_last = [(run.heartbeat, "time", "last heartbeat"), (run.claim, "claimed_at", "claimed")]
    for key, field, what in said_last:
        try:
            said = json.loads(store.get_bytes(key))
        except NotFound:
            continue
        except ValueError:
            return None  # half written (a store's copy): not judged
        known = {"host", "pid", field} <= set(said)
        return driver_gone(said, said[field], what, now) if known else None
    return None


def never_started(store: Store, run: RunTree, now: float | None = None) -> str | None:
    """Why a run claimed without a Metadata will never have one, or None while its driver may
    still write it (driver.claim_run writes it right after the claim; only a driver killed or
    a store failing in between leaves a run so): the claim's process is gone from this
    machine, or it claimed the run SILENT_FOR seconds ago."""
    if store.exists(run.metadata):
        return None
    try:
        claim = json.loads(store.get_bytes(run.claim))
    except (NotFound, ValueError):  # no such run; a claim half written (a store's copy)
        return None
    if not {"host", "pid", "claimed_at"} <= set(claim):  # a claim that says no driver
        return None
    return driver_gone(claim, claim["claimed_at"], "claimed", now)


def driver_gone(who: dict, since: float, what: str, now: float | None = None) -> str | None:
    """Why the driver `who` (host and pid) that last said something at `since` is gone."""
    import psutil

    now = time.time() if now is None else now
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since))
    if who.get("host") == socket.gethostname() and not psutil.pid_exists(who["pid"]):
        return f"its driver (pid {who['pid']} on {who['host']}) is gone; {what} {when}"
    if now - since > SILENT_FOR:
        return f"its driver ({who['host']}, pid {who['pid']}) has been silent since {when}"
    return None


def mark_abandoned(store: Store, tree: ExperimentTree) -> None:
    """A run left `running` by a driver that died without a word (SIGKILL, power loss) is
    marked `abandoned`, so nobody waits for it or mistakes it for a live one."""
    for run_num in existing_run_nums(store, tree):
        run = tree.run(run_num)
        try:
            record = json.loads(store.get_bytes(run.metadata))
        except (NotFound, ValueError):
            continue
        if record.get("status") != "running":
            continue
        why = silent_driver(store, run)
        if why is None:
            continue
        record.update(status="abandoned", failure_reason=why, end_time=record.get("end_time"))
        store.put_bytes(run.metadata, json.dumps(record, indent=2).encode())
        log.info(
            f"run {run.label} was left running: {why}; marked abandoned "
            f"(--resume {run_num} continues it)"
        )


def checkpoint_files(store: Store, run: RunTree) -> dict[str, int]:
    """Each folder of the run's checkpoints (a model's, a tuning trial's) -> its files: what a
    run that stopped leaves for --resume (Metadata's checkpoints_left)."""
    found: dict[str, int] = {}
    for key in store.list_keys(run.checkpoints_root):
        folder = key[len(run.checkpoints_root) :].split("/", 1)[0]
        found[folder] = found.get(folder, 0) + 1
    return found


# -- one command at a time on an ended run ------------------------------------------------------


class RunBusy(Refused):
    """Another command holds the run's lease."""


@contextmanager
def lease(store: Store, run: RunTree, doing: str):
    """While the block runs, this process alone acts on `run` (`doing`: "resumed", "pruned");
    a run that was never claimed has nothing to hold, and nothing is made for it. A `--resume`
    and a `prune` each take it before they read what the run is: without it a prune could
    remove the checkpoints of a run a resume had just found unpruned."""
    try:
        store.get_bytes(run.claim)
    except NotFound:  # no such run (the caller says so): no folder is made for it
        yield
        return
    with held(store, run.lease, f"run {run.label}", doing):
        yield


@contextmanager
def held(store: Store, key: str, what: str, doing: str):
    """While the block runs, this process alone holds `key` (created as a run_num is claimed)
    for `what` ("run 0003", "raw version 1a2b3c4d5e6f"). One whose holder is gone (its process
    no longer exists on this machine, or it was taken SILENT_FOR seconds ago elsewhere: a
    resume's heartbeat covers its run by then) is taken over; a live one raises RunBusy naming
    its holder."""
    body = json.dumps({**driver_identity(), "doing": doing, "time": time.time()}).encode()
    if not store.create(key, body):
        if not holder_gone(store, key):
            held_by = json.loads(store.get_bytes(key))
            since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(held_by["time"]))
            raise RunBusy(
                f"{what} is being {held_by.get('doing', 'acted on')} by pid "
                f"{held_by.get('pid')} on {held_by.get('host')} (since {since}); try again once "
                "it has finished"
            )
        store.delete(key)
        if not store.create(key, body):
            raise RunBusy(f"{what} was taken by another command just now; try again")
    try:
        yield
    finally:
        try:  # only its own: a long resume's lease may have been taken over meanwhile
            if store.get_bytes(key) == body:
                store.delete(key)
        except NotFound:
            pass
        except StoreError as e:  # a stale lease is taken over once its holder is gone
            log.warning(f"{what}: {store.uri_of(key)} could not be removed ({e})")


def holder_gone(store: Store, key: str) -> bool:
    """Whether the process that holds `key` (`held`) is gone, or nobody holds it."""
    import psutil

    try:
        holder = json.loads(store.get_bytes(key))
    except (NotFound, ValueError):  # released meanwhile, or half written
        return True
    mine = holder.get("host") == socket.gethostname()
    return (mine and not psutil.pid_exists(holder.get("pid", 0))) or (
        time.time() - holder.get("time", 0) > SILENT_FOR
    )
