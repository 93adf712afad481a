"""Every key of the run tree, named here and nowhere else.

`ExperimentTree` names an experiment's keys (raw data, raw versions, data versions, the cache,
the local registry, runs); `DataTree`, `RunTree` and `PredictionTree` name the keys under one
data version, one run and one `smpipe predict`. docs/run-tree.md draws the tree they name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from steps.runtime.names import STEP_METADATA_FILE

RUN_NUM_WIDTH = 4
# The names of the local registry's files under a group's folder (ExperimentTree.registry): a
# version's record (and a change's own name in its version's folder), and an approval change.
REGISTRY_RECORD = re.compile(r"(\d+)\.json")
REGISTRY_CHANGE = re.compile(r"(\d+)/(\d+)\.json")
# What prepare writes under prepared/, each a manifested folder.
SPLITS = ("train", "validation", "test", "labels")


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
    def raw_record(self) -> str:
        """What `smpipe upload` put in raw/, so a later upload is compared by content without
        reading raw/ back (pipeline/raw_data.py)."""
        return f"{self.experiment}/raw.json"

    @property
    def raw_versions_root(self) -> str:
        return f"{self.experiment}/raw-versions/"

    def raw_version(self, digest: str) -> RawVersion:
        """A local RAW_DATA folder's content in the store, named by its digest."""
        return RawVersion(f"{self.raw_versions_root}{digest}/")

    @property
    def data_root(self) -> str:
        return f"{self.experiment}/data/"

    @property
    def experiment_html(self) -> str:
        """experiment.html: every run on one page, linked to their reports (pipeline/report.py)."""
        return f"{self.experiment}/experiment.html"

    @property
    def runs_root(self) -> str:
        return f"{self.experiment}/runs/"

    def owner_of_models(self, models: str) -> RunTree | None:
        """The run whose models/ folder the key `models` is; None for another folder."""
        label = models[len(self.runs_root) :].split("/", 1)[0]
        owner = self.run(int(label)) if label.isdigit() else None
        return owner if owner and owner.models == models else None

    def data(self, data_version: int | str) -> DataTree:
        """A data version: the run_num of the run that produced it (`0003`), so data is
        versioned like runs and never overwritten. A str is a label used as is: the dry run's
        '<next run_num>'."""
        label = data_version if isinstance(data_version, str) else run_label(data_version)
        return DataTree(f"{self.data_root}{label}/")

    @property
    def registry_root(self) -> str:
        """The local model registry: one folder per model package group."""
        return f"{self.experiment}/registry/"

    def registry(self, group: str) -> str:
        """The local model registry's versions of one model package group."""
        return f"{self.registry_root}{group}/"

    def registry_version(self, group: str, version: int) -> str:
        return f"{self.registry(group)}{version:0{RUN_NUM_WIDTH}d}.json"

    def registry_changes(self, group: str, version: int) -> str:
        """The approval changes of one version (`smpipe approve`), each an object of its own."""
        return f"{self.registry(group)}{version:0{RUN_NUM_WIDTH}d}/"

    def cache_folder(self, step: str) -> str:
        """Every cache entry of a data step."""
        return f"{self.experiment}/cache/{step}/"

    def cache_entry(self, step: str, key: str) -> str:
        """The data version a data step computed from the inputs whose digest is `key`."""
        return f"{self.cache_folder(step)}{key}.json"

    def registry_change(self, group: str, version: int, change: int) -> str:
        """Change `change` (1, 2, ...) of a version's approval, created once and never rewritten."""
        return f"{self.registry_changes(group, version)}{change:06d}.json"

    def run(self, run_num: int | str) -> RunTree:
        label = run_num if isinstance(run_num, str) else run_label(run_num)
        return RunTree(f"{self.runs_root}{label}/", run_num if isinstance(run_num, int) else 0)


