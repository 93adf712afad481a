"""What a run keeps once it has ended, and what `smpipe prune` removes from older runs.

A completed run's checkpoints are removed (`remove_checkpoints`). `smpipe prune --keep N`
removes the bulky files of the runs older than the newest N completed ones (`prune_plan`,
`bulky_files`), and keeps what still reads them, saying why. What goes and what stays is
docs/run-tree.md; data/, the cache and a run that may still be running are never touched.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.errors import counted, log
from pipeline.history import human_bytes, run_rows
from pipeline.paths import ExperimentTree, RawVersion, RunTree, raw_version_digest
from pipeline.registry.records import registered_models
from pipeline.runs import (
    RunBusy,
    existing_run_nums,
    held,
    holder_gone,
    lease,
    never_started,
    silent_driver,
)
from pipeline.store import MANIFEST, NotFound, Store, StoreError, artifact_key
from steps.model_files import EXPORTS

# A model folder's weights (safetensors, or a Hugging Face save's .bin) and its exports
# (steps/model_files.py). Its small records stay: the report draws the curves from them.
WEIGHTS = (".safetensors", ".bin", *EXPORTS.values())
# Runs that may still be written to: a live driver's, or one claimed whose Metadata is not
# written yet (pipeline/history.py's statuses).
LIVE = ("running", "claimed")
# A key, or a prefix of keys, that something still reads, and what: prune keeps it.
Reference = tuple[str, str]


class PruneError(ValueError):
    """A prune that cannot be asked for, said in one sentence."""


def remove_checkpoints(store: Store, run: RunTree) -> int | None:
    """Remove every checkpoint of a run that completed (every model's and every tuning trial's;
    unless [training] KEEP_CHECKPOINTS_AFTER_RUN keeps them): the bytes freed, or None when the
    store refused (said in a warning: the run is completed all the same). A failed,
    interrupted or abandoned run keeps them, so `--resume` continues it."""
    removed = 0
    try:
        sizes = store.list_sizes(run.checkpoints_root)
        for key, size in sizes.items():
            store.delete(key)
            removed += size
    except StoreError as e:
        log.warning(
            f"the checkpoints of run {run.label} could not be removed ({human_bytes(removed)} "
            f"were): {e}. The run is completed all the same; `smpipe prune` removes them later."
        )
        return None
    if sizes:
        log.info(
            f"removed the checkpoints of run {run.label}: {human_bytes(removed)} freed "
            f"({counted(len(sizes), 'file')}; [training] KEEP_CHECKPOINTS_AFTER_RUN = true "
            "keeps them)"
        )
    return removed


@dataclass
class Removal:
    """What prune removes from one run: key -> bytes, and the same grouped by folder."""

    run: RunTree
    status: str
    run_bytes: int  # the whole run on the store, before
    files: dict[str, int] = field(default_factory=dict)
    groups: dict[str, int] = field(default_factory=dict)  # a folder of the run -> bytes
    # The bulky folders kept because something reads them: folder -> bytes, and why.
    kept: dict[str, int] = field(default_factory=dict)
    why: dict[str, list[str]] = field(default_factory=dict)
    finishing: bool = False  # a prune stopped half way left it: its record is finished too

    @property
    def to_do(self) -> bool:
        return bool(self.files) or self.finishing

    @property
    def bytes(self) -> int:
        return sum(self.files.values())


def bulky_files(
    store: Store, run: RunTree, status: str, references: Sequence[Reference] = ()
) -> Removal:
    """The files of `run` that prune removes, each counted under the folder it goes with; a
    bulky file that `references` name is kept instead, with why."""
    sizes = store.list_sizes(run.prefix)
    # A failed local job's folder, kept in the run when the store is a folder here.
    folders = [run.checkpoints_root, run.training_output, run.failed_jobs] + [
        f"{run.tuning(model)}{trial}/"
        for model in store.list_children(run.tuning_root)
        for trial in store.list_children(run.tuning(model))
    ]
    # A study's best model waiting for its export (a run that stopped between the two).
    folders += [run.best_trial_model(model) for model in store.list_children(run.models)]
    models = [f"{run.model(model)}model/" for model in store.list_children(run.models)]
    removal = Removal(run, status, sum(sizes.values()))
    for key, size in sizes.items():
        folder = next((f for f in folders if key.startswith(f)), None)
        model = next((m for m in models if key.startswith(m)), None)
        # A model folder loses its manifest with its weights: it is no longer complete, so
        # no later run mistakes it for a model it can test (pipeline/sources.py).
        if folder is None and model and (key.endswith(WEIGHTS) or key == model + MANIFEST):
            folder = model
        if folder is None:
            continue
        where = folder[len(run.prefix) :]
        reasons = [why for prefix, why in references if key.startswith(prefix)]
        if reasons:
            removal.kept[where] = removal.kept.get(where, 0) + size
            said = removal.why.setdefault(where, [])
            said += [why for why in reasons if why not in said]
        else:
            removal.files[key] = size
            removal.groups[where] = removal.groups.get(where, 0) + size
    return removal


def prune_plan(
    store: Store, tree: ExperimentTree, keep: int, packages: Sequence[Reference] = ()
) -> list[Removal]:
    """What pruning all but the newest `keep` completed runs removes, run by run, and what it
    keeps because something reads it (runs with nothing left to remove or keep are left out).
    Kept, found before anything is removed: a model a run prune leaves whole tested (`read_by`),
    a model a registered version points at (the local registry's records of every group, and
    `packages`), a model a predict record names (`predicted`).
    `packages`: what SageMaker's registered versions point at (registry/packages.py
    `package_models`)."""
    if keep < 1:
        raise PruneError(
            f"--keep {keep}: keep at least 1 completed run (the newest N completed runs and "
            "every run after them are left whole)"
        )
    rows = run_rows(store, tree)
    completed = [int(r["run"]) for r in rows if r["status"] == "completed"]
    oldest_kept = completed[-keep] if len(completed) > keep else 0
    # A run a stopped prune left half pruned is finished, whatever is kept now: nothing reads
    # it as whole any more (its record says it is pruned).
    pruned = [
        r
        for r in rows
        if (int(r["run"]) < oldest_kept or r.get("half_pruned"))
        and r["status"] not in (*LIVE, "unreadable")  # what it is, and reads, is not known
    ]
    if not pruned:
        return []
    staying = [tree.run(int(r["run"])) for r in rows if r not in pruned]
    runs = [tree.run(int(r["run"])) for r in pruned]
    references = [
        *read_by(store, tree, staying),
        *registered_models(store, tree),
        *predicted(store, runs),
        *packages,
    ]
    removals = []
    for row, run in zip(pruned, runs, strict=True):
        removal = bulky_files(store, run, row["status"], references)
        removal.finishing = bool(row.get("half_pruned"))
        if removal.to_do or removal.kept:
            removals.append(removal)
    return removals


def read_by(store: Store, tree: ExperimentTree, runs: list[RunTree]) -> list[Reference]:
    """What the runs prune leaves whole read of other runs: the models their inference tested
    (Metadata's sources: an inference-only run tests an earlier run's models/) and any model
    their Metadata records outside their own folder."""
    found = []
    for run in runs:
        try:
            record = json.loads(store.get_bytes(run.metadata))
        except (NotFound, ValueError, UnicodeDecodeError):
            continue  # claimed, its Metadata not written yet: it has read nothing yet
        folder = artifact_key(store, (record.get("sources") or {}).get("models") or "")
        if folder and not folder.startswith(run.prefix):
            owner = tree.owner_of_models(folder)
            tested = sorted(record.get("holdout_performance") or {})
            read = f"run {owner.label}'s models/" if owner else folder
            why = f"run {run.label} tested it (its inference read {read}: --steps inference)"
            keys = [owner.final_model(m) for m in tested] if owner and tested else [folder]
            found += [(key, why) for key in keys]
        for model, where in (record.get("model_artifacts") or {}).items():
            key = artifact_key(store, where)
            if key and not key.startswith(run.prefix):
                found.append((key, f"run {run.label} records it as its model {model!r}"))
    return found


def predicted(store: Store, runs: list[RunTree]) -> list[Reference]:
    """The models the runs' predictions name: each predict record's model_artifact (a failed
    or interrupted predict's record names none: it made nothing that needs its model). A
    prediction without a record may be running still (or was killed): the model its label
    names is kept; a record that cannot be read keeps every model of its run."""
    found = []
    for run in runs:
        for label in store.list_children(run.predictions):
            record = run.prediction(label).record
            where = run.prediction(label).prefix[len(run.prefix) :]
            try:
                said = json.loads(store.get_bytes(record))
            except NotFound:  # predict labels its folder <model>-<time>-<hex>
                model = run.final_model(label.rsplit("-", 2)[0])
                found.append((model, f"{where} has no record: a predict that may be running"))
                continue
            except (ValueError, UnicodeDecodeError) as e:
                said = e
            if not isinstance(said, dict):
                log.warning(f"prune: {store.uri_of(record)} is no predict record ({said!r})")
                found.append((run.models, f"{where}record.json cannot be read, it may name it"))
                continue
            model = said.get("model_artifact")
            key = artifact_key(store, model) if isinstance(model, str) else None
            if key:
                found.append((key, f"the predict record {where}record.json names it"))
    return found


def prune_run(store: Store, removal: Removal, keep: int) -> str | None:
    """Remove what `removal` names, manifests first (a model folder stops being complete
    before its weights go), then record it in the run's metadata.json; or, without removing
    anything, why not: a `--resume` holds the run, or resumed it since the plan was made."""
    try:
        with lease(store, removal.run, "pruned"):
            status = json.loads(store.get_bytes(removal.run.metadata)).get("status")
            if status == "running" and silent_driver(store, removal.run):
                status = "abandoned"  # as run_rows tells it
            if status != removal.status:
                return f"it is {status} now (it was {removal.status} when prune looked)"
            _remove(store, removal, keep)
    except RunBusy as e:
        return str(e)
    return None


def _remove(store: Store, removal: Removal, keep: int) -> None:
    """The run is recorded as pruned before anything of it goes, `unfinished` until all of it
    has: a prune stopped half way (Ctrl-C) leaves a run that nothing resumes or reads as
    whole, and that the next prune finishes."""
    run = removal.run
    record = json.loads(store.get_bytes(run.metadata))
    before = record.get("pruned") or {}
    # What a stopped prune set out to remove (it removed some of it): counted once, now.
    going = before.get("unfinished") or {}
    files = max(len(removal.files), going.get("files", 0))
    size = max(removal.bytes, going.get("bytes", 0))
    groups = {**removal.groups, **(going.get("removed") or {})}
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    unfinished = {"files": files, "bytes": size, "removed": groups}
    record["pruned"] = {**before, "time": now, "keep": keep, "unfinished": unfinished}
    store.put_bytes(run.metadata, json.dumps(record, indent=2).encode())
    for key in sorted(removal.files, key=lambda k: not k.endswith(MANIFEST)):
        store.delete(key)
    # Failed jobs' folders kept on this machine for an S3 store (in the run itself for a
    # folder store: removed with the files above).
    elsewhere = remove_kept_jobs(store, run)
    removed = dict(before.get("removed") or {})
    for where, n in groups.items():
        removed[where] = removed.get(where, 0) + n
    if elsewhere:
        removed["failed-jobs/ (this machine)"] = elsewhere
    record["pruned"] = {
        "time": now,
        "keep": keep,
        "removed_files": before.get("removed_files", 0) + files,
        "removed_bytes": before.get("removed_bytes", 0) + size,
        "removed": removed,
        "kept": removal.why,  # a folder of the run -> why it stayed, at this prune
    }
    store.put_bytes(run.metadata, json.dumps(record, indent=2).encode())


def remove_kept_jobs(store: Store, run: RunTree) -> int:
    """Remove the folders of `run`'s failed local jobs, kept on this machine for inspection
    (pipeline/backends/local.py `kept_jobs_folder`); the bytes freed (0 when there are none,
    or when they were kept on another machine)."""
    import shutil
    from pathlib import Path

    from pipeline.backends.local import kept_jobs_folder

    folder: Path = kept_jobs_folder(store, run)
    if not folder.is_dir():
        return 0
    size = sum(f.lstat().st_size for f in folder.rglob("*") if f.is_file() or f.is_symlink())
    shutil.rmtree(folder, ignore_errors=True)
    return size


# -- raw versions ---------------------------------------------------------------------------------


@dataclass
class RawRemoval:
    """A raw version prune removes, its bytes, and why it may go."""

    version: RawVersion
    bytes: int
    why: str


def raw_versions_plan(
    store: Store, tree: ExperimentTree, pruning: Sequence[RunTree] = (), current: Sequence[str] = ()
) -> tuple[list[RawRemoval], dict[str, str]]:
    """The raw versions (a local RAW_DATA folder's content, pipeline/raw_data.py) that nothing
    reads any more: no run that is not pruned names it (a pruned run is never resumed; its
    data/ snapshot keeps what it read), and it is neither `current` (the digest of the RAW_DATA
    folder as it is now, which the next run reads) nor the newest complete one. An upload that
    did not finish goes too, unless its driver is alive. Registered versions and predict
    records name no raw data. While a run is claimed without its Metadata, any version may be
    the one it reads: none is removed. `pruning`: runs this prune removes from, counted as
    pruned (what a dry run says is what --yes does). Returns the removals, and each version
    kept with why."""
    digests = store.list_children(tree.raw_versions_root)
    used = raw_versions_read(store, tree, {run.run_num for run in pruning})
    if not digests:
        return [], {}
    if used is None:
        why = "a run is claimed and has no Metadata yet: it may read any version"
        return [], dict.fromkeys(digests, why)
    complete = {}
    for digest in digests:
        try:
            manifest = json.loads(store.get_bytes(tree.raw_version(digest).prefix + MANIFEST))
            complete[digest] = manifest.get("created", "")
        except (NotFound, ValueError):
            pass
    newest = {d for d, created in complete.items() if created == max(complete.values())}
    removals, kept = [], {}
    for digest in digests:
        version = tree.raw_version(digest)
        if digest in used:
            runs = used[digest]
            kept[digest] = f"run{'s' if len(runs) > 1 else ''} {', '.join(runs)} read it"
        elif digest in current:
            kept[digest] = "RAW_DATA holds it now: the next run reads it"
        elif digest in newest:
            kept[digest] = "the newest version"
        elif not holder_gone(store, version.lease):
            kept[digest] = "a driver holds it (uploading it, or claiming the run that reads it)"
        if digest in kept:
            continue
        why = (
            "no run that is not pruned reads it"
            if digest in complete
            else "an upload that did not finish"
        )
        removals.append(RawRemoval(version, sum(store.list_sizes(version.prefix).values()), why))
    return removals, kept


def raw_versions_read(
    store: Store, tree: ExperimentTree, pruning: set[int] = frozenset()
) -> dict[str, list[str]] | None:
    """The digest of each raw version the runs that are not pruned read -> those runs' labels;
    None while a run is claimed without its Metadata (or has one that cannot be read): it may
    read any."""
    used: dict[str, list[str]] = {}
    for run_num in existing_run_nums(store, tree):
        if run_num in pruning:
            continue
        try:
            record = json.loads(store.get_bytes(tree.run(run_num).metadata))
        except NotFound:
            if never_started(store, tree.run(run_num)):
                continue  # its driver ended before the run read anything
            return None
        except (ValueError, UnicodeDecodeError):
            return None
        if record.get("pruned"):
            continue
        named = [record.get("raw_path"), (record.get("sources") or {}).get("raw")]
        for digest in {raw_version_digest(artifact_key(store, n) or "") for n in named if n}:
            if digest:
                used.setdefault(digest, []).append(tree.run(run_num).label)
    return used


def remove_raw_version(store: Store, tree: ExperimentTree, removal: RawRemoval) -> str | None:
    """Remove the version, manifest first (it stops being complete before its files go); or
    why not: a driver holds it (uploading it, or claiming the run that reads it), or a run
    claimed since the plan reads it. A driver takes the same lease to upload a version and
    claim its run, so what is read here after taking it is what the runs read."""
    version = removal.version
    try:
        with held(store, version.lease, f"raw version {version.digest[:12]}", "pruned"):
            used = raw_versions_read(store, tree)
            if used is None or version.digest in used:
                return "a run started since reads it"
            keys = [k for k in store.list_keys(version.prefix) if k != version.lease]
            for key in sorted(keys, key=lambda k: not k.endswith(MANIFEST)):
                store.delete(key)
    except RunBusy as e:
        return str(e)
    return None


# -- the whole experiment, as `smpipe prune` and KEEP_RUNS prune it --------------------------------


def prune_experiment(settings, store: Store, keep: int, remove: bool) -> list[str]:
    """Prune the runs before the newest `keep` completed ones and the raw versions nothing
    reads (`remove`), or say what that would remove: a line a run and a version, what is kept
    because something still reads it and why, and the bytes freed."""
    from pipeline.errors import PipelineError
    from pipeline.registry.packages import package_models

    tree = ExperimentTree(settings.experiment.name)
    try:  # before anything is removed: what SageMaker's registered versions point at
        packages = package_models(settings, store)
    except PipelineError as e:
        group = settings.registry.model_package_group
        raise PipelineError(
            f"prune: the versions of model package group {group!r} cannot be read, so the "
            f"models they point at are not known; nothing was removed ({e})"
        ) from None
    lines: list[str] = []
    verb = "removed" if remove else "would remove"
    removals = prune_plan(store, tree, keep, packages)
    for removal in list(removals):
        why_not = prune_run(store, removal, keep) if remove and removal.to_do else None
        if why_not:
            lines.append(f"run {removal.run.label}: not pruned: {why_not}")
            removals.remove(removal)
            continue
        what = ", ".join(f"{where} {human_bytes(n)}" for where, n in removal.groups.items())
        did = (
            f"{verb} {human_bytes(removal.bytes)} in {counted(len(removal.files), 'file')}: {what}"
        )
        lines.append(
            f"run {removal.run.label} ({removal.status}, {human_bytes(removal.run_bytes)}): "
            + (did if removal.to_do else "nothing to remove")
        )
        for where, why in removal.why.items():
            lines.append(f"  kept {where} ({human_bytes(removal.kept[where])}): {'; '.join(why)}")
    pruned = [r for r in removals if r.to_do]
    raw = prune_raw_versions(settings, store, tree, [r.run for r in pruned], remove, lines)
    if not pruned and not raw:
        lines.append(
            f"nothing to prune: the runs before the newest {keep} completed keep only what is "
            "still read, and every raw version is read"
        )
        return lines
    freed = human_bytes(sum(r.bytes for r in pruned) + sum(v.bytes for v in raw))
    runs = f"{len(pruned)} runs" + (f" and {len(raw)} raw versions" if raw else "")
    if remove:
        lines.append(f"freed {freed} in {runs}; their Metadata, logs and reports stay")
    else:
        lines.append(f"would free {freed} in {runs}; nothing was removed (--yes removes it)")
    kept = sum(sum(r.kept.values()) for r in removals)
    if kept:
        lines.append(
            f"kept {human_bytes(kept)} that runs, registered versions or predictions still read"
        )
    return lines


def prune_raw_versions(
    settings, store: Store, tree: ExperimentTree, pruning: list[RunTree], remove: bool, lines
) -> list[RawRemoval]:
    """The raw versions nothing reads, removed (`remove`) or said, and each kept one with why,
    as lines added to `lines`; the ones removed (or that would be)."""
    verb = "removed" if remove else "would remove"
    raw, kept = raw_versions_plan(store, tree, pruning, current_raw(settings))
    for digest, why in kept.items():
        size = human_bytes(sum(store.list_sizes(tree.raw_version(digest).prefix).values()))
        lines.append(f"kept raw version {digest[:12]} ({size}): {why}")
    for version in list(raw):
        why_not = remove_raw_version(store, tree, version) if remove else None
        named = f"raw version {version.version.digest[:12]}"
        if why_not:
            lines.append(f"{named}: not removed: {why_not}")
            raw.remove(version)
            continue
        lines.append(f"{named} ({version.why}): {verb} {human_bytes(version.bytes)}")
    return raw


def current_raw(settings) -> list[str]:
    """The digest of the RAW_DATA folder as it is now, which the next run reads: prune keeps
    its raw version (none for raw data in the store or a bucket, or a folder not here)."""
    from pathlib import Path

    from pipeline.errors import PipelineError
    from pipeline.raw_data import folder_digest

    raw = settings.raw_data_uri()
    if not raw or "://" in raw or not Path(raw).is_dir():
        return []
    try:
        return [folder_digest(Path(raw))]
    except (OSError, PipelineError):
        return []
