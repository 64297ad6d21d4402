"""The fault proxy, and the worker behind it: injected faults cost retries, never work."""

from __future__ import annotations

import errno
import functools
import json
import time

import aiohttp
import numpy as np
import pytest
from botocore.exceptions import ClientError, ConnectionClosedError, EndpointConnectionError

from proving.faults import SDK_ATTEMPTS, FaultPlan, FaultProxy, classify, parse_slow_reads
from proving.sqs_rules import unsendable
from sqsinfer.aws.session import may_have_taken_effect, open_clients
from sqsinfer.compute.handlers.xgboost_impl import XGBoostHandler
from sqsinfer.lab import standin, synthetic
from sqsinfer.limits import SQS_DEFAULT_MAX_MESSAGE_BYTES
from sqsinfer.metrics import Metrics
from tests.conftest import N_FEATURES, Stage, eventually, outcome_count, running, sample


@pytest.mark.parametrize(
    ("method", "path", "headers", "expected"),
    [
        (
            "POST",
            "/",
            {"X-Amz-Target": "AmazonSQS.ReceiveMessage"},
            ("sqs", "ReceiveMessage", False),
        ),
        ("GET", "/bucket/in/a.npy", {}, ("s3", "GetObject", False)),
        ("PUT", "/bucket/out/a.npy", {"If-None-Match": "*"}, ("s3", "PutObject", True)),
        ("HEAD", "/bucket/out/a.npy", {}, ("s3", "HeadObject", False)),
        ("HEAD", "/bucket", {}, ("s3", "HeadBucket", False)),
    ],
)
def test_operations_are_recognised(method, path, headers, expected):
    op = classify(method, path, "", headers)
    assert (op.service, op.name, op.conditional) == expected


TASKS = 30


def _allow_receives(stage: Stage, count: int) -> None:
    """Raise the queue's maxReceiveCount (the worker reads it at start-up)."""
    attributes = stage.sqs.get_queue_attributes(
        QueueUrl=stage.queue_url, AttributeNames=["RedrivePolicy"]
    )["Attributes"]
    policy = json.loads(attributes["RedrivePolicy"]) | {"maxReceiveCount": str(count)}
    stage.sqs.set_queue_attributes(
        QueueUrl=stage.queue_url, Attributes={"RedrivePolicy": json.dumps(policy)}
    )


async def test_worker_behind_faults_commits_every_task_exactly_once(
    stage: Stage, make_settings, model_path
):
    plan = FaultPlan(seed=7, s3_5xx=0.15, s3_conflict=0.3, sqs_errors=0.1, drop=0.1, latency_ms=5)
    # At these rates a message may use up three receives, one of them a receive whose
    # answer was dropped (so the worker never saw it): that is the retry budget's test,
    # not this one's, which is that every task is committed once.
    _allow_receives(stage, 10)
    proxy = FaultProxy(stage.endpoint, plan)
    await proxy.start()
    inputs = {}
    # Enough tasks that every kind of fault is drawn at these rates (a first delivery makes
    # only two S3 calls: with 20 tasks, no dropped S3 answer at all came up now and then).
    for i in range(TASKS):
        inputs[f"f{i}"] = synthetic.make_rows(4, N_FEATURES, seed=100 + i)
        uri = stage.put_input(f"f{i}.npy", synthetic.encode_input(inputs[f"f{i}"], "npy"))
        stage.send({"task_id": f"f{i}", "input": uri})
    settings = make_settings(
        endpoint_url=proxy.url, visibility_timeout_s=4, heartbeat_s=1, retry_base_s=1, prefetch=4
    )
    try:
        async with running(settings) as worker:
            await eventually(lambda: len(stage.outputs()) == TASKS, timeout_s=90)
            await eventually(lambda: stage.counts(stage.queue_url) == (0, 0), timeout_s=60)
    finally:
        await proxy.stop()
    handler = XGBoostHandler()
    handler.load(model_path, 1)
    for key, body in stage.outputs().items():
        task_id = key.removeprefix("out/").removesuffix(".npy")
        want = handler.predict(inputs[task_id]).reshape(-1, 1)
        np.testing.assert_allclose(synthetic.decode_output(body, "npy"), want, rtol=1e-6)
    assert stage.counts(stage.dlq_url) == (0, 0)
    assert outcome_count(worker, "rejected") == 0
    assert outcome_count(worker, "committed") + outcome_count(worker, "duplicate") >= TASKS
    for kind in ("s3:409", "s3:dropped"):
        assert proxy.counts[kind] > 0, proxy.counts
    assert proxy.counts["s3:503"] + proxy.counts["s3:500"] > 0
    assert proxy.counts["sqs:500"] + proxy.counts["sqs:throttled"] > 0


