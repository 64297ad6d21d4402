"""What happens to one message, from parse to delete, and the one outcome it ends in.

    parse ─bad─▶ DLQ + delete (rejected)
    another message of this worker on the same output ─▶ wait for it to finish
    redelivered (or waited)? HEAD output ─exists─▶ another task's? DLQ (rejected)
                                                    : chain link, delete (duplicate)
    GET input → shared memory → wait for a process → decode, predict, encode (child)
    conditional PUT ─412─▶ another task's? DLQ (rejected) : chain link, delete (duplicate)
                    ─200─▶ chain link, delete (committed)
    transient failure ─▶ visibility backoff (retried); on the last receive the redrive
        policy allows: DLQ with reason `retries_exhausted` (rejected)
    shutdown ─▶ visibility 0 (released)
    an S3 event that names no new object (a test event, a removal) ─▶ delete (ignored)

On a FIFO queue, a message received after another of its group in the same receive waits
for that one's message to be settled, holding no slot (SQS hands a group's messages in
order, and no more of the group while one is held): deleted ─▶ its own turn; handed back
(retried or released) ─▶ it goes back too, unstarted (released), so the group's order holds.

A message of several S3 event records runs them one after another under its one slot,
each through the same steps to its own outcome, and is settled once all have ended: any
retried ─▶ handed back with the backoff (those committed are duplicates next time);
otherwise each rejected record is copied to the DLQ alone, and the message deleted.

A message holds one of the worker's slots until its result is committed (or its outcome
otherwise decided): the chain link and the delete run after `Held.release_slot`.

The write decides the outcome: a delivery whose conditional put stood ends as
`committed` whatever happens to its message afterwards, so across the fleet committed
outcomes equal outputs written. The worker module owns the lifecycle; this module owns
the steps and their outcomes; `chain` owns the link to the next stage.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from sqsinfer import backoff, events, lineage, shm, tracing
from sqsinfer.aws.s3 import ObjectInfo, Storage
from sqsinfer.aws.session import error_code
from sqsinfer.aws.sqs import DeadLetter, FifoIds, Message, Sender, SqsQueue, dead_letter_copy
from sqsinfer.compute import formats, inference
from sqsinfer.compute.errors import InputError
from sqsinfer.config import Settings
from sqsinfer.logs import Event
from sqsinfer.messages import MessageRules, S3Uri, Task, deduplication_id, message_group
from sqsinfer.metrics import Metrics, Phase
from sqsinfer.outcomes import Outcome
from sqsinfer.shm import SharedInput
from sqsinfer.tracing.api import NO_TRACE, StepEvent, TaskTrace
from sqsinfer.worker.chain import DedupLinker, Delivery, Linker, LinkNotSent, Written, WrittenAt
from sqsinfer.worker.pool import InferencePool

log = logging.getLogger("sqsinfer.task")

RETRIES_EXHAUSTED = "retries_exhausted"  # both in outcomes.REJECTION_REASONS
OUTPUT_CONFLICT = "output_conflict"
# A cancelled task waits this long for a step already under way whose effect cannot be
# undone (a DLQ copy, a next-stage send): the message is then deleted, not released.
_UNDER_WAY_WAIT_S = 3.0
# What a task never treats as its own failure: a cancel, and what stops the process.
NOT_TASK_FAILURES = (asyncio.CancelledError, KeyboardInterrupt, SystemExit, GeneratorExit)


def looks_first(always_head_output: bool, receive_count: int) -> bool:
    """Whether a delivery HEADs its output before the work (`sqsinfer plan` counts by it).

    A first delivery goes straight to the work: the conditional put decides a duplicate
    there (and checks the output's owner). A redelivery looks first and spares the GET
    and the compute of what is already done (as does one that waited for another message
    of this worker on the same output).
    """
    return always_head_output or receive_count > 1


async def _no_receive_pending() -> None:
    """The default `Pipeline.receive_ended`: no receive of its own to wait for."""


class Step(StrEnum):
    """How far a held message's task has come (the worker's shutdown reads it)."""

    RECEIVED = "received"
    WAITING_GROUP = "waiting_group"  # for the message before it in its FIFO group
    WAITING_OUTPUT = "waiting_output"  # for another message of this worker on the same output
    CHECKING = "checking"
    FETCHING = "fetching"
    WAITING = "waiting"  # for an idle inference process
    COMPUTING = "computing"
    COMMITTING = "committing"
    LINK_WAIT = "link_wait"  # for another delivery's chain link (released freely)
    LINKING = "linking"  # owns the chain link: sending the next stage's message
    REJECTING = "rejecting"  # copying the message to the DLQ
    RELEASING = "releasing"  # cancelled: handing its message back (visibility 0)
    SETTLED = "settled"  # its outcome is decided and its message handed back or deleted


# Steps after which shutdown lets a task finish instead of releasing its message.
STARTED_STEPS = frozenset(
    {Step.COMPUTING, Step.COMMITTING, Step.LINKING, Step.REJECTING, Step.RELEASING, Step.SETTLED}
)
# Steps short and worth landing even after the drain deadline (the commit grace). A
# message being handed back is one: cancelling it again would leave it held.
FINISHING_STEPS = frozenset(
    {Step.COMMITTING, Step.LINKING, Step.REJECTING, Step.RELEASING, Step.SETTLED}
)


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
    wrote: bool = False  # this delivery's conditional put of the output stood
    # A step whose effect outlives a cancel, and the outcome the message has once it is done.
    under_way: tuple[asyncio.Future[Any], Outcome] | None = None
    # The worker's: told once the message gives its slot back (`release_slot`), and when
    # it takes one again (`take_slot`).
    on_release: Callable[[Held], None] | None = field(default=None, repr=False)
    on_take: Callable[[Held], None] | None = field(default=None, repr=False)
    slot_released: bool = False
    releasing: bool = False  # the worker cancelled it to hand its message back
    # A message of several records: how each has ended so far (None: one task).
    records: Records | None = None
    # The span of the record running now, and when it started (a message of several).
    record_trace: TaskTrace | None = field(default=None, repr=False)
    record_started: float = 0.0
    # On a FIFO queue: the message before it in its group, of the same receive (the
    # worker's), and set once this one is settled, for the one after it.
    after: Held | None = field(default=None, repr=False)
    done: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    # Which delivery wrote the output and how old it was when this one found or wrote it:
    # the chain link's intent, and on a FIFO next stage whether SQS still deduplicates.
    written: Written | None = None
    # What it held in flight: its input's segment and its output (the auto limit's bytes).
    held_bytes: int = 0

    def release_slot(self) -> None:
        """The input is no longer needed and the outcome decided: what is left (the chain
        link, the delete) runs without a slot. Idempotent. A message of several records
        keeps its slot until the last of them has ended."""
        if self.records is not None and self.records.running:
            return
        if not self.slot_released:
            self.slot_released = True
            if self.on_release is not None:
                self.on_release(self)

    @property
    def trace(self) -> TaskTrace:
        """Its task's trace (`NO_TRACE` while tracing is off): the message's, or
        the running record's span within it."""
        return self.message.trace if self.record_trace is None else self.record_trace

    def take_slot(self) -> None:
        """Hold a slot again after giving it back to wait (`Step.WAITING_OUTPUT`). The
        count may pass the limit for a while: the worker receives nothing until it is
        back under it."""
        if self.slot_released:
            self.slot_released = False
            if self.on_take is not None:
                self.on_take(self)

    def compute_s(self) -> float | None:
        """Seconds an inference process spent on this message (None: it computed nothing)."""
        phases = (Phase.HANDOFF, Phase.DECODE, Phase.INFER, Phase.ENCODE)
        if Phase.INFER.value not in self.timings:
            return None
        return sum(self.timings.get(p.value, 0.0) for p in phases)

    @property
    def started(self) -> bool:
        return self.step in STARTED_STEPS

    @property
    def deleted(self) -> bool:
        """Whether its message was settled by a delete (not handed back)."""
        return self.step == Step.SETTLED and self.outcome != Outcome.RETRIED

    def final(self, outcome: Outcome) -> Outcome:
        """The write decides: a delivery that wrote the output is `committed`, however its
        message was settled (a failed delete, a retried link, the DLQ on its last receive)."""
        return Outcome.COMMITTED if self.wrote else outcome


