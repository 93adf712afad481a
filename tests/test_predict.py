"""`smpipe predict`: a run's exported model on new texts, as a processing job on the local and
the emulated backends. Two small runs of two bag-of-embeddings models on a slice of the demo
are trained once; each test feeds the test split without its labels and holds the predictions
to the inference step's, row by row."""

from __future__ import annotations

import csv
import dataclasses
import errno
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import cli
from pipeline.config import ConfigError, load_settings
from pipeline.driver import parse_steps, run_pipeline
from pipeline.errors import PipelineError
from pipeline.paths import ExperimentTree
from pipeline.predict import predict
from pipeline.predict.checks import Chosen, PredictError
from pipeline.predict.files import read_rows, write_parts
from pipeline.predict.job import predict_job
from pipeline.service_model import as_if_on_s3, refused
from pipeline.store import LocalStore, key_of
from steps.batching import read_split
from tests.conftest import ROOT, write_settings

# Two models the demo's functions build, so that a run has a winner and a loser. encode waits
# while a file HOLD names is there: a predict interrupted while its job runs is held there
# until its Ctrl-C lands, however fast the job and however loaded the machine.
FUNCTIONS = """
import os
import time

import datasets

from user_functions import encode as demo_encode
from user_functions import load_tokenizer, ordered_input_keys  # noqa: F401
from user_functions import reconcile as demo_reconcile
from user_functions.baseline import BagOfEmbeddings


def reconcile(raw_dir):
    # As many a reconcile ends: through pandas, shuffled (so from_pandas keeps the index, as
    # `__index_level_0__`), with a number encode never reads. Predict asks for neither.
    dataset, dropped = demo_reconcile(raw_dir)
    frame = dataset.to_pandas().sample(frac=1, random_state=0)
    frame["words"] = frame["text"].str.split().str.len()
    return datasets.Dataset.from_pandas(frame), dropped


def encode(batch, tokenizer, model_name, max_length):
    while os.path.exists(HOLD) and time.time() < os.path.getmtime(HOLD) + 120:
        time.sleep(0.05)
    return demo_encode(batch, tokenizer, model_name, max_length)


def load_model(model_name, id2label, label2id):
    dim = {"bow": 128, "bow32": 32}[model_name]
    return BagOfEmbeddings(load_tokenizer(model_name).vocab_size, len(id2label), dim=dim)
"""
TREE = ExperimentTree("test-exp")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Run 1: bow and bow32, every step; run 2: bow alone, trained two epochs on run 1's data.
    Its reconcile returns two columns encode never reads (FUNCTIONS)."""
    from user_functions.demo_data import write_demo

    root = tmp_path_factory.mktemp("predict")
    write_demo(root / "raw", per_label=30)
    (root / "predict_functions.py").write_text(f"HOLD = {str(root / 'hold')!r}\n" + FUNCTIONS)
    path = write_settings(
        root / "settings.ini",
        str(root / "store"),
        experiment={"USER_FUNCTIONS": "predict_functions"},
        data={"RAW_DATA": str(root / "raw")},
        models={"MODEL_NAMES": "bow, bow32"},
    )
    store = LocalStore(root / "store")
    for steps, env in ((None, {}), ("train,inference", {"SMPIPE__MODELS__MODEL_NAMES": "bow",
                                                        "SMPIPE__TRAINING__EPOCHS": "2"})):  # fmt: skip
        settings = load_settings(path, env=env)
        record = run_pipeline(settings, store, parse_steps(steps), echo=io.StringIO())
        assert record["status"] == "completed"
    encoding = json.loads(
        (root / "store" / TREE.data(1).split("labels") / "encoding.json").read_text()
    )
    snapshot = json.loads((root / "store" / TREE.data(1).snapshot_info).read_text())
    assert {"words", "__index_level_0__"} < set(snapshot["columns"])
    assert [m["reads"] for m in encoding["models"].values()] == [["text"], ["text"]]
    test = read_split(root / "store" / TREE.data(1).split("test"))
    texts = pd.DataFrame(
        {"id": test.column("id").to_pylist(), "text": test.column("text").to_pylist()}
    )
    return {"settings": path, "store": store, "root": root, "texts": texts}


def inference_of(store, run_num: int, model: str) -> pd.DataFrame:
    """What the inference step predicted for each test row (its predictions.csv)."""
    key = f"{TREE.run(run_num).inference}{model}/predictions.csv"
    return pd.read_csv(store.uri_of(key), dtype={"id": str})


def winner_of(store, run_num: int) -> str:
    record = json.loads(store.get_bytes(TREE.run(run_num).metadata))
    return record["steps"]["inference"]["details"]["comparison"]["winner"]


def assert_same_as_inference(out: pd.DataFrame, expected: pd.DataFrame) -> None:
    """Row by row: the same ids in the same order, the same label, the same confidence."""
    assert list(out["id"]) == list(expected["id"])
    assert list(out["predicted"]) == list(expected["predicted"])
    probabilities = out[[c for c in out.columns if c.startswith("probability_")]].to_numpy()
    np.testing.assert_allclose(probabilities.max(axis=1), expected["confidence"], rtol=1e-6)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)


@pytest.mark.slow
def test_csv_on_local_labels_the_test_split_as_inference_did(trained, tmp_path):
    store, texts = trained["store"], trained["texts"]
    source = tmp_path / "new_texts.csv"
    with open(source, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "text"])
        writer.writerows(texts.iloc[:4].itertuples(index=False))
        writer.writerow(["blank-1", "   "])
        writer.writerow(["too-many", "a text", "and a stray field"])
        writer.writerows(texts.iloc[4:].itertuples(index=False))
    settings = load_settings(trained["settings"], env={})
    output = tmp_path / "out.csv"
    record = predict(settings, store, source, output, echo=io.StringIO())

    # The newest completed run (2), its one model; what it came from, beside the output.
    assert (record["run"], record["model"], record["model_chosen"]) == (
        "0002",
        "bow",
        "the run's one model",
    )
    assert record["input_sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert json.loads(Path(f"{output}.json").read_text()) == record
    assert (record["rows"], record["predicted"], record["malformed"]) == (
        len(texts) + 2,
        len(texts),
        2,
    )
    assert record["malformed_rows"] == [
        {"id": "blank-1", "error": "empty text in column 'text'"},
        {"id": "too-many", "error": "line 7 has 3 fields, the header 2"},
    ]
    out = pd.read_csv(output, dtype={"id": str})
    assert list(out.columns) == record["columns"]
    bad = out["id"].isin(["blank-1", "too-many"])
    assert list(out.index[bad]) == [4, 5] and out.loc[bad, "predicted"].isna().all()
    assert_same_as_inference(out[~bad].reset_index(drop=True), inference_of(store, 2, "bow"))
    # The record stays in the run's tree; the copy of the input does not.
    prediction = key_of(store, record["predictions"]).rstrip("/") + "/"
    assert json.loads(store.get_bytes(prediction + "record.json")) == record
    assert not store.list_keys(prediction + "input/") and store.list_keys(prediction + "output/")


def test_raw_data_without_labels_goes_through_the_runs_reconcile(trained, tmp_path):
    """New articles as RAW_DATA holds them, without labels.csv: the run's own reconcile makes
    their rows (the text joined as for training), and each gets inference's prediction."""
    store, texts = trained["store"], trained["texts"]
    new = tmp_path / "new"
    (new / "articles").mkdir(parents=True)
    for article_id in texts["id"]:
        shutil.copy(trained["root"] / "raw" / "articles" / f"{article_id}.txt", new / "articles")
    (new / "articles" / "blank.txt").write_text("  \n")  # reconcile drops it, and says so
    settings = load_settings(trained["settings"], env={})
    output = tmp_path / "out.csv"
    record = predict(settings, store, new, output, echo=io.StringIO(), raw=True)
    assert (record["input_format"], record["rows"], record["predicted"]) == (
        "raw",
        len(texts),
        len(texts),
    )
    assert record["reconcile"] == {
        "dropped": {"empty_article": 1},
        "dropped_ids": {"empty_article": ["blank"]},
    }
    out = pd.read_csv(output, dtype={"id": str}).sort_values("id").reset_index(drop=True)
    expected = inference_of(store, 2, "bow").sort_values("id").reset_index(drop=True)
    assert_same_as_inference(out, expected)

    # A file is not raw data; raw data reconcile makes nothing of is said with the rule.
    with pytest.raises(
        PredictError, match=r"--raw reads a folder, as reconcile\(raw_dir\) is given one"
    ):
        predict(settings, store, few_texts(trained, tmp_path / "texts.csv"), output, raw=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.md").write_text("no articles here")
    with pytest.raises(
        PipelineError, match=r"reconcile failed on INPUT .*other: .*returned no rows\. --raw runs"
    ):
        predict(settings, store, tmp_path / "other", output, raw=True)
    # Nothing was written over: OUTPUT is still the first predict's.
    assert json.loads(Path(f"{output}.json").read_text()) == record


LEAVES_A_THREAD = """
import threading, time
import datasets

def reconcile(raw_dir):
    threading.Thread(target=time.sleep, args=(3600,)).start()  # not a daemon: never joined
    return datasets.Dataset.from_dict({"id": ["a"], "text": [(raw_dir / "a.txt").read_text()]})

# The rest of the contract, which predict --raw does not call.
from user_functions import encode, load_model, load_tokenizer, ordered_input_keys  # noqa: E402
"""


def test_a_raw_reconcile_that_leaves_a_thread_still_ends(tmp_path):
    """reconcile runs in a process of its own, which ends once its rows are written, as a job
    does, whatever threads the user's module left running."""
    from pipeline.predict.raw import reconciled

    code, raw = tmp_path / "code", tmp_path / "raw"
    shutil.copytree(ROOT / "steps", code / "steps")
    shutil.copytree(ROOT / "user_functions", code / "user_functions")
    code.joinpath("threaded.py").write_text(LEAVES_A_THREAD)
    raw.mkdir()
    raw.joinpath("a.txt").write_text("a new text")

    def hung(*_):
        raise TimeoutError("the reconcile process waited for its thread")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        rows, said = reconciled(code, "threaded", raw, tmp_path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert pq.read_table(rows).to_pylist() == [{"id": "a", "text": "a new text"}]
    assert said == {"dropped": {}, "dropped_ids": {}}


HANGS = """
import os, time

def reconcile(raw_dir):
    (raw_dir / "pid").write_text(str(os.getpid()))
    time.sleep(90)  # longer than the test, short enough that a failure of it ends

from user_functions import encode, load_model, load_tokenizer, ordered_input_keys  # noqa: E402
"""


def test_ctrl_c_during_a_raw_reconcile_ends_its_process(tmp_path):
    """Ctrl-C while the run's reconcile reads raw data: its process is gone with the command,
    not left reading."""
    from pipeline.predict.raw import reconciled

    code, raw = tmp_path / "code", tmp_path / "raw"
    shutil.copytree(ROOT / "steps", code / "steps")
    shutil.copytree(ROOT / "user_functions", code / "user_functions")
    code.joinpath("hangs.py").write_text(HANGS)
    raw.mkdir()

    def press_ctrl_c() -> None:  # once the reconcile has begun: SIGINT to this process
        deadline = time.time() + 60
        while not raw.joinpath("pid").exists() and time.time() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    # Python's own Ctrl-C, which a pytest-xdist worker has set aside.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=press_ctrl_c, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            reconciled(code, "hangs", raw, tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)
    pid = int(raw.joinpath("pid").read_text())
    time.sleep(0.2)
    # Killed: gone, or a zombie until this process reaps it (subprocess reaps on its next call).
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.slow
def test_emulated_parquet_input_is_run_1s_winner_by_default(trained, tmp_path):
    """`smpipe predict` as a user types it, on the emulated backend: the SageMaker request
    sent to moto, the job played as SageMaker runs the image. No id column: rows are numbered."""
    store, texts = trained["store"], trained["texts"]
    source, output = tmp_path / "texts.parquet", tmp_path / "out.jsonl"
    pq.write_table(pa.table({"text": texts["text"].tolist()}), source)
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "predict", str(trained["settings"]), str(source),
         str(output), "--run", "1", "--backend", "emulated"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(Path(f"{output}.json").read_text())
    winner = winner_of(store, 1)
    assert (record["run"], record["model"], record["backend"]) == ("0001", winner, "emulated")
    assert record["model_chosen"] == "the winner by test macro-F1"
    out = pd.read_json(output, lines=True, dtype={"id": str})
    assert list(out["id"]) == [str(i) for i in range(len(texts))]
    out["id"] = texts["id"]
    assert_same_as_inference(out, inference_of(store, 1, winner))


@pytest.mark.slow
def test_jsonl_with_run_and_model_reports_malformed_lines(trained, tmp_path):
    store, texts = trained["store"], trained["texts"]
    loser = ({"bow", "bow32"} - {winner_of(store, 1)}).pop()
    source = tmp_path / "texts.jsonl"
    # A column encode never read, given anyway as a number and as nothing, is passed over.
    lines = [json.dumps({"id": i, "text": t, "words": [None, 3][n % 2]})
             for n, (i, t) in enumerate(texts.itertuples(index=False))]  # fmt: skip
    lines[2:2] = ['{"id": "number", "text": 12}', "not json", "", '["a list"]']
    source.write_text("\n".join(lines) + "\n")
    settings = load_settings(trained["settings"], env={})
    output = tmp_path / "out.parquet"
    record = predict(settings, store, source, output, run_num=1, model=loser, echo=io.StringIO())
    assert (record["run"], record["model"], record["model_chosen"]) == (
        "0001",
        loser,
        "named with --model",
    )
    assert [r["error"] for r in record["malformed_rows"]] == [
        "line 3: 'text' is a number, not text",
        "line 4 is not JSON (Expecting value: line 1 column 1 (char 0))",
        "line 6 is a JSON array, not an object",
    ]
    assert [r["id"] for r in record["malformed_rows"]] == ["number", "3", "4"]  # no id: row number
    out = pq.read_table(output).to_pandas()
    assert_same_as_inference(
        out[out["error"].isna()].reset_index(drop=True), inference_of(store, 1, loser)
    )
    # No row that can be predicted: OUTPUT says why for each, and the command exits 1.
    (tmp_path / "bad.jsonl").write_text('{"text": 1}\n{"text": "  "}\n')
    assert cli_predict(trained, str(tmp_path / "bad.jsonl"), str(tmp_path / "bad.csv")) == 1
    assert list(pd.read_csv(tmp_path / "bad.csv")["error"]) == [
        "line 1: 'text' is a number, not text",
        "empty text in column 'text'",
    ]


@pytest.mark.slow
def test_every_problem_is_said_before_anything_runs(trained, tmp_path, capsys):
    store = trained["store"]
    settings = load_settings(trained["settings"], env={})
    before = store.list_keys("test-exp/runs/")
    with pytest.raises(PredictError) as raised:
        predict(settings, store, tmp_path / "missing.csv", tmp_path / "out.xlsx", run_num=9)
    said = str(raised.value)
    assert (
        "3 problem(s)" in said
        and "--run 9: no run 0009 of 'test-exp'" in said
        and "(runs 0001-0002)" in said
    )
    assert f"INPUT {tmp_path / 'missing.csv'} does not exist" in said
    assert "OUTPUT" in said and "told by the suffix" in said
    # A model the run did not train; a CSV without the text column: the rule is named.
    source = tmp_path / "wrong.csv"
    source.write_text("id,body\n1,some text\n")
    with pytest.raises(PredictError) as raised:
        predict(settings, store, source, tmp_path / "out.csv", run_num=2, model="bow32")
    said = str(raised.value)
    assert "--model bow32: run 0002 trained no model 'bow32' (its models: bow)" in said
    with pytest.raises(
        PredictError,
        match=r"has no column 'text' \(it has \['id', 'body'\]\): predict gives the run's encode the columns it read of the run's data \(text\)",
    ):
        predict(settings, store, source, tmp_path / "out.csv")  # fmt: skip
    # The command says so, and exits 2, as for settings that are wrong.
    handler = signal.getsignal(signal.SIGTERM)
    try:
        code = cli.main(
            [
                "predict",
                str(trained["settings"]),
                str(source),
                str(tmp_path / "out.csv"),
                "--model",
                "nope",
            ]
        )
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert code == 2 and "--model nope: run 0002 trained no model 'nope'" in capsys.readouterr().err
    assert store.list_keys("test-exp/runs/") == before  # nothing uploaded, nothing run


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "emulated"])
def test_two_instances_each_predict_their_share(trained, tmp_path, monkeypatch, backend, request):
    """INSTANCE_COUNT 2: the parts are dealt out by S3 key, each instance predicts its own
    (both say so in the job's log), and OUTPUT is whole and the inference step's, in order."""
    from pipeline.predict import files as predict_files

    store = trained["store"]
    if backend == "emulated":  # the requests go to moto; the store stays the local folder
        from pipeline.backends.emulated import S3View

        request.getfixturevalue("aws_env")
        store = S3View(store)

    texts = trained["texts"]
    monkeypatch.setattr(predict_files, "PART_ROWS", 4)  # parts of 4 rows: several to share
    source, output, echo = tmp_path / "texts.csv", tmp_path / "out.csv", io.StringIO()
    texts.to_csv(source, index=False)
    env = {"SMPIPE__EXPERIMENT__BACKEND": backend}
    settings = load_settings(trained["settings"], env=env)
    record = predict(settings, store, source, output, run_num=2, instance_count=2, echo=echo)
    assert (record["instance_count"], record["rows"], record["predicted"]) == (
        2,
        len(texts),
        len(texts),
    )
    expected = inference_of(trained["store"], 2, "bow")
    assert_same_as_inference(pd.read_csv(output, dtype={"id": str}), expected)
    said = read_job_log(trained["store"], record) if backend == "emulated" else echo.getvalue()
    shares = {
        host: int(rows.replace(",", ""))
        for host, rows in re.findall(r"(algo-[12])\S*\s.*?predicting ([\d,]+) rows", said)
    }
    assert set(shares) == {"algo-1", "algo-2"} and sum(shares.values()) == len(texts), said
    # What the job cost, as a run's jobs: two instances billed on emulated, CPU-seconds locally.
    spent = record["cost"]
    if backend == "emulated":
        [job] = spent["jobs"]
        assert (job["use"], job["instance_count"]) == ("processing", 2)
        assert spent["billable_instance_seconds"] == 2 * job["billable_seconds"] >= 2
    else:
        assert spent["measure"] == "CPU-seconds" and spent["cpu_seconds"] > 0


