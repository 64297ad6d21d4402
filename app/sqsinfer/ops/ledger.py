"""The accounting behind `sqsinfer audit`: every task of a batch, at every stage, in one
category, from what S3 and the queues hold alone.

    dead-letter queues ─ read, handed back ─▶ task id → reason, per stage
    manifest ─ pass 1 ─▶ a spool of (task id, output key, line) + each stage's KeyIndex
    each stage's output prefix ─ listed ─▶ flags: exists, written twice, marker exists
    the spool ─ pass 2 ─▶ per task and stage: flags + dead letters [+ HEADs] ─▶ a category

Memory is bounded by the manifest's size at 17 bytes per task and stage (`KeyIndex`),
plus what the dead-letter queues hold, plus `concurrency` HEADs in flight: a manifest of
millions of lines is never held, and the per-task report goes to a file as it is made.

HEADs are made only where the listing does not say enough: each existing output's with
`lineage` (its owner and its model: `output_conflict`, `other_model`), and a chain
marker's when a stage's output exists but the next stage's does not (was it sent?).
Everything is read, nothing written: a run killed half-way and run again reports the same.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import IO, Any

import obstore
import orjson
from obstore.exceptions import BaseError as ObstoreError

from sqsinfer import lineage
from sqsinfer.aws.s3 import DataPath, ObjectInfo, Storage
from sqsinfer.limits import S3_LIST_PAGE_MAX
from sqsinfer.logs import Event
from sqsinfer.messages import S3Uri
from sqsinfer.ops.deadletters import (
    DEFAULT_DEADLINE_S,
    DeadLetter,
    DeadLetterRead,
    DeadLetterReader,
)
from sqsinfer.ops.keyindex import EXISTS, MARKER, WRITTEN_TWICE, DigestBuilder, KeyIndex
from sqsinfer.ops.manifest import BadLine, Entry, Item
from sqsinfer.ops.status import QueueRef, sample

log = logging.getLogger("sqsinfer.audit")

MARKER_SUFFIX = ".chain"  # the chain marker beside each handed-on output (worker.chain)
_STATE_KEY = "chain-state"
_SENT = "sent"
_CHUNK = 1000  # spool lines looked up at once


class Category(StrEnum):
    """Where a task stands at one stage. Stable: `--json` and `--tasks-out` carry them."""

    COMMITTED = "committed"  # its output exists, once, its own (and the model's, if asked)
    MISSING = "missing"  # no output, not in the dead-letter queue: unaccounted for
    DEAD_LETTERED = "dead_lettered"  # no output; its message is in the DLQ, with a reason
    OUTPUT_CONFLICT = "output_conflict"  # the output at its key belongs to another task
    OTHER_MODEL = "other_model"  # its output was written by another model than asked
    LINK_PENDING = "link_pending"  # its output exists, the next stage's link is not sent
    NOT_REACHED = "not_reached"  # an earlier stage did not hand it on (named there)
    WRITTEN_TWICE = "written_twice"  # its output key has more than one version


# Unfinished work no queue or reason accounts for: the audit exits 1.
UNACCOUNTED = frozenset({Category.MISSING, Category.LINK_PENDING, Category.WRITTEN_TWICE})
# Output handed on to the next stage (its link sent, or the next stage has its output).
_HANDED_ON = frozenset({Category.COMMITTED, Category.OTHER_MODEL, Category.WRITTEN_TWICE})


@dataclass(frozen=True)
class StageSpec:
    """One stage as the audit sees it: its queue, where its outputs go, what made them."""

    queue_url: str
    output_prefix: S3Uri  # its placeholders filled
    output_suffix: str = ".npy"
    model_sha256: str = ""  # outputs must carry this model ("": any)
    dlq_url: str = ""  # "": the queue's redrive target

    @property
    def name(self) -> str:
        return self.queue_url.rstrip("/").rsplit("/", 1)[-1]

    def output(self, task_id: str) -> S3Uri:
        return self.output_prefix.child(task_id + self.output_suffix)


@dataclass(frozen=True)
class Options:
    lineage: bool = False  # HEAD every existing output: its owner and its model
    concurrency: int = 32
    dlq_hold_s: int = 30
    dlq_deadline_s: float = DEFAULT_DEADLINE_S
    show: int = 20  # findings kept for the report (all go to the tasks file)


@dataclass(frozen=True)
class Finding:
    """A task that is not committed at a stage, and why."""

    task_id: str
    where: str
    stage: str
    category: Category
    output: str
    reason: str = ""
    detail: str = ""

    def as_dict(self) -> dict[str, str]:
        return {k: str(v) for k, v in vars(self).items() if v != ""}


@dataclass
class StageReport:
    name: str
    queue_url: str
    dlq_url: str
    output_prefix: str
    model_sha256: str
    versions_listed: bool = False  # the bucket is versioned: written-twice was checked
    lineage_checked: bool = False  # every output HEADed: its owner, and its model if asked
    categories: collections.Counter[str] = field(default_factory=collections.Counter)
    models: collections.Counter[str] = field(default_factory=collections.Counter)
    dead_letter_reasons: collections.Counter[str] = field(default_factory=collections.Counter)
    dead_letters: int = 0
    dead_letters_unread: int = 0
    # Its DLQ's pass: the queue's count at its start, why it ended, letters at the limit
    # of the DLQ's own redrive policy ("" and 0 without a DLQ, or for a DLQ's later stages).
    dead_letters_in_queue: int = 0
    dead_letters_read: int = 0
    dead_letters_ended: str = ""
    dead_letters_at_limit: int = 0
    dead_letters_not_in_manifest: int = 0
    outputs_not_in_manifest: int = 0
    outputs_looked_up: int = 0  # a message's own output outside the prefix: HEADed instead
    queue: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "queue_url": self.queue_url,
            "dlq_url": self.dlq_url,
            "output_prefix": self.output_prefix,
            "model_sha256": self.model_sha256 or None,
            "versions_listed": self.versions_listed,
            "lineage_checked": self.lineage_checked,
            **{c.value: self.categories[c] for c in Category},
            "by_model": dict(sorted(self.models.items())),
            "dead_letter_reasons": dict(sorted(self.dead_letter_reasons.items())),
            "dead_letters": self.dead_letters,
            "dead_letters_unread": self.dead_letters_unread,
            "dead_letters_in_queue": self.dead_letters_in_queue,
            "dead_letters_read": self.dead_letters_read,
            "dead_letters_ended": self.dead_letters_ended or None,
            "dead_letters_at_limit": self.dead_letters_at_limit,
            "dead_letters_not_in_manifest": self.dead_letters_not_in_manifest,
            "outputs_not_in_manifest": self.outputs_not_in_manifest,
            "outputs_looked_up": self.outputs_looked_up,
            "queue": self.queue,
        }


@dataclass
class AuditReport:
    stages: list[StageReport]
    lineage: bool = False  # checked at every stage (`--lineage`, or a model for each)
    lines: int = 0
    tasks: int = 0
    bad_lines: int = 0
    bad_reasons: collections.Counter[str] = field(default_factory=collections.Counter)
    repeated_lines: int = 0
    findings: list[Finding] = field(default_factory=list)  # the first `show`
    problems: int = 0  # findings in all
    tasks_not_done: int = 0  # tasks with a finding at some stage

    @property
    def unaccounted(self) -> int:
        return sum(s.categories[c] for s in self.stages for c in UNACCOUNTED)

    @property
    def complete(self) -> bool:
        """Every task committed at every stage."""
        return all(s.categories[Category.COMMITTED] == self.tasks for s in self.stages)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tasks": self.tasks,
            "manifest_lines": self.lines,
            "bad_lines": self.bad_lines,
            "bad_reasons": dict(sorted(self.bad_reasons.items())),
            "repeated_lines": self.repeated_lines,
            "lineage_checked": self.lineage,
            "complete": self.complete,
            "unaccounted": self.unaccounted,
            "stages": [stage.as_dict() for stage in self.stages],
            "tasks_not_done": self.tasks_not_done,
            "problems": self.problems,
            "findings": [f.as_dict() for f in self.findings],
        }


class Progress:
    """What the audit tells a progress display; this one tells nothing."""

    def phase(self, name: str, total: int | None = None) -> None:
        pass

    def advance(self, count: int = 1) -> None:
        pass


@dataclass
class _Facts:
    """What is known of a task's output at one stage."""

    flags: int
    dead: DeadLetter | None = None
    head: ObjectInfo | None = None  # with lineage: the output's HEAD (None: not made)
    link_state: str = ""  # the marker's state, when it had to be read
    unlisted: bool = False  # a message's own output outside the listed prefix: a HEAD says

    @property
    def exists(self) -> bool:
        return bool(self.flags & EXISTS)


