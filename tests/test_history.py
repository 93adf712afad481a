"""What users keep: `smpipe runs` and `smpipe compare` on a store with three runs (the third on
other data), and each run's report.html and the experiment's page opened in a real browser."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from pipeline import cli
from pipeline.config import load_settings
from pipeline.driver import parse_steps, run_pipeline
from pipeline.paths import ExperimentTree
from pipeline.report import SECTIONS
from pipeline.store import LocalStore
from tests.conftest import write_settings
from tests.test_user_functions import REVIEWS, write_module, write_reviews

TREE = ExperimentTree("reviews")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def three_runs(tmp_path_factory):
    """Run 1: two models on the reviews. Run 2: the same data, one more epoch. Run 3: other
    reviews (another snapshot), and its user functions edited."""
    tmp = tmp_path_factory.mktemp("history")
    write_module(tmp, "reviews_history", REVIEWS)
    write_reviews(tmp / "raw")

    def run(steps: str | None, epochs: str, models: str = "tiny") -> dict:
        path = write_settings(tmp / "settings.ini", str(tmp / "store"),
                              experiment={"USER_FUNCTIONS": "reviews_history", "NAME": "reviews"},
                              data={"RAW_DATA": str(tmp / "raw"), "MAX_SEQUENCE_LENGTH": "12"},
                              models={"MODEL_NAMES": models}, training={"EPOCHS": epochs, "LEARNING_RATE": "0.05"})  # fmt: skip
        loaded = load_settings(path, env={})
        return run_pipeline(loaded, LocalStore(tmp / "store"), parse_steps(steps), echo=sys.stdout)

    # Run 2 trains one model only, one epoch longer: reconcile is reused (the cache), prepare
    # runs again (the models are one of its inputs).
    records = [run(None, "2", models="tiny, small"), run(None, "3")]
    shutil.rmtree(tmp / "raw")
    write_reviews(tmp / "raw", n=60, seed=11)
    write_module(tmp, "reviews_history", REVIEWS + "\nEDITED = True\n")
    records.append(run(None, "3"))
    return tmp, records


def test_runs_lists_every_run(three_runs, capsys):
    tmp, records = three_runs
    verdicts = {s: e["status"] for s, e in records[1]["data_steps"].items()}
    assert verdicts == {"reconcile": "reused", "prepare": "computed"}
    # Its model was trained on its own prepared data, made from run 1's snapshot.
    lineage = records[1]["model_lineage"]["tiny"]
    assert lineage["data_version"] == 2
    assert lineage["data_snapshot_hash"] == records[0]["data_snapshot_hash"]
    assert cli.main(["runs", str(tmp / "settings.ini")]) == 0
    out = capsys.readouterr().out
    for record in records:
        assert f"{record['model_version']:04d}" in out and record["data_snapshot_hash"][:8] in out
        for model, performance in record["holdout_performance"].items():
            assert f"{model} {performance['macro_f1']:.4f}" in out
    assert out.count("completed") == 3
    # Only the settings that tell the runs apart, and each model's test accuracy beside its F1.
    assert "EPOCHS 2" in out and "EPOCHS 3" in out and "MODEL_NAMES tiny, small" in out
    assert "LEARNING_RATE" not in out
    accuracy = records[0]["holdout_performance"]["small"]["accuracy"]
    assert f"small {accuracy:.4f}" in out


@pytest.mark.parametrize("width", [80, 40])
def test_runs_on_a_narrow_terminal_shows_every_value_whole(three_runs, capsys, monkeypatch, width):
    """At 80 columns rich squeezed the table: `0.91…`, `comp…`, and at 40 every cell empty.
    A terminal too narrow for the table gets each run as lines, a value a line."""
    from rich.console import Console

    from pipeline import tables

    tmp, records = three_runs
    monkeypatch.setattr(tables, "console", lambda: Console(width=width, markup=False))
    assert cli.main(["runs", str(tmp / "settings.ini")]) == 0
    out = capsys.readouterr().out
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= width
    for record in records:
        assert f"run {record['model_version']:04d}" in out
        for model, performance in record["holdout_performance"].items():
            assert f"{model} {performance['macro_f1']:.4f}" in out
    assert out.count("completed") == 3


def test_a_runs_pages_in_a_local_store_are_named_where_they_lie(three_runs, caplog):
    """A run ends naming the experiment's page as a file to open; `smpipe report` copies pages
    only out of S3."""
    from pipeline.driver import write_run_report

    tmp, _ = three_runs
    store = LocalStore(tmp / "store")
    caplog.set_level("INFO", logger="smpipe")
    write_run_report(store, TREE.run(3), str(tmp / "settings.ini"))
    assert f"every run: {store.root / TREE.experiment_html}\n" in caplog.text + "\n"
    assert "copies it here" not in caplog.text


def test_compare_on_the_same_data_and_refused_on_other_data(three_runs, capsys):
    tmp, records = three_runs
    assert cli.main(["compare", str(tmp / "settings.ini"), "1", "2"]) == 0
    out = capsys.readouterr().out
    first, second = (records[i]["holdout_performance"]["tiny"]["macro_f1"] for i in (0, 1))
    assert f"{first:.4f}" in out and f"{second:.4f}" in out and f"{second - first:+.4f}" in out
    assert "F1 positive" in out  # per-label F1 of both runs
    assert "[training] EPOCHS: 2 -> 3" in out  # the settings that differ
    assert "only run 0001 tested small" in out
    assert "runs 0001 and 0002 ran with the same user code" in out

    # Run 3 was tested on other reviews: no metric is set against run 1's. Its user functions
    # differ, by a line, and are named; smpipe's own steps/ did not change.
    assert cli.main(["compare", str(tmp / "settings.ini"), "1", "3"]) == 1
    captured = capsys.readouterr()
    assert (
        "their test sets differ" in captured.err
        and records[2]["data_snapshot_hash"][:12] in captured.err
    )
    assert "macro_f1" not in captured.out and "[training] EPOCHS: 2 -> 3" in captured.out
    differ = "files of their code/ that differ (run 0001 -> run 0003):"
    assert f"{differ}\n  reviews_history.py: changed\n" in captured.out
    assert "steps/" not in captured.out
    # A run that is not there is said as one, with the runs that are.
    assert cli.main(["compare", str(tmp / "settings.ini"), "1", "9"]) != 0
    said = capsys.readouterr().err
    assert "no run 0009 of 'reviews' in " in said and "(runs 0001-0003)" in said
    # A run whose code is gone from the store is named.
    manifest = LocalStore(tmp / "store").root / TREE.run(2).code / "_MANIFEST.json"
    manifest.rename(manifest.with_name("aside"))
    try:
        assert cli.main(["compare", str(tmp / "settings.ini"), "1", "2"]) == 0
    finally:
        manifest.with_name("aside").rename(manifest)
    assert "the code of run 0002 is not in the store" in capsys.readouterr().out


@pytest.mark.browser
def test_the_report_renders_every_section_offline_in_chromium(three_runs):
    """Fails, never skips, without a browser: `make test` installs chromium (`make browser`);
    `pytest -m "not browser"` leaves this test out on a machine that cannot have one."""
    from playwright.sync_api import sync_playwright

    if CHROMIUM is None:
        pytest.fail("Debian's chromium is not installed: `make browser` installs it, "
                    "or leave this test out with `pytest -m 'not browser'`")  # fmt: skip

    tmp, records = three_runs
    store = LocalStore(tmp / "store")
    page_path = store.root / TREE.run(1).report_html
    # The driver wrote it when the run ended; `smpipe report` writes it again, the same.
    written = page_path.read_bytes()
    assert cli.main(["report", str(tmp / "settings.ini"), "1"]) == 0
    assert page_path.read_bytes() == written

    flags = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync"]  # fmt: skip
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=flags)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        requests: list[str] = []
        page.on("request", lambda request: requests.append(request.url))
        page.goto(page_path.as_uri())
        for section_id, title in SECTIONS:
            section = page.locator(f"section#{section_id}")
            assert section.is_visible() and section.locator("h2").inner_text() == title
            assert len(section.inner_text()) > len(title) + 10, section_id
        # Every picture decoded from the page itself: curves and confusion matrices.
        sizes = page.eval_on_selector_all("img", "imgs => imgs.map(i => i.naturalWidth)")
        assert len(sizes) == 4 and all(w > 100 for w in sizes)
        summary = page.locator("section#summary").inner_text()
        winner = records[0]["steps"]["inference"]["details"]["comparison"]["winner"]
        assert f"{winner} has the higher test macro-F1" in summary and "McNemar p" in summary
        rows = page.locator("section#results table").first.locator("tr").count()
        assert rows == 1 + 3  # header and the reviews' three labels
        # Each training job's time: the job, its steps, and each phase outside them.
        phases = page.locator("table#phases tr")
        assert phases.count() == 1 + 2  # run 1 trained two models
        header = phases.first.inner_text()
        assert all(p in header for p in ("optimizer steps", "validation", "exports", "start"))
        browser.close()
    # Nothing but the file itself was requested: no script, font, stylesheet or CDN.
    assert requests == [page_path.as_uri()]


def launch(p):
    """Debian's chromium, offline: nothing it would fetch by itself."""
    if CHROMIUM is None:
        pytest.fail("Debian's chromium is not installed: `make browser` installs it, "
                    "or leave this test out with `pytest -m 'not browser'`")  # fmt: skip
    flags = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync"]  # fmt: skip
    return p.chromium.launch(executable_path=CHROMIUM, args=flags)


