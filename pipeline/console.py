"""What a run shows while it goes.

On a terminal, one live display (rich) of the plan's jobs, a training job's progress bar and the
tuning trials; anywhere else (CI, a pipe, a log file), plain lines as they come. Either way,
warnings that dependencies print stay in the job logs. `Display` is both the backends' echo
stream and the driver's log handler; `log_summary` prints the run's end.
"""

from __future__ import annotations

import logging
import re
import signal
import sys
import threading
import time

from pipeline import cost
from pipeline.errors import RESULT, log
from pipeline.interrupts import stop_main
from pipeline.paths import run_label

JOB_LINE = re.compile(r"^\[(?P<job>[^\]]+)\] (?P<text>.*)$")
PROGRESS = re.compile(
    r"^step=(?P<step>\d+)/(?P<total>\d+) epoch=(?P<epoch>\d+) loss=(?P<loss>[-\d.e+]+|nan|inf)"
    r"(?: examples/s=(?P<rate>[\d.]+))?"
)
EPOCH_METRICS = re.compile(r"^epoch=\d+ step=\d+ ")
ROWS = re.compile(r"\b\d[\d,]* rows\b")  # "reconciled 2224 rows", "encoded 2224 rows for bow"
TRIAL = re.compile(r"^trial (?P<number>\d+)(?P<how> stopped| failed)?: (?P<text>.*)$")
# A warning as Python's warnings module prints it ("file.py:12: FutureWarning: ..."), and the
# source line it quotes after it (indented).
WARNING = re.compile(r"(^|: )\w*Warning: |^\s*warnings\.warn\(")
NOISE = re.compile(r"^\s+\S")  # the quoted source line of the warning just before


