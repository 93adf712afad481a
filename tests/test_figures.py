"""docs/figures.py makes the manual's figures from what recorded them: the reliability table
(docs/trust.md) from the figures the tests record (tests/reliability/figures.py), every number as recorded,
a missing one said and never written; the demo's figures from a run's Metadata."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.conftest import ROOT
from tests.reliability import figures as recorder

spec = importlib.util.spec_from_file_location("docs_figures", ROOT / "docs/figures.py")
made = importlib.util.module_from_spec(spec)
spec.loader.exec_module(made)

# What the recording tests write, one of each (tests/reliability/*, test_cache_mutations.py,
# test_local_backend.py), with numbers found nowhere else in the table.
RECORDED = {
    "s3-faults": dict(requests=347, faults={"500": 7, "503": 5, "dropped": 9}, runs=1,
                      completed=1, manifests=13, files=131, lost=0),
    "settings-cases/test_any_settings_file_is_valid_or_one_config_error": dict(cases=401, tracebacks=0),
    "settings-cases/test_any_bytes_are_valid_or_one_config_error": dict(cases=29, tracebacks=0),
    "settings-cases/test_a_dry_run_of_any_settings_exits_cleanly_and_writes_nothing": dict(cases=63, tracebacks=2),
    "secrets/job-folder-and-outputs": dict(files=17, found=0),
    "secrets/wandb-run": dict(files=23, found=1),
    "cache-mutations/user_functions": dict(mutants=11, stale=0),
    "cache-mutations/mutant_functions": dict(mutants=14, stale=0),
    "thousand-labels": dict(inference_seconds=3.24, inference_peak_mb=441.3,
                            confusion_png_bytes=47321, pipeline_seconds=15.2),
    "user-exit/on-import": dict(refused=True),
    "user-exit/sys.exit(0)": dict(failed=True, named=True, kept=False),
    "user-exit/sys.exit(3)": dict(failed=True, named=True, kept=False),
    "user-exit/os._exit(0)": dict(failed=True, named=False, kept=False),
    "max-run-seconds": dict(limit=3, status="Stopped", reason="MaxRuntimeExceeded", seconds=5.27),
    "helper-process": dict(job_seconds=1.83, helper_finished=False),
    "store-fills/checkpoint": dict(paragraph=True, status="failed", temporaries=0),
    "store-fills/every write": dict(paragraph=True, status="running", temporaries=0),
    "store-fills/resumed": dict(status="completed", temporaries=0),
    "driver-killed-mid-upload": dict(listed_abandoned=True, resumed="completed"),
}  # fmt: skip


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    monkeypatch.setattr(recorder, "FIGURES", tmp_path / "figures")
    monkeypatch.setattr(made, "FIGURES", tmp_path / "figures")
    for name, values in RECORDED.items():
        recorder.record(name, **values)
    return tmp_path / "figures"


def measured(table: str) -> dict[str, str]:
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    return {what.lstrip("| "): value.rstrip(" |") for what, value in rows}


def test_the_reliability_table_says_each_figure_as_recorded(recorded):
    table = measured(made.reliability_table())
    said = list(table.values())
    assert said[:3] == [
        "21 faults (7 500, 5 503, 9 dropped) in 347 requests of one pipeline run",
        "1 of 1",
        "0 of 131 files (13 manifests)",
    ]
    assert (
        said[3] == "493 per test run (mutated files and overrides 401, raw bytes 29, dry runs 63)"
    )
    assert said[4] == "2"  # tracebacks, summed: a count, never a cap
    assert "1 in 40 files" in said and "0 stale reuses in 25 changes" in said[6]
    assert (
        "inference job 3.2 s, peak 441 MB, confusion figure 47 KB; the whole pipeline 15 s" in said
    )
    assert "refused up front; 2 of 3 jobs failed naming the function, nothing kept" in said
    assert "`Stopped` after 5.3 s (`MaxRuntimeExceeded`)" in said
    assert "the job ends with the step (1.8 s), the helper is ended" in said
    assert "`smpipe runs`: abandoned; `--resume 1`: completed" in said
    assert not any(made.MISSING in value for value in said)


def test_a_missing_figure_is_said_and_the_page_is_not_written(recorded, tmp_path, capsys):
    (recorded / "thousand-labels.json").unlink()
    page = tmp_path / "trust.md"
    page.write_text("before\n\n" + made.HEADER + "\n|---|---|\n| old | row |\n\nafter\n")
    original = page.read_text()
    assert made.main(["reliability", "--write", str(page)]) == 1
    assert (
        "| 1,000 labels of 10 rows | not measured: run `make figures` |" in capsys.readouterr().out
    )
    assert page.read_text() == original


def test_the_table_is_written_over_the_pages_own(recorded, tmp_path):
    page = tmp_path / "trust.md"
    page.write_text("before\n\n" + made.HEADER + "\n|---|---|\n| old | row |\n\nafter\n")
    assert made.main(["reliability", "--write", str(page)]) == 0
    assert page.read_text() == "before\n\n" + made.reliability_table() + "\nafter\n"


def test_the_manual_holds_the_table_this_command_makes():
    """Its rows are the command's rows, in its order: a figure added by hand to docs/trust.md,
    or a row the command makes and the page lacks, fails here."""
    text = (ROOT / "docs/trust.md").read_text()
    start = text.index(made.HEADER)
    rows = text[start:].split("\n\n")[0].splitlines()
    assert list(measured("\n".join(rows))) == [what for what, _ in made.reliability_rows()]


def test_the_demo_figures_come_from_the_runs_metadata():
    record = {
        "run_id": "bbc-news/0007", "status": "completed", "backend": "local",
        "time_taken": 394.2, "memory_usage": 2048.0,
        "settings": "[data]\nMAX_SEQUENCE_LENGTH = 128\n",
        "data_steps": {"reconcile": {"status": "reused"}, "prepare": {"status": "reused"}},
        "holdout_performance": {"minilm": {"rows": 223, "macro_f1": 0.98611},
                                "bow": {"rows": 223, "macro_f1": 0.96634}},
        "steps": {
            "train": {"details": {"models": {"minilm": {"history": [{}, {}]},
                                             "bow": {"history": [{}, {}, {}, {}]}}}},
            "inference": {"details": {"comparison": {"winner": "minilm", "pairs": [
                {"models": ["minilm", "bow"], "disagree": 10, "mcnemar": {"p_value": 0.34375}}]}}},
        },
    }  # fmt: skip
    assert made.demo_figures(json.loads(json.dumps(record))).splitlines() == [
        "run bbc-news/0007 (completed, local backend): 394 s (6.6 minutes; reconcile reused, "
        "prepare reused); minilm 2 epochs, bow 4 epochs at 128 tokens; peak memory 2.0 GB",
        "test macro-F1: minilm 0.986, bow 0.966",
        "minilm vs bow: McNemar's exact test p = 0.34 on the 223 test rows (they disagree on "
        "10); winner minilm",
    ]