@pytest.mark.browser
def test_the_experiment_page_shows_every_run_with_what_differs_in_chromium(three_runs, capsys):
    """experiment.html, written when each run ended, holds every run: the settings that differ,
    each model's test metrics, a link to the run's report, and each model's validation curves
    of every run in one chart."""
    from playwright.sync_api import sync_playwright

    tmp, records = three_runs
    page_path = LocalStore(tmp / "store").root / TREE.experiment_html
    written = page_path.read_bytes()  # by the driver, at the end of run 3
    assert cli.main(["report", str(tmp / "settings.ini")]) == 0
    assert capsys.readouterr().out.strip().endswith(str(page_path))
    assert page_path.read_bytes() == written

    with sync_playwright() as p:
        browser = launch(p)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        requests: list[str] = []
        page.on("request", lambda request: requests.append(request.url))
        page.goto(page_path.as_uri())
        rows = page.locator("section#runs tr.run")
        assert rows.count() == len(records) == 3
        header = page.locator("section#runs tr").first.inner_text().split("\t")
        assert "EPOCHS" in header and "MODEL_NAMES" in header and "LEARNING_RATE" not in header
        for i, record in enumerate(records):
            row = page.locator(f"tr#run-{record['model_version']:04d}")
            cells = dict(zip(header, row.locator("td").all_inner_texts(), strict=True))
            assert cells["EPOCHS"] == ("2", "3", "3")[i] and cells["status"] == "completed"
            for model, performance in record["holdout_performance"].items():
                assert cells[f"{model} macro-F1"] == f"{performance['macro_f1']:.4f}"
                assert cells[f"{model} accuracy"] == f"{performance['accuracy']:.4f}"
            assert record["data_snapshot_hash"][:8] in cells["data"]
        assert "2 different data snapshots" in page.locator("section#runs").inner_text()
        # A chart per model trained, each drawn from the page itself.
        sizes = page.eval_on_selector_all("img", "imgs => imgs.map(i => i.naturalWidth)")
        assert len(sizes) == 2 and all(w > 300 for w in sizes)
        # Each run's link opens that run's report.
        page.locator("tr#run-0002 a").click()
        page.wait_for_load_state()
        assert (
            page.url
            == (page_path.parent / TREE.run(2).report_html.removeprefix(TREE.root)).as_uri()
        )
        assert "run 0002" in page.locator("header h1").inner_text()
        browser.close()
    assert requests[0] == page_path.as_uri() and all(r.startswith("file://") for r in requests)


