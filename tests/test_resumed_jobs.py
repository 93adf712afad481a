"""A resumed run on SageMaker (pipeline/backends/resuming.py), played by the emulator: the jobs
its earlier driver left running are stopped before anything starts, and none of another run's;
a tuning job stopped mid-search warm-starts the resumed one, which runs only the trials left
and takes the best of all of them. Small probe jobs (tests/jobs/) through the real entrypoint."""

# ruff: noqa: F811 - the tests take the emulator's fixtures, imported by name below

from __future__ import annotations

import io
import json
import threading
import time

import pytest

from pipeline.backend import Earlier
from pipeline.backends.resuming import trial_summaries, warm_start
from pipeline.jobs import TuningJob, request_for
from pipeline.search_space import Categorical
from tests.test_emulator import (  # noqa: F401 - the emulator's fixtures, used by name
    RUN,
    backend,
    emulator,
    inputs,
    probe_training,
    store,
)

STARTED = time.time()  # the run's start: every job a test makes is made after it


def searching_f1(name: str) -> TuningJob:
    """A tuning job of the run RUN whose trials report the f1 they are given, one at a time,
    each lasting a second: one can be stopped between trials."""
    trial = probe_training(
        name,
        hyperparameters={"model_name": "probe", "epochs": "1", "sleep": "1"},
        checkpoint_prefix=RUN.prefix + "checkpoints/probe/",
        sagemaker_output=RUN.prefix + "jobs/training/",
        model_prefix=RUN.prefix + "models/probe/",
    )
    f1s = Categorical(("0.51", "0.62", "0.73", "0.84", "0.95"))
    return TuningJob(name=name, trial=trial, ranges={"f1": f1s}, strategy="Random",
                     objective_metric="validation:f1", objective_type="Maximize",
                     max_jobs=4, max_parallel_jobs=1)  # fmt: skip


def described(emulator, name: str) -> dict:
    """The tuning job's DescribeHyperParameterTuningJob, once it is created."""
    from botocore.exceptions import ClientError

    deadline = time.time() + 60
    while True:
        try:
            return emulator.client.describe_hyper_parameter_tuning_job(
                HyperParameterTuningJobName=name
            )
        except ClientError:
            assert time.time() < deadline, f"{name} was never created"
            time.sleep(0.2)


def test_a_stopped_tuning_job_warm_starts_the_resumed_one_with_the_trials_left(
    store, emulator, inputs
):
    first = searching_f1(f"probe-{RUN.label}-tune-probe-090000")
    stopping = backend(emulator)
    ran = threading.Thread(target=stopping.run_tuning, args=(first,))
    ran.start()
    deadline = time.time() + 120
    while described(emulator, first.name)["TrainingJobStatusCounters"]["Completed"] < 1:
        assert time.time() < deadline, "the first trial never completed"
        time.sleep(0.2)
    stopping.stop()  # the driver stopped (Ctrl-C) in the tuning job's second trial
    ran.join()
    parent = described(emulator, first.name)
    assert parent["HyperParameterTuningJobStatus"] == "Stopped"
    done = parent["TrainingJobStatusCounters"]["Completed"]
    assert 1 <= done < 4

    echo = io.StringIO()
    resumed = backend(emulator, echo)
    resumed.resumed(Earlier(STARTED))  # nothing of the run is left running
    again = searching_f1(f"probe-{RUN.label}-tune-probe-091500")
    result = resumed.run_tuning(again)

    assert result.status == "Completed", result.failure_reason
    sent = emulator.records.requests[again.name]
    assert sent["WarmStartConfig"] == {
        "ParentHyperParameterTuningJobs": [{"HyperParameterTuningJobName": first.name}],
        "WarmStartType": "IdenticalDataAndAlgorithm",
    }
    assert sent["HyperParameterTuningJobConfig"]["ResourceLimits"] == {
        "MaxNumberOfTrainingJobs": 4 - done,
        "MaxParallelTrainingJobs": 1,
    }
    said = echo.getvalue()
    assert f"warm-started from {first.name} ({done} trials completed there)" in said
    assert f"{4 - done} of 4 trials left to run" in said
    # The record holds every trial of the model, the first tuning job's too, and the best of
    # them all is the one adopted: the first job's, where it found the best f1.
    trials = result.details["trials"]
    mine = [t for t in trials if t["job_name"].startswith(again.name)]
    assert len(mine) == 4 - done and len(trials) > len(mine)
    best = result.details["best"]
    assert best["objective"] == max(t["objective"] for t in trials if t["objective"] is not None)
    seen = json.loads(store.get_bytes(again.trial.model_prefix + "seen-rank0.json"))
    assert seen["job_name"] == best["job_name"]
    # Nothing of any trial stays: no archive, no checkpoint; only the new trials are billed.
    assert store.list_keys(again.trial.sagemaker_output) == []
    assert store.list_keys(again.trial.checkpoint_prefix) == []
    assert {b["job"].rsplit("-", 2)[0] for b in result.billing} == {again.name}


