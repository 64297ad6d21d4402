"""SQS: long-poll receive, batched deletes and visibility changes, DLQ and next-stage sends.

Deletes and visibility changes of single messages are gathered into batches of up to
ten (the SQS limit) for a few milliseconds; each caller learns whether *its* entry
succeeded, because only what `...Batch` reports under `Successful` counts. Next-stage
sends are batched the same way (`BatchSender`): an entry reported under `Failed` was
not sent (`EntryFailed`); an error of the whole call reaches every entry in it.

Two kinds of visibility change meet here, and their order matters. The keeper's
*extensions* (`extend`) keep a held message invisible; a *settle* (`delete`, or
`set_visibility` for a retry delay or a release) ends the hold. SQS applies calls in
the order they arrive, so an extension that lands after a release hides the message
for a whole timeout again. Hence: a settle marks its message settled at once (no new
extension includes it from then on), and a visibility settle waits for any extension
of the message still in flight before it is sent, so the settle lands last. An
extension the keeper gave up on (it did not answer in time) is not cancelled: a request
cut at this end may still reach SQS, late, so it stays in flight until it ends (its
answer, or the client's own timeouts), and settles wait for it too. Only at shutdown
(`hurry`) do settles stop waiting. Sending a settle again after a late extension was
ruled out: by then the message may have been received anew, and a stand-in that honours
a stale receipt handle (moto does) would cut the new receive's hold short. A delete
needs no wait: an extension of a deleted message changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, TypeVar

import orjson

from sqsinfer import tracing
from sqsinfer.limits import (
    SQS_BATCH_MAX,
    SQS_BATCH_MAX_BYTES,
    SQS_DEFAULT_MAX_MESSAGE_BYTES,
    SQS_FIFO_SUFFIX,
    SQS_MAX_ATTRIBUTES,
)
from sqsinfer.logs import Event
from sqsinfer.messages import xml_safe
from sqsinfer.tracing.api import AWS_TRACE_HEADER, NO_TRACE, TRACEPARENT, TRACESTATE, TaskTrace

log = logging.getLogger("sqsinfer.queue")

# The most one SendMessageBatch may carry, all entries together (SQS's oldest limit).
# How long a delete or visibility change waits for others to share its batch call. A
# message held a little longer costs nothing (it is invisible anyway, and holds no slot
# while its delete waits); a call saved saves the pod a few milliseconds of CPU in the
# SDK, and the endpoint a request.
LINGER_S = 0.05
# A next-stage send waits less: the chain marker's "sent" record follows it.
SEND_LINGER_S = 0.02
# A hand-back that waited for an extension call is sent only while its hold has this
# long left: about what the call itself takes to land on a loaded machine.
SETTLE_MARGIN_S = 1.0

# The attributes of a dead-letter copy. A detail is cut to _DETAIL_MAX_CHARS, and to
# _DETAIL_MIN_CHARS first when room is short.
OWN_ATTR_PREFIX = "sqsinfer."
REASON_ATTR = "sqsinfer.reason"
DETAIL_ATTR = "sqsinfer.detail"
SOURCE_ID_ATTR = "sqsinfer.source_message_id"
SOURCE_QUEUE_ATTR = "sqsinfer.source_queue"
BODY_TRUNCATED_ATTR = "sqsinfer.body_truncated"
_DETAIL_MAX_CHARS = 1000
_DETAIL_MIN_CHARS = 100
_DETAIL_OVERHEAD = len(DETAIL_ATTR) + len("String")
_TRACE_ATTRS = frozenset({TRACEPARENT, TRACESTATE})
GROUP_ID_ATTR = "MessageGroupId"  # the system attribute, and the send field, of the same name
SENT_TIMESTAMP_ATTR = "SentTimestamp"  # when SQS took the message, epoch milliseconds
_SYSTEM_ATTRS = ["ApproximateReceiveCount", AWS_TRACE_HEADER, GROUP_ID_ATTR, SENT_TIMESTAMP_ATTR]
# A queue's approximate counts, by what the worker calls them (GetQueueAttributes' names).
DEPTH_ATTRIBUTES = {
    "visible": "ApproximateNumberOfMessages",
    "in_flight": "ApproximateNumberOfMessagesNotVisible",
    "delayed": "ApproximateNumberOfMessagesDelayed",
}


def is_fifo(url: str) -> bool:
    """Whether the queue at `url` is a FIFO queue: SQS requires its name to end in
    `.fifo` and refuses that suffix on any other, so the URL alone tells (no call)."""
    return url.rstrip("/").endswith(SQS_FIFO_SUFFIX)


@dataclass(frozen=True)
class FifoIds:
    """What a send to a FIFO queue must carry: the message's group (its order) and its
    deduplication id (a second send with it within SQS's window is dropped). To a
    standard queue only the group goes (a fair queue's tenant), when there is one."""

    group_id: str
    deduplication_id: str


@dataclass(eq=False)
class Message:
    message_id: str
    receipt_handle: str
    body: str
    receive_count: int
    attributes: dict[str, Any] = field(default_factory=dict)
    received_at: float = field(default_factory=time.monotonic)
    trace_header: str = ""  # the AWSTraceHeader system attribute (X-Ray), if the producer set one
    group_id: str = ""  # its MessageGroupId (a fair or FIFO queue's), if the producer set one
    sent_at_s: float = 0.0  # when SQS took it (SentTimestamp), epoch seconds; 0: not known
    # Set when its delete or hand-back is asked for: it is extended no more.
    settled: bool = field(default=False, init=False)
    # Until when (monotonic) this receive holds it, as far as the worker knows: the
    # visibility keeper sets it at receive and at each extension (inf: nobody keeps it).
    # Past it the message may be another receive's, so a hand-back that had to wait is
    # not sent (with an old receipt it could make the new holder's message visible).
    hold_until: float = field(default=math.inf, init=False)
    # Its task's trace, once the worker started one (the batch calls of its message link to it).
    trace: TaskTrace = field(default=NO_TRACE, init=False, repr=False)

    @classmethod
    def from_sqs(cls, raw: dict[str, Any]) -> Message:
        system = raw.get("Attributes", {})
        return cls(
            message_id=raw["MessageId"],
            receipt_handle=raw["ReceiptHandle"],
            body=raw.get("Body", ""),
            receive_count=int(system.get("ApproximateReceiveCount", 1)),
            attributes=raw.get("MessageAttributes", {}) or {},
            trace_header=str(system.get(AWS_TRACE_HEADER, "")),
            group_id=str(system.get(GROUP_ID_ATTR, "")),
            sent_at_s=int(system.get(SENT_TIMESTAMP_ATTR, 0)) / 1000,
        )


BatchCall = Callable[[list[dict[str, Any]]], Awaitable[dict[str, Any]]]
T = TypeVar("T")
# What one entry's submitter learns, from its item under `Successful` or under `Failed`
# (None where it is not listed): a value, or an exception raised for it.
Resolve = Callable[[dict[str, Any] | None, dict[str, Any] | None], T]


class EntryFailed(Exception):
    """The service listed this entry of a batch call under `Failed`: it was not done."""

    def __init__(self, code: str, message: str, sender_fault: bool) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.sender_fault = sender_fault


class Extension(StrEnum):
    """What became of one message in an extension call."""

    EXTENDED = "extended"
    RETRY = "retry"  # the call failed or ran out of time, or SQS failed the entry on its side
    REFUSED = "refused"  # SQS refused the entry (a receipt handle no longer valid)
    SETTLED = "settled"  # settled before the call was made: not sent


def _succeeded(ok: dict[str, Any] | None, failed: dict[str, Any] | None) -> bool:
    return ok is not None


# What the span of a batch call is named after (`<operation> <queue>`), by batcher name.
_OPERATIONS = {
    "delete": "DeleteMessageBatch",
    "visibility": "ChangeMessageVisibilityBatch",
    "send": "SendMessageBatch",
}
_Pending = tuple[dict[str, Any], asyncio.Future[T], TaskTrace]


class EntryBatcher(Generic[T]):
    """Collects single entries into batch calls; each submitter awaits its own result.

    A batch goes out when it has ten entries, when adding one would pass `max_bytes`
    (0: no limit; `size` measures an entry), or `linger_s` after its first entry. Each
    call is traced (with `destination`, the queue's URL) as a span of its own, linked to
    the traces of the tasks whose entries it carries.
    """

    def __init__(
        self,
        name: str,
        call: BatchCall,
        resolve: Resolve[T],
        linger_s: float = LINGER_S,
        *,
        max_bytes: int = 0,
        size: Callable[[dict[str, Any]], int] = lambda entry: 0,
        destination: str = "",
    ) -> None:
        self.name = name
        self._call = call
        self._resolve = resolve
        self._linger_s = linger_s
        self._max_bytes = max_bytes
        self._size = size
        self._span = (_OPERATIONS.get(name, name), destination)
        self._pending: list[_Pending[T]] = []
        self._pending_bytes = 0
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()

    def submit(self, entry: dict[str, Any], trace: TaskTrace | None = None) -> asyncio.Future[T]:
        """Queue one entry; the future gets what `resolve` makes of the service's answer.

        `trace`: the task the entry serves (default: the current one, `tracing.current`).
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        size = self._size(entry) if self._max_bytes else 0
        if self._pending and self._pending_bytes + size > self._max_bytes > 0:
            self._flush()
        self._pending.append((entry, future, trace or tracing.current()))
        self._pending_bytes += size
        if len(self._pending) >= SQS_BATCH_MAX:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self._linger_s, self._flush)
        return future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._pending:
            batch, self._pending = self._pending[:SQS_BATCH_MAX], self._pending[SQS_BATCH_MAX:]
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
        self._pending_bytes = 0

    async def _send(self, batch: list[_Pending[T]]) -> None:
        entries = [dict(entry, Id=str(i)) for i, (entry, _, _) in enumerate(batch)]
        operation, destination = self._span
        kind = "producer" if operation == "SendMessageBatch" else "client"
        try:
            with tracing.batch(operation, destination, [t for _, _, t in batch], kind):
                response = await self._call(entries)
        except Exception as exc:  # whatever became of the call, it became of every entry
            for _, future, _ in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        ok = {item["Id"]: item for item in response.get("Successful", [])}
        failed = {item["Id"]: item for item in response.get("Failed", [])}
        for item in failed.values():
            log.warning(
                Event.BATCH_ENTRY_FAILED,
                extra={"call": self.name, "code": item.get("Code"), "error": item.get("Message")},
            )
        for i, (_, future, _) in enumerate(batch):
            if future.done():
                continue
            try:
                future.set_result(self._resolve(ok.get(str(i)), failed.get(str(i))))
            except Exception as exc:
                future.set_exception(exc)

    async def drain(self) -> None:
        """Send everything queued and wait for the calls in flight."""
        self._flush()
        while self._sending:
            await asyncio.gather(*list(self._sending), return_exceptions=True)


class Batcher(EntryBatcher[bool]):
    """Deletes and visibility changes: each submitter learns whether its entry succeeded."""

    def __init__(
        self, name: str, call: BatchCall, linger_s: float = LINGER_S, destination: str = ""
    ) -> None:
        super().__init__(name, call, _succeeded, linger_s, destination=destination)


class SqsQueue:
    """One queue: the consumer side of a stage."""

    def __init__(self, client: Any, url: str) -> None:
        self.client = client
        self.url = url
        self.fifo = is_fifo(url)
        self._deletes = Batcher("delete", self._delete_batch, destination=url)
        self._visibility = Batcher("visibility", self._visibility_batch, destination=url)
        # Extension calls in flight, by message (given up on or not): a visibility settle
        # waits for them.
        self._extending: dict[Message, set[asyncio.Task[dict[str, Any]]]] = {}
        self._deferred: set[asyncio.Task[bool]] = set()
        self._hurry = asyncio.Event()  # set at shutdown: settles wait for nothing more

    async def receive(self, max_messages: int, wait_s: int, visibility_s: int) -> list[Message]:
        response = await self.client.receive_message(
            QueueUrl=self.url,
            MaxNumberOfMessages=max(1, min(max_messages, SQS_BATCH_MAX)),
            WaitTimeSeconds=wait_s,
            VisibilityTimeout=visibility_s,
            # The count, X-Ray's trace header (the parent of a task's trace when the
            # producer set no `traceparent`), and the group id (logged; kept by a redrive).
            MessageSystemAttributeNames=_SYSTEM_ATTRS,
            # The older name of the same list, for services that know only it (older moto,
            # some emulators): without the count, every delivery looks like a first.
            AttributeNames=_SYSTEM_ATTRS,
            MessageAttributeNames=["All"],
        )
        return [Message.from_sqs(raw) for raw in response.get("Messages", [])]

    # -- settles: the end of a hold ------------------------------------------------
    def delete(self, message: Message) -> asyncio.Future[bool]:
        message.settled = True
        return self._deletes.submit({"ReceiptHandle": message.receipt_handle}, message.trace)

    def set_visibility(self, message: Message, seconds: int) -> asyncio.Future[bool]:
        """Hand the message back (visible after `seconds`), after any extension under way."""
        message.settled = True
        entry = {"ReceiptHandle": message.receipt_handle, "VisibilityTimeout": int(seconds)}
        calls = self._extending.get(message)
        if not calls:
            return self._visibility.submit(entry, message.trace)
        task = asyncio.get_running_loop().create_task(self._after(set(calls), entry, message))
        self._deferred.add(task)
        task.add_done_callback(self._deferred.discard)
        return task

    async def _after(
        self, calls: set[asyncio.Task[dict[str, Any]]], entry: dict[str, Any], message: Message
    ) -> bool:
        hurry = asyncio.get_running_loop().create_task(self._hurry.wait())
        try:
            while (pending := {c for c in calls if not c.done()}) and not hurry.done():
                await asyncio.wait(pending | {hurry}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hurry.cancel()
        if time.monotonic() > message.hold_until - SETTLE_MARGIN_S:
            # Its visibility lapsed (or will before the call lands) while the wait went on:
            # it is back on the queue already, or another receive's.
            log.warning(Event.HAND_BACK_SKIPPED, extra={"message_id": message.message_id})
            return False
        return await self._visibility.submit(entry, message.trace)

    def hurry(self) -> None:
        """From now on settles wait for no extension in flight (shutdown: the time left
        is for the settles themselves)."""
        self._hurry.set()

    async def change_visibility_many(self, messages: list[Message], seconds: int) -> list[bool]:
        """One batch call per ten messages; returns, per message, whether it succeeded."""
        futures = [self.set_visibility(m, seconds) for m in messages]
        results = await asyncio.gather(*futures, return_exceptions=True)
        return [r is True for r in results]

    # -- extensions: the keeper's ----------------------------------------------------
    async def extend(
        self, messages: list[Message], seconds: int, timeout_s: float
    ) -> dict[Message, Extension]:
        """Extend up to ten held messages in one call, given up after `timeout_s`.

        Settled messages are left out. A call given up on is not cancelled (cut here, the
        request could still reach SQS, late): it stays in flight, and holds a settle of
        its messages back, until it ends.
        """
        if len(messages) > SQS_BATCH_MAX:
            raise ValueError(f"at most {SQS_BATCH_MAX} messages per extension call")
        results = {m: Extension.SETTLED for m in messages if m.settled}
        held = [m for m in messages if not m.settled]
        if not held:
            return results
        entries = [
            {"Id": str(i), "ReceiptHandle": m.receipt_handle, "VisibilityTimeout": int(seconds)}
            for i, m in enumerate(held)
        ]
        call = asyncio.get_running_loop().create_task(self._traced_extension(entries, held))
        for message in held:
            self._extending.setdefault(message, set()).add(call)
        call.add_done_callback(lambda done: self._forget(done, held))
        await asyncio.wait({call}, timeout=timeout_s)
        if not call.done():
            log.debug(Event.EXTENSION_CALL_FAILED, extra={"error": "no answer in time"})
            return results | {m: Extension.RETRY for m in held}
        try:
            response = call.result()
        except Exception as exc:
            log.debug(Event.EXTENSION_CALL_FAILED, extra={"error": repr(exc)})
            return results | {m: Extension.RETRY for m in held}
        return results | _extension_results(held, response)

    def _forget(self, call: asyncio.Task[dict[str, Any]], messages: Iterable[Message]) -> None:
        if not call.cancelled():
            call.exception()  # retrieved: a call given up on may fail with nobody awaiting it
        for message in messages:
            calls = self._extending.get(message)
            if calls is not None:
                calls.discard(call)
                if not calls:
                    del self._extending[message]

    async def drain(self) -> None:
        self.hurry()
        while self._deferred:
            await asyncio.gather(*list(self._deferred), return_exceptions=True)
        await asyncio.gather(self._deletes.drain(), self._visibility.drain())

    async def _traced_extension(
        self, entries: list[dict[str, Any]], messages: list[Message]
    ) -> dict[str, Any]:
        traces = [m.trace for m in messages]
        with tracing.batch("ChangeMessageVisibilityBatch", self.url, traces):
            return await self._visibility_batch(entries)

    async def _delete_batch(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = await self.client.delete_message_batch(
            QueueUrl=self.url, Entries=entries
        )
        return result

    async def _visibility_batch(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = await self.client.change_message_visibility_batch(
            QueueUrl=self.url, Entries=entries
        )
        return result

    async def arn(self) -> str:
        response = await self.client.get_queue_attributes(
            QueueUrl=self.url, AttributeNames=["QueueArn"]
        )
        return str(response["Attributes"]["QueueArn"])

    async def redrive_target(self) -> str | None:
        """URL of the queue's dead-letter queue from its redrive policy, if it has one."""
        policy = await self.redrive_policy()
        return policy.dlq_url if policy else None

    async def redrive_policy(self) -> RedrivePolicy | None:
        """The queue's redrive policy (its DLQ's URL, its maxReceiveCount), if it has one."""
        response = await self.client.get_queue_attributes(
            QueueUrl=self.url, AttributeNames=["RedrivePolicy"]
        )
        policy = response.get("Attributes", {}).get("RedrivePolicy")
        if not policy:
            return None
        doc = orjson.loads(policy)
        _, _, _, _, account, name = doc["deadLetterTargetArn"].split(":", 5)
        found = await self.client.get_queue_url(QueueName=name, QueueOwnerAWSAccountId=account)
        return RedrivePolicy(str(found["QueueUrl"]), int(doc["maxReceiveCount"]))


async def depth(client: Any, url: str) -> dict[str, int]:
    """The queue's approximate counts (DEPTH_ATTRIBUTES' keys): one GetQueueAttributes."""
    response = await client.get_queue_attributes(
        QueueUrl=url, AttributeNames=list(DEPTH_ATTRIBUTES.values())
    )
    attrs = response.get("Attributes", {})
    return {key: int(attrs.get(name, 0)) for key, name in DEPTH_ATTRIBUTES.items()}


def oldest_age_s(messages: Iterable[Message], now_s: float) -> float:
    """Seconds the oldest of `messages` spent since SQS took it (0 for none); a clock
    behind SQS's reads as 0, not less."""
    return max([0.0, *(now_s - m.sent_at_s for m in messages if m.sent_at_s)])


@dataclass(frozen=True)
class RedrivePolicy:
    dlq_url: str
    max_receive_count: int  # SQS moves a message to the DLQ on the receive after this many


def _extension_results(held: list[Message], response: dict[str, Any]) -> dict[Message, Extension]:
    results = dict.fromkeys(held, Extension.RETRY)
    for item in response.get("Successful", []):
        results[held[int(item["Id"])]] = Extension.EXTENDED
    for failed in response.get("Failed", []):
        # A sender fault (an invalid receipt handle) will not heal by trying again.
        if failed.get("SenderFault"):
            results[held[int(failed["Id"])]] = Extension.REFUSED
        log.warning(
            Event.VISIBILITY_EXTENSION_ENTRY_FAILED,
            extra={"code": failed.get("Code"), "error": failed.get("Message")},
        )
    return results


def _string_attr(value: str) -> dict[str, str]:
    return {"DataType": "String", "StringValue": xml_safe(value)}


def _utf8_size(text: str) -> int:
    return len(text.encode())


def _attribute_size(name: str, value: dict[str, Any]) -> int:
    """What one attribute adds to a message's size: SQS counts name, type and value."""
    data = value.get("StringValue")
    size = _utf8_size(data) if data is not None else len(value.get("BinaryValue", b""))
    return _utf8_size(name) + _utf8_size(value.get("DataType", "")) + size


def message_size(body: str, attributes: dict[str, Any]) -> int:
    """A message's size as SQS measures it against the queue's MaximumMessageSize."""
    return _utf8_size(body) + sum(_attribute_size(k, v) for k, v in attributes.items())


def _cut(text: str, max_bytes: int) -> str:
    """The longest prefix of `text` within `max_bytes` of UTF-8, ending on a whole character."""
    return text.encode()[: max(0, max_bytes)].decode("utf-8", "ignore")


@dataclass(frozen=True)
class DeadLetter:
    """The copy of a rejected message sent to the dead-letter queue."""

    body: str
    attributes: dict[str, Any]


def dead_letter_copy(
    message: Message,
    reason: str,
    detail: str,
    source_queue: str,
    max_message_bytes: int = SQS_DEFAULT_MAX_MESSAGE_BYTES,
    *,
    trace: dict[str, Any] | None = None,
) -> DeadLetter:
    """The DLQ copy of a rejected message: always sendable, always with its reason.

    Every string is held to what SQS accepts (characters outside the XML range are
    escaped) and the whole copy to the DLQ's `max_message_bytes`, which counts the body
    and every attribute. What fits is kept in this order: the reason and where the
    message came from; the trace context's `traceparent`; the body; the first
    `_DETAIL_MIN_CHARS` of the detail; the original attributes, as many as fit in count
    (SQS allows ten) and size; its `tracestate`; the rest of the detail. A body too large
    to sit beside the reason is cut, and `sqsinfer.body_truncated` gives its original size.

    The trace context is `trace` (the task's, as message attributes) when given, else the
    original message's own `traceparent` and `tracestate`.
    """
    context = _trace_context(trace or message.attributes)
    own = {
        REASON_ATTR: _string_attr(reason),
        SOURCE_ID_ATTR: _string_attr(message.message_id),
        SOURCE_QUEUE_ATTR: _string_attr(source_queue),
    }
    if TRACEPARENT in context:
        own[TRACEPARENT] = context[TRACEPARENT]
    room = max_message_bytes - message_size("", own)
    detail = xml_safe(detail)[:_DETAIL_MAX_CHARS] or "-"
    detail_floor = _attribute_size(DETAIL_ATTR, _string_attr(detail[:_DETAIL_MIN_CHARS]))
    body = xml_safe(message.body)
    if _utf8_size(body) + detail_floor > room:
        original = str(_utf8_size(message.body))
        own[BODY_TRUNCATED_ATTR] = _string_attr(original)
        room -= _attribute_size(BODY_TRUNCATED_ATTR, own[BODY_TRUNCATED_ATTR])
        body = _cut(body, room - detail_floor)
        own[DETAIL_ATTR] = _string_attr(detail[:_DETAIL_MIN_CHARS])
        return DeadLetter(body, own)
    room -= _utf8_size(body) + detail_floor
    slots = SQS_MAX_ATTRIBUTES - len(own) - 1
    kept = _kept_attributes(message.attributes, room, slots)
    state = context.get(TRACESTATE)
    if (
        state is not None
        and TRACEPARENT in own
        and len(kept) < slots
        and _attribute_size(TRACESTATE, state) <= room - message_size("", kept)
    ):
        kept[TRACESTATE] = state
    room -= message_size("", kept)
    # The floor is already counted: the detail may grow into what the attributes left.
    own[DETAIL_ATTR] = _string_attr(_cut(detail, room + detail_floor - _DETAIL_OVERHEAD))
    return DeadLetter(body, kept | own)


def _clean(value: dict[str, Any]) -> dict[str, Any]:
    clean = dict(value)
    if "StringValue" in clean:
        clean["StringValue"] = xml_safe(clean["StringValue"])
    return clean


def _trace_context(attributes: dict[str, Any]) -> dict[str, Any]:
    """The W3C trace context among message attributes, held to what SQS accepts."""
    return {
        name: _clean(attributes[name])
        for name in (TRACEPARENT, TRACESTATE)
        if isinstance(attributes.get(name), dict)
    }


def _kept_attributes(original: dict[str, Any], room: int, max_count: int) -> dict[str, Any]:
    """The original attributes that fit in `room` bytes, in order, at most `max_count`
    (sqsinfer's own and the trace context aside: the copy has its own of each)."""
    kept: dict[str, Any] = {}
    for name, value in original.items():
        if name.startswith(OWN_ATTR_PREFIX) or name in _TRACE_ATTRS or len(kept) >= max_count:
            continue
        clean = _clean(value)
        size = _attribute_size(name, clean)
        if size <= room:
            kept[name] = clean
            room -= size
    return kept


def dead_letter_attributes(
    message: Message,
    reason: str,
    detail: str,
    source_queue: str,
    max_message_bytes: int = SQS_DEFAULT_MAX_MESSAGE_BYTES,
) -> dict[str, Any]:
    """The attributes of `dead_letter_copy` (for a body known to fit)."""
    return dead_letter_copy(message, reason, detail, source_queue, max_message_bytes).attributes


class Sender:
    """Sends whole messages to a queue (the DLQ, or the next stage).

    The next stage's sender is given a client without SDK retries: a retry of a send
    whose answer was lost sends the message twice, so its caller must see each failure.
    """

    def __init__(self, client: Any, url: str) -> None:
        self.client = client
        self.url = url
        self.fifo = is_fifo(url)  # its sends need `FifoIds`

    async def send(
        self,
        body: str | bytes,
        attributes: dict[str, Any] | None = None,
        fifo: FifoIds | None = None,
    ) -> str:
        """Send one message; its MessageId. `fifo`: its ids, required by a FIFO queue."""
        with tracing.current().call("SendMessage", self.url, "producer"):
            response = await self.client.send_message(
                QueueUrl=self.url, **_sent(body, attributes, self._ids(fifo))
            )
        return str(response["MessageId"])

    def _ids(self, fifo: FifoIds | None) -> FifoIds | None:
        """The ids a send carries: a FIFO queue's own; to a standard queue the group alone
        (a fair queue's tenant), never a deduplication id, which it refuses."""
        if not self.fifo:
            return FifoIds(fifo.group_id, "") if fifo is not None and fifo.group_id else None
        if fifo is None:
            raise ValueError(f"a send to the FIFO queue {self.url} needs a group and a dedup id")
        return fifo

    async def drain(self) -> None:
        """Wait for sends gathered but not yet made (none here: each send is its own call)."""


def _sent(
    body: str | bytes, attributes: dict[str, Any] | None, fifo: FifoIds | None
) -> dict[str, Any]:
    """A send's entry: with a FIFO queue's ids when it has them."""
    if fifo is None:
        return send_entry(body, attributes)
    return send_entry(body, attributes, fifo.group_id, fifo.deduplication_id)


def send_entry(
    body: str | bytes,
    attributes: dict[str, Any] | None = None,
    group_id: str = "",
    deduplication_id: str = "",
) -> dict[str, Any]:
    """A message's fields as SendMessage and a SendMessageBatch entry both take them. A
    group id on a standard queue makes it a fair queue: each group is served in turn,
    so one group's backlog does not hold up the others (not a FIFO's order)."""
    entry: dict[str, Any] = {"MessageBody": body.decode() if isinstance(body, bytes) else body}
    if attributes:
        entry["MessageAttributes"] = attributes
    if group_id:
        entry[GROUP_ID_ATTR] = group_id
    if deduplication_id:  # a FIFO queue's (a standard queue refuses one)
        entry["MessageDeduplicationId"] = deduplication_id
    return entry


def _message_id(ok: dict[str, Any] | None, failed: dict[str, Any] | None) -> str:
    if ok is not None:
        return str(ok["MessageId"])
    failed = failed or {}
    raise EntryFailed(
        str(failed.get("Code", "NotListed")),
        str(failed.get("Message", "the batch answer did not list this entry")),
        bool(failed.get("SenderFault", False)),
    )


def _entry_size(entry: dict[str, Any]) -> int:
    return message_size(entry["MessageBody"], entry.get("MessageAttributes", {}))


class BatchSender(Sender):
    """Sends gathered into SendMessageBatch calls (ten at most, `SEND_LINGER_S` apart).

    Each send learns its own fate: its MessageId; `EntryFailed` when SQS listed it under
    `Failed` (it was not sent); or the error of the whole call, which may have taken
    effect for every entry in it, exactly as for a single send whose answer was lost.
    """

    def __init__(self, client: Any, url: str, linger_s: float = SEND_LINGER_S) -> None:
        super().__init__(client, url)
        self._batcher = EntryBatcher(
            "send",
            self._send_batch,
            _message_id,
            linger_s,
            max_bytes=SQS_BATCH_MAX_BYTES,
            size=_entry_size,
            destination=url,
        )

    async def send(
        self,
        body: str | bytes,
        attributes: dict[str, Any] | None = None,
        fifo: FifoIds | None = None,
    ) -> str:
        return await self._batcher.submit(_sent(body, attributes, self._ids(fifo)))

    async def drain(self) -> None:
        await self._batcher.drain()

    async def _send_batch(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = await self.client.send_message_batch(
            QueueUrl=self.url, Entries=entries
        )
        return result
