"""Reading a dead-letter queue without consuming it: what is in it, by task, with reasons.

SQS has no way to look at a message without receiving it, and a received message is
hidden from everyone else until it is handed back. So each message is received with a
short hold (`hold_s`), kept track of, and every one read is handed back (visibility 0)
as soon as the pass over the queue ends, or when the run is interrupted (Ctrl-C,
SIGTERM). None is deleted. The hold is what lets a pass see every message: released at
once, the same few would come back in every receive and hide the rest.

A pass is bounded three ways, so that it ends however large the queue and however short
the hold:
- by the queue's approximate count at its start (visible and in flight): once it has read
  as many distinct messages, it ends (letters added meanwhile are for the next audit);
- by the message ids it has seen: a receive that brings back only messages already read
  means their holds lapsed before the pass could end (a pass longer than `hold_s`), and
  going on would only receive the same letters again, a receive count more each lap: it
  ends there, and says so;
- by a deadline (`deadline_s`): it ends with what it has read.
It ends at once too when a receive comes back empty and nobody else holds a message.
Messages someone else holds meanwhile (an audit killed before it handed its own back, a
`redrive` at work) are waited for until they come back, for up to `patience_s` and 4 s
more (a hold that lapses at the end of it is still seen); those still out are reported as
unread. The report says how many letters it read of how many the queue held, and why the
pass ended.

Each receive adds one to a message's receive count, which matters only to a dead-letter
queue with a redrive policy of its own: the receive after its `maxReceiveCount` moves the
message on. So a letter whose count has reached that limit is never let go before the
pass ends (its hold is extended as it runs out), never received twice by one audit; the
report counts such letters (`at_limit`): the next receive of each, by anyone, moves it.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from sqsinfer.aws.sqs import DETAIL_ATTR, SOURCE_QUEUE_ATTR, Message, SqsQueue
from sqsinfer.limits import SQS_BATCH_MAX
from sqsinfer.ops.redrive import reason_of

_RELEASE_CHUNK = 4 * SQS_BATCH_MAX
_RECHECK_S = 1.0
_DETAIL_KEPT_CHARS = 200  # of a letter's detail: enough to act on, little to hold
_POLL_S = 1
# Waited past `patience_s`: a hold that lapses at its very end is still followed by a
# whole receive and a count, however the polls fall against it (an audit killed at its
# read, run again at once with the same hold, waits for exactly one hold).
_PAST_PATIENCE_S = 2 * (_POLL_S + _RECHECK_S)
_COUNTS = ("ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible")
# A letter at its receive limit is held this long at least each time its hold is renewed:
# longer than a receive and a recheck, whatever `hold_s` is.
_KEEP_S = int(4 * (_POLL_S + _RECHECK_S))
# The longest one pass over a dead-letter queue may take, unless told otherwise.
DEFAULT_DEADLINE_S = 600.0


class Ended(StrEnum):
    """Why a pass over a dead-letter queue ended."""

    READ = "read"  # it read as many messages as the queue held at its start
    EMPTY = "empty"  # a receive came back empty (nobody else held any, or none came back)
    LAPPED = "lapped"  # holds lapsed before the pass ended: it came round to its own
    DEADLINE = "deadline"  # its deadline passed


@dataclass(frozen=True)
class DeadLetter:
    """One message in a dead-letter queue, as the audit needs it."""

    task_id: str  # "" when its body names none (malformed, or cut to fit)
    reason: str
    detail: str
    source_queue: str  # the queue it was rejected from ("" when the redrive policy moved it)
    input: str = ""  # its body's input, "" when it names none


@dataclass
class DeadLetterRead:
    url: str
    letters: list[DeadLetter] = field(default_factory=list)
    unread: int = 0  # held by someone else until the end of the pass
    released: bool = True  # every message read was handed back
    in_queue: int = 0  # the queue's approximate count at the start (visible and in flight)
    ended: Ended = Ended.EMPTY
    at_limit: int = 0  # letters received as often as the queue's own redrive policy allows

    @property
    def reasons(self) -> collections.Counter[str]:
        return collections.Counter(letter.reason for letter in self.letters)


def _attribute(message: Message, name: str) -> str:
    return str((message.attributes.get(name) or {}).get("StringValue") or "")


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def dead_letter(message: Message) -> DeadLetter:
    task_id = source = ""
    try:
        doc: Any = orjson.loads(message.body)
    except orjson.JSONDecodeError:
        doc = None
    if isinstance(doc, dict):
        task_id = _text(doc.get("task_id"))
        source = _text(doc.get("input"))
    return DeadLetter(
        task_id=task_id,
        reason=reason_of(message),
        detail=_attribute(message, DETAIL_ATTR)[:_DETAIL_KEPT_CHARS],
        source_queue=_attribute(message, SOURCE_QUEUE_ATTR),
        input=source,
    )


class DeadLetterReader:
    def __init__(
        self,
        sqs: Any,
        url: str,
        hold_s: int,
        patience_s: float,
        deadline_s: float = DEFAULT_DEADLINE_S,
    ) -> None:
        self.queue = SqsQueue(sqs, url)
        self.sqs = sqs
        self.hold_s = hold_s
        self.patience_s = patience_s
        self.deadline_s = deadline_s
        self.held: dict[str, Message] = {}
        # Letters at their queue's receive limit, and when each one's hold runs out.
        self.kept: dict[str, float] = {}
        self.limit: int | None = None

    async def read(self) -> DeadLetterRead:
        """Every message of the queue once at most, each handed back before this returns."""
        found = DeadLetterRead(self.queue.url)
        try:
            policy = await self.queue.redrive_policy()
            self.limit = policy.max_receive_count if policy else None
            found.in_queue = await self._in_queue()
            found.ended = await self._read_all(found)
        finally:
            found.released = await asyncio.shield(self._release())
        return found

    async def _read_all(self, found: DeadLetterRead) -> Ended:
        deadline = time.monotonic() + self.deadline_s
        patience = time.monotonic() + self.patience_s + _PAST_PATIENCE_S
        while time.monotonic() < deadline:
            # A long poll, however short: a receive without one asks only some of SQS's
            # servers, and may answer empty while messages wait on others.
            batch = await self.queue.receive(SQS_BATCH_MAX, _POLL_S, self.hold_s)
            new = self._take(batch, found)
            if new:
                found.unread = 0  # counted again at the next empty receive
            await self._keep_at_limit()
            if len(self.held) >= found.in_queue > 0:
                return Ended.READ
            if batch:
                if not new:
                    return Ended.LAPPED
                continue
            found.unread = await self._held_elsewhere()
            if not found.unread or time.monotonic() > patience:
                return Ended.EMPTY
            await asyncio.sleep(_RECHECK_S)
        return Ended.DEADLINE

    def _take(self, batch: list[Message], found: DeadLetterRead) -> int:
        """Note each message received; how many were new to this pass."""
        new = 0
        for message in batch:
            if message.message_id not in self.held:
                new += 1
                found.letters.append(dead_letter(message))
            # What handing it back needs, not its body: a lapsed hold's newer receipt.
            self.held[message.message_id] = Message(
                message.message_id, message.receipt_handle, "", message.receive_count
            )
            at_limit = self.limit is not None and message.receive_count >= self.limit
            if at_limit and message.message_id not in self.kept:
                found.at_limit += 1
                self.kept[message.message_id] = time.monotonic() + self.hold_s
        return new

    async def _keep_at_limit(self) -> None:
        """Extend the holds of letters at their receive limit that would lapse before the
        next receive ends (a lapsed one would be received again, and moved on)."""
        soon = time.monotonic() + _POLL_S + 2 * _RECHECK_S
        due = [self.held[m] for m, until in self.kept.items() if until < soon]
        if not due:
            return
        keep_s = max(self.hold_s, _KEEP_S)
        await self.queue.change_visibility_many(due, keep_s)
        for message in due:
            self.kept[message.message_id] = time.monotonic() + keep_s

    async def _in_queue(self) -> int:
        """The queue's approximate count of messages, visible and in flight."""
        response = await self.sqs.get_queue_attributes(
            QueueUrl=self.queue.url, AttributeNames=list(_COUNTS)
        )
        counts = response.get("Attributes", {})
        return sum(int(counts.get(name, 0)) for name in _COUNTS)

    async def _held_elsewhere(self) -> int:
        """Messages in the queue this pass has not read: someone else holds them."""
        return max(0, await self._in_queue() - len(self.held))

    async def _release(self) -> bool:
        """Hand back every message read; False when some hand-back was not confirmed
        (those come back by themselves when the hold lapses)."""
        held, self.held, self.kept = list(self.held.values()), {}, {}
        confirmed = True
        for start in range(0, len(held), _RELEASE_CHUNK):
            chunk = held[start : start + _RELEASE_CHUNK]
            confirmed &= all(await self.queue.change_visibility_many(chunk, 0))
        await self.queue.drain()
        return confirmed
