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
import torch

INPUTS_FILE = "inputs.json"  # in the labels channel: {model: {"keys", "pad", "sequence"}}
LENGTH_SUFFIX = "__length"  # `<model>__length`: the row's real length (tokens, padding excluded)


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
) -> tuple[dict[str, list], list[str], list[int]]:
    """The columns `keys` names from one batch of `encode`'s output, the columns dropped, and
    each row's real length. Raises ValueError naming `where` (the user's encode) on any shape
    that could not be batched."""
    if not isinstance(encoded, Mapping) or not encoded:
        raise TypeError(
            f"{where} must return a mapping of column name to per-row values (a dict or the "
            f"tokenizer's BatchEncoding), got {type(encoded).__name__}"
        )
    missing = [k for k in keys if k not in encoded]
    if missing:
        raise ValueError(
            f"{where} returned no {missing} (ordered_input_keys names them; it returned {list(encoded)})"
        )
    columns = {k: _as_list(encoded[k]) for k in keys}
    dropped = [k for k in encoded if k not in keys]
    lengths = [0] * rows
    for key, values in columns.items():
        if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != rows:
            got = len(values) if isinstance(values, Sequence) else type(values).__name__
            raise ValueError(
                f"{where} returned {got} values for {key!r} for a batch of {rows} rows"
            )
    sequence_keys = [k for k in keys if rows and isinstance(columns[k][0], Sequence)]
    for i in range(rows):
        row_lengths = {k: len(columns[k][i]) for k in sequence_keys}
        if sequence_keys and len(set(row_lengths.values())) != 1:
            raise ValueError(
                f"{where} returned inputs of different lengths for one row: {row_lengths}"
            )
        for k in keys:
            is_sequence = isinstance(columns[k][i], Sequence)
            if is_sequence != (k in sequence_keys):
                raise ValueError(f"{where} returned {k!r} as a sequence for some rows only")
            if is_sequence and any(isinstance(x, Sequence) for x in columns[k][i][:1]):
                raise ValueError(f"{where} returned nested sequences for {k!r} (one row, one list)")
        if sequence_keys:
            lengths[i] = next(iter(row_lengths.values()))
            if lengths[i] == 0:
                raise ValueError(f"{where} returned an empty sequence for row {i} of a batch")
            mask = columns.get("attention_mask")
            if mask is not None and "attention_mask" in sequence_keys:
                # Right-padded rows (the tokenizers' default) are as long as their mask says;
                # a left-padded row keeps its stored length.
                real = int(sum(mask[i]))
                if 0 < real < lengths[i] and not any(mask[i][real:]) and all(mask[i][:real]):
                    lengths[i] = real
    return columns, dropped, lengths


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


class Batches:
    """One model's rows held in memory, padded per batch: a DataLoader's `collate_fn` over
    row indices. Each batch is padded to its longest row (rounded up to `multiple_of`)."""

    def __init__(self, dataset, model_name: str, keys: list[str], inputs: dict,
                 max_length: int | None = None, multiple_of: int = 1, labels: bool = True):  # fmt: skip
        self.keys, self.multiple_of, self.max_length = keys, multiple_of, max_length
        self.pad = {k: inputs["pad"][k] for k in keys}
        self.sequence = set(inputs["sequence"])
        self.columns = {k: dataset[f"{model_name}_{k}"] for k in keys}
        self.lengths = np.asarray(dataset[length_column(model_name)], dtype=np.int64)
        if max_length:
            self.lengths = np.minimum(self.lengths, max_length)
        self.labels = torch.tensor(dataset["label_id"]) if labels else None

    def __len__(self) -> int:
        return len(self.lengths)

    def __call__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        longest = int(self.lengths[indices].max()) if len(indices) else 0
        width = -(-longest // self.multiple_of) * self.multiple_of
        batch: dict[str, torch.Tensor] = {}
        for key in self.keys:
            column = self.columns[key]
            if key not in self.sequence:
                batch[key] = torch.tensor([column[i] for i in indices])
                continue
            out = np.full((len(indices), width), self.pad[key], dtype=np.int64)
            for row, i in enumerate(indices):
                values = column[i][:width]
                out[row, : len(values)] = values
            batch[key] = torch.from_numpy(out)
        if self.labels is not None:
            batch["label_id"] = self.labels[indices]
        return batch


def by_length(lengths: np.ndarray, batch_size: int) -> list[list[int]]:
    """Batches of row indices sorted by length (longest first): evaluation pads least."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    return [order[i : i + batch_size].tolist() for i in range(0, len(order), batch_size)]
