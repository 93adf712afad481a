"""What a run shows: plain lines off a terminal with dependencies' warnings kept out (and in
with --verbose); on a terminal, the jobs with their status, a training bar, tuning trials."""

from __future__ import annotations

import io
import logging

from pipeline.console import Display

LINES = (
    "[demo-0001-reconcile-101010] reconciled 2224 rows, labels {'tech': 400}\n"
    "[demo-0001-train-minilm-101010] /venv/lib/transformers/utils.py:12: FutureWarning: `foo` is deprecated\n"
    "[demo-0001-train-minilm-101010]   warnings.warn(\n"
    "[demo-0001-train-minilm-101010] step=10/40 epoch=1 loss=0.8123 examples/s=61.5\n"
    "[demo-0001-train-minilm-101010] epoch=1 step=20 train:loss=0.7 validation:f1=0.81\n"
    "[demo-0001-tune-bow-101010] trial 2 stopped: early stopping: validation:f1=0.2000 at epoch 1\n"
)


def test_plain_lines_keep_dependency_warnings_out_unless_verbose():
    out = io.StringIO()
    Display(out, live=False).write(LINES)
    assert "FutureWarning" not in out.getvalue() and "warnings.warn" not in out.getvalue()
    assert "step=10/40" in out.getvalue() and "trial 2 stopped" in out.getvalue()
    loud = io.StringIO()
    Display(loud, verbose=True, live=False).write(LINES)
    assert "FutureWarning" in loud.getvalue() and "warnings.warn(" in loud.getvalue()


def test_the_live_display_follows_jobs_bars_and_trials():
    from rich.console import Console

    out = io.StringIO()
    display = Display(out, live=True)
    logger = logging.getLogger("smpipe.test-console")
    logger.handlers, logger.propagate = [display.handler()], False
    logger.setLevel(logging.INFO)
    logger.info("plan", extra={"event": ("plan", ["reconcile", "train minilm", "tune bow"])})
    logger.info("reconcile: started", extra={"event": ("started", "reconcile")})
    logger.info("reconcile: completed", extra={"event": ("ended", "reconcile", "completed", 3.2)})
    logger.info("train minilm: started", extra={"event": ("started", "train minilm")})
    display.write(LINES)
    screen = Console(file=io.StringIO(), width=160)
    screen.print(display._render())
    drawn = screen.file.getvalue()
    display.close()
    assert "✓ reconcile" in drawn and "completed" in drawn and "3s" in drawn
    assert "reconciled 2224 rows" in drawn
    assert (
        "train minilm" in drawn and "epoch 1" in drawn and "10/40" in drawn and "61.5 ex/s" in drawn
    )
    assert "trials of demo-0001-tune-bow-101010" in drawn and "stopped early stopping" in drawn
    assert "· tune bow" in drawn and "pending" in drawn
    # Above the display: the driver's lines and each epoch's metrics, not every job line.
    printed = out.getvalue()
    assert "validation:f1=0.81" in printed and "reconcile: completed" in printed
    assert "] step=10/40" not in printed  # that line is the bar, not a printed line
