"""The files `smpipe predict` reads and writes, read and written a part at a time.

INPUT is what users of Hugging Face `datasets` hand `load_dataset`, its format told by its
suffix as `datasets` tells it (datasets/packaged_modules/__init__.py, _EXTENSION_TO_MODULE):
`.csv`, `.tsv`, `.json`/`.jsonl`/`.ndjson` (JSON Lines), `.parquet`; or a folder of `.txt`
files, each file one text (the `text` builder's `sample_by="document"`: read as UTF-8 with
universal newlines, its column named `text`), named by its path in the folder without
`.txt`, as the demo's `articles/<id>.txt`. Rows are numbered from 0 in the input's order; a
row's id is its `id` column's value when the input has one, else that number.

A row that cannot be read (a CSV line with too many or too few fields, a line that is not a
JSON object, bytes that are not UTF-8, a value that is not text) is kept in its place with the
reason; the job gives it no prediction, and the output says why in its `error` column.
OUTPUT's format is its suffix's; it is written beside itself and renamed into place whole.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.store import FILE_MODE, file_sha256

# Rows per part: prepare encodes the run's data in batches of this many (datasets' map,
# batch_size=1000), and the job reads, predicts and writes one part at a time.
PART_ROWS = 1000
PART = "part-{:05d}.parquet"
FORMATS = {
    ".csv": "csv",
    ".tsv": "tsv",
    ".json": "jsonl",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
}
SAID = ".csv, .tsv, .jsonl (.json, .ndjson: JSON Lines), .parquet"
FOLDER = "folder"
TEXT = "text"  # the column the `text` builder names, the one a folder of files gives
SURROGATE = re.compile("[\udc80-\udcff]")  # bytes that were not UTF-8 (surrogateescape)


def format_of(path: Path) -> str | None:
    """csv | tsv | jsonl | parquet by the suffix, `folder` for a folder; None: unknown."""
    if path.is_dir():
        return FOLDER
    return FORMATS.get(path.suffix.lower())


def text_files(folder: Path) -> list[Path]:
    """The `.txt` files under a folder, hidden ones left out, in the order of their names."""
    found = (
        p
        for p in folder.rglob("*.txt")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def input_sha256(path: Path) -> str:
    """The hash of the input's bytes; of a folder, of each text file's name and hash."""
    if not path.is_dir():
        return file_sha256(path)
    h = hashlib.sha256()
    for file in text_files(path):
        h.update(f"{file.relative_to(path).as_posix()}\0{file_sha256(file)}\n".encode())
    return h.hexdigest()


# -- what an input holds, checked before anything runs ------------------------------------------


def input_columns(path: Path, kind: str) -> tuple[list[str], dict[str, str]]:
    """The columns the input has (a CSV's header, the first JSON object's keys, a Parquet
    schema), and those that cannot hold text with their type. ValueError when it cannot be
    read as its format."""
    if kind == FOLDER:
        return ([TEXT] if text_files(path) else []), {}
    if kind in ("csv", "tsv"):
        with open(path, newline="", encoding="utf-8-sig", errors="replace") as f:
            return next(csv.reader(f, delimiter="\t" if kind == "tsv" else ","), []), {}
    if kind == "parquet":
        try:
            schema = pq.ParquetFile(path).schema_arrow
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"it is not a Parquet file ({e})") from None
        strings = (pa.string(), pa.large_string(), pa.string_view())
        return schema.names, {f.name: str(f.type) for f in schema if f.type not in strings}
    with open(path, "rb") as f:
        first = next((line for line in f if line.strip()), b"")
    if first.lstrip().startswith(b"["):
        raise ValueError(
            "it is one JSON document; predict reads JSON Lines (one object per line), as "
            "datasets' json loader reads .jsonl"
        )
    try:
        row = json.loads(first) if first else {}
    except ValueError as e:
        raise ValueError(f"its first line is not JSON ({e})") from None
    return (list(row) if isinstance(row, dict) else []), {}


# -- reading rows ---------------------------------------------------------------------------


def read_rows(path: Path, kind: str, columns: list[str]) -> Iterator[dict]:
    """Each row as {"id", "error", <column>...}: values are text or None, the id None where
    the input has none; `error` says why a row could not be read."""
    readers = {
        "csv": lambda: _csv_rows(path, columns, ","),
        "tsv": lambda: _csv_rows(path, columns, "\t"),
        "jsonl": lambda: _jsonl_rows(path, columns),
        "parquet": lambda: _parquet_rows(path, columns),
        FOLDER: lambda: _folder_rows(path),
    }
    empty = dict.fromkeys(columns)  # a row that could not be read has no values
    return ({**empty, **row} for row in readers[kind]())


def _row(id_, error: str | None, values: dict) -> dict:
    return {"id": id_, "error": error, **values}


def _csv_rows(path: Path, columns: list[str], delimiter: str) -> Iterator[dict]:
    # A text may be longer than the csv module's default field limit (131,072 characters).
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    with open(path, newline="", encoding="utf-8-sig", errors="surrogateescape") as f:
        reader = csv.reader(f, delimiter=delimiter)
        header = next(reader, [])
        where = {name: i for i, name in enumerate(header)}
        while True:
            try:
                fields = next(reader)
            except StopIteration:
                return
            except csv.Error as e:
                yield _row(None, f"line {reader.line_num} is not CSV ({e})", {})
                continue
            if not fields:  # a blank line: no row, as pandas and datasets read it
                continue
            line = reader.line_num
            values = {c: fields[where[c]] if where[c] < len(fields) else None for c in columns}
            id_ = fields[where["id"]] if "id" in where and where["id"] < len(fields) else None
            error = None
            if len(fields) != len(header):
                error = f"line {line} has {len(fields)} fields, the header {len(header)}"
            if any(v is not None and SURROGATE.search(v) for v in values.values()):
                error, values = f"line {line} is not UTF-8", {}
            if id_ is not None and SURROGATE.search(id_):
                id_ = id_.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
            yield _row(id_, error, values)


def _jsonl_rows(path: Path, columns: list[str]) -> Iterator[dict]:
    with open(path, "rb") as f:
        for line, raw in enumerate(f, 1):
            if not raw.strip():  # a blank line: no row
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                yield _row(None, f"line {line} is not UTF-8", {})
                continue
            except ValueError as e:
                yield _row(None, f"line {line} is not JSON ({e})", {})
                continue
            if not isinstance(row, dict):
                yield _row(None, f"line {line} is a JSON {json_type(row)}, not an object", {})
                continue
            id_ = row.get("id")
            id_ = id_ if id_ is None or isinstance(id_, str) else json.dumps(id_)
            values = {c: row.get(c) for c in columns}
            wrong = {c: v for c, v in values.items() if v is not None and not isinstance(v, str)}
            error = None
            if wrong:
                said = ", ".join(f"{c!r} is a {json_type(v)}" for c, v in wrong.items())
                error, values = f"line {line}: {said}, not text", {}
            yield _row(id_, error, values)


def json_type(value) -> str:
    """A parsed JSON value's type as JSON names it."""
    kinds = {bool: "boolean", int: "number", float: "number", list: "array", dict: "object"}
    return kinds.get(type(value), type(value).__name__)


