"""`sqsinfer redrive`: move messages from a dead-letter queue back to their source queue.

Two paths. This module's is the client's: it receives each message and moves it itself,
so it can filter by reason and route each to the queue it was rejected from. To move
everything to one queue, `--server-side` hands the work to SQS (`ops.move_task`).

    receive (hold) ─▶ reason filter ─no─▶ held, released at the end (visibility 0)
                      ─yes─▶ SendMessageBatch to the target ─ok─▶ DeleteMessageBatch
                                                            ─failed─▶ held, released

Send first, delete second, and only what the send reported successful: an interruption
at any point leaves a message in the DLQ, in the target, or (between the two calls) in
both, which is harmless because its output is keyed by its task. Never in neither.

Messages not moved are held invisible until the run ends rather than released at once:
released at once, the same ones would come back in the next receive and hide the rest.
On Ctrl-C or SIGTERM they are released too; on a kill they come back by themselves
when the hold (`--visibility-timeout-s`) lapses.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from sqsinfer.aws.sqs import (
    REASON_ATTR,
    SOURCE_QUEUE_ATTR,
    Batcher,
    Message,
    SqsQueue,
    send_entry,
)
from sqsinfer.limits import SQS_BATCH_MAX, SQS_MOVE_TASK_MAX_RATE
from sqsinfer.logs import Event
from sqsinfer.ops import common
from sqsinfer.ops.move_task import MoveReport, MoveTaskError, ServerMove

log = logging.getLogger("sqsinfer.redrive")

NO_REASON = "max_receive_count"  # moved by the queue's redrive policy: no sqsinfer.reason
_OWN_PREFIX = "sqsinfer."
_STALE_ROUNDS = 3  # receives in a row that bring only messages already seen: done
_RELEASE_CHUNK = 4 * SQS_BATCH_MAX
_ANSWER_GRACE_S = 5.0  # a cancelled receive's answer is waited for this long past its poll

EPILOG = f"""\
The target of each message: --to, else the queue it was rejected from (its
{SOURCE_QUEUE_ATTR} attribute), else --queue-url. Messages the queue's own redrive
policy moved (too many receives) have no reason attribute: filter them as
--reason {NO_REASON}. Attributes are kept, except the {_OWN_PREFIX}* ones, so a
message rejected again gets fresh ones.

--server-side moves every message with SQS's own message move task instead: nothing
is received here, and every message goes to --to, else --queue-url, unchanged (no
reason filter, no routing by source queue; Ctrl-C cancels the task).

examples:
  sqsinfer redrive --queue-url $STAGE1 --dry-run             # what would move, by reason
  sqsinfer redrive --queue-url $STAGE1 --reason input_not_found
  sqsinfer redrive --dlq-url $DLQ --to $STAGE1 --max-messages 100
  sqsinfer redrive --queue-url $STAGE1 --server-side --max-per-second 100   # everything
