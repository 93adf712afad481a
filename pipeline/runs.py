"""run_num allocation that two drivers can never collide on.

A run is taken by creating `runs/<run_num>/CLAIM` with a conditional write (S3 `IfNoneMatch='*'`,
a hard link on disk, which fails if the name exists). The one that creates it owns the number;
the others see the create fail and try the next one. Nothing of an existing run is touched.
"""

from __future__ import annotations

import json
import os
import socket
import time

from pipeline.paths import ExperimentTree, parse_run_label
from pipeline.store import Store, StoreError


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
