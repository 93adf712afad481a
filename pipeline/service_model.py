"""Every SageMaker request checked as SageMaker checks it, before it is sent, on every backend.

boto3 checks only required members, types and minimum lengths (botocore/validate.py:
`range_check` reads `min` and nothing else); moto checks none of it. `check` walks botocore's
SageMaker service model from the operation's input shape and enforces every constraint it
declares (lengths, patterns, enums, ranges, sizes), then the documented limits it does not
carry (`DOCUMENTED`), and answers in SageMaker's own words (`Violation`).
"""

from __future__ import annotations

import difflib
import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from steps.runtime.names import PROCESSING_DIR

SERVICE = "sagemaker"


@dataclass(frozen=True)
class Violation:
    """One broken constraint, as SageMaker's validation message says it ("Value 'x' at 'path'
    failed to satisfy constraint: Member must satisfy regular expression pattern: ..."), with
    the field path as the request writes it (`--show-requests` prints the same request)."""

    path: str  # the field, as the request writes it: ResourceConfig.InstanceType
    constraint: str  # SageMaker's words: "Member must have length less than or equal to 63"
    value: Any = None

    def __str__(self) -> str:
        value = _shown(self.value)
        return f"Value {value} at '{self.path}' failed to satisfy constraint: {self.constraint}"


def job_name_part(text: str) -> str:
    """`text` as a part of a job's name: a job name is letters, digits and '-' between them
    (TrainingJobName, ProcessingJobName: pattern "[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}" in
    botocore's sagemaker service-2.json), so every run of other characters is one '-', and
    none is left at either end. Two names whose parts meet name one job."""
    return re.sub(r"-+", "-", re.sub(r"[^a-zA-Z0-9]+", "-", text)).strip("-")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + f"... ({len(str(value))} characters)"


@functools.cache
def service_model():
    """botocore's SageMaker service model, loaded once per process (and only when a request or
    a setting is checked)."""
    import botocore.session

    return botocore.session.get_session().get_service_model(SERVICE)


def shape(name: str):
    return service_model().shape_for(name)


@functools.cache
def _pattern(text: str):
    """A service pattern compiled to match as SageMaker does: the service's patterns are Java
    regular expressions, matched against the whole value as Java's `String.matches` does
    (SageMaker's own errors quote them anchored: `^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}` for a job
    name), with Java's meaning of `.`, `$`, `\\d`, `\\s`, `\\w` and the POSIX classes
    (`as_java`): a value with a `\\r` fails `.*` there as here. The `regex` package reads their
    `\\p{L}`-style classes, which Python's `re` does not; transformers depends on it already."""
    import regex

    # Java writes a code point above U+FFFF as its UTF-16 surrogate pair; Python as itself.
    text = text.replace("\\uD800\\uDC00-\\uDBFF\\uDFFF", "\\U00010000-\\U0010FFFF")
    return regex.compile(as_java(text))


