"""`smpipe init DIR`: a project that runs as it is, on `local` and `emulated`; `smpipe --version`;
`smpipe` with no command. The generated project is run as a user runs it: `smpipe` in its folder."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from pydantic_core import PydanticUndefined

from pipeline.cli import main
from pipeline.cli.parser import build_parser
from pipeline.config import SECTIONS, load_settings
from pipeline.project import TEMPLATE, derive_settings, template_files
from tests.conftest import ROOT

SMPIPE = str(Path(sys.executable).with_name("smpipe"))  # the command `make install` puts there
TEMPLATE_SETTINGS = TEMPLATE / "settings.ini"
SAMPLE_NOTE = re.compile(r"^# sample: \S")


def smpipe(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [SMPIPE, *args], cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True
    )


def new_project(tmp_path: Path, name: str = "my-project") -> Path:
    done = smpipe("init", name, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # What to type next is said.
    assert f"cd {name}\n  smpipe run settings.ini" in done.stdout
    return tmp_path / name


def run_sample(project: Path, *options: str) -> dict:
    """`smpipe run settings.ini` in the project, two optimizer steps (the sample's own 15
    take a minute here): the project's settings, code and data otherwise as generated."""
    done = smpipe("run", "settings.ini", *options, cwd=project,
                  SMPIPE__TRAINING__EPOCHS="1", SMPIPE__TRAINING__MAX_STEPS="2")  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "run 0001 completed" in done.stdout
    run = project / "artifacts" / "my-project" / "runs" / "0001"
    record = json.loads((run / "metadata.json").read_text())
    assert record["status"] == "completed"
    # The project's own functions ran (not the demo's of the same module name), on its sample.
    shipped = run / "code" / "user_functions" / "__init__.py"
    assert shipped.read_text() == (TEMPLATE / "user_functions" / "__init__.py").read_text()
    # Two models, so the first report compares: the pretrained one and the baseline.
    assert {m: p["rows"] for m, p in record["holdout_performance"].items()} == {
        "minilm": 10,
        "bow": 10,
    }
    comparison = record["steps"]["inference"]["details"]["comparison"]
    assert [sorted(pair["models"]) for pair in comparison["pairs"]] == [["bow", "minilm"]]
    snapshot = next(project.glob("artifacts/my-project/data/*/reconciled/snapshot.json"))
    reconciled = json.loads(snapshot.read_text())
    # The BBC dataset repeats an article: reconcile drops the second, by id, and says so.
    assert reconciled["dropped"] == {"empty_text": [], "duplicate_text": ["51"]}
    counts = dict.fromkeys(["business", "entertainment", "politics", "tech"], 20)
    assert reconciled["label_counts"] == {**counts, "sports": 19}
    return record


@pytest.mark.slow
def test_a_new_project_runs_its_sample_locally(tmp_path):
    project = new_project(tmp_path)
    assert sorted(p.relative_to(project) for p in project.rglob("*") if p.is_file()) == (
        template_files()
    )
    record = run_sample(project)
    assert record["backend"] == "local"
    # New items as data/ holds them, without their category: the project's reconcile reads
    # them (`predict --raw`), and the run's winner labels each.
    new = project / "new"
    new.mkdir()
    sample = (project / "data" / "news.csv").read_text().splitlines()
    header = sample[0].split(",")
    assert header[-1] == "category"
    rows = [line.rsplit(",", 1)[0] for line in sample[1:6]]  # its last column is the category
    (new / "news.csv").write_text("\n".join([",".join(header[:-1]), *rows]) + "\n")
    done = smpipe("predict", "settings.ini", "new", "labelled.csv", "--raw", cwd=project)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    predicted = list(csv.DictReader((project / "labelled.csv").open()))
    topics = {"business", "entertainment", "politics", "sports", "tech"}
    assert len(predicted) == 5 and {row["predicted"] for row in predicted} <= topics


