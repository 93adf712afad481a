"""Every key of the run tree, named here and nowhere else.

    <store>/<experiment>/
        raw/                                  the user's raw data (input, never written by a run)
        data/<data_version>/                  experiment-level data, shared by later runs
            reconciled/                       snapshot + manifest (hash, rows, label counts, drops)
            prepared/                         train/ validation/ test/ (save_to_disk), id2label.json
        runs/<run_num>/                       everything one run produces
            CLAIM                             written first, atomically: the run_num is taken
            settings.ini                      the settings as applied, secrets redacted
            metadata.json                     every step's section merged
            metadata/<step>.json              one object per step: steps never overwrite each other
            logs/<job_name>.log
            models/<model>/                   model/ (safetensors, TorchScript, curves), output/
            checkpoints/<model>/              synced training State (spot, restarts)
            tuning/<model>/                   trials and the best one
            inference/                        per-model and comparison statistics

A data_version is the run_num of the run that produced it (`0003`), so data is versioned
like runs and never overwritten; a run that skips reconcile/prepare reuses the newest
complete version and records which in its Metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

RUN_NUM_WIDTH = 4


def run_label(run_num: int) -> str:
    return f"{run_num:0{RUN_NUM_WIDTH}d}"


@dataclass(frozen=True)
class ExperimentTree:
    experiment: str

    @property
    def root(self) -> str:
        return f"{self.experiment}/"

    @property
    def raw(self) -> str:
        return f"{self.experiment}/raw/"

    @property
    def data_root(self) -> str:
        return f"{self.experiment}/data/"

    @property
    def runs_root(self) -> str:
        return f"{self.experiment}/runs/"

    def data(self, data_version: int) -> DataTree:
        return DataTree(f"{self.data_root}{run_label(data_version)}/")

    def run(self, run_num: int) -> RunTree:
        return RunTree(f"{self.runs_root}{run_label(run_num)}/", run_num)


@dataclass(frozen=True)
class DataTree:
    prefix: str

    @property
    def reconciled(self) -> str:
        return f"{self.prefix}reconciled/"

    @property
    def prepared(self) -> str:
        return f"{self.prefix}prepared/"


@dataclass(frozen=True)
class RunTree:
    prefix: str
    run_num: int

    @property
    def claim(self) -> str:
        return f"{self.prefix}CLAIM"

    @property
    def settings(self) -> str:
        return f"{self.prefix}settings.ini"

    @property
    def metadata(self) -> str:
        return f"{self.prefix}metadata.json"

    def step_metadata(self, step: str) -> str:
        return f"{self.prefix}metadata/{step}.json"

    def log(self, job_name: str) -> str:
        return f"{self.prefix}logs/{job_name}.log"

    def model(self, model_name: str) -> str:
        return f"{self.prefix}models/{model_name}/"

    def checkpoints(self, model_name: str) -> str:
        return f"{self.prefix}checkpoints/{model_name}/"

    def tuning(self, model_name: str) -> str:
        return f"{self.prefix}tuning/{model_name}/"

    def trial(self, model_name: str, trial: int) -> str:
        return f"{self.prefix}tuning/{model_name}/trial-{trial:03d}/"

    @property
    def inference(self) -> str:
        return f"{self.prefix}inference/"

    @property
    def job_output(self) -> str:
        return f"{self.prefix}jobs/"


def parse_run_label(label: str) -> int | None:
    return int(label) if label.isdigit() else None
