"""Issue 29, tuning and training: a trial stopped early keeps the objective it reported, no
trial is stopped at its last epoch, a split that cannot be made says how many rows a label
needs, and a rotated checkpoint is never the only complete one that S3 may hold.

The tuning cases drive the local tuner's own trial (`trial_objective`, with its pruner) over a
backend that prints the metric lines a trial would, so the pruner's decision is tested without
training anything; the checkpoint cases write real checkpoints of a tiny model."""

from __future__ import annotations

import csv
import io
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.jobs import JobResult, TrainingJob, TuningJob
from pipeline.paths import ExperimentTree
from pipeline.search_space import Categorical
from pipeline.store import LocalStore
from steps import checkpointing as ckpt
from steps.metrics import DEFINITIONS, METRICS, metric_line
from steps.sampler import ResumableBatchSampler

OBJECTIVE = "validation:f1"


def tuning_job(epochs: int = 3, max_steps: int = 0) -> TuningJob:
    trial = TrainingJob(
        name="t",
        step="train",
        code="",
        channels={},
        hyperparameters={"model_name": "tiny", "epochs": str(epochs), "max_steps": str(max_steps)},
        model_prefix="exp/runs/0001/models/tiny/best-trial/",
        output_prefix="exp/runs/0001/output/tiny/",
        checkpoint_prefix="exp/runs/0001/checkpoints/tiny/",
        sagemaker_output="exp/runs/0001/sagemaker/",
        metric_definitions=DEFINITIONS,
    )
    return TuningJob(
        name="tune",
        trial=trial,
        ranges={"learning_rate": Categorical(("0.1", "0.2"))},
        strategy="Grid",
        objective_metric=OBJECTIVE,
        objective_type="Maximize",
        max_jobs=2,
        max_parallel_jobs=1,
        early_stopping="Auto",
    )


class PrintingBackend:
    """A trial prints one metric line an epoch, its f1 values given by trial number; a watch
    that says stop ends it there (SIGTERM: it checkpoints and exits), as the local backend's
    run_training does."""

    def __init__(self, f1_by_trial: dict[int, list[float]], steps_per_epoch: int = 4):
        self.f1_by_trial, self.steps_per_epoch = f1_by_trial, steps_per_epoch
        self.stopped_at: dict[int, int] = {}

    def run_training(self, job: TrainingJob, watch) -> JobResult:
        number, metrics = int(job.model_prefix.split("trial-")[1].split("/")[0]), {}
        for epoch, f1 in enumerate(self.f1_by_trial[number], 1):
            scores = {key: 0.5 for key in METRICS.values()} | {"f1": f1}
            line = metric_line({"epoch": epoch, "step": epoch * self.steps_per_epoch, **scores})
            metrics[OBJECTIVE] = f1
            if watch(line):
                self.stopped_at[number] = epoch
                return JobResult(
                    job.name, "Stopped", "stopped on request", 0.0, 1.0, metrics=metrics
                )
        return JobResult(job.name, "Completed", None, 0.0, 1.0, metrics=metrics)


def study_of(tmp_path, backend, job: TuningJob):
    """The local tuner's study over `backend`: its sampler and pruner, its trials' records."""
    import optuna

    from pipeline.backends.local_tuning import (
        TrialFailed,
        TrialInterrupted,
        Trials,
        distributions,
        search,
        trial_objective,
    )

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    store, run = LocalStore(tmp_path / "store"), ExperimentTree("exp").run(1)
    sampler, pruner, n_trials = search(job, 0)
    study = optuna.create_study(direction="maximize", sampler=sampler, pruner=pruner)
    trials, spaces = Trials(store, run, "tiny"), distributions(job.ranges)
    said = []
    objective = trial_objective(backend, job, run, trials, spaces, said.append)
    study.optimize(objective, n_trials=n_trials, catch=(TrialFailed, TrialInterrupted))
    csv_rows = list(
        csv.DictReader(io.StringIO(store.get_bytes(run.tuning("tiny") + "trials.csv").decode()))
    )
    return trials.records, csv_rows, said


