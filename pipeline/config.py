"""settings.ini -> a typed, validated `Settings`, once, at the boundary.

Everything after `load_settings` sees types, never raw strings. Every problem in a file
is collected and raised together in one `ConfigError`, each line naming its section, key
and what is allowed, so a user fixes the whole file in one go.

Environment variables override keys: `SMPIPE__<SECTION>__<KEY>`, e.g.
`SMPIPE__TRAINING__EPOCHS=1`, `SMPIPE__TRAINING_BOW__LEARNING_RATE=1e-2` or
`SMPIPE__TUNING_HYPERPARAMETERS__LEARNING_RATE=1e-5->1e-3` (dots in a section name become
underscores).
"""

from __future__ import annotations

import configparser
import difflib
import io
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from steps.entrypoint import env_key
from steps.hyperparameters import HYPERPARAMETERS, PER_MODEL, TABLE, TUNABLE, Hyperparameter, wire
from steps.metrics import DEFINITIONS as METRIC_DEFINITIONS
from steps.metrics import check_definition

ENV_PREFIX = "SMPIPE__"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
NAME_RULE = "letters, digits, '_' or '-', starting with a letter or digit, at most 63 characters"
SECRET_KEY_RE = re.compile(r"(key|secret|token|password)", re.IGNORECASE)
log = logging.getLogger("smpipe")


class ConfigError(ValueError):
    """Every problem of one settings file, each on its own line."""

    def __init__(self, problems: list[str], source: str = "settings"):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s):\n{lines}")


def check_name(value: str) -> str:
    """A name that becomes part of a path: no '..', no slashes, not empty."""
    if not NAME_RE.match(value or ""):
        raise ValueError(f"{value!r} is not a valid name ({NAME_RULE})")
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
    user_functions: str = "user_functions"

    _name = field_validator("name")(check_name)

    @field_validator("store")
    @classmethod
    def _store(cls, value: str) -> str:
        if not value:
            raise ValueError("must be a local directory or s3://bucket[/prefix]")
        if value.startswith("s3://") and not value[5:].split("/")[0]:
            raise ValueError(f"{value!r} names no bucket")
        return value


class Data(hyperparameters_of("data")):  # SEED
    raw_data: str = ""  # empty: the experiment's raw/ folder in the store
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
        # A model's name also names environment variables (SM_CHANNEL_..., SM_HP_...), where
        # '-' and '_' are one character: two names must not meet there.
        keys = {}
        for name in value:
            keys.setdefault(env_key(name), []).append(name)
        clashes = [names for names in keys.values() if len(names) > 1]
        if clashes:
            raise ValueError(f"model names differ only in '-' and '_': {clashes}")
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
    # (checked by key: LIMITED). Never sent with spot or tuning jobs (jobs.keep_alive_refused);
    # nothing to keep on the local backend.
    keep_alive_seconds: int = 600


@dataclass(frozen=True)
class Interval:
    low: float
    high: float
    integer: bool
    log: bool

    def render(self) -> str:
        return f"{self.low}->{self.high}{' log' if self.log else ''}"


@dataclass(frozen=True)
class Categorical:
    options: tuple[str, ...]


Tunable = Interval | Categorical


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
    # Empty: nothing is registered. A SageMaker EntityName (checked by key: LIMITED).
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
        from pipeline.service_model import shape

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
    base_dir: str = ""  # relative local paths resolve against the settings file's folder

    def store_uri(self) -> str:
        store = self.experiment.store
        if store.startswith("s3://") or os.path.isabs(store):
            return store
        return str(Path(self.base_dir, store).resolve())

    def raw_data_uri(self) -> str:
        """[data] RAW_DATA as a URI or absolute folder; empty when the store's raw/ is used."""
        raw = self.data.raw_data
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
}
FREE_SECTIONS = ("tuning.hyperparameters", "tuning.metric_definitions")
HP, HP_ENV = "tuning.hyperparameters", "tuning_hyperparameters_"
# Keys that moved: (section, key) -> where they are now and why.
MOVED = {
    ("training", "max_sequence_length"): (
        "moved to [data] MAX_SEQUENCE_LENGTH: prepare applies it once, for every model"
    ),
}
INT_RE = re.compile(r"^[+-]?\d+$")


