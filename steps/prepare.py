"""Prepare (processing job): encode the snapshot for every model and split it, stratified by label.
Every model's columns are prefixed with its name, so in a comparison all models train and are
tested on exactly the same rows.

Inputs:  snapshot  the reconciled dataset
Outputs: train, validation, test  the splits (save_to_disk), with each model's `<model>__length`
         labels    id2label.json; inputs.json (input keys, padding values); encoding.json
         report    step_metadata.json
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets.formatting import PythonFormatter

from steps.arguments import PREPARE, parse
from steps.batching import check_encoded, length_column, pad_value, write_inputs
from steps.prepared_files import (
    capped,
    encoding_record,
    kind_of,
    tokenizer_identity,
    write_encoding,
)
from steps.reconcile import label_order
from steps.runtime import names
from steps.runtime.environment import processing_input, processing_output
from steps.runtime.step import run_step, write_step_metadata
from steps.splits import repeats_together, stratified_split
from steps.user_code import call, input_keys, load_user_functions


def parse_args() -> argparse.Namespace:
    return parse(PREPARE)


def check_labels(label_counts: dict[str, int]) -> None:
    """A classifier needs two classes at least; one label would train a model that is always
    right (macro-F1 1.0) and means nothing."""
    if len(label_counts) < 2:
        raise ValueError(
            f"the data has {len(label_counts)} label(s) {label_counts}: a classifier needs at "
            "least two; check reconcile and the raw data's labels"
        )


# Characters a text may be cut to before the user's encode, per token kept, and at least
# BUDGET_FLOOR: more than any real tokenizer's tokens take, so cutting there changes nothing
# encode returns, while a 33 MB article no longer costs gigabytes to keep 128 tokens.
CHARS_PER_TOKEN = 64
BUDGET_FLOOR = 4096


def clip_limits(
    dataset: datasets.Dataset, encode, keys: list[str], max_length: int, tokenizer, where: str
) -> dict[str, int]:
    """Text column -> the characters its texts can be cut to before `encode` without changing
    what it returns; a column is cut only on evidence about that column. For each text column
    with a text longer than the budget, its first such row is encoded with that column cut at
    one budget and at two (the row's other columns whole): equal outputs say encode reads no
    further than the budget into that column (it does not keep a text's end, say). Nothing is
    cut for a tokenizer that truncates on the left. Both probes pass the same checks as every
    batch of encode's output."""
    if getattr(tokenizer, "truncation_side", "right") != "right":
        return {}
    budget = max(BUDGET_FLOOR, CHARS_PER_TOKEN * max_length)
    columns = dataset.with_format("arrow")
    limits = {}
    for column, feature in dataset.features.items():
        if getattr(feature, "dtype", None) not in ("string", "large_string"):
            continue
        # Counted in Arrow: row by row in Python it was a tenth of encoding short texts.
        chars = np.asarray(pc.fill_null(pc.utf8_length(columns[column]), 0))
        long_rows = np.flatnonzero(chars > budget)
        if not len(long_rows):
            continue
        row = {k: [v] for k, v in dataset[int(long_rows[0])].items()}
        probes = [
            check_encoded(encode(clip(row, {column: n})), 1, keys, where)[0]
            for n in (budget, 2 * budget)
        ]
        if all(probes[0][k].to_pylist() == probes[1][k].to_pylist() for k in keys):
            limits[column] = budget
    return limits


def clip(batch: dict, limits: dict[str, int]) -> dict:
    """The batch with each column of `limits` cut to its number of characters."""
    return {
        k: [v[: limits[k]] if k in limits and isinstance(v, str) else v for v in values]
        for k, values in batch.items()
    }


def encode_cut(
    user_encode, batch, rows: int, limits: dict[str, int], keys: list[str], max_length: int, where
) -> tuple[dict, set[str], list[int]]:
    """One batch through the user's encode with its texts cut to `limits` (clip_limits), checked
    (check_encoded): the model's columns, the names encode returned beyond `keys`, the lengths.
    Predict encodes its texts through this too (steps/predict.py)."""
    cut = [
        i
        for i in range(rows)
        if any(isinstance(batch[c][i], str) and len(batch[c][i]) > n for c, n in limits.items())
    ]
    encoded = user_encode(clip(batch, limits) if cut else batch)
    columns, extra, lengths = check_encoded(encoded, rows, keys, where)
    # A cut text that came out short of max_length may have lost tokens (a text of mostly
    # whitespace): those rows are encoded whole.
    short = [i for i in cut if lengths[i] < max_length]
    if short:
        whole = user_encode({k: [v[i] for i in short] for k, v in batch.items()})
        replace_rows(columns, lengths, short, *check_encoded(whole, len(short), keys, where))
    return columns, extra, lengths


def replace_rows(
    columns: dict, lengths: list, rows: list[int], again: dict, _extra, again_lengths
) -> None:
    """Rows `rows` of one batch's encoded columns and lengths replaced by their encoding again."""
    for k in columns:
        patched = columns[k].to_pylist()
        for j, i in enumerate(rows):
            patched[i] = again[k][j].as_py()
        columns[k] = pa.array(patched, columns[k].type)
    for j, i in enumerate(rows):
        lengths[i] = again_lengths[j]


def encode_for(dataset: datasets.Dataset, functions, model_name: str, max_length: int, given=None):
    """The user's encode over every row, in batches, checked; the model's columns prefixed with
    its name plus `<model>__length`, what training needs to pad them (keys, padding values),
    and how its rows were encoded: which tokenizer, and which of the columns `given` encode
    reads (columns_read). One pass over the rows, each check beside the part of
    the encoding it protects. Rows are cut to `max_length` tokens here, once ([data]
    MAX_SEQUENCE_LENGTH, recorded in encoding.json: steps/prepared_files.py): training and
    inference read them whole. `<model>__length` is tokens per row, padding excluded."""
    tokenizer = call(functions, "load_tokenizer", model_name)
    identity = tokenizer_identity(tokenizer)
    tokenizer = capped(tokenizer, max_length)
    keys = input_keys(functions, model_name)
    where = f"{functions.module}.encode (model {model_name!r})"
    dropped: set[str] = set()

    def user_encode(batch):
        return call(functions, "encode", batch, tokenizer, model_name, max_length)

    limits = clip_limits(dataset, user_encode, keys, max_length, tokenizer, where)
    for column, limit in limits.items():
        print(
            f"texts of column {column!r} longer than {limit} characters are cut there before "
            f"{where}"
        )

    # The user's encode gets what datasets' batched map gives (columns as Python lists,
    # decoded lazily); the model's columns go back as Arrow arrays beside the table's own,
    # since datasets' writer would check every token of a Python list in Python.
    as_python = PythonFormatter(features=dataset.features, lazy=True)

    def encode(table: pa.Table, indices: list[int]) -> pa.Table:
        batch, rows = as_python.format_batch(table), table.num_rows
        try:
            columns, extra, lengths = encode_cut(
                user_encode, batch, rows, limits, keys, max_length, where
            )
        except RuntimeError as e:  # encode raised (steps/user_code.py `call`): on which row
            # Each row alone, its texts cut as the batch's were: memory never grows with one.
            refused = first_refused(user_encode, clip(batch, limits), rows, indices)
            raise RuntimeError(f"{e}{refused}") from e
        dropped.update(extra)
        for k, values in columns.items():
            table = table.append_column(f"{model_name}_{k}", values)
        return table.append_column(length_column(model_name), pa.array(lengths, pa.int64()))

    dataset = dataset.with_format("arrow").map(
        encode,
        batched=True,
        with_indices=True,
        batch_size=1000,
        desc=f"encode {model_name}",
        new_fingerprint=fingerprint(dataset, functions.module, model_name, max_length),
        load_from_cache_file=False,
        keep_in_memory=True,
    )
    dataset = dataset.with_format(None)
    info = padding_info(dataset, tokenizer, keys, model_name)
    report_and_check(dataset, model_name, keys, max_length, where, dropped, tokenizer)
    reads = columns_read(user_encode, dataset, given, limits, keys, where)
    return dataset, info, {"tokenizer": identity, "reads": reads, "kinds": kinds(dataset, reads)}


def kinds(dataset: datasets.Dataset, columns: list[str]) -> dict[str, str]:
    """Each of `columns` that does not hold text -> its kind (steps/prepared_files.py)."""
    features = dataset.features
    found = {c: kind_of(str(getattr(features[c], "dtype", features[c]))) for c in columns}
    return {c: kind for c, kind in found.items() if kind != "text"}


PROBE_ROWS = 8  # rows encode is given, each column left out in turn, to learn what it reads


def columns_read(
    user_encode, dataset, given: list[str] | None, limits: dict, keys: list[str], where: str
) -> list[str]:
    """The columns `given` (reconcile's, label and id aside; by default every column but
    those) that encode reads, which predict must be given (steps/predict.py). Each column on
    rows that hold a value in it (the first PROBE_ROWS, cut as encode had them: a blank says
    nothing of an encode that reads the column only when it has text), left out: it is read
    when encode then raises or returns anything else. A column without a value anywhere is
    not. An unused column (an html page, a pandas index) is then not asked of predict's
    INPUT, whatever it holds; one encode cannot encode whole is."""
    if given is None:
        given = [c for c in dataset.column_names if c not in ("label", "label_id", "id")]
    table = dataset.with_format("arrow")
    shown = given + ["id"] * ("id" in dataset.column_names)  # predict gives encode ids too
    reads = []
    for column in given:
        rows = np.flatnonzero(has_value(table[column]))[:PROBE_ROWS]
        if not len(rows):
            continue
        batch = clip(dataset.select(rows).select_columns(shown)[:], limits)
        try:
            whole = probe(user_encode, batch, len(rows), keys, where)
        except (RuntimeError, ValueError, TypeError):
            reads.append(column)
            continue
        try:
            without = {k: v for k, v in batch.items() if k != column}
            same = probe(user_encode, without, len(rows), keys, where) == whole
        except (RuntimeError, ValueError, TypeError):  # a KeyError, inside `call`
            same = False
        if not same:
            reads.append(column)
    return reads


def has_value(values: pa.ChunkedArray) -> np.ndarray:
    """Which rows hold a value: not null, and for text not blank."""
    present = pc.is_valid(values)
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        present = pc.and_(present, pc.greater(pc.utf8_length(pc.utf8_trim_whitespace(values)), 0))
    return np.asarray(pc.fill_null(present, False))


def probe(user_encode, batch: dict, rows: int, keys: list[str], where: str) -> dict:
    """encode's output for `batch`, checked, as plain lists."""
    out, _, _ = check_encoded(user_encode(batch), rows, keys, where)
    return {k: v.to_pylist() for k, v in out.items()}


def first_refused(user_encode, batch, rows: int, indices: list[int]) -> str:
    """Where a batch that encode raised on fails: the first of its rows that encode refuses
    alone, by id (else by its place in the data), with the values of it that are None (a
    blank cell read as a missing text); "" if every row passes alone."""
    for i in range(rows):
        row = {column: values[i : i + 1] for column, values in batch.items()}
        try:
            user_encode(row)
        except Exception:  # noqa: BLE001 - any error of the user's encode: this is the row
            which = f"id {row['id'][0]!r}" if "id" in row else f"place {indices[i]}"
            blank = [column for column, values in row.items() if values[0] is None]
            if not blank:
                return f" (first on the row with {which}, alone)"
            return (
                f" (first on the row with {which}, alone, whose "
                f"{', '.join(map(repr, blank))} is None: reconcile can drop such rows and say "
                "why in its second value)"
            )
    return ""


def fingerprint(dataset: datasets.Dataset, module: str, model_name: str, max_length: int) -> str:
    """A fingerprint of our own for the encode's map: datasets would otherwise pickle the
    closure (tokenizer and all) to hash it, a third of the whole encode on the demo. Never read
    from a cache: the user's encode may have changed under the same name."""
    key = f"{dataset._fingerprint}/{module}/{model_name}/{max_length}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


# The share of a model's tokens its tokenizer cannot name ([UNK]) from which its rows are said,
# and from which they are refused: a tokenizer built without its vocabulary (AutoTokenizer on a
# folder holding only a model's weights makes one of special tokens alone, without an error)
# gives a model nothing to learn from, and its run would end with the majority label's scores;
# so do texts in a script its vocabulary lacks (Amharic for an English BERT).
UNKNOWN_SAID, UNKNOWN_REFUSED = 0.5, 0.9
BARE_VOCABULARY = 100  # tokens: special ones alone, no words


def check_unknown(ids: pa.ChunkedArray, mask: pa.ChunkedArray | None, tokenizer, where: str):
    """How many of the tokens encode gave are the unknown token: padding (where the attention
    mask says, or the pad token where it is not the unknown one) and other special tokens
    aside, counted a chunk at a time."""
    unknown = getattr(tokenizer, "unk_token_id", None)
    listed = pa.types.is_list(ids.type) or pa.types.is_large_list(ids.type)
    special = [i for i in getattr(tokenizer, "all_special_ids", []) if i != unknown]
    if (
        not isinstance(unknown, int)
        or not listed
        or (mask is None and getattr(tokenizer, "pad_token_id", None) == unknown)
    ):
        return
    counted = found = 0
    for i, chunk in enumerate(ids.chunks):
        tokens = np.asarray(chunk.flatten())
        kept = ~np.isin(tokens, special)
        if mask is not None:
            kept &= np.asarray(mask.chunk(i).flatten()).astype(bool)
        counted, found = counted + int(kept.sum()), found + int((tokens[kept] == unknown).sum())
    share = found / counted if counted else 0.0
    if share >= UNKNOWN_SAID:
        said_unknown(share, tokenizer, where)


def said_unknown(share: float, tokenizer, where: str) -> None:
    """Rows whose tokens are mostly unknown: why, by the size of the vocabulary; refused from
    UNKNOWN_REFUSED on."""
    size = len(tokenizer.get_vocab()) if callable(getattr(tokenizer, "get_vocab", None)) else 0
    said = f"{share:.0%} of the tokens {where} gave are the unknown token {tokenizer.unk_token!r}"
    if 0 < size < BARE_VOCABULARY:
        said += (
            f": the tokenizer knows {size} tokens, no words (AutoTokenizer on a folder holding "
            "a model's weights but no tokenizer files builds one of special tokens alone)"
        )
    else:
        said += (
            f": its vocabulary of {size} tokens lacks most of these texts' words (another "
            "language or script: a multilingual model's tokenizer may suit them)"
        )
    if share >= UNKNOWN_REFUSED:
        raise ValueError(f"{said}; the model would learn from next to nothing")
    print(f"warning: {said}")


def padding_info(dataset: datasets.Dataset, tokenizer, keys: list[str], model_name: str) -> dict:
    """What training needs to pad a model's columns: its keys, their padding values, and which
    are sequences."""
    return {
        "keys": keys,
        "pad": {k: pad_value(k, tokenizer) for k in keys},
        # Sequences are padded per batch; scalar inputs (a feature per row) are stacked.
        "sequence": [
            k for k in keys if not isinstance(dataset.features[f"{model_name}_{k}"], datasets.Value)
        ],
    }


def report_and_check(
    dataset: datasets.Dataset,
    model_name: str,
    keys: list[str],
    max_length: int,
    where: str,
    dropped: set[str],
    tokenizer,
) -> None:
    """The encoding's lengths said; a row longer than MAX_SEQUENCE_LENGTH refused, and rows of
    words the tokenizer does not know (`check_unknown`)."""
    lengths = np.asarray(dataset.with_format("arrow")[length_column(model_name)])
    print(
        f"encoded {len(dataset)} rows for {model_name}: inputs {keys}, "
        f"length min {lengths.min()} median {int(np.median(lengths))} max {lengths.max()}"
    )
    if dropped:
        print(f"{where}: columns {sorted(dropped)} dropped (ordered_input_keys does not name them)")
    check_cut(lengths, max_length, where)
    if "input_ids" in keys:
        table = dataset.with_format("arrow")
        mask = table[f"{model_name}_attention_mask"] if "attention_mask" in keys else None
        check_unknown(table[f"{model_name}_input_ids"], mask, tokenizer, where)


def check_cut(lengths, max_length: int, where: str) -> None:
    """A row longer than MAX_SEQUENCE_LENGTH refused, naming encode: it did not truncate there
    (no `truncation=True`, or a larger `max_length` than the one it is given)."""
    if len(lengths) and max(lengths) > max_length:
        raise ValueError(
            f"{where} returned rows of up to {max(lengths)} tokens; MAX_SEQUENCE_LENGTH is "
            f"{max_length} (pass truncation=True, max_length=max_length to the tokenizer)"
        )


def empty_texts(dataset: datasets.Dataset, columns: list[str]) -> list[str]:
    """Each text column encode reads whose rows hold no text (empty or only spaces: a pandas
    `fillna("")` makes them): such a row is trained and tested on as an empty input, which
    `smpipe predict` refuses (steps/predict.py); named by id, or by row where there is none."""
    table = dataset.with_format("arrow")
    names = table["id"] if "id" in dataset.column_names else None
    said = []
    for column in columns:
        blank = pc.fill_null(
            pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(table[column])), 0), False
        )
        rows = np.flatnonzero(np.asarray(blank))
        if len(rows):
            shown = [str(names[int(r)]) if names is not None else f"row {r}" for r in rows[:10]]
            more = f" and {len(rows) - 10} more" if len(rows) > 10 else ""
            said.append(
                f"{len(rows)} row(s) with no text in column {column!r} ({', '.join(shown)}{more}):"
                " each is trained and tested on as an empty input, which `smpipe predict` "
                "refuses; reconcile may drop them"
            )
    return said


