"""`sqsinfer diff`: how the outputs of one batch under two prefixes differ (model A and B).

    manifest lines ─▶ task id, its output key under A ─▶ the same relative key under B
    (or --listing: both prefixes listed, merged by relative key)
        ─▶ bounded queue ─▶ N comparers: GET A ∥ GET B ─▶ the worker's decoders
           ─▶ shapes equal? ─▶ compare (sqsinfer.ops.changes) ─▶ one Tally

Memory is bounded whatever the batch: `concurrency` tasks are in flight (each at most
two objects of `max_input_bytes` and their decoded arrays), the manifest is read a chunk
at a time, a listing a page at a time, and the Tally is of fixed size. Outputs are
decoded by the formats' own decoders, which never unpickle.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import math
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import IO, Any

import aiohttp
import numpy as np
from botocore.exceptions import BotoCoreError, ClientError

from sqsinfer.aws.session import error_code, http_status
from sqsinfer.compute import formats
from sqsinfer.compute.errors import InputError
from sqsinfer.limits import S3_LIST_PAGE_MAX
from sqsinfer.messages import S3Uri, parse_s3_uri
from sqsinfer.ops import common
from sqsinfer.ops.changes import (
    BAD_LINE,
    EPS,
    MISSING_BOTH,
    ONLY_A,
    ONLY_B,
    SHAPE_MISMATCH,
    UNREADABLE,
    Change,
    Tally,
    compare,
)
from sqsinfer.ops.enqueue import in_thread
from sqsinfer.ops.manifest import (
    MANIFEST_FORMATS,
    BadLine,
    Entry,
    Item,
    KeyPattern,
    Validator,
    list_keys,
    manifest_format,
    read_manifest,
    run_on_manifest,
)

# Outputs up to this size are decoded and compared on the event loop; larger ones in a
# thread, so that one large pair does not hold up the other GETs.
_INLINE_BYTES = 1 << 18
# Throttling answers are 503 (SlowDown), retried by the SDK; any other 4xx but a missing
# key is a refusal of every GET alike (no such bucket, access denied): the run stops.
_THROTTLING = frozenset({"SlowDown", "ThrottlingException", "RequestThrottled", "Throttling"})
# What a GET that got no answer, or whose body broke off, raises (the SDK's, aiohttp's).
_BROKEN = (BotoCoreError, aiohttp.ClientError, OSError)

EPILOG = f"""\
Tasks come from a manifest (what sqsinfer enqueue reads: JSONL messages or CSV): each
task's output key under PREFIX_A is derived as the worker derives it
({{prefix}}/{{task_id}}.{{output_format}}) or is the message's own "output", which must lie
under PREFIX_A; the same relative key under PREFIX_B is its counterpart. With --listing
instead, every output object (.npy, .json, .parquet) under either prefix is paired with
the one of the same relative key under the other.

Per task: max |a-b| and max |a-b| / max(|a|, {EPS:.3g}) over the cells that are numbers
on both sides; a cell NaN on both sides is equal, one NaN on one side only is a change of
its own (beyond any threshold). Over the batch: quantiles (within 0.5%) of both, the
share of tasks beyond --threshold (on max |a-b|), the top --top tasks, and the tasks
present on one side only, of different shapes, or unreadable.

examples:
  sqsinfer diff s3://scores/model-a/ s3://scores/model-b/ --manifest tasks.jsonl
  sqsinfer diff s3://scores/a/ s3://scores/b/ --manifest tasks.csv --threshold 1e-4 --json
  sqsinfer diff s3://scores/a/ s3://scores/b/ --listing --top 20 --plot changes.png

