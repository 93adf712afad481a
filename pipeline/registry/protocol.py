"""What both registries keep: the `Registry` protocol the register step, `smpipe registry` and
`smpipe approve` hold them by, SageMaker's approval statuses, and a version's one line."""

from __future__ import annotations

from typing import Protocol

from pipeline.paths import RunTree, run_label

# The statuses `smpipe approve` sets: SageMaker's ModelApprovalStatus (CreateModelPackage and
# UpdateModelPackage in botocore's sagemaker service-2.json).
APPROVED, REJECTED, PENDING = "Approved", "Rejected", "PendingManualApproval"
STATUSES = (APPROVED, REJECTED, PENDING)


class Registry(Protocol):
    """A model package group's versions: records in the store on the local backend
    (records.py), SageMaker's model packages on the others (packages.py)."""

    def planned(self) -> str:
        """What a registered version becomes, as the plan says it."""
        ...

    def register(self, entry: dict, run: RunTree, commit: str | None) -> dict:
        """`entry` (what pipeline/registry/__init__.py `register` gathers of the winner) as a
        new version, or the version its token made before (a resumed run); what was kept.
        `commit`: the git commit the run was made at."""
        ...

    def where(self, registered: dict) -> str:
        """Where a version `register` returned can be found."""
        ...

    def versions(self) -> list[dict]:
        """Every version, oldest first: version, approval_status, registered_at, description."""
        ...

    def missing_model(self, row: dict) -> str | None:
        """Why version `row` (one of `versions()`) has no model that can be served (where it
        was, and that it is gone); None while it has one."""
        ...

    def set_status(self, row: dict, status: str) -> dict:
        """Version `row` given approval status `status`; the row it now is."""
        ...


def description(entry: dict) -> str:
    """ModelPackageDescription: what ListModelPackages shows of a version (`smpipe registry`)."""
    f1, data = entry["test_metrics"].get("macro_f1"), entry.get("data_version")
    snapshot = (entry.get("data_snapshot_hash") or "")[:8]
    score = f"test macro-F1 {f1:.4f}" if isinstance(f1, int | float) else "no test macro-F1"
    return f"{entry['experiment']} run {entry['run']}: {entry['model']}, {score}" + (
        f"; data {run_label(data)} {snapshot}".rstrip() if isinstance(data, int) else ""
    )


def version_line(group: str, record: dict) -> str:
    """Why `smpipe prune` keeps what a version points at."""
    status = record["approval_status"]
    return f"version {record['version']} of model package group {group!r} ({status}) points at it"
