"""Every instance type the shipped settings and `smpipe init`'s template use has an on-demand
price in its region in the shipped table (pipeline/cost.py PRICE_TABLE), for the use it is
billed at, so a demo run on the emulated backend ends with a dollar figure."""

from __future__ import annotations

import pytest

from pipeline.config import load_settings
from pipeline.cost import price_basis, price_of, uses_of
from pipeline.jobs import request_for
from pipeline.paths import ExperimentTree
from pipeline.sources import Sources
from pipeline.stages import STEPS, build_jobs
from tests.conftest import ROOT

SHIPPED = [ROOT / "settings.ini", ROOT / "pipeline/project_template/settings.ini"]


def billed_uses(path, job: str) -> tuple[str, set[tuple[str, str]]]:
    """(region, every (rate, instance type) a whole run of `path` is billed at)."""
    settings = load_settings(path, env={"SMPIPE__EXPERIMENT__JOB": job})
    tree = ExperimentTree(settings.experiment.name)
    jobs = build_jobs(settings, list(STEPS), tree.run(1), Sources(raw=tree.raw))
    uses = {
        use
        for j in jobs
        for use in uses_of(j.kind, request_for(j, "image", "role", lambda k: f"s3://b/{k}"))
    }
    return settings.experiment.region, uses


@pytest.mark.parametrize("job", ["train", "tune"])
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_shipped_instance_type_has_a_price_in_its_region(path, job):
    region, uses = billed_uses(path, job)
    assert uses  # the plan is billed at something
    basis = price_basis(region, {}, None)
    unpriced = sorted(
        f"{use} {instance}" for use, instance in uses if price_of(basis, use, instance)[0] is None
    )
    assert unpriced == [], f"{path.name} ({region}, JOB = {job}): no shipped price for {unpriced}"