def test_a_trial_stopped_early_keeps_the_last_objective_it_reported(tmp_path):
    # Trial 1 sets the median (0.9 each epoch); trial 2 falls behind it at epoch 1 of 3.
    backend = PrintingBackend({1: [0.9, 0.9, 0.9], 2: [0.25, 0.3, 0.35]})
    records, rows, said = study_of(tmp_path, backend, tuning_job(epochs=3))
    assert backend.stopped_at == {2: 1}
    stopped = records[2]
    assert stopped["status"] == "Stopped" and stopped["stop_reason"].startswith("early stopping")
    # What SageMaker reports for it: the latest objective it emitted.
    assert stopped["objective"] == 0.25
    assert [r["objective"] for r in rows] == ["0.9", "0.25"]
    assert [r["status"] for r in rows] == ["Completed", "Stopped"]


# Optuna's median pruner stops a trial whose best value so far is below the median of the
# completed trials' values at the same epoch (optuna/pruners/_percentile.py). Trial 1's values
# make that median low until the last epoch and high at it; trial 2 keeps 0.5 throughout.
@pytest.mark.parametrize(
    "epochs, max_steps, first",
    [
        (3, 0, [0.1, 0.1, 0.9]),  # its last epoch (EPOCHS)
        (3, 8, [0.1, 0.9]),  # MAX_STEPS (8) ends it at its second epoch of 4 steps
        (1, 0, [0.9]),  # its only epoch
    ],
)
def test_no_trial_is_stopped_at_its_last_epoch(tmp_path, epochs, max_steps, first):
    values = [0.5] * len(first)
    backend = PrintingBackend({1: first, 2: values})
    records, rows, said = study_of(tmp_path, backend, tuning_job(epochs, max_steps))
    assert backend.stopped_at == {}, said
    assert records[2]["status"] == "Completed" and records[2]["objective"] == 0.5
    assert records[2]["epochs"] == {i: 0.5 for i in range(1, len(values) + 1)}
    assert [r["status"] for r in rows] == ["Completed", "Completed"]


def test_a_trial_is_still_stopped_before_its_last_epoch(tmp_path):
    """The rule above does not switch early stopping off: the same trial with three epochs
    to run is stopped at its second."""
    backend = PrintingBackend({1: [0.1, 0.9, 0.9], 2: [0.5, 0.5, 0.5]})
    records, _, _ = study_of(tmp_path, backend, tuning_job(epochs=3))
    assert backend.stopped_at == {2: 2} and records[2]["objective"] == 0.5


# -- a stratified split that cannot be made ---------------------------------------------------


def split_args(train=0.8, validation=0.1, test=0.1, seed=0):
    return SimpleNamespace(
        train_fraction=train, validation_fraction=validation, test_fraction=test, seed=seed
    )


def test_a_split_that_cannot_be_made_says_how_many_rows_a_label_needs_and_names_a_few():
    from steps.splits import stratified_split

    # 200 labels of 4 rows, and one of 12 (enough): 0.8/0.1/0.1 needs 10 rows a label.
    counts = {f"label-{i:03d}": 4 for i in range(200)} | {"label-big": 12, "label-000": 3}
    id2label = dict(enumerate(counts))
    labels = [i for i, name in id2label.items() for _ in range(counts[name])]
    with pytest.raises(ValueError) as raised:
        stratified_split(labels, id2label, split_args())
    said = str(raised.value)
    assert "a label needs at least 10 rows for these fractions" in said
    # The fewest rows first, five named, the others counted; the label with enough is not one.
    assert (
        "labels with too few rows {'label-000': 3, 'label-001': 4, 'label-002': 4, "
        "'label-003': 4, 'label-004': 4} and 195 more (200 of 201 labels)"
    ) in said
    assert "label-005" not in said and "label-big" not in said
    assert "\n" not in said and len(said) < 500


@pytest.mark.parametrize(
    "fractions", [(0.8, 0.1, 0.1), (0.7, 0.15, 0.15), (0.5, 0.3, 0.2), (0.9, 0.05, 0.05)]
)
@pytest.mark.parametrize("labels_count", [2, 7, 60])
def test_the_rows_a_label_needs_are_enough_for_every_split_to_hold_it(fractions, labels_count):
    """The figure the message gives is one the split accepts: with that many rows per label
    (a few labels with a row or two more) every label is in train, validation and test."""
    from steps.splits import rows_a_label_needs, stratified_split

    need = rows_a_label_needs(*fractions)
    extra = np.random.default_rng(labels_count).integers(0, 3, labels_count)
    labels = [i for i in range(labels_count) for _ in range(need + int(extra[i]))]
    split = stratified_split(labels, {}, split_args(*fractions))
    for part, rows in split.items():
        assert {labels[i] for i in rows} == set(range(labels_count)), part


