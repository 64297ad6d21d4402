"""`sqsinfer enqueue`: put tasks on a stage's queue, from a manifest or an S3 listing.

    manifest lines / listed keys ─▶ validate (the worker's rules) ─bad─▶ stderr, summary
        ─▶ batches of ten (≤ 256 KiB) ─▶ bounded queue ─▶ N senders: [HEAD output] ─▶
           SendMessageBatch ─Failed─▶ retried with backoff ─still─▶ failed, exit 1

Only `concurrency` batches wait between the reader and the senders, so memory stays
flat however long the manifest. Re-running is safe: a task's output key is fixed by
its id, so a task sent twice is computed once (the second delivery is a duplicate).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import os
import socket
import stat
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from botocore.exceptions import BotoCoreError, ClientError

from sqsinfer import backoff, tracing
from sqsinfer.aws.s3 import Storage
from sqsinfer.aws.session import error_code, http_status
from sqsinfer.aws.sqs import is_fifo, message_size, send_entry
from sqsinfer.limits import SQS_BATCH_MAX, SQS_BATCH_MAX_BYTES
from sqsinfer.logs import Event
from sqsinfer.messages import (
    S3Uri,
    deduplication_id,
    filled_uri,
    has_placeholders,
    message_group,
    placeholder_values,
)
from sqsinfer.ops import common
from sqsinfer.ops.manifest import (
    MANIFEST_FORMATS,
    BadLine,
    Entry,
    Item,
    KeyPattern,
    Validator,
    manifest_format,
    read_listing,
    read_manifest,
    run_on_manifest,
)
from sqsinfer.tracing.api import FLUSH_S, OFF, Tracer

log = logging.getLogger("sqsinfer.enqueue")

_READ_CHUNK = 500  # manifest items parsed per hop to the reader thread
_RETRY_MAX_S = 5.0
_THROTTLING = frozenset({"ThrottlingException", "RequestThrottled", "Throttling"})

EPILOG = """\
A manifest is JSONL (one message per line: {"task_id": ..., "input": "s3://...",
"output"?: ..., "params"?: {...}}) or CSV (task_id,input[,output], optional header).
Lines are checked with the worker's own rules; bad ones are reported with their line
numbers on stderr and skipped. Give the stage's --allowed-input-prefixes and
--output-prefix (or its SQSINFER_ variables) to check exactly what the worker will.

examples:
  sqsinfer enqueue tasks.jsonl --queue-url https://sqs.eu-west-1.amazonaws.com/1234/score
  zcat tasks.csv.gz | sqsinfer enqueue - --format csv --queue-url $URL
  sqsinfer enqueue --from-prefix 's3://features/2026-11-01/*.npy' --queue-url $URL
  sqsinfer enqueue tasks.jsonl --queue-url $URL --skip-done --output-prefix s3://scores/
  sqsinfer enqueue tasks.jsonl --dry-run          # validate only, send nothing
  sqsinfer enqueue tasks.jsonl --queue-url $URL --group-field tenant   # a fair queue

--group-field FIELD sends each task's top-level FIELD (a string or an integer) as its
MessageGroupId: on a standard queue SQS then serves the groups fairly, so one tenant's
burst does not delay the others. A task without it, or with a value SQS would refuse
(1-128 letters, digits or ASCII punctuation), is a bad line. In a CSV manifest the
header names the column.