@dataclass(frozen=True)
class RecordEnd:
    """How one record of a message of several ended."""

    record: events.Record
    task_id: str | None
    outcome: Outcome
    reason: str = ""
    detail: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    trace: TaskTrace = NO_TRACE  # its span (NO_TRACE: it never ran)
    seconds: float = 0.0  # from its start to its end
    # Its work is not done: the message goes back for it. Not read from `outcome`, which
    # says `committed` for a record whose write stood even when its link then failed.
    again: bool = False


@dataclass
class Records:
    """The records of one message, run one after another: while one runs, its settles
    (a delete, a DLQ copy, a hand-back) are noted here, not made."""

    body: events.Body
    ended: list[RecordEnd] = field(default_factory=list)
    detail: str = ""  # why the running record was rejected or retried
    stopped: bool = False  # no record runs any more: the message itself is settled next

    @property
    def running(self) -> bool:
        return not self.stopped and len(self.ended) < len(self.body.records)

    def note(self, detail: str, outcome: Outcome) -> Outcome:
        self.detail = detail
        return outcome

    def end(self, held: Held, outcome: Outcome) -> None:
        """The running record ended in `outcome` (committed if its write stood)."""
        n, count = len(self.ended) + 1, len(self.body.records)
        record = self.body.records[n - 1]
        detail = f"record {n} of {count}: {self.detail}" if self.detail else ""
        task_id = held.task.task_id if held.task else None
        final = held.final(outcome)
        trace, held.record_trace = held.record_trace or NO_TRACE, None
        seconds = time.monotonic() - held.record_started if trace is not NO_TRACE else 0.0
        again = outcome == Outcome.RETRIED
        self.ended.append(
            RecordEnd(
                record, task_id, final, held.reason, detail, held.timings, trace, seconds, again
            )
        )
        self.detail = ""

    def end_rest(self, held: Held, outcome: Outcome) -> None:
        """Every record not ended yet ends as the message did (the running one committed
        if its write stood): cancelled part-way, the message was handed back."""
        self.stopped = True
        while len(self.ended) < len(self.body.records):
            self.end(held, outcome)
            held.task, held.wrote, held.timings = None, False, {}

    def rejected(self) -> list[RecordEnd]:
        return [e for e in self.ended if e.outcome == Outcome.REJECTED]

    def hand_back(self) -> None:
        """The message goes back for a record to be retried: a record refused meanwhile is
        not copied to the DLQ now (it will be once the message is settled), so it ends
        `retried` with its reason, as the message does."""
        self.ended = [
            dataclasses.replace(e, outcome=Outcome.RETRIED) if e.outcome == Outcome.REJECTED else e
            for e in self.ended
        ]