def test_runs_of_one_snapshot_split_otherwise_are_not_set_against_each_other(tmp_path):
    """Same snapshot, another [data] SEED: prepare split it into other test rows, so the
    metrics are of other rows and are not compared. Another MAX_SEQUENCE_LENGTH makes other
    prepared data of the same rows: compared."""
    from pipeline.history import compare_runs

    store = LocalStore(tmp_path / "store")
    settings = {
        1: "[data]\nSEED = 42\nMAX_SEQUENCE_LENGTH = 128\n",
        2: "[data]\nSEED = 7\nMAX_SEQUENCE_LENGTH = 128\n",
        3: "[data]\nSEED = 42\nMAX_SEQUENCE_LENGTH = 64\n",
    }
    for n, text in settings.items():
        run = TREE.run(n)
        performance = {"tiny": {"accuracy": 0.5, "macro_f1": 0.5, "weighted_f1": 0.5}}
        record = {"status": "completed", "model_version": n, "data_version": n,
                  "holdout_performance": performance, "data_snapshot_hash": "abc"}  # fmt: skip
        store.put_bytes(run.metadata, json.dumps(record).encode())
        store.put_bytes(run.settings, text.encode())
    other_split = compare_runs(store, TREE, 1, 2)
    assert not other_split["comparable"] and other_split["models"] == {}
    assert "split otherwise ([data] SEED: 42 -> 7): their test sets differ" in other_split["why"]
    same_rows = compare_runs(store, TREE, 1, 3)
    assert same_rows["comparable"] and "tiny" in same_rows["models"]


