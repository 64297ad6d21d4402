"""Stage 1 fed by S3 event notifications: uploads, and a relay of the bucket's events.

The bucket's own notification configuration sends its events (created, removed) to an
events queue: the stand-in writes every event body. Two threads feed stage 1 from there:
- `Uploader` writes the inputs in order, the queues kept shallow (moto's SQS slows as a
  queue deepens), overwriting or deleting those the workload says;
- `Relay` moves the events to stage 1's queue as they came, except that it sends some
  twice (a second delivery, as SQS may make) and merges some into bodies of several
  records (as a relay batching S3's events would). It never sends twice an event whose
  record is refused or contested: each of those must reach the DLQ exactly once.
"""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote_plus

from proving.chaos.workload import BUCKET, ChaosConfig, Upload, Workload
from sqsinfer.lab import stage, standin
from sqsinfer.limits import SQS_BATCH_MAX

_POLL_S = 0.2
_MAX_MERGED = 3  # records in one merged body at most


def events_queue(endpoint: str) -> str:
    """A queue the bucket sends its events to (created and removed under in/)."""
    s3, sqs = standin.clients(endpoint)
    url = str(sqs.create_queue(QueueName="chaos-events")["QueueUrl"])
    arn = stage.queue_arn(sqs, url)
    under_in = {"Key": {"FilterRules": [{"Name": "prefix", "Value": "in/"}]}}
    configuration = {
        "QueueConfigurations": [
            {"QueueArn": arn, "Events": [f"s3:{kind}:*"], "Filter": under_in}
            for kind in ("ObjectCreated", "ObjectRemoved")
        ]
    }
    s3.put_bucket_notification_configuration(Bucket=BUCKET, NotificationConfiguration=configuration)
    return url


@dataclass
class Tally:
    """What the S3 feeding did, for the report."""

    uploads: int = 0
    overwrites: int = 0
    deletes: int = 0
    relayed: int = 0  # bodies sent to stage 1
    sent_twice: int = 0
    merged: int = 0  # bodies of several records sent

    def figures(self) -> dict[str, Any]:
        return {
            "S3 uploads (overwritten, deleted at once)": f"{self.uploads} "
            f"({self.overwrites}, {self.deletes})",
            "event bodies relayed (sent twice, of several records)": f"{self.relayed} "
            f"({self.sent_twice}, {self.merged})",
        }


class _Feeding(threading.Thread):
    """A feeding thread: its `error` for the owner to read, `stop()` to end it early."""

    def __init__(self, name: str) -> None:
        super().__init__(daemon=True, name=name)
        self.error: BaseException | None = None
        self._stopping = threading.Event()

    def run(self) -> None:
        try:
            self.loop()
        except Exception as exc:  # the owner reads it: a thread's exception has no caller
            self.error = exc

    def loop(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=30)


@dataclass
class S3Feed:
    """What the uploader and the relay share."""

    endpoint: str
    work: Workload
    config: ChaosConfig
    tally: Tally
    events_url: str
    stage1_url: str


class Uploader(_Feeding):
    """Writes the workload's inputs while the events queue and stage 1's hold fewer than
    `feed_depth` messages together."""

    def __init__(self, feed: S3Feed) -> None:
        super().__init__("uploader")
        self.feed = feed
        self.s3, self.sqs = standin.clients(feed.endpoint)

    def loop(self) -> None:
        f = self.feed
        pending = list(f.work.uploads)
        while pending and not self._stopping.is_set():
            held = sum(stage.queue_depth(self.sqs, q) for q in (f.events_url, f.stage1_url))
            room = f.config.feed_depth - held
            if room < SQS_BATCH_MAX:
                self._stopping.wait(_POLL_S)
                continue
            for upload in pending[:room]:
                self._upload(upload)
            del pending[:room]

    def _upload(self, upload: Upload) -> None:
        tally = self.feed.tally
        self.s3.put_object(Bucket=BUCKET, Key=upload.key, Body=upload.data)
        if upload.then == "overwrite":
            self.s3.put_object(Bucket=BUCKET, Key=upload.key, Body=upload.data)
            tally.overwrites += 1
        elif upload.then == "delete":
            self.s3.delete_object(Bucket=BUCKET, Key=upload.key)
            tally.deletes += 1
        tally.uploads += 1


