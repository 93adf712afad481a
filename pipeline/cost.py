"""What a run cost, and the most a plan can cost: one home for prices and billing.

The backends record what each job used (`JobResult.billing`); here those facts meet prices
(`price_basis`: [cost] PRICES, else the AWS Price List API, else the shipped, dated PRICE_TABLE).
A job whose price is unknown says so by name; no price is ever guessed.

    plan:  each job's MaxRuntimeInSeconds x InstanceCount x price (`plan_lines`)
    run:   BillableTimeInSeconds x InstanceCount x price, per job, summed (`run_cost`)
"""

from __future__ import annotations

import json
import math
import time

# On-demand USD per instance-hour, by region and use, each region with its date and source.
# AWS's SageMaker pricing page (https://aws.amazon.com/sagemaker/pricing/) renders its tables
# with a script, so the figures here are AWS's own as found in AWS's repositories:
# - eu-west-1: the December 2023 SageMaker bill AWS published in aws-samples/sagemaker-ssh-helper
#   (Sample_Costs.md, commit b6bf9ba3), lines "$0.257 per Training ml.m5.xlarge hour in EU
#   (Ireland)" and the like.
# - us-east-1: what the AWS Price List API (pricing.get_products, ServiceCode AmazonSageMaker,
#   instanceType "<type>-Training") answered in aws-samples/amazon-sagemaker-training-jobs-
#   benchmarks (instance_types_benchmark_roberta.ipynb, commit 2a7c651c, SageMaker SDK 2.77.1,
#   2022): "ml.p3.2xlarge-Training price is $3.8250000000/hr", ml.g5.2xlarge $1.515.
# - us-east-1, the shipped settings' types (ml.g5.xlarge training, ml.m5.xlarge training and
#   processing): no repository of AWS's own states them, so they are AWS Price List API answers
#   as public logs quote them (2026-09): "processing price ml.m5.xlarge = $0.2300/h" for
#   {"instanceType": "ml.m5.xlarge-Processing", "usagetype": "USE1-Processing:ml.m5.xlarge"},
#   and ml.g5.xlarge-Training $1.408 (the figure most often quoted for us-east-1). Training
#   is priced as processing for ml.m5.xlarge, as the eu-west-1 bill above prices both at $0.257.
#   Confidence: medium; AWS's own bulk price file is the source to check them against:
#   https://pricing.us-east-1.amazonaws.com/offers/v1.0/aws/AmazonSageMaker/current/us-east-1/
#   index.json (usage types USE1-Train:ml.g5.xlarge, USE1-Processing:ml.m5.xlarge).
# Any other instance type without a price is named as unpriced until [cost] PRICES gives it;
# tests/test_shipped_prices.py holds that every shipped settings file is priced.
PRICE_TABLE = {
    "eu-west-1": {
        "date": "2023-12",
        "source": (
            "https://github.com/aws-samples/sagemaker-ssh-helper/blob/"
            "b6bf9ba39119784eb6ce6683ae9a6a2ed8ef4cd3/Sample_Costs.md"
        ),
        "training": {
            "ml.m5.xlarge": 0.257,
            "ml.g4dn.xlarge": 0.822,
            "ml.g5.xlarge": 1.57,
            "ml.p3.2xlarge": 4.131,
        },
        "processing": {"ml.m5.xlarge": 0.257},
    },
    "us-east-1": {
        "date": "2022 (ml.p3.2xlarge, ml.g5.2xlarge); 2026-09 (ml.g5.xlarge, ml.m5.xlarge)",
        "source": (
            "https://github.com/aws-samples/amazon-sagemaker-training-jobs-benchmarks/blob/"
            "2a7c651cfb92d9c5da8f00e1baeb2d09c928f471/instance_types_RoBERTa_benchmark/"
            "instance_types_benchmark_roberta.ipynb; AWS Price List API answers quoted in "
            "public logs (ml.g5.xlarge, ml.m5.xlarge: see pipeline/cost.py)"
        ),
        "training": {
            "ml.p3.2xlarge": 3.825,
            "ml.g5.2xlarge": 1.515,
            "ml.g5.xlarge": 1.408,
            "ml.m5.xlarge": 0.23,
        },
        "processing": {"ml.m5.xlarge": 0.23},
    },
}
# A warm pool's instances are billed as training compute: "Multiply
# ResourceRetainedBillableTimeInSeconds by the number of instances (InstanceCount) ... to get
# the total compute time SageMaker bills you" (API_WarmPoolStatus), at the training rate (the
# bill above: "$0.257 per Training Warm Pool ml.m5.xlarge hour", as its Training line).
RATE_OF_USE = {"training": "training", "warm pool": "training", "processing": "processing"}


