"""run_num allocation that two drivers can never collide on, and the heartbeat that tells a
live run from one whose driver died without a word.

A run is taken by creating `runs/<run_num>/CLAIM` with a conditional write (S3 `IfNoneMatch='*'`,
a hard link on disk, which fails if the name exists). The one that creates it owns the number;
the others see the create fail and try the next one. Nothing of an existing run is touched.
A run left `running` by a driver that is gone is marked `abandoned` (`mark_abandoned`).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from contextlib import contextmanager

from pipeline.errors import log
from pipeline.paths import ExperimentTree, parse_run_label
from pipeline.store import NotFound, Store, StoreError


def existing_run_nums(store: Store, tree: ExperimentTree) -> list[int]:
    nums = (parse_run_label(name) for name in store.list_children(tree.runs_root))
    return sorted(n for n in nums if n is not None)


def claim_run_num(store: Store, tree: ExperimentTree, max_attempts: int = 1000) -> int:
    """Claim the next free run_num and return it."""
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


def silent_driver(store: Store, key: str, now: float | None = None) -> str | None:
    """Why the driver of a `running` run is gone, or None while it may be alive: its process
    no longer exists on this machine, or its heartbeat stopped SILENT_FOR seconds ago."""
    import psutil

    try:
        beat = json.loads(store.get_bytes(key))
    except (NotFound, ValueError):
        return None  # a driver that has not beaten yet (or an older one): not judged
    now = time.time() if now is None else now
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(beat["time"]))
    if beat.get("host") == socket.gethostname() and not psutil.pid_exists(beat["pid"]):
        return f"its driver (pid {beat['pid']} on {beat['host']}) is gone; last heartbeat {when}"
    if now - beat["time"] > SILENT_FOR:
        return f"its driver ({beat['host']}, pid {beat['pid']}) has been silent since {when}"
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
        why = silent_driver(store, run.heartbeat)
        if why is None:
            continue
        record.update(status="abandoned", failure_reason=why, end_time=record.get("end_time"))
        store.put_bytes(run.metadata, json.dumps(record, indent=2).encode())
        log.info(
            f"run {run.label} was left running: {why}; marked abandoned "
            f"(--resume {run_num} continues it)"
        )