@pytest.mark.slow
def test_a_new_project_runs_its_sample_on_emulated_sagemaker(tmp_path):
    project = new_project(tmp_path)
    record = run_sample(project, "--backend", "emulated")
    # Priced from SageMaker's billing fields: the template's instance types have a price in
    # its region (pipeline/cost.py PRICE_TABLE), so the run ends with dollars, not "unknown".
    assert record["cost"]["usd"] is not None and record["cost"]["usd"] > 0, record["cost"]
    # Trained by a CreateTrainingJob: SageMaker's model.tar.gz, under OutputDataConfig.
    run = project / "artifacts" / "my-project" / "runs" / "0001"
    assert (
        len(list(run.glob("jobs/training/my-project-0001-train-minilm-*/output/model.tar.gz"))) == 1
    )
    # RAW_DATA (the sample beside settings.ini) went to the store as the raw version the run
    # names (pipeline/raw_data.py), as on SageMaker.
    assert record["raw_path"].startswith("my-project/raw-versions/")
    raw = project / "artifacts" / record["raw_path"] / "news.csv"
    assert raw.read_bytes() == (project / "data" / "news.csv").read_bytes()


def test_the_template_reconcile_drops_empty_and_repeated_rows_by_id(tmp_path):
    project = new_project(tmp_path)
    with open(project / "data" / "news.csv", "a", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows(
            [
                [101, "", "", "tech"],
                [102, "Dollar gains on Greenspan speech", "x", "business"],
                [103, "Dollar gains on Greenspan speech", "x", "business"],
            ]  # fmt: skip
        )
    # Imported under a name of its own: `user_functions` is the demo's in this process.
    spec = importlib.util.spec_from_file_location(
        "new_project_functions", project / "user_functions" / "__init__.py"
    )
    functions = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(functions)
    dataset, dropped = functions.reconcile(project / "data")
    assert dropped == {"empty_text": [101], "duplicate_text": [51, 103]}
    assert len(dataset) == 100 and {"id", "text", "label"} <= set(dataset.column_names)
    assert dataset[0]["text"] == (
        "India's rupee hits five-year high. India's rupee has hit a five-year high after "
        "Standard & Poor's (S&P) raised the country's foreign currency rating."
    )


def test_the_template_settings_are_the_demo_settings_derived():
    """One home for every key's comment: the shipped settings.ini. The template's is derived
    from it, so a key added there (and its comment) reaches new projects."""
    derived = derive_settings((ROOT / "settings.ini").read_text(encoding="utf-8"))
    assert TEMPLATE_SETTINGS.read_text(encoding="utf-8") == derived, (
        "pipeline/project_template/settings.ini is out of date: `.venv/bin/python -m pipeline.project`"
    )


def template_keys() -> dict[tuple[str, str], list[str]]:
    """(section, key) -> the comment lines above it in the template's settings.ini."""
    keys, section, above = {}, None, []
    for line in TEMPLATE_SETTINGS.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            section, above = stripped[1:-1].lower(), []
        elif stripped.startswith("#"):
            above.append(stripped)
        elif "=" in stripped and section in SECTIONS:
            keys[section, stripped.split("=", 1)[0].strip().lower()] = above
            above = []
        else:
            above = []
    return keys


def test_the_template_settings_hold_every_key_at_its_default_or_say_why():
    settings = load_settings(TEMPLATE_SETTINGS, env={})
    assert (
        settings.models.model_names == ["minilm", "bow"] and settings.experiment.backend == "local"
    )
    keys = template_keys()
    missing = [f"[{s}] {k}" for s, model in SECTIONS.items() for k in model.model_fields
               if (s, k) not in keys]  # fmt: skip
    assert not missing
    wrong = []
    for (section, key), above in keys.items():
        default = SECTIONS[section].model_fields[key].default
        if default is PydanticUndefined:  # required: NAME, STORE, MODEL_NAMES
            continue
        marked = any(SAMPLE_NOTE.match(line) for line in above)
        if (getattr(getattr(settings, section), key) != default) != marked:
            wrong.append(f"[{section}] {key.upper()}: {'marked' if marked else 'unmarked'}")
    assert not wrong


def test_init_refuses_a_folder_that_is_not_empty_and_changes_nothing(tmp_path, capsys):
    folder = tmp_path / "work"
    (folder / "notes").mkdir(parents=True)
    (folder / "settings.ini").write_text("mine")
    assert main(["init", str(folder)]) == 2
    error = capsys.readouterr().err
    assert f"error: {folder} is not empty (notes/, settings.ini)" in error
    assert (folder / "settings.ini").read_text() == "mine"
    assert sorted(p.name for p in folder.rglob("*")) == ["notes", "settings.ini"]

    (tmp_path / "file").write_text("x")
    assert main(["init", str(tmp_path / "file")]) == 2
    assert f"{tmp_path / 'file'} is a file, not a folder" in capsys.readouterr().err


def test_init_fills_a_just_cloned_repository_and_refuses_an_empty_name(tmp_path, capsys):
    """A repository cloned empty holds `.git/` alone: refused as "not empty", so a new
    project could not start in it. A `.gitignore` of the user's is named, as the template
    writes one. `smpipe init "$DIR"` with DIR unset made the project in the current folder."""
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / ".DS_Store").write_text("")
    assert main(["init", str(repo)]) == 0, capsys.readouterr().err
    assert (repo / "settings.ini").exists() and (repo / ".git").is_dir()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / ".gitignore").write_text("*.log\n")
    assert main(["init", str(mine)]) == 2
    assert f"{mine} is not empty (.gitignore)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["init", ""])
    assert exit_.value.code == 2
    assert "'': an empty path (a variable not set?)" in capsys.readouterr().err