def price_basis(region: str, overrides: dict[str, float], asked: dict | None = None) -> dict:
    """The prices a run (or a plan) applies, kept in its Metadata: [cost] PRICES, then what the
    AWS Price List API answered (`asked`, from `ask_price_list`), then the shipped table's
    figures for `region`, each with its date and source."""
    return {
        "currency": "USD",
        "region": region,
        "overrides": dict(overrides),
        "price_list": asked,
        "table": {
            use: PRICE_TABLE.get(region, {}).get(use, {}) for use in ("training", "processing")
        },
        "date": PRICE_TABLE.get(region, {}).get("date"),
        "source": PRICE_TABLE.get(region, {}).get("source"),
    }


def price_of(basis: dict, use: str, instance: str) -> tuple[float | None, str | None]:
    """An instance-hour of `instance` for `use`, and where that price comes from."""
    if instance in (basis.get("overrides") or {}):
        return basis["overrides"][instance], "[cost] PRICES"
    asked = basis.get("price_list") or {}
    price = asked.get("prices", {}).get(RATE_OF_USE[use], {}).get(instance)
    if price is not None:
        return price, f"AWS Price List API ({basis.get('region')}, {asked['date']})"
    price = (basis.get("table") or {}).get(RATE_OF_USE[use], {}).get(instance)
    if price is None:
        return None, None
    return price, f"shipped table ({basis.get('region')}, {basis.get('date')})"


# -- prices asked of AWS ------------------------------------------------------------------------

# The AWS Price List Query API (boto3 "pricing", GetProducts). Its endpoints are us-east-1,
# eu-central-1 and ap-south-1 (botocore's endpoints.json, "api.pricing" in the aws partition);
# each answers for every region. A SageMaker instance product is named "<type>-Training" by
# its instanceType attribute and priced under terms.OnDemand.*.priceDimensions.*.pricePerUnit
# .USD: AWS's own sample asks exactly that (aws-samples/amazon-sagemaker-training-jobs-benchmarks,
# instance_types_benchmark_roberta.ipynb, commit 2a7c651c: "ml.g5.2xlarge-Training price is
# $1.5150000000/hr"). "-Processing" for a processing instance is that pattern applied to the
# component SageMaker bills a processing job under (our reading; a product that does not
# match leaves the price unknown, never guessed). `regionCode` is the region's code, "us-east-1"
# (API_pricing_PriceList: "The available RegionCode list can be retrieved from
# GetAttributeValues").
PRICE_LIST = {
    "endpoint_region": "us-east-1",
    "service_code": "AmazonSageMaker",
    "component": {"training": "Training", "processing": "Processing"},
}


def ask_price_list(client, region: str, wanted: set[tuple[str, str]]) -> dict:
    """On-demand USD per instance-hour of each (use, instance type) in `wanted`, in `region`,
    as the Price List API answers today; what it could not answer, said. `client` is a boto3
    "pricing" client (`price_list_client`)."""
    from botocore.exceptions import BotoCoreError, ClientError

    prices: dict[str, dict[str, float]] = {}
    unanswered: list[str] = []
    for use, instance in sorted(wanted):
        product = f"{instance}-{PRICE_LIST['component'][RATE_OF_USE[use]]}"
        filters = [
            {"Type": "TERM_MATCH", "Field": "instanceType", "Value": product},
            {"Type": "TERM_MATCH", "Field": "regionCode", "Value": region},
        ]
        try:
            answer = client.get_products(
                ServiceCode=PRICE_LIST["service_code"], Filters=filters, MaxResults=10
            )
        except (ClientError, BotoCoreError) as err:  # every ask would fail the same way
            code = getattr(err, "response", {}).get("Error", {}).get("Code", type(err).__name__)
            unanswered.append(f"the AWS Price List API (pricing:GetProducts) failed: {code}")
            break
        price = on_demand_hourly(answer.get("PriceList", []))
        if price is None:
            unanswered.append(f"the AWS Price List API has no one price for {product} in {region}")
            continue
        prices.setdefault(RATE_OF_USE[use], {})[instance] = price
    return {
        "prices": prices,
        "unanswered": unanswered,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "source": f"pricing.get_products(ServiceCode={PRICE_LIST['service_code']})",
    }


