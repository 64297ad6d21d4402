"""Every message the worker sends would be accepted by AWS, and every DLQ copy has a reason.

moto accepts what AWS refuses (characters outside the XML range, messages whose
attributes push them over the queue's MaximumMessageSize), so these tests run the real
worker against moto and then hold everything that arrived on the next stage and the
dead-letter queue to AWS's rules (`proving.sqs_rules`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from proving.faults import FaultPlan, FaultProxy
from proving.sqs_rules import unsendable
from sqsinfer.aws.session import open_clients
from sqsinfer.aws.sqs import BODY_TRUNCATED_ATTR, REASON_ATTR
from sqsinfer.lab import synthetic
from sqsinfer.limits import SQS_DEFAULT_MAX_MESSAGE_BYTES
from sqsinfer.worker.preflight import Preflight
from tests.conftest import N_FEATURES, Stage, eventually, running
from tests.unit.test_inference import npy_claiming


def _hostile(stage: Stage) -> tuple[dict[str, str], dict[str, str]]:
    """Bodies that must be accepted (task id → body) and rejected (body → reason)."""
    b = stage.bucket
    good = stage.put_input("a.npy", synthetic.encode_input(synthetic.make_rows(3, 8, 1), "npy"))
    assert N_FEATURES == 8
    lying = stage.put_input("lying.npy", npy_claiming("(-1, 8)", values=16))
    unknowable = stage.put_input("unknowable.npy", npy_claiming("(-1, -1)", values=16))
    accepted = {
        # JSON escapes of characters SQS refuses arrive intact; decoded, they are unsendable.
        "params": {"task_id": "params", "input": good, "params": {"n\uffff": "\ufffe\x00"}},
    }
    rejected: dict[str, Any] = {
        "invalid_field": [
            {"task_id": "newline\n", "input": good},
            {"task_id": "in-char", "input": good.replace("a.npy", "a\uffff.npy")},
            {"task_id": "out-char", "input": good, "output": f"s3://{b}/out/o\ufffe.npy"},
            {"task_id": "long", "input": good, "output": f"s3://{b}/out/{'k' * 1010}.npy"},
        ],
        "undecodable_input": [
            {"task_id": "lying", "input": lying},
            {"task_id": "unknowable", "input": unknowable},
        ],
        # Within SQS's limit, over the worker's: its copy plus the reason is over SQS's.
        "message_too_large": [{"task_id": "big", "input": good, "pad": "x" * 261_500}],
    }
    return (
        {k: json.dumps(v) for k, v in accepted.items()},
        {json.dumps(doc): reason for reason, docs in rejected.items() for doc in docs},
    )


def _collector(stage: Stage, wanted: dict[str, int], got: dict[str, list[dict[str, Any]]]):
    """A check for `eventually`: drains each queue into `got` until it has its count."""

    def arrived() -> bool:
        for url in wanted:
            got.setdefault(url, []).extend(stage.drain_queue(url))
        return all(len(got[url]) >= count for url, count in wanted.items())

    return arrived


async def test_everything_sent_is_sendable_and_every_rejection_has_its_reason(
    stage: Stage, make_settings
):
    stage.sqs.set_queue_attributes(
        QueueUrl=stage.dlq_url,
        Attributes={"MaximumMessageSize": str(SQS_DEFAULT_MAX_MESSAGE_BYTES)},
    )
    accepted, rejected = _hostile(stage)
    for body in [*accepted.values(), *rejected]:
        stage.send(body)
    settings = make_settings(next_queue_url=stage.next_url, max_message_bytes=200_000)
    got: dict[str, list[dict[str, Any]]] = {}
    wanted = {stage.dlq_url: len(rejected), stage.next_url: len(accepted)}
    async with running(settings):
        await eventually(_collector(stage, wanted, got), timeout_s=60)
    dead, forwarded = got[stage.dlq_url], got[stage.next_url]
    for message in dead + forwarded:
        attributes = message.get("MessageAttributes")
        assert unsendable(message["Body"], attributes, SQS_DEFAULT_MAX_MESSAGE_BYTES) == [], (
            message["Body"][:200]
        )
    reasons = {
        m["Body"]: m.get("MessageAttributes", {}).get(REASON_ATTR, {}).get("StringValue")
        for m in dead
    }
    assert reasons == rejected
    assert [json.loads(m["Body"])["params"] for m in forwarded] == [{"n\uffff": "\ufffe\x00"}]


async def test_a_copy_too_large_for_the_dead_letter_queue_is_cut_and_keeps_its_reason(
    stage: Stage, make_settings
):
    stage.sqs.set_queue_attributes(
        QueueUrl=stage.dlq_url, Attributes={"MaximumMessageSize": "1024"}
    )
    body = "{" + "x" * 4999
    stage.send(body)
    got: dict[str, list[dict[str, Any]]] = {}
    async with running(make_settings()):
        await eventually(_collector(stage, {stage.dlq_url: 1}, got))
    (copy,) = got[stage.dlq_url]
    attributes = copy["MessageAttributes"]
    assert unsendable(copy["Body"], attributes, 1024) == []
    assert attributes[REASON_ATTR]["StringValue"] == "malformed_json"
    assert attributes[BODY_TRUNCATED_ATTR]["StringValue"] == "5000"
    assert body.startswith(copy["Body"]) and len(copy["Body"]) > 200


class _DenyingAttributes(FaultProxy):
    """Answers GetQueueAttributes on one queue as AWS does when the policy does not grant it."""

    denied_queue: str = ""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        target = request.headers.get("X-Amz-Target", "")
        if target.endswith(".GetQueueAttributes") and self.denied_queue in await request.text():
            return web.json_response(
                {"__type": "com.amazonaws.sqs#AccessDenied", "message": "not authorized"},
                status=403,
                content_type="application/x-amz-json-1.0",
                headers={"x-amzn-query-error": "AccessDenied;Sender"},
            )
        return await super()._handle(request)


async def test_a_dead_letter_queue_whose_size_may_not_be_read_is_assumed_at_the_default(
    stage: Stage, make_settings
):
    stage.sqs.set_queue_attributes(
        QueueUrl=stage.dlq_url, Attributes={"MaximumMessageSize": "1024"}
    )
    proxy = _DenyingAttributes(stage.endpoint, FaultPlan())
    proxy.denied_queue = stage.dlq_url.rsplit("/", 1)[1]
    await proxy.start()
    try:
        for endpoint, expected in (
            (stage.endpoint, 1024),
            (proxy.url, SQS_DEFAULT_MAX_MESSAGE_BYTES),
        ):
            settings = make_settings(endpoint_url=endpoint)
            async with open_clients(settings.region, endpoint) as clients:
                found = await Preflight(settings, clients, asyncio.Event()).run()
            assert found.dlq_url.endswith(stage.dlq_url.rsplit("/", 1)[1])
            assert found.dlq_max_message_bytes == expected
    finally:
        await proxy.stop()