def read_job_log(store, record) -> str:
    """The predict job's log as the run's tree keeps it (every instance's stream)."""
    return store.get_bytes(TREE.run(int(record["run"])).log(record["job_name"])).decode()


def test_the_texts_are_sharded_across_instances_by_s3_key(tmp_path):
    """Each instance gets about 1/n of the parts (ShardedByS3Key); the model and the labels
    go whole to every one; SageMaker's limit of 100 instances is checked before anything."""
    from pipeline.backend import LOCAL_IMAGE, LOCAL_ROLE
    from pipeline.jobs import processing_request
    from pipeline.plan import check_requests

    store = LocalStore(tmp_path / "store")
    settings = load_settings(
        write_settings(tmp_path / "settings.ini", str(tmp_path / "store")), env={}
    )
    run = TREE.run(1)
    model = run.final_model("bow")
    chosen = Chosen(run, "bow", "", model, 1, TREE.data(1), None, ["text"], "user_functions")
    prediction = run.prediction("p")
    request = processing_request(
        predict_job(settings, chosen, prediction, 3), LOCAL_IMAGE, LOCAL_ROLE, store.uri_of
    )
    assert request["ProcessingResources"]["ClusterConfig"]["InstanceCount"] == 3
    distribution = {
        i["InputName"]: i["S3Input"]["S3DataDistributionType"] for i in request["ProcessingInputs"]
    }
    assert distribution == {"code": "FullyReplicated", "texts": "ShardedByS3Key",
                            "model": "FullyReplicated", "labels": "FullyReplicated"}  # fmt: skip
    assert refused("CreateProcessingJob", as_if_on_s3(request)) == []
    with pytest.raises(ConfigError, match="InstanceCount"):
        check_requests([predict_job(settings, chosen, prediction, 101)], settings, store)


