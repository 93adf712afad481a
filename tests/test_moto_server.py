"""The embedded moto server's S3 makes a conditional create one step, as S3 does: of creates of
one key racing each other, exactly one succeeds (two drivers once claimed one run_num in CI).
Its host -> service lookup, kept per host, answers as moto's own."""

from __future__ import annotations

import threading
import time

import boto3
import pytest
from botocore.exceptions import ClientError
from moto.s3.models import S3Backend

from pipeline.backends import moto_server


@pytest.fixture
def slow_moto_put(monkeypatch):
    """moto's store step made slow, so every racing create passes moto's existence check
    before any of them stores: without the server's lock, all of them would succeed."""
    put = S3Backend.put_object

    def slow(self, *args, **kwargs):
        time.sleep(0.3)
        return put(self, *args, **kwargs)

    monkeypatch.setattr(S3Backend, "put_object", slow)


def test_of_racing_creates_of_one_key_exactly_one_succeeds(slow_moto_put, monkeypatch):
    server, endpoint = moto_server.serve()
    for name, value in {"AWS_ACCESS_KEY_ID": "t", "AWS_SECRET_ACCESS_KEY": "t"}.items():
        monkeypatch.setenv(name, value)
    try:
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        s3.create_bucket(Bucket="race")
        racers = 4
        start = threading.Barrier(racers)
        won, refused = [], []

        def create(n: int) -> None:
            client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
            start.wait()
            try:
                client.put_object(Bucket="race", Key="CLAIM", Body=str(n).encode(), IfNoneMatch="*")
                won.append(n)
            except ClientError as e:
                refused.append(e.response["Error"]["Code"])

        threads = [threading.Thread(target=create, args=(n,)) for n in range(racers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and refused == ["PreconditionFailed"] * (racers - 1)
        assert s3.get_object(Bucket="race", Key="CLAIM")["Body"].read() == str(won[0]).encode()
        # Plain puts still overwrite, unlocked.
        s3.put_object(Bucket="race", Key="CLAIM", Body=b"over")
        assert s3.get_object(Bucket="race", Key="CLAIM")["Body"].read() == b"over"
    finally:
        server.stop()


def test_the_kept_service_lookup_answers_as_motos_own():
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication

    server, _ = moto_server.serve()  # the lookup kept from here on
    try:
        kept = DomainDispatcherApplication.get_backend_for_host
        own = kept.__wrapped__
        dispatcher = DomainDispatcherApplication(server._server.app.create_app)
        hosts = [
            None,
            "moto_api",
            "s3",
            "s3.us-east-1.amazonaws.com",
            "bucket.s3.eu-west-1.amazonaws.com",
            "api.sagemaker.us-east-1.amazonaws.com",
            "logs.eu-west-1.amazonaws.com",
            "secretsmanager.us-east-1.amazonaws.com",
            "nothing.example.com",
        ]
        for host in hosts * 2:  # the second time from what was kept
            assert kept(dispatcher, host) == own(dispatcher, host), host
        assert set(dispatcher.smpipe_backends) == set(hosts)
    finally:
        server.stop()