exit status: 0 every task present on both sides, compared, and within --threshold when
given; 1 otherwise (or the run failed); 2 usage.
"""


class DiffError(Exception):
    """A problem that stops the whole run (no such bucket, access denied)."""


@dataclass(frozen=True)
class Pair:
    """A task and its output under each prefix."""

    index: int
    task_id: str
    a: S3Uri
    b: S3Uri

    def named(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "a": str(self.a), "b": str(self.b)}


@dataclass(frozen=True)
class OneSided:
    """A listed output with no counterpart under the other prefix."""

    index: int
    task_id: str
    category: str  # ONLY_A or ONLY_B
    uri: S3Uri


@dataclass(frozen=True)
class Refused:
    """A manifest line that names no task to compare."""

    index: int
    line: BadLine


Work = Pair | OneSided | Refused


# What comparing one pair of objects found.
@dataclass(frozen=True)
class Compared:
    change: Change
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Shapes:
    a: tuple[int, ...]
    b: tuple[int, ...]


@dataclass(frozen=True)
class Unreadable:
    side: str  # "a" or "b"
    reason: str


Judged = Compared | Shapes | Unreadable


@dataclass(frozen=True)
class Limits:
    max_object_bytes: int
    max_decoded_bytes: int


@dataclass
class Differ:
    """Compares `concurrency` tasks at a time into one Tally."""

    s3: Any
    tally: Tally
    limits: Limits
    concurrency: int = 16

    async def run(self, work: AsyncIterator[Work]) -> Tally:
        queue: asyncio.Queue[Pair | None] = asyncio.Queue(self.concurrency)
        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(self.concurrency):
                    group.create_task(self._comparer(queue))
                await self._produce(work, queue)
        except BaseExceptionGroup as errors:  # the first real error, not a group of one
            raise errors.exceptions[0] from None
        return self.tally

    async def _produce(self, work: AsyncIterator[Work], queue: asyncio.Queue[Pair | None]) -> None:
        async for item in work:
            if isinstance(item, Pair):
                await queue.put(item)
            elif isinstance(item, OneSided):
                side = "a" if item.category == ONLY_A else "b"
                named = {"task_id": item.task_id, side: str(item.uri)}
                self.tally.problem(item.category, item.index, named)
            else:
                print(f"sqsinfer diff: bad line {item.line}", file=sys.stderr)
                line = item.line
                named = {"where": line.where, "reason": line.reason, "detail": line.detail}
                self.tally.problem(BAD_LINE, item.index, named)
        for _ in range(self.concurrency):
            await queue.put(None)

    async def _comparer(self, queue: asyncio.Queue[Pair | None]) -> None:
        while (pair := await queue.get()) is not None:
            self._record(pair, await self.compare(pair))

    async def compare(self, pair: Pair) -> Judged | str:
        """What the pair's outputs show, or the category of a missing one."""
        got_a, got_b = await asyncio.gather(self._get(pair.a), self._get(pair.b))
        if got_a is None or got_b is None:
            return MISSING_BOTH if got_a is got_b else ONLY_B if got_a is None else ONLY_A
        if isinstance(got_a, str) or isinstance(got_b, str):
            return Unreadable("a", got_a) if isinstance(got_a, str) else Unreadable("b", str(got_b))
        max_decoded = self.limits.max_decoded_bytes
        if len(got_a) + len(got_b) <= _INLINE_BYTES:
            return judge(pair, got_a, got_b, max_decoded)
        return await asyncio.to_thread(judge, pair, got_a, got_b, max_decoded)

    def _record(self, pair: Pair, found: Judged | str) -> None:
        if isinstance(found, Compared):
            self.tally.changed(pair.index, pair.named(), found.change, found.shape)
        elif isinstance(found, Shapes):
            shapes = {"shape_a": list(found.a), "shape_b": list(found.b)}
            self.tally.problem(SHAPE_MISMATCH, pair.index, pair.named() | shapes)
        elif isinstance(found, Unreadable):
            why = {"side": found.side, "reason": found.reason}
            self.tally.problem(UNREADABLE, pair.index, pair.named() | why)
        else:
            self.tally.problem(found, pair.index, pair.named())

    async def _get(self, uri: S3Uri) -> bytes | str | None:
        """The object's bytes; None when there is none; why, when it cannot be read (too
        large, or the GET failed after the SDK's retries)."""
        try:
            response = await self.s3.get_object(Bucket=uri.bucket, Key=uri.key)
        except ClientError as exc:
            if http_status(exc) == 404 and error_code(exc) != "NoSuchBucket":
                return None
            if 400 <= http_status(exc) < 500 and error_code(exc) not in _THROTTLING:
                raise DiffError(f"cannot read {uri}: {exc}") from None
            return f"GET failed: {error_code(exc) or exc}"
        except _BROKEN as exc:
            return f"GET failed: {type(exc).__name__}: {exc}"
        async with response["Body"] as body:
            size = int(response["ContentLength"])
            if size > self.limits.max_object_bytes:
                return f"{size} bytes, more than max_input_bytes ({self.limits.max_object_bytes})"
            try:
                data: bytes = await body.read()
            except _BROKEN as exc:  # the body broke off half-way
                return f"GET failed: {type(exc).__name__}: {exc}"
        return data


