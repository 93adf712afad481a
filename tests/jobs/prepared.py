"""Small prepared splits for the bag-of-embeddings model, as prepare writes them: unpadded rows
of 4 to 16 tokens, the label given away by which marker token a row holds. For training jobs
started directly (tests/jobs/training_job.py, bench/warm_start.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import datasets

from steps.batching import write_inputs
from steps.prepared_files import encoding_record, write_encoding


def write_small_splits(root: Path, validation: int = 18) -> dict[str, Path]:
    """train (64 rows), validation (18) and labels under `root`: each channel's folder."""
    rng = random.Random(0)

    def rows(n):
        # Unpadded rows of 4 to 16 tokens, as prepare stores them: batches are grouped by length.
        labels = [i % 3 for i in range(n)]
        ids = [
            [101]
            + [rng.randrange(1000, 20000) for _ in range(rng.randrange(1, 14))]
            + [2000 + 7 * y, 102]
            for y in labels
        ]
        return {"bow_input_ids": ids, "bow_attention_mask": [[1] * len(i) for i in ids],
                "bow__length": [len(i) for i in ids], "label_id": labels}  # fmt: skip

    datasets.Dataset.from_dict(rows(64)).save_to_disk(str(root / "train"))
    datasets.Dataset.from_dict(rows(validation)).save_to_disk(str(root / "validation"))
    (root / "labels").mkdir()
    (root / "labels/id2label.json").write_text(json.dumps({"0": "a", "1": "b", "2": "c"}))
    write_inputs(root / "labels", {"bow": {"keys": ["input_ids", "attention_mask"],
                 "pad": {"input_ids": 0, "attention_mask": 0},
                 "sequence": ["input_ids", "attention_mask"]}})  # fmt: skip
    write_encoding(root / "labels", encoding_record(16, {"bow": {}}))  # rows of 4 to 16 tokens
    return {c: root / c for c in ("train", "validation", "labels")}