def _parquet_rows(path: Path, columns: list[str]) -> Iterator[dict]:
    file = pq.ParquetFile(path)
    wanted = [*columns, *(["id"] if "id" in file.schema_arrow.names else [])]
    for batch in file.iter_batches(batch_size=PART_ROWS, columns=wanted):
        for row in batch.to_pylist():
            id_ = row.pop("id", None)
            yield _row(None if id_ is None else str(id_), None, row)


def _folder_rows(path: Path) -> Iterator[dict]:
    for file in text_files(path):
        name = file.relative_to(path).as_posix().removesuffix(".txt")
        try:
            # As the `text` builder opens a file: text mode, UTF-8, universal newlines.
            yield _row(name, None, {TEXT: file.read_text(encoding="utf-8")})
        except UnicodeDecodeError:
            yield _row(name, f"{name}.txt is not UTF-8", {})
        except OSError as e:
            yield _row(name, f"{name}.txt cannot be read ({e.strerror or e})", {})


def write_parts(rows: Iterator[dict], folder: Path, columns: list[str], every=None) -> list[int]:
    """The rows as parquet parts of PART_ROWS rows in `folder` (row, id, error, columns);
    the rows in each part. `every(rows so far)` is called after each part."""
    schema = pa.schema(
        [("row", pa.int64()), ("id", pa.string()), ("error", pa.string())]
        + [(c, pa.string()) for c in columns]
    )
    sizes: list[int] = []
    chunk: list[dict] = []

    def flush() -> None:
        table = pa.Table.from_pylist(chunk, schema=schema)
        pq.write_table(table, folder / PART.format(len(sizes)))
        sizes.append(len(chunk))
        chunk.clear()
        if every is not None:
            every(sum(sizes))

    for number, row in enumerate(rows):
        chunk.append({**row, "row": number, "id": str(number) if row["id"] is None else row["id"]})
        if len(chunk) == PART_ROWS:
            flush()
    if chunk:
        flush()
    return sizes


# -- writing OUTPUT -------------------------------------------------------------------------


class OutputWriter:
    """OUTPUT, a part at a time, in the format its suffix names: written to a hidden file
    beside it and renamed into place once whole (`close(True)`)."""

    def __init__(self, path: Path, kind: str) -> None:
        self.path, self.kind = path, kind
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        os.fchmod(fd, FILE_MODE)  # mkstemp's 0600 would stay on the renamed file
        os.close(fd)
        self.tmp = Path(name)
        self._parquet = None
        self._text = None if kind == "parquet" else open(self.tmp, "w", encoding="utf-8")
        self._first = True

    def write(self, table: pa.Table) -> None:
        table = table.drop_columns(["row"])
        if self.kind == "parquet":
            if self._parquet is None:
                self._parquet = pq.ParquetWriter(self.tmp, table.schema)
            self._parquet.write_table(table)
            return
        frame = table.to_pandas()
        if self.kind == "jsonl":
            if len(frame):  # pandas before 3 ends the last line without a newline
                text = frame.to_json(orient="records", lines=True, force_ascii=False)
                self._text.write(text if text.endswith("\n") else text + "\n")
        else:
            sep = "\t" if self.kind == "tsv" else ","
            frame.to_csv(self._text, sep=sep, index=False, header=self._first, lineterminator="\n")
        self._first = False

    def close(self, whole: bool) -> None:
        for handle in (self._parquet, self._text):
            if handle is not None:
                handle.close()
        if whole:
            os.replace(self.tmp, self.path)
        else:
            self.tmp.unlink(missing_ok=True)