def on_demand_hourly(price_list: list[str]) -> float | None:
    """The one on-demand price per hour the answer's products share, or None when they name
    none or several (an answer we cannot read as one price is not a price)."""
    found = set()
    for item in price_list:  # each a JSON document: product, terms
        terms = json.loads(item).get("terms", {}).get("OnDemand", {})
        for term in terms.values():
            for dimension in term.get("priceDimensions", {}).values():
                usd = dimension.get("pricePerUnit", {}).get("USD")
                if usd is not None and dimension.get("unit", "").lower().startswith("hr"):
                    found.add(float(usd))
    found.discard(0.0)
    return found.pop() if len(found) == 1 else None


def price_list_client(session):
    """A pricing client on the Price List API's endpoint, retrying as every AWS client of the
    driver does."""
    from pipeline.store import aws_config

    return session.client("pricing", region_name=PRICE_LIST["endpoint_region"], config=aws_config())


def uses_of(kind: str, request: dict) -> set[tuple[str, str]]:
    """The (rate, instance type) pairs a request is billed at: a warm pool at its training's."""
    return {(RATE_OF_USE[use], instance) for use, instance, _, _ in _parts(kind, request)}


def dollars(seconds: float, count: int, price: float | None) -> float | None:
    """Instance-seconds at a price per instance-hour."""
    return None if price is None else seconds * count * price / 3600


def missing_price(basis: dict, use: str, instance: str) -> str:
    return f"no price for {instance} ({RATE_OF_USE[use]}, {basis.get('region')})"


# -- the most a plan can cost -------------------------------------------------------------------


def trials_at_most(config: dict) -> int:
    """How many training jobs a tuning job may launch: MaxNumberOfTrainingJobs ("the maximum
    number of training jobs that a hyperparameter tuning job can launch", API_ResourceLimits),
    or for Grid, sent without it, one per combination of its categorical values (Grid search,
    automatic-model-tuning-how-it-works.html)."""
    limit = config["ResourceLimits"].get("MaxNumberOfTrainingJobs")
    if limit is not None:
        return int(limit)
    ranges = config["ParameterRanges"].get("CategoricalParameterRanges", [])
    return math.prod(len(r["Values"]) for r in ranges)


def maximum(kind: str, request: dict, basis: dict) -> dict:
    """The most one request can bill: MaxRuntimeInSeconds (its StoppingCondition: "the
    maximum time for all of the attempts in total", spot restarts included; a spot job's
    MaxWaitTimeInSeconds adds only waiting, which BillableTimeInSeconds leaves out) x
    InstanceCount x price, plus the warm pool a training job may leave (KeepAlivePeriodInSeconds,
    billed as training); for a tuning job, that of each trial x the trials it may launch,
    bounded by its own ResourceLimits.MaxRuntimeInSeconds when set."""
    parts = _parts(kind, request)
    if kind != "tuning":
        return _priced(parts, basis, times=1)
    config = request["HyperParameterTuningJobConfig"]
    most = _priced(parts, basis, times=trials_at_most(config))
    ceiling = config["ResourceLimits"].get("MaxRuntimeInSeconds")
    if ceiling and most["usd"] is not None:  # every parallel trial running the whole time
        _, instance, _, count = parts[0]
        parallel = config["ResourceLimits"]["MaxParallelTrainingJobs"]
        price, _ = price_of(basis, "training", instance)
        most["usd"] = min(most["usd"], dollars(ceiling, count * parallel, price))
    return most


def _parts(kind: str, request: dict) -> list[tuple[str, str, int, int]]:
    """(use, instance type, most seconds, instances) of what one request (one trial of a
    tuning job) is billed for."""
    if kind == "processing":
        cluster = request["ProcessingResources"]["ClusterConfig"]
        seconds = request["StoppingCondition"]["MaxRuntimeInSeconds"]
        return [("processing", cluster["InstanceType"], seconds, cluster["InstanceCount"])]
    definition = request["TrainingJobDefinition"] if kind == "tuning" else request
    resources = definition["ResourceConfig"]
    instance, count = resources["InstanceType"], resources["InstanceCount"]
    parts = [("training", instance, definition["StoppingCondition"]["MaxRuntimeInSeconds"], count)]
    if resources.get("KeepAlivePeriodInSeconds"):
        parts.append(("warm pool", instance, resources["KeepAlivePeriodInSeconds"], count))
    return parts


