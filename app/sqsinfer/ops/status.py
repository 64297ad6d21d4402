"""`sqsinfer status`: each stage's queue and dead-letter queue, how fast it drains, when done.

Counts are SQS's approximate attributes (visible, in flight, delayed); the drain rate
is the fall of their sum between two samples, and the ETA what is left at that rate.
SQS's figures lag by up to a minute, so rates over a longer window (`--watch`) are
steadier than one interval.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from sqsinfer import config
from sqsinfer.aws.sqs import SqsQueue
from sqsinfer.ops import common

_COUNTS = {
    "visible": "ApproximateNumberOfMessages",
    "in_flight": "ApproximateNumberOfMessagesNotVisible",
    "delayed": "ApproximateNumberOfMessagesDelayed",
}

EPILOG = """\
Each queue's dead-letter queue (from its redrive policy) is shown under it.
drain/s is how fast visible + in flight + delayed falls (negative: the queue grows);
ETA is what is left at that rate.

examples:
  sqsinfer status --queue-url $STAGE1 --queue-url $STAGE2
  sqsinfer status --queue-url $STAGE1 --interval-s 30          # a steadier rate
  sqsinfer status --queue-url $STAGE1 --watch                  # a live table, Ctrl-C ends
  sqsinfer status --queue-url $STAGE1 --json | jq '.queues[] | {name, eta_s}'
"""


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
            response = await sqs.get_queue_attributes(
                QueueUrl=ref.url, AttributeNames=list(_COUNTS.values())
            )
        except (ClientError, BotoCoreError) as exc:
            raise StatusError(f"cannot read {ref.url}: {exc}") from None
        attrs = response.get("Attributes", {})
        counts = {key: int(attrs.get(name, 0)) for key, name in _COUNTS.items()}
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


def as_json(rows: Sequence[QueueStatus]) -> dict[str, Any]:
    return {
        "sampled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "queues": [asdict(row) for row in rows],
    }


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
    common.borrow(p, ())
    common.add_log_level(p)
    p.set_defaults(func=cmd_status)


def _urls(args: argparse.Namespace) -> list[str]:
    if args.queue_url:
        return list(args.queue_url)
    # Not flags of this command (its --queue-url repeats): the stage's environment only.
    stage = config.borrowed(argparse.Namespace(), ("queue_url", "next_queue_url"))
    return [url for url in stage.values() if url]


@common.quiet_on_broken_pipe
def cmd_status(args: argparse.Namespace) -> int:
    urls = _urls(args)
    if not urls:
        return common.usage_error("status", "give --queue-url (or set SQSINFER_QUEUE_URL)")
    if args.interval_s < 0 or (args.watch and args.interval_s <= 0):
        return common.usage_error("status", "--interval-s must be above 0 (0 without --watch)")
    return common.run_command(lambda: _main(args, urls), "status", args.log_level)


async def _main(args: argparse.Namespace, urls: list[str]) -> int:
    from sqsinfer.aws.session import open_clients

    async with open_clients(args.region, args.endpoint_url) as clients:
        try:
            refs = await discover(clients.sqs, urls, with_dlq=not args.no_dlq)
            if args.watch:
                await _watch(clients.sqs, refs, args)
            else:
                rows = await _once(clients.sqs, refs, args.interval_s)
                _print(rows, args)
        except StatusError as exc:
            return common.usage_error("status", str(exc))
    return common.EXIT_OK


async def _once(sqs: Any, refs: list[QueueRef], interval_s: float) -> list[QueueStatus]:
    first = await sample(sqs, refs)
    if interval_s > 0:
        await asyncio.sleep(interval_s)
        last = await sample(sqs, refs)
    else:
        last = first
    return [status(a, b) for a, b in zip(first, last, strict=True)]


def _print(rows: list[QueueStatus], args: argparse.Namespace) -> None:
    if args.json:
        import orjson

        print(orjson.dumps(as_json(rows)).decode(), flush=True)
        return
    from rich.console import Console

    Console().print(table(rows))


async def _watch(sqs: Any, refs: list[QueueRef], args: argparse.Namespace) -> None:
    history = History(args.window_s)
    refreshes = 0
    live = None if args.json else _live()
    try:
        while True:
            rows = history.add(await sample(sqs, refs))
            refreshes += 1
            if live is None:
                _print(rows, args)
            else:
                title = f"sqsinfer status · every {args.interval_s:g} s · Ctrl-C ends"
                live.update(table(rows, title), refresh=True)
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