exit status: 0 all sent (or skipped as done), 1 some could not be sent (re-run: it is
safe), 2 usage, 3 bad lines were skipped and everything else was sent.
"""


class EnqueueError(Exception):
    """A problem that stops the whole run (no such queue, access denied)."""


@dataclass
class EnqueueOptions:
    queue_url: str
    concurrency: int = 8
    retries: int = 5
    retry_base_s: float = 0.2
    skip_done: bool = False
    dry_run: bool = False


@dataclass
class EnqueueSummary:
    queue_url: str = ""
    dry_run: bool = False
    sent: int = 0
    skipped_done: int = 0
    bad: int = 0
    failed: int = 0
    retried: int = 0  # entry attempts after the first
    bad_reasons: collections.Counter[str] = field(default_factory=collections.Counter)
    elapsed_s: float = 0.0
    interrupted: bool = False

    @property
    def rate_per_s(self) -> float:
        return self.sent / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def exit_code(self) -> int:
        if self.failed or self.interrupted:
            return common.EXIT_FAILED
        return common.EXIT_PARTIAL if self.bad else common.EXIT_OK

    def as_dict(self) -> dict[str, Any]:
        return {
            "queue_url": self.queue_url,
            "dry_run": self.dry_run,
            "sent": self.sent,
            "skipped_done": self.skipped_done,
            "bad": self.bad,
            "failed": self.failed,
            "retried": self.retried,
            "bad_reasons": dict(sorted(self.bad_reasons.items())),
            "elapsed_s": round(self.elapsed_s, 3),
            "rate_per_s": round(self.rate_per_s, 1),
            "interrupted": self.interrupted,
        }

    def lines(self) -> list[str]:
        verb = "would send" if self.dry_run else "sent"
        head = (
            f"{verb} {self.sent:,}, skipped as done {self.skipped_done:,}, "
            f"bad lines {self.bad:,}, failed {self.failed:,} "
            f"in {self.elapsed_s:.1f} s ({self.rate_per_s:,.0f} tasks/s)"
        )
        if self.interrupted:
            head = "interrupted: " + head
        out = [head]
        if self.bad_reasons:
            reasons = ", ".join(f"{r} {n:,}" for r, n in sorted(self.bad_reasons.items()))
            out.append(f"bad lines by reason: {reasons}")
        if self.failed or self.interrupted:
            out.append("re-running is safe: a task sent twice is computed once")
        return out


class Progress(Protocol):
    def bad(self, line: BadLine) -> None: ...

    def failed(self, entry: Entry, why: str) -> None: ...

    def advance(self, items: int, size_bytes: int) -> None: ...


class PlainProgress:
    """Problems on stderr, one line each; no bar (not a terminal, or --quiet)."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream

    def _print(self, text: str) -> None:
        print(text, file=self.stream or sys.stderr)

    def bad(self, line: BadLine) -> None:
        self._print(f"bad line {line}")

    def failed(self, entry: Entry, why: str) -> None:
        self._print(f"not sent {entry.where}: task {entry.task.task_id}: {why}")

    def advance(self, items: int, size_bytes: int) -> None:
        pass


