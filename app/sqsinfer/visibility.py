"""The visibility keeper: one background task that keeps in-flight messages invisible.

Every `heartbeat_s` it extends, in batches of ten, each held message whose visibility
would lapse before the tick after next, so a short task costs no extra calls and a
long one is never handed to another consumer. A message held longer than
`max_task_time_s` is no longer extended: its task is abandoned (and retried).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from sqsinfer.metrics import Metrics
from sqsinfer.queue import Message, SqsQueue

log = logging.getLogger("sqsinfer.visibility")


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
        self._deadlines: dict[Message, float] = {}

    def add(self, message: Message) -> None:
        self._deadlines[message] = message.received_at + self.visibility_timeout_s

    def discard(self, message: Message) -> None:
        self._deadlines.pop(message, None)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self.tick()
            except Exception:  # the next tick tries again; a lapse only means a redelivery
                log.exception("visibility extension failed")

    async def tick(self) -> None:
        now = time.monotonic()
        for message in [m for m in self._deadlines if now - m.received_at >= self.max_task_time_s]:
            self.discard(message)
            log.warning("task over max time, abandoning message_id=%s", message.message_id)
            self.on_expired(message)
        due = [
            m for m, deadline in self._deadlines.items() if deadline < now + 2 * self.heartbeat_s
        ]
        if not due:
            return
        results = await self.queue.change_visibility_many(due, self.visibility_timeout_s)
        extended = 0
        for message, ok in zip(due, results, strict=True):
            if ok and message in self._deadlines:
                self._deadlines[message] = now + self.visibility_timeout_s
                extended += 1
            elif not ok:
                log.warning("could not extend visibility message_id=%s", message.message_id)
        self.metrics.visibility_extensions.inc(extended)
