"""The stand-in holds to what AWS promises its callers under concurrent calls.

moto alone does not (see `standin.make_atomic`); tests/localstack runs these same tests
against LocalStack.
"""

from __future__ import annotations

import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from sqsinfer.lab import standin

MESSAGES = 300
THREADS = 8


def _queue(sqs: Any) -> str:
    url: str = sqs.create_queue(QueueName=f"q{uuid.uuid4().hex[:10]}")["QueueUrl"]
    for start in range(0, MESSAGES, 10):
        entries = [{"Id": str(i), "MessageBody": f"m{start + i}"} for i in range(10)]
        sqs.send_message_batch(QueueUrl=url, Entries=entries)
    return url


@pytest.fixture
def endpoint(moto: standin.MotoServer) -> str:
    return moto.url


def _clients(endpoint: str) -> list[Any]:
    # A client each: one botocore client shared by threads would share its connections.
    return [standin.clients(endpoint)[1] for _ in range(THREADS)]


def test_concurrent_receives_never_hand_one_message_to_two(endpoint: str):
    sqsc = _clients(endpoint)
    url = _queue(sqsc[0])

    def receive_all(sqs: Any) -> list[str]:
        got: list[str] = []
        while batch := sqs.receive_message(
            QueueUrl=url, MaxNumberOfMessages=10, VisibilityTimeout=300
        ).get("Messages"):
            got += [m["MessageId"] for m in batch]
        return got

    with ThreadPoolExecutor(THREADS) as pool:
        received = [i for got in pool.map(receive_all, sqsc) for i in got]
    handed_twice = [i for i, n in Counter(received).items() if n > 1]
    assert handed_twice == []
    assert len(received) == MESSAGES


def test_concurrent_deletes_bring_no_message_back(endpoint: str):
    sqsc = _clients(endpoint)
    url = _queue(sqsc[0])
    handles: list[str] = []
    while (
        batch := sqsc[0]
        .receive_message(QueueUrl=url, MaxNumberOfMessages=10, VisibilityTimeout=300)
        .get("Messages")
    ):
        handles += [m["ReceiptHandle"] for m in batch]
    assert len(handles) == MESSAGES

    def delete(n: int) -> None:
        for handle in handles[n::THREADS]:
            sqsc[n].delete_message(QueueUrl=url, ReceiptHandle=handle)

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(delete, range(THREADS)))
    attrs = sqsc[0].get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    assert int(attrs["ApproximateNumberOfMessagesNotVisible"]) == 0  # none came back
    assert int(attrs["ApproximateNumberOfMessages"]) == 0


def _bucket(s3: Any) -> str:
    name = f"b{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    return name


def _s3_clients(endpoint: str) -> list[Any]:
    return [standin.clients(endpoint)[0] for _ in range(THREADS)]


def _tries(put: Any) -> list[bool]:
    """Every thread's conditional PUT, all at once: which passed their condition."""

    def one(n: int) -> bool:
        try:
            put(n)
        except Exception as exc:  # botocore's ClientError, a 412
            if "PreconditionFailed" not in str(exc):
                raise
            return False
        return True

    with ThreadPoolExecutor(THREADS) as pool:
        return list(pool.map(one, range(THREADS)))


def test_concurrent_creates_of_one_key_let_one_through(endpoint: str):
    s3c = _s3_clients(endpoint)
    bucket = _bucket(s3c[0])
    for round_ in range(10):
        key = f"out/{round_}.npy"
        body = b"x" * 1_000_000

        def create(n: int, key: str = key, body: bytes = body) -> None:
            s3c[n].put_object(Bucket=bucket, Key=key, Body=body, IfNoneMatch="*")

        assert sum(_tries(create)) == 1, f"round {round_}"


def test_concurrent_compare_and_swaps_of_one_version_let_one_through(endpoint: str):
    s3c = _s3_clients(endpoint)
    bucket = _bucket(s3c[0])
    for round_ in range(10):
        key = f"out/{round_}.chain"
        etag = s3c[0].put_object(Bucket=bucket, Key=key, Body=b"intent")["ETag"]

        def swap(n: int, key: str = key, etag: str = etag) -> None:
            s3c[n].put_object(Bucket=bucket, Key=key, Body=b"sent %d" % n, IfMatch=etag)

        assert sum(_tries(swap)) == 1, f"round {round_}"
