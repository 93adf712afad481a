"""Loading the user's five functions and checking them against the contract.

The driver calls `load_user_functions` before any job starts, so a missing function or a
wrong signature is reported by name up front; the steps call it again inside the job.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

# name -> the parameters it must take, in order, and what it does.
CONTRACT: dict[str, tuple[tuple[str, ...], str]] = {
    "reconcile": (
        ("raw_dir",),
        "collect the raw data into (datasets.Dataset with a string 'label', "
        "{reason: [ids dropped]})",
    ),
    "load_tokenizer": (("model_name",), "the tokenizer or processor of one model"),
    "encode": (
        ("batch", "tokenizer", "model_name", "max_length"),
        "batched encoding of reconciled rows for one model",
    ),
    "load_model": (("model_name", "id2label", "label2id"), "the torch.nn.Module to finetune"),
    "ordered_input_keys": (("model_name",), "the names of forward()'s inputs, in order"),
}


class UserFunctionError(ValueError):
    def __init__(self, problems: list[str], module: str):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"user functions in '{module}': {len(problems)} problem(s):\n{lines}")


@dataclass(frozen=True)
class UserFunctions:
    module: str
    reconcile: Callable
    load_tokenizer: Callable
    encode: Callable
    load_model: Callable
    ordered_input_keys: Callable


def _signature(name: str, params: tuple[str, ...]) -> str:
    return f"{name}({', '.join(params)})"


def signature_problem(fn: Callable, name: str, params: tuple[str, ...]) -> str | None:
    """Why `fn` cannot be called as the steps call it (`call` below: the contract's
    arguments, all of them, by position, in order), or None. Parameters after them
    with defaults, and *args/**kwargs, fit. The names are checked too: each argument given
    to a named parameter must go to the one of its name, since a swap (label2id where id2label
    goes) would be called without error and go wrong silently."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or extension Python cannot read: calling tells
        return None
    try:
        bound = signature.bind(*params)
    except TypeError:
        bound = None
    taken = [] if bound is None else list(bound.arguments)
    kinds = {p.name: p.kind for p in signature.parameters.values()}
    named = [k for k in taken if kinds[k] != inspect.Parameter.VAR_POSITIONAL]
    # A parameter of the contract's names that the call does not reach (keyword-only, or
    # after *args, which swallows its argument) would be left to its default, silently.
    stranded = [p for p in params if p in kinds and p not in taken]
    if bound is not None and named == list(params[: len(named)]) and not stranded:
        return None
    return (
        f"has the wrong signature {name}{signature}: expected {_signature(name, params)} "
        "(called with these arguments, by position; a parameter after them needs a default)"
    )


def load_user_functions(module_name: str, search_path: str | None = None) -> UserFunctions:
    """Import the module and check every function; raise one error listing every problem."""
    if search_path and search_path not in sys.path:
        sys.path.insert(0, search_path)
    try:
        module: ModuleType = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise UserFunctionError(
                [f"Could not import module '{module_name}'"], module_name
            ) from None
        raise UserFunctionError([f"importing '{module_name}' failed: {e}"], module_name) from e
    except SystemExit as e:  # sys.exit() at import: the module ends the process, silently
        raise UserFunctionError(
            [
                f"importing '{module_name}' called sys.exit({e.code!r}): a user module must not "
                "end the process"
            ],
            module_name,
        ) from None
    except Exception as e:  # a user module that raises on import
        raise UserFunctionError(
            [f"importing '{module_name}' raised {type(e).__name__}: {e}"], module_name
        ) from e

    problems = []
    found = {}
    for name, (params, meaning) in CONTRACT.items():
        fn = getattr(module, name, None)
        if fn is None:
            problems.append(
                f"Module '{module_name}' has no attribute '{name}': expected "
                f"{_signature(name, params)}, {meaning}"
            )
            continue
        if not callable(fn):
            problems.append(f"'{module_name}.{name}' is not a function")
            continue
        problem = signature_problem(fn, name, params)
        if problem:
            problems.append(f"'{module_name}.{name}' {problem}")
        found[name] = fn
    if problems:
        raise UserFunctionError(problems, module_name)
    return UserFunctions(module=module_name, **found)


def call(functions: UserFunctions, name: str, *args):
    """Call a user function; an exception inside it names the function, and so does a
    sys.exit() (of any code: a step that ends without its output has failed)."""
    try:
        return getattr(functions, name)(*args)
    except SystemExit as e:
        raise RuntimeError(
            f"user function {functions.module}.{name} called sys.exit({e.code!r}): "
            "a user function must return (or raise), not end the process"
        ) from None
    except Exception as e:
        raise RuntimeError(f"user function {functions.module}.{name} raised {raised(e)}") from e


# The one-line message goes to the terminal and to the job's failure reason, which SageMaker
# holds to 1,024 characters (FailureReason's max in botocore's sagemaker service-2.json):
# each text the user's code chose is cut, so that the cause still shows after a long message.
MESSAGE_LIMIT = 400
CAUSE_LIMIT = 300


def raised(e: BaseException) -> str:
    """`Type: message` of an exception, and of the innermost error it was raised from when
    that differs: a library's wrapper (datasets' DatasetGenerationError around a
    UnicodeDecodeError) says what went wrong only in its cause, which otherwise only the log's
    traceback shows."""
    said = f"{type(e).__name__}: {_cut(' '.join(str(e).split()), MESSAGE_LIMIT)}"
    root = innermost_cause(e)
    if root is e:
        return said
    cause = f"{type(root).__name__}: {_cut(' '.join(str(root).split()), CAUSE_LIMIT)}"
    return said if cause == said else f"{said} (caused by {cause})"


def innermost_cause(e: BaseException) -> BaseException:
    """The innermost error `e` was raised from: `raise ... from` (__cause__) as deep as it
    goes; the error being handled when one was raised (__context__, unless `from None` hid it)
    only until a `from` is met. Below a named cause, a context is what the library that
    raised it had handled on the way: pandas reading a cp1252 CSV raises the UnicodeDecodeError
    that datasets names while handling pyarrow's ArrowInvalid of its fast path."""
    seen, explicit = {id(e)}, False
    while True:
        below = e.__cause__
        explicit = explicit or below is not None
        if below is None and not explicit and not e.__suppress_context__:
            below = e.__context__
        if below is None or id(below) in seen:  # a chain can loop back on itself
            return e
        seen.add(id(below))
        e = below


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def input_keys(functions: UserFunctions, model_name: str) -> list[str]:
    """ordered_input_keys(model_name), checked: a list (or tuple) of distinct names. A bare
    string would otherwise be read a character a key."""
    keys = call(functions, "ordered_input_keys", model_name)
    where = f"{functions.module}.ordered_input_keys({model_name!r})"
    if not isinstance(keys, list | tuple) or not keys:
        raise ValueError(
            f"{where} returned {keys!r}: it returns the list of forward()'s input names, "
            "such as ['input_ids', 'attention_mask']"
        )
    if not all(isinstance(key, str) and key for key in keys) or len(set(keys)) < len(keys):
        raise ValueError(f"{where} returned {list(keys)!r}: each name once, as a string")
    return list(keys)


def local_modules(module_name: str, bases: list[Path]) -> dict[str, Path]:
    """The files the user's code is made of, as a job needs them: the module (a file, or a
    package folder) and every module beside it that it imports, from any of its files and any
    depth of them (imports inside functions too), transitively. Name -> its file or folder.
    Modules found nowhere in `bases` are libraries, installed in the image."""
    top = module_name.split(".")[0]
    base = next((b for b in bases if (b / top).is_dir() or (b / f"{top}.py").is_file()), None)
    if base is None:
        return {}
    found: dict[str, Path] = {}
    todo = [top]
    while todo:
        name = todo.pop()
        # A folder is a module of the user's only as a package (an __init__.py): a folder of
        # data that happens to share a library's name is not shipped as code.
        package = base / name
        is_package = package.is_dir() and (name == top or (package / "__init__.py").is_file())
        path = package if is_package else base / f"{name}.py"
        if name in found or name in ("steps", "pipeline") or not path.exists():
            continue
        found[name] = path
        for source in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            todo += imported_names(source)
    return found


def imported_names(source: Path) -> list[str]:
    """The top-level names a Python file imports absolutely, wherever the import stands."""
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return []
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module.split(".")[0])
    return names
