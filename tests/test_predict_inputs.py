"""What `smpipe predict` reads, without a trained run: INPUT in each format datasets reads
(a byte order mark skipped, a number column given as a number), texts cut before encode as
prepare cuts them and dealt to instances by S3 key, an encode that refuses a text costing that
row only, and raw data through the run's reconcile (a reconcile that leaves a thread, or hangs
until Ctrl-C, still ends)."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import ConfigError, load_settings
from pipeline.paths import ExperimentTree
from pipeline.predict.checks import Chosen
from pipeline.predict.files import read_rows, write_parts
from pipeline.predict.job import predict_job
from pipeline.service_model import as_if_on_s3, refused
from pipeline.store import LocalStore
from tests.conftest import ROOT, write_settings

TREE = ExperimentTree("test-exp")


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

    # A quote left open to the end: not CSV (the csv module joined every line after it into
    # one text, and the row count fell short); its row named by the line the quote opened on.
    # Text after a closing quote is read as pandas and datasets read it.
    csv_file.write_bytes(b'id,text\n1,"a ""q"" b"\n2,"bad"x\n3,"sic" \n4,"open\n5,never read\n')
    rows = list(read_rows(csv_file, "csv", ["text"]))
    assert [(r["id"], r["text"], r["error"]) for r in rows] == [
        ("1", 'a "q" b', None), ("2", "badx", None), ("3", "sic ", None),
        ("4", None, "line 5 is not CSV (a quote opened there is never closed)")]  # fmt: skip
    forgiven = io.StringIO('id,text\n2,"bad"x\n3,"sic" \n')
    assert pd.read_csv(forgiven)["text"].tolist() == ["badx", "sic "]  # as pandas reads them

    parts = tmp_path / "parts"
    parts.mkdir()
    assert write_parts(iter([{"id": None, "error": None, "text": "x"}] * 3), parts, ["text"]) == [3]
    table = pq.read_table(parts / "part-00000.parquet")
    assert table.column("row").to_pylist() == [0, 1, 2] and table.column("id").to_pylist() == [
        "0",
        "1",
        "2",
    ]
    # A row that could not be read, its id unread: none, not a number that may be another
    # row's id.
    named = [{"id": "1", "error": None, "text": "x"}, {"id": None, "error": "line 3", "text": None}]
    write_parts(iter(named), parts, ["text"])
    ids = pq.read_table(parts / "part-00000.parquet").column("id").to_pylist()
    assert ids == ["1", None]


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
