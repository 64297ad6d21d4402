"""The S3 and SQS behaviour the worker relies on, asserted on LocalStack and on moto.

Each test runs against both stand-ins; where they answer differently the expectation is
written per stand-in, so this file is also the record of what moto lets through that
LocalStack (like AWS) refuses.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from sqsinfer.limits import is_group_id

# Characters outside XML 1.0's range (#x9 | #xA | #xD | #x20-#xD7FF | #xE000-#xFFFD |
# #x10000-#x10FFFF), which AWS documents SQS refuses, and some inside it at its edges.
OUTSIDE_XML = ["\uffff", "\ufffe", "\x00", "\x08"]
INSIDE_XML = ["\ufffd", "\U00010000", "\t", "\x7f", "\ue000"]


@dataclass
class Aws:
    name: str
    s3: Any
    sqs: Any
    bucket: str

    @property
    def strict(self) -> bool:
        """LocalStack refuses what AWS refuses; moto lets it through."""
        return self.name == "localstack"

    def queue(self, **attributes: str) -> str:
        name = "q" + uuid.uuid4().hex[:12]
        return str(self.sqs.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"])

    def receive_one(self, url: str, **kw: Any) -> dict[str, Any]:
        got = self.sqs.receive_message(QueueUrl=url, WaitTimeSeconds=1, **kw)["Messages"]
        assert len(got) == 1
        return dict(got[0])

    def counts(self, url: str) -> tuple[int, int]:
        names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
        attrs = self.sqs.get_queue_attributes(QueueUrl=url, AttributeNames=names)["Attributes"]
        return int(attrs[names[0]]), int(attrs[names[1]])


@pytest.fixture(params=["localstack", "moto"])
def aws(request: pytest.FixtureRequest) -> Aws:
    server = request.getfixturevalue(
        "localstack_server" if request.param == "localstack" else "moto"
    )
    kw = {"endpoint_url": server.url, "region_name": "us-east-1"}
    s3, sqs = boto3.client("s3", **kw), boto3.client("sqs", **kw)
    bucket = "sem-" + uuid.uuid4().hex[:12]
    s3.create_bucket(Bucket=bucket)
    return Aws(request.param, s3, sqs, bucket)


def refusal(call: Callable[[], Any]) -> tuple[int, str] | None:
    """(HTTP status, error code) of a refused call; None when the call succeeded."""
    try:
        call()
    except ClientError as exc:
        return exc.response["ResponseMetadata"]["HTTPStatusCode"], exc.response["Error"]["Code"]
    return None


def body(aws: Aws, key: str) -> bytes:
    return bytes(aws.s3.get_object(Bucket=aws.bucket, Key=key)["Body"].read())


# -- S3 ------------------------------------------------------------------------------------


def test_a_second_create_is_refused_with_412_and_the_first_object_stands(aws: Aws):
    def create(data: bytes) -> Any:
        return aws.s3.put_object(Bucket=aws.bucket, Key="out/a.npy", Body=data, IfNoneMatch="*")

    assert refusal(lambda: create(b"first")) is None
    assert refusal(lambda: create(b"second")) == (412, "PreconditionFailed")
    assert body(aws, "out/a.npy") == b"first"  # never 409: neither stand-in answers it


def test_if_none_match_with_an_etag_is_not_implemented_where_moto_overwrites(aws: Aws):
    aws.s3.put_object(Bucket=aws.bucket, Key="k", Body=b"first")
    etag = aws.s3.head_object(Bucket=aws.bucket, Key="k")["ETag"]
    refused = refusal(
        lambda: aws.s3.put_object(Bucket=aws.bucket, Key="k", Body=b"second", IfNoneMatch=etag)
    )
    if aws.strict:
        assert refused == (501, "NotImplemented")
        assert body(aws, "k") == b"first"
    else:
        assert refused is None
        assert body(aws, "k") == b"second"  # a conditional put that overwrites


@pytest.mark.parametrize(
    ("key", "fits"),
    [("a" * 1024, True), ("é" * 512, True), ("a" * 1025, False), ("a" * 1023 + "é", False)],
    ids=["1024-ascii", "1024-bytes-512-chars", "1025-ascii", "1025-bytes-1024-chars"],
)
def test_object_keys_are_limited_to_1024_utf8_bytes(aws: Aws, key: str, fits: bool):
    refused = refusal(lambda: aws.s3.put_object(Bucket=aws.bucket, Key=key, Body=b"x"))
    if fits or not aws.strict:
        assert refused is None  # moto stores keys of any length
        assert body(aws, key) == b"x"
    else:
        assert refused == (400, "KeyTooLongError")


# -- SQS: characters ----------------------------------------------------------------------


def _attribute(value: str) -> dict[str, dict[str, str]]:
    return {"note": {"DataType": "String", "StringValue": value}}


@pytest.mark.parametrize("char", OUTSIDE_XML, ids=lambda c: f"U+{ord(c):04X}")
def test_characters_outside_xml_are_refused_in_bodies_and_attributes(aws: Aws, char: str):
    url = aws.queue()
    in_body = refusal(lambda: aws.sqs.send_message(QueueUrl=url, MessageBody=f"a{char}b"))
    in_attr = refusal(
        lambda: aws.sqs.send_message(
            QueueUrl=url, MessageBody="ab", MessageAttributes=_attribute(f"a{char}b")
        )
    )
    batch = aws.sqs.send_message_batch(
        QueueUrl=url,
        Entries=[{"Id": "bad", "MessageBody": f"a{char}"}, {"Id": "good", "MessageBody": "a"}],
    )
    if aws.strict:
        assert in_body == (400, "InvalidMessageContents")
        assert in_attr == (400, "InvalidParameterValue")
        assert [e["Id"] for e in batch["Successful"]] == ["good"]
        assert [(e["Id"], e["Code"]) for e in batch["Failed"]] == [
            ("bad", "InvalidMessageContents")
        ]
        assert aws.counts(url) == (1, 0)
    else:
        assert in_body is None and in_attr is None
        assert len(batch["Successful"]) == 2
        assert aws.counts(url) == (4, 0)


@pytest.mark.parametrize("char", INSIDE_XML, ids=lambda c: f"U+{ord(c):04X}")
def test_characters_inside_xml_pass_through_unchanged(aws: Aws, char: str):
    url = aws.queue()
    aws.sqs.send_message(QueueUrl=url, MessageBody=f"a{char}b", MessageAttributes=_attribute(char))
    got = aws.receive_one(url, MessageAttributeNames=["All"])
    assert got["Body"] == f"a{char}b"
    assert got["MessageAttributes"]["note"]["StringValue"] == char


# -- SQS: receipt handles and batches -----------------------------------------------------


def _received_twice(aws: Aws) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A message received, lapsed, and received again: (queue, first, second receipt)."""
    url = aws.queue(VisibilityTimeout="1")
    aws.sqs.send_message(QueueUrl=url, MessageBody="x")
    first = aws.receive_one(url)
    time.sleep(1.5)
    second = aws.receive_one(url, VisibilityTimeout=30)
    assert first["MessageId"] == second["MessageId"]
    assert first["ReceiptHandle"] != second["ReceiptHandle"]
    return url, first, second