def test_inputs_are_read_as_datasets_reads_them(tmp_path):
    """Every format a row at a time: ids kept or numbered, a row that cannot be read kept in
    its place with the reason."""
    csv_file = tmp_path / "t.csv"
    # A byte order mark, a quoted line break, a blank line, Latin-1 bytes, an empty text, a stray field.
    csv_file.write_bytes(b'\xef\xbb\xbfid,text\n1,"two\nlines"\n\n2,caf\xe9\n3,\n4,ok,extra\n')
    rows = list(read_rows(csv_file, "csv", ["text"]))
    assert [(r["id"], r["text"], r["error"]) for r in rows] == [
        ("1", "two\nlines", None), ("2", None, "line 5 is not UTF-8"), ("3", "", None),
        ("4", "ok", "line 7 has 3 fields, the header 2")]  # fmt: skip

    folder = tmp_path / "docs"
    (folder / "a").mkdir(parents=True)
    (folder / "a" / "x.txt").write_bytes(b"first\r\nsecond")
    (folder / "b.txt").write_bytes(b"\xff\xfe")
    (folder / ".hidden.txt").write_text("skipped")
    (folder / "labels.csv").write_text("skipped")
    rows = list(read_rows(folder, "folder", ["text"]))
    assert [(r["id"], r.get("text"), r["error"]) for r in rows] == [
        ("a/x", "first\nsecond", None), ("b", None, "b.txt is not UTF-8")]  # fmt: skip

    parquet = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": [7, 8], "text": ["a", None], "other": [1, 2]}), parquet)
    rows = list(read_rows(parquet, "parquet", ["text"]))
    assert [(r["id"], r["text"], r["error"]) for r in rows] == [("7", "a", None), ("8", None, None)]

    parts = tmp_path / "parts"
    parts.mkdir()
    assert write_parts(iter([{"id": None, "error": None, "text": "x"}] * 3), parts, ["text"]) == [3]
    table = pq.read_table(parts / "part-00000.parquet")
    assert table.column("row").to_pylist() == [0, 1, 2] and table.column("id").to_pylist() == [
        "0",
        "1",
        "2",
    ]