def test_a_resumed_tuning_job_with_no_ended_one_in_the_account_runs_every_trial(
    store, emulator, inputs
):
    """An emulated account lasts one driver: the resumed run's finds no earlier tuning job,
    says so, and runs all its trials, the earlier trials' checkpoints removed first."""
    store.put_bytes(RUN.prefix + "checkpoints/probe/gone-trial-001/ckpt.txt", b"state")
    echo = io.StringIO()
    resumed = backend(emulator, echo)
    resumed.resumed(Earlier(STARTED))
    job = searching_f1(f"probe-{RUN.label}-tune-probe-093000")
    job.max_jobs, job.trial.hyperparameters["sleep"] = 2, "0"
    result = resumed.run_tuning(job)
    assert result.status == "Completed", result.failure_reason
    assert "WarmStartConfig" not in emulator.records.requests[job.name]
    assert "no earlier tuning job of this model ended in this account: all trials run" in (
        echo.getvalue()
    )
    assert len(result.details["trials"]) == 2
    assert store.list_keys(job.trial.checkpoint_prefix) == []


def test_a_warm_start_from_a_tuning_job_the_account_lacks_is_refused(emulator, store):
    from botocore.exceptions import ClientError

    job = searching_f1(f"probe-{RUN.label}-tune-probe-094500")
    request = request_for(job, "smpipe:emulated", "arn:aws:iam::123456789012:role/r", store.uri_of)
    request["WarmStartConfig"] = {
        "ParentHyperParameterTuningJobs": [{"HyperParameterTuningJobName": "never-made"}],
        "WarmStartType": "IdenticalDataAndAlgorithm",
    }
    with pytest.raises(ClientError, match="never-made"):
        emulator.client.create_hyper_parameter_tuning_job(**request)