class Enqueuer:
    """Sends validated entries in batches of ten, at most `concurrency` calls at once."""

    def __init__(
        self,
        sqs: Any,
        s3: Any,
        options: EnqueueOptions,
        progress: Progress | None = None,
        tracer: Tracer = OFF,
    ) -> None:
        self.sqs = sqs
        self.storage = Storage(s3)
        self.options = options
        self.tracer = tracer  # one trace per task, its context in the message's `traceparent`
        self.progress: Progress = progress or PlainProgress()
        self.summary = EnqueueSummary(queue_url=options.queue_url, dry_run=options.dry_run)

    async def run(self, items: AsyncIterator[Item]) -> EnqueueSummary:
        started = time.monotonic()
        batches: asyncio.Queue[list[Entry] | None] = asyncio.Queue(self.options.concurrency)
        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(self.options.concurrency):
                    group.create_task(self._sender(batches))
                await self._produce(items, batches)
        except BaseExceptionGroup as errors:  # the first real error, not a group of one
            raise errors.exceptions[0] from None
        except asyncio.CancelledError:
            self.summary.interrupted = True
            raise
        finally:
            self.summary.elapsed_s = time.monotonic() - started
        return self.summary

    # -- reading ----------------------------------------------------------------------
    async def _produce(
        self, items: AsyncIterator[Item], batches: asyncio.Queue[list[Entry] | None]
    ) -> None:
        batch: list[Entry] = []
        batch_bytes = 0
        async for item in items:
            if isinstance(item, BadLine):
                self.summary.bad += 1
                self.summary.bad_reasons[item.reason] += 1
                self.progress.bad(item)
                self.progress.advance(1, item.size_bytes)
                continue
            entry = self._traced(item)
            size = message_size(entry.body, entry.trace.outgoing())
            if batch and (len(batch) == SQS_BATCH_MAX or batch_bytes + size > SQS_BATCH_MAX_BYTES):
                await batches.put(batch)
                batch, batch_bytes = [], 0
            batch.append(entry)
            batch_bytes += size
        if batch:
            await batches.put(batch)
        for _ in range(self.options.concurrency):
            await batches.put(None)

    def _traced(self, entry: Entry) -> Entry:
        """The entry with a trace of its own, begun here (its context counts toward the
        batch's bytes)."""
        if not self.tracer.enabled:
            return entry
        trace = self.tracer.produce(self.options.queue_url, entry.task.task_id)
        return dataclasses.replace(entry, trace=trace)

    # -- sending ----------------------------------------------------------------------
    async def _sender(self, batches: asyncio.Queue[list[Entry] | None]) -> None:
        while (batch := await batches.get()) is not None:
            if self.options.skip_done:
                batch = await self._drop_done(batch)
            if not batch:
                continue
            if self.options.dry_run:
                self._done(batch)
            else:
                await self._send(batch)

    async def _drop_done(self, batch: list[Entry]) -> list[Entry]:
        found = await asyncio.gather(*(self._exists(entry.task.output) for entry in batch))
        keep = []
        for entry, exists in zip(batch, found, strict=True):
            if exists:
                self.summary.skipped_done += 1
                self.progress.advance(1, entry.size_bytes)
                entry.trace.end()
            else:
                keep.append(entry)
        return keep

    async def _exists(self, uri: S3Uri) -> bool:
        try:
            return await self.storage.head(uri) is not None
        except (ClientError, BotoCoreError, OSError) as exc:
            # Sending is the safe answer: the worker's own HEAD skips a finished task.
            log.warning(
                Event.OUTPUT_CHECK_FAILED,
                extra={"uri": str(uri), "error": str(exc)},
            )
            return False

    async def _send(self, batch: list[Entry]) -> None:
        pending: list[tuple[Entry, str]] = [(entry, "") for entry in batch]
        for attempt in range(self.options.retries + 1):
            if attempt:
                self.summary.retried += len(pending)
                await asyncio.sleep(self._backoff_s(attempt))
            pending = await self._attempt([entry for entry, _ in pending])
            if not pending:
                return
        for entry, why in pending:
            self._failed(entry, why)

    def _backoff_s(self, attempt: int) -> float:
        return backoff.delay_s(attempt - 1, self.options.retry_base_s, _RETRY_MAX_S)

    async def _attempt(self, entries: list[Entry]) -> list[tuple[Entry, str]]:
        """One SendMessageBatch; returns the entries worth another attempt."""
        fifo = is_fifo(self.options.queue_url)
        request = [_request(str(i), e, fifo) for i, e in enumerate(entries)]
        traces = [e.trace for e in entries]
        try:
            with tracing.batch("SendMessageBatch", self.options.queue_url, traces, "producer"):
                response = await self.sqs.send_message_batch(
                    QueueUrl=self.options.queue_url, Entries=request
                )
        except (ClientError, BotoCoreError, OSError) as exc:
            if _fatal(exc):
                raise EnqueueError(f"cannot send to {self.options.queue_url}: {exc}") from None
            why = error_code(exc) or type(exc).__name__
            return [(entry, why) for entry in entries]
        ok = {item["Id"] for item in response.get("Successful", [])}
        failures = {item["Id"]: item for item in response.get("Failed", [])}
        self._done([e for i, e in enumerate(entries) if str(i) in ok])
        retry = []
        for i, entry in enumerate(entries):
            if str(i) in ok:
                continue
            failure = failures.get(str(i), {})
            why = f"{failure.get('Code', 'NotReported')}: {failure.get('Message', '')}".strip()
            if failure.get("SenderFault"):
                self._failed(entry, why)  # the request itself is wrong: sending again won't help
            else:
                retry.append((entry, why))
        return retry

    def _done(self, entries: list[Entry]) -> None:
        self.summary.sent += len(entries)
        self.progress.advance(len(entries), sum(e.size_bytes for e in entries))
        for entry in entries:
            entry.trace.end()

    def _failed(self, entry: Entry, why: str) -> None:
        entry.trace.end(error=why)
        self.summary.failed += 1
        self.progress.failed(entry, why)
        self.progress.advance(1, entry.size_bytes)


