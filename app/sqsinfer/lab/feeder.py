"""The producer of the proving ground: sends task messages in batches, at a pace.

moto's SQS rescans a queue on every call and slows as the queue deepens, so nothing here
enqueues a whole workload at once: the feeder sends what the pace allows and no more.
The paces in use:
- `Backlog`: counted, never asked of the queue (the benchmarks: no polling cost inside
  the measured window), at most at a rate when one is given;
- `keep_depth`: the queue's own depth, polled (chaos: several workers, kills, retries);
- `at_rate`: a steady number of tasks a second (the soak);
- everything at once, for a few hundred messages (the demo).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from sqsinfer.lab import stage
from sqsinfer.limits import SQS_BATCH_MAX

MAX_VISIBLE = 100  # the counted backlog never lets more than this wait in the queue


@dataclass
class Feeder:
    """Sends the bodies `body(0)`, `body(1)`, ... to one queue, up to `total` (None: endless)."""

    sqs: Any
    queue_url: str
    body: Callable[[int], str]
    total: int | None = None
    sent: int = 0
    calls: int = 0

    @property
    def done(self) -> bool:
        return self.total is not None and self.sent >= self.total

    def top_up(self, room: int) -> int:
        """Send up to `room` more messages, ten to a call; return how many went."""
        before = self.sent
        while room > 0 and not self.done:
            count = min(SQS_BATCH_MAX, room)
            if self.total is not None:
                count = min(count, self.total - self.sent)
            entries = [
                {"Id": str(i), "MessageBody": self.body(self.sent + i)} for i in range(count)
            ]
            response = self.sqs.send_message_batch(QueueUrl=self.queue_url, Entries=entries)
            self.calls += 1
            if response.get("Failed"):
                raise RuntimeError(f"feeder: send failed: {response['Failed'][:1]}")
            self.sent += count
            room -= count
        return self.sent - before


def listed(bodies: Sequence[str]) -> Callable[[int], str]:
    """The bodies of a prepared workload, in order."""
    return bodies.__getitem__


def cycling(prefix: str, input_uris: Sequence[str]) -> Callable[[int], str]:
    """Task `{prefix}-000042` and so on, each reading the next input of a cycle."""

    def body(seq: int) -> str:
        doc = {"task_id": f"{prefix}-{seq:06d}", "input": input_uris[seq % len(input_uris)]}
        return orjson.dumps(doc).decode()

    return body


@dataclass
class Backlog:
    """Feeds by counting instead of asking the queue: messages sent minus tasks finished is
    what is in the queue or held by the consumer. At most `depth` wait beyond what the
    consumer holds (`in_flight`), never more than MAX_VISIBLE in all; whole batches only."""

    feeder: Feeder
    depth: int
    in_flight: int

    def __post_init__(self) -> None:
        self.depth = max(SQS_BATCH_MAX, min(self.depth, MAX_VISIBLE - self.in_flight))

    per_s: float = 0.0  # also at most this many a second from the first top-up (0: no limit)
    started: float | None = None

    def top_up(self, finished: int) -> int:
        free = self.depth + self.in_flight - (self.feeder.sent - finished)
        if self.per_s > 0:
            # A consumer faster than the rate waits for work: its cost per task is then
            # taken at one throughput, whatever else the machine does meanwhile.
            now = time.monotonic()
            self.started = now if self.started is None else self.started
            due = int(self.per_s * (now - self.started)) + SQS_BATCH_MAX - self.feeder.sent
            free = min(free, due)
        return self.feeder.top_up(max(0, free - free % SQS_BATCH_MAX))


Pace = Callable[[Feeder], int]  # how many more messages may go now


def keep_depth(sqs: Any, queue_url: str, depth: int) -> Pace:
    """Room up to `depth` messages in the queue (visible, in flight and delayed)."""
    return lambda feeder: max(0, depth - stage.queue_depth(sqs, queue_url))


def at_rate(per_s: float) -> Pace:
    """Room for `per_s` messages a second since the first call, whatever the consumer does."""
    started: list[float] = []

    def pace(feeder: Feeder) -> int:
        if not started:
            started.append(time.monotonic())
        return int(per_s * (time.monotonic() - started[0])) + 1 - feeder.sent

    return pace


class FeedThread(threading.Thread):
    """Feeds in the background at a pace until the feeder is done or `stop()` is called."""

    def __init__(self, feeder: Feeder, pace: Pace, poll_s: float = 0.2) -> None:
        super().__init__(daemon=True, name="feeder")
        self.feeder, self.pace, self.poll_s = feeder, pace, poll_s
        self.error: BaseException | None = None
        self._stopping = threading.Event()

    def run(self) -> None:
        try:
            while not self.feeder.done and not self._stopping.is_set():
                if self.feeder.top_up(self.pace(self.feeder)) == 0:
                    self._stopping.wait(self.poll_s)
        except Exception as exc:  # the owner reads it: a thread's exception has no caller
            self.error = exc

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=30)
