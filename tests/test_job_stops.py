"""Jobs stopped: on request (Stop*, the driver, a pruned trial), at MaxRuntimeInSeconds, by a
spot reclaim. Stopping, then Stopped whatever the container exited with where the stop reached
it; what it saved uploaded; a restart on a new instance; the grace, then SIGKILL."""

from __future__ import annotations

import io
import json
import threading
import time

import pytest

from pipeline.backends.local import LocalBackend
from pipeline.store.protocol import key_of
from tests import test_emulator
from tests.test_emulator import RUN, backend, probe_processing, probe_training, until

# test_emulator's fixtures: a bucket's store, an emulator on it, the probes' inputs.
store, emulator, inputs = test_emulator.store, test_emulator.emulator, test_emulator.inputs


@pytest.mark.parametrize("how", ["StopTrainingJob", "MaxRuntimeInSeconds"])
def test_a_stopped_training_job_is_stopping_then_stopped_and_keeps_what_it_saved(
    store, emulator, inputs, how
):
    """Its status stayed InProgress until the container exited; a container that exited 0
    within the grace made it Completed; its SecondaryStatus said Stopped at its limit; and
    nothing it saved was uploaded. StopTrainingJob: "SageMaker changes the status of the job
    to Stopping. After SageMaker stops the job, it sets the status to Stopped", and the grace
    is there to "save the model artifacts, so the results of the training is not lost";
    SecondaryStatus: under Stopped, "MaxRuntimeExceeded" (botocore's sagemaker service-2.json)."""
    job = probe_training(f"stop-{how.lower()}")
    job.hyperparameters = {"epochs": "1", "sleep": "60", "finish_on_stop": "1"}
    request = backend(emulator).request(job)
    if how == "MaxRuntimeInSeconds":
        request["StoppingCondition"]["MaxRuntimeInSeconds"] = 2
    emulator.client.create_training_job(**request)
    name = request["TrainingJobName"]
    until(lambda: list(emulator.work_root.glob(f"{name}/**/seen-rank0.json")))  # in its sleep
    describe = emulator.client.describe_training_job
    if how == "StopTrainingJob":
        emulator.client.stop_training_job(TrainingJobName=name)
        asked = describe(TrainingJobName=name)
        assert (asked["TrainingJobStatus"], asked["SecondaryStatus"]) == ("Stopping", "Stopping")
    ended = until(
        lambda: (
            (d := describe(TrainingJobName=name))["TrainingJobStatus"] != "Stopping"
            and d["TrainingJobStatus"] != "InProgress"
            and d
        )
    )
    why = "Stopped" if how == "StopTrainingJob" else "MaxRuntimeExceeded"
    assert (ended["TrainingJobStatus"], ended["SecondaryStatus"]) == ("Stopped", why)
    assert store.exists(key_of(store, ended["ModelArtifacts"]["S3ModelArtifacts"]))


def test_a_reclaimed_spot_job_restarts_on_a_new_instance_with_only_its_checkpoints(
    store, emulator, inputs
):
    """The restart ran in the folders the first attempt left: its model/ files, and a hidden
    checkpoint file the emulator never uploads, were there again, and the first attempt's
    files reached model.tar.gz. An interruption restarts the job "on a new instance, with
    checkpoints restored from S3" (model-managed-spot-training)."""
    job = probe_training("spot-restart", use_spot=True, max_wait_seconds=86400)
    job.hyperparameters = {"epochs": "1", "sleep": "60", "sleep_once": "1"}
    result = []
    thread = threading.Thread(target=lambda: result.append(backend(emulator).run_training(job)))
    thread.start()
    until(lambda: list(emulator.work_root.glob("*spot-restart*/**/seen-rank0.json")))
    assert len(emulator.reclaim()) == 1
    thread.join(timeout=120)
    assert result[0].status == "Completed", result[0].failure_reason
    seen = json.loads(store.get_bytes(job.model_prefix + "seen-rank0.json"))
    assert seen["checkpoints_at_start"] == ["ckpt-rank0.txt"]  # from S3, and nothing else
    assert seen["model_at_start"] == []


