"""`sqsinfer status`: each stage's queue and dead-letter queue, how fast it drains, when done.

Counts are SQS's approximate attributes (visible, in flight, delayed); the drain rate
is the fall of their sum between two samples, and the ETA what is left at that rate.
SQS's figures lag by up to a minute, so rates over a longer window (`--watch`) are
steadier than one interval. With a manifest and a group field, each group's tasks, done
and left are counted from the manifest and the outputs (`sqsinfer.ops.groups`: why not
from the queue).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import IO, Any

from botocore.exceptions import BotoCoreError, ClientError

from sqsinfer import config
from sqsinfer.aws.sqs import SqsQueue, depth
from sqsinfer.ops import common
from sqsinfer.ops.enqueue import BORROWED, in_thread, validator_from_args
from sqsinfer.ops.groups import GroupLedger, GroupReport
from sqsinfer.ops.manifest import (
    MANIFEST_FORMATS,
    Validator,
    manifest_format,
    read_manifest,
    run_on_manifest,
)

EPILOG = """\
Each queue's dead-letter queue (from its redrive policy) is shown under it.
drain/s is how fast visible + in flight + delayed falls (negative: the queue grows);
ETA is what is left at that rate.

examples:
  sqsinfer status --queue-url $STAGE1 --queue-url $STAGE2
  sqsinfer status --queue-url $STAGE1 --interval-s 30          # a steadier rate
  sqsinfer status --queue-url $STAGE1 --watch                  # a live table, Ctrl-C ends
  sqsinfer status --queue-url $STAGE1 --json | jq '.queues[] | {name, eta_s}'
  sqsinfer status --queue-url $STAGE1 --manifest tasks.jsonl --group-field tenant \
      --output-prefix s3://scores/                            # tasks, done, left per tenant

Per group: SQS counts no groups, and reading messages to count them would hide them
from the workers. --manifest (what was enqueued) and --group-field (as given to
`sqsinfer enqueue`) count each group's tasks from the manifest, and its done ones from
the outputs that exist under the stage's output prefixes (listed at every refresh: a
request per 1,000 objects). left = tasks - done: queued, in flight, delayed or
dead-lettered (`sqsinfer audit` names each task). The table shows the groups with most
left (--groups-shown); --json has them all.
"""


# The stage's settings that say where each task's output goes (all enqueue's but the queue).
GROUP_BORROWED = tuple(name for name in BORROWED if name != "queue_url")


class StatusError(Exception):
    pass


@dataclass(frozen=True)
class QueueRef:
    url: str
    role: str  # "queue" or "dlq"
    source: str = ""  # for a DLQ: the queue whose redrive policy names it


@dataclass(frozen=True)
class Sample:
    ref: QueueRef
    visible: int
    in_flight: int
    delayed: int
    at_s: float  # monotonic

    @property
    def total(self) -> int:
        return self.visible + self.in_flight + self.delayed


@dataclass(frozen=True)
class QueueStatus:
    url: str
    name: str
    role: str
    source: str
    visible: int
    in_flight: int
    delayed: int
    total: int
    drain_per_s: float | None  # None: one sample only
    eta_s: float | None  # None: not draining (or unknown)
    window_s: float


def drain(first: Sample, last: Sample) -> tuple[float | None, float | None]:
    """Messages per second the queue fell by between two samples, and the time left."""
    elapsed_s = last.at_s - first.at_s
    if elapsed_s <= 0:
        return None, (0.0 if last.total == 0 else None)
    rate = (first.total - last.total) / elapsed_s
    if last.total == 0:
        return rate, 0.0
    return rate, (last.total / rate if rate > 0 else None)


def status(first: Sample, last: Sample) -> QueueStatus:
    rate, eta = drain(first, last)
    ref = last.ref
    return QueueStatus(
        url=ref.url,
        name=common.queue_name(ref.url),
        role=ref.role,
        source=ref.source,
        visible=last.visible,
        in_flight=last.in_flight,
        delayed=last.delayed,
        total=last.total,
        drain_per_s=rate,
        eta_s=eta,
        window_s=last.at_s - first.at_s,
    )


async def discover(sqs: Any, urls: Sequence[str], with_dlq: bool = True) -> list[QueueRef]:
    """The queues, each followed by its dead-letter queue (once, even when shared)."""
    refs: list[QueueRef] = []
    seen: set[str] = set()
    for url in urls:
        if url not in seen:
            seen.add(url)
            refs.append(QueueRef(url, "queue"))
        if not with_dlq:
            continue
        try:
            dlq = await SqsQueue(sqs, url).redrive_target()
        except (ClientError, BotoCoreError) as exc:
            raise StatusError(f"cannot read {url}: {exc}") from None
        if dlq and dlq not in seen:
            seen.add(dlq)
            refs.append(QueueRef(dlq, "dlq", source=url))
    return refs


async def sample(sqs: Any, refs: Sequence[QueueRef]) -> list[Sample]:
    """One GetQueueAttributes per queue, all at once."""

    async def one(ref: QueueRef) -> Sample:
        try:
            counts = await depth(sqs, ref.url)
        except (ClientError, BotoCoreError) as exc:
            raise StatusError(f"cannot read {ref.url}: {exc}") from None
        return Sample(ref, at_s=time.monotonic(), **counts)

    return list(await asyncio.gather(*(one(ref) for ref in refs)))


class History:
    """Samples per queue over a sliding window: the rate is oldest-to-newest within it."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: dict[str, collections.deque[Sample]] = {}

    def add(self, samples: Sequence[Sample]) -> list[QueueStatus]:
        out = []
        for s in samples:
            kept = self._samples.setdefault(s.ref.url, collections.deque())
            kept.append(s)
            while len(kept) > 2 and s.at_s - kept[1].at_s >= self.window_s:
                kept.popleft()
            out.append(status(kept[0], s))
        return out