# -- a task's trace: where its spans open and close ---------------------------------
# A task's span opens at its receive (the worker's tracer) and a record's at the record's
# start; each step's span is its `Timer`'s; a task's (or a record's) ends at its outcome
# (`end_trace`), else when its handling ends (`Pipeline.handle`).
# The steps that are spans of their task, by phase (the child's decode, predict and encode
# are events of `compute`, where they ran: `compute_events`).
STEP_SPANS = {
    Phase.S3_GET: "GET input",
    Phase.WAIT_PROCESS: "wait for a process",
    Phase.COMMIT: "PUT output",
    Phase.CHAIN: "chain link",
}
_CHILD_STEPS = (("decode_s", "decode"), ("infer_s", "predict"), ("encode_s", "encode"))
_FAILED = frozenset({Outcome.REJECTED, Outcome.RETRIED})  # a span with an error status


class Timer:
    """Measures one step of the held task, once: into its timings and the phase histogram
    (a `Phase`), and as its span in the task's trace (a `STEP_SPANS` phase, or `span`).
    Where the pipeline opens and closes the spans of a task's steps."""

    def __init__(self, held: Held, metrics: Metrics, phase: Phase | None, span: str = "") -> None:
        self.held, self.metrics, self.phase = held, metrics, phase
        self.span = span or (STEP_SPANS.get(phase, "") if phase is not None else "")

    def __enter__(self) -> None:
        self.started = time.perf_counter()

    def __exit__(self, error: type[BaseException] | None, *_: object) -> None:
        # A cancel too: the step did not finish.
        self.record(time.perf_counter() - self.started, error=error.__name__ if error else "")

    def record(
        self,
        seconds: float,
        *,
        attributes: dict[str, Any] | None = None,
        events: tuple[StepEvent, ...] = (),
        error: str = "",
    ) -> None:
        if self.phase is not None:
            self.held.timings[self.phase.value] = round(seconds, 6)
            self.metrics.observe(self.phase, seconds)
        if self.span:
            self.held.trace.step(
                self.span, seconds, attributes=attributes, events=events, error=error
            )


def compute_events(total_s: float, child: dict[str, Any]) -> tuple[StepEvent, ...]:
    """The child's steps as events of `compute` (the task's time in a process, hand-over
    there and back included), where they ran.
    The child measures each step's length, not its clock: the steps are laid end to end,
    the time of the hand-over (there and back) split either side of them."""
    spent_s = sum(float(child[key]) for key, _ in _CHILD_STEPS)
    at_s = max(0.0, total_s - spent_s) / 2
    found = []
    for key, name in _CHILD_STEPS:
        found.append((name, at_s, {"sqsinfer.duration_s": float(child[key])}))
        at_s += float(child[key])
    return tuple(found)


def end_trace(
    trace: TaskTrace, outcome: Outcome, reason: str, seconds: float, task: Task | None
) -> None:
    """End a task's span (or a record's) at its outcome, `seconds` after it started."""
    if trace.recording:
        facts = {"sqsinfer.outcome": str(outcome)} | ({"sqsinfer.reason": reason} if reason else {})
        if task is not None:
            facts |= {"sqsinfer.task_id": task.task_id, "sqsinfer.input": str(task.input)}
            facts["sqsinfer.output"] = str(task.output)
        trace.note(facts)
    trace.end(seconds, (reason or str(outcome)) if outcome in _FAILED else "")


def end_records_trace(trace: TaskTrace, outcomes: list[Outcome], seconds: float) -> None:
    """End the span of a message of several records at the outcomes they ended in."""
    if trace.recording:
        listed = [str(outcome) for outcome in outcomes]
        trace.note({"sqsinfer.records": len(listed), "sqsinfer.outcomes": listed})
    failed = sum(outcome in _FAILED for outcome in outcomes)
    trace.end(seconds, f"{failed} of {len(outcomes)} records" if failed else "")


class OutputVanished(Exception):
    """The output existed at the conditional put and not at the HEAD after it."""


class OutputLocks:
    """One lock per output key in flight in this worker: a second message for an output
    waits for the first to finish, then looks again (instead of computing it twice)."""

    def __init__(self) -> None:
        self._locks: dict[S3Uri, tuple[asyncio.Lock, int]] = {}

    def busy(self, uri: S3Uri) -> bool:
        return uri in self._locks

    @contextlib.asynccontextmanager
    async def hold(self, uri: S3Uri) -> AsyncIterator[None]:
        lock, users = self._locks.get(uri, (asyncio.Lock(), 0))
        self._locks[uri] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[uri]
            if users == 1:
                del self._locks[uri]
            else:
                self._locks[uri] = (lock, users - 1)


