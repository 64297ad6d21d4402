"""What happens to one message, from parse to delete, and the one outcome it ends in.

    parse ─bad─▶ DLQ + delete (rejected)
    HEAD output ─exists─▶ chain link, delete (duplicate)
    GET input → shared memory → wait for a process → decode, predict, encode (child)
    conditional PUT ─412─▶ chain link, delete (duplicate)
                    ─200─▶ chain link, delete (committed)
    transient failure ─▶ visibility backoff (retried) · shutdown ─▶ visibility 0 (released)

The worker module owns the lifecycle; this module owns the steps and their outcomes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from sqsinfer import backoff, formats, inference
from sqsinfer.aws import error_code
from sqsinfer.config import Settings
from sqsinfer.errors import InputError
from sqsinfer.messages import (
    MessageRejected,
    MessageRules,
    S3Uri,
    Task,
    next_stage_body,
    parse_task,
)
from sqsinfer.metrics import Metrics, Phase
from sqsinfer.outcomes import Outcome
from sqsinfer.pool import InferencePool
from sqsinfer.queue import Message, Sender, SqsQueue, dead_letter_copy
from sqsinfer.storage import Storage

log = logging.getLogger("sqsinfer.task")

CHAIN_MARKER_SUFFIX = ".chain"


class Step(StrEnum):
    """How far a held message's task has come (the worker's shutdown reads it)."""

    RECEIVED = "received"
    CHECKING = "checking"
    FETCHING = "fetching"
    WAITING = "waiting"  # for an idle inference process
    COMPUTING = "computing"
    COMMITTING = "committing"
    SETTLED = "settled"  # its outcome is decided and its message handed back or deleted


# Steps after which shutdown lets a task finish instead of releasing its message.
STARTED_STEPS = frozenset({Step.COMPUTING, Step.COMMITTING, Step.SETTLED})


class ChainPending(Exception):
    """Another delivery wrote the output moments ago and has not linked it yet."""

    def __init__(self, wait_s: float) -> None:
        super().__init__(f"chain link pending for {wait_s:.1f} s")
        self.wait_s = wait_s


@dataclass(eq=False)
class Held:
    """A message this worker holds, and how far its task has come."""

    message: Message
    step: Step = Step.RECEIVED
    task: Task | None = None
    expired: bool = False
    outcome: Outcome | None = None
    reason: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    delivery_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def started(self) -> bool:
        return self.step in STARTED_STEPS


class Timer:
    """Measures one phase into the held task's timings and the phase histogram."""

    def __init__(self, held: Held, metrics: Metrics, phase: Phase) -> None:
        self.held, self.metrics, self.phase = held, metrics, phase

    def __enter__(self) -> None:
        self.started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.record(time.perf_counter() - self.started)

    def record(self, seconds: float) -> None:
        self.held.timings[self.phase.value] = round(seconds, 6)
        self.metrics.observe(self.phase, seconds)


def chain_marker(output: S3Uri) -> S3Uri:
    """The small object that says "the next stage has been sent this output"."""
    return S3Uri(output.bucket, output.key + CHAIN_MARKER_SUFFIX)