# -- rendering ------------------------------------------------------------------------
def _rate_text(rate: float | None) -> str:
    if rate is None:
        return "-"
    return f"{rate:+,.1f}" if abs(rate) < 100 else f"{rate:+,.0f}"


def _eta_text(row: QueueStatus) -> str:
    if row.total == 0:
        return "drained"
    if row.drain_per_s is None:
        return "-"
    return common.format_duration(row.eta_s) if row.eta_s is not None else "not draining"


def table(rows: Sequence[QueueStatus], title: str = "") -> Any:
    from rich.table import Table

    t = Table(title=title or None, title_justify="left")
    for name, justify in (
        ("queue", "left"),
        ("visible", "right"),
        ("in flight", "right"),
        ("delayed", "right"),
        ("drain/s", "right"),
        ("ETA", "right"),
    ):
        t.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        label = row.name if row.role == "queue" else f"  └ DLQ {row.name}"
        t.add_row(
            label,
            f"{row.visible:,}",
            f"{row.in_flight:,}",
            f"{row.delayed:,}",
            _rate_text(row.drain_per_s),
            _eta_text(row),
        )
    return t


def group_table(report: GroupReport, shown: int) -> Any:
    from rich.table import Table

    more = len(report.groups) - shown
    caption = f"and {more:,} more groups (--json lists all)" if more > 0 else None
    t = Table(caption=caption, caption_justify="left")
    t.add_column(f"group ({report.group_field})")
    for name in ("tasks", "done", "left"):
        t.add_column(name, justify="right")
    for g in report.groups[:shown]:
        t.add_row(g.group, f"{g.tasks:,}", f"{g.done:,}", f"{g.left:,}")
    t.add_section()
    t.add_row("all", f"{report.tasks:,}", f"{report.done:,}", f"{report.tasks - report.done:,}")
    return t


def as_json(rows: Sequence[QueueStatus], groups: GroupReport | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "sampled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "queues": [asdict(row) for row in rows],
    }
    if groups is not None:
        doc["groups"] = groups.as_dict()
    return doc


# -- the command ----------------------------------------------------------------------
def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "status",
        help="depth, drain rate and ETA of each stage's queue and its DLQ",
        description="Visible, in flight and delayed messages per queue and DLQ; drain rate "
        "and ETA from two samples.",
        epilog=EPILOG,
        formatter_class=common.formatter(),
    )
    p.add_argument(
        "--queue-url",
        action="append",
        default=[],
        help="a stage's queue; repeat for several [SQSINFER_QUEUE_URL, SQSINFER_NEXT_QUEUE_URL]",
    )
    p.add_argument(
        "--interval-s",
        type=float,
        default=5.0,
        help="seconds between the two samples (5); 0: one sample, no rate",
    )
    p.add_argument("--watch", action="store_true", help="refresh a live table every interval")
    p.add_argument(
        "--window-s", type=float, default=60.0, help="with --watch, the rate's window (60)"
    )
    p.add_argument("--count", type=int, default=0, help="with --watch, stop after N refreshes")
    p.add_argument("--no-dlq", action="store_true", help="leave out the dead-letter queues")
    p.add_argument("--json", action="store_true", help="JSON on stdout (a line per refresh)")
    p.add_argument("--manifest", help="what was enqueued (JSONL or CSV; - reads stdin): per group")
    p.add_argument("--format", choices=MANIFEST_FORMATS, help="manifest format (by suffix)")
    p.add_argument("--group-field", metavar="FIELD", help="with --manifest: the tasks' group")
    p.add_argument(
        "--groups-shown",
        type=common.positive_int,
        default=20,
        help="groups in the table, most left first (20); --json has all",
    )
    # The stage's rules, to find each task's output as its worker will write it.
    common.borrow(p, GROUP_BORROWED, notes={"output_prefix": "needed by --manifest"})
    common.add_log_level(p)
    p.set_defaults(func=cmd_status)