def merged_space(shared: tuple[dict, dict], own: tuple[dict, dict]) -> tuple[dict, dict]:
    """(constants, tunables) of one model: its own keys replace the shared ones, whichever
    kind either is."""
    mine = {*own[0], *own[1]}
    constants = {k: v for k, v in shared[0].items() if k not in mine} | own[0]
    tunables = {k: v for k, v in shared[1].items() if k not in mine} | own[1]
    return constants, tunables


def parse_tunable(text: str) -> Tunable | str:
    """`a->b` (optionally `a->b log`) is an interval, `x,y,z` categorical, else a constant."""
    text = text.strip()
    if "->" in text:
        body, _, scale = text.partition(" ")
        if scale.strip() not in ("", "log"):
            raise ValueError(f"{text!r}: after an interval only 'log' may follow")
        low_s, _, high_s = body.partition("->")
        low_s, high_s = low_s.strip(), high_s.strip()
        if not low_s or not high_s:
            raise ValueError(f"{text!r}: an interval needs both bounds, as in 1e-5->1e-3")
        try:
            low, high = float(low_s), float(high_s)
        except ValueError:
            raise ValueError(f"{text!r}: bounds must be numbers") from None
        if not (math.isfinite(low) and math.isfinite(high)):
            raise ValueError(f"{text!r}: bounds must be finite")
        if low >= high:
            raise ValueError(f"{text!r}: empty interval, the low bound must be below the high one")
        log = scale.strip() == "log"
        if log and low <= 0:
            raise ValueError(f"{text!r}: a log scale needs a low bound above 0")
        integer = bool(INT_RE.match(low_s) and INT_RE.match(high_s))
        return Interval(low, high, integer, log)
    if "," in text:
        options = tuple(o.strip() for o in text.split(","))
        if any(not o for o in options):
            raise ValueError(f"{text!r}: an empty categorical option")
        if len(set(options)) != len(options):
            raise ValueError(f"{text!r}: categorical options repeat")
        return Categorical(options)
    if not text:
        raise ValueError("empty value")
    return text


def _read_text(path: Path) -> str:
    """The file's text; a UTF-8 byte order mark (Windows editors write one) is dropped."""
    try:
        return path.read_bytes().decode("utf-8-sig")
    except FileNotFoundError:
        raise ConfigError([f"settings file not found: {path}"], str(path)) from None
    except IsADirectoryError:
        raise ConfigError(
            [f"{path} is a folder; name the settings .ini file in it"], str(path)
        ) from None
    except PermissionError:
        raise ConfigError(
            [f"settings file {path} cannot be read (permission denied)"], str(path)
        ) from None
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise ConfigError(
            [
                f"line {line}: not UTF-8 text (byte {e.object[e.start]:#04x}); "
                "save the file as UTF-8"
            ],
            str(path),
        ) from None


def _lint_ini(text: str) -> tuple[list[str], str]:
    """Every line configparser would refuse or silently reinterpret, with its number, and
    the text without those lines (so the rest of the file is still checked).

    configparser stops at its first error and joins an indented line to the value above it
    (`EPOCHS = 2` then `  3` reads as "2\n3"); here each such line is a problem of its own."""
    problems: list[str] = []
    kept: list[str] = []
    keys: dict[str, set[str]] = {}  # section -> its keys so far
    section = None
    for number, line in enumerate(text.splitlines(), 1):
        stripped, problem = line.strip(), None
        if not stripped or stripped[0] in "#;":
            kept.append(line)
            continue
        if stripped.startswith("["):
            name = stripped[1:-1].strip().lower() if stripped.endswith("]") else ""
            if not name:
                problem = f"{stripped!r} is not a [section] header"
            elif name in keys:
                problem = f"section [{name}] appears twice"
            section = name or None
            keys.setdefault(name, set())
        elif line[0].isspace():
            problem = (
                f"indented line {stripped!r} would continue the value above it; start it at "
                "the beginning of the line (or comment it out with #)"
            )
        elif "=" not in stripped:
            problem = f"{stripped!r} is not KEY = value"
        elif section is None:
            problem = f"{stripped!r} comes before any [section] header"
        else:
            key = stripped.split("=", 1)[0].strip().lower()
            if not key:
                problem = f"{stripped!r} has no key before '='"
            elif key in keys[section]:
                problem = f"[{section}] {key.upper()} is set twice"
            keys[section].add(key)
        if problem:
            problems.append(f"line {number}: {problem}")
        kept.append("" if problem else line)
    return problems, "\n".join(kept)