def test_marker_writes_and_queue_urls_are_recognised():
    put = classify("PUT", "/bucket/out/a.npy.chain", "", {"If-Match": '"abc"'})
    assert (put.name, put.key, put.marker, put.if_match) == (
        "PutObject",
        "out/a.npy.chain",
        True,
        True,
    )
    create = classify("PUT", "/bucket/out/a.npy.chain", "", {"If-None-Match": "*"})
    assert create.marker and not create.if_match
    assert not classify("PUT", "/bucket/out/a.npy", "", {}).marker


async def test_a_dropped_send_answer_still_enqueues_the_message(stage: Stage):
    """The request reaches SQS; the SDK, seeing no answer, sends again: two messages."""
    name = stage.next_url.rsplit("/", 1)[1]
    plan = FaultPlan(send_drop=1.0, send_drop_queue=name, limits={"sqs:send_dropped": 1})
    proxy = FaultProxy(stage.endpoint, plan)
    await proxy.start()
    try:
        async with open_clients("us-east-1", proxy.url) as clients:
            await clients.sqs.send_message(QueueUrl=stage.next_url, MessageBody="once")
            await clients.sqs.send_message(QueueUrl=stage.queue_url, MessageBody="elsewhere")
    finally:
        await proxy.stop()
    assert proxy.counts == {"sqs:send_dropped": 1}
    assert [m["Body"] for m in stage.drain_queue(stage.next_url)] == ["once", "once"]
    assert [m["Body"] for m in stage.drain_queue(stage.queue_url)] == ["elsewhere"]


async def test_a_marker_burst_outlasts_the_sdk_retries_once_per_key(stage: Stage):
    proxy = FaultProxy(stage.endpoint, FaultPlan(marker_failures=1.0))
    await proxy.start()
    try:
        async with open_clients("us-east-1", proxy.url) as clients:
            put = functools.partial(clients.s3.put_object, Bucket=stage.bucket, Body=b"{}")
            with pytest.raises(ClientError, match="SlowDown"):
                await put(Key="out/a.npy.chain", IfNoneMatch="*")
            await put(Key="out/a.npy.chain", IfNoneMatch="*")  # its burst is spent
            await put(Key="out/a.npy")  # not a marker: never in a burst
    finally:
        await proxy.stop()
    assert proxy.counts == {"s3:marker_503": SDK_ATTEMPTS}
    assert set(stage.outputs()) == {"out/a.npy", "out/a.npy.chain"}


async def test_failing_operations_and_delays_are_applied_per_operation(stage: Stage):
    stage.send("m")
    plan = FaultPlan(failing={"DeleteMessageBatch": 1.0}, delays_s={"ReceiveMessage": 0.3})
    proxy = FaultProxy(stage.endpoint, plan)
    await proxy.start()
    try:
        async with open_clients("us-east-1", proxy.url) as clients:
            got = await clients.sqs.receive_message(QueueUrl=stage.queue_url, WaitTimeSeconds=1)
            entries = [{"Id": "0", "ReceiptHandle": got["Messages"][0]["ReceiptHandle"]}]
            with pytest.raises(ClientError, match="InternalError"):
                await clients.sqs.delete_message_batch(QueueUrl=stage.queue_url, Entries=entries)
    finally:
        await proxy.stop()
    assert proxy.counts == {"sqs:DeleteMessageBatch_500": SDK_ATTEMPTS}
    assert proxy.seen["ReceiveMessage"] == 1
    assert stage.counts(stage.queue_url) == (0, 1)  # not deleted: still in flight


