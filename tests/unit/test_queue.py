"""Batching of deletes, visibility changes and sends: each entry learns its own fate."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proving.sqs_rules import message_bytes, unsendable
from sqsinfer.aws.sqs import (
    BODY_TRUNCATED_ATTR,
    DETAIL_ATTR,
    REASON_ATTR,
    SOURCE_ID_ATTR,
    SOURCE_QUEUE_ATTR,
    Batcher,
    BatchSender,
    EntryFailed,
    Message,
    SqsQueue,
    dead_letter_attributes,
    dead_letter_copy,
)
from sqsinfer.limits import SQS_BATCH_MAX_BYTES


async def test_entries_are_sent_ten_at_a_time_and_only_successful_ones_count():
    calls: list[list[dict[str, Any]]] = []

    async def call(entries: list[dict[str, Any]]) -> dict[str, Any]:
        calls.append(entries)
        ok = [{"Id": e["Id"]} for e in entries if e["ReceiptHandle"] != "bad"]
        failed = [
            {"Id": e["Id"], "Code": "ReceiptHandleIsInvalid"}
            for e in entries
            if e["ReceiptHandle"] == "bad"
        ]
        return {"Successful": ok, "Failed": failed}

    batcher = Batcher("delete", call)
    handles = [f"h{i}" for i in range(23)]
    handles[5] = handles[17] = "bad"
    results = await asyncio.gather(*(batcher.submit({"ReceiptHandle": h}) for h in handles))
    assert [len(c) for c in calls] == [10, 10, 3]
    assert [i for i, ok in enumerate(results) if not ok] == [5, 17]


async def test_a_failed_call_fails_every_entry_of_its_batch():
    async def call(entries: list[dict[str, Any]]) -> dict[str, Any]:
        raise ConnectionError("endpoint down")

    batcher = Batcher("visibility", call)
    futures = [batcher.submit({"ReceiptHandle": str(i)}) for i in range(3)]
    for future in futures:
        with pytest.raises(ConnectionError):
            await future


async def test_deletes_really_remove_messages(stage):
    from sqsinfer.aws.session import open_clients

    for i in range(12):
        stage.send({"n": i})
    async with open_clients("us-east-1", stage.endpoint) as clients:
        queue = SqsQueue(clients.sqs, stage.queue_url)
        got: list[Message] = []
        while len(got) < 12:
            got += await queue.receive(10, 1, 30)
        results = await asyncio.gather(*(queue.delete(m) for m in got))
        await queue.drain()
    assert all(results)
    assert stage.counts(stage.queue_url) == (0, 0)
    assert all(m.receive_count == 1 for m in got)


def test_dead_letter_attributes_keep_what_fits_of_the_original():
    original = {f"a{i}": {"DataType": "String", "StringValue": str(i)} for i in range(9)}
    message = Message("id-1", "rh", "{}", 2, original)
    attrs = dead_letter_attributes(message, "malformed_json", "x" * 5000, "https://q")
    assert len(attrs) == 10  # the SQS limit
    assert attrs["sqsinfer.reason"]["StringValue"] == "malformed_json"
    assert len(attrs["sqsinfer.detail"]["StringValue"]) == 1000
    assert attrs["sqsinfer.source_message_id"]["StringValue"] == "id-1"


# -- the dead-letter copy: always sendable, always with its reason --------------------
def copy_of(body: str, attrs: dict | None = None, detail: str = "why", max_bytes: int = 262_144):
    message = Message("3f1c2a6e-0000-4000-8000-000000000001", "rh", body, 1, attrs or {})
    copy = dead_letter_copy(message, "malformed_json", detail, QUEUE_URL, max_bytes)
    assert unsendable(copy.body, copy.attributes, max_bytes) == []
    assert copy.attributes[REASON_ATTR]["StringValue"] == "malformed_json"
    assert copy.attributes[SOURCE_ID_ATTR]["StringValue"] == message.message_id
    assert copy.attributes[SOURCE_QUEUE_ATTR]["StringValue"] == QUEUE_URL
    return copy


QUEUE_URL = "https://sqs.eu-west-1.amazonaws.com/123456789012/fraud-features"


@pytest.mark.parametrize("bad", ["\uffff", "\ufffe", "\x00", "\x08", "\ud800"])
def test_a_detail_or_attribute_sqs_refuses_is_escaped(bad):
    attrs = {"trace": {"DataType": "String", "StringValue": f"t{bad}"}}
    copy = copy_of("{}", attrs, detail=f"bad {bad} character")
    assert copy.attributes[DETAIL_ATTR]["StringValue"].startswith("bad \\u")
    assert copy.attributes["trace"]["StringValue"].startswith("t\\u")


def test_a_copy_that_fits_is_the_original_body_with_every_attribute():
    attrs = {"trace": {"DataType": "String", "StringValue": "abc"}}
    copy = copy_of('{"task_id": "é"}', attrs, detail="d" * 5000)
    assert copy.body == '{"task_id": "é"}'
    assert copy.attributes["trace"] == attrs["trace"]
    assert len(copy.attributes[DETAIL_ATTR]["StringValue"]) == 1000
    assert BODY_TRUNCATED_ATTR not in copy.attributes


def test_a_body_near_the_limit_keeps_its_body_and_trims_detail_and_attributes():
    attrs = {f"a{i}": {"DataType": "String", "StringValue": "v" * 200} for i in range(5)}
    body = "x" * (262_144 - 800)
    copy = copy_of(body, attrs, detail="d" * 5000)
    assert copy.body == body
    assert BODY_TRUNCATED_ATTR not in copy.attributes
    detail = copy.attributes[DETAIL_ATTR]["StringValue"]
    assert 100 <= len(detail) < 1000
    assert 0 < len([k for k in copy.attributes if k.startswith("a")]) < 5


@pytest.mark.parametrize("max_bytes", [1024, 4096, 262_144])
@pytest.mark.parametrize("char", ["x", "é", "\u20ac", "\U0001f600"])
def test_a_body_too_large_for_the_queue_is_cut_and_marked(max_bytes, char):
    body = char * max_bytes
    attrs = {"trace": {"DataType": "String", "StringValue": "abc"}}
    copy = copy_of(body, attrs, detail="d" * 5000, max_bytes=max_bytes)
    size = copy.attributes[BODY_TRUNCATED_ATTR]["StringValue"]
    assert size == str(len(body.encode()))
    assert copy.body and body.startswith(copy.body)
    assert message_bytes(copy.body, copy.attributes) > max_bytes - 8  # cut, not emptied


def test_binary_attributes_count_toward_the_size():
    attrs = {"blob": {"DataType": "Binary", "BinaryValue": b"\x00" * 2000}}
    copy = copy_of("x" * 1500, attrs, max_bytes=4096)
    assert "blob" in copy.attributes
    copy = copy_of("x" * 2500, attrs, max_bytes=4096)
    assert "blob" not in copy.attributes and copy.body == "x" * 2500


# -- next-stage sends in batches ----------------------------------------------------------


class _SendBatches:
    """SendMessageBatch as SQS answers it, with chosen bodies listed under `Failed`."""

    def __init__(self, failing: set[str] = frozenset(), error: Exception | None = None) -> None:
        self.calls: list[list[dict[str, Any]]] = []
        self.failing = failing
        self.error = error

    async def send_message_batch(self, QueueUrl: str, Entries: list[dict[str, Any]]):
        self.calls.append(Entries)
        if self.error is not None:
            raise self.error
        ok = [e for e in Entries if e["MessageBody"] not in self.failing]
        bad = [e for e in Entries if e["MessageBody"] in self.failing]
        return {
            "Successful": [{"Id": e["Id"], "MessageId": "id-" + e["MessageBody"]} for e in ok],
            "Failed": [
                {"Id": e["Id"], "SenderFault": False, "Code": "InternalError", "Message": "no"}
                for e in bad
            ],
        }


async def test_a_send_entry_listed_as_failed_raises_for_that_send_only():
    client = _SendBatches(failing={"b"})
    sender = BatchSender(client, "https://queue")
    results = await asyncio.gather(*(sender.send(b) for b in "abc"), return_exceptions=True)
    assert len(client.calls) == 1  # the three shared one call
    assert results[0] == "id-a" and results[2] == "id-c"
    assert isinstance(results[1], EntryFailed) and results[1].code == "InternalError"
    assert not results[1].sender_fault


async def test_a_failed_send_call_reaches_every_send_in_its_batch():
    lost = TimeoutError("no answer")
    sender = BatchSender(_SendBatches(error=lost), "https://queue")
    results = await asyncio.gather(*(sender.send(b) for b in "abc"), return_exceptions=True)
    assert results == [lost, lost, lost]


async def test_sends_are_split_to_keep_each_batch_within_the_size_sqs_accepts():
    client = _SendBatches()
    sender = BatchSender(client, "https://queue")
    bodies = [str(i) * (SQS_BATCH_MAX_BYTES // 3 + 1) for i in range(5)]  # two fit, not three
    assert await asyncio.gather(*(sender.send(b) for b in bodies)) == ["id-" + b for b in bodies]
    assert [len(c) for c in client.calls] == [2, 2, 1]
    for call in client.calls:
        assert sum(len(e["MessageBody"].encode()) for e in call) <= SQS_BATCH_MAX_BYTES