def test_a_resumed_run_stops_the_jobs_its_driver_left_running_and_no_other(store, emulator, inputs):
    """A driver that died left its training job running: the resumed run stops it (it
    checkpoints on the SIGTERM), waits for its end before anything starts, and reads its bill.
    A job of the same run number writing elsewhere (another store's run) is not touched, nor
    one of another experiment, which is not even described: a role may be refused that."""
    from pipeline.backends.emulated.control_plane import error_response

    ours = probe_training(
        f"probe-{RUN.label}-train-probe-100000",
        hyperparameters={"model_name": "probe", "hang": "1"},
        sagemaker_output=RUN.prefix + "jobs/training/",
    )
    theirs = probe_training(
        f"probe-{RUN.label}-train-probe-100001",
        hyperparameters={"model_name": "probe", "hang": "1"},
        sagemaker_output="elsewhere/jobs/training/",
    )
    another = probe_training(  # experiment `prob`: its part begins ours, `probe`
        f"prob-{RUN.label}-train-probe-100000",
        hyperparameters={"model_name": "probe", "hang": "1"},
        sagemaker_output=f"prob/runs/{RUN.label}/jobs/training/",
    )
    dead = backend(emulator)
    for job in (ours, theirs, another):
        emulator.client.create_training_job(**dead.request(job))
    # IAM scoped to one experiment's jobs (arn:...:training-job/probe-*) refuses the rest.
    denied = f"not authorized to perform: sagemaker:DescribeTrainingJob on {another.name}"

    def refuse(params, **_):  # params: the request as sent, its JSON body among them
        if another.name in str(params.get("body")):
            return error_response(400, "AccessDeniedException", denied)
        return None

    emulator.client.meta.events.register("before-call.sagemaker.DescribeTrainingJob", refuse)
    echo = io.StringIO()
    try:
        bill = backend(emulator, echo).resumed(Earlier(STARTED))
    finally:
        emulator.client.meta.events.unregister("before-call.sagemaker.DescribeTrainingJob", refuse)

    def status(name: str) -> str:
        answer = emulator.client.describe_training_job(TrainingJobName=name)
        return answer["TrainingJobStatus"]

    try:
        assert status(ours.name) == "Stopped"
        assert status(theirs.name) == status(another.name) == "InProgress"
        said = echo.getvalue()
        assert f"[{ours.name}] training job still running from before the run was resumed" in said
        assert f"[{ours.name}] ended Stopped" in said
        assert theirs.name not in said and another.name not in said
        # What it billed is read once it has ended: its dead driver recorded nothing.
        assert [b["job"] for b in bill] == [ours.name] and bill[0]["billable_seconds"] >= 1
    finally:
        for job in (theirs, another):
            emulator.client.stop_training_job(TrainingJobName=job.name)


def test_a_resume_that_cannot_list_the_runs_jobs_stops_before_any_job_starts(emulator, store):
    """Without sagemaker:ListTrainingJobs the resumed run cannot tell what still runs: it
    stops, saying why, rather than start its jobs beside them."""
    from pipeline.backends.emulated.control_plane import error_response
    from pipeline.errors import PipelineError

    denied = "User is not authorized to perform: sagemaker:ListTrainingJobs"
    emulator.client.meta.events.register(
        "before-call.sagemaker.ListTrainingJobs",
        lambda **_: error_response(400, "AccessDeniedException", denied),
    )
    with pytest.raises(PipelineError) as refused:
        backend(emulator).resumed(Earlier(STARTED))
    said = str(refused.value)
    assert said.startswith(f"--resume {RUN.run_num}: the run's jobs that SageMaker may still run")
    assert denied in said and "would start its jobs beside them" in said


def test_a_job_stopped_with_the_driver_is_billed_when_the_run_is_resumed(store, emulator, inputs):
    """Ctrl-C while a job runs: the driver asks it to stop and leaves before SageMaker says
    what it billed. The job is named unbilled (the run's cost is then a lower bound); the
    resume reads its bill once it has ended."""
    job = probe_training(
        f"probe-{RUN.label}-train-probe-110000",
        hyperparameters={"model_name": "probe", "sleep": "5"},
        sagemaker_output=RUN.prefix + "jobs/training/",
    )
    polls = []

    def ctrl_c(**_):  # Ctrl-C, as it lands while the driver follows the job
        polls.append(1)
        if len(polls) == 2:
            raise KeyboardInterrupt

    events = emulator.client.meta.events
    events.register("after-call.sagemaker.DescribeTrainingJob", ctrl_c, unique_id="ctrl-c")
    driver = backend(emulator)
    with pytest.raises(KeyboardInterrupt):
        driver.run_training(job)
    events.unregister("after-call.sagemaker.DescribeTrainingJob", unique_id="ctrl-c")
    assert driver.unbilled == [{"kind": "training", "job": job.name}]

    bill = backend(emulator).resumed(
        Earlier(STARTED, driver.unbilled)
    )  # waits for it to end, then reads it
    assert [(b["job"], b["instance_type"]) for b in bill] == [(job.name, "ml.m5.xlarge")]
    assert bill[0]["billable_seconds"] >= 1