def _request(entry_id: str, entry: Entry, fifo: bool = False) -> dict[str, Any]:
    """One SendMessageBatch entry: the body, the task's trace context when traced, and
    its group id when grouped. To a FIFO queue, always a group (the `--group-field`'s,
    else the task's `group`, else its id) and a deduplication id from its output key: a
    re-run within SQS's 5 minutes adds no second message."""
    group, dedup = entry.group_id, ""
    if fifo:
        task = entry.task
        group = group or message_group(task.task_id, task.group)
        dedup = deduplication_id(str(task.output))
    return {"Id": entry_id, **send_entry(entry.body, entry.trace.outgoing(), group, dedup)}


def _fatal(exc: BaseException) -> bool:
    """A refusal of the whole request that no retry will change (4xx, not throttling)."""
    status = http_status(exc)
    return 400 <= status < 500 and error_code(exc) not in _THROTTLING


async def check_queue(sqs: Any, url: str) -> None:
    try:
        await sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])
    except (ClientError, BotoCoreError) as exc:
        raise EnqueueError(f"cannot use queue {url}: {exc}") from None


async def in_thread(items: Iterator[Item], chunk: int = _READ_CHUNK) -> AsyncIterator[Item]:
    """A blocking reader (a file, stdin) consumed in chunks off the event loop."""
    while True:
        block = await asyncio.to_thread(lambda: list(itertools.islice(items, chunk)))
        if not block:
            return
        for item in block:
            yield item


# -- the progress bar -----------------------------------------------------------------
class RichProgress:
    """A live bar on stderr: by manifest bytes when the size is known (so the ETA is real)."""

    def __init__(self, summary: EnqueueSummary, total_bytes: int | None, label: str) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            Progress,
            SpinnerColumn,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.summary = summary
        self.console = Console(stderr=True)
        columns: list[Any] = [SpinnerColumn(), TextColumn("{task.description}")]
        if total_bytes:
            columns += [BarColumn(bar_width=20), TaskProgressColumn()]
        columns += [TextColumn("{task.fields[stats]}"), TimeElapsedColumn()]
        if total_bytes:
            columns += [TextColumn("ETA"), TimeRemainingColumn(compact=True)]
        self.bar = Progress(*columns, console=self.console, transient=False)
        self.task = self.bar.add_task(label, total=total_bytes or None, stats="")
        self.started = time.monotonic()

    def __enter__(self) -> RichProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._refresh(0)
        self.bar.stop()

    def bad(self, line: BadLine) -> None:
        self.console.print(f"bad line {line}", markup=False, highlight=False)

    def failed(self, entry: Entry, why: str) -> None:
        text = f"not sent {entry.where}: task {entry.task.task_id}: {why}"
        self.console.print(text, markup=False, highlight=False)

    def advance(self, items: int, size_bytes: int) -> None:
        self._refresh(size_bytes)

    def _refresh(self, size_bytes: int) -> None:
        s = self.summary
        elapsed = max(1e-9, time.monotonic() - self.started)
        stats = f"{s.sent:,} sent · {s.bad:,} bad"
        if s.skipped_done:
            stats += f" · {s.skipped_done:,} done"
        if s.failed:
            stats += f" · {s.failed:,} failed"
        stats += f" · {s.sent / elapsed:,.0f}/s"
        self.bar.update(self.task, advance=size_bytes, stats=stats)


