"""A producer: put one task message per input object on a stage's queue, with boto3.

    python -m examples.producer QUEUE_URL s3://features/2026-11-01/ s3://scores/2026-11-01/

For large batches, `sqsinfer enqueue` does the same with validation, progress and
retries; this is what it amounts to.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import boto3


def task_messages(s3: Any, input_prefix: str, output_prefix: str) -> Iterator[dict[str, str]]:
    """One task per object under the input prefix; its output keeps the object's name."""
    bucket, _, prefix = input_prefix.removeprefix("s3://").partition("/")
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            key = item["Key"]
            name = key[len(prefix) :].rsplit(".", 1)[0]
            yield {
                "task_id": name,  # decides nothing here: the output is given
                "input": f"s3://{bucket}/{key}",
                "output": f"{output_prefix.rstrip('/')}/{name}.npy",
            }


def send_all(sqs: Any, queue_url: str, messages: Iterator[dict[str, str]]) -> int:
    """SendMessageBatch in tens; entries SQS reports as failed are sent again."""
    sent = 0
    batch: list[dict[str, str]] = []
    for message in messages:
        batch.append(message)
        if len(batch) == 10:
            sent += _send_batch(sqs, queue_url, batch)
            batch = []
    if batch:
        sent += _send_batch(sqs, queue_url, batch)
    return sent


def _send_batch(sqs: Any, queue_url: str, batch: list[dict[str, str]]) -> int:
    entries = [{"Id": str(i), "MessageBody": json.dumps(m)} for i, m in enumerate(batch)]
    for _ in range(5):
        failed = sqs.send_message_batch(QueueUrl=queue_url, Entries=entries).get("Failed", [])
        if not failed:
            return len(batch)
        retry = {f["Id"] for f in failed}
        entries = [e for e in entries if e["Id"] in retry]
    raise RuntimeError(f"{len(entries)} messages could not be sent")


if __name__ == "__main__":
    url, inputs, outputs = sys.argv[1:4]
    count = send_all(boto3.client("sqs"), url, task_messages(boto3.client("s3"), inputs, outputs))
    print(f"sent {count} tasks")
