"""S3 event notifications as tasks on LocalStack: the same end-to-end tests as on moto
(tests/worker/test_s3_events.py), each run here against LocalStack's own S3, SQS, SNS and
EventBridge through this directory's `stage` fixture.

One difference is LocalStack's, not AWS's: its EventBridge events carry the key
URL-encoded, as its S3 → SQS records do, where AWS (and moto) give EventBridge's key as it
is. So the EventBridge test here uses keys that encoding leaves alone; the keys with
spaces, `+`, `=` and letters beyond ASCII go through S3 → SQS and SNS here, as on moto.
"""

from __future__ import annotations

from tests.conftest import Stage
from tests.worker import test_s3_events as on_moto
from tests.worker.test_s3_events import (
    test_each_record_of_a_body_ends_alone_and_the_message_once_all_have,
    test_s3_sends_its_events_to_the_queue_and_each_is_scored_once,
    test_sns_delivers_them_wrapped_or_raw,
)

__all__ = [
    "test_each_record_of_a_body_ends_alone_and_the_message_once_all_have",
    "test_s3_sends_its_events_to_the_queue_and_each_is_scored_once",
    "test_sns_delivers_them_wrapped_or_raw",
]

# Keys that LocalStack's URL-encoding of EventBridge keys leaves as they are.
PLAIN = {
    "in/a-b.npy": "out/a-b.npy",
    "in/c_d.json": "out/c_d.npy",
    "in/x/y/z.jsonl": "out/x/y/z.npy",
}


async def test_eventbridge_delivers_them(stage: Stage, make_settings):
    metadata = await on_moto.through_eventbridge(stage, make_settings, PLAIN)
    assert [m["task-id"] for m in metadata] == ["a-b", "c_d", "x/y/z"]
