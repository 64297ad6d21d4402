"""Reading a dead-letter queue without consuming it: what is in it, by task, with reasons.

SQS has no way to look at a message without receiving it, and a received message is
hidden from everyone else until it is handed back. So each message is received with a
short hold (`hold_s`), kept track of, and every one read is handed back (visibility 0)
as soon as the pass over the queue ends, or when the run is interrupted (Ctrl-C,
SIGTERM). None is deleted. The hold is what lets a pass see every message: released at
once, the same few would come back in every receive and hide the rest.

A pass ends once it has read as many messages as the queue holds. Messages someone else
holds meanwhile (an audit killed before it handed its own back, a `redrive` at work) are
waited for until they come back, for up to `patience_s` and 4 s more (a hold that lapses
at the end of it is still seen); those still out are reported as unread. Each receive
adds one to a message's receive count, which matters only to a dead-letter queue with a
redrive policy of its own.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
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
    def __init__(self, sqs: Any, url: str, hold_s: int, patience_s: float) -> None:
        self.queue = SqsQueue(sqs, url)
        self.sqs = sqs
        self.hold_s = hold_s
        self.patience_s = patience_s
        self.held: dict[str, Message] = {}

    async def read(self) -> DeadLetterRead:
        """Every message of the queue once, each handed back before this returns."""
        found = DeadLetterRead(self.queue.url)
        try:
            await self._read_all(found)
        finally:
            found.released = await asyncio.shield(self._release())
        return found

    async def _read_all(self, found: DeadLetterRead) -> None:
        deadline = time.monotonic() + self.patience_s + _PAST_PATIENCE_S
        while True:
            # A long poll, however short: a receive without one asks only some of SQS's
            # servers, and may answer empty while messages wait on others.
            batch = await self.queue.receive(SQS_BATCH_MAX, _POLL_S, self.hold_s)
            for message in batch:
                if message.message_id not in self.held:
                    found.letters.append(dead_letter(message))
                # What handing it back needs, not its body: a lapsed hold's newer receipt.
                self.held[message.message_id] = Message(
                    message.message_id, message.receipt_handle, "", message.receive_count
                )
            if batch:
                continue
            found.unread = await self._held_elsewhere()
            if not found.unread or time.monotonic() > deadline:
                return
            await asyncio.sleep(_RECHECK_S)

    async def _held_elsewhere(self) -> int:
        """Messages in the queue this pass has not read: someone else holds them."""
        response = await self.sqs.get_queue_attributes(
            QueueUrl=self.queue.url, AttributeNames=list(_COUNTS)
        )
        counts = response.get("Attributes", {})
        total = sum(int(counts.get(name, 0)) for name in _COUNTS)
        return max(0, total - len(self.held))

    async def _release(self) -> bool:
        """Hand back every message read; False when some hand-back was not confirmed
        (those come back by themselves when the hold lapses)."""
        held, self.held = list(self.held.values()), {}
        confirmed = True
        for start in range(0, len(held), _RELEASE_CHUNK):
            chunk = held[start : start + _RELEASE_CHUNK]
            confirmed &= all(await self.queue.change_visibility_many(chunk, 0))
        await self.queue.drain()
        return confirmed