def test_init_fills_an_empty_folder_and_names_the_experiment_after_it(tmp_path, capsys):
    folder = tmp_path / "News topics (v2)"
    folder.mkdir()
    assert main(["init", str(folder)]) == 0
    assert "created project 'News-topics-v2'" in capsys.readouterr().out
    settings = load_settings(folder / "settings.ini", env={})
    assert settings.experiment.name == "News-topics-v2"
    assert settings.raw_data_uri() == str(folder / "data")
    assert settings.store_uri() == str(folder / "artifacts")


def test_version_is_the_installed_package_version(tmp_path):
    done = smpipe("--version", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (0, f"smpipe {version('smpipe')}\n")


def test_no_command_lists_every_command_and_exits_2(capsys):
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name in commands:
        assert re.search(rf"^    {name} ", err, re.MULTILINE), name
    assert "examples:\n  smpipe init my-project" in err


def test_init_names_a_link_that_leads_nowhere(tmp_path, capsys):
    """DIR a link to nothing, DIR under one, a dead link inside DIR: each named, nothing made
    (it said "`.gitignore` appeared meanwhile")."""
    broken = tmp_path / "broken"
    broken.symlink_to(tmp_path / "gone")
    for folder in (broken, broken / "project"):
        assert main(["init", str(folder)]) == 2
        error = capsys.readouterr().err
        assert (
            f"error: {broken} is a symbolic link to {tmp_path / 'gone'}, which does not exist"
            in error
        )
        assert "appeared meanwhile" not in error
    inside = tmp_path / "work"
    inside.mkdir()
    (inside / "data").symlink_to("nowhere")
    assert main(["init", str(inside)]) == 2
    assert f"{inside} is not empty (data -> nowhere, a link to nothing)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "work"]


@pytest.mark.parametrize("command", ["init", "--version", "runs"])
def test_output_to_a_closed_pipe_ends_quietly(tmp_path, command):
    """`smpipe init x | true`, `smpipe --version | true`, `smpipe runs settings.ini | head -0`:
    the reader has gone before smpipe writes; it ends with status 1 and nothing on stderr, no
    BrokenPipeError traceback (the Python docs' recipe for SIGPIPE; rich's Console, which
    `runs` prints with, follows it too)."""
    args = {"init": ["init", "x"], "--version": ["--version"], "runs": ["runs", "settings.ini"]}
    cwd = new_project(tmp_path) if command == "runs" else tmp_path
    read, write = os.pipe()
    os.close(read)  # the reader is gone before smpipe starts
    try:
        done = subprocess.run(
            [SMPIPE, *args[command]],
            cwd=cwd,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (1, "")
    if command == "init":
        assert (tmp_path / "x" / "settings.ini").exists()  # done; only its message was lost