@dataclass
class _Batch:
    bodies: list[str] = field(default_factory=list)
    merging: list[Any] = field(default_factory=list)  # records waiting to go out together


class Relay(_Feeding):
    """Moves the bucket's events to stage 1 until the uploader is done and the events
    queue empty."""

    def __init__(self, feed: S3Feed, uploader: Uploader) -> None:
        super().__init__("relay")
        self.feed, self.uploader = feed, uploader
        self.sqs = standin.clients(feed.endpoint)[1]
        self.rng = random.Random(feed.config.seed + 7)

    def loop(self) -> None:
        while not self._stopping.is_set():
            got = self.sqs.receive_message(
                QueueUrl=self.feed.events_url, MaxNumberOfMessages=SQS_BATCH_MAX, WaitTimeSeconds=1
            ).get("Messages", [])
            if not got:
                if not self.uploader.is_alive() and not stage.queue_depth(
                    self.sqs, self.feed.events_url
                ):
                    return
                continue
            self._send(self._relayed([m["Body"] for m in got]))
            entries = [
                {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(got)
            ]
            self.sqs.delete_message_batch(QueueUrl=self.feed.events_url, Entries=entries)

    def _relayed(self, bodies: list[str]) -> list[str]:
        """The bodies to send for these events: as they came, twice, or merged."""
        batch = _Batch()
        for body in bodies:
            doc = json.loads(body)
            records = doc.get("Records") if isinstance(doc, dict) else None
            if not records:  # the test event: as it came
                batch.bodies.append(body)
            elif self.rng.random() < self.feed.config.multi_records:
                batch.merging += records
                if len(batch.merging) >= _MAX_MERGED:
                    self._merge(batch)
            else:
                batch.bodies.append(body)
                if (
                    self._may_repeat(records)
                    and self.rng.random() < self.feed.config.duplicate_rate
                ):
                    batch.bodies.append(body)
                    self.feed.tally.sent_twice += 1
                    self.feed.work.duplicates += 1
        self._merge(batch)
        return batch.bodies

    def _merge(self, batch: _Batch) -> None:
        if batch.merging:
            batch.bodies.append(json.dumps({"Records": batch.merging}))
            self.feed.tally.merged += len(batch.merging) > 1
            batch.merging = []

    def _may_repeat(self, records: list[Any]) -> bool:
        """A second delivery of a new object's event that must end in one output."""
        for record in records:
            key = unquote_plus(record["s3"]["object"]["key"])
            if (
                not record["eventName"].startswith("ObjectCreated")
                or key in self.feed.work.event_dead
            ):
                return False
        return True

    def _send(self, bodies: list[str]) -> None:
        for start in range(0, len(bodies), SQS_BATCH_MAX):
            chunk = bodies[start : start + SQS_BATCH_MAX]
            entries = [{"Id": str(i), "MessageBody": b} for i, b in enumerate(chunk)]
            response = self.sqs.send_message_batch(QueueUrl=self.feed.stage1_url, Entries=entries)
            if response.get("Failed"):
                raise RuntimeError(f"relay: send failed: {response['Failed'][:1]}")
            self.feed.tally.relayed += len(chunk)


def start(
    endpoint: str, work: Workload, config: ChaosConfig, queues: dict[str, str], tally: Tally
) -> list[_Feeding]:
    """The uploader and the relay, started: stage 1 fed from the bucket's events."""
    feed = S3Feed(endpoint, work, config, tally, events_queue(endpoint), queues["stage1"])
    uploader = Uploader(feed)
    relay = Relay(feed, uploader)
    for thread in (uploader, relay):
        thread.start()
    return [uploader, relay]