# What java.util.regex.Pattern means by the constructs whose meaning Python's differs from
# (https://docs.oracle.com/en/java/javase/21/docs/api/java.base/java/util/regex/Pattern.html,
# "Predefined character classes", "POSIX character classes (US-ASCII only)", "Line
# terminators"; openjdk/jdk src/java.base/share/classes/java/util/regex/Pattern.java):
# - "A line terminator is a one- or two-character sequence that marks the end of a line of the
#   input character sequence": \n, \r\n, \r, \u0085, \u2028, \u2029; "If UNIX_LINES mode is not
#   activated, the regular expression . matches any character except a line terminator unless
#   the DOTALL flag is specified" (Python's `.` excludes \n alone);
# - \d is [0-9], \s [ \t\n\x0B\f\r], \w [a-zA-Z_0-9] "if UNICODE_CHARACTER_CLASS is not set"
#   (Python's are Unicode: '٣' is a \d, 'é' a \w, '\u00a0' a \s), their negations [^...];
# - \p{Alnum} and the other POSIX classes are US-ASCII only (regex's \p{Alnum} is Unicode);
# - `$`: "When not in multiline mode, the $ can only match at the very end of the input, unless
#   the input ends in a line terminator in which it matches right before the last line
#   terminator" (Pattern.java, class Dollar; Python's `$` before a final \n only).
# SageMaker's service sets none of DOTALL, UNIX_LINES, UNICODE_CHARACTER_CLASS: its patterns
# are matched as they are written (its errors quote them so).
JAVA_TERMINATORS = "\\n\\r\\x85\\u2028\\u2029"
JAVA_CLASSES = {  # escape -> its members, written for inside a [...] set
    "d": "0-9",
    "s": " \\t\\n\\x0B\\f\\r",
    "w": "a-zA-Z_0-9",
    "h": " \\t\\xA0\\u1680\\u180e\\u2000-\\u200a\\u202f\\u205f\\u3000",
    "v": "\\n\\x0B\\f\\r\\x85\\u2028\\u2029",
    "p{Lower}": "a-z",
    "p{Upper}": "A-Z",
    "p{ASCII}": "\\x00-\\x7F",
    "p{Alpha}": "a-zA-Z",
    "p{Digit}": "0-9",
    "p{Alnum}": "a-zA-Z0-9",
    "p{Punct}": "!-/:-@\\[-`{-~",
    "p{Graph}": "!-~",
    "p{Print}": " -~",
    "p{Blank}": " \\t",
    "p{Cntrl}": "\\x00-\\x1F\\x7F",
    "p{XDigit}": "0-9a-fA-F",
    "p{Space}": " \\t\\n\\x0B\\f\\r",
}
JAVA_NEGATED = {
    "D": "d",
    "S": "s",
    "W": "w",
    "H": "h",
    "V": "v",
    **{f"P{k[1:]}": k for k in JAVA_CLASSES if k[0] == "p"},
}


def as_java(pattern: str) -> str:
    """`pattern` rewritten so that Python's `regex` matches what Java's Pattern matches: `.`,
    `$`, the predefined and POSIX classes spelt out (JAVA_CLASSES). Raises ValueError on a
    construct whose translation is not written here (a nested set), rather than match it
    otherwise than SageMaker does; a test translates every pattern of the service model."""
    out, i, in_set = [], 0, None  # in_set: the positive members and negated escapes of a [...]
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            escape = pattern[i + 1 : i + 2]
            if escape in "pP" and pattern[i + 2 : i + 3] == "{":
                escape = pattern[i + 1 : pattern.index("}", i) + 1]
            if escape in ("Q", "E"):
                raise ValueError(f"{pattern!r}: \\Q...\\E quoting is not translated")
            i += 1 + len(escape)
            if in_set is not None:
                if escape in JAVA_CLASSES:
                    in_set[0].append(JAVA_CLASSES[escape])
                elif escape in JAVA_NEGATED:
                    in_set[1].append(JAVA_CLASSES[JAVA_NEGATED[escape]])
                else:
                    in_set[0].append("\\" + escape)
            elif escape in JAVA_CLASSES:
                out.append(f"[{JAVA_CLASSES[escape]}]")
            elif escape in JAVA_NEGATED:
                out.append(f"[^{JAVA_CLASSES[JAVA_NEGATED[escape]]}]")
            else:
                out.append("\\" + escape)
            continue
        if in_set is not None:
            if char == "[":
                raise ValueError(f"{pattern!r}: a nested character class is not translated")
            if char == "]" and (in_set[0] or in_set[1]) and in_set[0] != ["^"]:
                out.append(_java_set(*in_set))
                in_set = None
            else:
                in_set[0].append(char)
        elif char == "[":
            in_set = ([], [])
        elif char == ".":
            out.append(f"[^{JAVA_TERMINATORS}]")
        elif char == "$":
            out.append(f"(?=(?:\\r\\n|[{JAVA_TERMINATORS}])?\\Z)")
        else:
            out.append(char)
        i += 1
    if in_set is not None:
        raise ValueError(f"{pattern!r}: an unclosed character class")
    return "".join(out)


