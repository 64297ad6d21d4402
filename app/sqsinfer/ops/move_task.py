"""`sqsinfer redrive --server-side`: SQS's own message move task empties a dead-letter
queue into one queue, with no client holding a message.

    StartMessageMoveTask (the DLQ → the destination, at most --max-per-second)
      └─ ListMessageMoveTasks every few seconds: moved so far, of how many, until it ends
      └─ Ctrl-C or SIGTERM: CancelMessageMoveTask (what moved stays moved, the rest stays)

SQS receives, sends and deletes each message itself, so millions move without this
command receiving one and without a receipt held anywhere; it runs at the rate given,
or at one SQS picks from the backlog. Every message goes to the one destination, with
its body and attributes unchanged: no reason filter, no routing by the
`sqsinfer.source_queue` attribute. Those are the client-side path's (`ops.redrive`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from sqsinfer.aws.sqs import SqsQueue
from sqsinfer.logs import Event
from sqsinfer.ops import common

log = logging.getLogger("sqsinfer.redrive")

POLL_S = 5.0  # how often the task's progress is read
COMPLETED, CANCELLING, CANCELLED, FAILED = "COMPLETED", "CANCELLING", "CANCELLED", "FAILED"
_ENDED = frozenset({COMPLETED, CANCELLED, FAILED})


class MoveTaskError(Exception):
    pass


@dataclass
class MoveReport:
    source: str
    destination: str
    rate: int | None  # None: SQS picks it
    task_handle: str = ""
    status: str = ""
    moved: int = 0
    to_move: int | None = None
    failure_reason: str = ""
    interrupted: bool = False

    def exit_code(self) -> int:
        done = self.status == COMPLETED and not self.interrupted
        return common.EXIT_OK if done else common.EXIT_FAILED

    def as_dict(self) -> dict[str, Any]:
        return {
            "server_side": True,
            "source": self.source,
            "destination": self.destination,
            "max_per_second": self.rate,
            "task_handle": self.task_handle,
            "status": self.status,
            "moved": self.moved,
            "to_move": self.to_move,
            "failure_reason": self.failure_reason,
            "interrupted": self.interrupted,
        }

    def summary_line(self) -> str:
        of = f" of {self.to_move:,}" if self.to_move is not None else ""
        line = f"message move task {self.status.lower() or 'not started'}: moved {self.moved:,}{of}"
        line += f" to {common.queue_name(self.destination)}"
        if self.failure_reason:
            line += f" ({self.failure_reason})"
        return ("interrupted, " if self.interrupted else "") + line


class ServerMove:
    """One message move task, followed to its end (or cancelled with the run)."""

    def __init__(
        self, sqs: Any, dlq_url: str, destination_url: str, rate: int | None, poll_s: float = POLL_S
    ) -> None:
        self.sqs = sqs
        self.poll_s = poll_s
        self.report = MoveReport(dlq_url, destination_url, rate)
        self._source_arn = ""

    async def run(self) -> MoveReport:
        handle = await self._start()
        try:
            while self.report.status not in _ENDED:
                await asyncio.sleep(self.poll_s)
                await self._look(handle)
                self._show()
        except asyncio.CancelledError:
            self.report.interrupted = True
            await asyncio.shield(self._cancel(handle))
            raise
        return self.report

    async def _start(self) -> str:
        r = self.report
        try:
            self._source_arn = await SqsQueue(self.sqs, r.source).arn()
            destination_arn = await SqsQueue(self.sqs, r.destination).arn()
            kwargs: dict[str, Any] = {
                "SourceArn": self._source_arn,
                "DestinationArn": destination_arn,
            }
            if r.rate is not None:
                kwargs["MaxNumberOfMessagesPerSecond"] = r.rate
            started = await self.sqs.start_message_move_task(**kwargs)
        except (ClientError, BotoCoreError) as exc:
            raise MoveTaskError(
                f"cannot start a message move task from {r.source}: {exc}"
            ) from None
        r.task_handle, r.status = str(started["TaskHandle"]), "RUNNING"
        return r.task_handle

    async def _look(self, handle: str) -> None:
        """The task's state, from the latest task of the DLQ (one runs at a time, and
        SQS names a task's handle only while it runs)."""
        try:
            found = await self.sqs.list_message_move_tasks(SourceArn=self._source_arn, MaxResults=1)
        except (ClientError, BotoCoreError) as exc:
            log.warning(Event.MOVE_TASK_NOT_READ, extra={"error": str(exc)})
            return  # read again at the next poll; the task goes on meanwhile
        latest = (found.get("Results") or [{}])[0]
        if latest.get("TaskHandle", handle) != handle:
            raise MoveTaskError("another message move task of this DLQ is running")
        r = self.report
        r.status = str(latest.get("Status", r.status))
        r.moved = int(latest.get("ApproximateNumberOfMessagesMoved", r.moved))
        if "ApproximateNumberOfMessagesToMove" in latest:
            r.to_move = int(latest["ApproximateNumberOfMessagesToMove"])
        r.failure_reason = str(latest.get("FailureReason", ""))

    async def _cancel(self, handle: str) -> None:
        try:
            answer = await self.sqs.cancel_message_move_task(TaskHandle=handle)
        except (ClientError, BotoCoreError) as exc:  # ended meanwhile, most likely
            log.warning(Event.MOVE_TASK_NOT_CANCELLED, extra={"error": str(exc)})
            return
        self.report.status = CANCELLING
        self.report.moved = int(answer.get("ApproximateNumberOfMessagesMoved", self.report.moved))

    def _show(self) -> None:
        if sys.stderr.isatty():
            print(f"\r{self.report.summary_line()}", end="", file=sys.stderr, flush=True)
