"""What the command line says of unusual input: labels and model names that look like rich
markup are printed as they are, and run numbers that name no run are refused by number."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipeline import cli
from pipeline.paths import ExperimentTree
from pipeline.store import LocalStore
from tests.conftest import ROOT, write_settings

LABELS = ["[bold red]sports", "tech[/x]", "plain"]


@pytest.fixture
def two_runs(tmp_path):
    """Two finished runs of one model on the same data, written as a run writes them."""
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "store"))
    store, tree = LocalStore(tmp_path / "store"), ExperimentTree("test-exp")
    for n, f1 in ((1, 0.5), (2, 0.75)):
        run = tree.run(n)
        performance = {"[b]model": {"accuracy": f1, "macro_f1": f1, "weighted_f1": f1}}
        store.put_bytes(run.metadata, json.dumps({"status": "completed", "model_version": n,
                        "holdout_performance": performance, "data_snapshot_hash": "abc"}).encode())  # fmt: skip
        rows = "label,f1\n" + "".join(f'"{label}",{f1}\n' for label in LABELS)
        store.put_bytes(f"{run.inference}[b]model/per_label.csv", rows.encode())
        store.put_bytes(run.settings, b"[training]\nEPOCHS = 2\n")
    return path


def test_labels_that_look_like_markup_are_printed_as_they_are(two_runs, capsys):
    assert cli.main(["compare", str(two_runs), "1", "2"]) == 0
    out = capsys.readouterr().out
    for label in LABELS:
        assert f"F1 {label}" in out
    assert "[b]model: test metrics, run 0001 vs 0002" in out


def test_an_experiment_without_runs_has_no_page_to_show(tmp_path, capsys):
    """`smpipe report` on a new experiment: said, and nothing written into its store."""
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "store"))
    assert cli.main(["report", str(path)]) == 2
    assert "no runs of 'test-exp'" in capsys.readouterr().err
    assert not any(p.is_file() for p in (tmp_path / "store").rglob("*"))


def test_run_numbers_that_name_no_run_are_refused(two_runs, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["report", str(two_runs), "0"])
    assert exited.value.code == 2
    assert "'0' is not a run number" in capsys.readouterr().err
    assert cli.main(["report", str(two_runs), "99"]) == 2
    err = capsys.readouterr().err
    assert "no run 0099 of 'test-exp'" in err and "(runs 0001-0002)" in err
    assert cli.main(["compare", str(two_runs), "1", "7"]) == 2
    err = capsys.readouterr().err
    assert "no run 0007 of 'test-exp'" in err and "(runs 0001-0002)" in err
    assert cli.main(["compare", str(two_runs), "7", "9"]) == 2  # both named at once
    err = capsys.readouterr().err
    assert "no runs 0007 and 0009 of 'test-exp'" in err and "(runs 0001-0002)" in err
    assert cli.main(["run", str(two_runs), "--resume", "9"]) == 2  # refused, as settings are
    err = capsys.readouterr().err
    assert "--resume 9: no run 0009 at " in err and "(runs 0001-0002)" in err
    # A run another command holds (a --resume of it already going): refused, exit 2 too.
    from pathlib import Path

    from pipeline.runs import lease

    store, tree = LocalStore(Path(two_runs).parent / "store"), ExperimentTree("test-exp")
    failed = {**json.loads(store.get_bytes(tree.run(2).metadata)), "status": "failed"}
    store.put_bytes(tree.run(2).metadata, json.dumps(failed).encode())
    store.put_bytes(tree.run(2).claim, b"{}")  # claimed, as a run's number is
    with lease(store, tree.run(2), "resumed"):
        assert cli.main(["run", str(two_runs), "--resume", "2"]) == 2
    assert "run 0002 is being resumed by" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run", "plan"])
def test_an_empty_image_is_refused_not_taken_for_none(tmp_path, capsys, command):
    """`--image "$TAG"` with TAG unset would play every job as a plain process, saying
    nothing: refused, naming the option, before anything is written."""
    path = write_settings(
        tmp_path / "s.ini", str(tmp_path / "store"), experiment={"BACKEND": "emulated"}
    )
    assert cli.main([command, str(path), "--image", ""]) == 2
    err = capsys.readouterr().err
    assert "--image '': name the image every job runs in" in err
    assert not (tmp_path / "store").exists()


def test_plan_on_the_sagemaker_backend_needs_no_aws(tmp_path, monkeypatch, capsys):
    """No credentials (and no route to AWS): the plan says the store cannot be reached, plans
    as for an empty experiment, and prints every job and the most it can cost."""
    from pipeline.project import init_project

    init_project(tmp_path / "news")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for key, value in {
        "BACKEND": "sagemaker",
        "STORE": "s3://my-bucket/smpipe",
        "ROLE_ARN": "arn:aws:iam::123456789012:role/smpipe-jobs",
        "IMAGE_URI": "123456789012.dkr.ecr.us-east-1.amazonaws.com/smpipe:latest",
    }.items():
        monkeypatch.setenv(f"SMPIPE__EXPERIMENT__{key}", value)
    assert cli.main(["plan", str(tmp_path / "news/settings.ini")]) == 0
    out = capsys.readouterr()
    said = out.out + out.err
    assert (
        "s3://my-bucket/smpipe cannot be reached (Unable to locate credentials): planned as" in said
    )
    assert "--backend emulated --show-requests" in said
    assert "5. inference (processing job news-next-run-num-inference-" in said
    assert "most this plan can cost: $" in said
    assert "dry run: nothing was launched or written" in said


def test_the_report_is_said_where_a_browser_opens_it(
    two_runs, bucket, capsys, monkeypatch, tmp_path
):
    """A local store's report by its file; one in S3 (or the emulated backend's embedded S3,
    gone with the driver) as a copy here, beside its s3:// URI, kept in the user's cache
    folder under the bucket's name (never the system's temporary folder, where nothing would
    remove it)."""
    from pathlib import Path

    from pipeline.report import where_to_open, write_report
    from pipeline.store import S3Store

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert cli.main(["report", str(two_runs), "2"]) == 0
    local = capsys.readouterr().out.strip().removeprefix("report of run 0002: ")
    assert Path(local).is_file() and "<html" in Path(local).read_text().lower()
    store, tree = S3Store(f"s3://{bucket}/root"), ExperimentTree("test-exp")
    for key in LocalStore(Path(two_runs).parent / "store").list_keys("test-exp/"):
        store.put_bytes(key, LocalStore(Path(two_runs).parent / "store").get_bytes(key))
    key = write_report(store, tree, 2)
    said = where_to_open(store, key)
    copy, _, original = said.partition(" (a copy of ")
    assert original == f"{store.uri_of(key)})"
    assert Path(copy).read_bytes() == store.get_bytes(key)
    assert Path(copy) == tmp_path / "cache" / "smpipe" / "reports" / bucket / "root" / key
    # A cache folder that cannot be written: the report is said where it is, and why no copy.
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))
    said = where_to_open(store, key)
    assert said.startswith(f"{store.uri_of(key)} (no copy here to open: "), said


def test_a_runs_metadata_cut_short_is_named_never_a_traceback(two_runs, capsys):
    """A partial copy or sync of the store cut run 1's metadata.json short: `runs` lists the
    rest, and `report 1` names the file and why, in one line."""
    from pathlib import Path

    store, tree = LocalStore(Path(two_runs).parent / "store"), ExperimentTree("test-exp")
    key = tree.run(1).metadata
    store.put_bytes(key, store.get_bytes(key)[:40])
    assert cli.main(["runs", str(two_runs)]) == 0
    out = capsys.readouterr().out
    assert "0001" in out and "0.7500" in out  # run 2's row, with its metrics
    assert "unreadable" in out and "claimed" not in out  # not a run still being started
    assert cli.main(["report", str(two_runs), "1"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (
        f"error: run 0001 of 'test-exp': its Metadata {store.uri_of(key)} cannot be read (" in err
    )


def test_a_command_started_with_stdout_closed_or_stopped_in_its_imports_says_no_traceback(
    tmp_path, monkeypatch, capsys
):
    """`smpipe init p >&-` wrote its files, then ended in a traceback (Python sets a closed
    stdout to None); a Ctrl-C in the second a command imports what it needs printed a
    traceback through those imports."""
    folder = tmp_path / "p"
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "init", str(folder)],
                          cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, pass_fds=(), close_fds=True,
                          preexec_fn=lambda: os.close(1))  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert (folder / "settings.ini").exists()

    from pipeline.cli import parser

    def stopped():
        raise KeyboardInterrupt

    monkeypatch.setattr(parser, "build_parser", stopped)
    monkeypatch.setattr(cli, "build_parser", stopped)
    assert cli.main(["runs", "settings.ini"]) == 130
    assert capsys.readouterr().err == "interrupted: stopped by the user (Ctrl-C)\n"


@pytest.mark.parametrize("typed", ["+1", "1_0", "\u0661", "\uff14", "0", "-2"])
def test_every_command_reads_a_number_alike(typed, capsys):
    """`report +1` reported run 1 and `report 1_0` run 10, as int() reads them; `approve`
    refused both (isdigit()); both took non-ASCII digits. One rule for every number: ASCII
    digits, 1 and up."""
    for argv in (["report", "s.ini", typed], ["approve", "s.ini", typed],
                 ["prune", "s.ini", "--keep", typed], ["run", "s.ini", "--resume", typed]):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2 and repr(typed) in capsys.readouterr().err
