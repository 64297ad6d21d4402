"""Per-group progress of a batch, for `sqsinfer status --manifest FILE --group-field F`.

SQS counts a queue's messages, never its groups, and no call can count them without
harm: a receive hides what it reads (and adds to each message's receive count, towards
its redrive to the DLQ), so sampling a live queue would delay and dead-letter work. A
worker metric labelled by group would count what the workers saw, not what is left, and
a label per tenant is a Prometheus series per tenant: unbounded. What is exact and costs
the queue nothing is the batch itself: the manifest names every task, its group and its
output key, and an output that exists is a task done (the worker's conditional put makes
that the truth). So:

    manifest ─ once ─▶ each task's output key (16-byte digest) and group (a number)
    each output prefix ─ listed, every refresh ─▶ which of those keys exist
        ─▶ per group: tasks, done, left

Memory: 21 bytes a task, plus the group names. Each refresh lists the stage's output
prefixes: one request per 1,000 objects there (other batches' too).
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqsinfer.aws.s3 import Storage
from sqsinfer.messages import S3Uri
from sqsinfer.ops.keyindex import EXISTS, KeyIndex, TaggedDigestBuilder
from sqsinfer.ops.manifest import BadLine, Item


@dataclass(frozen=True)
class GroupCount:
    group: str
    tasks: int  # distinct tasks of the manifest in this group
    done: int  # of them, those whose output exists

    @property
    def left(self) -> int:
        """Not done yet: queued, in flight, delayed, or dead-lettered."""
        return self.tasks - self.done

    def as_dict(self) -> dict[str, Any]:
        return {"group": self.group, "tasks": self.tasks, "done": self.done, "left": self.left}


@dataclass
class GroupReport:
    group_field: str
    manifest: str
    groups: list[GroupCount]  # most left first
    bad_lines: int = 0
    bad_reasons: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def tasks(self) -> int:
        return sum(g.tasks for g in self.groups)

    @property
    def done(self) -> int:
        return sum(g.done for g in self.groups)

    def as_dict(self) -> dict[str, Any]:
        return {
            "group_field": self.group_field,
            "manifest": self.manifest,
            "tasks": self.tasks,
            "done": self.done,
            "left": self.tasks - self.done,
            "bad_lines": self.bad_lines,
            "bad_reasons": dict(sorted(self.bad_reasons.items())),
            "groups": [g.as_dict() for g in self.groups],
        }


class GroupLedger:
    """The manifest's tasks by group, read once; `count` lists the outputs each time."""

    def __init__(self, s3: Any, prefixes: Sequence[S3Uri], group_field: str, manifest: str) -> None:
        self.storage = Storage(s3)
        self.prefixes = outermost(prefixes)
        self.group_field = group_field
        self.manifest = manifest
        self.names: list[str] = []
        self.bad_lines = 0
        self.bad_reasons: collections.Counter[str] = collections.Counter()
        self._index: KeyIndex | None = None

    async def read(self, items: AsyncIterator[Item]) -> None:
        codes: dict[str, int] = {}
        builder = TaggedDigestBuilder()
        async for item in items:
            if isinstance(item, BadLine):
                self.bad_lines += 1
                self.bad_reasons[item.reason] += 1
                continue
            code = codes.setdefault(item.group_id, len(codes))
            builder.add(str(item.task.output), code)
        self.names = list(codes)
        self._index = builder.build()

    async def count(self) -> GroupReport:
        index = self._index
        assert index is not None, "read the manifest first"
        index.flags[:] = 0  # a refresh: what exists now
        for prefix in self.prefixes:
            async for keys in self.storage.keys(prefix):
                index.mark([f"s3://{prefix.bucket}/{key}" for key in keys], EXISTS)
        tasks = index.count_by_tag(len(self.names))
        done = index.count_by_tag(len(self.names), EXISTS)
        groups = [
            GroupCount(name, int(n), int(d))
            for name, n, d in zip(self.names, tasks.tolist(), done.tolist(), strict=True)
        ]
        groups.sort(key=lambda g: (-g.left, g.group))
        report = GroupReport(self.group_field, self.manifest, groups, self.bad_lines)
        report.bad_reasons.update(self.bad_reasons)
        return report


def outermost(prefixes: Sequence[S3Uri]) -> list[S3Uri]:
    """The prefixes that lie within no other (listing those lists the rest), each once."""
    unique = list(dict.fromkeys(prefixes))
    return [p for p in unique if not any(p != q and p.within(q) for q in unique)]