# -- the command ----------------------------------------------------------------------
BORROWED = (
    "queue_url",
    "allowed_input_prefixes",
    "output_prefix",
    "allowed_output_prefixes",
    "output_format",
    "max_message_bytes",
    "model_sha256",
    "model_version",
)
_NOTES = {
    "allowed_input_prefixes": "unset here: any bucket",
    "output_prefix": "needed by --skip-done",
    "model_sha256": "here the model whose outputs --skip-done looks for: fills {model_sha256_12}",
}


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "enqueue",
        help="send tasks to a queue from a manifest (JSONL/CSV) or an S3 listing",
        description="Send tasks to a stage's queue, validated with the worker's rules.",
        epilog=EPILOG,
        formatter_class=common.formatter(),
    )
    p.add_argument("manifest", nargs="?", help="JSONL or CSV manifest; - reads stdin")
    p.add_argument("--format", choices=MANIFEST_FORMATS, help="manifest format (by suffix)")
    p.add_argument(
        "--from-prefix",
        metavar="S3_GLOB",
        help="enqueue every object matching s3://bucket/prefix/*.npy (* also matches /); "
        "task id: the key below the last folder before the glob, without its suffix",
    )
    p.add_argument(
        "--skip-done", action="store_true", help="skip tasks whose output exists (a HEAD each)"
    )
    add_group_field(p, "each task's FIELD becomes its MessageGroupId (a fair queue)")
    # The stage's own rules, so that a line passes exactly when its worker would accept it.
    common.borrow(p, BORROWED, notes=_NOTES)
    p.add_argument("--concurrency", type=common.positive_int, default=8, help="batch calls (8)")
    p.add_argument("--retries", type=int, default=5, help="attempts after the first (5)")
    p.add_argument("--dry-run", action="store_true", help="validate and count; send nothing")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="the summary as JSON on stdout")
    common.add_log_level(p)
    p.set_defaults(func=cmd_enqueue)


def add_group_field(p: argparse.ArgumentParser, text: str) -> None:
    p.add_argument("--group-field", metavar="FIELD", help=text)


def validator_from_args(args: argparse.Namespace) -> Validator:
    """The worker's message rules from the borrowed settings (already parsed); output
    prefixes that name the model are filled when it is given (ValueError if they cannot be)."""
    prefix, allowed, values = args.output_prefix, args.allowed_output_prefixes, None
    if args.model_sha256:
        values = placeholder_values(args.model_sha256, args.model_version)
        prefix = filled_uri(prefix, values) if prefix is not None else None
        allowed = tuple(filled_uri(p, values) for p in allowed)
    return Validator(
        allowed_inputs=args.allowed_input_prefixes,
        output_prefix=prefix,
        allowed_outputs=allowed,
        output_suffix="." + args.output_format,
        max_message_bytes=args.max_message_bytes,
        placeholders=values,
        group_field=args.group_field or "",
    )


def _check_args(args: argparse.Namespace) -> str | None:
    if bool(args.manifest) == bool(args.from_prefix):
        return "give a manifest (a file, or - for stdin) or --from-prefix, not both"
    if not args.queue_url and not args.dry_run:
        return "--queue-url (or SQSINFER_QUEUE_URL) is required"
    if args.group_field and args.from_prefix:
        return "--group-field needs a manifest: a listed object has no fields to group by"
    if args.skip_done and not args.output_prefix:
        return "--skip-done needs --output-prefix (the stage's SQSINFER_OUTPUT_PREFIX)"
    if args.skip_done and has_placeholders(args.output_prefix.key) and not args.model_sha256:
        return "--skip-done: the output prefix names the model; give --model-sha256"
    return None


