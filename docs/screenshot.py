"""python docs/screenshot.py settings.ini docs/report.png: the newest run's report.html, as
headless Chromium (Debian's, driven by playwright) shows it, whole page."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

from pipeline.cli import open_experiment
from pipeline.paths import ExperimentTree
from pipeline.report import write_report
from pipeline.runs import existing_run_nums

# As the machine's notes say: without these, Chromium keeps trying to reach Google's hosts.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def main(settings_path: str, out: str) -> None:
    settings, store = open_experiment(settings_path)
    tree = ExperimentTree(settings.experiment.name)
    runs = existing_run_nums(store, tree)
    if not runs or not hasattr(store, "root"):
        sys.exit(f"no run of {settings.experiment.name!r} in a local store: `make run` first")
    page_path = Path(store.root, write_report(store, tree, runs[-1]))
    chromium = shutil.which("chromium") or sys.exit("chromium is not installed: `make browser`")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(page_path.as_uri())
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=out, full_page=True)
        browser.close()
    print(f"{out}: run {runs[-1]:04d}'s report ({page_path})")


if __name__ == "__main__":
    main(*sys.argv[1:3])
