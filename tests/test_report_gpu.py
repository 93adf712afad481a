"""What a training job measured on its GPUs (its `gpu_usage`, copied into its step's Metadata
section) is shown in the report's Timings, beside the step's peak memory. No GPU here: the
record is the one a GPU run writes, the report is the real one."""

from __future__ import annotations

import json
import re

from pipeline.paths import ExperimentTree
from pipeline.report import write_report
from pipeline.store import LocalStore

TREE = ExperimentTree("gpu-exp")


def test_the_report_shows_each_models_gpu_memory_beside_the_steps_peak(tmp_path):
    store = LocalStore(tmp_path / "store")
    gpu = {"minilm": {"devices": 2, "max_memory_allocated_mb": 3071.6}}
    record = {
        "experiment_name": "gpu-exp",
        "status": "completed",
        "steps": {
            "train": {"step": "train", "status": "completed", "time_taken": 61.0,
                      "memory_usage": 2048.0, "gpu_usage": gpu, "job_names": ["t-1"]},
            "inference": {"step": "inference", "status": "completed", "time_taken": 9.0,
                          "memory_usage": 900.0, "job_names": ["i-1"]},
        },
    }  # fmt: skip
    store.put_bytes(TREE.run(1).metadata, json.dumps(record).encode())
    page = store.get_bytes(write_report(store, TREE, 1)).decode()
    rows = re.findall(r"<tr><td>(train|inference)</td>.*?</tr>", page, re.S)
    assert rows == ["train", "inference"]
    timings = page.split('id="timings"')[1]
    assert "<td>2048; minilm: GPU 3072 (2 device(s))</td>" in timings
    assert "<td>900</td>" in timings  # a step that ran on no GPU says nothing of one
