"""SageMaker's control plane, as the emulated account plays it on moto: hooks on the SageMaker
client's calls that do what moto does not. A Create* call moto accepted starts its job
(instances.py plays processing and training, tuning.py the tuning service); a name used before
is refused; the Stop* calls stop a job; ListTrainingJobsForHyperParameterTuningJob lists a
tuning job's trials; a repeated ClientToken makes no second model package; warm pools expire
before anyone looks.
"""

from __future__ import annotations

import copy
import json
import signal
import threading
from collections import Counter

from pipeline.backend import EMULATED_IMAGE, EMULATED_ROLE
from pipeline.backends.emulated.account import Account
from pipeline.backends.emulated.instances import Instances
from pipeline.backends.emulated.records import JobRecords
from pipeline.backends.emulated.tuning import TuningService
from pipeline.backends.sagemaker import SageMakerBackend
from pipeline.jobs import KINDS
from pipeline.paths import RunTree
from pipeline.store import Store

KIND_CREATED_BY = {api.create: kind for kind, api in KINDS.items()}  # CreateTrainingJob: training


def _body(params: dict) -> dict:
    body = params["body"]
    return json.loads(body.decode() if isinstance(body, bytes) else body)


class _Response:
    def __init__(self, status_code: int):
        self.status_code, self.headers = status_code, {}


def ok(parsed: dict):
    """What a before-call hook returns for a call SageMaker answers and moto does not."""
    return _Response(200), {**parsed, "ResponseMetadata": {"HTTPStatusCode": 200}}


def error_response(status: int, code: str, message: str):
    """What a before-call hook returns for a call SageMaker refuses with `code`."""
    error = {"Error": {"Code": code, "Message": message}}
    return _Response(status), {**error, "ResponseMetadata": {"HTTPStatusCode": status}}


def used_name_message(kind: str, name: str, arn: str) -> str:
    """ResourceInUse's message for a job name used before, as AWS words it where a source shows
    it: training, "Training job names must be unique within an AWS account and region, and a
    training job with this name already exists (arn:...)" (CreateTrainingJob, as AWS answered
    it: github.com/aws/amazon-sagemaker-examples/pull/3108); tuning, "A hyperparameter tuning
    job with the name, X, already exists. Choose a different name."
    (CreateHyperParameterTuningJob: github.com/aws/amazon-sagemaker-examples/pull/3353). No
    source shows CreateProcessingJob's: the training message's wording, with "processing job"
    in it, is this emulator's guess."""
    if kind == "tuning":
        return (
            f"A hyperparameter tuning job with the name, {name}, already exists. "
            "Choose a different name."
        )
    job = {"processing": "processing job", "training": "training job"}[kind]
    return (
        f"{job.capitalize()} names must be unique within an AWS account and region, "
        f"and a {job} with this name already exists ({arn})"
    )


def refuse_used_name(jobs, operation: str, body: dict):
    """SageMaker's answer to a Create* `operation` whose `body` names a job used before in
    moto's `jobs`: ResourceInUse (the Create* calls' errors in botocore's sagemaker
    service-2.json), in the words AWS sent (`used_name_message`); None for a new name. A name
    stays used after its job ends: SageMaker deletes no job."""
    requested = next((v for k, v in body.items() if k.endswith("JobName")), None)
    name = requested
    known = {**jobs.processing_jobs, **jobs.training_jobs, **jobs.hyper_parameter_tuning_jobs}
    if operation == KINDS["tuning"].create and isinstance(name, str):
        # A tuning job's name "is not case sensitive" (HyperParameterTuningJobName,
        # botocore's sagemaker service-2.json): `News-...` is taken once `news-...` is.
        taken = {n.lower(): n for n in jobs.hyper_parameter_tuning_jobs}
        name = taken.get(name.lower(), name)
    if name not in known:
        return None
    arn = getattr(known[name], "arn", None) or name
    message = used_name_message(KIND_CREATED_BY[operation], requested, arn)
    return error_response(400, "ResourceInUse", message)


class CreatesApart:
    """No Describe or List is in flight while a create is answered and taken by the emulator,
    and no create while one of those is: moto makes a job as it answers the create (a tuning
    job Completed, one trial counted, a training job Completed), and the emulator sets it
    going only in the create's after-call hook, so a read of another thread between the two
    would see moto's answer, not SageMaker's. Reads run side by side, a thread never waits
    for itself, and every wait ends within 30 s (a call whose hooks raised holds no one)."""

    def __init__(self) -> None:
        self._turn = threading.Condition()
        self._creating: set[int] = set()
        self._reading: Counter[int] = Counter()

    def create_sent(self, **_) -> None:
        me = threading.get_ident()
        with self._turn:
            self._turn.wait_for(lambda: not set(self._reading) - {me}, timeout=30)
            self._creating.add(me)

    def create_done(self, **_) -> None:
        with self._turn:
            self._creating.discard(threading.get_ident())
            self._turn.notify_all()

    def read_sent(self, **_) -> None:
        me = threading.get_ident()
        with self._turn:
            self._turn.wait_for(lambda: not self._creating - {me}, timeout=30)
            self._reading[me] += 1

    def read_done(self, **_) -> None:
        me = threading.get_ident()
        with self._turn:
            self._reading[me] -= 1
            if self._reading[me] <= 0:
                del self._reading[me]
            self._turn.notify_all()


