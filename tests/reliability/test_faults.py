"""Fault injection: S3 answering 500, 503 SlowDown or dropping the connection on 5% of
requests (botocore's event hooks, against moto) costs retries, never an artifact; a
permanent error fails at once, naming the bucket and key."""

from __future__ import annotations

import collections
import random
import sys
import threading

import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ConnectionClosedError

import run_pipeline as cli
from pipeline.config import load_settings
from pipeline.driver import PipelineError, parse_steps, run_pipeline
from pipeline.store import MANIFEST, S3Store, StoreError, file_sha256, read_manifest
from tests.conftest import write_settings
from tests.reliability.figures import record

ERRORS = {500: "InternalError", 503: "SlowDown", 403: "AccessDenied"}


class Body:
    def __init__(self, data: bytes):
        self.data = data

    def stream(self, **_):
        yield self.data


def answer(request, status: int) -> AWSResponse:
    body = f"<Error><Code>{ERRORS[status]}</Code><Message>injected</Message></Error>".encode()
    return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, Body(body))


class Faults:
    """A before-send hook: the request is answered here, as if by a failing S3."""

    def __init__(self, rate: float, seed: int = 0, deny: str | None = None):
        self.rate, self.deny, self.rng = rate, deny, random.Random(seed)
        self.injected, self.requests, self.denied = collections.Counter(), 0, []
        self.lock = threading.Lock()

    def __call__(self, request, **_):
        with self.lock:
            self.requests += 1
            if self.deny and self.deny in request.url and request.method == "PUT":
                self.denied.append(request.url)
                return answer(request, 403)
            if self.rng.random() >= self.rate:
                return None
            kind = self.rng.choice(["500", "503", "dropped"])
            self.injected[kind] += 1
        if kind == "dropped":
            raise ConnectionClosedError(endpoint_url=request.url)
        return answer(request, int(kind))


def pipeline(tmp_path, bucket, demo_raw, faults: Faults, steps=None):
    path = write_settings(tmp_path / "s.ini", f"s3://{bucket}/root", models={"MODEL_NAMES": "bow"},
                          data={"RAW_DATA": str(demo_raw)}, training={"CHECKPOINT_EVERY_STEPS": "0"})  # fmt: skip
    settings = load_settings(path, {})
    store = S3Store(settings.store_uri())
    store.client.meta.events.register("before-send.s3", faults)
    try:
        return run_pipeline(settings, store, parse_steps(steps), echo=sys.stdout), store
    finally:
        store.client.meta.events.unregister("before-send.s3", faults)


def lost_files(store: S3Store, manifests: list[str], folder) -> tuple[int, list[str]]:
    """Every file of every manifest fetched and checked against its size and sha256: how many
    were checked, and the keys of those missing or different."""
    checked, lost = 0, []
    for i, key in enumerate(manifests):
        prefix = key[: -len(MANIFEST)]
        for rel, entry in read_manifest(store, prefix)["files"].items():
            checked, dest = checked + 1, folder / str(i) / rel
            try:
                store.download_file(prefix + rel, dest)
            except StoreError:
                lost.append(prefix + rel)
                continue
            if dest.stat().st_size != entry["size"] or file_sha256(dest) != entry["sha256"]:
                lost.append(prefix + rel)
    return checked, lost


@pytest.mark.slow
def test_transient_s3_faults_cost_retries_not_artifacts(tmp_path, bucket, demo_raw):
    faults = Faults(rate=0.05, seed=1)
    run, store = pipeline(tmp_path, bucket, demo_raw, faults)
    manifests = [k for k in store.list_keys("") if k.endswith(MANIFEST)]
    checked, lost = lost_files(store, manifests, tmp_path / "check")
    # As counted: how many requests a run makes (its heartbeat's among them) depends on how
    # long it takes, so the faults it meets do too; none may cost an artifact.
    record("s3-faults", requests=faults.requests, faults=dict(faults.injected), runs=1,
           completed=int(run["status"] == "completed"), manifests=len(manifests),
           files=checked, lost=len(lost))  # fmt: skip
    assert run["status"] == "completed"
    # Faults are drawn in request order from a seeded generator: whatever the timing, the
    # first 78 requests of any run meet 5 of them (and a run makes hundreds).
    assert faults.requests >= 78 and sum(faults.injected.values()) >= 5, faults.injected
    assert len(manifests) >= 10 and checked >= len(manifests) and lost == []


def test_a_permanent_error_fails_at_once_naming_bucket_and_key(tmp_path, bucket, demo_raw):
    faults = Faults(rate=0.0, deny="/jobs/prepare/")
    with pytest.raises(PipelineError) as e:  # the store's error, as the run's one paragraph
        pipeline(tmp_path, bucket, demo_raw, faults, steps="reconcile,prepare")
    assert str(e.value).startswith("run 0001 failed: ") and "\n" not in str(e.value)
    assert f"s3://{bucket}/root/test-exp/runs/0001/jobs/prepare/" in str(e.value)
    assert "AccessDenied" in str(e.value) and "It is marked failed at" in str(e.value)
    assert len(faults.denied) == 1  # not retried
    store = S3Store(f"s3://{bucket}/root")
    import json

    record = json.loads(store.get_bytes("test-exp/runs/0001/metadata.json"))
    assert record["status"] == "failed" and "AccessDenied" in record["failure_reason"]


def test_a_missing_bucket_is_named_before_anything_starts(tmp_path, aws_env, capsys):
    path = write_settings(tmp_path / "s.ini", "s3://smpipe-no-such-bucket/root")
    assert cli.main([str(path)]) == 2
    assert (
        "[experiment] STORE: s3://smpipe-no-such-bucket/root: no such bucket"
        in capsys.readouterr().err
    )
