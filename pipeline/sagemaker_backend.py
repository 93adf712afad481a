"""The SageMaker backend: real Processing, Training and Tuning jobs through the SDK v3.

Every job runs the image built from docker/ and receives the step scripts and the user
functions as its code, so the same scripts run here as on the local backend, under the same
contract: processing inputs and outputs under /opt/ml/processing with SM_PROCESSING_* naming
them, training channels, hyperparameters and SM_* set by SageMaker's training drivers,
checkpoints in /opt/ml/checkpoints synced with S3 (spot interruptions resume from them).

SageMaker lays a training job's output out its own way (model.tar.gz, output.tar.gz under
<output_path>/<job>/output/). After a job completes, this backend maps it onto the run tree
the rest of the driver reads: the report a step wrote is put beside its outputs and every
output prefix gets a manifest, so a partial upload is never read as a whole one.
"""

from __future__ import annotations

import json
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from pipeline.config import Categorical, Settings
from pipeline.jobs import JobResult, ProcessingJob, TrainingJob
from pipeline.paths import RunTree
from pipeline.store import MANIFEST, S3Store, Store, is_complete, upload_dir

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONTAINER = "/opt/ml"  # the container's side of the contract, named here and in SageMaker's docs
CODE_DIR = f"{CONTAINER}/processing/input/code"
TRAINING_CODE_DIR = f"{CONTAINER}/input/data/code"  # where SageMaker's drivers unpack source_dir


