"""`smpipe predict --raw`: new data in the shape [data] RAW_DATA has, turned into rows by the
run's own reconcile before predict reads them, so that new data is never joined by hand.

reconcile runs here, in a process of its own, with the user functions the run shipped (its
code/) and this project's steps/, as the predict job gets them (pipeline/code_bundle.py
`assemble`); labels are not needed (steps/reconcile.py `reconcile_new`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.raw_data import folder_problems

RAW = "raw"  # INPUT's format in predict's record: raw data, read by the run's reconcile
# What the process runs: steps/reconcile.py's reconcile_new with RAW, the module and OUT.
CALL = "import sys; from steps.reconcile import reconcile_new_process as p; p(sys.argv[1:])"
RULE = (
    "--raw runs the run's reconcile over INPUT as over RAW_DATA, without labels: a reconcile "
    "that reads a label returns None for it (or no label column) when the data has none"
)


def raw_problems(source: Path) -> list[str]:
    """Why INPUT cannot be given to reconcile as its raw_dir."""
    if not source.exists():
        return [f"INPUT {source} does not exist"]
    if not source.is_dir():
        return [f"INPUT {source}: --raw reads a folder, as reconcile(raw_dir) is given one"]
    return [f"INPUT {problem}" for problem in folder_problems(source)]


def reconciled(code: Path, module: str, source: Path, into: Path) -> tuple[Path, dict]:
    """INPUT's rows as `module`.reconcile returns them, in a parquet file under `into`, and
    what it dropped ({"dropped": {reason: count}, "dropped_ids": {reason: [first ids]}})."""
    out = into / "reconciled.parquet"
    # datasets' cache of what load_dataset read goes with the rest, not into ~/.cache.
    env = {**os.environ, "HF_DATASETS_CACHE": str(into / "datasets-cache")}
    done = subprocess.run(
        [sys.executable, "-c", CALL, str(source.resolve()), module, str(out)],
        cwd=code,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        why = lines[-1] if lines else f"it exited with status {done.returncode}"
        raise PipelineError(
            f"smpipe predict --raw: reconcile failed on INPUT {source}: {why}. {RULE}"
        )
    return out, json.loads(Path(f"{out}.json").read_text())