def judge(pair: Pair, data_a: bytes, data_b: bytes, max_decoded_bytes: int) -> Judged:
    """Decode both outputs with the worker's decoders and compare them."""
    arrays = []
    for side, uri, data in (("a", pair.a, data_a), ("b", pair.b, data_b)):
        try:
            arrays.append(decode(uri, data, max_decoded_bytes))
        except InputError as exc:
            return Unreadable(side, f"{exc.reason}: {exc.detail}")
    a, b = arrays
    if a.shape != b.shape:
        return Shapes(a.shape, b.shape)
    return Compared(compare(a, b), a.shape)


def decode(uri: S3Uri, data: bytes, max_decoded_bytes: int) -> np.ndarray:
    """An output as its format's decoder reads it (a next stage reads it so too)."""
    fmt = formats.for_output(uri.suffix)
    if fmt is None:
        raise InputError("unsupported_format", f"{uri.suffix or 'no suffix'} is not an output")
    if fmt.missing:
        raise InputError("unsupported_format", fmt.missing)
    return fmt.decode(memoryview(data), max_decoded_bytes, formats.NO_OPTIONS)


# -- where the pairs come from ----------------------------------------------------------
def counterpart(uri: S3Uri, a: S3Uri, b: S3Uri) -> S3Uri:
    """The object under `b` at the key `uri` has relative to `a`."""
    return S3Uri(b.bucket, b.key + uri.key[len(a.key) :])


def validator(a: S3Uri, output_format: str) -> Validator:
    """The worker's rules, lenient about inputs: outputs derived under A, or named under A."""
    return Validator(output_prefix=a, allowed_outputs=(a,), output_suffix="." + output_format)


async def from_manifest(items: AsyncIterator[Item], a: S3Uri, b: S3Uri) -> AsyncIterator[Work]:
    """Each task of a manifest read with `validator(a, ...)`, its output paired with B's."""
    index = 0
    async for item in items:
        if isinstance(item, Entry):
            task = item.task
            yield Pair(index, task.task_id, task.output, counterpart(task.output, a, b))
        else:
            yield Refused(index, item)
        index += 1


async def from_listing(s3: Any, a: S3Uri, b: S3Uri) -> AsyncIterator[Work]:
    """Both prefixes' outputs, merged by relative key (S3 lists in key order)."""
    async with contextlib.AsyncExitStack() as stack:
        left = await stack.enter_async_context(_read_ahead(_outputs(s3, a), S3_LIST_PAGE_MAX))
        right = await stack.enter_async_context(_read_ahead(_outputs(s3, b), S3_LIST_PAGE_MAX))
        async for item in _merged(left, right, a, b):
            yield item


async def _merged(
    left: AsyncIterator[str], right: AsyncIterator[str], a: S3Uri, b: S3Uri
) -> AsyncIterator[Work]:
    x, y = await anext(left, None), await anext(right, None)
    index = 0
    while x is not None or y is not None:
        if y is None or (x is not None and x < y):
            assert x is not None
            yield OneSided(index, _task_id(x), ONLY_A, a.child(x))
            x = await anext(left, None)
        elif x is None or y < x:
            yield OneSided(index, _task_id(y), ONLY_B, b.child(y))
            y = await anext(right, None)
        else:
            yield Pair(index, _task_id(x), a.child(x), b.child(y))
            x, y = await anext(left, None), await anext(right, None)
        index += 1