def stage_code(settings: Settings, destination: Path) -> Path:
    """The code every job receives: steps/ and the user functions module."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(PROJECT_ROOT / "steps", destination / "steps", ignore=ignore)
    module = settings.experiment.user_functions.split(".")[0]
    for base in (Path(settings.base_dir), PROJECT_ROOT):
        if (base / module).is_dir():
            shutil.copytree(base / module, destination / module, ignore=ignore)
            break
        if (base / f"{module}.py").is_file():
            shutil.copy2(base / f"{module}.py", destination / f"{module}.py")
            break
    else:
        raise FileNotFoundError(
            f"user functions module {module!r} not found beside {settings.source}"
        )
    return destination


def manifest_prefix(store: S3Store, prefix: str, job_name: str) -> bool:
    """Write the manifest of what a completed job uploaded; False when it uploaded nothing."""
    if is_complete(store, prefix):
        return True
    files = {}
    paginator = store.client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=store.bucket, Prefix=store._key(prefix)):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(store._key(prefix)) :]
            if rel != MANIFEST:
                files[rel] = {"size": obj["Size"], "etag": obj["ETag"].strip('"')}
    if not files:
        return False
    manifest = {"files": files, "total_bytes": sum(f["size"] for f in files.values()), "job_name": job_name,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    return store.create(prefix + MANIFEST, json.dumps(manifest, indent=2).encode()) or True


class SageMakerBackend:
    name = "sagemaker"

    def __init__(
        self,
        settings: Settings,
        store: Store,
        run: RunTree,
        echo=None,
        sagemaker_session=None,
        stream_logs: bool = True,
    ):
        if not isinstance(store, S3Store):
            raise TypeError("the sagemaker backend needs an s3:// store")
        self.settings, self.store, self.run = settings, store, run
        self.stream_logs = stream_logs
        self.echo = echo if echo is not None else sys.stdout
        if sagemaker_session is None:
            import boto3
            from sagemaker.core.helper.session_helper import Session

            # What the SDK uploads itself (the training code, its drivers) lands in this run's tree too.
            sagemaker_session = Session(
                boto_session=boto3.Session(region_name=settings.experiment.region),
                default_bucket=store.bucket,
                default_bucket_prefix=(store.prefix + run.sdk).strip("/"),
            )
        self.session = sagemaker_session
        self.code_prefix = run.code
        self._code_dir: Path | None = None

    def _code(self) -> Path:
        """Stage the code once per run, locally (training source_dir) and in S3 (processing)."""
        if self._code_dir is None:
            self._code_dir = stage_code(
                self.settings, Path(tempfile.mkdtemp(prefix="smpipe-code-"))
            )
            if not is_complete(self.store, self.code_prefix):
                upload_dir(self.store, self._code_dir, self.code_prefix)
        return self._code_dir

    def _say(self, name: str, text: str) -> None:
        print(f"[{name}] {text}", file=self.echo, flush=True)

    # -- processing ---------------------------------------------------------------------------

    def run_processing(self, job: ProcessingJob) -> JobResult:
        from sagemaker.core.processing import Processor
        from sagemaker.core.shapes import (
            ProcessingInput,
            ProcessingOutput,
            ProcessingS3Input,
            ProcessingS3Output,
        )

        self._code()
        env = {
            "PYTHONPATH": CODE_DIR,
            "SM_OUTPUT_FAILURE": f"{CONTAINER}/output/message",
            **job.env,
        }
        inputs = [ProcessingInput(input_name="code", s3_input=ProcessingS3Input(
            s3_uri=self.store.uri_of(self.code_prefix), local_path=CODE_DIR, s3_data_type="S3Prefix", s3_input_mode="File"))]  # fmt: skip
        for channel, source in job.inputs.items():
            local = f"{CONTAINER}/processing/input/{channel}"
            uri = source if "://" in source else self.store.uri_of(source)
            inputs.append(ProcessingInput(input_name=channel, s3_input=ProcessingS3Input(
                s3_uri=uri, local_path=local, s3_data_type="S3Prefix", s3_input_mode="File")))  # fmt: skip
            env[f"SM_PROCESSING_INPUT_{channel.upper()}"] = local
        outputs = []
        for channel, prefix in job.outputs.items():
            local = f"{CONTAINER}/processing/output/{channel}"
            outputs.append(ProcessingOutput(output_name=channel, s3_output=ProcessingS3Output(
                s3_uri=self.store.uri_of(prefix), local_path=local, s3_upload_mode="EndOfJob")))  # fmt: skip
            env[f"SM_PROCESSING_OUTPUT_{channel.upper()}"] = local
        processor = Processor(
            role=self.settings.experiment.role_arn,
            image_uri=self.settings.experiment.image_uri,
            instance_count=1,
            instance_type=job.instance_type,
            entrypoint=["python3", "-m", f"steps.{job.step}"],
            env=env,
            sagemaker_session=self.session,
        )
        start = time.time()
        self._say(job.name, f"processing job on {job.instance_type}")
        processor.run(
            inputs=inputs,
            outputs=outputs,
            arguments=job.arguments or None,
            wait=True,
            logs=self.stream_logs,  # the container's CloudWatch log, streamed while the job runs
            job_name=job.name,
        )
        described = self.session.sagemaker_client.describe_processing_job(
            ProcessingJobName=job.name
        )
        result = self._result(
            job.name, described["ProcessingJobStatus"], described.get("FailureReason"), start
        )
        if result.status == "Completed":
            missing = [
                p for p in job.outputs.values() if not manifest_prefix(self.store, p, job.name)
            ]
            if missing:
                result.status = "Failed"
                result.failure_reason = f"the job completed but wrote nothing to {', '.join(self.store.uri_of(p) for p in missing)}"
        return result

    # -- training -----------------------------------------------------------------------------

    def model_trainer(self, job: TrainingJob):
        from sagemaker.core.training.configs import (
            CheckpointConfig,
            Compute,
            OutputDataConfig,
            SourceCode,
            StoppingCondition,
        )
        from sagemaker.train import ModelTrainer
        from sagemaker.train.distributed import Torchrun

        compute = Compute(
            instance_type=job.instance_type,
            instance_count=job.instance_count,
            enable_managed_spot_training=job.use_spot or None,
        )
        stopping = StoppingCondition(
            max_runtime_in_seconds=job.max_run_seconds,
            max_wait_time_in_seconds=job.max_wait_seconds if job.use_spot else None,
        )
        trainer = ModelTrainer(
            training_image=self.settings.experiment.image_uri,
            role=self.settings.experiment.role_arn,
            base_job_name=job.name,
            sagemaker_session=self.session,
            # SageMaker's drivers run the entry script (under torchrun when distributed) from the
            # code channel; PYTHONPATH lets it import steps/ and the user functions as packages.
            source_code=SourceCode(
                source_dir=str(self._code()), entry_script=f"steps/{job.step}.py"
            ),
            distributed=Torchrun(process_count_per_node=job.processes_per_host)
            if job.processes_per_host > 1
            else None,
            compute=compute,
            stopping_condition=stopping,
            checkpoint_config=CheckpointConfig(
                s3_uri=self.store.uri_of(job.checkpoint_prefix),
                local_path=f"{CONTAINER}/checkpoints",
            ),
            output_data_config=OutputDataConfig(
                s3_output_path=self.store.uri_of(self.run.training_output)
            ),
            hyperparameters=job.hyperparameters,
            environment={
                **job.env,
                "SM_CHECKPOINT_DIR": f"{CONTAINER}/checkpoints",
                "PYTHONPATH": TRAINING_CODE_DIR,
            },
        )
        if job.metric_definitions:
            from sagemaker.core.shapes import MetricDefinition

            trainer = trainer.with_metric_definitions(
                [MetricDefinition(name=k, regex=v) for k, v in job.metric_definitions.items()]
            )
        return trainer

    def run_training(self, job: TrainingJob) -> JobResult:
        trainer = self.model_trainer(job)
        channels = self._channels(job)
        start = time.time()
        self._say(
            job.name,
            f"training job on {job.instance_count} x {job.instance_type}{' (spot)' if job.use_spot else ''}",
        )
        trainer.train(input_data_config=channels, wait=True, logs=self.stream_logs)
        name = trainer._latest_training_job.training_job_name
        described = self.session.sagemaker_client.describe_training_job(TrainingJobName=name)
        result = self._result(
            name, described["TrainingJobStatus"], described.get("FailureReason"), start
        )
        if result.status == "Completed":
            self._adopt_training_output(described, job, result)
        return result

    def _adopt_training_output(self, described: dict, job: TrainingJob, result: JobResult) -> None:
        """model.tar.gz becomes the model prefix; the report inside output.tar.gz goes beside it."""
        artifacts = described.get("ModelArtifacts", {}).get("S3ModelArtifacts", "")
        base = artifacts.rsplit("/", 1)[0] + "/" if artifacts else ""
        prefix = base[len(f"s3://{self.store.bucket}/{self.store.prefix}") :] if base else ""
        if not prefix or not self.store.exists(prefix + "model.tar.gz"):
            result.status, result.failure_reason = (
                "Failed",
                f"the job completed but left no model.tar.gz at {base or '(none)'}",
            )
            return
        self.store.upload_file(
            self._fetch(prefix + "model.tar.gz"), job.model_prefix + "model.tar.gz"
        )
        manifest_prefix(self.store, job.model_prefix, result.name)
        if self.store.exists(prefix + "output.tar.gz"):
            with tarfile.open(self._fetch(prefix + "output.tar.gz")) as tar:
                member = next(
                    (m for m in tar.getmembers() if m.name.endswith("step_metadata.json")), None
                )
                if member is not None:
                    self.store.put_bytes(
                        job.output_prefix + "step_metadata.json", tar.extractfile(member).read()
                    )
        manifest_prefix(self.store, job.output_prefix, result.name)

    def _channels(self, job: TrainingJob) -> list:
        from sagemaker.core.training.configs import InputData

        return [
            InputData(channel_name=c, data_source=self.store.uri_of(p))
            for c, p in job.channels.items()
        ]

    def _fetch(self, key: str) -> Path:
        path = Path(tempfile.mkdtemp(prefix="smpipe-fetch-")) / key.rsplit("/", 1)[-1]
        self.store.download_file(key, path)
        return path

    def _result(self, name: str, status: str, reason: str | None, start: float) -> JobResult:
        self._say(name, f"{status}{': ' + reason if reason else ''}")
        log_key = self.run.log(name)
        self.store.put_bytes(log_key, f"{name}: {status}\n{reason or ''}\n".encode())
        return JobResult(
            name=name,
            status="Completed"
            if status == "Completed"
            else ("Interrupted" if status == "Stopped" else "Failed"),
            failure_reason=reason,
            start_time=start,
            end_time=time.time(),
            log_key=log_key,
        )

    # -- tuning -------------------------------------------------------------------------------

    def tuner(self, job: TrainingJob):
        from sagemaker.core.parameter import (
            CategoricalParameter,
            ContinuousParameter,
            IntegerParameter,
        )
        from sagemaker.train.tuner import HyperparameterTuner

        ranges = {}
        for name, t in self.settings.tunables.items():
            if isinstance(t, Categorical):
                ranges[name] = CategoricalParameter(list(t.options))
            else:
                kind = IntegerParameter if t.integer else ContinuousParameter
                low, high = (int(t.low), int(t.high)) if t.integer else (t.low, t.high)
                ranges[name] = kind(low, high, scaling_type="Logarithmic" if t.log else "Linear")
        tuning = self.settings.tuning
        return HyperparameterTuner(
            model_trainer=self.model_trainer(job),
            objective_metric_name=tuning.objective_metric,
            objective_type=tuning.objective_type,
            hyperparameter_ranges=ranges,
            metric_definitions=[
                {"Name": k, "Regex": v} for k, v in self.settings.metric_definitions.items()
            ],
            strategy=tuning.strategy,
            max_jobs=tuning.max_jobs,
            max_parallel_jobs=tuning.max_parallel_jobs,
            base_tuning_job_name=job.name[:32].rstrip("-"),
        )

    def run_tuning(self, job: TrainingJob) -> tuple[JobResult, dict]:
        """One SageMaker tuning job; its best training job's model becomes job.model_prefix."""
        tuner = self.tuner(job)
        channels = self._channels(job)
        start = time.time()
        self._say(
            job.name,
            f"tuning job: {self.settings.tuning.max_jobs} trials, {self.settings.tuning.strategy}",
        )
        tuner.tune(inputs=channels, wait=True)
        client = self.session.sagemaker_client
        name = tuner.latest_tuning_job.hyper_parameter_tuning_job_name
        described = client.describe_hyper_parameter_tuning_job(HyperParameterTuningJobName=name)
        result = self._result(
            name, described["HyperParameterTuningJobStatus"], described.get("FailureReason"), start
        )
        best = described.get("BestTrainingJob") or {}
        details = {"tuning_job": name, "strategy": self.settings.tuning.strategy, "ran_as": self.settings.tuning.strategy,
                   "objective_metric": self.settings.tuning.objective_metric, "best": best or None,
                   "counters": described.get("TrainingJobStatusCounters")}  # fmt: skip
        if result.status == "Completed":
            if not best:
                result.status, result.failure_reason = (
                    "Failed",
                    f"tuning job {name} completed with no best training job",
                )
            else:
                from botocore.exceptions import ClientError

                try:
                    trained = client.describe_training_job(TrainingJobName=best["TrainingJobName"])
                except ClientError as e:
                    result.status = "Failed"
                    result.failure_reason = f"the best training job {best['TrainingJobName']} of {name} cannot be read: {e}"
                    return result, json.loads(json.dumps(details, default=str))
                self._adopt_training_output(trained, job, result)
        return result, json.loads(json.dumps(details, default=str))

    def close(self, succeeded: bool) -> None:
        if self._code_dir is not None:
            shutil.rmtree(self._code_dir, ignore_errors=True)