def test_a_value_spelled_another_way_is_not_a_change():
    """`--resume` after `LEARNING_RATE = 0.1` became `.10` (or `3e-4` `0.0003`) was refused
    as changed settings, and `runs` showed the two as differing: the same value, as the
    settings read it. A change of value is still one."""
    from pipeline.history import differing_settings, settings_changes, settings_values

    before = "[training]\nLEARNING_RATE = 0.1\nWARMUP_RATIO = 3e-4\nCOMPILE = true\n" \
             "[models]\nMODEL_NAMES = minilm, bow\n"  # fmt: skip
    same = "[training]\nLEARNING_RATE = .10\nWARMUP_RATIO = 0.0003\nCOMPILE = yes\n" \
           "[models]\nMODEL_NAMES = minilm,bow\n"  # fmt: skip
    assert settings_changes(before, same) == []
    assert differing_settings([settings_values(before), settings_values(same)]) == [{}, {}]
    other = same.replace(".10", ".01").replace("yes", "no").replace("minilm,bow", "bow,minilm")
    assert settings_changes(before, other) == [
        "[models] MODEL_NAMES: minilm, bow -> bow,minilm",
        "[training] COMPILE: true -> no",
        "[training] LEARNING_RATE: 0.1 -> .01",
    ]


def test_compare_says_which_run_tested_nothing_and_refuses_runs_with_no_model_in_common():
    """It said "tested no model (status completed, failed)", both runs' statuses for one that
    failed; and two runs that tested no model in common printed no metrics with status 0."""
    from pipeline.history import why_not_comparable

    tested = {"status": "completed", "data_snapshot_hash": "ab" * 32, "data_version": 1}
    minilm = {**tested, "holdout_performance": {"minilm": {"macro_f1": 0.9}}}
    bow = {**tested, "holdout_performance": {"bow": {"macro_f1": 0.8}}}
    failed = {"status": "failed"}
    assert (
        why_not_comparable((1, minilm), (2, failed), [])
        == "run 0002 tested no model (it is failed)"
    )
    assert why_not_comparable((1, {"status": "interrupted"}), (2, failed), []) == (
        "runs 0001 and 0002 tested no model (they are interrupted and failed)")  # fmt: skip
    assert why_not_comparable((1, minilm), (2, bow), []) == (
        "runs 0001 and 0002 tested no model in common (run 0001: minilm; run 0002: bow)")  # fmt: skip
    assert why_not_comparable((1, minilm), (2, minilm), []) is None


def test_a_narrow_table_with_a_column_squeezed_to_nothing_or_a_cell_holding_an_ellipsis():
    """rich squeezed a column to no width without a "…" (the table kept, its values gone); and
    a label named with a "…" is no cut."""
    from rich.console import Console
    from rich.table import Table

    from pipeline.tables import fit

    table = Table(title="runs")
    for column in ("run", "status", "test macro-F1", "size"):
        table.add_column(column)
    table.add_row("0001", "completed", "minilm 0.9123", "1.2 GB")
    assert not isinstance(fit(Console(width=20, markup=False), table), Table)
    # At 12 columns rich draws no "…" at all: every cell is blank.
    assert not isinstance(fit(Console(width=12, markup=False), table), Table)
    labelled = Table(title="per-label F1 of minilm")
    labelled.add_column("label")
    labelled.add_row("sport…")
    assert fit(Console(width=200, markup=False), labelled) is labelled
