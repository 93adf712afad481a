"""What you see and keep, the promises no other test holds: the end-of-run summary and the
numbers of its verdict (McNemar's exact test, the paired bootstrap interval), `smpipe plan`
with `--show-requests`, and how much of a run `-q` and `-v` show."""

from __future__ import annotations

import itertools
import json
import math
import re

import numpy as np
import pytest

from pipeline import cli
from pipeline.console import summary_lines
from pipeline.jobs import KINDS
from pipeline.paths import ExperimentTree
from pipeline.service_model import as_if_on_s3, refused
from steps.inference import accuracy_difference_ci, compare, mcnemar, statistics
from tests.conftest import write_settings
from tests.test_user_functions import REVIEWS, write_module, write_reviews

ID2LABEL = {0: "business", 1: "sport", 2: "tech"}


def predictions(rows: int, only_a: int, only_b: int, both_wrong: int, seed: int = 0):
    """Labels and two models' predictions with exactly `only_a` rows only model a gets right,
    `only_b` only b, `both_wrong` neither; the rest both."""
    rng = np.random.default_rng(seed)
    truth = rng.integers(0, 3, rows)
    wrong = (truth + 1) % 3
    kinds = np.array([0] * only_a + [1] * only_b + [2] * both_wrong)
    kinds = np.concatenate([kinds, np.full(rows - len(kinds), 3)])
    rng.shuffle(kinds)
    a = np.where((kinds == 0) | (kinds == 3), truth, wrong)
    b = np.where((kinds == 1) | (kinds == 3), truth, wrong)
    return truth, a, b


