"""Predict (processing job, `smpipe predict`): one run's exported model on new texts.

Texts are encoded as prepare encoded the run's data and run through the inference step's
program and batching, so the same texts get the inference step's predictions. Parts are read,
encoded, predicted and written one at a time: memory grows neither with the input nor with a text.

Inputs:  texts        parquet parts from the driver: `row`, `id`, `error`, the text columns
                      (several instances: a shard of the parts each, ShardedByS3Key)
         model        the model's folder (smpipe.json, the export MODEL_FORMAT names)
         labels       the prepared data's labels/ (inputs.json, encoding.json)
Outputs: predictions  a part per part: `row`, `id`, `predicted`, `probability_<label>`, `error`
"""

from __future__ import annotations

import argparse
import os
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from steps.arguments import PREDICT, parse
from steps.batching import Batches, length_column, read_inputs
from steps.inference import load_program, run_batches
from steps.model_files import RECORD, read_record
from steps.precision import Precision, resolve
from steps.prepare import check_cut, clip_limits, encode_cut
from steps.prepared_files import capped, other_tokenizer, read_encoding, recorded_kinds
from steps.runtime import names
from steps.runtime.environment import processing_input, processing_output
from steps.runtime.step import run_step
from steps.user_code import UserFunctions, call, load_user_functions

PROBABILITY = "probability_"  # + a label: that label's probability


def parse_args() -> argparse.Namespace:
    return parse(PREDICT)


def model_folder() -> Path:
    """The model input, unpacked where it is a SageMaker training output kept as its tarball
    (as steps/inference.py reads one)."""
    path = processing_input("model")
    archive = path / "model.tar.gz"
    if archive.exists() and not (path / RECORD).exists():
        with tarfile.open(archive) as tar:
            tar.extractall(path, filter="data")
    return path


@dataclass
class Encoder:
    """The user's encode of one model, as prepare called it for the run's data (the run's own
    `load_tokenizer` and `encode`, at the length encoding.json records): texts cut before
    encode at the very length prepare would (steps/prepare.py `clip_limits`, `encode_cut`), so
    that memory does not grow with a text."""

    functions: UserFunctions
    tokenizer: object
    name: str
    keys: list[str]
    max_length: int
    where: str
    kinds: dict[str, str] = field(default_factory=dict)  # the columns read that are not text
    said: set[str] = field(default_factory=set)  # the columns whose cut the log has told

    def encode(self, batch: dict[str, list]):
        return call(self.functions, "encode", batch, self.tokenizer, self.name, self.max_length)

    def __call__(self, batch: dict[str, list]) -> tuple[dict[str, pa.Array], list[int]]:
        """A batch encoded and checked as prepare encodes its data (steps/prepare.py): each text
        column cut on the evidence of its first text longer than the budget (clip_limits),
        a cut row short of max_length encoded whole (encode_cut). The batch is the data set
        the evidence is taken from, as prepare's is its whole data: a batch of predict is a
        part of the input, or one row where encode refused the part."""
        limits = clip_limits(
            datasets.Dataset.from_dict(batch),
            self.encode,
            self.keys,
            self.max_length,
            self.tokenizer,
            self.where,
        )
        for column in sorted(set(limits) - self.said):
            self.said.add(column)
            print(
                f"texts of column {column!r} longer than {limits[column]} characters are cut "
                f"there before {self.where}",
                flush=True,
            )
        rows = len(batch["id"])
        columns, _, lengths = encode_cut(
            self.encode, batch, rows, limits, self.keys, self.max_length, self.where
        )
        check_cut(lengths, self.max_length, self.where)  # as prepare checked the run's data
        return columns, lengths


def load_encoder(name: str, keys: list[str], encoding: dict) -> Encoder:
    """The run's user functions and tokenizer; a tokenizer other than the one that encoded
    the run's data (encoding.json) would give the model ids it was not trained on."""
    functions = load_user_functions(os.environ[names.USER_FUNCTIONS_VARIABLE])
    tokenizer = call(functions, "load_tokenizer", name)
    if differs := other_tokenizer(tokenizer, encoding, name):
        raise ValueError(
            f"{functions.module}.load_tokenizer({name!r}) returns another tokenizer than the one "
            f"that encoded the run's data ({differs}): the model would be given ids it was not "
            "trained on"
        )
    tokenizer = capped(tokenizer, encoding["max_length"])  # as prepare gave it to encode
    where = f"{functions.module}.encode (model {name!r})"
    kinds = recorded_kinds(encoding, name)
    return Encoder(functions, tokenizer, name, keys, encoding["max_length"], where, kinds)


def malformed(row: dict, text_columns: list[str], kinds: dict[str, str]) -> str | None:
    """Why a row gets no prediction: the driver could not read it, or a text is missing,
    not a string, or empty, or a value of another kind (`kinds`: a number, say) is missing."""
    if row["error"]:
        return row["error"]
    for column in text_columns:
        value = row[column]
        if column in kinds:
            if value is None:
                return f"no value in column {column!r}"
            continue
        if not isinstance(value, str):
            return f"no text in column {column!r}"
        if not value.strip():
            return f"empty text in column {column!r}"
    return None


