"""Each section of settings.ini as a typed model, with its defaults, bounds and the rules it
checks alone, and `Settings`, the whole file. pipeline/config.py builds them (`load_settings`);
a hyperparameter's type, default and bounds come from steps/hyperparameters.py's table.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from pipeline.search_space import Tunable, merged_space
from pipeline.service_model import job_name_part, shape
from steps.hyperparameters import TABLE, Hyperparameter, wire
from steps.runtime.names import env_key

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
KMS_KEY_ARN = re.compile(r"^arn:aws[a-z-]*:kms:[a-z0-9-]+:\d{12}:key/[A-Za-z0-9-]+$")
NAME_RULE = "letters, digits, '_' or '-', starting with a letter or digit, at most 63 characters"


def check_name(value: str) -> str:
    """A name that becomes part of a path: no '..', no slashes, not empty."""
    if not NAME_RE.match(value or ""):
        raise ValueError(f"{value!r} is not a valid name ({NAME_RULE})")
    return value


# $NAME and ${NAME} in a path, as os.path.expandvars reads them.
VARIABLE = re.compile(r"\$(\w+|\{[^}]*\})")


def as_a_shell_reads(path: str) -> str:
    """A path setting with `~` and environment variables expanded, as a shell would expand
    them in a command's argument: the file is read by none, and `${HOME}/data` must not
    become a folder named `${HOME}`."""
    return os.path.expandvars(os.path.expanduser(path))


def check_path(value: str) -> str:
    """A path setting not in quotes (a value is taken as written: the quotes would be part of
    the path, a folder named `".`), whose environment variables are all set (an unset one
    would be left as it is written, a folder of that name)."""
    if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"":
        raise ValueError(
            f"{value!r} is in quotes, which would be part of the path: write it without them "
            "(a path with spaces needs none)"
        )
    unset = [
        m.group(0) for m in VARIABLE.finditer(value) if m.group(1).strip("{}") not in os.environ
    ]
    if unset:
        raise ValueError(f"{value!r} names {', '.join(unset)}: not set in the environment")
    return value


class Section(BaseModel):
    # inf and nan are never a setting: a float key is a finite number or an error.
    model_config = ConfigDict(
        extra="forbid", frozen=True, str_strip_whitespace=True, allow_inf_nan=False
    )


def _field(h: Hyperparameter) -> tuple[object, object]:
    """One row of the hyperparameter table as a pydantic field: type, default, bounds, help."""
    if h.type is str and h.choices:
        return Literal[h.choices], Field(h.default, description=h.help)
    if h.choices:  # a number, or a word in its place ("auto")
        number = Annotated[h.type, Field(**h.bounds())]
        return number | Literal[h.choices], Field(h.default, description=h.help)
    return h.type, Field(h.default, description=h.help, **h.bounds())


def hyperparameters_of(section: str) -> type[Section]:
    """The keys of `section` that are hyperparameters (steps/hyperparameters.py's table), as
    the base of that section's model."""
    fields = {h.name: _field(h) for h in TABLE if h.section == section}
    return create_model(f"{section.title()}Hyperparameters", __base__=Section, **fields)


class Experiment(Section):
    name: str
    store: str  # a local directory, or s3://bucket[/prefix]
    backend: Literal["local", "sagemaker", "emulated"] = "local"
    job: Literal["train", "tune"] = "train"
    region: str = "us-east-1"
    role_arn: str = ""
    image_uri: str = ""
    # A customer-managed KMS key the store bucket (and the secrets) are encrypted under: `smpipe
    # iam` grants its use to the driver and the role (pipeline/iam.py). The key's own ARN, not
    # an alias: "When an alias is the value of a resource element, the policy applies to the
    # alias resource, not to any KMS key that might be associated with it" (KMS developer
    # guide, alias-authorization.html).
    kms_key_arn: str = ""
    # After each completed run, prune the runs before the newest KEEP_RUNS completed ones and
    # the raw versions nothing reads, as `smpipe prune --keep KEEP_RUNS --yes` does; 0: never.
    keep_runs: int = Field(0, ge=0)
    user_functions: str = "user_functions"

    _name = field_validator("name")(check_name)

    @field_validator("kms_key_arn")
    @classmethod
    def _kms_key_arn(cls, value: str) -> str:
        if value and not KMS_KEY_ARN.match(value):
            raise ValueError(
                "is not a KMS key's ARN (arn:aws:kms:<region>:<account>:key/<key id>; an "
                "alias cannot be granted on)"
            )
        return value

    @field_validator("user_functions")
    @classmethod
    def _module(cls, value: str) -> str:
        """A module's name as `import` takes it, which a file's path or name is not."""
        module = value.removesuffix(".py").replace("/", ".").replace("\\", ".").strip(".")
        if module != value:
            raise ValueError(f"is a module's name, as import takes it: {module!r}, not a file's")
        if not all(part.isidentifier() for part in value.split(".")):
            raise ValueError("is a module's name, as import takes it (such as user_functions)")
        return value

    @field_validator("store")
    @classmethod
    def _store(cls, value: str) -> str:
        if not value:
            raise ValueError("must be a local directory or s3://bucket[/prefix]")
        bucket = value[5:].split("/")[0] if value.startswith("s3://") else None
        if bucket == "":
            raise ValueError(f"{value!r} names no bucket")
        # Letters, digits, '.', '-' ("Bucket names can consist only of lowercase letters,
        # numbers, periods (.), and hyphens (-)"; buckets made in us-east-1 before March 2018
        # may hold capitals and '_' too: AWS's "General purpose bucket naming rules").
        if bucket and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*[A-Za-z0-9]", bucket):
            raise ValueError(
                f"{value!r} names no bucket: {bucket!r} is not a bucket's name (letters, "
                "digits, '.' and '-', beginning and ending with a letter or digit)"
            )
        if "://" in value and not value.startswith("s3://"):
            raise ValueError(
                f"{value!r}: a store is a local directory, written as a path (such as "
                f"{value.split('://', 1)[1] or '/data/smpipe'}), or s3://bucket[/prefix]"
            )
        return check_path(value)


class Data(hyperparameters_of("data")):  # SEED
    raw_data: str = ""  # empty: the experiment's raw/ folder in the store
    _raw_data = field_validator("raw_data")(check_path)
    train_fraction: float = Field(0.8, gt=0, lt=1)
    validation_fraction: float = Field(0.1, gt=0, lt=1)
    test_fraction: float = Field(0.1, gt=0, lt=1)
    # Tokens per row at most: prepare applies it once, for every model, and records it beside
    # the prepared data (encoding.json), as Hugging Face's run_glue has max_seq_length among
    # its data arguments. Training reads it from there.
    max_sequence_length: int = Field(128, ge=8, le=131_072)
    instance_type: str = "ml.m5.xlarge"


class Models(Section):
    model_names: list[str]

    @field_validator("model_names", mode="before")
    @classmethod
    def _split(cls, value):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not value:
            raise ValueError("name at least one model")
        return value

    @field_validator("model_names")
    @classmethod
    def _names(cls, value: list[str]) -> list[str]:
        for name in value:
            check_name(name)
        if len(set(value)) != len(value):
            raise ValueError(f"model names repeat: {value}")
        # A model's name also names environment variables (SM_CHANNEL_..., SM_HP_...), upper
        # case, where '-' and '_' are one character: two names must not meet there.
        # Nor in job names (job_name_part): "0" and "0-" name one job.
        keys, parts = {}, {}
        for name in value:
            keys.setdefault(env_key(name), []).append(name)
            parts.setdefault(job_name_part(name), []).append(name)
        clashes = [names for names in (*keys.values(), *parts.values()) if len(names) > 1]
        clashes = [list(c) for c in dict.fromkeys(tuple(c) for c in clashes)]
        if clashes:
            raise ValueError(f"model names differ only in case, '-' and '_': {clashes}")
        return value


class Training(hyperparameters_of("training")):
    """[training]: the hyperparameters of the table (how a model learns, how it checkpoints),
    then the shape of the job."""

    use_distributed: bool = False
    # auto: one process per GPU of the instance (SageMaker's framework containers launch that
    # many; SM_NUM_GPUS), one on an instance without GPUs.
    processes_per_host: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = "auto"
    instance_type: str = "ml.g5.xlarge"
    instance_count: int = Field(1, ge=1, le=100)
    use_spot: bool = False
    # SageMaker's limit on MaxRuntimeInSeconds and MaxWaitTimeInSeconds: 28 days.
    max_run_seconds: int = Field(86400, ge=60, le=2_419_200)
    max_wait_seconds: int = Field(172800, ge=60, le=2_419_200)
    max_restarts: int = Field(3, ge=0, le=100)
    # The programs written beside the weights (safetensors, always): torchscript, exported.
    # Empty: the one [inference] MODEL_FORMAT runs (`Settings.exports`). Each is checked
    # against the eager model, and written once per model: a tuning study's trials write
    # none, its best model is exported after it.
    exports: list[Literal["torchscript", "exported"]] = []

    @field_validator("exports", mode="before")
    @classmethod
    def _formats(cls, value):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        return value

    # A completed run's checkpoints (resume state: weights, optimizer, scheduler) are removed
    # when it completes; true keeps them. Failed and interrupted runs always keep theirs.
    keep_checkpoints_after_run: bool = False
    # SageMaker managed warm pools: a training job's ResourceConfig.KeepAlivePeriodInSeconds,
    # how long its instances wait, billed, for the next matching training job (the run's next
    # model) to start on them without provisioning (train-warm-pools.html). 600: the driver's
    # adoption of one model's outputs fits before the next job is created; after the run's
    # last job the pool idles at most that long. 0: none. The range is the service model's
    # (by key: config_checks.LIMITED). Never sent with spot or tuning jobs
    # (jobs.keep_alive_refused); nothing to keep on the local backend.
    keep_alive_seconds: int = 600


class Tuning(Section):
    objective_metric: str = "validation:f1"
    objective_type: Literal["Maximize", "Minimize"] = "Maximize"
    strategy: Literal["Bayesian", "Random", "Grid", "Hyperband"] = "Bayesian"
    max_jobs: int = Field(4, ge=1, le=10_000)
    max_parallel_jobs: int = Field(1, ge=1, le=100)
    # Auto: a trial whose objective falls behind the median of earlier trials at the same
    # epoch is stopped (SageMaker's TrainingJobEarlyStoppingType).
    early_stopping: Literal["Off", "Auto"] = "Off"


class Inference(Section):
    instance_type: str = "ml.m5.xlarge"
    batch_size: int = Field(64, ge=1, le=65_536)
    model_format: Literal["torchscript", "exported"] = "torchscript"
    # auto: bf16 on a CPU that computes it natively (AMX or AVX512-BF16), else fp32
    # (steps/precision.py); inference then also runs up to 512 test rows in fp32 and records
    # how the two agree. no: fp32.
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"


class Tracking(hyperparameters_of("tracking")):  # WANDB_PROJECT, WANDB_MODE
    # An AWS Secrets Manager secret holding the wandb key, read inside SageMaker jobs.
    wandb_secret_id: str = ""
    # More environment variables whose values are masked wherever a run writes (the wandb,
    # AWS and Hugging Face credentials always are).
    secret_variables: list[str] = []

    @field_validator("secret_variables", mode="before")
    @classmethod
    def _names(cls, value):
        names = (
            [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
        )
        bad = [n for n in names if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n)]
        if bad:
            raise ValueError(f"{bad} are not environment variable names")
        return names


class Hub(Section):
    # HF_HUB_OFFLINE=1 (and TRANSFORMERS_OFFLINE, HF_DATASETS_OFFLINE) in every job: models
    # and tokenizers load from local files only. Off: a job may download from the Hub.
    offline: bool = False
    # An AWS Secrets Manager secret holding a Hugging Face token (gated or private models),
    # read inside sagemaker and emulated jobs as the wandb key is; locally HF_TOKEN is used.
    token_secret_id: str = ""


class Registry(Section):
    # The model package group each completed run's winning model is registered in, as one new
    # version (sagemaker, emulated: SageMaker's model registry; local: <experiment>/registry/).
    # Empty: nothing is registered. A SageMaker EntityName (by key: config_checks.LIMITED).
    model_package_group: str = ""
    # The ModelApprovalStatus a new version gets: the enum of CreateModelPackage's
    # ModelApprovalStatus in botocore's sagemaker service-2.json (a test holds them equal).
    approval_status: Literal["PendingManualApproval", "Approved", "Rejected"] = (
        "PendingManualApproval"
    )


class Cost(Section):
    # [cost] PRICES: on-demand USD per instance-hour by instance type ("ml.g5.xlarge: 1.408,
    # ml.m5.xlarge: 0.23"), for the run's region, training and processing alike, over the
    # shipped table (pipeline/cost.py). Empty: the table alone; a price neither knows is said.
    prices: dict[str, float] = {}

    @field_validator("prices", mode="before")
    @classmethod
    def _pairs(cls, value):
        if not isinstance(value, str):
            return value
        known = {*shape("TrainingInstanceType").enum, *shape("ProcessingInstanceType").enum}
        prices, bad = {}, []
        for pair in filter(None, (p.strip() for p in value.split(","))):
            instance, _, price = (part.strip() for part in pair.partition(":"))
            try:
                number = float(price)
            except ValueError:
                number = math.nan
            if instance not in known:
                close = difflib.get_close_matches(instance, sorted(known), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                what = "an instance type SageMaker trains or processes on"
                bad.append(f"{instance!r} is not {what}{hint}")
            elif not (math.isfinite(number) and number > 0):
                bad.append(f"{pair!r}: write INSTANCE_TYPE: USD per hour, a number above 0")
            elif instance in prices:  # one price each, as a key is set once in a section
                bad.append(
                    f"{instance!r} is priced twice ({prices[instance]:g} and {number:g}); "
                    "write it once"
                )
            else:
                prices[instance] = number
        if bad:
            raise ValueError("; ".join(bad))
        return prices


class Emulated(Section):
    # The image every job of an emulated run runs in, a container per host (`make image` builds
    # smpipe:latest; pipeline/player/images.py); empty: the jobs run as processes of this
    # machine. ENGINE: docker, podman, or auto (docker where its daemon answers).
    image: str = ""
    engine: Literal["auto", "docker", "podman"] = "auto"


class Settings(BaseModel):
    """The whole validated settings file."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    experiment: Experiment
    data: Data
    models: Models
    training: Training
    tuning: Tuning
    inference: Inference
    tracking: Tracking
    hub: Hub
    registry: Registry
    cost: Cost = Cost()
    emulated: Emulated = Emulated()
    # [training.<model>]: what one model trains with, [training] with its overrides applied.
    model_training: dict[str, Training] = {}
    # [tuning.hyperparameters]: constants override [training]; tunables are searched.
    tuning_constants: dict[str, str] = {}
    tunables: dict[str, Tunable] = {}
    # [tuning.hyperparameters.<model>]: one model's own constants and ranges, key by key over
    # the shared ones (a pretrained encoder and a model trained from scratch want different
    # learning rates).
    model_tuning_constants: dict[str, dict[str, str]] = {}
    model_tunables: dict[str, dict[str, Tunable]] = {}
    # [tuning.metric_definitions]: name -> regex read off the training log.
    metric_definitions: dict[str, str] = {}
    source: str = ""  # the file it came from
    applied_ini: str = ""  # the file as applied (environment overrides in), secrets redacted
    overrides: tuple[str, ...] = ()  # what changed it: SMPIPE__ variables, --backend, --image
    # Each per-model value of the file an override of every model's gave way (config_file.py
    # `over_every_model`), in words.
    given_way: tuple[str, ...] = ()
    base_dir: str = ""  # relative local paths resolve against the settings file's folder

    def store_uri(self) -> str:
        store = as_a_shell_reads(self.experiment.store)
        if store.startswith("s3://") or os.path.isabs(store):
            return store
        return str(Path(self.base_dir, store).resolve())

    def raw_data_uri(self) -> str:
        """[data] RAW_DATA as a URI or absolute folder; empty when the store's raw/ is used."""
        raw = as_a_shell_reads(self.data.raw_data)
        if not raw or "://" in raw or os.path.isabs(raw):
            return raw
        return str(Path(self.base_dir, raw).resolve())

    def tuning_space(self, model_name: str) -> tuple[dict[str, str], dict[str, Tunable]]:
        """(constants, searched ranges) of `model_name`'s tuning job: the shared section with
        the model's own section applied key by key (a constant may replace a range)."""
        return merged_space(
            (self.tuning_constants, self.tunables),
            (
                self.model_tuning_constants.get(model_name, {}),
                self.model_tunables.get(model_name, {}),
            ),
        )

    def training_hyperparameters(self, model_name: str, job_kind: str) -> dict[str, str]:
        """What a training job receives: every row of the hyperparameter table, from the
        section that sets it (a tuning trial's constants over them), as strings: SageMaker
        passes hyperparameters as strings."""
        run = {"model_name": model_name, "exports": self.exports(job_kind)}
        sections = {
            "training": self.model_training.get(model_name, self.training),
            "data": self.data,
            "tracking": self.tracking,
        }
        hps = {
            h.name: run[h.name] if h.section == "run" else getattr(sections[h.section], h.name)
            for h in TABLE
        }
        if job_kind == "tuning":
            hps.update(self.tuning_space(model_name)[0])
        return {k: wire(v) for k, v in hps.items()}

    def exports(self, job_kind: str = "training") -> str:
        """The programs a job writes, as it receives them (steps/hyperparameters.py
        EXPORT_CHOICES): [training] EXPORTS, or the one MODEL_FORMAT needs; none for a
        tuning trial, whose study's best model is exported after it (steps/export.py)."""
        if job_kind == "tuning":
            return "none"
        formats = self.training.exports or [self.inference.model_format]
        return ",".join(f for f in ("torchscript", "exported") if f in formats)


SECTIONS: dict[str, type[Section]] = {
    "experiment": Experiment,
    "data": Data,
    "models": Models,
    "training": Training,
    "tuning": Tuning,
    "inference": Inference,
    "tracking": Tracking,
    "hub": Hub,
    "registry": Registry,
    "cost": Cost,
    "emulated": Emulated,
}
