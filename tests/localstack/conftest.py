"""LocalStack as the stand-in: its own S3 and SQS in host mode on loopback, one per session.

Every test here is skipped, with the reason, when LocalStack is not installed; `make
test-localstack` installs it and sets SQSINFER_LOCALSTACK_REQUIRED, which turns that skip
into a failure so the lane cannot pass without running.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from proving import localstack
from sqsinfer.lab import standin
from tests.conftest import Stage, make_stage

REQUIRED_ENV = "SQSINFER_LOCALSTACK_REQUIRED"


@pytest.fixture(scope="session")
def localstack_server() -> Iterator[localstack.LocalStackServer]:
    try:
        python = localstack.localstack_python()
    except localstack.LocalStackMissing as exc:
        if os.environ.get(REQUIRED_ENV):
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    standin.use_fake_credentials()
    with localstack.localstack_server(python=python) as server:
        yield server


@pytest.fixture(autouse=True)
def _needs_localstack(localstack_server: localstack.LocalStackServer) -> None:
    """Every test in this directory runs against LocalStack (or is skipped without it)."""


@pytest.fixture
def stage(localstack_server: localstack.LocalStackServer) -> Stage:
    """The root conftest's stage, on LocalStack: `make_settings` and its users follow."""
    return make_stage(localstack_server.url)