def test_a_byte_order_mark_is_skipped_in_json_lines_as_in_csv(tmp_path):
    """A UTF-8 BOM (Excel's, Notepad's) before the first JSON object: the first row is read
    with its own id, as datasets' json loader reads it and as a CSV's is, and its columns and
    the one-document check see past it; a later line not UTF-8 still costs its row only."""
    from pipeline.predict.checks import check_files

    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(
        b'\xef\xbb\xbf{"id": "j1", "text": "one"}\r\n\n{"id": "j2", "text": "two"}\n'
        b'{"text": "caf\xe9"}\n'
    )
    rows = list(read_rows(jsonl, "jsonl", ["text"]))
    assert [(r["id"], r["text"], r["error"]) for r in rows] == [
        ("j1", "one", None), ("j2", "two", None), (None, None, "line 4 is not UTF-8")]  # fmt: skip
    assert check_files(jsonl, tmp_path / "out.csv", ["text"])[2] == []
    document = tmp_path / "doc.jsonl"
    document.write_bytes(b'\xef\xbb\xbf[{"text": "one"}]\n')
    [problem] = check_files(document, tmp_path / "out.csv", ["text"])[2]
    assert "is one JSON document; predict reads JSON Lines" in problem, problem


def test_a_column_encode_read_as_a_number_is_given_as_one_from_every_format(tmp_path):
    """`n`, a column of whole numbers in the run's data that its encode read (encoding.json's
    kinds): a number from JSON Lines and Parquet, its text from CSV; a blank is a missing
    value (the job says so), anything else refused with the reason, in its row."""
    from pipeline.predict.checks import check_columns
    from steps.predict import encode_rows

    kinds = {"n": "int"}
    csv_file = tmp_path / "t.csv"
    csv_file.write_text("id,text,n\na,x,3\nb,y,3.0\nc,z,\nd,w,many\ne,v,2.5\n")
    rows = list(read_rows(csv_file, "csv", ["text", "n"], kinds))
    assert [(r["n"], r["error"]) for r in rows] == [
        (3, None), (3, None), (None, None), (None, "'n' is 'many', not a number"),
        (None, "'n' is '2.5', not a whole number")]  # fmt: skip
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"text": "x", "n": 3}\n{"text": "y", "n": "4"}\n{"text": "z", "n": true}\n')
    assert [(r["n"], r["error"]) for r in read_rows(jsonl, "jsonl", ["text", "n"], kinds)] == [
        (3, None), (4, None), (None, "'n' is True, not a number")]  # fmt: skip
    parquet = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["x", "y"], "n": [1, None]}), parquet)
    assert [r["n"] for r in read_rows(parquet, "parquet", ["text", "n"], kinds)] == [1, None]
    assert check_columns(parquet, "parquet", ["text", "n"], kinds) == []
    pq.write_table(pa.table({"text": ["x"], "n": [[1]]}), parquet)
    assert check_columns(parquet, "parquet", ["text", "n"], kinds) == [
        f"INPUT {parquet}: column 'n' holds list<element: int64>, where the run's data held int"
    ]
    # The job's parts hold them as numbers; a row without one gets no prediction.
    parts = tmp_path / "parts"
    parts.mkdir()
    write_parts(iter(rows), parts, ["text", "n"], kinds=kinds)
    table = pq.read_table(parts / "part-00000.parquet")
    assert table.schema.field("n").type == pa.int64() and table.column("n")[0].as_py() == 3
    encoder = Refusing()
    encoder.kinds = kinds
    _, good, errors = encode_rows(encoder, table.to_pylist(), ["text", "n"])
    assert good == [0, 1] and errors[2] == "no value in column 'n'"