class Audit:
    def __init__(
        self,
        s3: Any,
        sqs: Any,
        stages: list[StageSpec],
        options: Options,
        *,
        progress: Progress | None = None,
        tasks_out: IO[bytes] | None = None,
        data: DataPath | None = None,  # lists through obstore; None: through the SDK
    ) -> None:
        self.data = data
        self.sqs = sqs
        self.storage = Storage(s3)
        self.s3 = s3
        self.stages = stages
        self.options = options
        self.progress = progress or Progress()
        self.tasks_out = tasks_out
        reports = [
            StageReport(s.name, s.queue_url, s.dlq_url, str(s.output_prefix), s.model_sha256)
            for s in stages
        ]
        for report in reports:  # a model asked for implies the HEADs (`_head_output`)
            report.lineage_checked = options.lineage or bool(report.model_sha256)
        self.report = AuditReport(reports, lineage=all(r.lineage_checked for r in reports))
        self.indexes: list[KeyIndex] = []
        self._listed_prefix = str(stages[0].output_prefix)
        # Per stage: task id -> its dead letter, and how many copies the DLQ holds. What
        # pass 2 does not take belongs to no task of the manifest.
        self.dead: list[dict[str, DeadLetter]] = [{} for _ in stages]
        self.copies: list[collections.Counter[str]] = [collections.Counter() for _ in stages]
        self._heads = asyncio.Semaphore(options.concurrency)

    async def run(self, items: AsyncIterator[Item]) -> AuditReport:
        await self._resolve_dead_letter_queues()
        await self._read_dead_letters()
        with tempfile.TemporaryFile() as spool:
            await self._first_pass(items, spool)
            for i in range(len(self.stages)):
                await self._list_stage(i)
            spool.seek(0)
            await self._second_pass(spool)
        for i, report in enumerate(self.report.stages):  # letters no task of the manifest took
            report.dead_letters_not_in_manifest += sum(self.copies[i][t] for t in self.dead[i])
        for i, stage in enumerate(self.stages):
            self.report.stages[i].queue = await self._depths(stage.queue_url)
        return self.report

    # -- the dead-letter queues -------------------------------------------------------
    async def _resolve_dead_letter_queues(self) -> None:
        from sqsinfer.aws.sqs import SqsQueue

        for stage, report in zip(self.stages, self.report.stages, strict=True):
            if not report.dlq_url:
                report.dlq_url = await SqsQueue(self.sqs, stage.queue_url).redrive_target() or ""

    async def _read_dead_letters(self) -> None:
        """Every dead-letter queue of the chain, read at once (each pass ends in a poll)."""
        urls = list(dict.fromkeys(r.dlq_url for r in self.report.stages if r.dlq_url))
        self.progress.phase("dead letters")
        hold_s, deadline_s = self.options.dlq_hold_s, self.options.dlq_deadline_s
        readers = [DeadLetterReader(self.sqs, url, hold_s, hold_s, deadline_s) for url in urls]
        for found in await asyncio.gather(*(reader.read() for reader in readers)):
            self.progress.advance(len(found.letters))
            self._file_dead_letters(found)

    def _file_dead_letters(self, found: DeadLetterRead) -> None:
        """Each letter to the stage it was rejected from: by its source queue, else by its
        input lying under the stage before's outputs, else the first stage of that DLQ."""
        using = [i for i, r in enumerate(self.report.stages) if r.dlq_url == found.url]
        for letter in found.letters:
            i = self._stage_of(letter, using)
            report = self.report.stages[i]
            report.dead_letters += 1
            report.dead_letter_reasons[letter.reason] += 1
            if letter.task_id:
                self.dead[i].setdefault(letter.task_id, letter)
                self.copies[i][letter.task_id] += 1
            else:
                report.dead_letters_not_in_manifest += 1
        for i in using[:1]:  # a DLQ several stages share is told of once, at the first
            report = self.report.stages[i]
            report.dead_letters_unread += found.unread
            report.dead_letters_in_queue = found.in_queue
            report.dead_letters_read = len(found.letters)
            report.dead_letters_ended = found.ended.value
            report.dead_letters_at_limit = found.at_limit

    def _stage_of(self, letter: DeadLetter, using: list[int]) -> int:
        for i in using:
            if letter.source_queue == self.stages[i].queue_url:
                return i
        for i in using:
            before = self.stages[i - 1].output_prefix if i else None
            if before is not None and letter.input.startswith(str(before)):
                return i
        return using[0]

    # -- pass 1: the manifest ---------------------------------------------------------
    async def _first_pass(self, items: AsyncIterator[Item], spool: IO[bytes]) -> None:
        """Each valid line to the spool and its output key at every stage to the indexes."""
        self.progress.phase("manifest")
        builders = [DigestBuilder() for _ in self.stages]
        async for item in items:
            self.report.lines += 1
            self.progress.advance()
            if isinstance(item, BadLine):
                self.report.bad_lines += 1
                self.report.bad_reasons[item.reason] += 1
                continue
            keys = self._keys(item)
            for builder, key in zip(builders, keys, strict=True):
                builder.add(key)
            spool.write(orjson.dumps([item.task.task_id, item.where, *keys]) + b"\n")
        self.indexes = [builder.build() for builder in builders]
        self.report.tasks = len(self.indexes[0])  # a task on two lines is one task

    def _keys(self, entry: Entry) -> list[str]:
        """The task's output at every stage: the message's own at the first, then each
        stage's derived key (a next-stage message names no output)."""
        task_id = entry.task.task_id
        later = [str(stage.output(task_id)) for stage in self.stages[1:]]
        return [str(entry.task.output), *later]

    # -- the listings -----------------------------------------------------------------
    async def _list_stage(self, i: int) -> None:
        stage, report = self.stages[i], self.report.stages[i]
        prefix = stage.output_prefix
        report.versions_listed = await self._versioned(prefix.bucket)
        self.progress.phase(f"listing {stage.name}")
        if report.versions_listed:
            report.outputs_not_in_manifest = await self._mark(i, self._versions(prefix))
            return
        try:
            report.outputs_not_in_manifest = await self._mark(i, self._listed(prefix))
        except ObstoreError as exc:  # a key object_store will not take: the SDK lists it
            log.info(Event.AUDIT_LISTING_AGAIN, extra={"prefix": str(prefix), "error": str(exc)})
            report.outputs_not_in_manifest = await self._mark(i, self._objects(prefix))

    async def _mark(self, i: int, pages: AsyncIterator[tuple[list[str], list[str]]]) -> int:
        """Flag what a stage's listing holds; how many of its outputs no task of the
        manifest names. Flags are only ever set: a listing done again changes nothing."""
        index, bucket, unknown = self.indexes[i], self.stages[i].output_prefix.bucket, 0
        async for latest, twice in pages:
            outputs = [k for k in latest if not k.endswith(MARKER_SUFFIX)]
            markers = [k.removesuffix(MARKER_SUFFIX) for k in latest if k.endswith(MARKER_SUFFIX)]
            unknown += index.mark([f"s3://{bucket}/{k}" for k in outputs], EXISTS)
            index.mark([f"s3://{bucket}/{k}" for k in markers], MARKER)
            index.mark([f"s3://{bucket}/{k}" for k in twice], WRITTEN_TWICE)
            self.progress.advance(len(latest))
        return unknown

    async def _listed(self, prefix: S3Uri) -> AsyncIterator[tuple[list[str], list[str]]]:
        """The objects under a prefix through obstore, whose listing pages cost a
        fraction of the SDK's (measured: docs/performance.md); without it, the SDK's."""
        if self.data is None:
            async for page in self._objects(prefix):
                yield page
            return
        store = await self.data.store(prefix.bucket)
        async for chunk in obstore.list(store, prefix.key or None, chunk_size=S3_LIST_PAGE_MAX):
            yield [meta["path"] for meta in chunk], []

    async def _versioned(self, bucket: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            answer = await self.s3.get_bucket_versioning(Bucket=bucket)
        except ClientError:  # not allowed to ask: list the objects, not their versions
            return False
        return answer.get("Status") in ("Enabled", "Suspended")

    async def _objects(self, prefix: S3Uri) -> AsyncIterator[tuple[list[str], list[str]]]:
        """Pages of (keys that exist, keys written twice): one version each, here."""
        async for keys in self.storage.keys(prefix):
            yield keys, []

    async def _versions(self, prefix: S3Uri) -> AsyncIterator[tuple[list[str], list[str]]]:
        """Pages of (keys whose latest version is an object, non-marker keys with more than
        one object version). A key's versions may run over a page break: the last key
        of a page waits for the next."""
        paginator = self.s3.get_paginator("list_object_versions")
        pages = paginator.paginate(
            Bucket=prefix.bucket, Prefix=prefix.key, PaginationConfig={"PageSize": S3_LIST_PAGE_MAX}
        )
        tally = _VersionTally()
        async for page in pages:
            tally.add(page)
            yield tally.complete()
        yield tally.complete(final=True)

    # -- pass 2: each task ------------------------------------------------------------
    async def _second_pass(self, spool: IO[bytes]) -> None:
        self.progress.phase("checking", self.report.lines - self.report.bad_lines)
        window: collections.deque[asyncio.Future[list[Finding]]] = collections.deque()
        limit = 4 * self.options.concurrency
        for chunk in _chunks(spool):
            for row, facts in zip(chunk, self._facts(chunk), strict=True):
                window.append(self._task(row, facts))
                while len(window) > limit or (window and window[0].done()):
                    self._record(await window.popleft())
        while window:
            self._record(await window.popleft())

    def _facts(self, chunk: list[list[str]]) -> list[list[_Facts] | None]:
        """Each row's facts per stage from the indexes; None for a repeated line."""
        at = [
            index.positions([row[2 + i] for row in chunk]) for i, index in enumerate(self.indexes)
        ]
        flags = [
            index.flags_at(positions) for index, positions in zip(self.indexes, at, strict=True)
        ]
        first = self.indexes[0].first_visits(at[0])
        out: list[list[_Facts] | None] = []
        for n, row in enumerate(chunk):
            if not first[n]:
                self.report.repeated_lines += 1
                out.append(None)
                continue
            facts = [
                _Facts(flags[i][n], self.dead[i].pop(row[0], None)) for i in range(len(self.stages))
            ]
            facts[0].unlisted = not row[2].startswith(self._listed_prefix)
            out.append(facts)
        return out

    def _task(self, row: list[str], facts: list[_Facts] | None) -> asyncio.Future[list[Finding]]:
        if facts is None:
            done: asyncio.Future[list[Finding]] = asyncio.get_running_loop().create_future()
            done.set_result([])
            return done
        if not self._needs_heads(facts):
            done = asyncio.get_running_loop().create_future()
            done.set_result(self._classify(row, facts))
            return done
        return asyncio.ensure_future(self._with_heads(row, facts))

    def _needs_heads(self, facts: list[_Facts]) -> bool:
        return facts[0].unlisted or any(
            self._head_output(facts, i) or self._read_link(facts, i) for i in range(len(facts))
        )

    def _head_output(self, facts: list[_Facts], i: int) -> bool:
        return facts[i].exists and self.report.stages[i].lineage_checked

    def _read_link(self, facts: list[_Facts], i: int) -> bool:
        """A stage's output exists, the next one's does not, and the marker says more."""
        last = i + 1 == len(facts)
        return (
            not last
            and facts[i].exists
            and not facts[i + 1].exists
            and bool(facts[i].flags & MARKER)
        )

    async def _with_heads(self, row: list[str], facts: list[_Facts]) -> list[Finding]:
        if facts[0].unlisted:  # the listing could not say: its HEAD does (and its marker's)
            facts[0].head = await self._head(_uri(row[2]))
            facts[0].flags |= (EXISTS | MARKER) if facts[0].head is not None else 0
            self.report.stages[0].outputs_looked_up += 1

        async def look(i: int) -> None:
            uri = _uri(row[2 + i])
            if self._head_output(facts, i) and facts[i].head is None:
                facts[i].head = await self._head(uri)
            if self._read_link(facts, i):
                marker = await self._head(S3Uri(uri.bucket, uri.key + MARKER_SUFFIX))
                facts[i].link_state = _link_state(marker)

        await asyncio.gather(*(look(i) for i in range(len(facts))))
        return self._classify(row, facts)

    async def _head(self, uri: S3Uri) -> ObjectInfo | None:
        async with self._heads:
            return await self.storage.head(uri)

    # -- the categories ---------------------------------------------------------------
    def _classify(self, row: list[str], facts: list[_Facts]) -> list[Finding]:
        task_id, where = row[0], row[1]
        found: list[Finding] = []
        upstream = True
        for i, stage in enumerate(self.stages):
            after = facts[i + 1] if i + 1 < len(facts) else None
            category, reason, detail = _category(task_id, stage, facts[i], after, upstream)
            report = self.report.stages[i]
            report.categories[category] += 1
            head = facts[i].head
            if head is not None and category in (Category.COMMITTED, Category.OTHER_MODEL):
                report.models[head.metadata.get(lineage.MODEL_SHA256, "")] += 1
            upstream = category in _HANDED_ON
            if category in (Category.COMMITTED, Category.NOT_REACHED):
                continue  # not reached: the stage that did not hand it on names it
            found.append(Finding(task_id, where, stage.name, category, row[2 + i], reason, detail))
        return found

    def _record(self, findings: list[Finding]) -> None:
        self.progress.advance()
        self.report.tasks_not_done += bool(findings)
        for finding in findings:
            self.report.problems += 1
            if len(self.report.findings) < self.options.show:
                self.report.findings.append(finding)
            if self.tasks_out is not None:
                self.tasks_out.write(orjson.dumps(finding.as_dict()) + b"\n")

    # -- the queues -------------------------------------------------------------------
    async def _depths(self, url: str) -> dict[str, int]:
        """What the stage's queue still holds: work in progress, or not yet started."""
        (found,) = await sample(self.sqs, [QueueRef(url, "queue")])
        return {"visible": found.visible, "in_flight": found.in_flight, "delayed": found.delayed}


def _category(
    task_id: str, stage: StageSpec, facts: _Facts, after: _Facts | None, upstream: bool
) -> tuple[Category, str, str]:
    """A task's category at one stage (first match wins), with the reason and detail."""
    dead = facts.dead
    if facts.exists:
        head = facts.head
        if head is not None and head.metadata.get(lineage.TASK_ID) != task_id:
            owner = head.metadata.get(lineage.TASK_ID)
            return Category.OUTPUT_CONFLICT, f"task {owner!r}" if owner else "no task-id", ""
        if dead is not None and dead.reason == Category.OUTPUT_CONFLICT:
            return Category.OUTPUT_CONFLICT, dead.reason, dead.detail
        model = head.metadata.get(lineage.MODEL_SHA256, "") if head is not None else ""
        if head is not None and stage.model_sha256 and model != stage.model_sha256:
            return Category.OTHER_MODEL, model or "no model-sha256", ""
        if facts.flags & WRITTEN_TWICE:
            return Category.WRITTEN_TWICE, "", ""
        if after is not None and not after.exists and facts.link_state != _SENT:
            state = facts.link_state or ("no marker" if not facts.flags & MARKER else "")
            return Category.LINK_PENDING, state, dead.reason if dead is not None else ""
        return Category.COMMITTED, "", ""
    if dead is not None:
        return Category.DEAD_LETTERED, dead.reason, dead.detail
    if not upstream:
        return Category.NOT_REACHED, "", ""
    return Category.MISSING, "", ""


def _link_state(marker: ObjectInfo | None) -> str:
    if marker is None:
        return "no marker"
    # A marker written before the link had states reads as sent, as the worker reads it.
    return marker.metadata.get(_STATE_KEY, _SENT)


def _uri(text: str) -> S3Uri:
    bucket, _, key = text.removeprefix("s3://").partition("/")
    return S3Uri(bucket, key)


def _chunks(spool: IO[bytes]) -> Iterator[list[list[str]]]:
    chunk: list[list[str]] = []
    for line in spool:
        chunk.append(orjson.loads(line))
        if len(chunk) == _CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


class _VersionTally:
    """Versions of the keys of a version listing, a page at a time.

    A key was overwritten when it has more object versions than its deletions account
    for: written, deleted and written again is no overwrite (a recompute after an
    operator removed an output), written over without a deletion between is.
    """

    def __init__(self) -> None:
        # key -> [object versions, latest is an object, delete markers]
        self._pending: dict[str, list[int]] = {}

    def add(self, page: dict[str, Any]) -> None:
        for version in page.get("Versions", []):
            tally = self._pending.setdefault(version["Key"], [0, 0, 0])
            tally[0] += 1
            tally[1] |= bool(version.get("IsLatest"))
        for marker in page.get("DeleteMarkers", []):
            self._pending.setdefault(marker["Key"], [0, 0, 0])[2] += 1

    def complete(self, *, final: bool = False) -> tuple[list[str], list[str]]:
        """(existing keys, non-marker keys written twice) of every key that is complete:
        all but the greatest, which the next page may continue, unless this is the end."""
        if not self._pending:
            return [], []
        last = max(self._pending)
        done = {k: v for k, v in self._pending.items() if final or k != last}
        self._pending = {} if final else {last: self._pending[last]}
        latest = [k for k, (_, is_object, _) in done.items() if is_object]
        twice = [
            k
            for k, (n, _, deleted) in done.items()
            if n > deleted + 1 and not k.endswith(MARKER_SUFFIX)
        ]
        return latest, twice