def _java_set(members: list[str], negated: list[str]) -> str:
    """A [...] set whose members may include negated classes (Java's [\\S\\s]): the union of
    the plain set and each negated class, as Python's V0 sets cannot hold a negated class."""
    plain = "".join(members)
    if not negated:
        return f"[{plain}]"
    if plain.startswith("^"):
        raise ValueError(f"[{plain}...]: a negated set holding a negated class is not translated")
    return "(?:" + "|".join(([f"[{plain}]"] if plain else []) + [f"[^{n}]" for n in negated]) + ")"


def check(operation: str, request: dict) -> list[Violation]:
    """Every way `request` breaks what SageMaker accepts for `operation`, or []: the service
    model botocore ships (botocore/data/sagemaker/2017-07-24/service-2.json) declares every
    constraint SageMaker itself enforces on input, so without this an instance-type typo or a
    257-character argument would pass `emulated` and fail on AWS."""
    found: list[Violation] = []
    _walk(service_model().operation_model(operation).input_shape, request, "", found)
    for rule in DOCUMENTED.get(operation, ()):
        found += rule(request)
    return found


def check_value(shape_name: str, value: Any, path: str) -> list[Violation]:
    """One value against one shape of the model (a setting that becomes that field)."""
    found: list[Violation] = []
    _walk(shape(shape_name), value, path, found)
    return found


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


# The Python types a value of each kind of shape may have (bool is an int in Python; not here).
TYPES = {
    "structure": dict,
    "map": dict,
    "list": (list, tuple),
    "string": str,
    "boolean": bool,
    "integer": int,
    "long": int,
    "float": (int, float),
    "double": (int, float),
}


def _walk(s, value: Any, path: str, found: list[Violation]) -> None:
    """Every constraint of shape `s` on `value`, and of its members' shapes on its members."""
    expected = TYPES.get(s.type_name)
    numeric_bool = s.type_name not in ("boolean", "structure") and isinstance(value, bool)
    if expected is not None and (not isinstance(value, expected) or numeric_bool):
        found.append(Violation(path, f"Member must be of type {s.type_name}", value))
        return
    check = CHECKS.get(s.type_name)
    if check is not None:
        check(s, value, path, found)


def _structure(s, value: dict, path: str, found: list[Violation]) -> None:
    for name in s.required_members:
        if value.get(name) is None:
            found.append(Violation(_join(path, name), "Member must not be null"))
    for name, item in value.items():
        if name not in s.members:
            valid = ", ".join(s.members)
            found.append(Violation(_join(path, name), f"Unknown parameter; valid: {valid}"))
        elif item is not None:
            _walk(s.members[name], item, _join(path, name), found)


def _list(s, value: list, path: str, found: list[Violation]) -> None:
    _size(s.metadata, len(value), value, path, found)
    for i, item in enumerate(value):
        _walk(s.member, item, f"{path}[{i}]", found)


def _map(s, value: dict, path: str, found: list[Violation]) -> None:
    _size(s.metadata, len(value), value, path, found)
    for key, item in value.items():
        _walk(s.key, key, f"{path} (key {key!r})", found)
        _walk(s.value, item, _join(path, str(key)), found)


def _string(s, value: str, path: str, found: list[Violation]) -> None:
    _size(s.metadata, len(value), value, path, found)
    if s.enum and value not in s.enum:
        near = difflib.get_close_matches(value, s.enum, n=1, cutoff=0.8)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        shown = ", ".join(s.enum[:8]) + (f", ... {len(s.enum)} in all" if len(s.enum) > 8 else "")
        # The list is the installed botocore's, not the service's: botocore 1.34.0 knew 51
        # training instance types, 1.44.8 knows 225. Naming the release says what to upgrade.
        import botocore

        known = f" (botocore {botocore.__version__}'s list: a newer botocore may know more)"
        found.append(
            Violation(path, f"Member must satisfy enum value set: [{shown}]{hint}{known}", value)
        )
    pattern = s.metadata.get("pattern")
    if pattern and not _pattern(pattern).fullmatch(value):
        found.append(
            Violation(path, f"Member must satisfy regular expression pattern: {pattern}", value)
        )