@dataclass
class Pipeline:
    settings: Settings
    rules: MessageRules
    storage: Storage
    queue: SqsQueue
    dead_letters: Sender
    next_stage: Sender | None
    pool: InferencePool
    metrics: Metrics
    model_sha256: str

    # -- the whole life of one message ------------------------------------------------
    async def handle(self, held: Held) -> Outcome:
        """Run the task and settle the message. Never raises, except a second cancel."""
        try:
            outcome = await self._process(held)
        except asyncio.CancelledError:
            outcome = held.outcome or (Outcome.RETRIED if held.expired else Outcome.RELEASED)
            # The message must still be handed back even though this task was cancelled.
            await asyncio.shield(self._settle_cancelled(held, outcome))
        self._record(held, outcome)
        return outcome

    async def _process(self, held: Held) -> Outcome:
        try:
            try:
                held.task = parse_task(held.message.body, self.rules)
                return await self._run(held, held.task)
            except (MessageRejected, InputError) as exc:
                return await self._reject(held, exc.reason, exc.detail)
        except ChainPending as pending:
            held.reason = "chain_pending"
            return await self._retry(held, pending.wait_s)
        except Exception as exc:  # transient by default: the redrive policy bounds retries
            held.reason = error_code(exc) or type(exc).__name__
            log.warning("task failed, will retry: %s", exc, extra=self._ids(held))
            return await self._retry(held)

    async def _run(self, held: Held, task: Task) -> Outcome:
        held.step = Step.CHECKING
        existing = await self.storage.head(task.output)
        if existing is not None:
            await self._chain(held, task, won=False, output_age_s=existing.age_s)
            return await self._finish(held, Outcome.DUPLICATE)
        held.step = Step.FETCHING
        with Timer(held, self.metrics, Phase.S3_GET):
            shared = await self.storage.get_shared(task.input, self.settings.max_input_bytes)
        with shared:
            result = await self._infer(held, task, shared.name, shared.size)
        held.step = Step.COMMITTING
        with Timer(held, self.metrics, Phase.COMMIT):
            won = await self._commit(held, task, result["body"])
        await self._chain(held, task, won=won)  # a 412 means the other writer is alive just now
        return await self._finish(held, Outcome.COMMITTED if won else Outcome.DUPLICATE)

    async def _commit(self, held: Held, task: Task, body: bytes) -> bool:
        """The conditional put of the output. True when this delivery's write stands."""
        return await self._put_first(
            held, task.output, body, formats.named(task.output_format).content_type
        )

    async def _put_first(self, held: Held, uri: S3Uri, body: bytes, content_type: str) -> bool:
        """Write unless the object exists. True when the object that stands is ours."""
        if await self.storage.put_if_absent(uri, body, self._metadata(held), content_type):
            return True
        # A 412 can answer our own write: the SDK retries a put whose answer was lost in
        # a dropped connection. The delivery id in the metadata tells the two apart.
        existing = await self.storage.head(uri)
        return existing is not None and existing.metadata.get("delivery") == held.delivery_id

    async def _infer(self, held: Held, task: Task, shm_name: str, size: int) -> dict[str, Any]:
        held.step = Step.WAITING
        waited = time.perf_counter()
        async with self.pool.lease() as lease:
            Timer(held, self.metrics, Phase.WAIT_PROCESS).record(time.perf_counter() - waited)
            held.step = Step.COMPUTING
            began = time.perf_counter()
            result = await lease.run(
                inference.run_task, shm_name, size, task.input_format, task.output_format
            )
        total = time.perf_counter() - began
        for phase in (Phase.DECODE, Phase.INFER, Phase.ENCODE):
            Timer(held, self.metrics, phase).record(result[f"{phase}_s"])
        # What the child did not account for is the cost of handing work over and back.
        spent = result["decode_s"] + result["infer_s"] + result["encode_s"]
        Timer(held, self.metrics, Phase.HANDOFF).record(max(0.0, total - spent))
        self.metrics.rows.inc(result["rows"])
        return result

    # -- chaining ---------------------------------------------------------------------
    async def _chain(self, held: Held, task: Task, *, won: bool, output_age_s: float = 0) -> None:
        """Hand the output to the next stage: never lost, and sent once in effect.

        The delivery that wrote the output sends the next message, then writes the
        marker `<output>.chain`. Another delivery that finds the output sends nothing
        while the marker is present. When the marker is absent it cannot tell a
        writer still sending from one that crashed after its write, so it waits:
        while the output is younger than `chain_settle_s` the message is retried
        later; once older, the writer is presumed dead and this delivery sends. A
        crash between the write and the send therefore delays the link, never loses
        it, and a live duplicate never adds a downstream message.
        """
        if self.next_stage is None:
            return
        held.step = Step.COMMITTING
        marker = chain_marker(task.output)
        with Timer(held, self.metrics, Phase.CHAIN):
            if not won:
                if await self.storage.head(marker) is not None:
                    return
                if output_age_s < self.settings.chain_settle_s:
                    raise ChainPending(self.settings.chain_settle_s - output_age_s)
            sent_id = await self.next_stage.send(next_stage_body(task))
            note = orjson.dumps({"next_message_id": sent_id, "queue": self.next_stage.url})
            created = await self._put_first(held, marker, note, "application/json")
        if not created:  # two deliveries sent: after a crash, or a writer slower than the settle
            self.metrics.chain_duplicates.inc()
            log.warning("next stage sent twice", extra=self._ids(held))

    # -- outcomes ---------------------------------------------------------------------
    async def _finish(self, held: Held, outcome: Outcome) -> Outcome:
        held.outcome = outcome
        held.step = Step.SETTLED
        deleted = await asyncio.shield(self.queue.delete(held.message))
        if not deleted:  # it will come back, find its output and end as a duplicate
            log.warning("delete not confirmed", extra=self._ids(held))
        return outcome

    async def _reject(self, held: Held, reason: str, detail: str) -> Outcome:
        held.reason = reason
        copy = dead_letter_copy(
            held.message, reason, detail, self.queue.url, self.rules.dead_letter_max_bytes
        )
        # Copy first, delete second: a crash in between leaves a copy, never nothing.
        await asyncio.shield(self.dead_letters.send(copy.body, copy.attributes))
        self.metrics.rejections.labels(reason).inc()
        log.info("message rejected: %s", detail, extra=self._ids(held))
        return await self._finish(held, Outcome.REJECTED)

    def retry_delay_s(self, receive_count: int) -> int:
        """The visibility delay of a retry: doubles with each receive of the message."""
        s = self.settings
        return max(1, int(backoff.delay_s(receive_count - 1, s.retry_base_s, s.retry_max_s)))

    async def _retry(self, held: Held, delay_s: float | None = None) -> Outcome:
        held.outcome = Outcome.RETRIED
        if delay_s is None:
            delay = self.retry_delay_s(held.message.receive_count)
        else:
            delay = max(1, math.ceil(delay_s))
        try:
            await asyncio.shield(self.queue.set_visibility(held.message, delay))
        except Exception as exc:  # then it comes back when its current visibility lapses
            log.warning("could not set retry delay: %s", exc, extra=self._ids(held))
        return Outcome.RETRIED

    async def _settle_cancelled(self, held: Held, outcome: Outcome) -> None:
        if held.step == Step.SETTLED:
            return  # already deleted (or its deletion is under way)
        delay = self.retry_delay_s(held.message.receive_count) if outcome == Outcome.RETRIED else 0
        try:
            await self.queue.set_visibility(held.message, delay)
        except Exception as exc:  # it becomes visible again when its timeout lapses
            log.warning("could not hand back message: %s", exc, extra=self._ids(held))

    # -- bookkeeping ------------------------------------------------------------------
    def _metadata(self, held: Held) -> dict[str, str]:
        assert held.task is not None
        return {
            "task-id": held.task.task_id,
            "model-sha256": self.model_sha256,
            "message-id": held.message.message_id,
            "worker": self.settings.worker_id,
            "delivery": held.delivery_id,
        }

    def _ids(self, held: Held) -> dict[str, Any]:
        return {
            "task_id": held.task.task_id if held.task else None,
            "message_id": held.message.message_id,
            "receive_count": held.message.receive_count,
        }

    def _record(self, held: Held, outcome: Outcome) -> None:
        elapsed = time.monotonic() - held.message.received_at
        self.metrics.outcome(outcome, elapsed)
        fields = self._ids(held) | {"outcome": outcome, "seconds": round(elapsed, 6)}
        if held.reason:
            fields["reason"] = held.reason
        fields["phases"] = held.timings
        log.info("task finished", extra=fields)