class Emulator:
    """Plays the jobs moto accepts; `backend()` is the SageMaker backend wired to it. Its jobs
    run under `work_root` (a new folder by default), in `image` with `engine` where an image
    is named, else as processes."""

    def __init__(
        self,
        store: Store,
        region: str,
        work_root: str | None = None,
        image: str = "",
        engine: str = "auto",
    ):
        self.store, self.account = store, Account(region)
        self.client, self.logs = self.account.client, self.account.logs
        self.records = JobRecords(self.account.jobs)
        self.instances = Instances(store, self.logs, self.records, work_root, image, engine)
        self.work_root, self.containers = self.instances.work_root, self.instances.containers
        self.image_ref = self.instances.image_ref  # None: jobs played as processes
        self.tuning = TuningService(self.records, self._train_trial)
        self._threads: dict[str, threading.Thread] = {}
        self._pending = threading.local()  # the Create* request being sent from this thread
        self._apart = CreatesApart()
        self._hook()

    def _hook(self) -> None:
        """SageMaker's part, on the client's calls, where moto's differs or is missing."""
        events = self.client.meta.events
        events.register("provide-client-params.sagemaker", self._capture)
        for api in KINDS.values():
            # First of each call's hooks, and its end whatever answers it (`_created` ends
            # a create's).
            apart = self._apart
            events.register_first(f"before-call.sagemaker.{api.create}", apart.create_sent)
            events.register(f"after-call-error.sagemaker.{api.create}", apart.create_done)
            for reading in (api.describe, f"List{api.resource}s"):
                events.register_first(f"before-call.sagemaker.{reading}", apart.read_sent)
                events.register_first(f"after-call.sagemaker.{reading}", apart.read_done)
                events.register_first(f"after-call-error.sagemaker.{reading}", apart.read_done)
            # SageMaker refuses a name used before in the account and region; moto overwrites.
            events.register(f"before-call.sagemaker.{api.create}", self._refuse_used_name)
            events.register(f"after-call.sagemaker.{api.create}", self._created)
            # moto has no Stop* calls: SageMaker's part, played here.
            events.register(f"before-call.sagemaker.{api.stop}", self._stop)
        events.register(
            f"before-call.sagemaker.{KINDS['tuning'].create}", self._refuse_unknown_parents
        )
        # A warm pool's time runs out between calls: it is Terminated before anyone looks.
        pools = self.records.pools
        for operation in ("DescribeTrainingJob", "ListTrainingJobs"):
            events.register(f"before-call.sagemaker.{operation}", lambda **_: pools.expire())
        # Nor ListTrainingJobsForHyperParameterTuningJob.
        listing_trials = "sagemaker.ListTrainingJobsForHyperParameterTuningJob"
        events.register_first(f"before-call.{listing_trials}", self._apart.read_sent)
        events.register_first(f"after-call.{listing_trials}", self._apart.read_done)
        events.register_first(f"after-call-error.{listing_trials}", self._apart.read_done)
        events.register(f"before-call.{listing_trials}", self._list_trials)
        # moto makes a new model package for every CreateModelPackage, whatever its ClientToken.
        events.register("before-call.sagemaker.CreateModelPackage", self._same_client_token)

    def backend(self, run: RunTree, image_uri: str, role_arn: str, echo=None):
        return SageMakerBackend(
            self.store,
            run,
            client=self.client,
            logs_client=self.logs,
            image_uri=image_uri or EMULATED_IMAGE,
            role_arn=role_arn or EMULATED_ROLE,
            echo=echo,
            poll_seconds=0.5,
        )

    def close(self) -> None:
        self.instances.stop()
        for thread in list(self._threads.values()):
            thread.join()
        self.instances.close()

    def reclaim(self, job: str = "") -> list[str]:
        """AWS takes a spot instance back: every running spot training job whose name starts
        with `job` gets SIGTERM and is started again from its checkpoints, while its
        MaxWaitTimeInSeconds lasts (model-managed-spot-training.html). Returns their names."""
        names = self.records.spot_running(job)
        self.instances.take_back(names)
        return names

    # -- hooks on the client ---------------------------------------------------------------------

    def _capture(self, params, model, **_):
        if model.name in KIND_CREATED_BY:  # kept until SageMaker (moto) accepts it
            self._pending.request = copy.deepcopy(params)

    def _created(self, http_response, parsed, model, **_):
        try:
            self._take(http_response, parsed, model)
        finally:
            self._apart.create_done()

    def _take(self, http_response, parsed, model) -> None:
        if http_response.status_code != 200:
            return
        arn = next(v for k, v in parsed.items() if k.endswith("Arn"))
        name = arn.rsplit("/", 1)[-1]
        kind = KIND_CREATED_BY[model.name]
        self.records.accepted(name, kind, self._pending.request)
        play = {
            "processing": self.instances.play_processing,
            "training": self.instances.play_training,
            "tuning": self._play_tuning,
        }[kind]
        thread = threading.Thread(target=self._guard, args=(play, name), daemon=True)
        self._threads[name] = thread
        thread.start()

    def _refuse_used_name(self, model, params, **_):
        return refuse_used_name(self.account.jobs, model.name, _body(params))

    def _refuse_unknown_parents(self, params, **_):
        """A warm start names parent tuning jobs whose results it starts from: one the account
        does not hold is refused. The service model lists no error of its own for it
        (CreateHyperParameterTuningJob's are ResourceInUse and ResourceLimitExceeded), so it
        is played as the ValidationException every SageMaker call may answer."""
        warm = _body(params).get("WarmStartConfig") or {}
        held = {n.lower() for n in self.account.jobs.hyper_parameter_tuning_jobs}
        missing = [
            p["HyperParameterTuningJobName"]
            for p in warm.get("ParentHyperParameterTuningJobs", [])
            if p["HyperParameterTuningJobName"].lower() not in held
        ]
        if not missing:
            return None
        return error_response(
            400, "ValidationException", f"Parent tuning jobs not found: {', '.join(missing)}"
        )

    def _stop(self, model, params, **_):
        name = next(iter(_body(params).values()))
        self.records.stop_asked(name, *self.tuning.trials.get(name, []))
        # StopTrainingJob: SIGTERM, SIGKILL 120 s later (API_StopTrainingJob.html); the
        # entrypoint forwards it, training checkpoints. StopProcessingJob: "SIGINT and SIGKILL"
        # are what the processing container gets (build-your-own-processing-container.html).
        signum = signal.SIGINT if model.name == "StopProcessingJob" else signal.SIGTERM
        self.instances.stop(name, signum)
        return ok({})

    def _list_trials(self, params, **_):
        """A tuning job the account does not hold (one an earlier driver's account ran) is
        ResourceNotFound, the one error botocore's sagemaker service-2.json lists for
        ListTrainingJobsForHyperParameterTuningJob; the message is this emulator's words. The
        account is this emulator's requests: moto's records are the process's, and an earlier
        emulator's jobs stay in them."""
        name = _body(params)["HyperParameterTuningJobName"]
        if name not in self.records.requests:
            message = f"Amazon SageMaker can't find a tuning job named {name}"
            return error_response(400, "ResourceNotFound", message)
        return ok({"TrainingJobSummaries": self.tuning.summaries(name)})

    def _same_client_token(self, params, **_):
        """CreateModelPackage is idempotent on its ClientToken: "A unique token that guarantees
        that the call to this API is idempotent" (its idempotencyToken member in botocore's
        sagemaker service-2.json), and an idempotent AWS API "uses the token to return a
        response identical to the response that was returned the first time that the request
        was completed" (AWS Well-Architected Framework, REL04-BP04). A repeated token is
        answered with the package its first request made, and nothing is created. How long
        SageMaker remembers a token is not documented: here, as long as the package exists."""
        token = _body(params).get("ClientToken")
        packages = self.account.jobs.model_packages.values()
        made = [p for p in packages if token and p.client_token == token]
        return ok({"ModelPackageArn": made[0].arn}) if made else None

    # -- the jobs started ------------------------------------------------------------------------

    def _guard(self, play, name: str) -> None:
        """Whatever goes wrong in playing a job ends that job Failed, never the driver."""
        try:
            play(name)
        except Exception as e:  # noqa: BLE001 - becomes the job's FailureReason
            reason = f"ClientError: the emulator could not run the job: {e}"
            self.records.ended(name, "Failed", reason)

    def _play_tuning(self, name: str) -> None:
        # The trials share one environment: its fork server starts beside the first trial.
        with self.instances.sharing_environment():
            self.tuning.play(name)

    def _train_trial(self, request: dict) -> str:
        """The tuning service's trial: a training job created as any other, waited for; its
        TrainingJobStatus."""
        name = request["TrainingJobName"]
        self.records.trial(name)
        self.client.create_training_job(**request)
        self._threads[name].join()
        return self.records.training(name).training_job_status
