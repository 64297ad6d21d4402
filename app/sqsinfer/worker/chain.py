"""Handing an output to the next stage: one send in effect, and every possible second one counted.

A standard SQS queue cannot drop a duplicate, so the link is decided before the send.
The output itself is its writer's intent: the delivery whose conditional put of the
output stood owns the link from that write on (its delivery id is in the output's
metadata, the write's time is its Last-Modified), and records what became of it in the
marker object `<output>.chain`. Each step is a conditional PUT, so two deliveries never
both believe they own the link:

    (none: the writer's) ──sent, If-None-Match: *──▶ sent   later deliveries send nothing
    (none) ──nothing sent, If-None-Match: *──▶ released     the next delivery starts clean
    (none) ──taken over, If-None-Match: *──▶ sending        its writer is presumed dead
    sending ──sent, If-Match: its ETag──▶ sent
    sending ──nothing sent, If-Match──▶ released
    sending (another's) ──If-Match──▶ sending       taken over: its owner is presumed dead
    released ──If-Match──▶ sending

So a task delivered once costs one marker PUT ("sent"). A delivery that finds the output
and no marker waits for the writer as for any intent (the output's age is the intent's).

Only the owner sends, with the SDK's retries off: the worker retries the send itself,
so it knows when an answer was lost (the message may have gone out). Sends of several
links share SendMessageBatch calls (`queue.BatchSender`): an entry the answer lists as
failed was not sent; a call whose answer was lost may have sent every entry in it, and
each entry's link counts its own possible duplicate, as a single send's would. A takeover happens
when the owner's intent is older than `chain_settle_s`, or at once when the owner is a
delivery of this worker that has ended (finished, failed, cancelled or expired, its send
no longer under way): only then is it known to be dead. An earlier receive of the same
message is no such proof: SQS delivers a message again while the first receive may still
be working on it (its visibility lapsed, or a second copy), possibly on another worker.
What can still put a second message on the next stage is counted in
`sqsinfer_chain_duplicates_total` and logged with the task id:
- possible: each send attempt whose answer was lost (it may have gone out, and the link
  is sent again); a link taken over from an owner that may have sent before it died; a
  writer's send beside an intent made by a worker that counts no takeover (0.2.0);
- certain: an owner that sent and then found the link recorded as sent by another.
A certain duplicate was counted as possible by the delivery that took it over too, so
`possible` alone bounds the extra messages from above, and `certain` from below.

A marker without a `chain-state` (written before these steps existed) reads as sent.

A FIFO next stage needs no marker (`DedupLinker`): every delivery that finds the output
written sends its link, with the output key's digest as MessageDeduplicationId, and SQS
drops every send after the first for 300 s from that first one. The first send comes
after the output's write, so every send made within `chain_dedup_window_s` of that write
(by the output's own Last-Modified, read on S3's clock) falls inside the window of the
first, whichever delivery made it: no second message. A send made later (a redelivery
long after the write, a stalled owner) may fall outside it: each that may have gone out
counts as `possible`. Lost answers within the window are retried freely and count nothing.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from sqsinfer import tracing
from sqsinfer.aws.s3 import Storage
from sqsinfer.aws.session import may_have_taken_effect
from sqsinfer.aws.sqs import EntryFailed, FifoIds, Sender
from sqsinfer.backoff import Backoff
from sqsinfer.logs import Event
from sqsinfer.messages import S3Uri, Task, deduplication_id, message_group, next_stage_body
from sqsinfer.metrics import DuplicateKind, Metrics

log = logging.getLogger("sqsinfer.chain")

MARKER_SUFFIX = ".chain"
STATE_KEY = "chain-state"
# On an intent that took over another's ("sending", or a writer's output without a
# marker): its delivery counts the possible duplicate. A writer that finds another's
# intent without it (made by a worker before the output stood for its writer's intent,
# which creates one at once) counts the possible duplicate itself.
TAKEOVER_KEY = "chain-takeover"
_CONTENT_TYPE = "application/json"
# Sends and marker writes retried in the worker (each after the SDK's own, for S3).
SEND_ATTEMPTS = 4
WRITE_ATTEMPTS = 4
RETRY = Backoff(base_s=0.2, max_s=2.0)
# How often a delivery waiting on another's intent looks at the marker again.
_RECHECK = Backoff(base_s=0.1, max_s=2.0)
# Conditional writes of the marker that may lose to others before the link is given up
# (each loss means another delivery moved it on: this many only under a storm).
_MAX_LOST_WRITES = 10
# Deliveries of this worker that ended while owning an unsent link, remembered so that a
# later delivery of the same output takes their intent over at once. Only those count
# (a delivery whose link was sent leaves nothing to take over), so few are ever kept;
# one forgotten only costs a wait of `chain_settle_s`.
ENDED_KEPT = 10_000


class LinkState(StrEnum):
    SENDING = "sending"
    SENT = "sent"
    RELEASED = "released"


def marker_uri(output: S3Uri) -> S3Uri:
    """The small object that records the link of `output` to the next stage."""
    return S3Uri(output.bucket, output.key + MARKER_SUFFIX)


@dataclass(frozen=True)
class Marker:
    state: LinkState
    delivery: str
    message_id: str
    etag: str  # "": no marker yet, the output stands for its writer's intent
    age_s: float
    took_over: bool = False  # an intent that took over another's (TAKEOVER_KEY)


@dataclass(frozen=True)
class Written:
    """An output as the link sees it: which delivery wrote it, and how old it is."""

    by: str  # the writer's delivery id (the output's `delivery` metadata; "" if none)
    at: WrittenAt

    def intent(self) -> Marker:
        """The writer's intent the output stands for while no marker exists."""
        return Marker(LinkState.SENDING, self.by, "", "", self.at.age_now_s())


