"""Loading the user's five functions and checking them against the contract.

The driver calls `load_user_functions` before any job starts, so a missing function or a
wrong signature is reported by name up front; the steps call it again inside the job.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

# name -> the parameters it must take, in order, and what it does.
CONTRACT: dict[str, tuple[tuple[str, ...], str]] = {
    "reconcile": (
        ("raw_dir",),
        "collect the raw data into (datasets.Dataset with a string 'label', {reason: [ids dropped]})",
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
                f"Module '{module_name}' has no attribute '{name}': expected {_signature(name, params)}, {meaning}"
            )
            continue
        if not callable(fn):
            problems.append(f"'{module_name}.{name}' is not a function")
            continue
        got = tuple(
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
        )
        if got != params:
            problems.append(
                f"'{module_name}.{name}' has the wrong signature {_signature(name, got)}: "
                f"expected {_signature(name, params)}"
            )
        found[name] = fn
    if problems:
        raise UserFunctionError(problems, module_name)
    return UserFunctions(module=module_name, **found)


def call(functions: UserFunctions, name: str, *args):
    """Call a user function; an exception inside it names the function."""
    try:
        return getattr(functions, name)(*args)
    except Exception as e:
        raise RuntimeError(
            f"user function {functions.module}.{name} raised {type(e).__name__}: {e}"
        ) from e
