"""The local registry: a model package group's versions as records in the store, for the local
backend, where nothing is sent to SageMaker.

Each version is a record `<experiment>/registry/<group>/<version>.json` (`register_locally`),
never rewritten: each later approval change is an object of its own, `<version>/<change>.json`
(`add_change`). Both are created with the store's conditional write, so two drivers never take
the same version and changes made at once are all kept.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from pipeline import metadata as md
from pipeline.errors import PipelineError, log
from pipeline.paths import REGISTRY_CHANGE, REGISTRY_RECORD, ExperimentTree, RunTree
from pipeline.registry.protocol import STATUSES, description, version_line
from pipeline.store import NotFound, Store, artifact_key, files_gone, is_complete

# What a record must hold to be listed, approved and kept from prune: what register writes.
RECORD_FIELDS = {"experiment": str, "run": str, "model": str, "model_artifact": str}
# How many change numbers an approval tries before giving up: each one refused was taken by
# another approval meanwhile, so this many at once on one version.
CHANGE_ATTEMPTS = 1000


@dataclass
class LocalRegistry:
    """The `Registry` of the local backend: group `group`'s records in `store`."""

    store: Store
    tree: ExperimentTree
    group: str
    approval_status: str  # what a new version starts as: [registry] APPROVAL_STATUS

    def planned(self) -> str:
        return f"a record in {self.store.uri_of(self.tree.registry(self.group))}"

    def register(self, entry: dict, run: RunTree, commit: str | None) -> dict:
        # The entry names the run; the run's commit is in its Metadata.
        return register_locally(self.store, self.tree, entry, self.approval_status)

    def where(self, registered: dict) -> str:
        return self.store.uri_of(self.tree.registry(self.group))

    def versions(self) -> list[dict]:
        found = local_versions(self.store, self.tree, self.group)
        return [{**r, "description": description(r)} for r in found]

    def missing_model(self, row: dict) -> str | None:
        model = artifact_key(self.store, row["model_artifact"])
        if not model or not is_complete(self.store, model):
            return f"{self.store.uri_of(model or '')} is no longer complete"
        if gone := files_gone(self.store, model):  # removed by hand: the manifest stayed
            return f"{self.store.uri_of(model)} lost {', '.join(gone)}"
        return None

    def set_status(self, row: dict, status: str) -> dict:
        change = {"approval_status": status, "time": md.iso(time.time())}
        add_change(self.store, self.tree, self.group, row["version"], change)
        return {**row, "approval_status": status, "history": [*row["history"], change]}


def register_locally(store: Store, tree: ExperimentTree, entry: dict, status: str) -> dict:
    """A new version record (version, run, model, test metrics, data version and hash, approval
    status), or the one this run and model made before (its driver stopped
    before Metadata said so). Versions count from 1; a version another driver took meanwhile
    (the conditional create fails) is skipped for the next. `status`: the version's first."""
    group = entry["group"]
    records = local_versions(store, tree, group)
    for record in records:
        if record.get("token") == entry["token"]:
            return record
    version = max((r["version"] for r in records), default=0) + 1
    now = md.iso(time.time())
    while True:
        record = {
            "version": version,
            **entry,
            "approval_status": status,
            "registered_at": now,
            "history": [{"approval_status": status, "time": now}],
        }
        if store.create(
            tree.registry_version(group, version), json.dumps(record, indent=2).encode()
        ):
            return record
        version += 1


def local_versions(store: Store, tree: ExperimentTree, group: str) -> list[dict]:
    """Every version record of `group` in the local registry, oldest first, with the approval
    changes made since folded in: approval_status is the newest change's, history holds them
    all. A file that is no record or change, or one that cannot be read as one, is named in a
    warning and skipped: it never fails `registry`, `approve` or a run's register step."""
    folder = tree.registry(group)
    records, changes = {}, {}
    for key in store.list_keys(folder):
        name = key[len(folder) :]
        record_name, change_name = REGISTRY_RECORD.fullmatch(name), REGISTRY_CHANGE.fullmatch(name)
        if not (record_name or change_name):
            skipped(store, key, "not a version (<version>.json) or a change (<version>/<n>.json)")
            continue
        try:
            document = json.loads(store.get_bytes(key))
        except NotFound:  # removed meanwhile
            continue
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
            skipped(store, key, f"not JSON ({e})")
            continue
        if record_name:
            why = record_problem(document, int(record_name.group(1)))
            if why:
                skipped(store, key, why)
            else:
                records[document["version"]] = document
        elif change_problem(document):
            skipped(store, key, change_problem(document))
        else:
            version, number = int(change_name.group(1)), int(change_name.group(2))
            changes.setdefault(version, {})[number] = document
    folded = []
    for version, record in sorted(records.items()):
        made = [changes.get(version, {})[n] for n in sorted(changes.get(version, {}))]
        history = [*record.get("history", []), *made]
        status = made[-1]["approval_status"] if made else record["approval_status"]
        folded.append({**record, "approval_status": status, "history": history})
    return folded


def record_problem(record, version: int) -> str | None:
    """Why a <version>.json is no version record to use, or None."""
    if not isinstance(record, dict):
        return "not a version record (a JSON object)"
    if record.get("version") != version:
        return f"its version is {record.get('version')!r}, not {version} as its name says"
    if record.get("approval_status") not in STATUSES:
        return f"its approval_status {record.get('approval_status')!r} is not SageMaker's"
    if not isinstance(record.get("history", []), list):
        return "its history is not a list"
    missing = [f for f, kind in RECORD_FIELDS.items() if not isinstance(record.get(f), kind)]
    if missing or not isinstance(record.get("test_metrics"), dict):
        return f"it lacks {', '.join(missing or ['test_metrics'])}"
    return None


def change_problem(change) -> str | None:
    """Why a <version>/<n>.json is no approval change, or None."""
    if not isinstance(change, dict) or change.get("approval_status") not in STATUSES:
        return "not an approval change (approval_status and time)"
    return None


def skipped(store: Store, key: str, why: str) -> None:
    log.warning(f"registry: skipped {store.uri_of(key)}: {why}")


def add_change(store: Store, tree: ExperimentTree, group: str, version: int, change: dict) -> int:
    """Change `change` appended to the version's changes: the next free number, taken with the
    store's conditional create (an exclusive link on a folder; PutObject's If-None-Match on S3,
    https://docs.aws.amazon.com/AmazonS3/latest/userguide/conditional-writes.html). A number
    another approval took meanwhile is refused, and the next one is tried: every change lands,
    in one order all readers see (a read, change and write back of the record would lose all
    but one). Its number."""
    folder = tree.registry_changes(group, version)
    names = (REGISTRY_RECORD.fullmatch(key[len(folder) :]) for key in store.list_keys(folder))
    number = max((int(m.group(1)) for m in names if m), default=0) + 1
    document = json.dumps(change, indent=2).encode()
    for _ in range(CHANGE_ATTEMPTS):
        if store.create(tree.registry_change(group, version, number), document):
            return number
        number += 1
    raise PipelineError(
        f"registry: version {version} of {group!r}: {CHANGE_ATTEMPTS} change numbers were taken "
        f"meanwhile at {store.uri_of(folder)}; nothing was changed, try again"
    )


def registered_models(store: Store, tree: ExperimentTree) -> list[tuple[str, str]]:
    """(key, why) for the model folder of every version in the local registry, every group of
    the experiment (a group the settings named before counts too)."""
    found = []
    for group in store.list_children(tree.registry_root):
        for record in local_versions(store, tree, group):
            key = artifact_key(store, record["model_artifact"])
            if key:
                found.append((key, version_line(group, record)))
    return found