def left_running(emulator, stamp: str) -> list:
    """Two training jobs of the run that hang, made by a driver that then died."""
    left = [
        probe_training(
            f"probe-{RUN.label}-train-probe-{stamp}{n}",
            hyperparameters={"model_name": "probe", "hang": "1"},
            sagemaker_output=RUN.prefix + "jobs/training/",
        )
        for n in (0, 1)
    ]
    for job in left:
        emulator.client.create_training_job(**backend(emulator).request(job))
    return left


def test_ctrl_c_while_a_resume_waits_leaves_every_job_stopping_and_unbilled(
    store, emulator, inputs
):
    """Ctrl-C while the resumed run waits for what its dead driver left running: every such
    job was asked to stop before the first wait (each ends Stopped), and each is named
    unbilled for the next resume."""
    left = left_running(emulator, "12000")
    resuming = backend(emulator)
    describe, stop, stopped = resuming.describe_job, resuming.stop_job, []

    def stopping(name, kind):
        stopped.append(name)
        stop(name, kind)

    def waiting(kind, name):  # Ctrl-C lands on the first wait, once both were asked to stop
        if len(stopped) == 2:
            raise KeyboardInterrupt
        return describe(kind, name)

    resuming.stop_job, resuming.describe_job = stopping, waiting
    with pytest.raises(KeyboardInterrupt):
        resuming.resumed(Earlier(STARTED))
    assert resuming.unbilled == [{"kind": "training", "job": job.name} for job in left]

    def status(name: str) -> str:
        return emulator.client.describe_training_job(TrainingJobName=name)["TrainingJobStatus"]

    deadline = time.time() + 60
    while {status(job.name) for job in left} - {"Stopped", "Completed", "Failed"}:
        assert time.time() < deadline, "a job was never stopped"
        time.sleep(0.2)
    assert [status(job.name) for job in left] == ["Stopped", "Stopped"]


def ended(emulator, kind: str, name: str) -> dict:
    """The job's Describe answer once it has ended."""
    describe = {
        "training": lambda: emulator.client.describe_training_job(TrainingJobName=name),
        "tuning": lambda: described(emulator, name),
    }[kind]
    deadline = time.time() + 120
    while True:
        answer = describe()
        status = answer.get("TrainingJobStatus") or answer.get("HyperParameterTuningJobStatus")
        if status in ("Completed", "Failed", "Stopped"):
            return answer
        assert time.time() < deadline, f"{name} never ended"
        time.sleep(0.2)


@pytest.mark.parametrize("sent", [False, True], ids=["before-its-request-left", "after"])
def test_ctrl_c_while_a_resume_asks_the_first_job_to_stop_stops_the_others_too(
    store, emulator, inputs, sent
):
    """Ctrl-C while the resume asks the first job left running to stop, before its request
    left or after: the driver cannot tell which, so that one is asked again, and the others
    are asked too, as the driver's own jobs are on Ctrl-C; none runs on unbilled."""
    left = left_running(emulator, "12500" if sent else "12600")
    resuming = backend(emulator)
    stop, stopped, cut = resuming.stop_job, [], []

    def stopping(name, kind):
        if not sent and not cut:
            cut.append(name)
            raise KeyboardInterrupt  # lands before the first stop's request left
        stop(name, kind)
        stopped.append(name)
        if sent and len(stopped) == 1:
            raise KeyboardInterrupt  # lands just after the first stop was asked

    resuming.stop_job = stopping
    with pytest.raises(KeyboardInterrupt):
        resuming.resumed(Earlier(STARTED))
    first, *others = [job.name for job in left]
    assert stopped == [first, first, *others] if sent else [first, *others]
    for job in left:
        assert ended(emulator, "training", job.name)["TrainingJobStatus"] == "Stopped"
    assert {j["job"] for j in resuming.unbilled} == {job.name for job in left}