@dataclass
class Pipeline:
    settings: Settings
    rules: MessageRules
    storage: Storage
    queue: SqsQueue
    dead_letters: Sender
    next_stage: Sender | None  # its client must not retry sends: `chain` counts each lost answer
    pool: InferencePool
    metrics: Metrics
    producer: lineage.Producer  # what made this worker's outputs: their lineage
    max_receive_count: int | None = None  # the queue's redrive policy; None: retried forever
    outputs: OutputLocks = field(default_factory=OutputLocks)
    # The worker's: returns once the receive it has pending now (if any) has ended. A
    # hand-back waits for it (see `_hand_back`).
    receive_ended: Callable[[], Awaitable[None]] = _no_receive_pending

    def __post_init__(self) -> None:
        s, sender = self.settings, self.next_stage
        # A FIFO next stage drops a second send itself: no marker (see `chain`).
        self.linker = (
            Linker(self.storage, sender, self.metrics, s.chain_settle_s)
            if sender is not None and not sender.fifo
            else None
        )
        self.dedup_linker = (
            DedupLinker(sender, self.metrics, s.chain_dedup_window_s)
            if sender is not None and sender.fifo
            else None
        )

    # -- the whole life of one message ------------------------------------------------
    async def handle(self, held: Held) -> Outcome:
        """Run the task and settle the message. Never raises, except a second cancel."""
        tracing.enter(held.trace)  # what it sends carries its trace; batch calls link to it
        try:
            return await self._handle(held)
        finally:
            self._end_traces(held)  # however it ended: no span is left open
            held.after = None
            held.done.set()  # the next of its FIFO group may look at how it was settled

    @staticmethod
    def _end_traces(held: Held) -> None:
        if held.records is not None:
            for end in held.records.ended:
                end.trace.end()
        if held.record_trace is not None:
            held.record_trace.end()
        held.message.trace.end()

    async def _handle(self, held: Held) -> Outcome:
        try:
            if held.after is not None and not await self._group_turn(held, held.after):
                outcome = await self._hand_back(held)
            else:
                outcome = await self._process(held, self._work)
        except asyncio.CancelledError:
            # The message must still be handed back even though this task was cancelled.
            outcome = await asyncio.shield(self._settle_cancelled(held))
        if held.records is not None:  # each record has its own outcome
            held.records.stopped = True
            held.release_slot()
            self._record_each(held, held.records)
            self._ended(held)  # the last record's delivery (each before it was told at its end)
            return outcome
        held.release_slot()
        outcome = held.final(outcome)
        self._record(held, outcome)
        self._ended(held)
        return outcome

    async def _group_turn(self, held: Held, before: Held) -> bool:
        """Wait, holding no slot, for the message before this one in its FIFO group to be
        settled. True when it was deleted: this one's turn. False when it went back: this
        one must go back unstarted too (SQS keeps the group's order while both are held,
        and hands the earlier one first)."""
        held.step = Step.WAITING_GROUP
        held.release_slot()
        await before.done.wait()
        if not before.deleted:
            log.info(
                Event.GROUP_HANDED_BACK, extra=self._ids(held) | {"group": held.message.group_id}
            )
            return False
        held.step = Step.RECEIVED
        held.take_slot()
        # Its time starts with its turn: the keeper's max_task_time_s is for its own work.
        held.message.received_at = time.monotonic()
        return True

    async def _process(self, held: Held, work: Callable[[Held], Awaitable[Outcome]]) -> Outcome:
        """`work` to its outcome: a permanent problem rejected, any other error retried."""
        try:
            try:
                return await work(held)
            except InputError as exc:
                return await self._reject(held, exc.reason, exc.detail)
        except BaseException as exc:  # transient by default: bounded by the redrive policy
            # Not only Exception: a native extension's panic (pyo3's PanicException, from
            # obstore) is a BaseException, and must end in an outcome like any failure.
            # Only what asks the task or the process to stop goes on.
            if isinstance(exc, NOT_TASK_FAILURES):
                raise
            code = exc.code if isinstance(exc, LinkNotSent) else error_code(exc)
            held.reason = code or type(exc).__name__
            log.warning(Event.TASK_FAILED, extra=self._ids(held) | {"error": str(exc)})
            return await self._retry(held, f"{held.reason}: {exc}")

    async def _work(self, held: Held) -> Outcome:
        body = events.parse_body(held.message.body, self.rules)
        self._count_events(held, body)
        if len(body.records) > 1:
            return await self._run_records(held, body)
        return await self._run_item(held, body.records[0].item)

    async def _run_item(self, held: Held, item: Task | events.Ignored | InputError) -> Outcome:
        """One task of a message (or an event it ignores, or why it is refused), settled."""
        if isinstance(item, InputError):
            raise item
        if isinstance(item, events.Ignored):
            held.trace.note({"sqsinfer.event": item.event})
            log.info(Event.EVENT_IGNORED, extra=self._ids(held) | {"event": item.event})
            return await self._finish(held, Outcome.IGNORED)
        held.task = item
        return await self._finish(held, await self._run(held, item))

    async def _run(self, held: Held, task: Task) -> Outcome:
        waited = self.outputs.busy(task.output)
        if waited:
            # Waiting needs neither its input nor a process: the slot goes to another
            # message meanwhile, and is taken again (above the limit for a while, if
            # need be) once the output is this message's to look at.
            held.step = Step.WAITING_OUTPUT
            held.release_slot()
        async with self.outputs.hold(task.output):
            if waited:
                held.take_slot()
            return await self._run_alone(held, task, look_first=waited or self._redelivered(held))

    def _redelivered(self, held: Held) -> bool:
        """Whether the output may exist already, so that a HEAD is worth its call."""
        return looks_first(self.settings.always_head_output, held.message.receive_count)

    async def _run_alone(self, held: Held, task: Task, *, look_first: bool) -> Outcome:
        """The task, with no other message of this worker on its output meanwhile."""
        held.step = Step.CHECKING
        existing = None
        if look_first:
            with Timer(held, self.metrics, None, "HEAD output"):
                existing = await self.storage.head(task.output)
        if existing is not None:
            held.release_slot()
            self._check_existing(held, task, existing)
            held.written = self._found(existing)
            await self._chain(held, task)
            return Outcome.DUPLICATE
        held.step = Step.FETCHING
        with Timer(held, self.metrics, Phase.S3_GET):
            shared = await self.storage.get_shared(
                task.input, self.settings.max_input_bytes, task.input_version
            )
        with shared:
            result = await self._infer(held, task, shared.name, shared.size)
        held.held_bytes = shm.segment_bytes(shared.size) + len(result["body"])
        held.step = Step.COMMITTING
        with Timer(held, self.metrics, Phase.COMMIT):
            held.wrote = await self._commit(held, task, result, shared)
        if held.wrote and self.linker is not None:
            self.linker.wrote(held.delivery_id)  # its link is its own from the write on
        held.release_slot()
        await self._chain(held, task)
        return Outcome.DUPLICATE  # committed when it wrote

    async def _commit(
        self, held: Held, task: Task, result: dict[str, Any], source: SharedInput
    ) -> bool:
        """The conditional put of the output. True when this delivery's write stands."""
        content_type = formats.named(task.output_format).content_type
        metadata = self._metadata(held, result["sha256"], source)
        # If it lands, it is younger than this.
        held.written = Written(held.delivery_id, WrittenAt(0.0))
        if await self.storage.commit(task.output, result["body"], metadata, content_type):
            return True
        # A 412 can answer our own write: the SDK retries a put whose answer was lost in
        # a dropped connection. The delivery id in the metadata tells the two apart.
        existing = await self.storage.head(task.output)
        if existing is None:  # written and deleted again meanwhile: look again later
            raise OutputVanished(f"{task.output} answered 412, then was gone")
        if existing.metadata.get(lineage.DELIVERY) == held.delivery_id:
            return True
        self._check_existing(held, task, existing)
        held.written = self._found(existing)
        return False

    @staticmethod
    def _found(existing: ObjectInfo) -> Written:
        """Another delivery's output: its writer, and its age by S3's clock."""
        return Written(existing.metadata.get(lineage.DELIVERY, ""), WrittenAt(existing.age_s))

    def _check_existing(self, held: Held, task: Task, existing: ObjectInfo) -> None:
        """An existing output is this task's (a duplicate) or a conflict: never handed on.
        An event's output is this event's only when made from the same input and version.

        One of this task's written by another model stays a duplicate (the task is done;
        its output is not this worker's to replace), counted and logged: a new model
        meant to write beside the old one needs a per-model output prefix.
        """
        owner = existing.metadata.get(lineage.TASK_ID)
        if owner != task.task_id:
            whose = f"task {owner!r}" if owner else "no task (no task-id metadata)"
            raise InputError(
                OUTPUT_CONFLICT, f"{task.output} already exists and belongs to {whose}"
            )
        other_input = events.provenance_conflict(task, existing.metadata)
        if other_input:
            raise InputError(OUTPUT_CONFLICT, other_input)
        model = existing.metadata.get(lineage.MODEL_SHA256, "")
        if model and model != self.producer.model_sha256:
            self.metrics.other_model_outputs.inc()
            log.warning(
                Event.OUTPUT_OF_ANOTHER_MODEL,
                extra=self._ids(held)
                | {
                    "output": str(task.output),
                    "its_model": model,
                    "model": self.producer.model_sha256,
                },
            )

    async def _infer(self, held: Held, task: Task, shm_name: str, size: int) -> dict[str, Any]:
        held.step = Step.WAITING
        waited = time.perf_counter()

        def started() -> None:  # a process took it (alone, or with other small tasks)
            Timer(held, self.metrics, Phase.WAIT_PROCESS).record(time.perf_counter() - waited)
            held.step = Step.COMPUTING

        job = inference.Job(
            shm_name, size, task.input_format, task.output_format, task.input_options
        )
        result = await self.pool.compute(job, started)
        # Coalesced, a task's infer is its rows' share of the call, and its handoff its
        # share of the call's round trip beyond what the process spent: the tasks' phases
        # (and compute spans) add up to the process's time. Alone, the round trip.
        spent = result["decode_s"] + result["infer_s"] + result["encode_s"]
        total = result["handoff_s"] + spent
        rows = {"sqsinfer.rows": int(result["rows"])}
        events = compute_events(total, result)
        Timer(held, self.metrics, None, "compute").record(total, attributes=rows, events=events)
        for phase in (Phase.DECODE, Phase.INFER, Phase.ENCODE, Phase.HANDOFF):
            Timer(held, self.metrics, phase).record(result[f"{phase}_s"])
        self.metrics.process_busy.inc(spent)
        self.metrics.rows.inc(result["rows"])
        return result

    # -- chaining ---------------------------------------------------------------------
    async def _chain(self, held: Held, task: Task) -> None:
        """Hand the output to the next stage: see `chain` for how it is sent once in effect.

        Waiting for another delivery's link happens here, holding the message (the
        visibility keeper extends it), so a wait never spends a receive.
        """
        delivery = Delivery(
            held.delivery_id, held.message.message_id, task.task_id, self._ids(held)
        )
        if self.dedup_linker is not None:
            assert held.written is not None  # set where the output was found or written
            held.step = Step.LINKING
            with Timer(held, self.metrics, Phase.CHAIN):
                sending = self.dedup_linker.hand_on(delivery, task, held.written.at)
                await self._under_way(held, sending, Outcome.DUPLICATE)
            return
        if self.linker is None:
            return

        def waiting() -> None:
            held.step = Step.LINK_WAIT

        with Timer(held, self.metrics, Phase.CHAIN):
            assert held.written is not None
            claim = await self.linker.claim(delivery, task.output, waiting, held.written)
            if claim is None:
                return
            held.step = Step.LINKING
            sending = self.linker.hand_on(delivery, task, claim)
            await self._under_way(held, sending, Outcome.DUPLICATE)

    # -- outcomes ---------------------------------------------------------------------
    async def _under_way(self, held: Held, step: Awaitable[Any], then: Outcome) -> Any:
        """Run a step whose effect a cancel cannot undo; once it is done, so is the message.

        A cancel does not stop it: the cancelled task waits for it (briefly) and, when it
        succeeded, deletes the message as `then` instead of handing it back.
        """
        future = asyncio.ensure_future(step)
        held.under_way = (future, then)
        try:
            return await asyncio.shield(future)
        finally:
            if future.done():
                held.under_way = None

    async def _finish(self, held: Held, outcome: Outcome) -> Outcome:
        if held.records is not None and held.records.running:
            return outcome  # the message is deleted once all its records have ended
        held.outcome = outcome
        held.step = Step.SETTLED
        held.release_slot()  # the delete holds no slot
        try:
            with Timer(held, self.metrics, None, "delete"):
                deleted = await asyncio.shield(self.queue.delete(held.message))
        except Exception as exc:  # the outcome stands: the write (or the copy) decided it
            log.warning(Event.DELETE_FAILED, extra=self._ids(held) | {"error": str(exc)})
            deleted = False
        if not deleted:  # it will come back, find its output and end as a duplicate
            log.warning(Event.DELETE_NOT_CONFIRMED, extra=self._ids(held))
        return outcome

    async def _reject(self, held: Held, reason: str, detail: str) -> Outcome:
        held.reason = reason
        if held.records is not None and held.records.running:
            return held.records.note(detail, Outcome.REJECTED)  # copied once all have ended
        held.step = Step.REJECTING
        held.release_slot()
        copy = dead_letter_copy(
            held.message,
            reason,
            detail,
            self.queue.url,
            self.rules.dead_letter_max_bytes,
            trace=held.trace.outgoing(),
        )
        # Copy first, delete second: a crash in between leaves a copy, never nothing.
        task_id = held.task.task_id if held.task else None
        ids = self._dead_letter_ids(held, copy, task_id)
        sending = self.dead_letters.send(copy.body, copy.attributes, ids)
        await self._under_way(held, sending, Outcome.REJECTED)
        self._rejected(held, detail)
        return await self._finish(held, Outcome.REJECTED)

    def _dead_letter_ids(self, held: Held, copy: DeadLetter, task_id: str | None) -> FifoIds | None:
        """A FIFO DLQ's ids for a copy: the message's own group (a redrive keeps its
        order), else its task's; one copy of each message (or record) in SQS's window. On
        a standard DLQ, a fair queue's message keeps its group (its tenant) alone, as the
        redrive policy's move and `sqsinfer redrive` keep it."""
        message = held.message
        if not self.dead_letters.fifo:
            return FifoIds(message.group_id, "") if message.group_id else None
        group = message.group_id or message_group(task_id or message.message_id)
        return FifoIds(group, deduplication_id(f"{message.message_id}\n{copy.body}"))

    def _rejected(self, held: Held, detail: str) -> None:
        self.metrics.rejections.labels(held.reason).inc()
        log.info(
            Event.MESSAGE_REJECTED,
            extra=self._ids(held) | {"reason": held.reason, "detail": detail},
        )

    def retry_delay_s(self, receive_count: int) -> int:
        """The visibility delay of a retry: doubles with each receive of the message."""
        s = self.settings
        return backoff.visibility_delay_s(receive_count, s.retry_base_s, s.retry_max_s)

    def _last_receive(self, held: Held) -> bool:
        limit = self.max_receive_count
        return limit is not None and held.message.receive_count >= limit

    async def _retry(self, held: Held, error: str) -> Outcome:
        held.release_slot()
        if held.records is not None and held.records.running:
            if self._last_receive(held):  # as for a message: with a reason, not moved bare
                return await self._reject(held, RETRIES_EXHAUSTED, error)
            return held.records.note(error, Outcome.RETRIED)
        if self._last_receive(held):
            # The redrive policy would move it on its next receive, without a reason.
            reason = held.reason
            try:
                return await self._reject(held, RETRIES_EXHAUSTED, error)
            except Exception as exc:  # then the redrive policy moves it after all
                held.reason = reason
                log.warning(Event.DLQ_COPY_FAILED, extra=self._ids(held) | {"error": str(exc)})
        return await self._back_off(held)

    async def _back_off(self, held: Held) -> Outcome:
        """Make the message visible again after the backoff of its receive count."""
        held.outcome = Outcome.RETRIED
        delay = self.retry_delay_s(held.message.receive_count)
        try:
            await asyncio.shield(self.queue.set_visibility(held.message, delay))
        except Exception as exc:  # then it comes back when its current visibility lapses
            log.warning(Event.RETRY_DELAY_NOT_SET, extra=self._ids(held) | {"error": str(exc)})
        return Outcome.RETRIED

    async def _settle_cancelled(self, held: Held) -> Outcome:
        """Hand the message of a cancelled task back, unless its work is already done."""
        run = held.records
        if run is None or not run.running:
            return await self._settle_message_cancelled(held)
        # Cancelled during one of several records: the message goes back whatever that
        # record's step (a link under way may land first), and the records not ended yet
        # end as it does; those committed are duplicates on its next delivery.
        pending = held.under_way
        if pending is not None:
            await self._under_way_done(held)
            held.under_way = None  # it settles no message: the message goes back
        run.stopped = True
        outcome = await self._settle_message_cancelled(held)
        run.end_rest(held, outcome)
        if pending is not None and not pending[0].done():
            held.under_way = pending  # `_ended` waits for it before its link may be taken
        return outcome

    async def _settle_message_cancelled(self, held: Held) -> Outcome:
        if held.step == Step.SETTLED and held.outcome is not None:
            return held.outcome  # already deleted (or its deletion is under way)
        if held.under_way is not None and await self._under_way_done(held):
            _, then = held.under_way
            if then == Outcome.REJECTED:
                self._rejected(held, "copied to the DLQ while shutting down")
            return await self._finish(held, then)
        if held.expired:  # over max_task_time_s: a transient failure, retried (or, last, the DLQ)
            held.reason = "max_task_time"
            detail = f"over max_task_time_s ({self.settings.max_task_time_s:g} s)"
            return await self._retry(held, detail)
        return await self._hand_back(held)

    async def release(self, held: Held) -> Outcome:
        """Hand back a message whose work never started (one the worker's last receive
        brought in after shutdown began), and record its outcome."""
        try:
            outcome = await self._hand_back(held)
            self._record(held, outcome)
            return outcome
        finally:
            held.trace.end()

    async def _hand_back(self, held: Held) -> Outcome:
        """Visibility 0, once the worker's own pending receive has ended: a long poll
        still open at SQS would take the message straight back, hide it for a whole
        visibility timeout and spend one of its receives."""
        held.step = Step.RELEASING
        await self.receive_ended()
        try:
            await self.queue.set_visibility(held.message, 0)
        except Exception as exc:  # it becomes visible again when its timeout lapses
            log.warning(Event.HAND_BACK_FAILED, extra=self._ids(held) | {"error": str(exc)})
        return Outcome.RELEASED

    @staticmethod
    async def _under_way_done(held: Held) -> bool:
        """Whether the step under way succeeded, waiting for it a little."""
        assert held.under_way is not None
        future, _ = held.under_way
        await asyncio.wait({future}, timeout=_UNDER_WAY_WAIT_S)
        return future.done() and not future.cancelled() and future.exception() is None

    # -- a message of several records -------------------------------------------------
    async def _run_records(self, held: Held, body: events.Body) -> Outcome:
        """Each record through the steps of a message of its own (its settles noted), one
        after another under the message's slot; then the message is settled."""
        run = held.records = Records(body)
        try:
            for n, record in enumerate(body.records, start=1):
                held.task, held.wrote, held.reason, held.timings = None, False, "", {}
                held.delivery_id = uuid.uuid4().hex  # each record's write is its own
                self._trace_record(held, n, len(body.records))
                run_it = functools.partial(self._run_item, item=record.item)
                run.end(held, await self._process(held, run_it))
                self._ended(held)  # nothing of this record's delivery runs any more
        finally:
            run.stopped = True
            tracing.enter(held.message.trace)
        if any(e.again for e in run.ended):
            run.hand_back()
            held.release_slot()
            return await self._back_off(held)
        rejected = run.rejected()
        if rejected:
            held.step = Step.REJECTING
            held.release_slot()
            # A cancel now waits for the copies, then deletes the message (`_under_way`).
            await self._under_way(held, self._copy_records(held, rejected), Outcome.DUPLICATE)
        return await self._finish(held, Outcome.DUPLICATE)

    @staticmethod
    def _trace_record(held: Held, n: int, count: int) -> None:
        """The record's span, a child of the message's: its steps, its next-stage message
        and its DLQ copy are the record's."""
        attributes = {"sqsinfer.record": n, "sqsinfer.records": count}
        held.record_started = time.monotonic()  # first: its span is not shorter than the record
        held.record_trace = held.message.trace.child("record", attributes)
        tracing.enter(held.record_trace)

    async def _copy_records(self, held: Held, rejected: list[RecordEnd]) -> None:
        """Copy each rejected record to the DLQ alone, as S3's body of one record."""
        await asyncio.gather(*(self._copy_record(held, end) for end in rejected))
        for end in rejected:
            self.metrics.rejections.labels(end.reason).inc()
            log.info(
                Event.MESSAGE_REJECTED,
                extra=self._ids(held)
                | {"task_id": end.task_id, "reason": end.reason, "detail": end.detail},
            )

    async def _copy_record(self, held: Held, end: RecordEnd) -> None:
        tracing.enter(end.trace)  # the copy's send is the record's (this task's context only)
        copy = self._record_copy(held, end)
        ids = self._dead_letter_ids(held, copy, end.task_id)
        await self.dead_letters.send(copy.body, copy.attributes, ids)

    def _record_copy(self, held: Held, end: RecordEnd) -> DeadLetter:
        alone = dataclasses.replace(held.message, body=end.record.alone())
        return dead_letter_copy(
            alone,
            end.reason,
            end.detail,
            self.queue.url,
            self.rules.dead_letter_max_bytes,
            trace=end.trace.outgoing(),
        )

    def _record_each(self, held: Held, run: Records) -> None:
        elapsed = time.monotonic() - held.message.received_at
        exemplar = held.message.trace.exemplar()  # the records' spans are in its trace
        for n, end in enumerate(run.ended, start=1):
            self.metrics.outcome(end.outcome, elapsed, exemplar)
            task = end.record.item if isinstance(end.record.item, Task) else None
            end_trace(end.trace, end.outcome, end.reason, end.seconds, task)
            fields = self._ids(held) | {"task_id": end.task_id, "record": n}
            fields |= {"records": len(run.ended), "outcome": end.outcome}
            fields["seconds"] = round(elapsed, 6)
            if end.reason:
                fields["reason"] = end.reason
            fields["phases"] = end.timings
            log.info(Event.TASK_FINISHED, extra=fields)
        end_records_trace(held.message.trace, [end.outcome for end in run.ended], elapsed)

    def _count_events(self, held: Held, body: events.Body) -> None:
        if body.shape in events.EVENT_SHAPES:
            held.trace.note({"sqsinfer.shape": body.shape})
            for record in body.records:
                self.metrics.events.labels(body.shape, record.kind).inc()

    # -- bookkeeping ------------------------------------------------------------------
    def _metadata(self, held: Held, output_sha256: str, source: SharedInput) -> dict[str, str]:
        assert held.task is not None
        written = lineage.Written(
            task_id=held.task.task_id,
            message_id=held.message.message_id,
            delivery=held.delivery_id,
            output_sha256=output_sha256,
            input_etag=source.etag,
            input_version_id=source.version_id,
            input_uri_sha256=events.input_digest(held.task),
        )
        return lineage.output_metadata(self.producer, written)

    def _ids(self, held: Held) -> dict[str, Any]:
        ids = {
            "task_id": held.task.task_id if held.task else None,
            "message_id": held.message.message_id,
            "receive_count": held.message.receive_count,
        }
        if held.message.group_id:  # a fair queue's tenant, say: whose task this was
            ids["group_id"] = held.message.group_id
        if held.records is not None and held.records.running:
            ids["record"] = len(held.records.ended) + 1  # of a message of several
        return ids

    def _ended(self, held: Held) -> None:
        """Tell the linker this delivery has ended, once its send (if one is still under
        way after a cancel) has too: a link it left unsent may then be taken over at once."""
        linker = self.linker
        if linker is None:
            return
        under_way = held.under_way[0] if held.under_way is not None else None
        if under_way is not None and not under_way.done():
            under_way.add_done_callback(lambda _: linker.ended(held.delivery_id))
        else:
            linker.ended(held.delivery_id)

    def _record(self, held: Held, outcome: Outcome) -> None:
        elapsed = time.monotonic() - held.message.received_at
        self.metrics.outcome(outcome, elapsed, held.trace.exemplar())
        end_trace(held.trace, outcome, held.reason, elapsed, held.task)
        fields = self._ids(held) | {"outcome": outcome, "seconds": round(elapsed, 6)}
        if held.reason:
            fields["reason"] = held.reason
        fields["phases"] = held.timings
        log.info(Event.TASK_FINISHED, extra=fields)