def _urls(args: argparse.Namespace) -> list[str]:
    if args.queue_url:
        return list(args.queue_url)
    # Not flags of this command (its --queue-url repeats): the stage's environment only.
    stage = config.borrowed(argparse.Namespace(), ("queue_url", "next_queue_url"))
    return [url for url in stage.values() if url]


def _check_args(args: argparse.Namespace) -> str | None:
    if args.interval_s < 0 or (args.watch and args.interval_s <= 0):
        return "--interval-s must be above 0 (0 without --watch)"
    if bool(args.manifest) != bool(args.group_field):
        return "--manifest and --group-field go together"
    if args.manifest and not args.output_prefix:
        return "--manifest needs --output-prefix (the stage's SQSINFER_OUTPUT_PREFIX)"
    return None


@common.quiet_on_broken_pipe
def cmd_status(args: argparse.Namespace) -> int:
    urls = _urls(args)
    if not urls:
        return common.usage_error("status", "give --queue-url (or set SQSINFER_QUEUE_URL)")
    problem = _check_args(args)
    if problem:
        return common.usage_error("status", problem)
    try:
        validator = validator_from_args(args) if args.manifest else None
    except ValueError as exc:
        return common.usage_error("status", str(exc))
    return run_on_manifest(
        "status", args.manifest, args.log_level, lambda fh: _main(args, urls, validator, fh)
    )


async def _main(
    args: argparse.Namespace, urls: list[str], validator: Validator | None, fh: IO[bytes] | None
) -> int:
    from sqsinfer.aws.session import open_clients

    async with open_clients(args.region, args.endpoint_url) as clients:
        try:
            refs = await discover(clients.sqs, urls, with_dlq=not args.no_dlq)
            ledger = None
            if validator is not None and fh is not None:
                ledger = await _ledger(clients.s3, validator, fh, args)
            if args.watch:
                await _watch(clients.sqs, refs, args, ledger)
            else:
                rows = await _once(clients.sqs, refs, args.interval_s)
                _print(rows, args, await _count(ledger))
        except StatusError as exc:
            return common.usage_error("status", str(exc))
    return common.EXIT_OK


async def _ledger(
    s3: Any, validator: Validator, fh: IO[bytes], args: argparse.Namespace
) -> GroupLedger:
    """The manifest's tasks by group (read once; the outputs are listed each refresh)."""
    name = "stdin" if args.manifest == "-" else args.manifest
    ledger = GroupLedger(s3, validator.allowed_outputs, args.group_field, name)
    fmt = manifest_format(name, args.format)
    await ledger.read(in_thread(read_manifest(fh, name, fmt, validator)))
    return ledger


async def _once(sqs: Any, refs: list[QueueRef], interval_s: float) -> list[QueueStatus]:
    first = await sample(sqs, refs)
    if interval_s > 0:
        await asyncio.sleep(interval_s)
        last = await sample(sqs, refs)
    else:
        last = first
    return [status(a, b) for a, b in zip(first, last, strict=True)]


async def _count(ledger: GroupLedger | None) -> GroupReport | None:
    if ledger is None:
        return None
    try:
        return await ledger.count()
    except (ClientError, BotoCoreError) as exc:  # no such bucket, not allowed to list
        raise StatusError(f"cannot list the outputs: {exc}") from None


def _print(
    rows: list[QueueStatus], args: argparse.Namespace, groups: GroupReport | None = None
) -> None:
    if args.json:
        import orjson

        print(orjson.dumps(as_json(rows, groups)).decode(), flush=True)
        return
    from rich.console import Console

    Console().print(_tables(rows, groups, args.groups_shown))


def _tables(
    rows: list[QueueStatus], groups: GroupReport | None, shown: int, title: str = ""
) -> Any:
    if groups is None:
        return table(rows, title)
    from rich.console import Group

    return Group(table(rows, title), group_table(groups, shown))


async def _watch(
    sqs: Any, refs: list[QueueRef], args: argparse.Namespace, ledger: GroupLedger | None
) -> None:
    history = History(args.window_s)
    refreshes = 0
    live = None if args.json else _live()
    try:
        while True:
            rows = history.add(await sample(sqs, refs))
            groups = await _count(ledger)
            refreshes += 1
            if live is None:
                _print(rows, args, groups)
            else:
                title = f"sqsinfer status · every {args.interval_s:g} s · Ctrl-C ends"
                live.update(_tables(rows, groups, args.groups_shown, title), refresh=True)
            if args.count and refreshes >= args.count:
                return
            await asyncio.sleep(args.interval_s)
    finally:
        if live is not None:
            live.stop()


def _live() -> Any:
    from rich.live import Live

    live = Live(auto_refresh=False)
    live.start()
    return live
