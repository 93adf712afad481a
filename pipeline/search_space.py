"""A tuning job's search space: what [tuning.hyperparameters] writes, and the forms it takes.

    settings    `1e-5->1e-3 log` an Interval, `16,32` a Categorical, `4` a constant
    SageMaker   a request's ParameterRanges (Continuous-, Integer-, CategoricalParameterRanges)
    Optuna      the local tuner's distributions (Float-, Int-, CategoricalDistribution)

A leaf: it imports nothing else of the pipeline, so the settings (config.py), the jobs
(jobs.py) and the backends all import it at their top.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# The section of settings.ini that writes the shared search space; [tuning.hyperparameters.
# <model>] writes one model's own.
SECTION = "tuning.hyperparameters"
INT_RE = re.compile(r"^[+-]?\d+$")


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


def merged_space(shared: tuple[dict, dict], own: tuple[dict, dict]) -> tuple[dict, dict]:
    """(constants, tunables) of one model: its own keys replace the shared ones, whichever
    kind either is."""
    mine = {*own[0], *own[1]}
    constants = {k: v for k, v in shared[0].items() if k not in mine} | own[0]
    tunables = {k: v for k, v in shared[1].items() if k not in mine} | own[1]
    return constants, tunables


def most_epochs(ranges: dict[str, Tunable], constant: str) -> int:
    """The most epochs a trial trains (Hyperband's largest resource): the searched EPOCHS'
    highest value, or the constant one when it is not searched."""
    searched = ranges.get("epochs")
    if searched is None:
        return int(constant)
    if isinstance(searched, Categorical):
        return max(int(float(o)) for o in searched.options)
    return int(searched.high)


# -- SageMaker: a CreateHyperParameterTuningJob request's ParameterRanges ---------------------


def parameter_ranges(ranges: dict[str, Tunable]) -> dict[str, list]:
    """The ranges as a tuning request's ParameterRanges (API_ParameterRanges.html), each
    bound a string as the API takes it; an interval with whole-number bounds is an integer
    range, `log` its Logarithmic ScalingType."""
    out: dict[str, list] = {
        "ContinuousParameterRanges": [],
        "IntegerParameterRanges": [],
        "CategoricalParameterRanges": [],
    }
    for name, r in sorted(ranges.items()):
        if isinstance(r, Categorical):
            out["CategoricalParameterRanges"].append({"Name": name, "Values": list(r.options)})
            continue
        kind = "IntegerParameterRanges" if r.integer else "ContinuousParameterRanges"
        low, high = (str(int(r.low)), str(int(r.high))) if r.integer else (str(r.low), str(r.high))
        scaling = "Logarithmic" if r.log else "Linear"
        out[kind].append({"Name": name, "MinValue": low, "MaxValue": high, "ScalingType": scaling})
    return out


def from_parameter_ranges(ranges: dict) -> dict[str, Tunable]:
    """A tuning request's ParameterRanges as the settings write them (the emulator's reading
    of a request it was sent)."""
    out: dict[str, Tunable] = {}
    for kind, integer in (("ContinuousParameterRanges", False), ("IntegerParameterRanges", True)):
        for r in ranges.get(kind, []):
            log = r.get("ScalingType") in ("Logarithmic", "ReverseLogarithmic")
            out[r["Name"]] = Interval(float(r["MinValue"]), float(r["MaxValue"]), integer, log)
    for r in ranges.get("CategoricalParameterRanges", []):
        out[r["Name"]] = Categorical(tuple(r["Values"]))
    return out


# -- Optuna: the local tuner's distributions ----------------------------------------------------
# optuna is imported where it is used: it is slow to import, and only a local tuning job needs
# it.


def distributions(ranges: dict[str, Tunable]) -> dict:
    """The ranges as Optuna distributions, by name: log-uniform on a `log` interval."""
    import optuna.distributions as d

    out = {}
    for name, r in sorted(ranges.items()):
        if isinstance(r, Categorical):
            out[name] = d.CategoricalDistribution(list(r.options))
        elif r.integer:
            out[name] = d.IntDistribution(int(r.low), int(r.high), log=r.log)
        else:
            out[name] = d.FloatDistribution(r.low, r.high, log=r.log)
    return out


def value_of(drawn) -> str:
    """A value Optuna drew, as a hyperparameter string (what a training job receives)."""
    if isinstance(drawn, str):
        return drawn
    return f"{drawn:.6g}" if isinstance(drawn, float) else str(drawn)


def drawn_value(space, value: str):
    """A hyperparameter string read back (a trial's record) as the value Optuna drew from
    `space`: the inverse of `value_of`."""
    import optuna.distributions as d

    if isinstance(space, d.IntDistribution):
        return int(float(value))
    if isinstance(space, d.FloatDistribution):
        return float(value)
    return value
