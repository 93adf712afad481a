"""Fixtures the reliability tests share with the suites they extend."""

from tests.test_local_backend import store  # noqa: F401 - a LocalStore and an S3Store (moto)
from tests.test_resume import channels  # noqa: F401 - small prepared splits for a training job