def _read_ini(path: Path) -> tuple[dict[str, dict[str, str]], list[str]]:
    """The sections and keys of the file, and every problem of its syntax."""
    problems, text = _lint_ini(_read_text(path))
    parser = configparser.ConfigParser(
        interpolation=None, delimiters=("=",), inline_comment_prefixes=(";",)
    )
    parser.optionxform = str.lower  # keys are case-insensitive; the file writes them in capitals
    try:
        parser.read_string(text, source=str(path))
    except configparser.Error as e:  # what the lint above did not foresee, still one line
        raise ConfigError([*problems, f"not a valid ini file: {e}"], str(path)) from None
    return {s.lower(): dict(parser.items(s)) for s in parser.sections()}, problems


def _apply_env(raw: dict[str, dict[str, str]], env: dict[str, str]) -> list[str]:
    """SMPIPE__<SECTION>__<KEY> overrides; one that names no section is refused, not ignored."""
    names = {s.replace(".", "_"): s for s in list(SECTIONS) + list(FREE_SECTIONS)}
    problems = []
    for var, value in sorted(env.items()):
        if not var.startswith(ENV_PREFIX):
            continue
        section, sep, key = var[len(ENV_PREFIX) :].lower().partition("__")
        if not sep or not key or not section:
            problems.append(f"environment {var}: write it as {ENV_PREFIX}<SECTION>__<KEY>")
        elif section in names:
            raw.setdefault(names[section], {})[key] = value
        elif section.startswith("training_"):  # SMPIPE__TRAINING_<MODEL>__<KEY>
            raw.setdefault("training." + section.removeprefix("training_"), {})[key] = value
        elif section.startswith(HP_ENV):  # SMPIPE__TUNING_HYPERPARAMETERS_<MODEL>__<KEY>
            raw.setdefault(HP + "." + section.removeprefix(HP_ENV), {})[key] = value
        else:
            allowed = (
                ", ".join(n.upper() for n in names)
                + ", TRAINING_<MODEL>, TUNING_HYPERPARAMETERS_<MODEL>"
            )
            problems.append(f"environment {var}: no section {section.upper()} (allowed: {allowed})")
    return problems