async def test_only_extensions_are_held_once_per_message_and_named(stage: Stage, caplog):
    """A hand-back (visibility below the floor) passes; an extension is held, and its
    retry (the same receipt handle) is not; the held call's log line names the message."""
    message_id = stage.send("m")
    plan = FaultPlan(
        visibility_delay_s=0.5,
        visibility_delay_rate=1.0,
        visibility_delay_min_s=30,
        visibility_delay_once=True,
    )
    proxy = FaultProxy(stage.endpoint, plan)
    await proxy.start()
    try:
        async with open_clients("us-east-1", proxy.url) as clients:
            got = await clients.sqs.receive_message(QueueUrl=stage.queue_url, WaitTimeSeconds=1)
            handle = got["Messages"][0]["ReceiptHandle"]

            async def change(seconds: int) -> float:
                started = time.monotonic()
                entries = [{"Id": "0", "ReceiptHandle": handle, "VisibilityTimeout": seconds}]
                answer = await clients.sqs.change_message_visibility_batch(
                    QueueUrl=stage.queue_url, Entries=entries
                )
                assert [e["Id"] for e in answer["Successful"]] == ["0"]
                return time.monotonic() - started

            assert await change(5) < 0.4  # a hand-back: below the floor, not held
            assert await change(30) >= 0.5  # an extension: held, then it lands
            assert await change(30) < 0.4  # this message's calls were held once already
    finally:
        await proxy.stop()
    assert proxy.counts == {"sqs:visibility_delayed": 1}
    held = [r for r in caplog.records if r.getMessage() == "visibility call held"]
    assert [(r.message_ids, r.visibility_s) for r in held] == [([message_id], [30])]


async def test_with_slow_only_just_the_calls_carrying_a_slow_task_are_held(stage: Stage, caplog):
    """The stall is aimed at a hold known to be long: a task whose input reads slowly."""
    slow_id = stage.send({"task_id": "s", "input": f"s3://{stage.bucket}/in/slow-1.npy"})
    stage.send({"task_id": "f", "input": f"s3://{stage.bucket}/in/fast-1.npy"})
    plan = FaultPlan(
        visibility_delay_s=0.1,
        visibility_delay_rate=1.0,
        visibility_delay_once=True,
        visibility_delay_slow_only=True,
        slow_reads={"in/slow-": 0.1},
    )
    proxy = FaultProxy(stage.endpoint, plan)
    await proxy.start()
    handles: dict[str, str] = {}
    try:
        async with open_clients("us-east-1", proxy.url) as clients:
            while len(handles) < 2:
                got = await clients.sqs.receive_message(
                    QueueUrl=stage.queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=1
                )
                for m in got.get("Messages", []):
                    handles[json.loads(m["Body"])["task_id"]] = m["ReceiptHandle"]
            for task_id in ("f", "s", "f"):
                entries = [{"Id": "0", "ReceiptHandle": handles[task_id], "VisibilityTimeout": 30}]
                await clients.sqs.change_message_visibility_batch(
                    QueueUrl=stage.queue_url, Entries=entries
                )
    finally:
        await proxy.stop()
    assert proxy.counts == {"sqs:visibility_delayed": 1}
    held = [r for r in caplog.records if r.getMessage() == "visibility call held"]
    assert [r.message_ids for r in held] == [[slow_id]]


async def test_slow_reads_hold_only_the_keys_under_their_prefix(stage: Stage):
    stage.put_input("slow-1.npy", b"slow")
    stage.put_input("fast-1.npy", b"fast")
    proxy = FaultProxy(stage.endpoint, FaultPlan(slow_reads={"in/slow-": 0.5}))
    await proxy.start()
    try:
        async with open_clients("us-east-1", proxy.url) as clients:
            timings = {}
            for name in ("slow-1.npy", "fast-1.npy"):
                started = time.monotonic()
                got = await clients.s3.get_object(Bucket=stage.bucket, Key=f"in/{name}")
                assert await got["Body"].read() == name.split("-")[0].encode()
                timings[name] = time.monotonic() - started
    finally:
        await proxy.stop()
    assert timings["slow-1.npy"] >= 0.5 > timings["fast-1.npy"]
    assert proxy.counts == {"s3:slow_read": 1}


async def test_every_message_sent_through_the_proxy_is_recorded_as_sqs_would_get_it(
    stage: Stage, tmp_path
):
    """Characters moto accepts and AWS refuses show in the record, to be held to AWS's rules."""
    record = tmp_path / "sends.jsonl"
    proxy = FaultProxy(
        stage.endpoint, FaultPlan(failing={"SendMessage": 1.0}), record_path=str(record)
    )
    await proxy.start()
    attributes = {"sqsinfer.reason": {"DataType": "String", "StringValue": "why\uffff"}}
    try:
        async with open_clients("us-east-1", proxy.url) as clients:
            with pytest.raises(
                ClientError, match="InternalError"
            ):  # refused: recorded all the same
                await clients.sqs.send_message(
                    QueueUrl=stage.next_url, MessageBody="a\x00b", MessageAttributes=attributes
                )
            await clients.sqs.send_message_batch(
                QueueUrl=stage.queue_url, Entries=[{"Id": "0", "MessageBody": "fine"}]
            )
    finally:
        await proxy.stop()
    sent = [json.loads(line) for line in record.read_text().splitlines()]
    assert all(isinstance(line.pop("at"), float) for line in sent)  # when it reached the proxy
    assert sent[0] == {"queue": stage.next_url, "body": "a\x00b", "attributes": attributes}
    assert len(sent) == 1 + SDK_ATTEMPTS  # the first try and each of the SDK's retries
    assert sent[-1] == {"queue": stage.queue_url, "body": "fine", "attributes": {}}
    assert unsendable(sent[0]["body"], sent[0]["attributes"], SQS_DEFAULT_MAX_MESSAGE_BYTES) == [
        "body has characters outside the XML range",
        "attribute sqsinfer.reason has characters outside the XML range",
    ]