@dataclass(frozen=True)
class RawVersion:
    """One content of a local RAW_DATA folder: files/ holds exactly its data files (what the
    reconcile job reads, nothing of ours among them); the manifest beside files/ lists them and
    is written last."""

    prefix: str

    @property
    def digest(self) -> str:
        return self.prefix.rstrip("/").rsplit("/", 1)[-1]

    @property
    def lease(self) -> str:
        """Held while a driver uploads this version and claims the run that reads it, or a
        prune removes it (pipeline/runs.py `held`)."""
        return f"{self.prefix}LEASE"

    @property
    def files(self) -> str:
        return f"{self.prefix}files/"


def raw_version_digest(key: str) -> str | None:
    """The digest of the raw version whose files/ `key` is, or None for any other key."""
    parts = key.rstrip("/").split("/")
    if len(parts) >= 4 and parts[-3] == "raw-versions" and parts[-1] == "files":
        return parts[-2]
    return None


@dataclass(frozen=True)
class DataTree:
    prefix: str

    @property
    def reconciled(self) -> str:
        return f"{self.prefix}reconciled/"

    @property
    def prepared(self) -> str:
        return f"{self.prefix}prepared/"

    @property
    def snapshot_info(self) -> str:
        """snapshot.json: content hash, rows, label counts, what reconcile dropped."""
        return f"{self.prefix}reconciled/snapshot.json"

    @property
    def prepared_from(self) -> str:
        """from.json: the reconciled data version and snapshot hash prepare read (another
        version's, when reconcile was reused)."""
        return f"{self.prefix}prepared/from.json"

    def split(self, name: str) -> str:
        """train/, validation/, test/ or labels/ of the prepared data."""
        return f"{self.prefix}prepared/{name}/"

    @property
    def id2label(self) -> str:
        return labels_of(self.split("labels"))

    @property
    def version(self) -> str:
        """The data version's label (`0003`)."""
        return self.prefix.rstrip("/").rsplit("/", 1)[-1]


def labels_of(folder: str) -> str:
    """id2label.json in a prepared labels/ folder or a model's folder (which keeps its own)."""
    return f"{folder}id2label.json"


def model_folder(models: str, model_name: str) -> str:
    """A model as inference runs it, under a run's models/ (RunTree.models): where inference
    and the registry find it, whichever run trained it."""
    return f"{models}{model_name}/model/"


def step_report(prefix: str) -> str:
    """What a job's step wrote of itself (steps/runtime/names.py STEP_METADATA_FILE), in its
    report output or its training output folder."""
    return f"{prefix}{STEP_METADATA_FILE}"