def test_a_container_that_ignores_its_stop_is_killed_after_the_grace(store, tmp_path, inputs):
    """StopTrainingJob / StopProcessingJob: the signal, then SIGKILL when the grace is over
    (120 s on SageMaker; 1 s here)."""
    local = LocalBackend(store, RUN, echo=io.StringIO(), work_root=str(tmp_path / "work"))
    local.containers.grace_seconds = 1
    results = []
    thread = threading.Thread(
        target=lambda: results.append(local.run_processing(probe_processing("hang", "--hang")))
    )
    started = time.time()
    thread.start()
    while not local.containers._running and time.time() - started < 60:
        time.sleep(0.1)
    time.sleep(3)  # the step is up and ignoring signals
    local.containers.stop()
    thread.join(timeout=30)
    assert not thread.is_alive() and results[0].status != "Completed"


def test_a_job_stopped_while_its_container_starts_is_stopped_once_it_has(store, tmp_path, inputs):
    """StopProcessingJob before the job's container was registered (Ctrl-C as it starts): the
    container gets the signal, then SIGKILL after the grace, and does not run on."""
    local = LocalBackend(store, RUN, echo=io.StringIO(), work_root=str(tmp_path / "work"))
    local.containers.grace_seconds = 1
    hang = probe_processing("hang-late", "--hang")
    local.containers.stop(hang.name)  # what StopProcessingJob asks, before its container exists
    results = []
    thread = threading.Thread(target=lambda: results.append(local.run_processing(hang)))
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive() and results[0].status != "Completed"


def test_a_stop_counts_only_where_it_reached_a_running_container(store, tmp_path, inputs):
    """A stop that comes after the job's container exited 0 (a tuning trial still uploading
    its checkpoints when Ctrl-C stops the study) leaves it Completed, its work kept; one that
    reaches it while it runs makes it Stopped, whatever it exits with (status_after)."""
    local = LocalBackend(store, RUN, echo=io.StringIO(), work_root=str(tmp_path / "work"))
    local.containers.grace_seconds = 1
    done = local.run_processing(probe_processing("quick"))
    local.containers.stop("quick")
    assert done.status == "Completed" and not local.containers.stop_reached("quick")
    results = []
    hang = probe_processing("hang-stopped", "--hang")
    thread = threading.Thread(target=lambda: results.append(local.run_processing(hang)))
    thread.start()
    until(lambda: local.containers._running)
    time.sleep(1)
    local.containers.stop("hang-stopped")
    thread.join(timeout=60)
    assert local.containers.stop_reached("hang-stopped") and results[0].status == "Stopped"


def test_a_trial_in_progress_has_its_objective_pending_and_a_stopped_tuning_job_stops_it(
    store, emulator, inputs
):
    """ListTrainingJobsForHyperParameterTuningJob said Failed of a trial still running (its
    ObjectiveStatus: "Pending: The training job is in progress and evaluation of its final
    objective metric is pending", the service model); StopHyperParameterTuningJob then stops
    the trials: Stopped, with the objective one reported."""
    from tests.test_emulator import tuning_job

    job = tuning_job("tune-pending")
    job.trial.hyperparameters = {"model_name": "probe", "epochs": "1", "sleep": "60",
                                 "finish_on_stop": "1"}  # fmt: skip
    request = backend(emulator).request(job)
    emulator.client.create_hyper_parameter_tuning_job(**request)
    listing = emulator.client.list_training_jobs_for_hyper_parameter_tuning_job
    name = request["HyperParameterTuningJobName"]
    until(lambda: list(emulator.work_root.glob(f"{name}*/**/seen-rank0.json")))  # in its sleep
    running = listing(HyperParameterTuningJobName=name)["TrainingJobSummaries"]
    assert {s["ObjectiveStatus"] for s in running} == {"Pending"}
    emulator.client.stop_hyper_parameter_tuning_job(HyperParameterTuningJobName=name)
    described = emulator.client.describe_hyper_parameter_tuning_job
    until(lambda: described(HyperParameterTuningJobName=name)["HyperParameterTuningJobStatus"]
          in ("Stopped", "Completed", "Failed"))  # fmt: skip
    ended = listing(HyperParameterTuningJobName=name)["TrainingJobSummaries"]
    assert {s["TrainingJobStatus"] for s in ended} == {"Stopped"}
    for trial in ended:  # one stopped before it reported an objective has none evaluated
        reported = "FinalHyperParameterTuningJobObjectiveMetric" in trial
        assert trial["ObjectiveStatus"] == ("Succeeded" if reported else "Failed")
    assert any("FinalHyperParameterTuningJobObjectiveMetric" in trial for trial in ended)