def test_slow_reads_are_given_as_prefix_and_seconds():
    assert parse_slow_reads(["in/slow-=16", "a=b=1.5"]) == {"in/slow-": 16.0, "a=b": 1.5}
    with pytest.raises(ValueError, match="PREFIX=SECONDS"):
        parse_slow_reads(["16"])


async def test_an_answer_lost_on_the_way_reaches_the_caller_as_the_sdks_error_and_is_counted(
    stage: Stage,
):
    """A call with no answer at all (the connection closed mid-answer, no SDK retries) fails
    with the SDK's own error, and counts as an AWS error of its operation."""
    plan = FaultPlan(send_drop=1.0, limits={"sqs:send_dropped": 1})
    proxy = FaultProxy(stage.endpoint, plan)
    await proxy.start()
    metrics = Metrics()
    try:
        async with open_clients("us-east-1", proxy.url) as clients:
            metrics.count_aws_calls(clients.sqs_single_attempt)
            # Not a TypeError from the metrics hook in its place: callers sort errors by type.
            with pytest.raises(ConnectionClosedError):
                await clients.sqs_single_attempt.send_message(
                    QueueUrl=stage.next_url, MessageBody="m"
                )
    finally:
        await proxy.stop()
    assert proxy.counts == {"sqs:send_dropped": 1}
    assert sample(metrics, "sqsinfer_aws_requests_total", operation="SendMessage") == 1
    assert sample(metrics, "sqsinfer_aws_errors_total", operation="SendMessage") == 1


async def test_a_reset_answer_took_effect_yet_reads_as_the_sdks_connection_error(stage: Stage):
    """Sends, puts and deletes reach the service; each answer is a reset (RST). The SDK
    calls it what it calls a refused connect, so only the error under it tells them apart."""
    stage.send("to delete")
    plan = FaultPlan(reset=1.0, limits={"sqs:reset": 2, "s3:reset": 1})
    proxy = FaultProxy(stage.endpoint, plan)
    await proxy.start()
    nowhere = f"http://127.0.0.1:{standin.free_port()}"
    try:
        async with (
            open_clients("us-east-1", proxy.url) as clients,
            open_clients("us-east-1", nowhere) as unreachable,
        ):
            with pytest.raises(EndpointConnectionError) as reset:
                await clients.sqs_single_attempt.send_message(
                    QueueUrl=stage.next_url, MessageBody="sent"
                )
            with pytest.raises(EndpointConnectionError) as refused:
                await unreachable.sqs_single_attempt.send_message(
                    QueueUrl=stage.next_url, MessageBody="never"
                )
            # With the SDK's retries, a reset call is sent again and succeeds.
            await clients.s3.put_object(Bucket=stage.bucket, Key="out/a.npy", Body=b"put")
            got = await clients.sqs.receive_message(QueueUrl=stage.queue_url, WaitTimeSeconds=1)
            entries = [{"Id": "0", "ReceiptHandle": got["Messages"][0]["ReceiptHandle"]}]
            await clients.sqs.delete_message_batch(QueueUrl=stage.queue_url, Entries=entries)
    finally:
        await proxy.stop()
    assert proxy.counts == {"sqs:reset": 2, "s3:reset": 1}
    cause = reset.value.kwargs["error"]
    assert isinstance(cause, aiohttp.ClientOSError) and cause.errno == errno.ECONNRESET
    assert may_have_taken_effect(reset.value)
    assert not may_have_taken_effect(refused.value)
    assert [m["Body"] for m in stage.drain_queue(stage.next_url)] == ["sent"]
    assert stage.outputs() == {"out/a.npy": b"put"}
    assert stage.counts(stage.queue_url) == (0, 0)  # the delete took effect