def test_a_stale_receipt_handle_deletes_the_message_someone_else_holds(aws: Aws):
    """Both stand-ins delete with an older handle (AWS documents the delete may not happen).

    The worker must not count on either: a delivery whose visibility lapsed and which then
    deletes may remove the redelivery's message (which then finds nothing to settle), or
    not (the redelivery finds the output and ends as a duplicate).
    """
    url, first, second = _received_twice(aws)
    assert aws.counts(url) == (0, 1)
    aws.sqs.delete_message(QueueUrl=url, ReceiptHandle=first["ReceiptHandle"])
    assert aws.counts(url) == (0, 0)
    # The current holder's handle no longer moves the message ...
    refused = refusal(
        lambda: aws.sqs.change_message_visibility(
            QueueUrl=url, ReceiptHandle=second["ReceiptHandle"], VisibilityTimeout=0
        )
    )
    assert refused == (400, "InvalidParameterValue" if aws.strict else "ReceiptHandleIsInvalid")
    # ... but deleting with it again succeeds: a repeated delete is harmless.
    again = aws.sqs.delete_message_batch(
        QueueUrl=url, Entries=[{"Id": "0", "ReceiptHandle": second["ReceiptHandle"]}]
    )
    assert [e["Id"] for e in again["Successful"]] == ["0"]
    assert again.get("Failed", []) == []


def _batch_on_three_handles(aws: Aws, operation: str, **extra: Any) -> tuple[str, Any]:
    """One batch call on a held message ("live"), a deleted one ("gone") and junk."""
    url = aws.queue(VisibilityTimeout="30")
    for text in ("a", "b"):
        aws.sqs.send_message(QueueUrl=url, MessageBody=text)
    held: list[str] = []
    while len(held) < 2:
        got = aws.sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=2, WaitTimeSeconds=1)
        held += [m["ReceiptHandle"] for m in got.get("Messages", [])]
    aws.sqs.delete_message(QueueUrl=url, ReceiptHandle=held[1])
    handles = {"live": held[0], "gone": held[1], "junk": "not-a-receipt-handle"}
    entries = [{"Id": name, "ReceiptHandle": h, **extra} for name, h in handles.items()]
    return url, getattr(aws.sqs, operation)(QueueUrl=url, Entries=entries)