def _number(s, value: float, path: str, found: list[Violation]) -> None:
    low, high = s.metadata.get("min"), s.metadata.get("max")
    if low is not None and value < low:
        found.append(
            Violation(path, f"Member must have value greater than or equal to {low}", value)
        )
    if high is not None and value > high:
        found.append(Violation(path, f"Member must have value less than or equal to {high}", value))


def _size(md: dict, size: int, value: Any, path: str, found: list[Violation]) -> None:
    if "min" in md and size < md["min"]:
        found.append(
            Violation(path, f"Member must have length greater than or equal to {md['min']}", value)
        )
    if "max" in md and size > md["max"]:
        found.append(
            Violation(path, f"Member must have length less than or equal to {md['max']}", value)
        )


CHECKS = {
    "structure": _structure,
    "list": _list,
    "map": _map,
    "string": _string,
    "integer": _number,
    "long": _number,
    "float": _number,
    "double": _number,
}


# -- what the documentation says and the model does not carry --------------------------------
# Each rule names its source. Where a page and the model disagree (the HyperParameters value
# limit: 2500 in the model, 256 in the developer guide's text), the model wins: it is what the
# service validates with.

MAX_RUNTIME = 28 * 24 * 3600
# The names Hyperband reads the maximum resource from when StrategyConfig does not give one.
HYPERBAND_EPOCH_NAMES = ("epochs", "numepochs", "n-epochs", "n_epochs", "num_epochs")
TUNING_OBJECTIVE = "_tuning_objective_metric"


def _stopping(stopping: dict, spot: bool, path: str) -> list[Violation]:
    found = []
    run, wait = stopping.get("MaxRuntimeInSeconds"), stopping.get("MaxWaitTimeInSeconds")
    # StoppingCondition.MaxRuntimeInSeconds: "The default value is 1 day. The maximum value is
    # 28 days." (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_StoppingCondition.html)
    if isinstance(run, int) and run > MAX_RUNTIME:
        found.append(
            Violation(
                f"{path}.MaxRuntimeInSeconds",
                f"Member must have value less than or equal to {MAX_RUNTIME} (28 days)",
                run,
            )
        )
    # MaxWaitTimeInSeconds, of a managed spot job: "the amount of time spent waiting for Spot
    # capacity plus the amount of time the job can run. It must be equal to or greater than
    # MaxRuntimeInSeconds." (API_StoppingCondition.html; the developer guide's spot page says
    # "larger than": the API reference's "equal to" is taken.)
    if spot and wait is None:
        found.append(
            Violation(
                f"{path}.MaxWaitTimeInSeconds",
                "Member must not be null when EnableManagedSpotTraining is true",
            )
        )
    if spot and isinstance(wait, int) and isinstance(run, int) and wait < run:
        found.append(
            Violation(
                f"{path}.MaxWaitTimeInSeconds",
                f"Member must be greater than or equal to MaxRuntimeInSeconds ({run})",
                wait,
            )
        )
    return found


def _training(request: dict) -> list[Violation]:
    spot = bool(request.get("EnableManagedSpotTraining"))
    return _stopping(request.get("StoppingCondition", {}), spot, "StoppingCondition")


def _processing(request: dict) -> list[Violation]:
    found = []
    # ProcessingS3Input.LocalPath: "an absolute path to the input data and must begin with
    # /opt/ml/processing/" (https://docs.aws.amazon.com/sagemaker/latest/APIReference/
    # API_ProcessingS3Input.html); outputs too (build-your-own-processing-container.html).
    places = [
        (f"ProcessingInputs[{i}].S3Input.LocalPath", (item.get("S3Input") or {}).get("LocalPath"))
        for i, item in enumerate(request.get("ProcessingInputs", []))
    ] + [
        (
            f"ProcessingOutputConfig.Outputs[{i}].S3Output.LocalPath",
            (item.get("S3Output") or {}).get("LocalPath"),
        )
        for i, item in enumerate(request.get("ProcessingOutputConfig", {}).get("Outputs", []))
    ]
    for path, local in places:
        if isinstance(local, str) and not local.startswith(f"{PROCESSING_DIR}/"):
            found.append(Violation(path, f"Member must begin with {PROCESSING_DIR}/", local))
    return found