# -- checkpoints that S3 holds in part ---------------------------------------------------------


class OneProcess:
    """What save_checkpoint and train.py's resume read of an Accelerator: one process."""

    is_main_process = is_local_main_process = True
    process_index, num_processes = 0, 1

    def __init__(self) -> None:
        self.said: list[str] = []

    def wait_for_everyone(self) -> None:
        pass

    def print(self, *parts) -> None:
        self.said.append(" ".join(map(str, parts)))


class OtherNode(OneProcess):
    """The first process of a node other than the main one (multi-node SageMaker): its rank's
    files in the node's own checkpoint folder, no CURRENT."""

    is_main_process = False
    process_index = 1


def tiny_state() -> ckpt.State:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    sampler = ResumableBatchSampler(8, 2, 1, 1, 0, seed=1)
    return ckpt.State(model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler,
                      seed=1, run_name="r")  # fmt: skip


def save(directory: Path, state: ckpt.State, step: int, keep: int = 1) -> None:
    """A checkpoint at `step` as train.py writes one, its weights (and best) all `step`."""
    state.step = step
    with torch.no_grad():
        state.model.weight.fill_(step)
    best = {k: v.clone() for k, v in state.model.state_dict().items()}
    ckpt.save_checkpoint(OneProcess(), directory, state, best, keep)


def sagemaker_sync(local: Path, s3: Path, arrived=lambda rel: True) -> None:
    """/opt/ml/checkpoints copied to S3 as SageMaker documents it (model-checkpoints.html):
    what the job deleted is deleted there; of what it wrote, the files `arrived` says reached
    S3 before the job was terminated, each whole (model-train-storage.html: no writes to S3
    when the job is terminated)."""
    s3.mkdir(parents=True, exist_ok=True)
    files = {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()}
    for path in [p for p in s3.rglob("*") if p.is_file()]:
        if path.relative_to(s3).as_posix() not in files:
            path.unlink()
    for rel in sorted(files):
        there = s3 / rel
        if arrived(rel) and not (
            there.exists() and there.read_bytes() == (local / rel).read_bytes()
        ):
            there.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(local / rel, there)
    for folder in sorted((p for p in s3.rglob("*") if p.is_dir()), reverse=True):
        if not any(folder.iterdir()):
            folder.rmdir()


def resume_from(s3: Path, into: Path) -> SimpleNamespace:
    """A new job (a spot restart, `--resume`): S3 copied into its folder, train.py's resume."""
    from steps.train import resume

    shutil.copytree(s3, into)
    job = SimpleNamespace(accelerator=OneProcess(), state=tiny_state(), best_weights=None,
                          resumed_from=None, env=SimpleNamespace(checkpoint_dir=into))  # fmt: skip
    resume(job)
    return job


def test_the_checkpoint_before_the_newest_stays_until_the_next_save_begins(tmp_path):
    state = tiny_state()
    save(tmp_path, state, 10, keep=1)
    save(tmp_path, state, 20, keep=1)
    assert ckpt.checkpoint_names(tmp_path) == ["ckpt-00000010", "ckpt-00000020"]
    assert ckpt.current_checkpoint(tmp_path).name == "ckpt-00000020"
    # The next save makes room first: never more than two on disk, the one being written
    # included.
    begun = ckpt.begin_checkpoint(tmp_path, ckpt.checkpoint_name(30), keep=1)
    assert ckpt.checkpoint_names(tmp_path) == ["ckpt-00000020"] and begun.name.endswith(".tmp")
    save(tmp_path, state, 30, keep=1)
    assert ckpt.checkpoint_names(tmp_path) == ["ckpt-00000020", "ckpt-00000030"]
    save(tmp_path, state, 40, keep=3)  # more than two: as many as asked for
    save(tmp_path, state, 50, keep=3)
    assert ckpt.checkpoint_names(tmp_path) == [f"ckpt-000000{s}" for s in (30, 40, 50)]


