"""The visibility keeper: one background task that keeps in-flight messages invisible.

Every `heartbeat_s` a tick extends each held message whose visibility would lapse
before the tick after next, so a short task costs no extra calls and a long one is
never handed to another consumer. Settings keep the heartbeat at most a third of the
visibility timeout, so a message is due with at least one heartbeat left before it
lapses: that margin is what its extension has to land in.

Ticks keep to a fixed schedule (`heartbeat_s` apart from the keeper's start, never
drifting with the event loop), and each judges what is due by its scheduled time. So the
cadence is a property of the settings, not of timing noise: an extension made at a tick
holds the message `visibility_timeout_s` from a moment at or after that tick, and it is
due again `extension_every_ticks` ticks later, always. (Judged by the moment a tick
happened to run, a visibility of exactly three heartbeats flipped between an extension
every heartbeat and one every other heartbeat on microseconds of jitter.) `sqsinfer
plan` counts the calls with the same rules (`expected_extensions`).

A slow call must not cost other messages their hold, so:
- ticks start on schedule, never waiting for an earlier tick's calls;
- a tick's due messages go out in batches of ten, all at once, earliest lapse first;
- each call is given up after half the time left before the earliest lapse in its
  batch, and what failed is tried again within the tick while time is left;
- a message with an extension under way is not sent again by the next tick.

A settled message (deleted or handed back) leaves the keeper: the queue marks it when
the settle is asked for, before the settle call is sent, and no tick includes it from
then on. A message held longer than `max_task_time_s` is no longer extended: its task
is abandoned (and retried).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from sqsinfer.aws.sqs import Extension, Message, SqsQueue
from sqsinfer.backoff import Backoff
from sqsinfer.limits import SQS_BATCH_MAX
from sqsinfer.logs import Event
from sqsinfer.metrics import Metrics

log = logging.getLogger("sqsinfer.visibility")

# A call gets at least this long (or all the time left, when less): any shorter and
# a healthy but loaded endpoint would see every call given up on.
_MIN_CALL_S = 1.0
# Between tries of entries that failed fast (throttling, a 5xx), within one tick.
_RETRY_BACKOFF = Backoff(base_s=0.1, max_s=1.0)
# Float slack when the first extension's age is a whole number of heartbeats.
_EPSILON = 1e-9


def due(hold_until: float, tick_at: float, heartbeat_s: float) -> bool:
    """Whether a message held until `hold_until` is extended by the tick scheduled at
    `tick_at`: its visibility would lapse before the tick after next."""
    return hold_until < tick_at + 2 * heartbeat_s


def extension_every_ticks(visibility_timeout_s: float, heartbeat_s: float) -> int:
    """Ticks from one extension of a message to its next. An extension at a tick holds
    the message from a moment at or after that tick (SQS counts from its call), so by
    `due` it is due again at the first tick more than `visibility − 2 × heartbeat` later:
    every other tick with the defaults (60 s, 20 s), not every tick."""
    first_s = visibility_timeout_s - 2 * heartbeat_s
    return math.floor(first_s / heartbeat_s + _EPSILON) + 1


def expected_extensions(hold_s: float, visibility_timeout_s: float, heartbeat_s: float) -> float:
    """Extensions of a message held `hold_s` from its receive to its settle, on average
    over where the keeper's ticks fall in its hold.

    The first is made by the first tick after the message has been held `visibility −
    2 × heartbeat` (so at an age spread evenly over the heartbeat after that), the next
    every `extension_every_ticks` ticks, each made only while the message is still held:
    the mean, over that first age a, of the count of a + k × every below `hold_s`.
    """
    first_s = visibility_timeout_s - 2 * heartbeat_s
    every_s = heartbeat_s * extension_every_ticks(visibility_timeout_s, heartbeat_s)

    def area(x: float) -> float:  # ∫_0^x ceil(u / every) du: extensions summed over ages
        if x <= 0:
            return 0.0
        n = math.floor(x / every_s)
        return every_s * n * (n + 1) / 2 + (n + 1) * (x - n * every_s)

    return (area(hold_s - first_s) - area(hold_s - first_s - heartbeat_s)) / heartbeat_s


class VisibilityKeeper:
    def __init__(
        self,
        queue: SqsQueue,
        *,
        visibility_timeout_s: int,
        heartbeat_s: float,
        max_task_time_s: float,
        metrics: Metrics,
        on_expired: Callable[[Message], None],
    ) -> None:
        self.queue = queue
        self.visibility_timeout_s = visibility_timeout_s
        self.heartbeat_s = heartbeat_s
        self.max_task_time_s = max_task_time_s
        self.metrics = metrics
        self.on_expired = on_expired
        # The messages it keeps; each one's deadline is its `hold_until`.
        self._kept: set[Message] = set()
        self._extending: set[Message] = set()
        self._ticks: set[asyncio.Task[None]] = set()

    def add(self, message: Message) -> None:
        message.hold_until = message.received_at + self.visibility_timeout_s
        self._kept.add(message)

    def discard(self, message: Message) -> None:
        self._kept.discard(message)

    async def run(self) -> None:
        next_at = time.monotonic()
        try:
            while True:
                # On schedule: a late tick does not push the ones after it (see above).
                next_at += self.heartbeat_s
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                tick = asyncio.get_running_loop().create_task(self.tick(next_at))
                self._ticks.add(tick)
                tick.add_done_callback(self._tick_done)
        finally:
            for tick in self._ticks:
                tick.cancel()
            await asyncio.gather(*self._ticks, return_exceptions=True)

    def _tick_done(self, tick: asyncio.Task[None]) -> None:
        self._ticks.discard(tick)
        if not tick.cancelled() and tick.exception() is not None:
            # The next tick tries again; a lapse only means a redelivery.
            log.error(Event.VISIBILITY_TICK_FAILED, exc_info=tick.exception())

    async def tick(self, scheduled_at: float | None = None) -> None:
        """Extend what is due at the tick scheduled at `scheduled_at` (default: now)."""
        now = time.monotonic()
        at = now if scheduled_at is None else min(scheduled_at, now)
        for message in [m for m in self._kept if m.settled]:
            self.discard(message)
        for message in [m for m in self._kept if now - m.received_at >= self.max_task_time_s]:
            self.discard(message)
            log.warning(Event.TASK_OVER_MAX_TIME, extra={"message_id": message.message_id})
            self.on_expired(message)
        ready = sorted(
            (
                m
                for m in self._kept
                if due(m.hold_until, at, self.heartbeat_s) and m not in self._extending
            ),
            key=lambda m: m.hold_until,
        )
        batches = [ready[i : i + SQS_BATCH_MAX] for i in range(0, len(ready), SQS_BATCH_MAX)]
        await asyncio.gather(*(self._keep(batch) for batch in batches))

    async def _keep(self, batch: list[Message]) -> None:
        """Extend one batch, trying again what failed while there is time before a lapse."""
        self._extending.update(batch)
        try:
            pending, attempt = batch, 0
            while pending := self._held(pending):
                left_s = self._left_s(pending)
                started = time.monotonic()
                results = await self.queue.extend(
                    pending, self.visibility_timeout_s, timeout_s=max(left_s / 2, _MIN_CALL_S)
                )
                pending = self._record(results, started)
                left_s = self._left_s(self._held(pending))
                if left_s <= _MIN_CALL_S:
                    break
                await asyncio.sleep(min(_RETRY_BACKOFF.delay_s(attempt), left_s / 4))
                attempt += 1
            for message in self._held(pending):
                log.warning(Event.VISIBILITY_NOT_EXTENDED, extra={"message_id": message.message_id})
        finally:
            self._extending.difference_update(batch)

    def _held(self, messages: list[Message]) -> list[Message]:
        return [m for m in messages if m in self._kept and not m.settled]

    def _left_s(self, messages: list[Message]) -> float:
        """Seconds until the first of these messages lapses (0 when there are none)."""
        if not messages:
            return 0.0
        return min(m.hold_until for m in messages) - time.monotonic()

    def _record(self, results: dict[Message, Extension], started: float) -> list[Message]:
        """Note new deadlines; returns the messages worth another try."""
        extended = 0
        retry: list[Message] = []
        for message, result in results.items():
            if result == Extension.EXTENDED and message in self._kept:
                # SQS counts from when it handled the call, which is after it was sent.
                message.hold_until = started + self.visibility_timeout_s
                extended += 1
            elif result == Extension.RETRY:
                retry.append(message)
            elif result == Extension.REFUSED:
                log.warning(
                    Event.VISIBILITY_EXTENSION_REFUSED, extra={"message_id": message.message_id}
                )
        self.metrics.visibility_extensions.inc(extended)
        return retry