class Refusing:
    """An encode that refuses any text holding "boom" (or every text), as a user's may."""

    name, keys, kinds = "m", ["input_ids"], {}

    def __init__(self, everything: bool = False):
        self.everything = everything

    def __call__(self, batch):
        if self.everything or any("boom" in t for t in batch["text"]):
            raise ValueError("user function predict_functions.encode raised ValueError: boom")
        return {"input_ids": pa.array([[1, 2]] * len(batch["id"]))}, [2] * len(batch["id"])


def test_a_text_encode_refuses_costs_its_row_only():
    from steps.predict import encode_rows

    def row(i, text, error=None):
        return {"row": i, "id": f"r{i}", "error": error, "text": text}

    rows = [
        row(0, "fine"),
        row(1, "boom"),
        row(2, " "),
        row(3, None, "line 5 is not UTF-8"),
        row(4, "ok"),
    ]
    table, good, errors = encode_rows(Refusing(), rows, ["text"])
    assert (
        good == [0, 4] and table.num_rows == 2 and table.column("m__length").to_pylist() == [2, 2]
    )
    assert errors == {1: "user function predict_functions.encode raised ValueError: boom",
                      2: "empty text in column 'text'", 3: "line 5 is not UTF-8"}  # fmt: skip
    assert encode_rows(Refusing(), rows[2:4], ["text"])[:2] == (
        None,
        [],
    )  # a part of malformed rows
    with pytest.raises(
        ValueError, match="boom"
    ):  # refusing every text: encode is wrong, not the data
        encode_rows(Refusing(everything=True), rows, ["text"])


# -- hostile use: every file predict writes checked before the job, a failure after
# it one line that leaves OUTPUT and its record as they were, nothing left behind but a log
# and a record saying so, long texts cut before encode as prepare would cut them ------------


def store_for(trained, backend: str, request):
    """The trained store as `backend` sees it (emulated: the local folder seen as a bucket)."""
    if backend == "local":
        return trained["store"]
    from pipeline.backends.emulated import S3View

    request.getfixturevalue("aws_env")
    return S3View(trained["store"])