def test_a_sigterm_checkpoint_before_an_epochs_end_is_never_written_over_by_the_end(tmp_path):
    """SIGTERM in an epoch's last optimizer step checkpoints before the epoch's end; the resumed
    job ends the epoch and checkpoints at the same step: a checkpoint of its own, on every node
    (the main node's folder and another's, which held the first one's rank files)."""
    for accelerator, folder in (
        (OneProcess(), tmp_path / "main"),
        (OtherNode(), tmp_path / "other"),
    ):
        state = tiny_state()  # 4 batches an epoch
        state.step = state.batch_in_epoch = 4
        ckpt.save_checkpoint(accelerator, folder, state, None, keep=1)
        before_end = folder / f"ckpt-00000004{ckpt.BEFORE_EPOCH_END}"
        written = {p.name: p.read_bytes() for p in before_end.iterdir()}
        state.epoch, state.batch_in_epoch = 1, 0
        ckpt.save_checkpoint(accelerator, folder, state, None, keep=1)
        assert ckpt.checkpoint_names(folder) == [before_end.name, "ckpt-00000004"]
        assert {p.name: p.read_bytes() for p in before_end.iterdir()} == written
    assert ckpt.current_checkpoint(tmp_path / "main").name == "ckpt-00000004"


def test_a_checkpoint_that_current_never_named_is_removed_on_resume(tmp_path):
    """The job ended between step 20's rename and the pointer's: the next resumes from 10, and
    20, which it will write anew, goes."""
    job1, state = tmp_path / "job1", tiny_state()
    save(job1, state, 10)
    save(job1, state, 20)
    ckpt.point_current(job1, job1 / "ckpt-00000010")
    job2 = resume_from(job1, tmp_path / "job2")
    assert job2.state.step == 10 and torch.all(job2.state.model.weight == 10)
    assert ckpt.checkpoint_names(job2.env.checkpoint_dir) == ["ckpt-00000010"]
    assert (
        "removed ['ckpt-00000020']: newer than the checkpoint resumed from" in job2.accelerator.said
    )


@pytest.mark.parametrize("lost", ["state.pt", "rank0.pt", "best_model.pt", "meta.json"])
def test_a_checkpoint_cut_short_on_its_way_to_s3_never_costs_the_one_before(tmp_path, lost):
    """KEEP_CHECKPOINTS = 1. The job checkpoints at steps 10 and 20, both copied to S3; SIGTERM
    at step 23: it checkpoints and exits, and of that checkpoint S3 gets CURRENT and all but
    one file before the job is terminated. The next job resumes from step 20, whole; its next
    checkpoint (30) is cut short too, and the job after it still finds step 20."""
    job1, s3 = tmp_path / "job1", tmp_path / "s3"
    state = tiny_state()
    for step in (10, 20):
        save(job1, state, step)
        sagemaker_sync(job1, s3)
    save(job1, state, 23)  # on SIGTERM
    sagemaker_sync(job1, s3, arrived=lambda rel: rel != f"ckpt-00000023/{lost}")
    job2 = resume_from(s3, tmp_path / "job2")
    assert job2.resumed_from and job2.resumed_from["checkpoint"].endswith("ckpt-00000020")
    assert job2.state.step == 20 and torch.all(job2.best_weights["weight"] == 20)
    assert any("ckpt-00000023 could not be loaded" in line for line in job2.accelerator.said)
    # The one it could not load is removed (it would count as the newest), CURRENT names
    # the one it resumed from.
    assert ckpt.checkpoint_names(job2.env.checkpoint_dir) == ["ckpt-00000020"]
    assert ckpt.current_checkpoint(job2.env.checkpoint_dir).name == "ckpt-00000020"
    save(job2.env.checkpoint_dir, job2.state, 30)
    sagemaker_sync(
        job2.env.checkpoint_dir, s3, arrived=lambda rel: not rel.startswith("ckpt-00000030")
    )
    job3 = resume_from(s3, tmp_path / "job3")
    assert job3.state.step == 20 and torch.all(job3.state.model.weight == 20)
