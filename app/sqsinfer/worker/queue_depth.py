"""The depth of the stage's queue and its dead-letter queue, sampled for /metrics.

Every `queue_sample_s` the worker asks SQS for each queue's approximate counts (one
GetQueueAttributes a queue) and shows them as sqsinfer_queue_messages{queue, state}. The
alerts on dead letters piling up need the DLQ's depth, which neither the worker's own
counts (SQS's redrive moves messages there unseen) nor KEDA (it reads the source queue
only) give; an exporter of CloudWatch's SQS metrics would, as another component with its
own IAM role and minutes of delay. A call a queue a minute per pod is cheap beside the
calls each task makes: docs/operating.md has the figures.

A queue that cannot be read shows no counts until it can (a stale one would keep an
alert firing, or silent); the failure is logged once, and counted with the other AWS
errors (sqsinfer_aws_errors_total{operation="GetQueueAttributes"}).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from sqsinfer.aws.sqs import depth
from sqsinfer.logs import Event
from sqsinfer.metrics import Metrics

log = logging.getLogger("sqsinfer.worker")

SOURCE = "source"
DEAD_LETTER = "dead_letter"
# What each sample reads: one GetQueueAttributes a queue (`sqsinfer plan` counts them).
SAMPLED = (SOURCE, DEAD_LETTER)


class QueueDepth:
    def __init__(
        self, sqs: Any, queues: dict[str, str], metrics: Metrics, interval_s: float
    ) -> None:
        self.sqs = sqs
        self.queues = queues  # {SOURCE: url, DEAD_LETTER: url}
        self.metrics = metrics
        self.interval_s = interval_s
        self._unknown: set[str] = set()  # queues whose last sample failed

    async def run(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self.interval_s)

    async def sample(self) -> None:
        await asyncio.gather(*(self._one(role, url) for role, url in self.queues.items()))

    async def _one(self, role: str, url: str) -> None:
        try:
            counts = await depth(self.sqs, url)
        except (ClientError, BotoCoreError, OSError, TimeoutError) as exc:
            self.metrics.queue_depth(role, None)
            if role not in self._unknown:
                self._unknown.add(role)
                log.warning(
                    Event.QUEUE_DEPTH_UNKNOWN, extra={"queue": url, "role": role, "error": str(exc)}
                )
            return
        self.metrics.queue_depth(role, counts)
        if role in self._unknown:
            self._unknown.discard(role)
            log.info(Event.QUEUE_DEPTH_KNOWN, extra={"queue": url, "role": role})
