"""What `encode` returns, checked once in prepare, and batches padded to their own longest row.

`encode` returns what tokenizers return: a mapping (a dict, a `BatchEncoding`) of column name
to one value per row, each a sequence of numbers (padded or not) or a scalar. Prepare keeps the
columns `ordered_input_keys` names, records each row's real length and each input's padding
value (`inputs.json` in the labels channel), and refuses a malformed output by naming `encode`.
Training, validation and inference then pad every batch to its longest row, never to the
global maximum, as `DataCollatorWithPadding` does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

INPUTS_FILE = "inputs.json"  # in the labels channel: {model: {"keys", "pad", "sequence"}}
LENGTH_SUFFIX = "__length"  # `<model>__length`: the row's real length (tokens, padding excluded)


# Inputs that are indices or masks, whatever their shape.
INTEGER_KEYS = (
    "input_ids",
    "attention_mask",
    "token_type_ids",
    "position_ids",
    "decoder_input_ids",
    "decoder_attention_mask",
)


def length_column(model_name: str) -> str:
    return f"{model_name}{LENGTH_SUFFIX}"


def _as_list(value):
    """Tensors and arrays (return_tensors="pt"/"np") as plain lists."""
    return value.tolist() if hasattr(value, "tolist") else value


def pad_value(key: str, tokenizer) -> int:
    """What a tokenizer pads an input with: pad_token_id for ids, 0 for masks and type ids."""
    if key in ("input_ids", "decoder_input_ids"):
        pad = getattr(tokenizer, "pad_token_id", None)
        return int(pad) if pad is not None else 0
    if key == "token_type_ids":
        return int(getattr(tokenizer, "pad_token_type_id", 0) or 0)
    return 0


def check_encoded(
    encoded, rows: int, keys: list[str], where: str
) -> tuple[dict[str, pa.Array], list[str], list[int]]:
    """The columns `keys` names from one batch of `encode`'s output, as Arrow arrays, the
    columns dropped, and each row's real length. Raises ValueError naming `where` (the user's
    encode) on any shape that could not be batched. Checked column by column in Arrow: a
    Python loop over every row and token cost a tenth of encoding short texts."""
    if not isinstance(encoded, Mapping) or not encoded:
        raise TypeError(
            f"{where} must return a mapping of column name to per-row values (a dict or the "
            f"tokenizer's BatchEncoding), got {type(encoded).__name__}"
        )
    missing = [k for k in keys if k not in encoded]
    if missing:
        raise ValueError(
            f"{where} returned no {missing} (ordered_input_keys names them; it returned "
            f"{list(encoded)})"
        )
    columns = {k: _as_array(encoded[k], k, rows, where) for k in keys}
    dropped = [k for k in encoded if k not in keys]
    sequence_keys = [k for k in keys if pa.types.is_list(columns[k].type)]
    if not sequence_keys:
        return columns, dropped, [0] * rows
    row_lengths = {
        k: pc.list_value_length(columns[k]).to_numpy(zero_copy_only=False) for k in sequence_keys
    }
    lengths = row_lengths[sequence_keys[0]]
    for k in sequence_keys[1:]:
        unequal = np.flatnonzero(row_lengths[k] != lengths)
        if len(unequal):
            i = int(unequal[0])
            raise ValueError(
                f"{where} returned inputs of different lengths for one row: "
                f"{ {key: int(row_lengths[key][i]) for key in sequence_keys} }"
            )
    if rows and lengths.min() == 0:
        raise ValueError(
            f"{where} returned an empty sequence for row {int(np.argmin(lengths))} of a batch"
        )
    if "attention_mask" in sequence_keys:
        lengths = _masked_lengths(columns["attention_mask"], lengths)
    return columns, dropped, lengths.tolist()


def _as_array(values, key: str, rows: int, where: str) -> pa.Array:
    """One input's values for a batch: a number per row, or a flat sequence of numbers."""
    values = _as_list(values)
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != rows:
        got = len(values) if isinstance(values, Sequence) else type(values).__name__
        raise ValueError(f"{where} returned {got} values for {key!r} for a batch of {rows} rows")
    try:
        array = pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        rows_are = [isinstance(v, Sequence) and not isinstance(v, str) for v in values]
        if any(
            is_row and any(isinstance(x, Sequence) for x in v)
            for is_row, v in zip(rows_are, values, strict=True)
        ):
            raise ValueError(
                f"{where} returned nested sequences for {key!r} (one row, one list)"
            ) from e
        if any(rows_are):
            raise ValueError(f"{where} returned {key!r} as a sequence for some rows only") from e
        raise ValueError(f"{where} returned values for {key!r} that are not numbers ({e})") from e
    if array.null_count or (pa.types.is_list(array.type) and array.flatten().null_count):
        raise ValueError(f"{where} returned None among the values for {key!r}")
    item = array.type.value_type if pa.types.is_list(array.type) else array.type
    if pa.types.is_list(item) or pa.types.is_large_list(item):
        raise ValueError(f"{where} returned nested sequences for {key!r} (one row, one list)")
    if not (pa.types.is_integer(item) or pa.types.is_floating(item) or pa.types.is_boolean(item)):
        raise ValueError(f"{where} returned values of type {item} for {key!r}, not numbers")
    # Token ids, masks and type ids index embeddings: a float there is a bug upstream, and a
    # sequence is padded into integers (steps/batching.py), which would cut 1.7 to 1 silently.
    if pa.types.is_floating(item) and (key in INTEGER_KEYS or pa.types.is_list(array.type)):
        raise ValueError(
            f"{where} returned floating-point values for {key!r}: token ids, masks and every "
            "sequence input are integers"
        )
    return array


