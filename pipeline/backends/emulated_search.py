"""SageMaker's search for a tuning job, as the emulator plays it (backends/emulated.py): the
request's ranges drawn at random (a grid for Grid). The search itself is SageMaker's business;
what the emulator checks is that the request is whole and that each trial runs and reports its
objective.
"""

from __future__ import annotations

import itertools
import math

from pipeline.search_space import Categorical, from_parameter_ranges


def candidates(config: dict, static: dict) -> list[dict[str, str]]:
    """The trials' values: every combination for Grid, else MaxNumberOfTrainingJobs draws
    seeded by the static `seed` (SageMaker's own search is not played)."""
    import random

    ranges = from_parameter_ranges(config["ParameterRanges"])
    if config["Strategy"] == "Grid":
        return grid(ranges)
    rng = random.Random(int(static.get("seed", 0)))
    return [sample(ranges, rng) for _ in range(config["ResourceLimits"]["MaxNumberOfTrainingJobs"])]


def sample(tunables: dict, rng) -> dict[str, str]:
    values = {}
    for name, t in sorted(tunables.items()):
        if isinstance(t, Categorical):
            values[name] = rng.choice(t.options)
            continue
        if t.log:
            x = math.exp(rng.uniform(math.log(t.low), math.log(t.high)))
        else:
            x = rng.uniform(t.low, t.high)
        values[name] = str(round(x)) if t.integer else f"{x:.6g}"
    return values


def grid(tunables: dict) -> list[dict[str, str]]:
    names = sorted(tunables)
    return [
        dict(zip(names, combo, strict=True))
        for combo in itertools.product(*(tunables[n].options for n in names))
    ]
