"""The plan: every job of a run described once, as the request its backend receives; checked
as SageMaker would check it before anything is written or sent; printed (`smpipe plan`, and
at the start of every run) with what SageMaker would bill at most.
"""

from __future__ import annotations

import json
import shlex

from pipeline import cost, registry, service_model
from pipeline.backend import identity
from pipeline.config import ConfigError, Settings
from pipeline.errors import log
from pipeline.jobs import KINDS, request_for
from pipeline.service_model import as_if_on_s3
from pipeline.stages import Job, job_label, plan_lines
from pipeline.store import Store


def describe(job: Job, settings: Settings, store: Store) -> dict:
    """The request a job becomes on the run's backend (the local backend plays this same
    request)."""
    return request_for(job, *identity(settings), store.uri_of)


def check_requests(jobs: list[Job], settings: Settings, store: Store) -> None:
    """Every request of the plan as SageMaker would check it, before anything is written or
    sent: one ConfigError naming each job, field and constraint (pipeline/service_model.py)."""
    problems = [
        problem
        for job in jobs
        for problem in service_model.refused(
            KINDS[job.kind].create, as_if_on_s3(describe(job, settings, store))
        )
    ]
    names = [job.name for job in jobs]
    problems += [
        f"job name {n} is used twice in the plan" for n in sorted(set(names)) if names.count(n) > 1
    ]
    if problems:
        raise ConfigError(problems, f"{settings.source}: requests SageMaker would refuse")


def log_plan(
    jobs: list[Job],
    settings: Settings,
    store: Store,
    show_requests=False,
    registering=False,
    basis: dict | None = None,
    brief: bool = False,
) -> None:
    """The plan: every job with its inputs and outputs (`smpipe plan`), or, `brief`, a line a
    job and the most it can cost, as a run opens (its paths are the plan's to say)."""
    e = settings.experiment
    labels = {"event": ("plan", [job_label(j) for j in jobs])}
    where = f"on the {e.backend} backend, store {store.uri}"
    log.info(f"plan for experiment {e.name!r} {where}:", extra=labels)
    for number, job in enumerate(jobs, 1):
        for line in plan_lines(number, job, store)[: 1 if brief else None]:
            log.info(line)
        if show_requests:
            text = json.dumps(describe(job, settings, store), indent=2)
            log.info("\n".join("       " + line for line in text.splitlines()))
    if registering:  # no job: the driver's own step after inference
        log.info(f"  {len(jobs) + 1}. {registry.plan_line(settings, store)}")
    if e.backend != "local":  # what SageMaker would bill at most, before anything starts
        basis = basis or prices_for(jobs, settings, store)
        for problem in (basis.get("price_list") or {}).get("unanswered", []):
            log.warning(f"{problem}; the shipped table and [cost] PRICES price the rest")
        priced = [
            (job_label(j), cost.maximum(j.kind, describe(j, settings, store), basis)) for j in jobs
        ]
        lines = cost.plan_lines(priced)
        if brief:  # the plan's most, not each job's
            lines = [line for line in lines[1:] if not line.startswith(" ")]
        for line in lines:
            log.info(line)
    if brief:
        log.info(
            f"(`smpipe plan {shlex.quote(settings.source)}` says each job's inputs, outputs "
            "and costs)"
        )


def prices_for(jobs: list[Job], settings: Settings, store: Store, pricing=None) -> dict:
    """The prices a run applies, in its region: [cost] PRICES, then (on the sagemaker backend)
    the AWS Price List API's answer for the instance types the jobs use, then the shipped
    table. The emulated backend asks no one: its AWS is moto, which has no Price List."""
    e = settings.experiment
    asked = None
    if e.backend == "sagemaker" and getattr(store, "unreached", False):
        unasked = "the store could not be reached, so the AWS Price List API was not asked"
        asked = {"prices": {}, "unanswered": [unasked], "date": None}
    elif e.backend == "sagemaker":
        wanted = {
            (use, instance)
            for job in jobs
            for use, instance in cost.uses_of(job.kind, describe(job, settings, store))
            if instance not in settings.cost.prices
        }
        if wanted:
            if pricing is None:
                import boto3

                pricing = cost.price_list_client(boto3.Session(region_name=e.region))
            asked = cost.ask_price_list(pricing, e.region, wanted)
    return cost.price_basis(e.region, settings.cost.prices, asked)
