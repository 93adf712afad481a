"""settings.ini -> a typed, validated `Settings`, once, at the boundary: `load_settings`.

Every problem in a file is collected and raised together in one `ConfigError`, each line naming
its section, key and what is allowed. Its parts: the file as text and its SMPIPE__<SECTION>__<KEY>
overrides (config_file.py), each section's model (config_sections.py), a tuning job's search
space (search_space.py), what no one section can check alone (config_checks.py). Here: the
sections typed, per-model sections and tuning ranges. Import what the settings need from here.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from pydantic import ValidationError

from pipeline.config_checks import (
    across_sections,
    lora_keys_unused,
    paths_not_utf8,
    sagemaker_limits,
)
from pipeline.config_file import (
    ConfigError,
    apply_env,
    over_every_model,
    read_ini,
    render_redacted,
)
from pipeline.config_sections import (
    NAME_RE,
    SECTIONS,
    Cost,
    Data,
    Emulated,
    Experiment,
    Hub,
    Inference,
    Models,
    Registry,
    Section,
    Settings,
    Tracking,
    Training,
    Tuning,
)
from pipeline.errors import log
from pipeline.search_space import SECTION as HP
from pipeline.search_space import Categorical, Interval, Tunable, merged_space, parse_tunable
from steps.hyperparameters import HYPERPARAMETERS, PER_MODEL, TUNABLE
from steps.metrics import DEFINITIONS as METRIC_DEFINITIONS
from steps.metrics import check_definition

# What the rest of the pipeline imports of the settings.
__all__ = [
    "NAME_RE",
    "SECTIONS",
    "Categorical",
    "ConfigError",
    "Cost",
    "Data",
    "Emulated",
    "Experiment",
    "Hub",
    "Inference",
    "Interval",
    "Models",
    "Registry",
    "Settings",
    "Tracking",
    "Training",
    "Tuning",
    "Tunable",
    "load_settings",
]

FREE_SECTIONS = (HP, "tuning.metric_definitions")
# Keys that moved: (section, key) -> where they are now and why.
MOVED = {
    ("training", "max_sequence_length"): (
        "moved to [data] MAX_SEQUENCE_LENGTH: prepare applies it once, for every model"
    ),
}


def _pydantic_problems(section: str, error: ValidationError) -> list[str]:
    problems = []
    for e in error.errors():
        key = str(e["loc"][0]).upper() if e["loc"] else "?"
        if e["type"] == "missing":
            problems.append(f"[{section}] {key}: required key is missing")
        elif e["type"] == "extra_forbidden" and (section, key.lower()) in MOVED:
            problems.append(f"[{section}] {key}: {MOVED[section, key.lower()]}")
        elif e["type"] == "extra_forbidden":
            known = [k.upper() for k in SECTIONS[section].model_fields]
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.7)
            hint = f"did you mean {close[0]}? " if close else ""
            problems.append(f"[{section}] {key}: unknown key ({hint}allowed: {', '.join(known)})")
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
    """Read, override from the environment, validate; raise one ConfigError listing everything,
    so a user fixes the whole file in one go. Everything after this sees types, never raw
    strings. Overrides: `SMPIPE__TRAINING__EPOCHS=1`, `SMPIPE__TRAINING_BOW__LEARNING_RATE=1e-2`,
    `SMPIPE__TUNING_HYPERPARAMETERS__LEARNING_RATE=1e-5->1e-3` (dots in a section name become
    underscores)."""
    path = Path(path)
    raw, problems = read_ini(path)
    overrides: dict[tuple[str, str], str] = {}
    given_way = _apply_environment(raw, os.environ if env is None else env, overrides, problems)
    problems += _unknown_sections(raw)
    parsed = _sections(raw, problems)
    names = parsed["models"].model_names if "models" in parsed else None
    if names is not None:
        raw = _sections_named_as_listed(raw, names)
    for prefix in ("training", HP):
        _warn_unlisted(_model_sections(raw, prefix), names, path)
    model_training = _per_model(raw, parsed, problems)
    constants, tunables = _tuning_hyperparameters(raw.get(HP, {}), HP, problems)
    model_constants, model_tunables = _per_model_tuning(raw, problems)
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
    problems += across_sections(parsed, spaces, model_tunables, metrics, str(path))
    if names is not None and "training" in parsed:
        effective = {m: model_training.get(m, parsed["training"]) for m in names}
        problems += lora_keys_unused(parsed["training"], effective, raw, spaces)
    problems += sagemaker_limits(parsed, spaces, model_tunables, metrics)
    if problems:
        raise ConfigError([from_environment(p, overrides) for p in problems], str(path))
    settings = Settings(
        **parsed,
        model_training=model_training,
        tuning_constants=constants,
        tunables=tunables,
        model_tuning_constants=model_constants,
        model_tunables=model_tunables,
        metric_definitions=metrics,
        source=str(path),
        base_dir=str(path.resolve().parent),
        applied_ini=render_redacted(raw),
        overrides=tuple(sorted(set(overrides.values()))),
        given_way=tuple(given_way),
    )
    if problems := paths_not_utf8(settings):
        raise ConfigError([from_environment(p, overrides) for p in problems], str(path))
    return settings


def _apply_environment(raw: dict, env, overrides: dict, problems: list[str]) -> list[str]:
    """The environment's SMPIPE__ variables applied to `raw` (config_file.apply_env), their
    problems added to `problems`; each per-model value of the file an override of every
    model's gave way, in words (said by the run: pipeline/driver.py)."""
    problems += apply_env(raw, dict(env), [*SECTIONS, *FREE_SECTIONS], overrides)
    return over_every_model(raw, overrides)