def test_a_job_that_ended_while_no_driver_followed_it_is_billed_by_the_resume_once(
    store, emulator, inputs
):
    """A driver killed outright (SIGKILL, a machine gone) records nothing of the job it
    followed, which runs to its end all the same. The resume reads its bill; a job the run
    holds a record of (`counted`) is not billed again."""
    jobs = [
        probe_training(
            f"probe-{RUN.label}-train-probe-13000{n}",
            hyperparameters={"model_name": "probe"},
            sagemaker_output=RUN.prefix + "jobs/training/",
            keep_alive_seconds=0,  # no warm pool (a run's last training job keeps none)
        )
        for n in (0, 1)
    ]
    for job in jobs:
        emulator.client.create_training_job(**backend(emulator).request(job))
        assert ended(emulator, "training", job.name)["TrainingJobStatus"] == "Completed"
    echo = io.StringIO()
    bill = backend(emulator, echo).resumed(Earlier(STARTED, counted={jobs[1].name}))
    assert [b["job"] for b in bill] == [jobs[0].name] and bill[0]["billable_seconds"] >= 1
    said = echo.getvalue()
    assert f"[{jobs[0].name}] ended while no driver followed it: its bill read now" in said
    assert jobs[1].name not in said
    # Nor is a job made before the run started (by more than the margin for the clocks): the
    # list asks only for what was made after (CreationTimeAfter).
    assert backend(emulator).resumed(Earlier(time.time() + 7200)) == []


def test_a_tuning_job_that_completed_while_no_driver_followed_it_is_adopted_not_run_again(
    store, emulator, inputs
):
    """The driver died while its tuning job ran, and the job completed its search. The resume
    bills its trials, and the resumed run's tuning job is not created: the best trial of the
    completed one is adopted, its model unpacked, every trial's archive removed."""
    first = searching_f1(f"probe-{RUN.label}-tune-probe-140000")
    first.max_jobs, first.trial.hyperparameters["sleep"] = 2, "0"
    emulator.client.create_hyper_parameter_tuning_job(**backend(emulator).request(first))
    parent = ended(emulator, "tuning", first.name)
    assert parent["HyperParameterTuningJobStatus"] == "Completed"

    echo = io.StringIO()
    resumed = backend(emulator, echo)
    # One trial's bill was named unbilled by a driver before: read once all the same.
    trials = [s["TrainingJobName"] for s in trial_summaries(emulator.client, first.name)]
    unread = [{"kind": "training", "job": trials[0]}]
    bill = resumed.resumed(Earlier(STARTED, unread))
    assert sorted(b["job"] for b in bill) == sorted(trials) and len(trials) == 2
    again = searching_f1(f"probe-{RUN.label}-tune-probe-141500")
    again.max_jobs, again.trial.hyperparameters["sleep"] = 2, "0"  # the very request
    store.put_bytes(RUN.log(first.name), b"kept by the driver that followed it\n")
    result = resumed.run_tuning(again)

    assert result.status == "Completed", result.failure_reason
    assert again.name not in emulator.records.requests  # nothing searched again
    said = echo.getvalue()
    assert f"not searched again: {first.name} completed its search" in said
    assert result.billing == [] and result.details["tuning_job"] == first.name
    assert result.name == first.name  # the job that searched: none named again.name was made
    best = parent["BestTrainingJob"]["TrainingJobName"]
    assert result.details["best"]["job_name"] == best
    seen = json.loads(store.get_bytes(again.trial.model_prefix + "seen-rank0.json"))
    assert seen["job_name"] == best
    assert store.list_keys(again.trial.sagemaker_output) == []
    log = store.get_bytes(RUN.log(first.name)).decode()  # added to what was kept there
    assert log.startswith("kept by the driver that followed it\n")
    assert "adopted the best trial of" in log