def _tuning(request: dict) -> list[Violation]:
    config = request.get("HyperParameterTuningJobConfig", {})
    definition = request.get("TrainingJobDefinition", {})
    ranges = config.get("ParameterRanges", {})
    searched = [r.get("Name") for kind in ranges.values() for r in kind]
    static = definition.get("StaticHyperParameters", {})
    found = _stopping(
        definition.get("StoppingCondition", {}),
        bool(definition.get("EnableManagedSpotTraining")),
        "TrainingJobDefinition.StoppingCondition",
    )
    # ParameterRanges: the maximum of each list "also the maximum for the hyperparameter tuning
    # job itself. That is, the sum of the number of hyperparameters for all the ranges can't
    # exceed the maximum number specified" (https://docs.aws.amazon.com/sagemaker/latest/
    # APIReference/API_ParameterRanges.html): 30 in all.
    if len(searched) > 30:
        found.append(
            Violation(
                "HyperParameterTuningJobConfig.ParameterRanges",
                "Member must have at most 30 hyperparameter ranges in all",
                len(searched),
            )
        )
    # "You can use up to 100 hyperparameters in total (static + tunable)"; "AMT may add
    # additional hyperparameters(s) that contribute to the limit of 100 total hyperparameters.
    # Currently ... SageMaker AI adds _tuning_objective_metric automatically."
    # (https://docs.aws.amazon.com/sagemaker/latest/dg/automatic-model-tuning-define-ranges.html)
    total = len(static) + len(set(searched)) + 1
    if total > 100:
        found.append(
            Violation(
                "TrainingJobDefinition.StaticHyperParameters",
                f"static + searched hyperparameters + {TUNING_OBJECTIVE} must be at most 100",
                total,
            )
        )
    found += _tuning_metrics(config, definition)
    strategy = config.get("Strategy")
    if strategy == "Hyperband":
        found += _hyperband(config, static)
    found += _training_jobs(config)
    return found


# Automatic model tuning's limits (https://docs.aws.amazon.com/sagemaker/latest/dg/
# automatic-model-tuning-limits.html): "Number of training jobs per hyperparameter tuning job"
# 750 for Bayesian optimization, Hyperband and Grid ("either specified explicitly or inferred
# from the search space"), not increasable; Random search 750, "Can be increased to" 10000.
TRAINING_JOBS_LIMIT = {"Bayesian": 750, "Hyperband": 750, "Grid": 750, "Random": 10_000}
# HyperbandStrategyConfig.MaxResource: "The maximum value is 20,000 epochs." (botocore's
# sagemaker service-2.json; the model itself has only its min).
HYPERBAND_MAX_RESOURCE = 20_000


def _training_jobs(config: dict) -> list[Violation]:
    strategy = config.get("Strategy")
    limit = TRAINING_JOBS_LIMIT.get(strategy)
    limits = config.get("ResourceLimits") or {}
    asked = limits.get("MaxNumberOfTrainingJobs")
    if strategy == "Grid" and asked is None:  # inferred from the search space
        ranges = (config.get("ParameterRanges") or {}).get("CategoricalParameterRanges", [])
        asked = math.prod(len(r.get("Values", [])) for r in ranges)
    if limit is None or not isinstance(asked, int) or asked <= limit:
        return []
    field = "ResourceLimits.MaxNumberOfTrainingJobs"
    if "MaxNumberOfTrainingJobs" not in limits:
        field = "ParameterRanges.CategoricalParameterRanges"  # the grid's combinations
    return [
        Violation(
            f"HyperParameterTuningJobConfig.{field}",
            f"Member must be at most {limit} training jobs per hyperparameter tuning job for "
            f"Strategy {strategy}",
            asked,
        )
    ]