class Display:
    """The echo stream of the backends and the handler of the driver's log, in one.

    Live: each job of the plan with its status, elapsed time and the rows it processed; for a
    running training job a bar with its epoch, loss, examples/s and ETA; the tuning trials as a
    table that fills in. The driver's own lines and each epoch's metrics print above it; every
    other job line is in the job's log (`--verbose` shows them all). Warnings that dependencies
    print (deprecations, "this will change in version x") are kept out of the terminal."""

    def __init__(self, stream=None, verbose: bool = False, live: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.verbose = verbose
        self.live_mode = self.stream.isatty() if live is None else live
        self.jobs: dict[str, dict] = {}  # label -> status, started, seconds
        self.bars: dict[str, dict] = {}  # running training job -> its last progress line
        self.trials: dict[str, dict[int, str]] = {}  # tuning job -> trial -> what it said
        self.notes: dict[str, str] = {}  # job -> its latest line about rows processed
        self._after_warning = False
        self._buffer = ""
        self._lock = threading.Lock()
        self._live = None
        self.closed = False  # the stream failed: nothing more is written to it
        self._closing = threading.Lock()
        if self.live_mode:
            from rich.console import Console
            from rich.live import Live

            self.console = Console(file=self.stream, markup=False)  # user strings are text
            self._live = Live(
                console=self.console,
                refresh_per_second=4,
                get_renderable=self._render,
                transient=False,
                redirect_stdout=False,
            )

    # -- the echo stream ---------------------------------------------------------------------

    def write(self, text: str) -> int:
        with self._lock:
            self._buffer += text
            *lines, self._buffer = self._buffer.split("\n")
        for line in lines:
            self.job_line(line)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def job_line(self, line: str) -> None:
        """Job output, as "[job name] line" through the backend's echo stream."""
        match = JOB_LINE.match(line)
        job, text = (match["job"], match["text"]) if match else ("", line)
        if WARNING.search(text) or (self._after_warning and NOISE.match(text)):
            self._after_warning = True
            if self.verbose:
                self._print(line)
            return
        self._after_warning = False
        progress, trial = PROGRESS.match(text), TRIAL.match(text)
        if ROWS.search(text) and not progress:
            self.notes[job] = text if len(text) <= 80 else text[:77] + "..."
        if progress:
            now, step = time.time(), int(progress["step"])
            first = self.bars.get(job, {}).get("first", (now, step))  # for the ETA
            self.bars[job] = {**progress.groupdict(), "at": now, "first": first}
        if trial:
            self.trials.setdefault(job, {})[int(trial["number"])] = (
                (trial["how"] or "").strip() + " " + trial["text"]
            )
        shown = not self.live_mode or self.verbose or EPOCH_METRICS.match(text) or trial
        if shown or "Error" in text or "Traceback" in text:
            self._print(line)

    # -- the driver's log ------------------------------------------------------------------

    def handler(self) -> logging.Handler:
        display = self

        class Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                event = getattr(record, "event", None)
                if event:
                    display.event(*event)
                display._print(record.getMessage())

        return Handler()

    def event(self, kind: str, *args) -> None:
        """What the driver tells the display, with logging records that carry an `event`:
        ("plan", [job labels]), ("started", label), ("ended", label, status, seconds)."""
        now = time.time()
        if kind == "plan":
            for label in args[0]:
                self.jobs.setdefault(label, {"status": "pending", "started": None, "seconds": None})
        elif kind == "started":
            self.jobs[args[0]] = {"status": "running", "started": now, "seconds": None}
            if self._live is not None and not self._live.is_started:
                self._live.start()
        elif kind == "ended":
            label, status, seconds = args
            self.jobs[label] = {**self.jobs.get(label, {}), "status": status, "seconds": seconds}
            self.bars = {job: bar for job, bar in self.bars.items() if not _same_job(job, label)}

    def close(self) -> None:
        if self._live is not None and self._live.is_started:
            self._live.stop()

    # -- drawing ---------------------------------------------------------------------------

    def _print(self, text: str) -> None:
        """`text` on the stream, while it can take it. A pipe whose reader has gone (`smpipe
        run S | head`, a `less` quit) stops the command as Ctrl-C does, as such a pipe's
        SIGPIPE ends any other command: the run is marked interrupted and --resume continues
        it. Any other stream that fails (a closed terminal: SIGHUP stops the run) is only no
        longer written; the jobs' lines stay in their logs."""
        if self.closed:
            return
        try:
            if self.live_mode:
                self.console.print(text, markup=False, highlight=False, soft_wrap=True)
            else:
                print(text, file=self.stream, flush=True)
        except OSError as e:
            with self._closing:  # two threads' lines may fail at once: one stop
                first, self.closed = not self.closed, True
            if first and isinstance(e, BrokenPipeError):
                stop_main(signal.SIGPIPE)

    def _render(self):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        steps = Table(box=None, show_header=False, padding=(0, 2))
        for label, job in self.jobs.items():
            seconds = job["seconds"]
            if job["status"] == "running" and job["started"]:
                seconds = time.time() - job["started"]
            mark, style = {
                "completed": ("✓", "green"),
                "failed": ("✗", "red"),
                "running": ("●", "yellow"),
                "interrupted": ("■", "red"),
            }.get(job["status"], ("·", "dim"))
            note = next((n for name, n in self.notes.items() if _same_job(name, label)), "")
            steps.add_row(
                Text.assemble((mark, style), " ", label),
                Text(job["status"]),
                Text(f"{seconds:.0f}s" if seconds else ""),
                Text(note, style="dim"),
            )
        parts = [steps]
        for job, bar in self.bars.items():
            label = next((label for label in self.jobs if _same_job(job, label)), job)
            parts.append(_bar(label, bar))
        for job, trials in self.trials.items():
            table = Table(title=f"trials of {job}", title_justify="left", box=None, padding=(0, 2))
            table.add_column("trial", justify="right")
            table.add_column("result")
            for number in sorted(trials):
                table.add_row(str(number), Text(trials[number].strip()))
            parts.append(table)
        return Group(*parts)


def _same_job(job_name: str, label: str) -> bool:
    """A job's name holds its step and model: `bbc-news-0003-train-minilm-101213`."""
    step, _, model = label.partition(" ")
    return f"-{step}-" in job_name and (not model or f"-{model}-" in job_name + "-")


def _bar(job: str, bar: dict):
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    step, total = int(bar["step"]), max(int(bar["total"]), 1)
    rate = f"{float(bar['rate']):.1f} ex/s" if bar.get("rate") else ""
    (first_at, first_step), eta = bar["first"], ""
    if step > first_step:  # the job's own pace since its first progress line
        eta = "ETA " + _clock((total - step) * (bar["at"] - first_at) / (step - first_step))
    row = Table.grid(padding=(0, 1))
    cells = [
        f"  {job}",
        f"epoch {bar['epoch']}",
        None,
        f"{step}/{total}",
        f"loss {bar['loss']}",
        rate,
        eta,
    ]
    row.add_row(
        *(
            Text(c) if c is not None else ProgressBar(total=total, completed=step, width=30)
            for c in cells
        )
    )
    return row


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


# -- what a finished run says at the end ---------------------------------------------------------


def log_summary(record: dict, run_uri: str) -> None:
    for line in summary_lines(record, run_uri):
        log.info(line, extra=RESULT)


# What an emulated run showed, and what it could not (docs/sagemaker.md's emulator section).
EMULATED_CHECKED = (
    "emulated: every request was checked against botocore's SageMaker model and its limits, and "
    "each job played as SageMaker runs it; not checked here: IAM permissions (`smpipe iam` "
    "prints them), VPC, KMS and quotas, the GPU and its driver, real speed and the bill "
    "(docs/sagemaker.md, BACKEND = emulated)"
)


def summary_lines(record: dict, run_uri: str) -> list[str]:
    """What a finished run says at the end: per model its test metrics, training time, best
    epoch and where its model is; the comparison's winner and whether the win is significant."""
    performance = record.get("holdout_performance") or {}
    train = (
        (record.get("steps") or {}).get("train") or (record.get("steps") or {}).get("tune") or {}
    )
    trained = (train.get("details") or {}).get("models") or {}
    lines = []
    if performance:
        lines += [
            "",
            "test-set performance",
            f"  {'model':<14}{'accuracy':>9}{'macro F1':>10}{'weighted F1':>13}{'rows':>6}"
            f"{'trained':>9}{'best epoch':>12}  model",
        ]
        for name, p in sorted(performance.items(), key=lambda kv: -kv[1]["macro_f1"]):
            t = trained.get(name) or {}
            took = f"{t['job_seconds']:.0f}s" if t.get("job_seconds") is not None else "-"
            where = (record.get("model_artifacts") or {}).get(name, "-")
            lines.append(
                f"  {name:<14}{p['accuracy']:>9.4f}{p['macro_f1']:>10.4f}{p['weighted_f1']:>13.4f}"
                f"{p['rows']:>6}{took:>9}{str(t.get('best_epoch', '-')):>12}  {where}"
            )
        comparison = (record["steps"].get("inference") or {}).get("details", {}).get("comparison")
        for pair in (comparison or {}).get("pairs", []):
            lines.append("  " + verdict(pair))
    if record.get("cost"):  # dollars from SageMaker's billing; locally CPU-seconds
        lines.append(cost.as_text(record["cost"]))
    if record.get("backend") == "emulated":
        lines.append(EMULATED_CHECKED)
    took = f"{record['time_taken']:.0f}s"
    lines.append(
        f"\nrun {run_label(record['model_version'])} {record['status']} in {took}: {run_uri}"
    )
    return lines


def verdict(pair: dict) -> str:
    """One line on a pair of models: which is ahead in test accuracy, by how much, and
    whether that is significant."""
    a, b = pair["models"]
    m, ci = pair["mcnemar"], pair.get("accuracy_difference_ci95")
    ahead = a if pair["accuracy_difference"] >= 0 else b
    behind = b if ahead == a else a
    # accuracy(ahead) - accuracy(behind), and its interval, whichever way the pair is ordered
    sign = 1 if ahead == a else -1
    interval = ""
    if ci:
        low, high = sorted((sign * ci[0], sign * ci[1]))
        interval = f", 95% CI [{low:+.4f}, {high:+.4f}]"
    difference = sign * pair["accuracy_difference"]
    how = f"accuracy {difference:+.4f}{interval}; McNemar p={m['p_value']:.3g}"
    if m["significant_at_0.05"]:
        return f"{ahead} beats {behind}: {how}, significant at 0.05"
    return f"{ahead} vs {behind}: no significant difference ({ahead} ahead by {how})"
