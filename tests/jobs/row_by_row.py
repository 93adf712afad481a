"""The collate steps/batching.py's `Batches` replaced: each batch built from Python lists, row
by row. tests/test_dynamic_padding.py holds `Batches` to its batches, and bench/loader.py times
it beside `Batches` as the baseline."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from steps.batching import length_column


class RowByRow:
    """`Batches`' interface, each batch copied row by row out of Python lists."""

    def __init__(
        self,
        table: pa.Table,
        model_name: str,
        keys: list[str],
        inputs: dict,
        multiple_of: int = 1,
        labels: bool = True,
    ):
        self.keys, self.multiple_of = keys, multiple_of
        self.pad = {k: inputs["pad"][k] for k in keys}
        self.sequence = set(inputs["sequence"])
        self.columns = {k: table.column(f"{model_name}_{k}").to_pylist() for k in keys}
        self.lengths = np.asarray(table.column(length_column(model_name)), dtype=np.int64)
        self.labels = torch.tensor(table.column("label_id").to_pylist()) if labels else None

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