def _priced(parts: list[tuple[str, str, int, int]], basis: dict, times: int) -> dict:
    usd, missing, said, sources, hours = 0.0, [], [], set(), {}
    for use, instance, seconds, count in parts:
        # Instance-hours bound the bill whatever the price: said even where it is unknown.
        hours[instance] = hours.get(instance, 0.0) + times * seconds * count / 3600
        price, source = price_of(basis, use, instance)
        if price is None:
            missing.append(missing_price(basis, use, instance))
            said.append(f"{use} {seconds} s x {count} x {instance}, unpriced")
            continue
        usd += times * dollars(seconds, count, price)
        said.append(f"{use} {seconds} s x {count} x {instance} at ${price}/h")
        sources.add(source)
    how = (f"{times} trials x " if times != 1 else "") + " + ".join(said)
    missing = list(dict.fromkeys(missing))  # a warm pool's price is its training job's
    return {
        "usd": None if missing else usd,
        "missing": missing,
        "how": how,
        "sources": sources,
        "instance_hours": hours,
    }


def plan_lines(priced: list[tuple[str, dict]]) -> list[str]:
    """What the plan says of its cost: each job's most (named by its label), then the plan's."""
    lines = ["what each job can cost at most, before anything starts:"]
    for label, most in priced:
        if most["usd"] is not None:
            lines.append(f"  {label}: at most ${most['usd']:,.2f} ({most['how']})")
        else:
            lines.append(f"  {label}: at most unknown ({most['how']})")
    known = sum(m["usd"] for _, m in priced if m["usd"] is not None)
    missing = sorted({x for _, m in priced for x in m["missing"]})
    sources = sorted({s for _, m in priced for s in m["sources"]})
    where = f"prices: {', '.join(sources) or 'none'}"
    if not missing:
        lines.append(
            f"most this plan can cost: ${known:,.2f} on demand (each job's MaxRuntimeInSeconds x "
            f"instances x price per instance-hour; {where})"
        )
    else:
        priced_part = f" (the priced jobs: at most ${known:,.2f}; {where})" if sources else ""
        hours: dict[str, float] = {}
        for _, most in priced:
            for instance, h in most["instance_hours"].items():
                hours[instance] = hours.get(instance, 0.0) + h
        used = ", ".join(f"{h:,.1f} h of {instance}" for instance, h in sorted(hours.items()))
        lines.append(
            f"most this plan can cost: unknown, {'; '.join(missing)}: set [cost] PRICES"
            + priced_part
        )
        lines.append(f"most instance-hours it can use: {used}")
    return lines


# -- what a run cost ----------------------------------------------------------------------------


def run_cost(
    billing: list[dict], basis: dict | None, backend: str, unbilled: list[dict] = ()
) -> dict | None:
    """The run's cost from its jobs' billing records: priced line by line on SageMaker
    (emulated too: its billing fields are played as AWS documents them), from the instance
    type and count and the seconds DescribeTrainingJob bills, or a processing job's start and
    end; locally the CPU-seconds and peak memory of the job's processes, never dollars.
    `unbilled`: jobs stopped with the driver whose bill was not read (Metadata's
    unbilled_jobs): the total is then at least what is priced; locally, what they used was
    not measured."""
    if not billing and not unbilled:
        return None
    if backend == "local":
        cpu = [b["cpu_seconds"] for b in billing if b.get("cpu_seconds") is not None]
        peaks = [b["peak_memory_mb"] for b in billing if b.get("peak_memory_mb") is not None]
        return {
            "measure": "CPU-seconds",
            "cpu_seconds": round(sum(cpu), 1) if cpu else None,
            "peak_memory_mb": max(peaks) if peaks else None,
            "jobs": billing,
            "unmeasured": [u["job"] for u in unbilled],  # stopped with the driver
        }
    basis = basis or {}
    lines, total, missing, sources = [], 0.0, set(), set()
    for b in billing:
        price, source = price_of(basis, b["use"], b["instance_type"])
        seconds = b.get("billable_seconds")
        usd = None if seconds is None else dollars(seconds, b["instance_count"], price)
        if seconds is not None and price is None:
            missing.add(missing_price(basis, b["use"], b["instance_type"]))
        sources |= {source} if source else set()
        total += usd or 0.0
        priced = {"price_per_hour": price, "usd": None if usd is None else round(usd, 6)}
        lines.append({**b, **priced})
    return {
        "measure": "USD",
        "usd": None if missing or unbilled else round(total, 6),  # pools among them
        "priced_usd": round(total, 6),
        "unpriced": sorted(missing),
        "unbilled": [u["job"] for u in unbilled if u["kind"] != "pool"],
        # Warm pools still kept when the run ended: their time was not known yet.
        "unbilled_pools": [u["job"] for u in unbilled if u["kind"] == "pool"],
        # Where their bill is: SageMaker's Describe* answers; an emulated account's ended
        # with its driver.
        "unbilled_bill": (
            "an emulated account bills nothing, and its records ended with its driver"
            if backend == "emulated"
            else "SageMaker bills them all the same: their Describe* answer says what, and a "
            "--resume of a stopped run reads it"
        ),
        "billable_instance_seconds": sum(
            (b.get("billable_seconds") or 0) * b["instance_count"] for b in billing
        ),
        "prices": f"prices: {', '.join(sorted(sources)) or 'none'}",
        "jobs": lines,
    }


