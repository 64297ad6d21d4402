"""Fixtures: a moto server on loopback (its own process), queues, buckets, a small model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proving.faults import FaultPlan, FaultProxy
from sqsinfer.config import Settings
from sqsinfer.lab import stage as lab_stage
from sqsinfer.lab import standin, synthetic
from sqsinfer.worker.lifecycle import Worker

N_FEATURES = 8
MAX_RECEIVE_COUNT = 3

# Traces are off for the whole suite and the workers it starts as processes, whatever the
# shell says (the otel extra is installed with the dev tools); the tracing tests turn them
# on, pointed at a receiver of their own.
for _name in [name for name in os.environ if name.startswith("OTEL_")]:
    del os.environ[_name]
os.environ["OTEL_SDK_DISABLED"] = "true"


@pytest.fixture(autouse=True)
def _root_logging() -> Iterator[None]:
    """Undo what a command run in-process did to the root logger.

    A command's `logs.configure` points the root logger at the stderr pytest captured for
    that test; left in place, later tests' logs would go to a closed stream.
    """
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


# AWS's own configuration: what a test of it clears first, so that a developer's shell (or
# ~/.aws/config) does not decide where the test's calls go.
AWS_VARIABLES = (
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ENDPOINT_URL_SQS",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
    "AWS_CA_BUNDLE",
    "REQUESTS_CA_BUNDLE",
    "AWS_USE_FIPS_ENDPOINT",
    "AWS_USE_DUALSTACK_ENDPOINT",
    *(f"{name}_PROXY" for name in ("HTTP", "HTTPS", "ALL", "NO")),
    *(f"{name}_proxy" for name in ("http", "https", "all", "no")),
)


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """An environment with the stand-in's fake credentials and nothing else of AWS's
    configuration (no region, no endpoint, no profile); set what a test needs on it."""
    for name in AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    for name, value in standin.FAKE_CREDENTIALS.items():
        if name != "AWS_DEFAULT_REGION":
            monkeypatch.setenv(name, value)
    return monkeypatch


@pytest.fixture(scope="session")
def moto() -> Iterator[standin.MotoServer]:
    standin.use_fake_credentials()
    with standin.moto_server() as server:
        yield server


@pytest.fixture(scope="session")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("model") / "model.ubj"
    return synthetic.train_model(str(path), N_FEATURES, trees=10, depth=3, seed=1)


@dataclass
class Stage:
    """One stage's queues and bucket on a stand-in server, with sync clients to inspect them."""

    endpoint: str
    s3: Any
    sqs: Any
    bucket: str
    queue_url: str
    dlq_url: str
    next_url: str
    next_dlq_url: str

    def put_input(self, name: str, data: bytes) -> str:
        self.s3.put_object(Bucket=self.bucket, Key=f"in/{name}", Body=data)
        return f"s3://{self.bucket}/in/{name}"

    def send(self, body: dict[str, Any] | str, queue_url: str | None = None) -> str:
        text = body if isinstance(body, str) else json.dumps(body)
        response = self.sqs.send_message(QueueUrl=queue_url or self.queue_url, MessageBody=text)
        return str(response["MessageId"])

    def outputs(self, prefix: str = "out/") -> dict[str, bytes]:
        return lab_stage.read_objects(self.s3, self.bucket, prefix)

    def counts(self, queue_url: str) -> tuple[int, int]:
        attrs = self.sqs.get_queue_attributes(
            QueueUrl=queue_url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )["Attributes"]
        return (
            int(attrs["ApproximateNumberOfMessages"]),
            int(attrs["ApproximateNumberOfMessagesNotVisible"]),
        )

    def drain_queue(self, queue_url: str) -> list[dict[str, Any]]:
        """Receive (and delete) everything visible on a queue."""
        got: list[dict[str, Any]] = []
        while True:
            response = self.sqs.receive_message(
                QueueUrl=queue_url,
                MaxNumberOfMessages=10,
                WaitTimeSeconds=0,
                MessageAttributeNames=["All"],
                MessageSystemAttributeNames=["All"],
            )
            batch = response.get("Messages", [])
            if not batch:
                return got
            for message in batch:
                self.sqs.delete_message(QueueUrl=queue_url, ReceiptHandle=message["ReceiptHandle"])
            got += batch