def few_texts(trained, path: Path, rows: int = 6) -> Path:
    trained["texts"].iloc[:rows].to_csv(path, index=False)
    return path


def predictions_left(store, run_num: int = 2) -> dict[str, list[str]]:
    """Each predict's folder in the run's tree, and what it holds."""
    prefix = TREE.run(run_num).prefix + "predictions/"
    held: dict[str, list[str]] = {}
    for key in store.list_keys(prefix):
        label, rest = key[len(prefix) :].split("/", 1)
        held.setdefault(label, []).append(rest)
    return held


def cli_predict(trained, *args: str) -> int:
    handler = signal.getsignal(signal.SIGTERM)  # predict_command sets its own
    try:
        return cli.main(["predict", str(trained["settings"]), *args])
    finally:
        signal.signal(signal.SIGTERM, handler)


@pytest.mark.slow
def test_predict_never_writes_over_its_input_or_a_file_it_did_not_make(trained, tmp_path, capsys):
    """`smpipe predict S texts.csv.json texts.csv`: the record OUTPUT.json would be INPUT.
    Refused before anything runs (exit 2), as is an OUTPUT.json or an OUTPUT of the user's;
    their bytes and the run's tree are as they were."""
    store = trained["store"]
    before = store.list_keys("test-exp/runs/")
    source = tmp_path / "texts.csv.json"  # JSON Lines, as .json is read
    source.write_text('{"id": "a", "text": "Shares rallied after the results"}\n')
    kept = source.read_bytes()
    assert cli_predict(trained, str(source), str(tmp_path / "texts.csv")) == 2
    said = capsys.readouterr().err
    assert f"OUTPUT.json {source} is INPUT: predictions never overwrite their texts" in said
    settings = load_settings(trained["settings"], env={})
    notes = tmp_path / "out.csv.json"
    notes.write_text('{"my": "notes"}\n')
    why = f"OUTPUT.json {notes} exists and is not predict's record of {tmp_path / 'out.csv'}"
    with pytest.raises(PredictError, match=re.escape(why)):
        predict(settings, store, source, tmp_path / "out.csv")
    mine = tmp_path / "mine.csv"
    mine.write_text("id,label\n1,sport\n")
    why = f"OUTPUT {mine} exists and no mine.csv.json beside it says predict wrote it"
    with pytest.raises(PredictError, match=re.escape(why)):
        predict(settings, store, source, mine)
    assert source.read_bytes() == kept and notes.read_text() == '{"my": "notes"}\n'
    assert mine.read_text() == "id,label\n1,sport\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "mine.csv",
        "out.csv.json",
        "texts.csv.json",
    ]
    assert store.list_keys("test-exp/runs/") == before  # nothing uploaded, nothing run


@pytest.mark.slow
def test_outputs_that_cannot_be_written_are_refused_before_the_job(trained, tmp_path, capsys):
    """OUTPUT under /proc, OUTPUT.json a folder, OUTPUT a link or inside an INPUT folder, a
    read-only folder: each is a problem listed before anything runs, with the others (exit 2,
    PredictError), not an OSError traceback after the job."""
    store = trained["store"]
    before = store.list_keys("test-exp/runs/")
    source = few_texts(trained, tmp_path / "texts.csv")
    # Two problems at once, and one of the run: every one is said.
    (tmp_path / "out.csv.json").mkdir()
    assert cli_predict(trained, str(source), str(tmp_path / "out.csv"), "--model", "nope") == 2
    said = capsys.readouterr().err
    assert "2 problem(s)" in said
    assert "--model nope: run 0002 trained no model 'nope'" in said
    assert f"OUTPUT.json {tmp_path / 'out.csv.json'} is a folder" in said
    settings = load_settings(trained["settings"], env={})

    def refused(output: Path, why: str) -> None:
        with pytest.raises(PredictError, match=re.escape(why)):
            predict(settings, store, source, output)

    refused(Path("/proc/out.csv"), "OUTPUT /proc/out.csv: its folder /proc cannot be written")
    folder = tmp_path / "articles"
    folder.mkdir()
    (folder / "a.txt").write_text("Shares rallied after the results")
    with pytest.raises(PredictError, match=re.escape(f"is inside the INPUT folder {folder}")):
        predict(settings, store, folder, folder / "out.csv")
    (tmp_path / "link.csv").symlink_to(tmp_path / "elsewhere.csv")
    refused(tmp_path / "link.csv", f"OUTPUT {tmp_path / 'link.csv'} is a symbolic link")
    (tmp_path / "out.dir.csv").mkdir()
    refused(
        tmp_path / "out.dir.csv",
        f"OUTPUT {tmp_path / 'out.dir.csv'} is a folder: predict writes one file",
    )
    if os.geteuid() != 0:  # root writes into a folder of mode 0555 all the same
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        refused(locked / "out.csv", f"its folder {locked} cannot be written")
    assert store.list_keys("test-exp/runs/") == before  # nothing uploaded, nothing run
    assert not list(Path("/proc").glob(".out.csv.*"))


class Sabotaged:
    """The configured backend, with `after(job)` done once its job has ended (the driver then
    writes OUTPUT), or with the job changed by `job(job)` before it runs."""

    def __init__(self, after=None, job=None):
        self.after, self.change = after, job

    def __call__(self, settings, store, run, echo):
        from pipeline.backends.choose import make_backend

        backend = make_backend(settings, store, run, echo)
        real = backend.run_processing

        def run_processing(job):
            result = real(self.change(job) if self.change else job)
            if self.after:
                self.after(job)
            return result

        backend.run_processing = run_processing
        return backend


