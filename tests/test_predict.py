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
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import cli
from pipeline.config import load_settings
from pipeline.driver import parse_steps, run_pipeline
from pipeline.errors import PipelineError
from pipeline.paths import ExperimentTree
from pipeline.predict import predict
from pipeline.predict.checks import PredictError
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
    # A line whose id cannot be read has none: its row number could be another row's id.
    assert [r["id"] for r in record["malformed_rows"]] == ["number", None, None]
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