def _pydantic_problems(section: str, error: ValidationError) -> list[str]:
    problems = []
    for e in error.errors():
        key = str(e["loc"][0]).upper() if e["loc"] else "?"
        if e["type"] == "missing":
            problems.append(f"[{section}] {key}: required key is missing")
        elif e["type"] == "extra_forbidden" and (section, key.lower()) in MOVED:
            problems.append(f"[{section}] {key}: {MOVED[section, key.lower()]}")
        elif e["type"] == "extra_forbidden":
            allowed = ", ".join(k.upper() for k in SECTIONS[section].model_fields)
            problems.append(f"[{section}] {key}: unknown key (allowed: {allowed})")
        else:
            msg = e["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
            problems.append(f"[{section}] {key}: {msg} (got {e.get('input')!r})")
    return problems


def _out_of_bounds(where: str, key: str, value: Tunable | str) -> list[str]:
    """A searched value obeys the bounds [training] KEY has: each bound, option or constant."""
    if isinstance(value, Interval):
        candidates = [value.low, value.high]
    else:
        candidates = list(value.options) if isinstance(value, Categorical) else [value]
    problems = []
    for candidate in candidates:
        try:
            Training(**{key: candidate})
        except ValidationError as e:
            msg = e.errors()[0]["msg"].replace("Input should be", "must be")
            problems.append(f"{where}: {candidate!r} {msg} (the bound of [training] {key.upper()})")
    return problems


def load_settings(path: str | os.PathLike, env: dict[str, str] | None = None) -> Settings:
    """Read, override from the environment, validate; raise one ConfigError listing everything."""
    path = Path(path)
    raw, problems = _read_ini(path)
    problems += _apply_env(raw, dict(os.environ) if env is None else env)
    problems += _unknown_sections(raw)
    parsed = _sections(raw, problems)
    # [training.<model>] and [tuning.hyperparameters.<model>] of a model not in MODEL_NAMES
    # are checked as fully as the others, and not applied: a library of per-model settings
    # that MODEL_NAMES selects from.
    names = parsed["models"].model_names if "models" in parsed else None
    for prefix in ("training", HP):
        _warn_unlisted(_model_sections(raw, prefix), names, path)
    model_training = _per_model(raw, parsed, problems)
    constants, tunables = _tuning_hyperparameters(raw.get(HP, {}), HP, problems)
    model_constants, model_tunables = {}, {}
    for model, section in _model_sections(raw, HP).items():
        model_constants[model], model_tunables[model] = _tuning_hyperparameters(
            raw[section], section, problems
        )
    if names is not None:
        model_training = {m: t for m, t in model_training.items() if m in names}
        model_constants = {m: c for m, c in model_constants.items() if m in names}
        model_tunables = {m: t for m, t in model_tunables.items() if m in names}
    metrics = _metric_definitions(raw, problems)
    spaces = {
        m: (
            f"{HP}.{m}",
            merged_space(
                (constants, tunables), (model_constants.get(m, {}), model_tunables.get(m, {}))
            )[1],
        )
        for m in (parsed["models"].model_names if "models" in parsed else [])
    }
    problems += _across_sections(parsed, spaces, model_tunables, metrics)
    problems += _sagemaker_limits(parsed, spaces, model_tunables, metrics)
    if problems:
        raise ConfigError(problems, str(path))
    return Settings(
        **parsed,
        model_training=model_training,
        tuning_constants=constants,
        tunables=tunables,
        model_tuning_constants=model_constants,
        model_tunables=model_tunables,
        metric_definitions=metrics,
        source=str(path),
        base_dir=str(path.resolve().parent),
        applied_ini=_render_redacted(raw),
    )


def _unknown_sections(raw: dict[str, dict[str, str]]) -> list[str]:
    allowed = ", ".join([*SECTIONS, *FREE_SECTIONS, "training.<model>", HP + ".<model>"])
    return [
        f"[{section}]: unknown section (allowed: {allowed})"
        for section in raw
        if section not in SECTIONS
        and section not in FREE_SECTIONS
        and not section.startswith(("training.", HP + "."))
    ]


def _model_sections(raw: dict, prefix: str) -> dict[str, str]:
    """model -> its [<prefix>.<model>] section."""
    return {s.removeprefix(prefix + "."): s for s in raw if s.startswith(prefix + ".")}


def _warn_unlisted(sections: dict[str, str], names: list[str] | None, path: Path) -> None:
    """A warning for each per-model section of a model not in MODEL_NAMES, naming the models
    it may be a misspelling of."""
    for model, section in sections.items() if names is not None else ():
        if model in names:
            continue
        close = difflib.get_close_matches(model, names, n=2)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        log.warning(
            f"warning: {path}: [{section}] is checked but not applied: {model!r} is not in "
            f"[models] MODEL_NAMES ({', '.join(names)}){hint}"
        )


def _sections(raw: dict[str, dict[str, str]], problems: list[str]) -> dict[str, Section]:
    """Each fixed section as its typed model; a section with problems is left out."""
    parsed: dict[str, Section] = {}
    for section, model in SECTIONS.items():
        try:
            parsed[section] = model(**raw.get(section, {}))
        except ValidationError as e:
            problems.extend(_pydantic_problems(section, e))
    return parsed


def _per_model(raw: dict, parsed: dict[str, Section], problems: list[str]) -> dict[str, Training]:
    """[training.<model>]: [training] with the model's per-model keys applied."""
    model_training: dict[str, Training] = {}
    allowed = ", ".join(k.upper() for k in PER_MODEL)
    for model, section in _model_sections(raw, "training").items():
        for key in raw[section]:
            if ("training", key) in MOVED:
                problems.append(f"[{section}] {key.upper()}: {MOVED['training', key]}")
            elif key not in PER_MODEL:
                problems.append(
                    f"[{section}] {key.upper()}: not a per-model key (allowed: {allowed})"
                )
        if "training" not in parsed:
            continue
        try:
            shared = {
                k: v for k, v in raw.get("training", {}).items() if ("training", k) not in MOVED
            }
            own = {k: v for k, v in raw[section].items() if k in PER_MODEL}
            model_training[model] = Training(**(shared | own))
        except ValidationError as e:
            problems.extend(
                p.replace("[training]", f"[{section}]") for p in _pydantic_problems("training", e)
            )
    return model_training


def _tuning_hyperparameters(
    values: dict[str, str], section: str, problems: list[str]
) -> tuple[dict[str, str], dict[str, Tunable]]:
    """[tuning.hyperparameters] or a model's own: constants and searched ranges, each typed
    and bounded."""
    constants: dict[str, str] = {}
    tunables: dict[str, Tunable] = {}
    for key, text in values.items():
        where = f"[{section}] {key.upper()}"
        # Ranges only over what changes how a model learns; a constant may also set a trial's
        # budget or precision (MAX_STEPS, MIXED_PRECISION), as a tuning job's static
        # hyperparameters do.
        constant_only = [k for k in PER_MODEL if k not in TUNABLE]
        if key not in PER_MODEL:
            problems.append(
                f"{where}: not a tunable hyperparameter (allowed: {', '.join(TUNABLE)}; "
                f"as a single value also {', '.join(constant_only)})"
            )
            continue
        try:
            value = parse_tunable(text)
        except ValueError as e:
            problems.append(f"{where}: {e}")
            continue
        if key in constant_only and not isinstance(value, str):
            problems.append(
                f"{where}: takes a single value, not a range (searched: {', '.join(TUNABLE)})"
            )
            continue
        kind = HYPERPARAMETERS[key].type
        typed = []
        if isinstance(value, Interval) and kind is int and not value.integer:
            typed.append(f"{where}: {text!r} must have whole-number bounds for an integer")
        elif isinstance(value, str | Categorical):
            for option in value.options if isinstance(value, Categorical) else (value,):
                try:
                    kind(option)
                except ValueError:
                    typed.append(f"{where}: {option!r} is not a {kind.__name__}")
        problems += typed or _out_of_bounds(where, key, value)
        if isinstance(value, str):
            constants[key] = value
        else:
            tunables[key] = value
    return constants, tunables


def _metric_definitions(raw: dict, problems: list[str]) -> dict[str, str]:
    # Every metric train.py prints has a regex already; the section may add or override.
    metrics: dict[str, str] = dict(METRIC_DEFINITIONS)
    for key, regex in raw.get("tuning.metric_definitions", {}).items():
        problem = check_definition(key, regex)
        if problem:
            problems.append(f"[tuning.metric_definitions] {key.upper()}: {problem}")
            continue
        metrics[key] = regex
    return metrics


def _across_sections(
    parsed: dict[str, Section],
    spaces: dict[str, tuple[str, dict[str, Tunable]]],
    own: dict[str, dict[str, Tunable]],
    metrics: dict[str, str],
) -> list[str]:
    """What no one section can check alone, as one flat list of rules, each a few lines (the
    backend's and the tuning job's apart). `spaces`: each model's section and searched ranges,
    `own`: the ranges its own section sets."""
    problems: list[str] = []
    if "data" in parsed:
        d = parsed["data"]
        total = d.train_fraction + d.validation_fraction + d.test_fraction
        if abs(total - 1.0) > 1e-6:
            problems.append(
                "[data] TRAIN_FRACTION + VALIDATION_FRACTION + TEST_FRACTION must sum to 1 "
                f"(got {total:g})"
            )
    problems += _sagemaker_needs(parsed)
    problems += _tuning_needs(parsed, spaces, own)
    if "tuning" in parsed and parsed["tuning"].objective_metric not in metrics:
        problems.append(
            f"[tuning] OBJECTIVE_METRIC: {parsed['tuning'].objective_metric!r} is not a metric "
            f"(train.py prints {', '.join(METRIC_DEFINITIONS)}; [tuning.metric_definitions] "
            f"defines {', '.join(k for k in metrics if k not in METRIC_DEFINITIONS) or 'no other'})"
        )
    if "training" in parsed and "inference" in parsed:
        formats, needed = parsed["training"].exports, parsed["inference"].model_format
        if formats and needed not in formats:
            problems.append(
                f"[training] EXPORTS ({', '.join(formats)}) leaves out {needed}, the program "
                f"[inference] MODEL_FORMAT runs: add it, or leave EXPORTS empty"
            )
    if "training" in parsed:
        t = parsed["training"]
        if t.instance_count > 1 and not t.use_distributed:
            problems.append("[training] INSTANCE_COUNT > 1 needs USE_DISTRIBUTED = true")
        if t.use_spot and t.max_wait_seconds < t.max_run_seconds:
            problems.append(
                f"[training] MAX_WAIT_SECONDS ({t.max_wait_seconds}) must be at least "
                f"MAX_RUN_SECONDS ({t.max_run_seconds}): SageMaker's MaxWaitTimeInSeconds "
                "includes the run"
            )
    return problems


def _sagemaker_needs(parsed: dict[str, Section]) -> list[str]:
    """What the sagemaker backend needs of the other sections."""
    problems: list[str] = []
    if not ("experiment" in parsed and parsed["experiment"].backend == "sagemaker"):
        return problems
    e = parsed["experiment"]
    if not e.store.startswith("s3://"):
        problems.append("[experiment] STORE: the sagemaker backend needs an s3:// store")
    if not e.role_arn.startswith("arn:"):
        problems.append("[experiment] ROLE_ARN: the sagemaker backend needs an IAM role ARN")
    if not e.image_uri:
        problems.append(
            "[experiment] IMAGE_URI: the sagemaker backend needs the image built from docker/"
        )
    tracking = parsed.get("tracking")
    if tracking and tracking.wandb_mode == "online" and not tracking.wandb_secret_id:
        problems.append(
            "[tracking] WANDB_MODE = online on the sagemaker backend needs WANDB_SECRET_ID: "
            "a SageMaker job has no WANDB_API_KEY of its own (set the secret, or "
            "WANDB_MODE = offline)"
        )
    return problems


def _tuning_needs(
    parsed: dict[str, Section],
    spaces: dict[str, tuple[str, dict[str, Tunable]]],
    own: dict[str, dict[str, Tunable]],
) -> list[str]:
    """What JOB = tune needs of the ranges and of [tuning]."""
    problems: list[str] = []
    if not ("experiment" in parsed and parsed["experiment"].job == "tune"):
        return problems
    grid = "tuning" in parsed and parsed["tuning"].strategy == "Grid"
    for model, (section, tunables) in spaces.items():
        if not tunables:
            problems.append(
                f"[{HP}]: JOB = tune needs at least one tunable (a->b or x,y,z) for {model}"
            )
        ranges = [(k, v) for k, v in tunables.items() if isinstance(v, Interval)]
        for key, value in ranges if grid else ():
            where = section if key in own.get(model, {}) else HP
            problem = (
                f"[{where}] {key.upper()}: STRATEGY = Grid takes categorical options only "
                f"(x,y,z), not {value.render()}"
            )
            if problem not in problems:  # a shared range is one problem, not one per model
                problems.append(problem)
    if (
        "tuning" in parsed
        and parsed["tuning"].strategy == "Hyperband"
        and parsed["tuning"].early_stopping == "Auto"
    ):
        problems.append(
            "[tuning] EARLY_STOPPING: Hyperband stops trials early by itself; set "
            "EARLY_STOPPING = Off (SageMaker refuses both)"
        )
    if "tuning" in parsed:
        problems += _tuning_limits(parsed["tuning"], spaces, own)
    return problems


# Automatic model tuning's resource limits (https://docs.aws.amazon.com/sagemaker/latest/dg/
# automatic-model-tuning-limits.html; pipeline/service_model.py TRAINING_JOBS_LIMIT checks the
# request too): "Number of training jobs per hyperparameter tuning job" is 750 for "[Bayesian
# optimization]", "[Hyperband]" and "[Grid] ..., either specified explicitly or inferred from
# the search space", none of them increasable; "[Random search]" 750, "Can be increased to"
# 10000 ([tuning] MAX_JOBS's own bound). Checked on every backend, as every SageMaker limit
# is: the same settings run anywhere. Hyperband's MaxResource ("The maximum value is 20,000
# epochs") is a trial's most epochs, which [training] EPOCHS bounds at 10,000.
TRAINING_JOBS_PER_TUNING_JOB = 750
RANDOM_TRAINING_JOBS_PER_TUNING_JOB = 10_000
LIMITS_PAGE = "automatic-model-tuning-limits.html"


def _tuning_limits(
    tuning: Tuning,
    spaces: dict[str, tuple[str, dict[str, Tunable]]],
    own: dict[str, dict[str, Tunable]],
) -> list[str]:
    """[tuning] MAX_JOBS, and a grid's combinations, against SageMaker's training jobs per
    tuning job; a Random search past 750 is said to need a quota increase."""
    problems: list[str] = []
    limit, strategy = TRAINING_JOBS_PER_TUNING_JOB, tuning.strategy
    if strategy in ("Bayesian", "Hyperband") and tuning.max_jobs > limit:
        problems.append(
            f"[tuning] MAX_JOBS: {tuning.max_jobs}; with STRATEGY = {strategy} SageMaker runs at "
            f"most {limit} training jobs per hyperparameter tuning job, a limit that cannot be "
            f"increased ({LIMITS_PAGE}); STRATEGY = Random goes up to "
            f"{RANDOM_TRAINING_JOBS_PER_TUNING_JOB:,} with a quota increase"
        )
    if strategy == "Random" and tuning.max_jobs > limit:
        log.warning(
            f"warning: [tuning] MAX_JOBS = {tuning.max_jobs}: SageMaker's default limit is "
            f'{limit} training jobs per tuning job with Random search; it "can be increased to" '
            f"{RANDOM_TRAINING_JOBS_PER_TUNING_JOB:,} (Service Quotas, {LIMITS_PAGE})"
        )
    for model, (section, tunables) in spaces.items() if strategy == "Grid" else ():
        options = {k: v.options for k, v in tunables.items() if isinstance(v, Categorical)}
        combinations = math.prod(len(o) for o in options.values())
        if combinations > limit:
            keys = " x ".join(
                f"[{section if k in own.get(model, {}) else HP}] {k.upper()} ({len(o)})"
                for k, o in options.items()
            )
            problems.append(
                f"{keys}: STRATEGY = Grid runs every combination, {combinations:,} for {model}; "
                f"SageMaker runs at most {limit} training jobs per hyperparameter tuning job, "
                f'"either specified explicitly or inferred from the search space" '
                f"({LIMITS_PAGE}): fewer options, or STRATEGY = Random"
            )
    return problems


def _render_redacted(raw: dict[str, dict[str, str]]) -> str:
    """The settings as they were applied (file + environment overrides), secrets blanked."""
    out = configparser.ConfigParser(interpolation=None, delimiters=("=",))
    out.optionxform = str.upper
    for section, values in raw.items():
        out.add_section(section)
        for key, value in values.items():
            # An empty value hides nothing: it stays empty (it says "not set", not "a secret").
            masked = value and SECRET_KEY_RE.search(key)
            out.set(section, key, "<redacted>" if masked else value)
    buf = io.StringIO()
    out.write(buf)
    return buf.getvalue()


# Settings that become one field of a SageMaker request: (section, key, the field's shape in
# the service model, how the request writes the value). Every Environment value of a
# processing job is at most 256 characters; each of these reaches the jobs as one.
LIMITED = (
    ("data", "instance_type", "ProcessingInstanceType", str),
    ("inference", "instance_type", "ProcessingInstanceType", str),
    ("training", "instance_type", "TrainingInstanceType", str),
    ("training", "keep_alive_seconds", "KeepAlivePeriodInSeconds", int),
    ("experiment", "role_arn", "RoleArn", str),
    ("experiment", "image_uri", "AlgorithmImage", str),
    ("experiment", "user_functions", "ProcessingEnvironmentValue", str),
    ("tracking", "wandb_secret_id", "ProcessingEnvironmentValue", str),
    ("tracking", "secret_variables", "ProcessingEnvironmentValue", ",".join),
    ("hub", "token_secret_id", "ProcessingEnvironmentValue", str),
    ("registry", "model_package_group", "EntityName", str),  # CreateModelPackageGroup's name
)


def _sagemaker_limits(
    parsed: dict[str, Section],
    spaces: dict[str, tuple[str, dict[str, Tunable]]],
    own: dict[str, dict[str, Tunable]],
    metrics: dict[str, str],
) -> list[str]:
    """Settings that become fields of a SageMaker request, against the limits of those fields
    in the service model (pipeline/service_model.py): said here by key, before a plan is made.
    `smpipe plan` checks the whole requests again."""
    from pipeline.service_model import check_value, shape

    checks = [
        (f"[{section}] {key.upper()}", kind, write(getattr(parsed[section], key)))
        for section, key, kind, write in LIMITED
        if section in parsed and getattr(parsed[section], key)  # empty: not sent
    ]
    for model, (section, tunables) in spaces.items():
        for key, value in tunables.items():
            if isinstance(value, Categorical):  # one problem per section that says it
                where = section if key in own.get(model, {}) else HP
                checks.append((f"[{where}] {key.upper()}", "ParameterValues", list(value.options)))
    for name, regex in metrics.items():
        checks.append((f"[tuning.metric_definitions] {name.upper()}", "MetricName", name))
        checks.append((f"[tuning.metric_definitions] {name.upper()}", "MetricRegex", regex))
    problems = [
        f"{where}: {v.value!r} {_said(v.constraint, kind)}"
        for where, kind, value in checks
        for v in check_value(kind, value, where)
    ]
    if "models" in parsed:  # prepare and inference take the list as one ContainerArguments entry
        joined, limit = (
            ",".join(parsed["models"].model_names),
            shape("ContainerArgument").metadata["max"],
        )
        if len(joined) > limit:
            problems.append(
                f"[models] MODEL_NAMES: {len(joined)} characters with the commas; SageMaker passes "
                f"them to a job as one argument of at most {limit}"
            )
    if len(metrics) > 20:  # a tuning job's quota (automatic-model-tuning-limits.html)
        problems.append(
            f"[tuning.metric_definitions]: {len(metrics)} metrics; SageMaker's tuning jobs take "
            "at most 20"
        )
    return list(dict.fromkeys(problems))


def _said(constraint: str, shape_name: str) -> str:
    """SageMaker's "Member must ..." as a sentence about a setting."""
    if constraint.startswith("Member must satisfy enum value set"):
        hint = (
            constraint[constraint.rfind("(did you mean") :] if "(did you mean" in constraint else ""
        )
        return f"is not a value SageMaker accepts for {shape_name} {hint}".rstrip()
    return constraint.replace("Member must", "must", 1).replace(
        "have length less than or equal to", "have at most"
    )
