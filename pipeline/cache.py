"""Content-addressed data steps: reconcile and prepare run again only when what they read changed.

Each data step's output is keyed by the hash of everything it reads:

    reconcile  the raw data (every file's path and content hash), the source of the user's
               `reconcile` and of what it uses, the step's own code, its arguments
    prepare    the reconcile key it reads (or the snapshot's hash when that was reused by
               --steps), the source of `load_tokenizer`, `encode`, `ordered_input_keys` and
               of what they use, the step's own code, its arguments (models, MAX_SEQUENCE_LENGTH,
               split fractions, seed)

The output itself stays where the run that computed it wrote it (data/<run_num>/), manifested
as every output is; `cache/<step>/<key>.json` points at it. A run whose key has a complete
output reuses it and says so (terminal and Metadata); any change to an input computes it
again; `--no-cache` always computes. Two drivers that compute the same key at once each write
their own complete output, and the index is created conditionally, so it names exactly one of
them: never a half-written output.

"The source of what they use": the functions and classes of the user's package a function
refers to, followed transitively, whole modules of that package it refers to, and the
values of plain module-level names (a dict of paths, say). Library code is identified by the
package versions in Metadata, not hashed.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FunctionType, ModuleType

from pipeline.paths import SPLITS, ExperimentTree
from pipeline.store import NotFound, Store, file_sha256, is_complete, open_store

STEPS_DIR = Path(__file__).resolve().parent.parent / "steps"
# The user functions each data step calls.
CALLS = {"reconcile": ("reconcile",), "prepare": ("load_tokenizer", "encode", "ordered_input_keys")}


@dataclass
class CacheEntry:
    """One data step's verdict: reused (from `data_version`), computed, or not cacheable."""

    step: str
    status: str  # reused | computed | uncached | skipped
    key: str | None = None
    inputs: dict[str, str] = field(default_factory=dict)  # what the key is the hash of
    data_version: int | None = None  # where the reused output is
    note: str = ""

    def record(self) -> dict:
        return {"status": self.status, "key": self.key, "inputs": self.inputs,
                "data_version": self.data_version, "note": self.note or None}  # fmt: skip


def digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


# -- what a step reads, as hashes -----------------------------------------------------------------