"""

# What the server-side path cannot do (it moves everything, and holds nothing).
_CLIENT_SIDE_ONLY = {"reason": "--reason", "dry_run": "--dry-run", "max_messages": "--max-messages"}


class RedriveError(Exception):
    pass


@dataclass(frozen=True)
class RedriveOptions:
    dlq_url: str
    to_url: str = ""  # every message goes here when given
    fallback_url: str = ""  # for messages that do not name their source queue
    reasons: frozenset[str] = frozenset()  # empty: every reason
    dry_run: bool = False
    max_messages: int = 0  # 0: no limit
    hold_s: int = 300
    wait_s: int = 2


@dataclass
class RedriveReport:
    dry_run: bool = False
    received: int = 0  # distinct messages seen
    moved: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    skipped: collections.Counter[str] = field(default_factory=collections.Counter)
    no_target: int = 0
    failed: int = 0  # sends that failed: still in the DLQ
    both: int = 0  # sent, but the delete was not confirmed: in both queues
    interrupted: bool = False

    @property
    def moved_total(self) -> int:
        return sum(self.moved.values())

    def exit_code(self) -> int:
        bad = self.failed or self.no_target or self.interrupted
        return common.EXIT_FAILED if bad else common.EXIT_OK

    def as_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "received": self.received,
            "moved" if not self.dry_run else "would_move": self.moved_total,
            "by_reason": [
                {"reason": reason, "target": target, "messages": n}
                for (reason, target), n in sorted(self.moved.items())
            ],
            "skipped_by_filter": dict(sorted(self.skipped.items())),
            "no_target": self.no_target,
            "failed": self.failed,
            "in_both": self.both,
            "interrupted": self.interrupted,
        }


def reason_of(message: Message) -> str:
    attr = message.attributes.get(REASON_ATTR) or {}
    return str(attr.get("StringValue") or NO_REASON)


def kept_attributes(message: Message) -> dict[str, Any]:
    """The message's own attributes, without sqsinfer's, in the shape a send takes."""
    out = {}
    for name, value in message.attributes.items():
        if name.startswith(_OWN_PREFIX):
            continue
        kept = {k: value[k] for k in ("DataType", "StringValue", "BinaryValue") if k in value}
        out[name] = kept
    return out


class Redriver:
    def __init__(self, sqs: Any, options: RedriveOptions) -> None:
        self.sqs = sqs
        self.options = options
        self.dlq = SqsQueue(sqs, options.dlq_url)
        self.report = RedriveReport(dry_run=options.dry_run)
        self.held: dict[str, Message] = {}  # message id → latest receipt, not yet deleted
        self._senders: dict[str, Batcher] = {}

    async def run(self) -> RedriveReport:
        try:
            await self._loop()
        except asyncio.CancelledError:
            self.report.interrupted = True
            raise
        finally:
            await asyncio.shield(self._release_held())
        return self.report

    async def _loop(self) -> None:
        stale = 0
        while stale < _STALE_ROUNDS and not self._limit_reached():
            batch = await self._receive()
            if not batch:
                return
            fresh = [m for m in batch if m.message_id not in self.held]
            for message in batch:
                self.held[message.message_id] = message  # a lapsed hold: its newer receipt
            stale = 0 if fresh else stale + 1
            self.report.received += len(fresh)
            groups = self._classify(fresh)
            for target, messages in groups.items():
                await self._move(target, messages)

    async def _receive(self) -> list[Message]:
        o = self.options
        receiving = asyncio.ensure_future(self.dlq.receive(SQS_BATCH_MAX, o.wait_s, o.hold_s))
        try:
            return await asyncio.shield(receiving)
        except asyncio.CancelledError:
            # A receive that reached SQS hid what it got for the hold: its answer, briefly
            # waited for, puts those messages with the held ones, released at the end.
            with contextlib.suppress(Exception):
                got = await asyncio.wait_for(receiving, o.wait_s + _ANSWER_GRACE_S)
                self.held.update((m.message_id, m) for m in got)
            raise
        except (ClientError, BotoCoreError) as exc:
            raise RedriveError(f"cannot receive from {o.dlq_url}: {exc}") from None

    def _limit_reached(self) -> bool:
        return 0 < self.options.max_messages <= self.report.moved_total

    def _target(self, message: Message) -> str:
        o = self.options
        source = (message.attributes.get(SOURCE_QUEUE_ATTR) or {}).get("StringValue")
        return o.to_url or str(source or "") or o.fallback_url

    def _classify(self, messages: list[Message]) -> dict[str, list[Message]]:
        """Group what moves by target; everything else stays held until the end."""
        groups: dict[str, list[Message]] = collections.defaultdict(list)
        planned = self.report.moved_total
        for message in messages:
            reason = reason_of(message)
            target = self._target(message)
            if self.options.reasons and reason not in self.options.reasons:
                self.report.skipped[reason] += 1
            elif not target or target == self.options.dlq_url:  # never back into itself
                self.report.no_target += 1
                log.warning(
                    Event.NO_TARGET_FOR_MESSAGE,
                    extra={"message_id": message.message_id, "reason": reason},
                )
            elif self.options.max_messages and planned >= self.options.max_messages:
                continue  # over the limit: released untouched
            elif self.options.dry_run:
                self.report.moved[(reason, target)] += 1
                planned += 1
            else:
                groups[target].append(message)
                planned += 1
        return groups

    async def _move(self, target: str, messages: list[Message]) -> None:
        sender = self._sender(target)
        sends = [
            sender.submit(send_entry(message.body, kept_attributes(message), message.group_id))
            for message in messages
        ]
        sent_ok = await asyncio.gather(*sends, return_exceptions=True)
        sent = [m for m, ok in zip(messages, sent_ok, strict=True) if ok is True]
        errors = [r for r in sent_ok if isinstance(r, BaseException)]
        if errors and not sent:  # the call itself fails (no such queue, no permission): stop
            self.report.failed += len(messages)
            raise RedriveError(f"cannot send to {target}: {errors[0]}")
        self.report.failed += len(messages) - len(sent)
        for m, ok in zip(messages, sent_ok, strict=True):
            if ok is not True:
                log.warning(
                    Event.NOT_SENT, extra={"queue": target, "message_id": m.message_id, "error": ok}
                )
        deletes = await asyncio.gather(*(self.dlq.delete(m) for m in sent), return_exceptions=True)
        for message, deleted in zip(sent, deletes, strict=True):
            reason = reason_of(message)
            self.report.moved[(reason, target)] += 1
            if deleted is True:
                del self.held[message.message_id]
            else:
                self.report.both += 1  # released at the end; a later run moves it again

    def _sender(self, target: str) -> Batcher:
        if target not in self._senders:
            self._senders[target] = Batcher("redrive send", _batch_call(self.sqs, target))
        return self._senders[target]

    async def _release_held(self) -> None:
        if not self.held:
            return
        held = list(self.held.values())
        lost_hold = 0
        for start in range(0, len(held), _RELEASE_CHUNK):  # a few batch calls at a time
            chunk = held[start : start + _RELEASE_CHUNK]
            lost_hold += (await self.dlq.change_visibility_many(chunk, 0)).count(False)
        if lost_hold:  # they come back by themselves when the hold lapses
            log.warning(
                Event.MESSAGES_NOT_RELEASED,
                extra={"messages": lost_hold, "hold_s": self.options.hold_s},
            )
        await self.dlq.drain()
        self.held.clear()


def _batch_call(sqs: Any, url: str) -> Callable[[list[dict[str, Any]]], Any]:
    async def call(entries: list[dict[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = await sqs.send_message_batch(QueueUrl=url, Entries=entries)
        return result

    return call


# -- rendering ------------------------------------------------------------------------
def report_table(report: RedriveReport) -> Any:
    from rich.table import Table

    verb = "would move" if report.dry_run else "moved"
    t = Table(title=f"redrive{' (dry run)' if report.dry_run else ''}", title_justify="left")
    t.add_column("reason")
    t.add_column("target")
    t.add_column(verb, justify="right")
    for (reason, target), n in sorted(report.moved.items()):
        t.add_row(reason, common.queue_name(target), f"{n:,}")
    for reason, n in sorted(report.skipped.items()):
        t.add_row(reason, "(not matching --reason, left)", f"{n:,}")
    return t


def summary_line(report: RedriveReport) -> str:
    verb = "would move" if report.dry_run else "moved"
    parts = [
        f"received {report.received:,}",
        f"{verb} {report.moved_total:,}",
        f"left by the filter {sum(report.skipped.values()):,}",
    ]
    if report.no_target:
        parts.append(f"no target {report.no_target:,} (give --to or --queue-url)")
    if report.failed:
        parts.append(f"send failed {report.failed:,} (still in the DLQ)")
    if report.both:
        parts.append(f"delete unconfirmed {report.both:,} (in both: harmless duplicates)")
    if report.interrupted:
        parts.insert(0, "interrupted")
    return ", ".join(parts)


# -- the command ----------------------------------------------------------------------
def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "redrive",
        help="move messages from a dead-letter queue back to their queue",
        description="Move DLQ messages back: send first, delete after; filter by reason.",
        epilog=EPILOG,
        formatter_class=common.formatter(),
    )
    common.borrow(
        p,
        ("queue_url", "dlq_url"),
        notes={
            "queue_url": "here the source: its redrive policy names the DLQ, and it is the "
            "default target",
            "dlq_url": "here the DLQ to drain",
        },
    )
    p.add_argument("--to", default="", help="send every message here instead")
    p.add_argument(
        "--reason",
        action="append",
        default=[],
        help=f"only messages with this sqsinfer.reason; repeatable ({NO_REASON}: none)",
    )
    p.add_argument("--dry-run", action="store_true", help="count what would move; move nothing")
    p.add_argument("--max-messages", type=int, default=0, help="move at most N (0: all)")
    p.add_argument(
        "--visibility-timeout-s",
        type=common.positive_int,
        default=300,
        help="how long received messages stay hidden if this run dies (300)",
    )
    p.add_argument("--wait-time-s", type=int, default=2, help="long-poll wait per receive (2)")
    p.add_argument(
        "--server-side",
        action="store_true",
        help="move every message with SQS's message move task (StartMessageMoveTask), to "
        "--to, else --queue-url; nothing received here",
    )
    p.add_argument(
        "--max-per-second",
        type=_move_rate,
        default=None,
        help=f"with --server-side: the task's rate, 1-{SQS_MOVE_TASK_MAX_RATE} messages a "
        "second (default: SQS picks it from the backlog)",
    )
    p.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    common.add_log_level(p)
    p.set_defaults(func=cmd_redrive)


@common.quiet_on_broken_pipe
def cmd_redrive(args: argparse.Namespace) -> int:
    if not (args.queue_url or args.dlq_url):
        return common.usage_error("redrive", "give --queue-url or --dlq-url")
    problem = _server_side_problem(args)
    if problem:
        return common.usage_error("redrive", problem)
    return common.run_command(lambda: _main(args), "redrive", args.log_level)


def _move_rate(text: str) -> int:
    value = int(text)
    if not 1 <= value <= SQS_MOVE_TASK_MAX_RATE:
        raise argparse.ArgumentTypeError(f"must be 1-{SQS_MOVE_TASK_MAX_RATE}, got {value}")
    return value


def _server_side_problem(args: argparse.Namespace) -> str:
    """What is wrong with the server-side flags together with the rest ("": nothing)."""
    if not args.server_side:
        return "--max-per-second goes with --server-side" if args.max_per_second else ""
    given = [flag for name, flag in _CLIENT_SIDE_ONLY.items() if getattr(args, name)]
    if given:
        return f"{', '.join(given)}: the client-side path's; --server-side moves everything"
    if not (args.to or args.queue_url):
        return "--server-side moves every message to one queue: give --to or --queue-url"
    return ""


async def _dlq_url(sqs: Any, args: argparse.Namespace) -> str:
    if args.dlq_url:
        return str(args.dlq_url)
    try:
        found = await SqsQueue(sqs, args.queue_url).redrive_target()
    except (ClientError, BotoCoreError) as exc:
        raise RedriveError(f"cannot read {args.queue_url}: {exc}") from None
    if not found:
        raise RedriveError(f"{args.queue_url} has no redrive policy: give --dlq-url")
    return found


async def _main(args: argparse.Namespace) -> int:
    from sqsinfer.aws.session import open_clients

    async with open_clients(args.region, args.endpoint_url) as clients:
        if args.server_side:
            return await _server_side(clients.sqs, args)
        redriver: Redriver | None = None
        try:
            options = RedriveOptions(
                dlq_url=await _dlq_url(clients.sqs, args),
                to_url=args.to,
                fallback_url=args.queue_url,
                reasons=frozenset(args.reason),
                dry_run=args.dry_run,
                max_messages=args.max_messages,
                hold_s=args.visibility_timeout_s,
                wait_s=args.wait_time_s,
            )
            redriver = Redriver(clients.sqs, options)
            with _cancel_on_sigterm():
                report = await redriver.run()
        except RedriveError as exc:
            print(f"sqsinfer redrive: {exc}", file=sys.stderr)
            if redriver is not None:
                _print(redriver.report, args)
            return common.EXIT_FAILED
        except asyncio.CancelledError:
            if redriver is not None:
                _print(redriver.report, args)
            raise
    _print(report, args)
    return report.exit_code()


async def _server_side(sqs: Any, args: argparse.Namespace) -> int:
    mover: ServerMove | None = None
    try:
        dlq_url = await _dlq_url(sqs, args)
        mover = ServerMove(sqs, dlq_url, args.to or args.queue_url, args.max_per_second)
        with _cancel_on_sigterm():
            report = await mover.run()
    except (RedriveError, MoveTaskError) as exc:
        print(f"sqsinfer redrive: {exc}", file=sys.stderr)
        if mover is not None and mover.report.task_handle:
            _print(mover.report, args)
        return common.EXIT_FAILED
    except asyncio.CancelledError:
        if mover is not None:
            _print(mover.report, args)
        raise
    _print(report, args)
    return report.exit_code()


def _print(report: RedriveReport | MoveReport, args: argparse.Namespace) -> None:
    if args.json:
        import orjson

        print(orjson.dumps(report.as_dict()).decode())
        return
    if isinstance(report, MoveReport):
        if sys.stderr.isatty():
            print(file=sys.stderr)  # below the progress line
        print(report.summary_line())
        return
    from rich.console import Console

    console = Console()
    if report.moved or report.skipped:
        console.print(report_table(report))
    print(summary_line(report))


@contextlib.contextmanager
def _cancel_on_sigterm() -> Any:
    """SIGTERM cancels the run like Ctrl-C does, so held messages are released."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    try:
        if task is not None:
            loop.add_signal_handler(signal.SIGTERM, task.cancel)
    except (NotImplementedError, RuntimeError):  # not the main thread, or not POSIX
        task = None
    try:
        yield
    finally:
        if task is not None:
            loop.remove_signal_handler(signal.SIGTERM)