@pytest.mark.slow
def test_a_rerun_replaces_its_own_output_and_a_failed_write_changes_nothing(
    trained, tmp_path, monkeypatch
):
    """A rerun into the same OUTPUT replaces OUTPUT and OUTPUT.json (both predict's, OUTPUT's
    sha256 the one recorded); an OUTPUT edited since is the user's, and so is an OUTPUT.json
    made during the job (checked again before writing). A write that fails after the job is
    one line naming the file; OUTPUT and its record are as they were, no temporary stays, and
    the run's tree keeps only the job's log and a record that says the predict failed. Files
    on this machine only: the backend plays no part (the emulated one's, see the next test)."""
    store = trained["store"]
    settings = load_settings(trained["settings"], env={})
    source, output = few_texts(trained, tmp_path / "texts.csv"), tmp_path / "out.csv"
    record = tmp_path / "out.csv.json"
    predict(settings, store, source, output, echo=io.StringIO())
    second = predict(settings, store, source, output, echo=io.StringIO())
    assert json.loads(record.read_text()) == second and second["status"] == "completed"
    assert second["output_sha256"] == hashlib.sha256(output.read_bytes()).hexdigest()
    predicted, recorded = output.read_bytes(), record.read_bytes()

    output.write_bytes(predicted + b"my,correction\n")
    why = f"OUTPUT {output} was changed since predict wrote it"
    with pytest.raises(PredictError, match=re.escape(why)):
        predict(settings, store, source, output)
    output.write_bytes(predicted)

    def notes_appear(job) -> None:  # during the job, the user writes OUTPUT.json of their own
        (tmp_path / "other.csv.json").write_text("my notes")

    with pytest.raises(PipelineError, match="other.csv was not written, since the job began"):
        predict(
            settings,
            store,
            source,
            tmp_path / "other.csv",
            echo=io.StringIO(),
            make_backend=Sabotaged(after=notes_appear),
        )
    assert (tmp_path / "other.csv.json").read_text() == "my notes"

    real = os.replace

    def rename_fails(job) -> None:  # after the job, renaming onto OUTPUT fails (a disk error)
        def replace(source, target):
            if Path(target) == output:
                raise OSError(errno.EIO, "Input/output error", str(source), None, str(target))
            real(source, target)

        monkeypatch.setattr(os, "replace", replace)

    left = set(predictions_left(trained["store"]))
    with pytest.raises(PipelineError) as raised:
        sabotaged = Sabotaged(after=rename_fails)
        predict(settings, store, source, output, echo=io.StringIO(), make_backend=sabotaged)
    monkeypatch.setattr(os, "replace", real)
    said = str(raised.value)
    assert "\n" not in said and f"cannot put {output} in place (Input/output error)" in said
    assert output.read_bytes() == predicted and record.read_bytes() == recorded  # as they were
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "other.csv.json",
        "out.csv",
        "out.csv.json",
        "texts.csv",
    ]
    [label] = set(predictions_left(trained["store"])) - left
    assert predictions_left(trained["store"])[label] == ["record.json"]
    failed = json.loads(store.get_bytes(TREE.run(2).prediction(label).record))
    assert failed["status"] == "failed" and f"cannot put {output} in place" in failed["reason"]
    assert store.exists(key_of(store, failed["job_log"]))


class InterruptOnce:
    """An echo that presses Ctrl-C (SIGINT to this process) once the job says it predicts."""

    def __init__(self):
        self.text, self.sent = "", False

    def write(self, text: str) -> int:
        self.text += text
        if not self.sent and re.search(r"predicting [\d,]+ rows", self.text):
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "emulated"])
@pytest.mark.parametrize("how", ["failed", "interrupted"])
def test_a_failed_or_interrupted_predict_leaves_only_its_log_and_a_record(
    trained, tmp_path, backend, how, request
):
    """A predict whose job fails (its arguments refused) or that is interrupted while its job
    runs (Ctrl-C) leaves no OUTPUT, no OUTPUT.json, no temporary; in the run's tree no code,
    texts or parts of predictions: the job's log, and a record that says what happened and
    where that log is."""
    store = store_for(trained, backend, request)
    settings = load_settings(trained["settings"], env={"SMPIPE__EXPERIMENT__BACKEND": backend})
    source, output = few_texts(trained, tmp_path / "texts.csv"), tmp_path / "out.csv"
    left = set(predictions_left(trained["store"]))
    if how == "failed":
        wrong = Sabotaged(  # a format the step refuses (argparse: exit 2)
            job=lambda job: dataclasses.replace(
                job, arguments=[*job.arguments, "--model-format", "onnx"]
            )
        )
        with pytest.raises(PipelineError, match="predict failed in job"):
            predict(settings, store, source, output, echo=io.StringIO(), make_backend=wrong)
    else:
        # The job waits in encode (FUNCTIONS' HOLD) until Ctrl-C stops it: its line reaches
        # the driver late through CloudWatch's polling on emulated, later still under load.
        hold = trained["settings"].parent / "hold"
        hold.touch()
        # Ctrl-C as a terminal's finds this process: a suite started in the background by a
        # shell without job control inherits SIGINT ignored (test_lifecycle.as_from_a_terminal).
        ignored = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            with pytest.raises(KeyboardInterrupt):
                predict(settings, store, source, output, echo=InterruptOnce())
        finally:
            signal.signal(signal.SIGINT, ignored)
            hold.unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["texts.csv"]
    [label] = set(predictions_left(trained["store"])) - left
    assert predictions_left(trained["store"])[label] == ["record.json"]
    record = json.loads(store.get_bytes(TREE.run(2).prediction(label).record))
    assert record["status"] == how and "model_artifact" not in record
    assert store.get_bytes(key_of(store, record["job_log"]))  # the log is where it says


