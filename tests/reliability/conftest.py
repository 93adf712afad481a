"""Fixtures the reliability tests share with the suites they extend."""

from tests.test_local_backend import store  # noqa: F401 - a LocalStore and an S3Store (moto)
from tests.test_prune import store_at  # noqa: F401 - a LocalStore or an S3Store and its STORE
