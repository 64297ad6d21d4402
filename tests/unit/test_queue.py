"""Batching of deletes and visibility changes: each entry learns its own fate."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sqsinfer.queue import Batcher, Message, SqsQueue, dead_letter_attributes


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
    from sqsinfer.aws import open_clients

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