async def _outputs(s3: Any, prefix: S3Uri) -> AsyncIterator[str]:
    """The keys of output objects under `prefix`, relative to it, in key order."""
    last = ""
    async for key in list_keys(s3, KeyPattern.parse(str(prefix))):
        if key < last:  # a directory bucket lists in no order: a merge would mispair
            raise DiffError(f"the listing of {prefix} is not in key order: give --manifest")
        last = key
        if formats.for_output(S3Uri(prefix.bucket, key).suffix) is not None:
            yield key[len(prefix.key) :]


@contextlib.asynccontextmanager
async def _read_ahead(items: AsyncIterator[str], depth: int) -> AsyncIterator[AsyncIterator[str]]:
    """`items`, fetched up to `depth` ahead by a task of their own: a listing's next page
    is on its way while the last one's pairs are compared, rather than after."""
    queue: asyncio.Queue[str | BaseException | None] = asyncio.Queue(depth)

    async def fill() -> None:
        try:
            async for item in items:
                await queue.put(item)
        except Exception as exc:  # raised where the items are read, not in this task
            await queue.put(exc)
        else:
            await queue.put(None)

    async def read() -> AsyncIterator[str]:
        while (item := await queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    filler = asyncio.create_task(fill())
    try:
        yield read()
    finally:
        filler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await filler


def _task_id(relative: str) -> str:
    return relative[: relative.rfind(".")]


# -- the report -------------------------------------------------------------------------
def report(tally: Tally, a: S3Uri, b: S3Uri, source: str, elapsed_s: float) -> dict[str, Any]:
    rate = tally.tasks / elapsed_s if elapsed_s > 0 else 0.0
    return (
        {"a": str(a), "b": str(b), "source": source}
        | tally.as_dict()
        | {
            "elapsed_s": round(elapsed_s, 3),
            "tasks_per_s": round(rate, 1),
        }
    )


_PROBLEM_NAMES = {
    ONLY_A: "only in A",
    ONLY_B: "only in B",
    MISSING_BOTH: "in neither",
    SHAPE_MISMATCH: "shape mismatch",
    UNREADABLE: "unreadable",
    BAD_LINE: "bad lines",
}


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _shape(shape: list[int]) -> str:
    return "×".join(map(str, shape))


def _summary_rows(doc: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [
        ("A", doc["a"]),
        ("B", doc["b"]),
        ("tasks", f"{doc['tasks']:,} ({doc['source']})"),
        ("compared", f"{doc['compared']:,}"),
        ("identical", f"{doc['identical']:,}"),
        ("NaN on one side only", f"{doc['nan_mismatch_tasks']:,}"),
    ]
    if doc["threshold"] is not None:
        share = doc["beyond_threshold_share"]
        percent = "" if share is None else f" ({share:.2%})"
        rows.append((f"beyond {doc['threshold']:g}", f"{doc['beyond_threshold']:,}{percent}"))
    rows += [(name, f"{doc[key]:,}") for key, name in _PROBLEM_NAMES.items()]
    rows.append(("rate", f"{doc['tasks_per_s']:,.0f} tasks/s in {doc['elapsed_s']:.1f} s"))
    return rows


def _example(key: str, found: dict[str, Any]) -> str:
    if key == BAD_LINE:
        return str(found["where"])
    if key == SHAPE_MISMATCH:
        return (
            f"{found['task_id']} ({_shape(found['shape_a'])} in A, {_shape(found['shape_b'])} in B)"
        )
    if key == UNREADABLE:
        return f"{found['task_id']} ({found['side'].upper()}: {found['reason']})"
    return str(found["task_id"])


def example_lines(doc: dict[str, Any]) -> list[str]:
    """The first tasks of each problem category, a line each."""
    lines = []
    for key, name in _PROBLEM_NAMES.items():
        found = doc["examples"][key]
        if found:
            more = ", ..." if doc[key] > len(found) else ""
            lines.append(f"{name}: {', '.join(_example(key, e) for e in found)}{more}")
    return lines


def render(doc: dict[str, Any]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console()
    summary = Table(title="diff", title_justify="left", show_header=False, box=box.SIMPLE)
    summary.add_column()
    summary.add_column(justify="right")
    for name, value in _summary_rows(doc):
        summary.add_row(name, value)
    console.print(summary)
    spread = Table(title="change per task", title_justify="left", box=box.SIMPLE)
    for name in ("", "p50", "p90", "p99", "max"):
        spread.add_column(name, justify="right" if name else "left")
    for key, name in (("max_abs", "max |a-b|"), ("max_rel", "max relative")):
        spread.add_row(name, *(_number(doc[key][q]) for q in ("p50", "p90", "p99", "max")))
    console.print(spread)
    if doc["top"]:
        title = f"top {len(doc['top'])} by max |a-b|"
        top = Table(title=title, title_justify="left", box=box.SIMPLE)
        for name in ("task", "max |a-b|", "max relative", "NaN one side", "shape"):
            top.add_column(name, justify="left" if name == "task" else "right")
        for t in doc["top"]:
            numbers = (_number(t["max_abs"]), _number(t["max_rel"]), f"{t['nan_mismatches']:,}")
            top.add_row(t["task_id"], *numbers, _shape(t["shape"]))
        console.print(top)
    for line in example_lines(doc):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def verdict(doc: dict[str, Any]) -> str:
    """Why the run is not clean, in one line ("" when it is)."""
    parts = [f"{name} {doc[key]:,}" for key, name in _PROBLEM_NAMES.items() if doc[key]]
    if doc["beyond_threshold"]:
        parts.append(f"beyond {doc['threshold']:g} {doc['beyond_threshold']:,}")
    return ", ".join(parts)


def plot(tally: Tally, path: str) -> None:
    """A PNG histogram of the per-task max |a-b| on a log axis (10 bins a decade)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values, counts = tally.max_abs.buckets()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if values.size:
        low = math.floor(math.log10(values.min()))
        high = max(low + 1, math.ceil(math.log10(values.max())))
        edges = np.logspace(low, high, (high - low) * 10 + 1)
        ax.hist(values, bins=edges.tolist(), weights=counts, color="tab:blue")
        ax.set_xscale("log")
    if tally.threshold:
        ax.axvline(tally.threshold, color="tab:red", linestyle="--")
        ax.text(
            tally.threshold,
            1,
            f" threshold {tally.threshold:g}",
            transform=ax.get_xaxis_transform(),
            va="top",
            color="tab:red",
        )
    ax.set_xlabel("per-task max |a − b|")
    ax.set_ylabel("tasks")
    ax.set_title(
        f"{tally.compared:,} tasks compared; {tally.max_abs.zeros:,} with max |a − b| = 0 "
        "(not on a log axis)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the command ----------------------------------------------------------------------
BORROWED = ("output_format", "max_input_bytes", "max_decoded_bytes")
_NOTES = {
    "output_format": "the suffix of derived output keys under both prefixes",
    "max_input_bytes": "here: the largest output object read",
    "max_decoded_bytes": "here: the largest decoded output",
}


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "diff",
        help="how two prefixes' outputs of the same tasks differ (model A against B)",
        description="Compare the outputs of one batch under two prefixes, task by task.",
        epilog=EPILOG,
        formatter_class=common.formatter(),
    )
    p.add_argument("prefix_a", metavar="PREFIX_A", help="s3:// prefix of the reference outputs")
    p.add_argument("prefix_b", metavar="PREFIX_B", help="s3:// prefix of the outputs to compare")
    p.add_argument("--manifest", metavar="FILE", help="the tasks: JSONL or CSV; - reads stdin")
    p.add_argument("--format", choices=MANIFEST_FORMATS, help="manifest format (by suffix)")
    p.add_argument(
        "--listing", action="store_true", help="no manifest: pair the outputs listed under both"
    )
    p.add_argument(
        "--threshold",
        metavar="X",
        type=_non_negative,
        help="exit 1 when a task's max |a-b| passes it",
    )
    p.add_argument(
        "--top",
        metavar="K",
        type=common.parse_count,
        default=10,
        help="tasks of largest change listed (10)",
    )
    p.add_argument(
        "--concurrency",
        metavar="N",
        type=common.positive_int,
        default=16,
        help="tasks compared at once (16)",
    )
    p.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    p.add_argument("--plot", metavar="PNG", help="write a histogram of the changes (matplotlib)")
    common.borrow(p, BORROWED, notes=_NOTES)
    common.add_log_level(p)
    p.set_defaults(func=cmd_diff)


def _prefixes(args: argparse.Namespace) -> tuple[S3Uri, S3Uri]:
    """The two prefixes; ValueError says what is wrong with them."""
    a = parse_s3_uri(args.prefix_a, "PREFIX_A", prefix=True)
    b = parse_s3_uri(args.prefix_b, "PREFIX_B", prefix=True)
    if a == b:
        raise ValueError("PREFIX_A and PREFIX_B are the same prefix")
    if args.listing and (a.within(b) or b.within(a)):
        raise ValueError("with --listing, neither prefix may lie inside the other")
    return a, b


def _check_args(args: argparse.Namespace) -> str | None:
    if bool(args.manifest) == bool(args.listing):
        return "give --manifest FILE (- for stdin) or --listing, one of them"
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib: pip install 'sqsinfer[plot]'"
    return None


@common.quiet_on_broken_pipe
def cmd_diff(args: argparse.Namespace) -> int:
    problem = _check_args(args)
    if problem:
        return common.usage_error("diff", problem)
    try:
        a, b = _prefixes(args)
    except ValueError as exc:
        return common.usage_error("diff", str(exc))
    return run_on_manifest("diff", args.manifest, args.log_level, lambda fh: _main(args, a, b, fh))


async def _main(args: argparse.Namespace, a: S3Uri, b: S3Uri, fh: IO[bytes] | None) -> int:
    from sqsinfer.aws.session import open_clients

    tally = Tally(threshold=args.threshold, top_k=args.top)
    limits = Limits(args.max_input_bytes, args.max_decoded_bytes)
    started = time.monotonic()
    async with open_clients(args.region, args.endpoint_url, 2 * args.concurrency) as clients:
        if fh is None:
            work = from_listing(clients.s3, a, b)
        else:
            name = "stdin" if args.manifest == "-" else args.manifest
            fmt = manifest_format(name, args.format)
            lines = read_manifest(fh, name, fmt, validator(a, args.output_format))
            work = from_manifest(in_thread(lines), a, b)
        try:
            await Differ(clients.s3, tally, limits, args.concurrency).run(work)
        except (DiffError, ClientError, BotoCoreError) as exc:
            print(f"sqsinfer diff: {exc}", file=sys.stderr)
            return common.EXIT_FAILED
    doc = report(tally, a, b, "listing" if fh is None else "manifest", time.monotonic() - started)
    return _finish(args, tally, doc)


def _finish(args: argparse.Namespace, tally: Tally, doc: dict[str, Any]) -> int:
    if args.plot:
        try:
            plot(tally, args.plot)
        except OSError as exc:
            print(f"sqsinfer diff: cannot write {args.plot}: {exc}", file=sys.stderr)
            return common.EXIT_FAILED
    if args.json:
        import orjson

        print(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
    else:
        render(doc)
    if not tally.ok:
        print(f"sqsinfer diff: {verdict(doc)}", file=sys.stderr)
        return common.EXIT_FAILED
    return common.EXIT_OK