@dataclass(frozen=True)
class RunTree:
    prefix: str
    run_num: int

    @property
    def experiment(self) -> str:
        return self.prefix.split("/")[0]

    @property
    def label(self) -> str:
        return self.prefix.rstrip("/").rsplit("/", 1)[-1]

    @property
    def claim(self) -> str:
        return f"{self.prefix}CLAIM"

    @property
    def lease(self) -> str:
        """Held by the one `--resume` or `prune` acting on this ended run (pipeline/runs.py)."""
        return f"{self.prefix}LEASE"

    @property
    def settings(self) -> str:
        return f"{self.prefix}settings.ini"

    @property
    def metadata(self) -> str:
        return f"{self.prefix}metadata.json"

    @property
    def heartbeat(self) -> str:
        """Rewritten by the run's driver every HEARTBEAT_SECONDS while it runs."""
        return f"{self.prefix}heartbeat.json"

    def step_metadata(self, step: str) -> str:
        return f"{self.prefix}metadata/{step}.json"

    @property
    def logs(self) -> str:
        return f"{self.prefix}logs/"

    def log(self, job_name: str) -> str:
        return f"{self.logs}{job_name}.log"

    def model(self, model_name: str) -> str:
        return f"{self.prefix}models/{model_name}/"

    def final_model(self, model_name: str) -> str:
        """The model as inference runs it: weights, the exported programs, the record."""
        return model_folder(self.models, model_name)

    def model_output(self, model_name: str) -> str:
        """What a model's training job wrote besides the model (its report, curves)."""
        return f"{self.prefix}models/{model_name}/output/"

    def best_trial_model(self, model_name: str) -> str:
        """A tuning study's best model before its export; removed once exported."""
        return f"{self.prefix}models/{model_name}/best-trial/"

    def checkpoints(self, model_name: str) -> str:
        return f"{self.prefix}checkpoints/{model_name}/"

    @property
    def checkpoints_root(self) -> str:
        """Every model's and every trial's checkpoints (a trial's are `<model>-trial-NNN`)."""
        return f"{self.prefix}checkpoints/"

    @property
    def failed_jobs(self) -> str:
        """The folders of the run's failed local jobs, kept for inspection when the store is a
        folder on this machine (pipeline/backends/local.py `kept_jobs_folder`)."""
        return f"{self.prefix}failed-jobs/"

    @property
    def tuning_root(self) -> str:
        return f"{self.prefix}tuning/"

    def tuning(self, model_name: str) -> str:
        return f"{self.prefix}tuning/{model_name}/"

    def tuning_record(self, model_name: str) -> str:
        """What a tuning job did, in one shape on every backend (pipeline/tuning_record.py)."""
        return f"{self.prefix}tuning/{model_name}/tuning.json"

    def trial(self, model_name: str, trial: int) -> str:
        return f"{self.prefix}tuning/{model_name}/trial-{trial:03d}/"

    def trial_model(self, model_name: str, trial: int) -> str:
        return f"{self.trial(model_name, trial)}model/"

    def trial_output(self, model_name: str, trial: int) -> str:
        return f"{self.trial(model_name, trial)}output/"

    def local_trial_checkpoints(self, model_name: str, trial: int) -> str:
        """A local study's trial's checkpoints (pipeline/backends/local_tuning.py)."""
        return self.checkpoints(f"{model_name}-trial-{trial:03d}")

    def trials(self, model_name: str, suffix: str) -> str:
        """trials.csv and trials.png, the tuning record's table and chart (every backend);
        trials.json, a local study's own journal of its trials (for --resume)."""
        return f"{self.prefix}tuning/{model_name}/trials.{suffix}"

    @property
    def inference(self) -> str:
        return f"{self.prefix}inference/"

    @property
    def predictions(self) -> str:
        return f"{self.prefix}predictions/"

    def prediction(self, label: str) -> PredictionTree:
        """One `smpipe predict` with a model of this run (pipeline/predict/)."""
        return PredictionTree(f"{self.predictions}{label}/")

    def report(self, step: str) -> str:
        """Where a processing job's own Metadata section (step_metadata.json) lands."""
        return f"{self.prefix}jobs/{step}/"

    @property
    def models(self) -> str:
        """Every model of the run: the one input inference reads them all from."""
        return f"{self.prefix}models/"

    @property
    def training_output(self) -> str:
        """SageMaker's OutputDataConfig: <job>/output/model.tar.gz and output.tar.gz."""
        return f"{self.prefix}jobs/training/"

    def model_quality(self, model_name: str) -> str:
        """A registered model's test metrics, the document its ModelMetrics.ModelQuality names."""
        return f"{self.prefix}registry/{model_name}/model_quality.json"

    def registry_archive(self, model_name: str) -> str:
        """A registered model's model.tar.gz, packed from its folder when no training job's
        archive holds it (a tuned model: exported after its study)."""
        return f"{self.prefix}registry/{model_name}/model.tar.gz"

    @property
    def report_html(self) -> str:
        """report.html: the run on one self-contained page (pipeline/report.py)."""
        return f"{self.prefix}report.html"

    @property
    def code(self) -> str:
        return f"{self.prefix}code/"


@dataclass(frozen=True)
class PredictionTree:
    prefix: str

    @property
    def code(self) -> str:
        """The job's code: this project's steps/ with the run's own user functions."""
        return f"{self.prefix}code/"

    @property
    def input(self) -> str:
        """The texts as parquet parts (part-NNNNN.parquet), sharded across instances by key."""
        return f"{self.prefix}input/"

    @property
    def output(self) -> str:
        """One parquet part of predictions per input part, named as it."""
        return f"{self.prefix}output/"

    @property
    def record(self) -> str:
        """record.json: run, model, input hash, counts, malformed rows (OUTPUT.json too)."""
        return f"{self.prefix}record.json"


def parse_run_label(label: str) -> int | None:
    return int(label) if label.isdigit() else None