def exact_mcnemar_p(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar: twice the smaller binomial tail of the discordant rows, at
    one half each way, capped at 1."""
    n = only_a + only_b
    tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_bootstrap(right_a, right_b, resamples: int = 20_000) -> tuple[float, float]:
    """The 95% percentile interval of accuracy(a) - accuracy(b), test rows resampled whole."""
    rng = np.random.default_rng(1)
    picks = rng.integers(0, len(right_a), (resamples, len(right_a)))
    differences = right_a[picks].mean(1) - right_b[picks].mean(1)
    return tuple(np.percentile(differences, [2.5, 97.5]))


@pytest.mark.parametrize("only_a, only_b", [(40, 12), (12, 10), (0, 0)])
def test_mcnemar_and_the_bootstrap_interval_are_the_textbook_numbers(only_a, only_b):
    truth, a, b = predictions(300, only_a, only_b, both_wrong=20)
    right_a, right_b = a == truth, b == truth
    test = mcnemar(right_a, right_b)
    assert (test["only_first_right"], test["only_second_right"]) == (only_a, only_b)
    assert test["p_value"] == pytest.approx(exact_mcnemar_p(only_a, only_b), rel=1e-9)
    assert test["significant_at_0.05"] == (test["p_value"] < 0.05)
    low, high = accuracy_difference_ci(right_a, right_b)
    difference = right_a.mean() - right_b.mean()
    assert low <= difference <= high
    if only_a + only_b == 0:  # the models agree on every row: nothing varies
        assert low == high == 0.0
        return
    expected = paired_bootstrap(right_a.astype(float), right_b.astype(float))
    assert (low, high) == pytest.approx(expected, abs=0.008)


def test_the_summary_gives_each_models_scores_time_epoch_and_place_then_the_verdict(tmp_path):
    truth, a, b = predictions(300, only_a=40, only_b=12, both_wrong=20)
    performance = {m: statistics(truth, p, ID2LABEL)[1] for m, p in (("minilm", a), ("bow", b))}
    comparison = compare(["bow", "minilm"], performance, {"minilm": a, "bow": b}, truth, tmp_path)
    where = {m: f"s3://bucket/exp/runs/0003/models/{m}/model/" for m in ("minilm", "bow")}
    record = {
        "holdout_performance": performance,
        "steps": {
            "train": {"details": {"models": {"minilm": {"job_seconds": 95.4, "best_epoch": 2},
                                             "bow": {"job_seconds": 12.2, "best_epoch": 4}}}},
            "inference": {"details": {"comparison": comparison}},
        },
        "model_artifacts": where,
        "model_version": 3,
        "status": "completed",
        "time_taken": 301.6,
    }  # fmt: skip
    lines = summary_lines(record, "s3://bucket/exp/runs/0003")
    rows = [line.split() for line in lines if re.match(r"  (minilm|bow) +\d", line)]
    assert [r[0] for r in rows] == ["minilm", "bow"]  # by test macro-F1, the better first
    for row in rows:
        p = performance[row[0]]
        numbers = [f"{p[k]:.4f}" for k in ("accuracy", "macro_f1", "weighted_f1")]
        trained = record["steps"]["train"]["details"]["models"][row[0]]
        assert row[1:] == [*numbers, "300", f"{trained['job_seconds']:.0f}s",
                           str(trained["best_epoch"]), where[row[0]]]  # fmt: skip
    p = exact_mcnemar_p(40, 12)
    low, high = comparison["pairs"][0]["accuracy_difference_ci95"]
    lead = (40 - 12) / 300  # minilm is right on 28 more rows of 300
    # The pair is (bow, minilm): the line turns the difference and its interval minilm's way.
    assert f"minilm beats bow: accuracy {lead:+.4f}, 95% CI [{-high:+.4f}, {-low:+.4f}]; " in (
        "\n".join(lines)
    )
    assert f"McNemar p={p:.3g}, significant at 0.05" in "\n".join(lines)
    assert lines[-1] == "\nrun 0003 completed in 302s: s3://bucket/exp/runs/0003"
    # A pair that is not significantly apart says so.
    truth, a, b = predictions(300, only_a=12, only_b=10, both_wrong=20)
    performance = {m: statistics(truth, p, ID2LABEL)[1] for m, p in (("minilm", a), ("bow", b))}
    record["holdout_performance"] = performance
    record["steps"]["inference"]["details"]["comparison"] = compare(
        ["minilm", "bow"], performance, {"minilm": a, "bow": b}, truth, tmp_path
    )
    said = "\n".join(summary_lines(record, "s3://bucket/exp/runs/0003"))
    assert "minilm vs bow: no significant difference (minilm ahead by accuracy +0.0067" in said
    assert f"McNemar p={exact_mcnemar_p(12, 10):.3g})" in said
    assert "not checked here" not in said
    # An emulated run says what it checked and what only AWS can tell.
    said = "\n".join(summary_lines({**record, "backend": "emulated"}, "s3://bucket/exp/runs/3"))
    assert "emulated: every request was checked against botocore's SageMaker model" in said
    assert "not checked here: IAM permissions (`smpipe iam` prints them)" in said


def test_plan_with_show_requests_prints_every_job_and_the_request_it_becomes(
    tmp_path, demo_raw, capsys
):
    store = tmp_path / "store"
    path = write_settings(tmp_path / "s.ini", str(store), data={"RAW_DATA": str(demo_raw)})
    assert cli.main(["plan", str(path), "--show-requests"]) == 0
    out = capsys.readouterr().out
    assert not store.exists()  # nothing written, not even the store's folder
    jobs = re.findall(r"^ {2}(\d)\. (\w+(?: \[\w+\])?) \((\w+) job (\S+)\)$", out, re.M)
    assert [(n, step, kind) for n, step, kind, _ in jobs] == [
        ("1", "reconcile", "processing"), ("2", "prepare", "processing"),
        ("3", "train [minilm]", "training"), ("4", "train [bow]", "training"),
        ("5", "inference", "processing"),
    ]  # fmt: skip
    # After each job line: its inputs and outputs, then its request as JSON.
    blocks = re.split(r"^ {2}\d\. .*$", out, flags=re.M)[1:]
    requests = []
    for block in blocks:
        lines = block[block.index("\n       {") + 1 :].splitlines()
        indented = itertools.takewhile(lambda line: line.startswith(" " * 7), lines)
        requests.append(json.loads("\n".join(indented)))
    names = [job[3] for job in jobs]
    assert [r.get("ProcessingJobName") or r.get("TrainingJobName") for r in requests] == names
    reconcile, train = requests[0], requests[2]
    assert reconcile["AppSpecification"]["ContainerEntrypoint"] == [
        "python3",
        "-m",
        "steps.entrypoint",
    ]
    assert reconcile["AppSpecification"]["ContainerArguments"][:2] == ["process", "reconcile"]
    assert train["HyperParameters"]["model_name"] == "minilm"
    assert all(isinstance(v, str) for v in train["HyperParameters"].values())
    assert {c["ChannelName"] for c in train["InputDataConfig"]} == {
        "code",
        "train",
        "validation",
        "labels",
    }
    kinds = ["processing", "processing", "training", "training", "processing"]
    assert [
        refused(KINDS[k].create, as_if_on_s3(r)) for k, r in zip(kinds, requests, strict=True)
    ] == [[]] * 5


NOISY = (
    REVIEWS
    + """
import warnings as _warnings

_reconcile = reconcile


def reconcile(raw_dir):
    print("noisy reconcile: reading the reviews", flush=True)
    _warnings.warn("this call is deprecated, as libraries say", FutureWarning, stacklevel=1)
    return _reconcile(raw_dir)
"""
)


def test_quiet_shows_the_summary_only_and_verbose_every_line_warnings_too(tmp_path, capsys):
    """A run's terminal: job lines without the warnings dependencies print (which stay in
    the job's log); -v every line, warnings included; -q the summary and where its pages are."""
    write_module(tmp_path, "reviews_noisy", NOISY)
    write_reviews(tmp_path / "raw", n=30)
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "store"),
                          experiment={"USER_FUNCTIONS": "reviews_noisy", "NAME": "reviews"},
                          data={"RAW_DATA": str(tmp_path / "raw"), "MAX_SEQUENCE_LENGTH": "12"},
                          models={"MODEL_NAMES": "tiny"})  # fmt: skip
    shown = {}
    for loudness in ("", "-v", "-q"):
        run = ["run", str(path), "--steps", "reconcile", "--no-cache", *filter(None, [loudness])]
        assert cli.main(run) == 0
        shown[loudness] = capsys.readouterr().out
    warning = "FutureWarning: this call is deprecated, as libraries say"
    assert "noisy reconcile: reading the reviews" in shown[""] and warning not in shown[""]
    assert "plan for experiment 'reviews'" in shown[""]
    assert "noisy reconcile: reading the reviews" in shown["-v"] and warning in shown["-v"]
    tree = ExperimentTree("reviews")
    record = json.loads((tmp_path / "store" / tree.run(3).metadata).read_text())
    assert record["status"] == "completed"
    # -q: the summary, then where its pages are (what the run produced, nothing of its going).
    summary = "\n".join(summary_lines(record, record["artifact_uri"]))
    report, page = (
        tmp_path / "store" / tree.run(3).report_html,
        tmp_path / "store" / tree.experiment_html,
    )
    assert shown["-q"] == f"{summary}\nreport: {report}\nevery run: {page}\n"
    assert "run 0003 completed in" in shown["-q"]
    # What the terminal left out is in the job's log.
    logs = (tmp_path / "store" / tree.run(1).logs).glob("*reconcile*.log")
    assert warning in next(logs).read_text()
