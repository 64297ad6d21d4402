"""The bench's side of the local stand-in: a fresh bucket and queue for each scenario.

Each scenario gets its own bucket, queue and dead-letter queue, so nothing one scenario
left behind (objects, messages, moto's per-queue state) slows the next. The producer is
the proving ground's feeder with a counted backlog (`sqsinfer.lab.feeder.Backlog`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from sqsinfer.lab import stage


@dataclass
class Resources:
    bucket: str
    queue_url: str
    dlq_url: str
    inputs: list[str]  # s3:// URIs of the input files


def create_resources(s3: Any, sqs: Any, inputs: list[bytes]) -> Resources:
    """A bucket with the inputs under in/, a queue and its dead-letter queue."""
    name = stage.create_bucket(s3, "bench-" + uuid.uuid4().hex[:12])
    uris = stage.put_objects(
        s3, name, {f"in/{index}.npy": body for index, body in enumerate(inputs)}, threads=4
    )
    queue = stage.create_queue(sqs, name, attributes={"VisibilityTimeout": "60"})
    return Resources(name, queue.url, queue.dlq_url, uris)