def as_text(cost: dict | None) -> str:
    """The run's cost in one line (the summary, the report)."""
    if not cost:
        return "cost: not recorded"
    if cost["measure"] == "CPU-seconds":
        cpu, peak = cost.get("cpu_seconds"), cost.get("peak_memory_mb")
        unmeasured = cost.get("unmeasured")
        used = f"{cpu:,.1f} CPU-seconds" if cpu is not None else "CPU-seconds not measured"
        used = f"at least {used}" if unmeasured and cpu is not None else used
        memory = f", peak memory {peak:,.0f} MB" if peak is not None else ""
        said = f"used: {used}{memory} (local backend: this machine, nothing billed)"
        return said + (
            f"; not measured: {', '.join(unmeasured)}, stopped with the run" if unmeasured else ""
        )
    seconds = cost["billable_instance_seconds"]
    jobs, pools = cost.get("unbilled"), cost.get("unbilled_pools")
    if jobs or pools:
        unpriced = (
            f"; {'; '.join(cost['unpriced'])} (set [cost] PRICES)" if cost["unpriced"] else ""
        )
        said = [
            f"cost: at least ${cost['priced_usd']:,.4f} ({seconds:,} billable instance-seconds)"
        ]
        if jobs:
            said.append(
                f"not counted: {', '.join(jobs)}, stopped with the run before their bill could "
                f"be read ({cost.get('unbilled_bill', '')})"
            )
        if pools:
            said.append(
                f"nor the warm pool kept for {', '.join(pools)}, its time not known yet when "
                "the run ended"
            )
        return "; ".join(said) + unpriced
    if cost["usd"] is None:
        return (
            f"cost: unknown, {'; '.join(cost['unpriced'])} (set [cost] PRICES); the priced "
            f"jobs ${cost['priced_usd']:,.4f}; {seconds:,} billable instance-seconds"
        )
    return f"cost: ${cost['usd']:,.4f} ({seconds:,} billable instance-seconds; {cost['prices']})"


def short(cost: dict | None) -> str:
    """The run's cost in a table cell (`smpipe runs`)."""
    if not cost:
        return ""
    if cost["measure"] == "CPU-seconds":
        cpu, unmeasured = cost.get("cpu_seconds"), cost.get("unmeasured")
        if cpu is None:
            return "not measured" if unmeasured else ""
        return f"{'≥' if unmeasured else ''}{cpu:,.0f} CPU-s"
    if cost.get("unbilled") or cost.get("unbilled_pools"):
        return f"≥${cost['priced_usd']:,.4f} (unbilled)"
    if cost["usd"] is None:
        return f"≥${cost['priced_usd']:,.4f} (unpriced)"
    return f"${cost['usd']:,.4f}"


def spot_savings(billable: int | None, training: int | None) -> float | None:
    """Managed spot training's savings, as AWS computes them: "(1 - BillableTimeInSeconds /
    TrainingTimeInSeconds) * 100" (DescribeTrainingJob's BillableTimeInSeconds, botocore's
    sagemaker service-2.json; model-managed-spot-training.html). The savings are billable
    against training time, so billable time at the on-demand price is what a spot job cost:
    our reading of that formula, the one AWS gives."""
    if not billable or not training:
        return None
    return round((1 - billable / training) * 100, 1)