def make_stage(
    endpoint: str,
    region: str = standin.REGION,
    *,
    fifo_input: bool = False,
    fifo_next: bool = False,
) -> Stage:
    """A fresh bucket and two queue pairs (this stage's, the next one's) at `endpoint`, in
    `region` (the stand-in keeps queues per region); either pair FIFO queues if asked."""
    s3, sqs = standin.clients(endpoint, region)
    name = lab_stage.create_bucket(s3, "t" + uuid.uuid4().hex[:10])
    this, after = (
        lab_stage.create_queue(
            sqs,
            queue,
            max_receive_count=MAX_RECEIVE_COUNT,
            attributes={"VisibilityTimeout": "30"},
            fifo=fifo,
        )
        for queue, fifo in ((name, fifo_input), (name + "-next", fifo_next))
    )
    return Stage(endpoint, s3, sqs, name, this.url, this.dlq_url, after.url, after.dlq_url)


@pytest.fixture
def stage(moto: standin.MotoServer) -> Stage:
    return make_stage(moto.url)


def stage_settings(stage: Stage, model_path: str, /, **overrides: Any) -> Settings:
    """A worker's settings for `stage`, quick to start and stop; `overrides` win, and one
    given as None is left unset (the worker's default)."""
    values: dict[str, Any] = {
        "queue_url": stage.queue_url,
        "model_path": model_path,
        "allowed_input_prefixes": f"s3://{stage.bucket}/in/",
        "output_prefix": f"s3://{stage.bucket}/out/",
        "endpoint_url": stage.endpoint,
        "region": standin.REGION,  # the stand-in's, whatever AWS_REGION the shell has
        "processes": "1",
        "wait_time_s": "1",
        "visibility_timeout_s": "30",
        "heartbeat_s": "10",
        "health_host": "127.0.0.1",
        "health_port": "0",
        "retry_base_s": "1",
        "task_time_s": "5",
        "drain_deadline_s": "10",
    }
    values.update({k: str(v) for k, v in overrides.items()})
    unset = [k for k, v in overrides.items() if v is None]
    return Settings.load(environ={}, overrides={k: values[k] for k in values if k not in unset})


@pytest.fixture
def make_settings(stage: Stage, model_path: str) -> Callable[..., Settings]:
    def make(**overrides: Any) -> Settings:
        return stage_settings(stage, model_path, **overrides)

    return make


@contextlib.asynccontextmanager
async def running(settings: Settings) -> AsyncIterator[Worker]:
    """A worker serving in this event loop; stopped (and drained) on exit."""
    worker = Worker(settings)
    serving = asyncio.create_task(worker.serve())
    try:
        while not worker.ready:
            if serving.done():
                serving.result()  # start-up failed: raise its error here
            await asyncio.sleep(0.02)
        yield worker
    finally:
        worker.stop()
        await asyncio.wait_for(serving, 60)


@contextlib.asynccontextmanager
async def fault_proxy(stage: Stage, plan: FaultPlan) -> AsyncIterator[FaultProxy]:
    """The fault proxy in front of the stage's moto server, in this event loop."""
    proxy = FaultProxy(stage.endpoint, plan)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()


async def eventually(check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Wait until `check()` is true (polling), or fail with the time it took."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(check):
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.1)


def outcome_count(worker: Worker, outcome: str) -> int:
    return worker.metrics.outcomes[outcome]


def sample(metrics: Any, name: str, **labels: str) -> float:
    """The current value of one metric sample (0 when it was never set)."""
    return metrics.registry.get_sample_value(name, labels) or 0.0


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Say how many hostile inputs the fuzz tests ran (they count them as they go)."""
    import sys

    fuzz = sys.modules.get("tests.unit.test_fuzz")
    cases = getattr(fuzz, "CASES", None)
    if cases:
        detail = ", ".join(f"{n} {what}" for what, n in sorted(cases.items()))
        terminalreporter.write_line(f"hostile-input cases: {sum(cases.values())} ({detail})")
