"""Content-addressed data steps: reconcile and prepare run again only when what they read changed.

Each data step's output is keyed by the hash of everything it reads (`plan`): the raw data or
the reconcile key, what the user functions it calls can reach (`Closure`), its own code and its
arguments. The output stays where the run that computed it wrote it (data/<run_num>/), and
`cache/<step>/<key>.json` points at it (`remember`, `lookup`). docs/outputs.md (Data steps that
need not run again) says what a user sees.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
import json
import re
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from types import BuiltinFunctionType, CodeType, FunctionType, ModuleType

from pipeline.paths import SPLITS, ExperimentTree, raw_version_digest
from pipeline.raw_data import folder_digest, is_hidden
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
        return {
            "status": self.status,
            "key": self.key,
            "inputs": self.inputs,
            "data_version": self.data_version,
            "note": self.note or None,
        }


def digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:  # a name read from a folder may hold bytes that are not UTF-8: as read
        h.update(part.encode("utf-8", "surrogateescape"))
        h.update(b"\0")
    return h.hexdigest()


# -- what a step reads, as hashes -----------------------------------------------------------------


def step_code_digest(step: str) -> str:
    """steps/<step>.py and every steps module it imports, transitively."""
    seen: dict[str, str] = {}
    todo = [step]
    while todo:
        name = todo.pop()
        path = STEPS_DIR / f"{name.replace('.', '/')}.py"  # runtime.names: steps/runtime/names.py
        if name in seen or not path.is_file():
            continue
        source = path.read_text()
        seen[name] = source
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("steps."):
                module = node.module.split(".", 1)[1]
                todo.append(module)
                todo += [f"{module}.{a.name}" for a in node.names]  # a submodule, as names
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


# Calls whose target is named at run time: what they reach cannot be read off the code.
DYNAMIC = {"getattr", "globals", "vars", "locals", "eval", "exec", "__import__", "import_module"}


class Inexact(Exception):
    """What a step's code can reach cannot be established exactly (the reason)."""


def canonical(value) -> str:
    """A value's content as text, the same for equal contents whatever their order in a set
    or dict; Inexact for a value whose content cannot be read (an object's repr is not its
    content)."""
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        return repr(value)
    if isinstance(value, re.Pattern):
        return f"re.compile({value.pattern!r}, {value.flags})"
    if isinstance(value, PurePath):
        return f"Path({str(value)!r})"
    if isinstance(value, tuple | list):
        return f"{type(value).__name__}({', '.join(canonical(v) for v in value)})"
    if isinstance(value, set | frozenset):
        return f"set({', '.join(sorted(canonical(v) for v in value))})"
    if isinstance(value, dict):
        items = sorted(f"{canonical(k)}: {canonical(v)}" for k, v in value.items())
        return f"dict({', '.join(items)})"
    raise Inexact(f"a {type(value).__name__}, whose content cannot be read")