def _failures(response: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    return {e["Id"]: (e["Code"], e["SenderFault"]) for e in response.get("Failed", [])}


def test_delete_batch_reports_each_entry_on_its_own(aws: Aws):
    url, response = _batch_on_three_handles(aws, "delete_message_batch")
    # A deleted message's handle deletes again without complaint; only junk fails.
    # LocalStack marks that failure SenderFault false, moto true.
    assert sorted(e["Id"] for e in response["Successful"]) == ["gone", "live"]
    assert _failures(response) == {"junk": ("ReceiptHandleIsInvalid", not aws.strict)}
    assert aws.counts(url) == (0, 0)


def test_change_visibility_batch_reports_each_entry_on_its_own(aws: Aws):
    url, response = _batch_on_three_handles(
        aws, "change_message_visibility_batch", VisibilityTimeout=0
    )
    assert [e["Id"] for e in response["Successful"]] == ["live"]
    if aws.strict:
        gone = ("InvalidParameterValueException", False)
    else:
        gone = ("ReceiptHandleIsInvalid", True)
    assert _failures(response) == {
        "gone": gone,
        "junk": ("ReceiptHandleIsInvalid", not aws.strict),
    }
    assert aws.counts(url) == (1, 0)  # the live one is visible again


def test_redrive_moves_a_message_to_the_dlq_after_max_receive_count(aws: Aws):
    dlq = aws.queue()
    arn = aws.sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]
    policy = {"deadLetterTargetArn": arn["QueueArn"], "maxReceiveCount": "2"}
    url = aws.queue(RedrivePolicy=json.dumps(policy))
    aws.sqs.send_message(QueueUrl=url, MessageBody="poison")
    counts = []
    for _ in range(3):
        got = aws.sqs.receive_message(
            QueueUrl=url,
            VisibilityTimeout=0,
            WaitTimeSeconds=0,
            MessageSystemAttributeNames=["ApproximateReceiveCount"],
        ).get("Messages", [])
        counts += [int(m["Attributes"]["ApproximateReceiveCount"]) for m in got]
    assert counts == [1, 2]  # the third receive finds it gone
    assert aws.counts(url) == (0, 0)
    moved = aws.receive_one(dlq, MessageSystemAttributeNames=["All"])
    assert moved["Body"] == "poison"
    # LocalStack names the source queue as AWS does; moto leaves the attribute out.
    source = moved["Attributes"].get("DeadLetterQueueSourceArn")
    assert source == (_arn(aws, url) if aws.strict else None)


def _arn(aws: Aws, url: str) -> str:
    attrs = aws.sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])
    return str(attrs["Attributes"]["QueueArn"])


# -- SQS: fair queues ----------------------------------------------------------------------
PUNCTUATION = """!"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"""  # all SQS allows in a group id


def test_a_standard_queue_keeps_a_message_group_id(aws: Aws):
    """A fair queue is a standard queue whose producers set MessageGroupId: the receive
    hands it back as a system attribute (`sqsinfer enqueue --group-field`, the worker's
    log, a redrive all rely on it). Neither stand-in serves the groups fairly: that is
    AWS's scheduling, not a contract a stand-in can show."""
    url = aws.queue()
    sent_groups = {"a": "tenant-a", "b": PUNCTUATION, "c": None, "d": "x" * 128}
    entries = [
        {"Id": body, "MessageBody": body, **({"MessageGroupId": g} if g else {})}
        for body, g in sent_groups.items()
    ]
    assert len(aws.sqs.send_message_batch(QueueUrl=url, Entries=entries)["Successful"]) == 4
    groups: dict[str, str | None] = {}
    for _ in range(10):  # a standard queue's receive may bring a part of what it holds
        got = aws.sqs.receive_message(
            QueueUrl=url,
            MaxNumberOfMessages=10,
            WaitTimeSeconds=1,
            VisibilityTimeout=60,
            MessageSystemAttributeNames=["All"],
        ).get("Messages", [])
        groups |= {m["Body"]: m.get("Attributes", {}).get("MessageGroupId") for m in got}
        if len(groups) == len(sent_groups):
            break
    assert groups == sent_groups
    assert all(is_group_id(g) for g in sent_groups.values() if g is not None)


@pytest.mark.parametrize(
    "group", ["x" * 129, "café", "a b", ""], ids=["129", "accent", "space", "empty"]
)
def test_a_group_id_sqs_refuses_is_refused_where_moto_keeps_it(aws: Aws, group: str):
    """The rule `sqsinfer enqueue --group-field` holds a task to before sending
    (limits.is_group_id) is LocalStack's, as AWS documents it; moto stores anything."""
    assert not is_group_id(group)
    url = aws.queue()
    refused = refusal(
        lambda: aws.sqs.send_message(QueueUrl=url, MessageBody="a", MessageGroupId=group)
    )
    if aws.strict:
        assert refused == (400, "InvalidParameterValue")
    else:
        assert refused is None