def test_parents_that_completed_with_no_best_trial_are_searched_again_not_adopted(store):
    """A tuning job that completed with no best trial (every trial failed, say) is no result to
    adopt: the resumed one searches again, warm-started, at least one trial (the service
    model's least MaxNumberOfTrainingJobs), never failing the same way on every resume."""
    job = searching_f1(f"probe-{RUN.label}-tune-probe-150000")
    request = request_for(job, "smpipe:emulated", "arn:aws:iam::123456789012:role/r", store.uri_of)
    parent = {"HyperParameterTuningJobName": "earlier", "HyperParameterTuningJobStatus": "Completed",
              "TrainingJobStatusCounters": {"Completed": 4, "Failed": 0}}  # fmt: skip
    warmed, parents, said = warm_start(request, [parent])
    assert warmed is not None and parents == [parent]
    assert warmed["HyperParameterTuningJobConfig"]["ResourceLimits"]["MaxNumberOfTrainingJobs"] == 1
    assert "warm-started from earlier (4 trials completed there): 1 of 4 trials left" in said
    best = {"TrainingJobName": "earlier-001-abcdef12",
            "FinalHyperParameterTuningJobObjectiveMetric": {"MetricName": "validation:f1", "Value": 0.9}}  # fmt: skip
    adopted, parents, said = warm_start(request, [{**parent, "BestTrainingJob": best}])
    assert adopted is None and "not searched again: earlier completed its search" in said


def test_a_warm_pool_no_driver_recorded_is_billed_by_the_resume_once(store, emulator, inputs):
    """A driver records a warm pool's kept time when the next training job ends. The first
    job's pool was reused by the second, whose driver died: the resume reads both jobs' bills
    and the time the pool was kept, as training compute, once. A pool still kept when the run
    is resumed has no time yet: it is named unbilled, the cost a lower bound."""
    made = backend(emulator)

    def job(n: int, **changes):
        name = f"probe-{RUN.label}-train-probe-16{n:02d}00"
        return probe_training(name, sagemaker_output=RUN.prefix + "jobs/training/", **changes)

    first, second = job(0, keep_alive_seconds=60), job(1)
    assert made.run_training(first).status == "Completed"
    time.sleep(1.6)  # the pool waits, billed, for the next job
    emulator.client.create_training_job(**made.request(second))  # its driver dies
    assert ended(emulator, "training", second.name)["TrainingJobStatus"] == "Completed"
    kept = emulator.client.describe_training_job(TrainingJobName=first.name)["WarmPoolStatus"]
    assert kept["ReusedByJob"] == second.name

    echo = io.StringIO()
    bill = backend(emulator, echo).resumed(Earlier(STARTED))  # the dead driver recorded none
    assert sorted((b["job"], b["use"]) for b in bill) == [
        (first.name, "training"),
        (first.name, "warm pool"),
        (second.name, "training"),
    ]
    pool = next(b for b in bill if b["use"] == "warm pool")
    assert pool["billable_seconds"] == kept["ResourceRetainedBillableTimeInSeconds"] >= 1
    said = echo.getvalue()
    assert f"[{first.name}] its warm pool's kept time, recorded by no driver, read now" in said
    counted = Earlier(STARTED, counted={first.name, second.name}, pools={first.name})
    assert backend(emulator).resumed(counted) == []

    third = job(2, keep_alive_seconds=60)
    assert made.run_training(third).status == "Completed"  # its pool waits for a next job
    echo, resuming = io.StringIO(), backend(emulator, io.StringIO())
    resuming.echo = echo
    counted = Earlier(STARTED, counted={first.name, second.name, third.name}, pools={first.name})
    assert resuming.resumed(counted) == []
    assert resuming.unbilled == [{"kind": "pool", "job": third.name}]
    assert f"[{third.name}] its warm pool is still kept: its time is not known yet" in (
        echo.getvalue()
    )