def test_predict_truncates_long_texts_before_encode_as_prepare_does():
    """One text of 300,000 characters with MAX_SEQUENCE_LENGTH 32: the user's encode is never
    given more than twice prepare's budget (clip_limits' two probes; 4,096 characters at 32
    tokens), so memory does not grow with a text, and it returns what the whole text gives."""
    import user_functions
    from steps.predict import Encoder, encode_rows
    from steps.prepare import BUDGET_FLOOR, CHARS_PER_TOKEN
    from steps.user_code import load_user_functions

    given: list[int] = []

    def encode(batch, tokenizer, model_name, max_length):
        given.append(max(len(t) for t in batch["text"]))
        return user_functions.encode(batch, tokenizer, model_name, max_length)

    functions = dataclasses.replace(load_user_functions("user_functions"), encode=encode)
    tokenizer = user_functions.load_tokenizer("bow")
    encoder = Encoder(functions, tokenizer, "bow", ["input_ids", "attention_mask"], 32, "encode")
    long = ("Shares rallied after the results, and the market followed. " * 5000)[:300_000]
    rows = [
        {"row": 0, "id": "long", "error": None, "text": long},
        {"row": 1, "id": "short", "error": None, "text": "Shares rallied"},
    ]
    table, good, errors = encode_rows(encoder, rows, ["text"])
    assert good == [0, 1] and not errors
    assert max(given) <= 2 * max(BUDGET_FLOOR, CHARS_PER_TOKEN * 32), given
    whole = user_functions.encode({"text": [long]}, tokenizer, "bow", 32)["input_ids"][0]
    assert table.column("bow_input_ids").to_pylist()[0] == whole
    assert table.column("bow__length").to_pylist()[0] == 32


def test_an_encode_that_does_not_cut_at_max_length_is_named_for_the_rows_it_makes_too_long():
    """An encode that truncates at a length of its own, 512 tokens, not at MAX_SEQUENCE_LENGTH:
    a run whose rows were all short passed prepare; predict then says what prepare would have
    said, for each longer row, and predicts the rest."""
    import user_functions
    from steps.predict import Encoder, encode_rows
    from steps.user_code import load_user_functions

    def encode(batch, tokenizer, model_name, max_length):
        return tokenizer(batch["text"], truncation=True, max_length=512)

    functions = dataclasses.replace(load_user_functions("user_functions"), encode=encode)
    tokenizer = user_functions.load_tokenizer("bow")
    where = "user_functions.encode (model 'bow')"
    encoder = Encoder(functions, tokenizer, "bow", ["input_ids", "attention_mask"], 32, where)
    rows = [
        {"row": 0, "id": "long", "error": None, "text": "Shares rallied again. " * 100},
        {"row": 1, "id": "short", "error": None, "text": "Shares rallied"},
    ]
    table, good, errors = encode_rows(encoder, rows, ["text"])
    assert good == [1] and table.column("bow__length").to_pylist() == [4]
    assert list(errors) == [0] and re.fullmatch(
        re.escape(where) + r" returned rows of up to [0-9]{3} tokens; MAX_SEQUENCE_LENGTH is 32 "
        r"\(pass truncation=True, max_length=max_length to the tokenizer\)",
        errors[0],
    ), errors


def test_long_texts_make_smaller_parts(tmp_path, monkeypatch):
    """Parts end at PART_CHARS characters of text as well as at PART_ROWS rows: the driver and
    the job hold a part at a time, so a thousand long texts never share one."""
    from pipeline.predict import files as predict_files

    monkeypatch.setattr(predict_files, "PART_CHARS", 2500)
    rows = [{"id": None, "error": None, "text": "x" * 1000} for _ in range(5)]
    rows.insert(2, {"id": None, "error": None, "text": "y" * 6000})  # longer than a part
    assert write_parts(iter(rows), tmp_path, ["text"]) == [2, 1, 2, 1]
    table = pq.read_table(tmp_path / "part-00001.parquet")
    assert table.column("row").to_pylist() == [2]


def test_input_that_cannot_be_read_at_all_is_one_line(tmp_path):
    """An empty file, one of blank lines, UTF-16, NUL bytes, a first line that is not UTF-8,
    an empty Parquet file: each one clear line before anything runs. A later row that is not
    UTF-8 costs its row only (test_inputs_are_read_as_datasets_reads_them)."""
    from pipeline.predict.checks import check_files

    files = {
        "empty.csv": b"",
        "blank.jsonl": b"\n  \n\n",
        "utf16.csv": "id,text\n1,caf\u00e9\n".encode("utf-16"),
        "nul.tsv": b"i\x00d\x00\t\x00t\x00e\x00x\x00t\x00\n\x00",
        "latin1.jsonl": '{"text": "caf\u00e9"}\n'.encode("latin-1"),
    }
    expected = {
        "empty.csv": "is empty: it holds no rows",
        "blank.jsonl": "is empty: it holds no lines",
        "utf16.csv": "is UTF-16 (it starts with a UTF-16 byte order mark): predict reads UTF-8",
        "nul.tsv": "holds NUL bytes in its first line",
        "latin1.jsonl": "its first line is not UTF-8 (byte 0xe9)",
        "empty.parquet": "is empty: it holds no rows",
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    expected["doc.jsonl"] = "is one JSON document"  # refused from its first character
    (tmp_path / "doc.jsonl").write_text('[{"text": "' + "x" * 100_000 + '"}]')
    for name, why in expected.items():
        [problem] = check_files(tmp_path / name, tmp_path / "out.csv", ["text"])[2]
        assert problem.startswith(f"INPUT {tmp_path / name}") and why in problem, problem
