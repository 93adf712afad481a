"""Property-based: generated and mutated settings files end in a valid `Settings` or a
`ConfigError`; never a traceback, a job or a write."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import run_pipeline
from pipeline.config import ConfigError, Settings, load_settings
from steps.hyperparameters import HYPERPARAMETERS, parse_hyperparameters
from tests.conftest import ROOT
from tests.reliability.figures import record

SHIPPED = (ROOT / "settings.ini").read_text()
LINES = SHIPPED.splitlines()
VALUE_LINES = [i for i, line in enumerate(LINES) if "=" in line and not line.startswith("#")]
# Values a user might write, and ones that broke us before.
AWKWARD = ["", "0", "-1", "-5", "1e29", "1e400", "inf", "nan", "-0.0", "1e-5->1e-3", "1->0",
           "3->3", "a->b", "x,,y", "1,1", "true", "yes", "  7  ", "0x10", "1_000", "(a)(b)",
           "([0-9.]+)", "[", "s3://", "s3://bucket/p", "/proc/x", "..", "a/b", "é"]  # fmt: skip

values = st.one_of(
    st.sampled_from(AWKWARD),
    st.integers(-(10**30), 10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=12),
)
mutation = st.one_of(
    st.tuples(st.just("value"), st.sampled_from(VALUE_LINES), values),
    st.tuples(st.just("delete"), st.integers(0, len(LINES) - 1), st.none()),
    st.tuples(st.just("indent"), st.integers(0, len(LINES) - 1), st.none()),
    st.tuples(st.just("duplicate"), st.integers(0, len(LINES) - 1), st.none()),
    st.tuples(st.just("insert"), st.integers(0, len(LINES)), st.text(max_size=30)),
)


def mutate(store: str, edits: list, bom: bool) -> bytes:
    lines = [f"STORE = {store}" if line.startswith("STORE =") else line for line in LINES]
    for kind, at, value in edits:
        at = min(at, len(lines) - 1) if kind != "insert" else min(at, len(lines))
        if not lines and kind != "insert":
            continue
        if kind == "value":
            lines[at] = lines[at].split("=", 1)[0] + "= " + value if "=" in lines[at] else lines[at]
        elif kind == "delete":
            del lines[at]
        elif kind == "indent":
            lines[at] = "  " + lines[at]
        elif kind == "duplicate":
            lines.insert(at, lines[at])
        else:
            lines.insert(at, value)
    text = ("\ufeff" if bom else "") + "\n".join(lines) + "\n"
    return text.encode("utf-8", errors="surrogatepass")


overrides = st.dictionaries(
    st.sampled_from(["SMPIPE__TRAINING__EPOCHS", "SMPIPE__TRAINNG__EPOCHS", "SMPIPE__X",
                     "SMPIPE__DATA__SEED", "SMPIPE__TRAINING_BOW__LEARNING_RATE",
                     "SMPIPE__TUNING_HYPERPARAMETERS__BATCH_SIZE", "SMPIPE____"]),
    values, max_size=3,
)  # fmt: skip


@pytest.fixture
def cases(request):
    """The cases hypothesis ran through this test (its explicit examples among them, a failing
    one's shrinking too), and the tracebacks among them: recorded as the test ends."""
    counted = collections.Counter()
    yield counted
    record(f"settings-cases/{request.node.name}", cases=counted["cases"],
           tracebacks=counted["tracebacks"])  # fmt: skip


def counted(cases: collections.Counter, call, *args):
    """call(*args), one case: an exception other than ConfigError is a traceback."""
    cases["cases"] += 1
    try:
        return call(*args)
    except ConfigError:
        raise
    except Exception:
        cases["tracebacks"] += 1
        raise


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(edits=st.lists(mutation, max_size=6), bom=st.booleans(), env=overrides)
def test_any_settings_file_is_valid_or_one_config_error(tmp_path, cases, edits, bom, env):
    path = tmp_path / "settings.ini"
    path.write_bytes(mutate(str(tmp_path / "store"), edits, bom))
    try:
        settings = counted(cases, load_settings, path, env)
    except ConfigError as e:
        assert e.problems and all(isinstance(p, str) and p for p in e.problems)
        event("ConfigError")
        return
    event("valid Settings")
    a_job_accepts(settings)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(raw=st.binary(max_size=200))
def test_any_bytes_are_valid_or_one_config_error(tmp_path, cases, raw):
    path = tmp_path / "settings.ini"
    path.write_bytes(raw)
    try:
        counted(cases, load_settings, path, {})
    except ConfigError as e:
        assert e.problems


def a_job_accepts(settings: Settings) -> None:
    """What loads is what a job takes: every model's training job and tuning trial parses its
    hyperparameters (steps/hyperparameters.py, as steps/train.py does), and every value a
    search may draw lies within the same bounds (its interval's ends, each option)."""
    for model in settings.models.model_names:
        for kind in ("training", "tuning"):
            parse_hyperparameters(settings.training_hyperparameters(model, kind))
        for name, searched in settings.tuning_space(model)[1].items():
            row = HYPERPARAMETERS[name]
            values = getattr(searched, "options", None) or (searched.low, searched.high)
            for value in values:
                row.cast(value)  # ValueError naming the bound it breaks


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(edits=st.lists(mutation, max_size=4), bom=st.booleans())
# Raw data the settings point at in vain, every time: no RAW_DATA line (the experiment's raw/
# is empty), another experiment NAME (its raw/ is too).
@example(edits=[("delete", LINES.index("RAW_DATA ="), None)], bom=False)
@example(edits=[("value", LINES.index("NAME = bbc-news"), "other")], bom=False)
def test_a_dry_run_of_any_settings_exits_cleanly_and_writes_nothing(
    tmp_path_factory, aws_env, monkeypatch, capsys, demo_raw, cases, edits, bom
):
    # aws_env: a mutated BACKEND or s3:// STORE talks to moto, never to AWS.
    folder = tmp_path_factory.mktemp("dry")
    lines = mutate(str(folder / "store"), edits, bom).decode("utf-8", errors="surrogatepass")
    # The module to import stays the demo's: the file's text must not choose what is imported.
    text = "\n".join(
        "USER_FUNCTIONS = user_functions"
        if line.strip().upper().startswith("USER_FUNCTIONS")
        else line
        for line in lines.splitlines()
    ).replace("RAW_DATA =", f"RAW_DATA = {demo_raw} ;", 1)
    (folder / "settings.ini").write_bytes(text.encode("utf-8", errors="surrogatepass"))
    before = listing(folder)
    code = counted(cases, run_pipeline.main, [str(folder / "settings.ini"), "--dry-run"])
    out = capsys.readouterr()
    event(f"exit {code}")
    cases["tracebacks"] += "Traceback" in out.err + out.out
    assert "Traceback" not in out.err + out.out
    assert listing(folder) == before
    # The README's exit statuses: 0, the plan printed; 2, the settings (or the store they
    # name) wrong, every problem listed. A dry run has no step to fail (1).
    if code == 2:
        assert re.match(r"error: .*: \d+ problem\(s\):\n  - ", out.err), out.err
        return
    assert code == 0, out.err
    assert out.out.rstrip().endswith("dry run: nothing was launched or written")
    for number, step in enumerate(("reconcile", "prepare"), 1):
        assert f"  {number}. {step} (processing job " in out.out