def _per_model_tuning(raw: dict, problems: list[str]) -> tuple[dict, dict]:
    """Each [tuning.hyperparameters.<model>] section's constants and search spaces, by model."""
    constants, tunables = {}, {}
    for model, section in _model_sections(raw, HP).items():
        constants[model], tunables[model] = _tuning_hyperparameters(raw[section], section, problems)
    return constants, tunables


def from_environment(problem: str, overrides: dict[tuple[str, str], str]) -> str:
    """A problem with a value an SMPIPE__ variable set, naming the variable: the file does not
    hold that value, and a user reading only the file would not find it."""
    for (section, key), var in overrides.items():
        if problem.startswith(f"[{section}] {key.upper()}:"):
            return f"{problem} (set by {var} in the environment)"
    return problem


def _unknown_sections(raw: dict[str, dict[str, str]]) -> list[str]:
    allowed = ", ".join([*SECTIONS, *FREE_SECTIONS, "training.<model>", HP + ".<model>"])
    return [
        f"[{section}]: unknown section (allowed: {allowed})"
        for section in raw
        if section not in SECTIONS
        and section not in FREE_SECTIONS
        and not section.startswith(("training.", HP + "."))
    ]


def _sections_named_as_listed(raw: dict, names: list[str]) -> dict:
    """read_ini lower-cases section names, as it does keys; a model's name keeps the case
    MODEL_NAMES writes it in. So [training.MiniLM] and [training.minilm] are both MiniLM's
    section here. Two names differing in case alone are refused (config_sections.Models), so
    this is never ambiguous."""
    spelled = {name.lower(): name for name in names}
    renamed = {}
    for section, keys in raw.items():
        prefix = next((p for p in (HP, "training") if section.startswith(p + ".")), None)
        if prefix is not None:
            model = section.removeprefix(prefix + ".")
            section = f"{prefix}.{spelled.get(model, model)}"
        renamed[section] = keys
    return renamed


def _model_sections(raw: dict, prefix: str) -> dict[str, str]:
    """model -> its [<prefix>.<model>] section."""
    return {s.removeprefix(prefix + "."): s for s in raw if s.startswith(prefix + ".")}


def _warn_unlisted(sections: dict[str, str], names: list[str] | None, path: Path) -> None:
    """A warning for each per-model section of a model not in MODEL_NAMES, naming the models
    it may be a misspelling of."""
    for model, section in sections.items() if names is not None else ():
        if model in names:
            continue
        spelled = {name.lower(): name for name in names}
        close = [spelled[c] for c in difflib.get_close_matches(model.lower(), spelled, n=2)]
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
    """[training.<model>]: [training] with the model's per-model keys applied. Those of a
    model not in MODEL_NAMES (and [tuning.hyperparameters.<model>]) are checked as fully as
    the others, and not applied: a library of per-model settings MODEL_NAMES selects from."""
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
            close = difflib.get_close_matches(key, PER_MODEL, n=1, cutoff=0.7)
            hint = f"did you mean {close[0].upper()}? " if close else ""
            problems.append(
                f"{where}: not a tunable hyperparameter ({hint}allowed: {', '.join(TUNABLE)}; "
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
