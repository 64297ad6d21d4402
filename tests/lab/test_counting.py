"""The stand-in counts the requests it serves, by port, service, operation and target."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from sqsinfer.lab import counting, standin


@pytest.fixture(scope="module")
def two_ports() -> Iterator[standin.MotoServer]:
    with standin.moto_server(more_endpoints=1) as server:
        yield server


def _served(server: standin.MotoServer, before: dict[counting.Kind, counting.Counted]) -> dict:
    return {
        (k.port, k.service, k.operation, k.target): (v.requests, v.chunks)
        for k, v in counting.difference(before, server.request_counts()).items()
    }


def test_each_port_counts_its_own_clients_requests(two_ports: standin.MotoServer):
    main_s3, main_sqs = standin.clients(two_ports.url)
    s3, sqs = standin.clients(two_ports.endpoints[0])
    bucket = f"b-{uuid.uuid4().hex[:10]}"
    main_s3.create_bucket(Bucket=bucket)
    standard = main_sqs.create_queue(QueueName=f"q{uuid.uuid4().hex[:8]}")["QueueUrl"]
    fifo = main_sqs.create_queue(
        QueueName=f"q{uuid.uuid4().hex[:8]}.fifo", Attributes={"FifoQueue": "true"}
    )["QueueUrl"]
    before = two_ports.request_counts()

    s3.put_object(Bucket=bucket, Key="stage1/t.npy", Body=b"x")
    s3.put_object(Bucket=bucket, Key="stage1/t.npy.chain", Body=b"{}")
    s3.put_object(Bucket=bucket, Key="stage1/t.npy.chain", Body=b"{}")
    s3.head_object(Bucket=bucket, Key="stage1/t.npy.chain")
    s3.get_object(Bucket=bucket, Key="stage1/t.npy")
    sqs.send_message(QueueUrl=standard, MessageBody="y" * (70 * 1024))  # two 64 KiB chunks
    sqs.send_message(QueueUrl=fifo, MessageBody="z", MessageGroupId="g", MessageDeduplicationId="d")
    main_s3.head_object(Bucket=bucket, Key="stage1/t.npy")  # the other port's
    served = _served(two_ports, before)

    port = int(two_ports.endpoints[0].rsplit(":", 1)[1])
    main = int(two_ports.url.rsplit(":", 1)[1])
    assert served == {
        (port, "s3", "PutObject", ".npy"): (1, 1),
        (port, "s3", "PutObject", ".chain"): (2, 2),
        (port, "s3", "HeadObject", ".chain"): (1, 1),
        (port, "s3", "GetObject", ".npy"): (1, 1),
        (port, "sqs", "SendMessage", "standard"): (1, 2),
        (port, "sqs", "SendMessage", "fifo"): (1, 1),
        (main, "s3", "HeadObject", ".npy"): (1, 1),
    }


def test_query_protocol_requests_are_classified_too():
    environ = {
        "PATH_INFO": "/",
        "REQUEST_METHOD": "POST",
        "SERVER_PORT": "4566",
        "HTTP_AUTHORIZATION": "AWS4-HMAC-SHA256 Credential=AK/20260101/us-east-1/sqs/"
        "aws4_request, SignedHeaders=host, Signature=00",
    }
    body = b"Action=DeleteMessageBatch&QueueUrl=http%3A%2F%2Fh%2F1%2Fq.fifo"
    assert counting.classify(environ, body) == counting.Kind(
        4566, "sqs", "DeleteMessageBatch", "fifo"
    )
    assert counting.classify({"PATH_INFO": "/moto-api/reset"}, b"") is None