class Closure:
    """Everything a step's user functions can reach in the user's code: the source of every
    function, class and module of it they refer to, transitively (imports inside functions
    too), the content of every value of it they read (module-level constants, compiled
    patterns, sets, containers of any size, default arguments, closures). Library code is
    identified by name; its version is in Metadata. `reasons` says where reachability could
    not be established exactly."""

    def __init__(self, own: dict[str, Path]) -> None:
        self.own_names = set(own)
        self.own_roots = [p.resolve() for p in own.values()]
        self.parts: dict[str, str] = {}
        self.reasons: list[str] = []

    def is_own(self, obj) -> bool:
        module = (
            obj
            if isinstance(obj, ModuleType)
            else sys.modules.get(getattr(obj, "__module__", "") or "")
        )
        path = getattr(module, "__file__", None)
        if not path:
            return False
        path = Path(path).resolve()
        return any(path == root or root in path.parents for root in self.own_roots)

    def visit(self, obj) -> None:
        label = (
            obj.__name__ if isinstance(obj, ModuleType) else f"{obj.__module__}.{obj.__qualname__}"
        )
        if label in self.parts:
            return
        try:
            self.parts[label] = (
                Path(obj.__file__).read_text()
                if isinstance(obj, ModuleType)
                else inspect.getsource(obj)
            )
        except (OSError, TypeError):
            self.reasons.append(f"the source of {label} cannot be read")
            return
        if isinstance(obj, ModuleType):
            for name, value in sorted(vars(obj).items()):
                if not name.startswith("__"):
                    self.value(f"{label}.{name}", value)
            return
        functions = (
            [v for v in vars(obj).values() if isinstance(v, FunctionType)]
            if isinstance(obj, type)
            else [obj]
        )
        for fn in functions:
            self.function(fn, label)

    def function(self, fn: FunctionType, label: str) -> None:
        scope = fn.__globals__
        for name in sorted(_names(fn.__code__)):
            if name in scope and not name.startswith("__"):
                self.value(f"{label}:{name}", scope[name])
            elif name in DYNAMIC:
                self.reasons.append(
                    f"{label} calls {name}(), which names what it reaches at run time"
                )
        for i, default in enumerate(
            [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
        ):
            self.value(f"{label}:default{i}", default)
        for i, cell in enumerate(fn.__closure__ or ()):
            try:
                self.value(f"{label}:closure{i}", cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        self.local_imports(fn, label)

    def local_imports(self, fn: FunctionType, label: str) -> None:
        """Modules imported inside a function (the Hugging Face habit: import where used)."""
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        except (OSError, TypeError, SyntaxError):
            return
        package = (
            fn.__module__
            if hasattr(sys.modules.get(fn.__module__), "__path__")
            else fn.__module__.rpartition(".")[0]
        )
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = (
                    importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                    if node.level
                    else node.module
                )
                targets = [(base, alias.name) for alias in node.names]
            else:
                continue
            for module_name, attribute in targets:
                if module_name.split(".")[0] not in self.own_names:
                    continue  # a library (transformers, say): not imported here for nothing
                try:
                    module = importlib.import_module(module_name)
                except Exception:  # noqa: BLE001 - not importable here: a library of the image
                    continue
                if not self.is_own(module):
                    continue
                value = getattr(module, attribute, None) if attribute else module
                if attribute and value is None:  # `from package import submodule`
                    try:
                        value = importlib.import_module(f"{module_name}.{attribute}")
                    except ImportError:
                        self.reasons.append(
                            f"{label} imports {module_name}.{attribute}, which cannot be found"
                        )
                        continue
                self.value(f"{label}:import {module_name}.{attribute or ''}", value)

    def value(self, label: str, value) -> None:
        if isinstance(value, ModuleType | type | FunctionType | BuiltinFunctionType):
            if self.is_own(value):
                self.visit(value)
            else:  # a library's module, class or function: its version is in Metadata
                name = getattr(value, "__qualname__", getattr(value, "__name__", ""))
                self.parts[label] = f"library {getattr(value, '__module__', '')}.{name}"
            return
        try:  # data, read whole; an object (a tokenizer built at import, say) is not data
            self.parts[label] = hashlib.sha256(canonical(value).encode()).hexdigest()
        except Inexact as e:
            self.reasons.append(f"{label} is {e}")


def all_files_digest(own: dict[str, Path]) -> str:
    """Every file of the user's shipped code, by path and content: what a step may read when
    its reach cannot be established exactly."""
    files = {}
    for name, path in own.items():
        for f in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if f.is_file() and "__pycache__" not in f.parts:
                files[f"{name}/{f.relative_to(path).as_posix()}" if path.is_dir() else f.name] = (
                    file_sha256(f)
                )
    return digest(*(f"{k} {v}" for k, v in sorted(files.items())))


def functions_digest(functions: list, own: dict[str, Path]) -> tuple[str, str | None]:
    """The digest of what `functions` can reach in the user's code (`own`: its modules, as the
    run ships them), and None; or, where that cannot be established exactly, the digest of
    every file of the user's code and why. Data files shipped with the code count either way."""
    closure = Closure(own)
    for fn in functions:
        closure.visit(fn)
    data_files = {
        f"{n}/{f.relative_to(p).as_posix()}": file_sha256(f)
        for n, p in own.items()
        if p.is_dir()
        for f in sorted(p.rglob("*"))
        if f.is_file() and f.suffix not in (".py", ".pyc")
    }
    data = [f"data {k} {v}" for k, v in sorted(data_files.items())]
    if closure.reasons:
        return digest("whole code", all_files_digest(own), *data), closure.reasons[0]
    return digest(*(f"{k}\n{closure.parts[k]}" for k in sorted(closure.parts)), *data), None


def step_reaches(functions, own: dict[str, Path]) -> dict[str, tuple[str, str | None]]:
    """`functions_digest` of each data step's user functions (CALLS), by step."""
    return {
        step: functions_digest([getattr(functions, name) for name in names], own)
        for step, names in CALLS.items()
    }


def raw_digest(store: Store, raw: str) -> str | None:
    """Every raw data file's path and content hash; None when the driver cannot list them (raw
    data in another bucket, readable only by the jobs). Hidden files are not data, here as
    everywhere (pipeline/raw_data.py). A local folder and the raw version of it give the same
    key: its content digest, which names the version."""
    if raw.startswith("/"):
        return f"raw {folder_digest(Path(raw))}"
    if "://" not in raw and raw_version_digest(raw):
        return f"raw {raw_version_digest(raw)}"
    if "://" not in raw:
        files = store.fingerprints(raw)
    else:
        try:
            files = open_store(raw).fingerprints("")
        except Exception:  # noqa: BLE001 -- other credentials: the job reads it, we cannot
            return None
    files = {k: v for k, v in files.items() if not is_hidden(k)}
    return digest(*(f"{k} {v}" for k, v in sorted(files.items()))) if files else None


# -- the index -------------------------------------------------------------------------------


def lookup(store: Store, tree: ExperimentTree, step: str, key: str) -> int | None:
    """The data version holding a complete output for `key`, if any."""
    try:
        version = json.loads(store.get_bytes(tree.cache_entry(step, key)))["data_version"]
    except (NotFound, KeyError, ValueError):
        return None
    data = tree.data(version)
    if step == "reconcile":
        complete = is_complete(store, data.reconciled)
    else:
        complete = all(is_complete(store, data.split(s)) for s in SPLITS)
    return version if complete else None


def decide(
    store: Store, tree: ExperimentTree, step: str, inputs: dict[str, str | None], use_cache: bool
) -> CacheEntry:
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
    (another driver's, when it indexed the same key first). Two drivers that compute the same
    key at once each write their own complete output, and the index is created conditionally,
    so it names exactly one of them: never a half-written output."""
    record = json.dumps(
        {
            "data_version": version,
            "inputs": inputs,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    ).encode()
    where = tree.cache_entry(step, key)
    if store.create(where, record):
        return version
    earlier = lookup(store, tree, step, key)
    if earlier is None:  # the indexed output is gone: this one replaces it
        store.put_bytes(where, record)
        return version
    return earlier


def reconciled_as(
    store: Store, tree: ExperimentTree, upstream: CacheEntry | None, snapshot: str | None
) -> list[str | None]:
    """What prepare's key says of the data it reads, each way an earlier prepare of the same
    snapshot may have been keyed, the one this run indexes first: the key of the reconcile
    that makes it in the same run (its snapshot is not known before it runs), or the snapshot
    reused by --steps. A prepare keyed one way is found the other: `--steps train,inference`
    reuses the prepare of a whole run of the same data and settings, and the reverse."""
    if upstream is not None:
        reused = upstream.status == "reused" and upstream.data_version is not None
        made = reused and _snapshot_of(store, tree, upstream.data_version)
        return [upstream.key, *([f"snapshot {made}"] if made else [])]
    if snapshot is None:
        return [None]
    folder = tree.cache_folder("reconcile")
    keys = [entry[len(folder) :].removesuffix(".json") for entry in store.list_keys(folder)]
    makers = [
        key
        for key in sorted(keys)
        if (version := lookup(store, tree, "reconcile", key)) is not None
        and _snapshot_of(store, tree, version) == snapshot
    ]
    return [f"snapshot {snapshot}", *makers]


def _snapshot_of(store: Store, tree: ExperimentTree, version: int) -> str | None:
    try:
        return json.loads(store.get_bytes(tree.data(version).snapshot_info))["snapshot_hash"]
    except (NotFound, KeyError, ValueError):
        return None


def plan(
    store: Store,
    tree: ExperimentTree,
    steps: list[str],
    raw: str,
    snapshot_hash: str | None,
    arguments: dict[str, list[str]],
    reaches: dict[str, tuple[str, str | None]],
    use_cache: bool,
) -> dict[str, CacheEntry]:
    """The verdict for each data step in `steps`, keyed by:

        reconcile  the raw data (every data file's path and content hash: `raw_digest`), what
                   the user's `reconcile` can reach, the step's own code, its arguments
        prepare    the reconcile key it reads (or the snapshot's hash when that was reused by
                   --steps; either finds a prepare keyed the other way: `reconciled_as`),
                   what `load_tokenizer`, `encode`, `ordered_input_keys` can reach, the
                   step's own code, its arguments (models, MAX_SEQUENCE_LENGTH, split
                   fractions, seed)

    `raw`: where reconcile reads; `snapshot_hash`: the snapshot prepare reads when reconcile is
    not in `steps`;
    `arguments`: each step's job arguments; `reaches`: `step_reaches` of the user functions
    (computed where the driver checked them: pipeline/user_check.py)."""
    notes: dict[str, str] = {}

    def inputs(step: str) -> dict[str, str | None]:
        reach, why = reaches[step]
        if why:
            notes[step] = f"keyed by every file of the user code ({why})"
        return {
            "functions": reach,
            "code": step_code_digest(step),
            "arguments": json.dumps(arguments.get(step, [])),
        }

    entries: dict[str, CacheEntry] = {}
    if "reconcile" in steps:
        entries["reconcile"] = decide(
            store,
            tree,
            "reconcile",
            {"raw": raw_digest(store, raw), **inputs("reconcile")},
            use_cache,
        )
    if "prepare" in steps:
        upstream = entries.get("reconcile")
        decisions = [
            decide(store, tree, "prepare", {"reconciled": read, **inputs("prepare")}, use_cache)
            for read in reconciled_as(store, tree, upstream, snapshot_hash)
        ]
        reused = [d for d in decisions if d.status == "reused"]
        entries["prepare"] = (reused or decisions)[0]
    for step, note in notes.items():
        entries[step].note = "; ".join(filter(None, [entries[step].note, note]))
    return entries