def _masked_lengths(mask: pa.ListArray, lengths: np.ndarray) -> np.ndarray:
    """Right-padded rows (the tokenizers' default) are as long as their attention mask says:
    ones, then zeros. A row whose mask has another shape (left-padded) keeps its length."""
    values = mask.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = mask.offsets.to_numpy()
    starts = offsets[:-1] - offsets[0]
    real = np.add.reduceat(values, starts) if len(values) else np.zeros(len(lengths), np.int64)
    # Ones then zeros: every value 0 or 1, and no step up inside a row.
    step_up = np.zeros(len(values), bool)
    step_up[1:] = values[1:] > values[:-1]
    step_up[starts] = False
    bad = (
        np.add.reduceat(step_up | (values > 1) | (values < 0), starts) > 0
        if len(values)
        else real > 0
    )
    right_padded = ~bad & (real > 0) & (real < lengths)
    return np.where(right_padded, real, lengths)


def write_inputs(directory: Path, inputs: dict) -> None:
    (directory / INPUTS_FILE).write_text(json.dumps(inputs, indent=2))


def read_inputs(directory: Path, model_name: str, keys: list[str]) -> dict:
    """This model's padding values and which inputs are sequences, as prepare recorded them."""
    path = directory / INPUTS_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: the prepared data predates dynamic padding; run prepare again"
        )
    info = json.loads(path.read_text()).get(model_name)
    if info is None or any(k not in info["pad"] for k in keys):
        raise ValueError(f"{path} has no inputs {keys} for model {model_name!r}")
    return info