def step_code_digest(step: str) -> str:
    """steps/<step>.py and every steps module it imports, transitively."""
    seen: dict[str, str] = {}
    todo = [step]
    while todo:
        name = todo.pop()
        path = STEPS_DIR / f"{name}.py"
        if name in seen or not path.is_file():
            continue
        source = path.read_text()
        seen[name] = source
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("steps."):
                todo.append(node.module.split(".", 1)[1])
            elif isinstance(node, ast.ImportFrom) and node.module == "steps":
                todo += [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                todo += [a.name.split(".", 1)[1] for a in node.names if a.name.startswith("steps.")]
    return digest(*(f"{n}\n{seen[n]}" for n in sorted(seen)))


def _names(code: CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _names(const)
    return names


def functions_digest(functions: list, package: str) -> str:
    """The source of `functions` and of every function, class or module of `package` they
    refer to (transitively), and the values of plain module-level names they read."""
    parts: dict[str, str] = {}

    def own(value) -> bool:
        name = value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", "")
        return (name or "").split(".")[0] == package

    def visit(obj) -> None:
        label = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', obj)}"
        if isinstance(obj, ModuleType):
            label = obj.__name__
        if label in parts:
            return
        try:
            parts[label] = (
                Path(obj.__file__).read_text()
                if isinstance(obj, ModuleType)
                else inspect.getsource(obj)
            )
        except (OSError, TypeError):
            parts[label] = repr(obj)
            return
        members = (
            [v for v in vars(obj).values() if isinstance(v, FunctionType)]
            if isinstance(obj, type)
            else [obj]
        )
        for fn in members:
            code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
            for name in sorted(_names(code)) if code else ():
                value = scope.get(name)
                if value is None or name.startswith("__"):
                    continue
                if own(value) and (isinstance(value, ModuleType | type) or callable(value)):
                    visit(value)
                elif isinstance(value, str | int | float | bool | tuple | list | dict | frozenset):
                    parts[f"{label}:{name}"] = repr(value)[:10_000]

    for fn in functions:
        visit(fn)
    return digest(*(f"{k}\n{parts[k]}" for k in sorted(parts)))


def raw_digest(store: Store, raw: str) -> str | None:
    """Every raw file's path and content hash; None when the driver cannot list them (raw
    data in another bucket, readable only by the jobs)."""
    if "://" not in raw and not raw.startswith("/"):
        files = store.fingerprints(raw)
    elif raw.startswith("/"):
        root = Path(raw)
        files = {
            p.relative_to(root).as_posix(): file_sha256(p)
            for p in sorted(root.rglob("*"))
            if p.is_file()
        }
    else:
        try:
            files = open_store(raw).fingerprints("")
        except Exception:  # noqa: BLE001 -- other credentials: the job reads it, we cannot
            return None
    return digest(*(f"{k} {v}" for k, v in sorted(files.items()))) if files else None


# -- the index -------------------------------------------------------------------------------


def index_key(tree: ExperimentTree, step: str, key: str) -> str:
    return f"{tree.root}cache/{step}/{key}.json"


def lookup(store: Store, tree: ExperimentTree, step: str, key: str) -> int | None:
    """The data version holding a complete output for `key`, if any."""
    try:
        version = json.loads(store.get_bytes(index_key(tree, step, key)))["data_version"]
    except (NotFound, KeyError, ValueError):
        return None
    data = tree.data(version)
    if step == "reconcile":
        complete = is_complete(store, data.reconciled)
    else:
        complete = all(is_complete(store, data.split(s)) for s in SPLITS)
    return version if complete else None


def decide(store: Store, tree: ExperimentTree, step: str, inputs: dict[str, str | None],
           use_cache: bool) -> CacheEntry:  # fmt: skip
    """Reuse or compute `step`, whose output is determined by `inputs` (name -> hash or
    value; None: not known, so not cacheable)."""
    unknown = [name for name, value in inputs.items() if value is None]
    if unknown:
        return CacheEntry(
            step, "uncached", note=f"{', '.join(unknown)} cannot be read by the driver"
        )
    known = {name: str(value) for name, value in inputs.items()}
    key = digest(*(f"{k}={v}" for k, v in sorted(known.items())))
    if not use_cache:
        return CacheEntry(step, "computed", key, known, note="--no-cache")
    version = lookup(store, tree, step, key)
    if version is None:
        return CacheEntry(step, "computed", key, known)
    return CacheEntry(step, "reused", key, known, data_version=version)


def remember(
    store: Store, tree: ExperimentTree, step: str, key: str, inputs: dict, version: int
) -> int:
    """Index this run's complete output under its key; returns the version the index names
    (another driver's, when it indexed the same key first)."""
    record = json.dumps({"data_version": version, "inputs": inputs,
                         "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode()  # fmt: skip
    where = index_key(tree, step, key)
    if store.create(where, record):
        return version
    earlier = lookup(store, tree, step, key)
    if earlier is None:  # the indexed output is gone: this one replaces it
        store.put_bytes(where, record)
        return version
    return earlier


def plan(
    store: Store,
    tree: ExperimentTree,
    steps: list[str],
    raw: str,
    snapshot_hash: str | None,
    arguments: dict[str, list[str]],
    functions,
    use_cache: bool,
) -> dict[str, CacheEntry]:
    """The verdict for each data step in `steps`. `raw`: where reconcile reads;
    `snapshot_hash`: the snapshot prepare reads when reconcile is not in `steps`;
    `arguments`: each step's job arguments; `functions`: the loaded user functions."""
    package = functions.module.split(".")[0]

    def inputs(step: str) -> dict[str, str | None]:
        fns = [getattr(functions, name) for name in CALLS[step]]
        return {"functions": functions_digest(fns, package), "code": step_code_digest(step),
                "arguments": json.dumps(arguments.get(step, []))}  # fmt: skip

    entries: dict[str, CacheEntry] = {}
    if "reconcile" in steps:
        entries["reconcile"] = decide(store, tree, "reconcile",
                                      {"raw": raw_digest(store, raw), **inputs("reconcile")}, use_cache)  # fmt: skip
    if "prepare" in steps:
        upstream = entries.get("reconcile")
        reconciled = (upstream.key if upstream else None) or (
            f"snapshot {snapshot_hash}" if snapshot_hash and not upstream else None
        )
        entries["prepare"] = decide(store, tree, "prepare", {"reconciled": reconciled, **inputs("prepare")}, use_cache)  # fmt: skip
    return entries