@dataclass(frozen=True)
class Delivery:
    """One receive of a message, as the link sees it."""

    delivery_id: str
    message_id: str
    task_id: str
    log_fields: dict[str, Any] = field(default_factory=dict)


class LinkNotSent(Exception):
    """The next stage's message could not be sent (or recorded) now: retry the message."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code


@dataclass
class Claim:
    """A link this delivery owns: the ETag of its intent ("" for the writer's own, which
    the output stands for), and what it knows of earlier sends."""

    etag: str
    inherited_doubt: bool  # taken over from an owner that may have sent


class EndedDeliveries:
    """This worker's deliveries that ended owning a link they had not recorded as sent.

    Bounded (the oldest are forgotten first). A delivery is added only once nothing of it
    runs any more, its send included, so an intent it left is known to be dead.
    """

    def __init__(self, kept: int = ENDED_KEPT) -> None:
        self._order: collections.deque[str] = collections.deque()
        self._ids: set[str] = set()
        self._kept = kept

    def add(self, delivery_id: str) -> None:
        if delivery_id in self._ids:
            return
        self._order.append(delivery_id)
        self._ids.add(delivery_id)
        while len(self._order) > self._kept:
            self._ids.discard(self._order.popleft())

    def __contains__(self, delivery_id: object) -> bool:
        return delivery_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)


@dataclass
class Linker:
    storage: Storage
    sender: Sender  # its client must not retry: each lost answer must be seen here
    metrics: Metrics
    settle_s: float
    # Deliveries of this worker holding a claim not yet recorded as sent, and those that
    # ended holding one (`ended`): the intents it may take over without waiting.
    _owning: set[str] = field(default_factory=set, init=False, repr=False)
    dead: EndedDeliveries = field(default_factory=EndedDeliveries, init=False, repr=False)

    def wrote(self, delivery_id: str) -> None:
        """Note that a delivery of this worker wrote an output: it owns its link."""
        self._owning.add(delivery_id)

    def ended(self, delivery_id: str) -> None:
        """Note that a delivery of this worker has ended, nothing of it still running (a
        send under way included). An intent it left can be taken over at once."""
        if delivery_id in self._owning:
            self._owning.discard(delivery_id)
            self.dead.add(delivery_id)

    async def claim(
        self,
        delivery: Delivery,
        output: S3Uri,
        on_waiting: Callable[[], None],
        written: Written,
    ) -> Claim | None:
        """Own the link of `output`, or None once it is recorded as sent.

        The delivery that wrote the output owns it at once, without a call: no other can
        have claimed the link of an output that did not exist. Another waits while the
        writer's intent (the output, until a marker exists) or another's is fresh
        (calling `on_waiting` first), looking again now and then, until its owner records
        its send or it is old enough to take over. Cancelling it at any point is harmless.
        """
        self._owning.add(delivery.delivery_id)
        if written.by == delivery.delivery_id:
            return Claim("", inherited_doubt=False)
        return await self._claim(marker_uri(output), delivery, on_waiting, written)

    async def hand_on(self, delivery: Delivery, task: Task, claim: Claim) -> None:
        """Send the next stage's message for an owned link and record it as sent.

        Raises LinkNotSent (or an S3 error) when the link is not done: retry later.
        Do not cancel it half-way: a send without its record costs a possible duplicate.
        """
        await self._send_and_record(marker_uri(task.output), delivery, task, claim)
        self._owning.discard(delivery.delivery_id)  # sent and recorded: nothing to take over

    # -- owning the link --------------------------------------------------------------
    async def _claim(
        self, uri: S3Uri, delivery: Delivery, on_waiting: Callable[[], None], written: Written
    ) -> Claim | None:
        # Owning from the first write on: a write whose answer is lost may have landed.
        marker = await self._read(uri) or written.intent()
        checks = lost = 0
        taking: Marker | None = None  # the intent this delivery last tried to take over
        while lost < _MAX_LOST_WRITES:
            if marker.state == LinkState.SENT:
                return None
            elif marker.delivery == delivery.delivery_id and marker.state == LinkState.SENDING:
                # Our write's answer was lost. A takeover's keeps the doubt it took over.
                if taking is not None:
                    return self._took_over(taking, delivery, marker.etag)
                return Claim(marker.etag, inherited_doubt=False)
            elif self._may_take(marker):
                taking = marker
                doubt = marker.state == LinkState.SENDING  # this delivery counts it
                etag = await self._write(
                    uri, delivery, LinkState.SENDING, etag=marker.etag, took_over=doubt
                )
                if etag is not None:
                    return self._took_over(marker, delivery, etag)
                lost += 1
            else:
                on_waiting()
                wait_s = min(_RECHECK.delay_s(checks), self.settle_s - marker.age_s)
                checks += 1
                await asyncio.sleep(max(0.05, wait_s))
            marker = await self._read(uri) or written.intent()
        raise LinkNotSent("chain_contended", f"{uri} kept changing under this delivery")

    def _may_take(self, marker: Marker) -> bool:
        if marker.state == LinkState.RELEASED:
            return True
        # Its owner is known to be dead only when it was a delivery of this worker that
        # ended. Any other owner, an earlier receive of this very message included, may
        # still be sending (SQS delivers concurrently too): wait for it as for any other.
        return marker.delivery in self.dead or marker.age_s >= self.settle_s

    def _took_over(self, marker: Marker, delivery: Delivery, etag: str) -> Claim:
        doubt = marker.state == LinkState.SENDING
        if doubt:
            log.warning(
                Event.CHAIN_LINK_TAKEN_OVER,
                extra=delivery.log_fields
                | {"from_delivery": marker.delivery, "intent_age_s": round(marker.age_s, 3)},
            )
        return Claim(etag, inherited_doubt=doubt)

    async def _send_and_record(
        self, uri: S3Uri, delivery: Delivery, task: Task, claim: Claim
    ) -> None:
        sent_id = await self._send(uri, delivery, claim, next_stage_body(task))
        if claim.inherited_doubt:  # the owner it took over from may have sent before dying
            self._count(DuplicateKind.POSSIBLE, delivery, "link taken over")
        await self._record(uri, delivery, claim, sent_id)

    async def _send(self, uri: S3Uri, delivery: Delivery, claim: Claim, body: str | bytes) -> str:
        """Send, retrying here; each attempt that may have gone out counts as possible."""
        unsure = False
        last: Exception | None = None
        for attempt in range(SEND_ATTEMPTS):
            if attempt:
                await asyncio.sleep(RETRY.delay_s(attempt - 1))
                if not await self._still_ours(uri, claim):
                    # Taken over while retrying: the new owner sends and counts any doubt.
                    raise LinkNotSent("chain_taken_over", "link taken over while sending")
            try:
                # The next stage's task is a child of this one: one trace across stages.
                return await self.sender.send(body, tracing.current().outgoing())
            except Exception as exc:
                last = exc
                if send_failed(exc, delivery, attempt):  # one more may be on the next stage
                    unsure = True
                    self._count(DuplicateKind.POSSIBLE, delivery, "lost send answer")
        if not unsure and not claim.inherited_doubt:
            # Nothing went out: hand the link back clean. Otherwise the intent stays, and
            # whoever takes it over counts a possible duplicate.
            await self._write(uri, delivery, LinkState.RELEASED, etag=claim.etag)
        raise LinkNotSent("chain_send_failed", f"next stage send failed: {last}")

    async def _still_ours(self, uri: S3Uri, claim: Claim) -> bool:
        marker = await self._read(uri)
        if not claim.etag:  # the writer's: ours while no marker says otherwise
            return marker is None
        return marker is not None and marker.etag == claim.etag

    async def _record(self, uri: S3Uri, delivery: Delivery, claim: Claim, sent_id: str) -> None:
        """Write "sent" over this delivery's intent (retried in `_write` before giving up)."""
        extra = {"next_message_id": sent_id, "queue": self.sender.url}
        try:
            etag = await self._write(uri, delivery, LinkState.SENT, etag=claim.etag, extra=extra)
        except Exception as exc:
            # The next delivery takes the intent over and counts a possible duplicate.
            raise LinkNotSent("chain_unrecorded", f"sent, but not recorded: {exc}") from exc
        if etag is None:
            await self._lost_record(uri, delivery)

    async def _lost_record(self, uri: S3Uri, delivery: Delivery) -> None:
        """The intent changed under us: our own record (its answer lost), or a takeover."""
        marker = await self._read(uri)
        if marker is None or marker.delivery == delivery.delivery_id:
            return
        if marker.state == LinkState.SENT:
            self._count(DuplicateKind.CERTAIN, delivery, "link taken over after this send")
        elif marker.state == LinkState.SENDING and not marker.took_over:
            # An intent created beside this writer's by a worker that does not count it.
            self._count(DuplicateKind.POSSIBLE, delivery, "another intent beside this send")
        # Otherwise: the delivery that took it over counts it when it sends.

    # -- the marker ---------------------------------------------------------------------
    async def _read(self, uri: S3Uri) -> Marker | None:
        info = await self.storage.head(uri)
        if info is None:
            return None
        meta = info.metadata
        try:
            state = LinkState(meta.get(STATE_KEY, LinkState.SENT))
        except ValueError:
            state = LinkState.SENT  # unknown: never send on a marker this code cannot read
        delivery, message_id = meta.get("delivery", ""), meta.get("message-id", "")
        took_over = TAKEOVER_KEY in meta
        return Marker(state, delivery, message_id, info.etag, info.age_s, took_over)

    async def _write(
        self,
        uri: S3Uri,
        delivery: Delivery,
        state: LinkState,
        *,
        etag: str = "",
        extra: dict[str, str] | None = None,
        took_over: bool = False,
    ) -> str | None:
        """One step of the marker: the new ETag, or None when its precondition failed.
        Without `etag` (no marker yet) it is created, If-None-Match: *; else If-Match.

        Failures that outlast the SDK's retries are retried here a few times. A retry of
        a write that did land fails its precondition; the caller reads the marker and
        finds its own delivery id there.
        """
        metadata = {
            STATE_KEY: str(state),
            "delivery": delivery.delivery_id,
            "message-id": delivery.message_id,
            "task-id": delivery.task_id,
        } | ({TAKEOVER_KEY: "1"} if took_over else {})
        # A fresh id in every body: two writes never share an ETag, so If-Match is exact.
        doc = {
            "state": state,
            "task_id": delivery.task_id,
            "delivery": delivery.delivery_id,
            "message_id": delivery.message_id,
            "write": uuid.uuid4().hex,
            "at": round(time.time(), 3),
        }
        body = orjson.dumps(doc | (extra or {}))
        for attempt in range(WRITE_ATTEMPTS):
            try:
                if not etag:
                    return await self.storage.put_if_absent(uri, body, metadata, _CONTENT_TYPE)
                return await self.storage.put_if_match(uri, body, metadata, _CONTENT_TYPE, etag)
            except Exception as exc:
                if attempt + 1 == WRITE_ATTEMPTS:
                    raise
                log.warning(
                    Event.CHAIN_MARKER_WRITE_FAILED,
                    extra=delivery.log_fields
                    | {"state": state, "attempt": attempt + 1, "error": str(exc)},
                )
                await asyncio.sleep(RETRY.delay_s(attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    def _count(self, kind: DuplicateKind, delivery: Delivery, cause: str) -> None:
        count_duplicate(self.metrics, kind, delivery, cause)


def send_failed(exc: Exception, delivery: Delivery, attempt: int) -> bool:
    """Log a failed send attempt; whether it may have gone out all the same. An entry SQS
    listed as failed in its batch answer was not sent; an error of the whole call may have
    reached SQS, for each entry of the batch."""
    maybe_sent = not isinstance(exc, EntryFailed) and may_have_taken_effect(exc)
    log.warning(
        Event.NEXT_STAGE_SEND_FAILED,
        extra=delivery.log_fields
        | {"attempt": attempt + 1, "maybe_sent": maybe_sent, "error": str(exc)},
    )
    return maybe_sent


def count_duplicate(metrics: Metrics, kind: DuplicateKind, delivery: Delivery, cause: str) -> None:
    metrics.chain_duplicates.labels(kind).inc()
    log.warning(Event.CHAIN_DUPLICATE, extra=delivery.log_fields | {"kind": kind, "cause": cause})


@dataclass(frozen=True)
class WrittenAt:
    """How old the output was at a moment of this process's clock: its age then."""

    age_s: float
    seen_at: float = field(default_factory=time.monotonic)

    def age_now_s(self) -> float:
        return self.age_s + time.monotonic() - self.seen_at


@dataclass
class DedupLinker:
    """The link to a FIFO next stage: SQS's deduplication instead of markers."""

    sender: Sender  # a FIFO queue's; its client must not retry (each lost answer seen here)
    metrics: Metrics
    window_s: float  # sends within this of the output's write are deduplicated by SQS

    async def hand_on(self, delivery: Delivery, task: Task, written: WrittenAt) -> None:
        """Send the link; raises LinkNotSent when no attempt went out for sure (retry)."""
        body = next_stage_body(task)
        ids = FifoIds(message_group(task.task_id, task.group), deduplication_id(str(task.output)))
        last: Exception | None = None
        for attempt in range(SEND_ATTEMPTS):
            if attempt:
                await asyncio.sleep(RETRY.delay_s(attempt - 1))
            # Judged before the send: a send that starts inside the margin lands inside
            # SQS's window. One outside it may add a message, if any other went out.
            outside = written.age_now_s() >= self.window_s
            try:
                await self.sender.send(body, tracing.current().outgoing(), fifo=ids)
            except Exception as exc:
                last = exc
                if send_failed(exc, delivery, attempt) and outside:
                    self._outside(delivery, written)
                continue
            if outside:
                self._outside(delivery, written)
            return
        raise LinkNotSent("chain_send_failed", f"next stage send failed: {last}")

    def _outside(self, delivery: Delivery, written: WrittenAt) -> None:
        cause = f"sent {written.age_now_s():.0f} s after the output's write"
        count_duplicate(self.metrics, DuplicateKind.POSSIBLE, delivery, cause)