def cmd_enqueue(args: argparse.Namespace) -> int:
    problem = _check_args(args)
    if problem:
        return common.usage_error("enqueue", problem)
    try:
        validator = validator_from_args(args)
        pattern = KeyPattern.parse(args.from_prefix) if args.from_prefix else None
    except ValueError as exc:
        return common.usage_error("enqueue", str(exc))
    return run_on_manifest(
        "enqueue", args.manifest, args.log_level, lambda fh: _main(args, validator, pattern, fh)
    )


def _total_bytes(fh: IO[bytes] | None) -> int | None:
    if fh is None:
        return None
    info = os.fstat(fh.fileno())
    return info.st_size if stat.S_ISREG(info.st_mode) else None  # a pipe has no known size


async def _main(
    args: argparse.Namespace,
    validator: Validator,
    pattern: KeyPattern | None,
    fh: IO[bytes] | None,
) -> int:
    tracer: Tracer = OFF
    if not args.dry_run:  # OTEL_* variables decide, as for the worker
        tracer = tracing.from_env(service_instance=socket.gethostname(), component="enqueue")
    try:
        return await _enqueue(args, tracer, validator, pattern, fh)
    finally:
        if tracer.enabled and not await asyncio.to_thread(tracer.shutdown, FLUSH_S):
            log.warning(Event.TRACES_NOT_FLUSHED, extra={"timeout_s": FLUSH_S})


async def _enqueue(
    args: argparse.Namespace,
    tracer: Tracer,
    validator: Validator,
    pattern: KeyPattern | None,
    fh: IO[bytes] | None,
) -> int:
    from sqsinfer.aws.session import open_clients

    options = EnqueueOptions(
        queue_url=args.queue_url,
        concurrency=args.concurrency,
        retries=args.retries,
        skip_done=args.skip_done,
        dry_run=args.dry_run,
    )
    connections = args.concurrency * (SQS_BATCH_MAX if args.skip_done else 1)
    async with open_clients(args.region, args.endpoint_url, connections) as clients:
        enqueuer = Enqueuer(clients.sqs, clients.s3, options, tracer=tracer)
        try:
            if not args.dry_run:
                await check_queue(clients.sqs, args.queue_url)
            items = _items(clients.s3, validator, pattern, fh, args)
            with _progress(args, enqueuer.summary, fh) as progress:
                enqueuer.progress = progress
                summary = await enqueuer.run(items)
        except (EnqueueError, ClientError, BotoCoreError) as exc:  # e.g. no such bucket
            print(f"sqsinfer enqueue: {exc}", file=sys.stderr)
            _report(args, enqueuer.summary)
            return common.EXIT_FAILED
        except asyncio.CancelledError:
            _report(args, enqueuer.summary)
            raise
    _report(args, summary)
    return summary.exit_code()


def _items(
    s3: Any,
    validator: Validator,
    pattern: KeyPattern | None,
    fh: IO[bytes] | None,
    args: argparse.Namespace,
) -> AsyncIterator[Item]:
    if pattern is not None:
        return read_listing(s3, pattern, validator)
    assert fh is not None
    name = "stdin" if args.manifest == "-" else args.manifest
    fmt = manifest_format(name, args.format)
    return in_thread(read_manifest(fh, name, fmt, validator))


def _progress(
    args: argparse.Namespace, summary: EnqueueSummary, fh: IO[bytes] | None
) -> contextlib.AbstractContextManager[Progress]:
    if args.quiet or not sys.stderr.isatty():
        return contextlib.nullcontext(PlainProgress())
    label = "dry run" if args.dry_run else "enqueue"
    return RichProgress(summary, _total_bytes(fh), label)


def _report(args: argparse.Namespace, summary: EnqueueSummary) -> None:
    if args.json:
        import orjson

        print(orjson.dumps(summary.as_dict()).decode())
    else:
        for line in summary.lines():
            print(line)