def _tuning_metrics(config: dict, definition: dict) -> list[Violation]:
    found = []
    # Automatic model tuning's limits: 20 metrics per tuning job (https://docs.aws.amazon.com/
    # sagemaker/latest/dg/automatic-model-tuning-limits.html; the API model allows 40). The
    # objective is read off the log with its own definition (automatic-model-tuning-define-
    # metrics-variables.html).
    metrics = definition.get("AlgorithmSpecification", {}).get("MetricDefinitions", [])
    if len(metrics) > 20:
        found.append(
            Violation(
                "TrainingJobDefinition.AlgorithmSpecification.MetricDefinitions",
                "Member must have length less than or equal to 20 for a tuning job",
                len(metrics),
            )
        )
    objective = config.get("HyperParameterTuningJobObjective", {}).get("MetricName")
    if objective and metrics and objective not in {m.get("Name") for m in metrics}:
        found.append(
            Violation(
                "HyperParameterTuningJobConfig.HyperParameterTuningJobObjective.MetricName",
                "Member must name one of the MetricDefinitions",
                objective,
            )
        )
    return found


def _hyperband(config: dict, static: dict) -> list[Violation]:
    """API_HyperbandStrategyConfig.html: "If the value for MaxResource is not provided, and
    either Hyperband is selected ... SageMaker AI infers the value from the static
    hyperparameters epochs, numepochs, n-epochs, n_epochs, or num_epochs; if none is given, a
    validation error is raised"; Hyperband "has its own internal early stopping mechanism" and
    needs TrainingJobEarlyStoppingType Off (API_HyperParameterTuningJobConfig.html)."""
    found = []
    if config.get("TrainingJobEarlyStoppingType", "Off") != "Off":
        found.append(
            Violation(
                "HyperParameterTuningJobConfig.TrainingJobEarlyStoppingType",
                "Member must be Off for Strategy Hyperband",
                config["TrainingJobEarlyStoppingType"],
            )
        )
    hyperband = (config.get("StrategyConfig") or {}).get("HyperbandStrategyConfig") or {}
    if "MaxResource" not in hyperband and not set(HYPERBAND_EPOCH_NAMES) & set(static):
        found.append(
            Violation(
                "HyperParameterTuningJobConfig.StrategyConfig.HyperbandStrategyConfig.MaxResource",
                "Member must not be null when no static hyperparameter names the epochs "
                f"({', '.join(HYPERBAND_EPOCH_NAMES)})",
            )
        )
    low, high = hyperband.get("MinResource"), hyperband.get("MaxResource")
    if isinstance(high, int) and high > HYPERBAND_MAX_RESOURCE:
        found.append(
            Violation(
                "HyperParameterTuningJobConfig.StrategyConfig.HyperbandStrategyConfig.MaxResource",
                f"Member must have value less than or equal to {HYPERBAND_MAX_RESOURCE} epochs",
                high,
            )
        )
    if isinstance(low, int) and isinstance(high, int) and low > high:
        found.append(
            Violation(
                "HyperParameterTuningJobConfig.StrategyConfig.HyperbandStrategyConfig.MinResource",
                f"Member must be at most MaxResource ({high})",
                low,
            )
        )
    return found


DOCUMENTED: dict[str, tuple[Callable[[dict], list[Violation]], ...]] = {
    "CreateTrainingJob": (_training,),
    "CreateProcessingJob": (_processing,),
    "CreateHyperParameterTuningJob": (_tuning,),
}


def as_if_on_s3(request: dict) -> dict:
    """A request whose store is a local folder (the local backend's), its folders written as
    the S3 URIs SageMaker would get: the rest of it is checked as it stands."""
    if isinstance(request, list):
        return [as_if_on_s3(item) for item in request]
    if not isinstance(request, dict):
        return request
    return {
        key: "s3://local-store/" + value.lstrip("/")
        if key in ("S3Uri", "S3OutputPath") and isinstance(value, str) and "://" not in value
        else as_if_on_s3(value)
        for key, value in request.items()
    }


def refused(operation: str, request: dict) -> list[str]:
    """What SageMaker would refuse in a request to create a job (`operation`, as
    CreateTrainingJob: pipeline/jobs.py KINDS names each kind's), each line naming the
    operation, the job and the field."""
    name = next((v for k, v in request.items() if k.endswith("JobName")), "?")
    return [f"{operation} {name}: {v}" for v in check(operation, request)]
