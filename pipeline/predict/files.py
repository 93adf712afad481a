"""The files `smpipe predict` reads and writes, read and written a part at a time.

INPUT is what Hugging Face `datasets` reads, its format told by its suffix (`format_of`), or a
folder of `.txt` files; `read_rows` yields its rows, a row that cannot be read kept in its place
with the reason, and `write_parts` splits them into parquet parts. OUTPUT's format is its
suffix's; every file predict writes is checked before the job runs (`check_targets`) and renamed
into place whole, the record first (`place`).
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import interrupts
from pipeline.store import FILE_MODE, file_sha256
from steps.prepared_files import as_kind

# Rows per part: prepare encodes the run's data in batches of this many (datasets' map,
# batch_size=1000), and the job reads, predicts and writes one part at a time.
PART_ROWS = 1000
# Characters of text per part, at most (a row longer than this has a part of its own): the
# driver and the job hold a part at a time, so a thousand long texts do not take gigabytes.
PART_CHARS = 64 << 20
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
# What bytes.isspace() counts as blank, and JSON's whitespace with it: a line of only these is no
# row (str.isspace() would count Unicode's spaces too, which JSON does not).
BLANK = " \t\n\r\x0b\x0c"


def open_text(path: Path, newline: str, errors: str = "surrogateescape"):
    """INPUT (a CSV, TSV or JSON Lines file) as text: the one place predict decodes one. UTF-8,
    a byte order mark at its start skipped ("utf-8-sig": "some Microsoft tools" write one,
    Python's codecs docs, Encodings and Unicode), as
    datasets reads each: csv through pandas, which skips it; json, whose loader strips a
    leading BOM before pyarrow reads the lines (datasets/packaged_modules/json/json.py,
    `_generate_tables`). Bytes that are not UTF-8 become surrogates (`SURROGATE`), so such a
    row costs that row only. `newline`: "" for the csv module (its own quoting of line breaks),
    "\n" for JSON Lines (lines end at LF only, a CR before it is JSON whitespace)."""
    return open(path, encoding="utf-8-sig", errors=errors, newline=newline)


def format_of(path: Path) -> str | None:
    """csv | tsv | jsonl | parquet by the suffix, `folder` for a folder; None: unknown. The
    suffixes are those `datasets` tells formats by (datasets/packaged_modules/__init__.py,
    _EXTENSION_TO_MODULE): `.json`, `.jsonl` and `.ndjson` are JSON Lines."""
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

# Byte order marks of the encodings a file that is not UTF-8 text most often is in
# (https://www.unicode.org/faq/utf_bom.html#bom4); UTF-32's before UTF-16's, which they begin with.
BOMS = {
    b"\xff\xfe\x00\x00": "UTF-32",
    b"\x00\x00\xfe\xff": "UTF-32",
    b"\xff\xfe": "UTF-16",
    b"\xfe\xff": "UTF-16",
}
PEEK = 1 << 16  # bytes read from INPUT's start to tell its encoding and whether it is empty


def unreadable(path: Path, kind: str) -> str | None:
    """Why a CSV, TSV or JSON Lines INPUT cannot be read at all, in one line: it is empty, or
    its first line (a CSV's header, the first JSON object) is not UTF-8. Predict reads UTF-8,
    as datasets' loaders do (csv: pandas' default; json: JsonConfig.encoding "utf-8"); a
    later row that is not UTF-8 costs that row only (its `error` says so). Only the start of
    the file is read."""
    with open(path, "rb") as f:
        start = f.read(PEEK)
        while start and start.isspace():  # blank lines before the first row: no row yet
            start = f.read(PEEK)
    if not start:
        return f"INPUT {path} is empty: it holds no {'lines' if kind == 'jsonl' else 'rows'}"
    for bom, name in BOMS.items():
        if start.startswith(bom):
            return f"INPUT {path} is {name} (it starts with a {name} byte order mark): {UTF8}"
    first = start.lstrip().split(b"\n", 1)[0]
    if b"\x00" in first:
        return (
            f"INPUT {path} holds NUL bytes in its first line, as UTF-16 or binary data does: {UTF8}"
        )
    try:
        first.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(first) - 4 or len(first) < len(start):  # not a character cut by PEEK
            byte = f"byte {first[e.start]:#04x}"
            return f"INPUT {path}: its first line is not UTF-8 ({byte}): {UTF8}"
    return None


UTF8 = "predict reads UTF-8 text, as datasets does; save it as UTF-8"


def input_columns(path: Path, kind: str) -> tuple[list[str], dict[str, str]]:
    """The columns the input has (a CSV's header, the first JSON object's keys, a Parquet
    schema), and those that cannot hold text with their type. ValueError when it cannot be
    read as its format."""
    if kind == FOLDER:
        return ([TEXT] if text_files(path) else []), {}
    if kind in ("csv", "tsv"):
        with open_text(path, "", errors="replace") as f:
            return next(csv.reader(f, delimiter="\t" if kind == "tsv" else ","), []), {}
    if kind == "parquet":
        try:
            schema = pq.ParquetFile(path).schema_arrow
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"it is not a Parquet file ({e})") from None
        strings = (pa.string(), pa.large_string(), pa.string_view())
        return schema.names, {f.name: str(f.type) for f in schema if f.type not in strings}
    with open_text(path, "\n") as f:
        # The first character, before the first line is read whole: one JSON document may be
        # one line of gigabytes.
        while (char := f.read(1)) and char in BLANK:
            pass
        if char == "[":
            raise ValueError(
                "it is one JSON document; predict reads JSON Lines (one object per line), as "
                "datasets' json loader reads .jsonl"
            )
        first = char + f.readline() if char else ""
    try:
        row = json.loads(first) if first else {}
    except ValueError as e:
        raise ValueError(f"its first line is not JSON ({e})") from None
    return (list(row) if isinstance(row, dict) else []), {}


def parquet_rows(path: Path) -> int:
    """The rows a Parquet file holds, from its footer."""
    return pq.ParquetFile(path).metadata.num_rows


# -- reading rows ---------------------------------------------------------------------------


def read_rows(
    path: Path, kind: str, columns: list[str], kinds: dict[str, str] | None = None
) -> Iterator[dict]:
    """Each row as {"id", "error", <column>...}: values are text or None (those of a column of
    `kinds`: of its kind, from a number or its text; as_kind), the id None where the input
    has none; `error` says why a row could not be read (a CSV line with too many or too few
    fields, a line that is not a JSON object, bytes that are not UTF-8, a value that is not
    text, or not of its kind): the job gives that row no prediction, and OUTPUT's `error`
    column says why."""
    kinds = kinds or {}
    texts = [c for c in columns if c not in kinds]
    readers = {
        "csv": lambda: _csv_rows(path, columns, ","),
        "tsv": lambda: _csv_rows(path, columns, "\t"),
        "jsonl": lambda: _jsonl_rows(path, columns, texts),
        "parquet": lambda: _parquet_rows(path, columns),
        FOLDER: lambda: _folder_rows(path),
    }
    empty = dict.fromkeys(columns)  # a row that could not be read has no values
    return (of_kinds({**empty, **row}, kinds) for row in readers[kind]())


def of_kinds(row: dict, kinds: dict[str, str]) -> dict:
    """The row with the values of `kinds`' columns as their kind, or its `error` saying which
    value is not."""
    if row["error"]:
        return row
    for column, kind in kinds.items():
        row[column], why = as_kind(row[column], kind)
        if why:
            return {**row, "error": f"{column!r} is {why}", **dict.fromkeys(kinds)}
    return row


def _row(id_, error: str | None, values: dict) -> dict:
    return {"id": id_, "error": error, **values}


def _csv_rows(path: Path, columns: list[str], delimiter: str) -> Iterator[dict]:
    # A text may be longer than the csv module's default field limit (131,072 characters).
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    with open_text(path, "") as f:
        consumed: list[str] = []  # the lines of the record being read

        def lines() -> Iterator[str]:
            for line in f:
                consumed.append(line)
                yield line

        # strict: a quote left open to the end of the file is an error, not a text holding
        # every line after it (the csv module's default joins them into one field silently).
        # Other strictness (text after a closing quote, `"abc" ,x`) is forgiven as pandas and
        # datasets forgive it: the record is read again, leniently.
        reader = csv.reader(lines(), delimiter=delimiter, strict=True)
        header = next(reader, [])
        where = {name: i for i, name in enumerate(header)}
        while True:
            consumed.clear()
            error = None
            try:
                fields = next(reader)
            except StopIteration:
                return
            except csv.Error as e:
                fields = next(csv.reader(consumed, delimiter=delimiter), [])
                if "unexpected end of data" in str(e):
                    start = reader.line_num - len(consumed) + 1
                    error = f"line {start} is not CSV (a quote opened there is never closed)"
            if not fields:  # a blank line: no row, as pandas and datasets read it
                continue
            yield _csv_row(fields, header, where, columns, reader.line_num, error)


def _csv_row(fields, header, where, columns, line: int, error: str | None) -> dict:
    """One record of a CSV as read_rows gives it (`error`: why it is not CSV, if it is not)."""
    values = {c: fields[where[c]] if where[c] < len(fields) else None for c in columns}
    id_ = fields[where["id"]] if "id" in where and where["id"] < len(fields) else None
    if error:
        values = {}
    elif len(fields) != len(header):
        error = f"line {line} has {len(fields)} fields, the header {len(header)}"
    if any(v is not None and SURROGATE.search(v) for v in values.values()):
        error, values = f"line {line} is not UTF-8", {}
    if id_ is not None and SURROGATE.search(id_):
        id_ = id_.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return _row(id_, error, values)


def _jsonl_rows(path: Path, columns: list[str], texts: list[str]) -> Iterator[dict]:
    with open_text(path, "\n") as f:
        for line, text in enumerate(f, 1):
            if not text.strip(BLANK):  # a blank line: no row
                continue
            if SURROGATE.search(text):
                yield _row(None, f"line {line} is not UTF-8", {})
                continue
            try:
                row = json.loads(text)
            except ValueError as e:
                yield _row(None, f"line {line} is not JSON ({e})", {})
                continue
            if not isinstance(row, dict):
                yield _row(None, f"line {line} is a JSON {json_type(row)}, not an object", {})
                continue
            id_ = row.get("id")
            id_ = id_ if id_ is None or isinstance(id_, str) else json.dumps(id_)
            values = {c: row.get(c) for c in columns}
            wrong = {c: values[c] for c in texts if values[c] is not None}
            wrong = {c: v for c, v in wrong.items() if not isinstance(v, str)}
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
    """Each file one text, as the `text` builder reads it with `sample_by="document"` (its
    column named `text`), named by its path in the folder without `.txt` (the demo's
    `articles/<id>.txt`)."""
    for file in text_files(path):
        name = file.relative_to(path).as_posix().removesuffix(".txt")
        try:
            # As the `text` builder opens a file: text mode, UTF-8, universal newlines.
            yield _row(name, None, {TEXT: file.read_text(encoding="utf-8")})
        except UnicodeDecodeError:
            yield _row(name, f"{name}.txt is not UTF-8", {})
        except OSError as e:
            yield _row(name, f"{name}.txt cannot be read ({e.strerror or e})", {})


ARROW_KINDS = {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_()}


def write_parts(
    rows: Iterator[dict], folder: Path, columns: list[str], every=None, kinds=None
) -> list[int]:
    """The rows as parquet parts of PART_ROWS rows and PART_CHARS characters of text at most in
    `folder` (row, id, error, columns: text, or of their kind in `kinds`); the rows in each
    part. `every(rows so far)` is called after each part. Rows are numbered from 0 in the
    input's order; a row's id is its `id` column's value when the input has one, else that
    number; a row that could not be read, whose id was not read, has none: its number could
    be another row's id (its error names its line)."""
    kinds = kinds or {}
    schema = pa.schema(
        [("row", pa.int64()), ("id", pa.string()), ("error", pa.string())]
        + [(c, ARROW_KINDS[kinds[c]] if c in kinds else pa.string()) for c in columns]
    )
    sizes: list[int] = []
    chunk: list[dict] = []
    chars = 0

    def flush() -> None:
        table = pa.Table.from_pylist(chunk, schema=schema)
        pq.write_table(table, folder / PART.format(len(sizes)))
        sizes.append(len(chunk))
        chunk.clear()
        if every is not None:
            every(sum(sizes))

    for number, row in enumerate(rows):
        size = sum(len(row[c]) for c in columns if isinstance(row.get(c), str))
        if chunk and chars + size > PART_CHARS:
            flush()
            chars = 0
        id_ = row["id"] if row["id"] is not None or row["error"] else str(number)
        chunk.append({**row, "row": number, "id": id_})
        chars += size
        if len(chunk) == PART_ROWS:
            flush()
            chars = 0
    if chunk:
        flush()
    return sizes


# -- writing OUTPUT -------------------------------------------------------------------------

# Keys every record of `smpipe predict` has (pipeline/predict/): how an OUTPUT.json that
# predict wrote is told from a file of the user's of the same name.
RECORD_KEYS = frozenset({"model", "input_sha256", "output", "predictions"})
# A record lists at most 100 malformed rows (pipeline/predict/job.py LISTED): far below this.
RECORD_BYTES = 16 << 20
REFUSED = "predict never replaces a file it did not make: move it, or choose another OUTPUT"


def record_path(output: Path) -> Path:
    """OUTPUT.json: the record of what OUTPUT came from, beside it."""
    return output.with_name(output.name + ".json")


def temporary(target: Path) -> Path:
    """A new hidden file beside `target`, mode FILE_MODE: what `target` is written to before
    it is renamed into place. Created exclusively (mkstemp), so never a file that was there."""
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        os.fchmod(fd, FILE_MODE)  # mkstemp's 0600 would stay on the renamed file
    finally:
        os.close(fd)
    return Path(name)


def check_targets(source: Path, output: Path) -> tuple[list[str], bytes | None]:
    """Every problem with the files predict will write, found before anything runs. OUTPUT and
    OUTPUT.json are neither INPUT nor in an INPUT folder, neither a folder, a link nor another
    kind of file, and neither is a file predict did not make; their folder takes new files (a
    temporary is made there and removed, as the writes will be). An existing OUTPUT.json is
    predict's when it is a predict record naming this OUTPUT; an existing OUTPUT is predict's
    when such a record is beside it and OUTPUT's sha256 is the one it recorded (an OUTPUT
    edited since is the user's). Returns the problems, and that record's bytes if there is one
    (put back if OUTPUT cannot be renamed into place)."""
    record = record_path(output)
    folder = output.parent
    if not folder.is_dir():
        return [f"OUTPUT {output}: its folder {folder} does not exist"], None
    output_wrong = target_problems("OUTPUT", output, source)
    record_wrong = target_problems("OUTPUT.json", record, source)
    problems = output_wrong + record_wrong
    try:
        if not output_wrong:  # never a file made in an INPUT folder, even for a moment
            temporary(output).unlink()
    except OSError as e:
        why = f"creating a file there failed: {e.strerror or e}"
        problems.append(f"OUTPUT {output}: its folder {folder} cannot be written ({why})")
    try:
        previous = None if record_wrong else read_record(record)
        recorded = recorded_output(previous, output)
        mine = not output_wrong and output.exists() and bool(recorded)  # a regular file
        changed = mine and recorded != file_sha256(output)
    except OSError as e:
        return [*problems, f"{e.filename} cannot be read ({e.strerror or e})"], None
    whys = []
    if previous is not None and recorded is None:
        whys.append(f"OUTPUT.json {record} exists and is not predict's record of {output}")
    if not output_wrong and output.exists() and recorded is None:
        whys.append(f"OUTPUT {output} exists and no {record.name} beside it says predict wrote it")
    elif not output_wrong and changed:
        whys.append(
            f"OUTPUT {output} was changed since predict wrote it (its sha256 is not the one "
            f"{record.name} records)"
        )
    problems += [f"{why}: {REFUSED}" for why in whys]
    if not problems:
        problems = sticky_problems(folder, [t for t in (output, record) if t.exists()])
    return problems, previous if recorded is not None else None


def read_record(path: Path) -> bytes | None:
    """OUTPUT.json's bytes, if it is there; a file too large to be a record reads as b""."""
    if not path.exists():
        return None
    if path.stat().st_size > RECORD_BYTES:
        return b""
    return path.read_bytes()


def recorded_output(record: bytes | None, output: Path) -> str | None:
    """The sha256 a predict record of this OUTPUT gives it ("" in records from before it was
    recorded); None when `record` is not one."""
    try:
        parsed = json.loads(record) if record is not None else None
    except ValueError:  # not JSON, or not UTF-8
        return None
    if not isinstance(parsed, dict) or not RECORD_KEYS <= parsed.keys():
        return None
    if parsed["output"] != str(output.resolve()):
        return None
    return str(parsed.get("output_sha256") or "")


def target_problems(what: str, target: Path, source: Path) -> list[str]:
    """`target` (OUTPUT or OUTPUT.json) is not INPUT (by path or, for a link, by file), not in
    an INPUT folder, and a regular file if it is there at all."""
    if source.exists() and (
        target.resolve() == source.resolve()
        or (target.exists() and os.path.samefile(target, source))
    ):
        return [f"{what} {target} is INPUT: predictions never overwrite their texts"]
    if source.is_dir() and target.resolve().is_relative_to(source.resolve()):
        return [f"{what} {target} is inside the INPUT folder {source}: predict never writes there"]
    if target.is_symlink():
        return [
            f"{what} {target} is a symbolic link: predict writes a new file and renames it into "
            "place, which would replace the link; name the file it points to"
        ]
    if target.is_dir():
        return [f"{what} {target} is a folder: predict writes a file there"]
    if target.exists() and not target.is_file():
        return [f"{what} {target} is not a regular file: predict writes a file there"]
    return []


def sticky_problems(folder: Path, existing: list[Path]) -> list[str]:
    """In a sticky folder (/tmp) only a file's owner, the folder's or root may replace it
    (unlink(2), rename(2): EPERM), which the temporary made there does not show."""
    mode, me = folder.stat(), os.geteuid()
    if not mode.st_mode & stat.S_ISVTX or me in (0, mode.st_uid):
        return []
    return [
        f"{target} belongs to another user in the sticky folder {folder}: predict cannot replace it"
        for target in existing
        if target.stat().st_uid != me
    ]


class OutputWriter:
    """OUTPUT, a part at a time, in the format its suffix names, written to a hidden file
    beside it (`tmp`): `finish()` once whole, `discard()` otherwise; `place` puts it in place."""

    def __init__(self, path: Path, kind: str) -> None:
        self.path, self.kind = path, kind
        self.tmp = temporary(path)
        self._parquet = None
        self._text = None
        try:
            self._text = None if kind == "parquet" else open(self.tmp, "w", encoding="utf-8")
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise
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

    def _close(self) -> None:
        handles, self._parquet, self._text = (self._parquet, self._text), None, None
        for handle in handles:
            if handle is not None:
                handle.close()  # a text file's last bytes are written here: it may fail

    def finish(self) -> Path:
        """The whole output, closed (a failure to write its last bytes raises here)."""
        self._close()
        return self.tmp

    def discard(self) -> None:
        try:
            self._close()
        finally:
            self.tmp.unlink(missing_ok=True)


def place(output: Path, written: Path, record: str, previous: bytes | None) -> list[int]:
    """OUTPUT's record and then OUTPUT renamed into place from the files written beside them,
    Ctrl-C and SIGTERM held meanwhile (the signals that came are returned). The record goes
    first, so that OUTPUT appears only with its record beside it: whoever waits for OUTPUT
    finds the record of these very predictions (its sha256 included), and a crash between the
    two renames leaves a record whose OUTPUT is missing or not the one it names, which a
    rerun replaces, never predictions without a record. A rename that fails puts the old
    record back (or removes the new one) and raises OSError naming the file it was to put
    in place (`filename2`, or `filename`); `written` is removed however it ends."""
    target = record_path(output)
    staged = None
    try:
        try:
            staged = temporary(target)
            with open(staged, "w", encoding="utf-8") as f:
                f.write(record)
        except OSError as e:  # named for the file it was to become
            raise OSError(e.errno, e.strerror, str(target)) from None
        with interrupts.held() as held:
            os.replace(staged, target)
            staged = None
            try:
                os.replace(written, output)
            except OSError:
                put_back(target, previous)
                raise
        return held
    finally:
        written.unlink(missing_ok=True)
        if staged is not None:
            staged.unlink(missing_ok=True)


def put_back(record: Path, previous: bytes | None) -> None:
    """The record as it was before `place` replaced it: the earlier one, or none."""
    try:
        if previous is None:
            record.unlink(missing_ok=True)
            return
        again = temporary(record)
        again.write_bytes(previous)
        os.replace(again, record)
    except OSError:  # the rename's error is the one to say
        pass
