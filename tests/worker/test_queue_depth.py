"""The queue metrics the alerts read: the depth of the queue and its DLQ, sampled by the
worker (sqsinfer_queue_messages), and the age of what it receives
(sqsinfer_received_message_age_seconds), against the moto server."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from sqsinfer.aws.session import open_clients
from sqsinfer.aws.sqs import SqsQueue, oldest_age_s
from sqsinfer.config import Settings
from sqsinfer.lab import stage as lab_stage
from sqsinfer.lab import standin
from sqsinfer.logs import Event
from sqsinfer.metrics import Metrics
from tests.conftest import MAX_RECEIVE_COUNT, Stage, eventually, running, sample

DEPTH = "sqsinfer_queue_messages"
AGE = "sqsinfer_received_message_age_seconds"


def depth(metrics: Metrics, queue: str, state: str) -> float | None:
    return metrics.registry.get_sample_value(DEPTH, {"queue": queue, "state": state})


async def test_the_worker_shows_its_queues_depth_and_dead_letters_piling_up(
    stage: Stage, make_settings: Callable[..., Settings], caplog: pytest.LogCaptureFixture
) -> None:
    stage.sqs.send_message(QueueUrl=stage.queue_url, MessageBody="{}", DelaySeconds=900)
    async with running(make_settings(queue_sample_s=0.2)) as worker:
        m = worker.metrics
        await eventually(lambda: depth(m, "source", "delayed") == 1)
        await eventually(lambda: depth(m, "dead_letter", "visible") == 0)
        for n in range(2):  # malformed: each rejected to the DLQ with its reason
            stage.send(f"not json {n}")
        await eventually(lambda: depth(m, "dead_letter", "visible") == 2)
        # the copy lands in the DLQ before its message's outcome is counted
        await eventually(lambda: sample(m, "sqsinfer_tasks_total", outcome="rejected") == 2)
        assert sample(m, "sqsinfer_aws_requests_total", operation="GetQueueAttributes") >= 4

        # A DLQ that cannot be read shows no counts (not its last ones), and says so once.
        stage.sqs.delete_queue(QueueUrl=stage.dlq_url)
        await eventually(lambda: depth(m, "dead_letter", "visible") is None)
        assert depth(m, "source", "delayed") == 1  # the other queue is still read
        errors_at = sample(m, "sqsinfer_aws_errors_total", operation="GetQueueAttributes")
        await eventually(
            lambda: (
                sample(m, "sqsinfer_aws_errors_total", operation="GetQueueAttributes")
                >= errors_at + 2
            )
        )
        unknown = [r for r in caplog.records if r.getMessage() == Event.QUEUE_DEPTH_UNKNOWN]
        assert len(unknown) == 1 and unknown[0].role == "dead_letter"  # type: ignore[attr-defined]

        dlq_name = stage.dlq_url.rsplit("/", 1)[1]
        lab_stage.create_queue(stage.sqs, dlq_name, max_receive_count=MAX_RECEIVE_COUNT)
        await eventually(lambda: depth(m, "dead_letter", "visible") == 0)
        assert [r.getMessage() for r in caplog.records].count(Event.QUEUE_DEPTH_KNOWN) == 1


async def test_no_sampling_when_switched_off(
    stage: Stage, make_settings: Callable[..., Settings]
) -> None:
    async with running(make_settings(queue_sample_s=0)) as worker:
        stage.send("not json")
        await eventually(lambda: sample(worker.metrics, "sqsinfer_tasks_total", outcome="rejected"))
        assert depth(worker.metrics, "dead_letter", "visible") is None
        calls = sample(
            worker.metrics, "sqsinfer_aws_requests_total", operation="GetQueueAttributes"
        )
    assert calls == 2  # start-up's looks at the redrive policy and the DLQ's size, no more


async def test_a_receive_carries_each_messages_age(stage: Stage) -> None:
    """SentTimestamp comes with every receive: a message delayed 2 s is at least 2 s old."""
    sent_at = time.time()
    stage.sqs.send_message(QueueUrl=stage.queue_url, MessageBody="{}", DelaySeconds=2)
    stage.send("fresh")
    async with open_clients(standin.REGION, stage.endpoint) as clients:
        queue = SqsQueue(clients.sqs, stage.queue_url)
        got = await queue.receive(10, wait_s=1, visibility_s=30)
        while len(got) < 2:
            got += await queue.receive(10, wait_s=5, visibility_s=30)
    now = time.time()
    assert all(sent_at - 2 <= m.sent_at_s <= now for m in got)  # the stand-in's clock is ours
    assert 2.0 <= oldest_age_s(got, now) <= now - sent_at
    assert oldest_age_s([], now) == 0.0
    assert oldest_age_s(got, min(m.sent_at_s for m in got) - 5) == 0.0  # a clock behind SQS's


async def test_the_worker_shows_the_age_of_what_it_received(
    stage: Stage, make_settings: Callable[..., Settings]
) -> None:
    # A long poll of 3 s: the age stays shown that long before an empty receive zeroes it.
    async with running(make_settings(wait_time_s=3)) as worker:
        assert sample(worker.metrics, AGE) == 0.0
        stage.sqs.send_message(QueueUrl=stage.queue_url, MessageBody="x", DelaySeconds=2)
        await eventually(lambda: sample(worker.metrics, AGE) >= 2.0)
        assert sample(worker.metrics, AGE) < 30
        await eventually(lambda: sample(worker.metrics, AGE) == 0.0)  # the queue is empty