def main() -> None:
    args = parse_args()
    functions = load_user_functions(os.environ[names.USER_FUNCTIONS_VARIABLE])
    snapshot = datasets.load_from_disk(str(processing_input("snapshot") / "dataset"))
    model_names = [m for m in args.model_names.split(",") if m]

    counts = collections.Counter(snapshot["label"])
    # The labels' order as reconcile kept it; without it (a snapshot made before, or by other
    # means), the order label_order gives strings and numbers.
    kept = processing_input("snapshot") / "snapshot.json"
    labels = (json.loads(kept.read_text()) if kept.exists() else {}).get("labels")
    labels = labels or label_order(counts)
    check_labels({label: counts[label] for label in labels})
    id2label = dict(enumerate(labels))
    label2id = {label: i for i, label in id2label.items()}
    dataset = snapshot.map(lambda b: {"label_id": [label2id[x] for x in b["label"]]}, batched=True)

    # Split first: a data set that cannot be split is refused before any text is encoded.
    splits = stratified_split(dataset["label_id"], id2label, args)
    inputs: dict[str, dict] = {}
    encoded: dict[str, dict] = {}
    given = [c for c in snapshot.column_names if c not in ("label", "id")]
    for model_name in model_names:
        dataset, inputs[model_name], encoded[model_name] = encode_for(
            dataset, functions, model_name, args.max_length, given
        )
    read = {c for record in encoded.values() for c in record["reads"] if c not in record["kinds"]}
    for line in empty_texts(snapshot, sorted(read)):
        print(f"warning: {line}")
    reads = [encoded[m]["reads"] for m in model_names]  # the columns each model's encode reads
    splits = repeats_together(snapshot, reads, dataset["label_id"], id2label, args, splits)
    sizes = {}
    for name, indices in splits.items():
        part = dataset.select(indices)
        part.save_to_disk(str(processing_output(name)))
        sizes[name] = len(part)
    (processing_output("labels") / "id2label.json").write_text(
        json.dumps({str(k): v for k, v in id2label.items()}, indent=2)
    )
    write_inputs(processing_output("labels"), inputs)
    encoding = encoding_record(args.max_length, encoded)
    write_encoding(processing_output("labels"), encoding)
    print(f"splits: {sizes}; labels: {id2label}")
    write_step_metadata(
        processing_output("report"),
        {
            "split_sizes": sizes,
            "id2label": id2label,
            "model_names": model_names,
            "max_length": args.max_length,
            "inputs": inputs,
            "encoding": encoding,
            "seed": args.seed,
        },
    )


if __name__ == "__main__":
    run_step("prepare", main)