def read_split(directory: Path) -> pa.Table:
    """A split prepare saved with `datasets.Dataset.save_to_disk`, read the way
    `datasets.load_from_disk` reads it (its Arrow stream files, memory-mapped, in the order
    state.json lists them), without importing datasets, which every training job would pay for
    (docs/performance.md)."""
    state = Path(directory) / "state.json"
    if not state.exists():
        raise FileNotFoundError(f"{state} is missing: {directory} is not a split prepare saved")
    files = [Path(directory) / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    return pa.concat_tables(pa.ipc.open_stream(pa.memory_map(str(f))).read_all() for f in files)


class Batches:
    """One model's rows held in memory, padded per batch: a DataLoader's `collate_fn` over
    row indices. Each batch is padded to its longest row (rounded up to `multiple_of`).

    A sequence column is held as Arrow holds it, its rows' values end to end in one numpy
    array with each row's offset (`ListArray.values` and `.offsets`, zero-copy where the split
    is one chunk), and a batch is gathered from it with whole-array indexing, no Python per row
    or token (bench/loader.py measures it against building batches from Python lists row by
    row; docs/performance.md has the figures).

    Rows are used whole: prepare cut them, once. `max_length`, the length prepare recorded
    (encoding.json), is a check: a longer row means the data is not what prepare wrote, and
    is an error, never cut here."""

    def __init__(
        self,
        table: pa.Table,
        model_name: str,
        keys: list[str],
        inputs: dict,
        max_length: int | None = None,
        multiple_of: int = 1,
        labels: bool = True,
    ):
        self.keys, self.multiple_of = keys, multiple_of
        self.pad = {k: inputs["pad"][k] for k in keys}
        sequence = set(inputs["sequence"])
        columns = {k: table.column(f"{model_name}_{k}") for k in keys}
        self.sequences = _shared_offsets({k: _rows(columns[k]) for k in keys if k in sequence})
        # A number per row: the whole column through torch.tensor once, so a batch has the
        # dtype torch gives those values (int64, float32, bool).
        self.scalars = {k: torch.tensor(columns[k].to_pylist()) for k in keys if k not in sequence}
        self.lengths = np.asarray(table.column(length_column(model_name)), dtype=np.int64)
        if max_length is not None and len(self.lengths) and self.lengths.max() > max_length:
            row = int(np.argmax(self.lengths))
            raise ValueError(
                f"row {row} of model {model_name!r} has {self.lengths[row]} tokens, more than "
                f"the {max_length} prepare recorded cutting rows to (encoding.json): the "
                "prepared data is not what prepare wrote; run prepare again"
            )
        self.labels = torch.tensor(table.column("label_id").to_pylist()) if labels else None

    def __len__(self) -> int:
        return len(self.lengths)

    def __call__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        rows = np.asarray(indices, dtype=np.int64).reshape(-1)
        longest = int(self.lengths[rows].max()) if len(rows) else 0
        width = -(-longest // self.multiple_of) * self.multiple_of
        picked = torch.from_numpy(rows)
        gathers: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        batch: dict[str, torch.Tensor] = {}
        for key in self.keys:
            if key in self.scalars:
                batch[key] = self.scalars[key][picked]
                continue
            values, offsets = self.sequences[key]
            if id(offsets) not in gathers:  # inputs of one row layout share where to copy
                gathers[id(offsets)] = _gather(offsets, rows, width)
            inside, source = gathers[id(offsets)]
            out = np.full((len(rows), width), self.pad[key], dtype=np.int64)
            out[inside] = values[source]
            batch[key] = torch.from_numpy(out)
        if self.labels is not None:
            batch["label_id"] = self.labels[picked]
        return batch


def _rows(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """A list column's values end to end, and where each row starts (one more offset than
    rows: the end of the last). Offsets index the chunk's whole values buffer, a sliced
    chunk's too: pyarrow's `ListArray.values` is "the underlying array of values ...
    ignoring the array's offset" (its docstring), and `.offsets` are the slice's own."""
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    values = array.values.to_numpy(zero_copy_only=False)
    return values, array.offsets.to_numpy(zero_copy_only=False).astype(np.int64)


def _shared_offsets(columns: dict[str, tuple]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The same offsets array for every input of the same row layout (input_ids and its
    attention mask), so a batch computes where to copy once for them."""
    seen: list[np.ndarray] = []
    out = {}
    for key, (values, offsets) in columns.items():
        same = next((s for s in seen if np.array_equal(s, offsets)), None)
        if same is None:
            seen.append(offsets)
            same = offsets
        out[key] = (values, same)
    return out


def _gather(offsets: np.ndarray, rows: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Which cells of a (rows, width) batch hold a value, and each one's place in the values:
    a row's first `width` values (a row stored padded can be longer than the batch's width;
    its padding is cut), the rest of the row padding."""
    starts = offsets[rows]
    positions = np.arange(width)
    inside = positions < (offsets[rows + 1] - starts)[:, None]
    return inside, (starts[:, None] + positions)[inside]


def by_length(
    lengths: np.ndarray, batch_size: int, max_tokens: int | None = None
) -> list[list[int]]:
    """Batches of row indices sorted by length (longest first): evaluation pads least. With
    `max_tokens`, a batch also holds at most that many tokens (rows x its longest row)."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    if not max_tokens:
        return [order[i : i + batch_size].tolist() for i in range(0, len(order), batch_size)]
    batches, start = [], 0
    while start < len(order):
        width = max(1, int(lengths[order[start]]))  # the longest row of the batch comes first
        rows = max(1, min(batch_size, max_tokens // width))
        batches.append(order[start : start + rows].tolist())
        start += rows
    return batches
