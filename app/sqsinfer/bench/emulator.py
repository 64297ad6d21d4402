"""The bench's side of the local stand-in: fresh queues and buckets, and the feeder.

Each scenario gets its own bucket, queue and dead-letter queue, so nothing one scenario
left behind (objects, messages, moto's per-queue state) slows the next. The feeder is
the producer: it keeps the queue shallow, because every moto SQS call rescans the
queue and slows as it deepens.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import orjson

SQS_BATCH = 10
MAX_VISIBLE = 100  # the feeder never lets more than this wait in the queue


@dataclass
class Resources:
    bucket: str
    queue_url: str
    dlq_url: str
    inputs: list[str]  # s3:// URIs of the input files


def clients(endpoint: str, region: str) -> tuple[Any, Any]:
    import boto3

    kw = {"endpoint_url": endpoint, "region_name": region}
    return boto3.client("s3", **kw), boto3.client("sqs", **kw)


def create_resources(s3: Any, sqs: Any, inputs: list[bytes]) -> Resources:
    """A bucket with the inputs under in/, a queue and its dead-letter queue."""
    name = "bench-" + uuid.uuid4().hex[:12]
    s3.create_bucket(Bucket=name)

    def put(item: tuple[int, bytes]) -> str:
        index, body = item
        s3.put_object(Bucket=name, Key=f"in/{index}.npy", Body=body)
        return f"s3://{name}/in/{index}.npy"

    with ThreadPoolExecutor(4) as pool:
        uris = list(pool.map(put, enumerate(inputs)))
    dlq = sqs.create_queue(QueueName=name + "-dlq")["QueueUrl"]
    queue = sqs.create_queue(QueueName=name, Attributes={"VisibilityTimeout": "60"})["QueueUrl"]
    return Resources(name, queue, dlq, uris)


@dataclass
class Feeder:
    """Sends task messages so that at most `depth` wait beyond what the consumer holds.

    It counts instead of asking the queue: messages sent minus tasks finished is what is
    in the queue or held by the consumer, so the queue itself is never polled for depth.
    """

    sqs: Any
    resources: Resources
    prefix: str
    depth: int
    in_flight: int
    sent: int = 0
    calls: int = 0
    _bodies: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Sent but unfinished never exceeds MAX_VISIBLE, whatever the consumer holds.
        self.depth = max(SQS_BATCH, min(self.depth, MAX_VISIBLE - self.in_flight))

    def body(self, seq: int) -> str:
        uris = self.resources.inputs
        doc = {"task_id": f"{self.prefix}-{seq:06d}", "input": uris[seq % len(uris)]}
        return orjson.dumps(doc).decode()

    def top_up(self, finished: int) -> None:
        """Send whole batches while the backlog is below the target."""
        while self.sent - finished + SQS_BATCH <= self.depth + self.in_flight:
            entries = [
                {"Id": str(i), "MessageBody": self.body(self.sent + i)} for i in range(SQS_BATCH)
            ]
            response = self.sqs.send_message_batch(
                QueueUrl=self.resources.queue_url, Entries=entries
            )
            self.calls += 1
            if response.get("Failed"):
                raise RuntimeError(f"feeder: send failed: {response['Failed'][:1]}")
            self.sent += SQS_BATCH