def encode_rows(
    encoder: Encoder, rows: list[dict], text_columns: list[str]
) -> tuple[pa.Table | None, list[int], dict[int, str]]:
    """The model's columns for the rows that can be encoded (a table Batches reads), their
    positions, and why each other row cannot be. A batch encode refuses is encoded again row
    by row, so one bad text costs its row only; when no row can be, encode itself is wrong
    and the job fails with its error."""
    errors = {
        i: why for i, row in enumerate(rows) if (why := malformed(row, text_columns, encoder.kinds))
    }
    good = [i for i in range(len(rows)) if i not in errors]

    def batch_of(indices: list[int]) -> dict[str, list]:
        return {c: [rows[i][c] for i in indices] for c in ["id", *text_columns]}

    if not good:
        return None, good, errors
    try:
        parts = [encoder(batch_of(good))]
    except (RuntimeError, ValueError, TypeError) as first:
        parts, kept = [], []
        for i in good:
            try:
                parts.append(encoder(batch_of([i])))
                kept.append(i)
            except (RuntimeError, ValueError, TypeError) as e:
                errors[i] = str(e)
        if not kept:
            raise first
        good = kept
    columns = {
        f"{encoder.name}_{k}": pa.concat_arrays([p[0][k] for p in parts]) for k in encoder.keys
    }
    lengths = [n for p in parts for n in p[1]]
    columns[length_column(encoder.name)] = pa.array(lengths, pa.int64())
    return pa.table(columns), good, errors


def predict_part(
    rows: list[dict],
    encoder: Encoder,
    program,
    inputs: dict,
    args,
    labels: list[str],
    precision: Precision,
) -> pa.Table:
    """One part's predictions: a row each, in the part's order, through the inference step's
    program and batching (steps/inference.py `load_program`, `run_batches`). A row without a
    prediction says why in `error`: the driver could not read it, an empty text, a text that is
    not a string, or encode refused it."""
    text_columns = args.text_columns.split(",")
    table, good, errors = encode_rows(encoder, rows, text_columns)
    probabilities = np.full((len(rows), len(labels)), np.nan, dtype=np.float32)
    predicted = [None] * len(rows)
    if good:
        batches = Batches(
            table, encoder.name, encoder.keys, inputs, encoder.max_length, labels=False
        )
        logits = run_batches(program, batches, encoder.keys, args.batch_size, precision)
        probabilities[good] = torch.softmax(logits, -1).numpy()
        for position, label_id in zip(good, logits.argmax(-1).tolist(), strict=True):
            predicted[position] = labels[label_id]  # the logits' argmax, as inference takes it
    out = {
        "row": pa.array([r["row"] for r in rows], pa.int64()),
        "id": pa.array([r["id"] for r in rows], pa.string()),
        "predicted": pa.array(predicted, pa.string()),
    }
    for j, label in enumerate(labels):
        out[PROBABILITY + label] = pa.array(probabilities[:, j], mask=np.isnan(probabilities[:, j]))
    out["error"] = pa.array([errors.get(i) for i in range(len(rows))], pa.string())
    return pa.table(out)


def progress(done: int, total: int, malformed_rows: int, started: float) -> str:
    """The job's progress line (the live display shows it beside the job)."""
    seconds = max(time.time() - started, 1e-9)
    rate = done / seconds
    eta = (total - done) / rate if rate else 0.0
    return (
        f"{done:,} of {total:,} rows done ({100 * done / max(total, 1):.0f}%), "
        f"{rate:.1f} rows/s, ETA {eta:.0f} s; {malformed_rows:,} of them malformed (no prediction)"
    )


def main() -> None:
    args = parse_args()
    name = args.model_name
    directory = model_folder()
    record = read_record(directory)
    keys = record["ordered_input_keys"]
    id2label = {int(k): v for k, v in record["id2label"].items()}
    labels = [id2label[i] for i in sorted(id2label)]
    encoding = read_encoding(processing_input("labels"))
    if record.get("max_length") not in (None, encoding["max_length"]):
        raise ValueError(
            f"model {name!r} was trained on rows cut to {record['max_length']} tokens, but "
            f"its data's encoding.json says {encoding['max_length']}"
        )
    inputs = read_inputs(processing_input("labels"), name, keys)
    encoder = load_encoder(name, keys, encoding)
    program = load_program(directory, args.model_format, name)
    precision = resolve(args.mixed_precision, num_gpus=0)
    parts = sorted(processing_input("texts").glob("part-*.parquet"))
    if not parts:  # ShardedByS3Key may give an instance none (about 1/n of the objects each)
        print("no part of the input reached this instance: nothing to predict here")
        return
    total = sum(pq.ParquetFile(p).metadata.num_rows for p in parts)
    out, started, done, bad = processing_output("predictions"), time.time(), 0, 0
    print(
        f"predicting {total:,} rows in {len(parts)} part(s) with model {name!r} "
        f"({args.model_format}, {len(labels)} labels, rows of up to {encoder.max_length} tokens, "
        f"computed in {precision.applied}: {precision.reason})",
        flush=True,
    )
    for part in parts:
        rows = pq.read_table(part).to_pylist()
        predictions = predict_part(rows, encoder, program, inputs, args, labels, precision)
        pq.write_table(predictions, out / part.name)
        done += len(rows)
        bad += len(rows) - predictions.column("error").null_count
        print(progress(done, total, bad, started), flush=True)


if __name__ == "__main__":
    run_step("predict", main)
