"""A fault-injecting reverse proxy for S3 and SQS endpoints (loopback only).

moto never throttles, never answers 409 `ConditionalRequestConflict` and never drops a
connection; real AWS does all three. Put this proxy in front of the moto server and
point the worker's endpoint setting at it, exactly as it would point at AWS. Per
operation and at seeded random rates it answers S3 503 `SlowDown` / 500, S3 409 on
conditional puts, SQS 500 / throttling, adds latency, holds visibility changes back
(a stalled call that still lands, late), closes connections after the real answer
came back but before the client read all of it, and resets connections (a TCP RST, as
a load balancer or a NAT gateway sends one) after the real answer came back, before any
of it was sent. Either way the request took effect, and the client cannot know: a clean
close reaches it as a broken answer, a reset as the SDK error a refused connect raises.

Targeted rules, for the paths where one fault matters most: `SendMessage` answers
dropped or reset after SQS took the message (a lost answer whose retry sends it
twice), bursts of 503s on the `.chain` marker PUTs long enough to outlast the SDK's own
retries, every call of chosen operations failed, fixed delays per operation, slow reads
of chosen keys (a task that holds its message for long) and stalls aimed at those
tasks' extensions, and a cap on how often each kind of fault is injected.

It can also record every message sent through it (`record_path`: one JSON line per
message, its queue, body and attributes), so that what a worker sent can be held to
AWS's rules afterwards, whatever the stand-in behind it accepted.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import logging
import random
import signal
import socket
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from sqsinfer.aws.session import SDK_RETRIES
from sqsinfer.lab.latency import (
    Latency,
    LatencyProxy,
    Operation,
    Profile,
    Spread,
    check_target,
    classify,
    profile_named,
)

log = logging.getLogger("sqsinfer.faults")

DROP_DEFAULT_OPERATIONS = frozenset(
    {"GetObject", "PutObject", "ReceiveMessage", "DeleteMessageBatch"}
)
RESET_DEFAULT_OPERATIONS = frozenset(
    {"SendMessage", "SendMessageBatch", "PutObject", "DeleteMessageBatch"}
)
VISIBILITY_OPERATIONS = frozenset({"ChangeMessageVisibility", "ChangeMessageVisibilityBatch"})
SEND_OPERATIONS = frozenset({"SendMessage", "SendMessageBatch"})  # next-stage sends are batched
RESET_LINE = "answer reset"  # logged for each reset: its operation and queue
# A burst of this many failures outlasts the SDK's own retries: the call itself fails.
SDK_ATTEMPTS = SDK_RETRIES + 1


@dataclass
class FaultPlan:
    """Rates are probabilities per request (0 to 1)."""

    seed: int = 0
    s3_5xx: float = 0.0
    s3_slowdown: float = 0.0  # S3 requests answered 503 SlowDown (S3 throttling a prefix)
    s3_conflict: float = 0.0
    sqs_errors: float = 0.0
    sqs_throttling: float = 0.0  # SQS requests answered 400 RequestThrottled
    latency_ms: float = 0.0  # up to this much added, uniformly
    latency: str = ""  # or a profile's latency per operation (sqsinfer.lab.latency)
    drop: float = 0.0
    drop_operations: frozenset[str] = DROP_DEFAULT_OPERATIONS
    reset: float = 0.0  # answers of these operations reset (RST) after the service acted
    reset_operations: frozenset[str] = RESET_DEFAULT_OPERATIONS
    spare_operations: frozenset[str] = frozenset()  # never faulted (e.g. set-up calls)
    refuse_credentials: bool = False  # answer everything as AWS does to a bad key
    # Visibility changes held this long before they are forwarded: a stalled call that
    # still takes effect, late. At this rate, for at most `visibility_delay_calls` calls
    # (0: no limit); only calls whose every entry asks for at least
    # `visibility_delay_min_s` (a keeper's extensions ask for the whole timeout, a
    # hand-back for less); with `visibility_delay_once`, at most one call per receipt
    # handle (the retry of a held extension gets through); with
    # `visibility_delay_slow_only`, only calls that carry a slow task's message (one
    # whose `input` is a key under a `slow_reads` prefix: a hold known to be long).
    visibility_delay_s: float = 0.0
    visibility_delay_rate: float = 0.0
    visibility_delay_calls: int = 0
    visibility_delay_min_s: int = 0
    visibility_delay_once: bool = False
    visibility_delay_slow_only: bool = False
    slow_reads: dict[str, float] = field(default_factory=dict)  # key prefix -> s per GetObject
    send_drop: float = 0.0  # SendMessage answers dropped after SQS took the message
    send_drop_queue: str = ""  # only sends to a queue whose URL ends in this ("": any)
    send_reset: float = 0.0  # SendMessage answers reset after SQS took the message
    send_reset_queue: str = ""  # only sends to a queue whose URL ends in this ("": any)
    marker_failures: float = 0.0  # `.chain` PUTs that start a burst of 503s (once per key)
    marker_burst: int = SDK_ATTEMPTS  # 503s in a row per burst
    marker_burst_max: int = 0  # above marker_burst: each burst's length drawn up to this
    marker_updates_only: bool = False  # only the marker's If-Match rewrites, not its creation
    failing: dict[str, float] = field(default_factory=dict)  # operation -> rate of 500s
    refusing: dict[str, float] = field(default_factory=dict)  # operation -> rate of 400s
    delays_s: dict[str, float] = field(default_factory=dict)  # operation -> seconds added
    limits: dict[str, int] = field(default_factory=dict)  # fault kind (a `counts` key) -> most

    def latency_model(self) -> Latency | None:
        """The latency to add: a named profile's, or evenly up to `latency_ms`; None."""
        if self.latency and self.latency_ms:
            raise ValueError("latency_ms or a latency profile, not both")
        if self.latency:
            return Latency(profile_named(self.latency), self.seed)
        if self.latency_ms > 0:
            return Latency(Profile("even", s3_other=_even(self), sqs_other=_even(self)), self.seed)
        return None


def _even(plan: FaultPlan) -> Spread:
    return Spread.evenly(plan.latency_ms)


def json_object(body: bytes | str) -> dict[str, Any]:
    """An SQS JSON-protocol request, answer or message body ({} when not a JSON object)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return {}
    return doc if isinstance(doc, dict) else {}


def sqs_operation(op: Operation, doc: dict[str, Any]) -> Operation:
    """`op` with what its request names: the queue, and a visibility change's entries."""
    entries = doc.get("Entries", [doc]) if op.name in VISIBILITY_OPERATIONS else []
    return dataclasses.replace(
        op,
        queue=str(doc.get("QueueUrl", "")),
        visibility_s=tuple(int(e.get("VisibilityTimeout", 0)) for e in entries),
        receipts=tuple(str(e.get("ReceiptHandle", "")) for e in entries),
    )


def sent_messages(op: Operation, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages a SendMessage(Batch) request asks SQS to enqueue."""
    if op.name == "SendMessage":
        entries = [doc]
    elif op.name == "SendMessageBatch":
        entries = list(doc.get("Entries", []))
    else:
        return []
    fifo = {"MessageGroupId": "group", "MessageDeduplicationId": "deduplication_id"}
    return [
        {
            "queue": op.queue,
            "body": entry.get("MessageBody", ""),
            "attributes": entry.get("MessageAttributes", {}),
        }
        | {ours: entry[name] for name, ours in fifo.items() if name in entry}  # FIFO's only
        for entry in entries
    ]


def _s3_error(status: int, code: str, message: str) -> web.Response:
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        "<RequestId>injected</RequestId></Error>"
    )
    return web.Response(status=status, text=body, content_type="application/xml")


def _sqs_error(status: int, code: str, message: str) -> web.Response:
    return web.json_response(
        {"__type": f"com.amazonaws.sqs#{code}", "message": message},
        status=status,
        content_type="application/x-amz-json-1.0",
        headers={"x-amzn-query-error": f"{code};{'Sender' if status < 500 else 'Receiver'}"},
    )


@dataclass
class FaultProxy(LatencyProxy):
    """The latency proxy (`sqsinfer.lab.latency`) with faults: `plan` says which."""

    plan: FaultPlan = field(default_factory=FaultPlan)
    counts: collections.Counter[str] = field(default_factory=collections.Counter)

    seen: collections.Counter[str] = field(default_factory=collections.Counter)
    record_path: str = ""  # every message sent through the proxy, appended as JSON lines

    def __post_init__(self) -> None:
        super().__post_init__()
        self._rng = random.Random(self.plan.seed)
        if self.latency is None:
            self.latency = self.plan.latency_model()
        self._marker_bursts: dict[str, int] = {}  # marker key -> 503s still to answer
        # Receipt handle -> message id, from the receives: names the messages of a held call.
        self._receipts: dict[str, str] = {}
        self._held_receipts: set[str] = set()
        self._slow_receipts: set[str] = set()  # those of messages whose input reads slowly

    def _chance(self, rate: float) -> bool:
        return rate > 0 and self._rng.random() < rate

    def _injected(self, op: Operation) -> web.Response | None:
        """An error answered instead of forwarding, or None."""
        p = self.plan
        if p.refuse_credentials:
            if op.service == "sqs":
                return _sqs_error(
                    403, "UnrecognizedClientException", "The security token is invalid."
                )
            return _s3_error(403, "InvalidAccessKeyId", "The AWS Access Key Id does not exist.")
        if op.name in p.spare_operations:
            return None
        # Not `or`: an aiohttp response is a mapping, and an empty one is falsy in older
        # aiohttp (3.9 and 3.10 here), which would pass every targeted fault through.
        targeted = self._targeted(op)
        return targeted if targeted is not None else self._random(op)

    def _targeted(self, op: Operation) -> web.Response | None:
        """The rules aimed at one path: marker write bursts and failing operations."""
        if op.marker and self._marker_fails(op):
            return self._count(op, "marker_503", _s3_error(503, "SlowDown", "Injected burst."))
        error = _sqs_error if op.service == "sqs" else _s3_error
        if self._chance(self.plan.failing.get(op.name, 0.0)):
            return self._count(op, f"{op.name}_500", error(500, "InternalError", "Injected."))
        if self._chance(self.plan.refusing.get(op.name, 0.0)):  # never reached the service
            return self._count(op, f"{op.name}_400", error(400, "RequestThrottled", "Refused."))
        return None

    def _marker_fails(self, op: Operation) -> bool:
        """Each marker key gets at most one burst; its first write may start it.

        Setting `marker_failures` to 0 ends every burst under way.
        """
        if self.plan.marker_failures <= 0 or (self.plan.marker_updates_only and not op.if_match):
            return False
        left = self._marker_bursts.get(op.key)
        if left is None:
            chosen = self._chance(self.plan.marker_failures) and self._allowed(op, "marker_503")
            left = self._burst_length() if chosen else 0
        self._marker_bursts[op.key] = max(0, left - 1)
        return left > 0

    def _burst_length(self) -> int:
        low, high = self.plan.marker_burst, self.plan.marker_burst_max
        return self._rng.randint(low, high) if high > low else low

    def _throttled(self, op: Operation) -> web.Response | None:
        """S3's SlowDown, SQS's throttling: a refusal to be retried, later and slower."""
        if op.service == "s3" and self._chance(self.plan.s3_slowdown):
            return self._count(
                op, "slowdown", _s3_error(503, "SlowDown", "Reduce your request rate.")
            )
        if op.service == "sqs" and self._chance(self.plan.sqs_throttling):
            return self._count(
                op, "throttling", _sqs_error(400, "RequestThrottled", "Rate exceeded")
            )
        return None

    def _random(self, op: Operation) -> web.Response | None:
        p = self.plan
        throttled = self._throttled(op)
        if throttled is not None:
            return throttled
        if op.service == "s3" and op.conditional and self._chance(p.s3_conflict):
            return self._count(
                op,
                "409",
                _s3_error(
                    409,
                    "ConditionalRequestConflict",
                    "A conflicting operation occurred. You can retry the request.",
                ),
            )
        if op.service == "s3" and self._chance(p.s3_5xx):
            if self._rng.random() < 0.5:
                return self._count(
                    op, "503", _s3_error(503, "SlowDown", "Reduce your request rate.")
                )
            return self._count(op, "500", _s3_error(500, "InternalError", "Injected error."))
        if op.service == "sqs" and self._chance(p.sqs_errors):
            if self._rng.random() < 0.5:
                return self._count(
                    op, "throttled", _sqs_error(400, "RequestThrottled", "Rate exceeded")
                )
            return self._count(op, "500", _sqs_error(500, "InternalError", "Injected error."))
        return None

    def _delays(self, op: Operation) -> bool:
        """Whether to hold this visibility change back (and count it as held)."""
        p = self.plan
        if op.name not in VISIBILITY_OPERATIONS or p.visibility_delay_s <= 0:
            return False
        if p.visibility_delay_calls and self.counts["sqs:visibility_delayed"] >= (
            p.visibility_delay_calls
        ):
            return False
        if min(op.visibility_s, default=0) < p.visibility_delay_min_s:
            return False
        if p.visibility_delay_once and self._held_receipts.intersection(op.receipts):
            return False
        if p.visibility_delay_slow_only and not self._slow_receipts.intersection(op.receipts):
            return False
        if not self._chance(p.visibility_delay_rate):
            return False
        self.counts["sqs:visibility_delayed"] += 1
        self._held_receipts.update(op.receipts)
        return True

    async def _hold(self, op: Operation) -> None:
        """Hold a stalled visibility change, or a slow read, before it is forwarded."""
        if self._delays(op):
            ids = [self._receipts.get(r, "?") for r in op.receipts]
            log.info(
                "visibility call held",
                extra={
                    "message_ids": ids,
                    "visibility_s": list(op.visibility_s),
                    "held_s": self.plan.visibility_delay_s,
                },
            )
            await asyncio.sleep(self.plan.visibility_delay_s)
        if op.name == "GetObject":
            for prefix, seconds in self.plan.slow_reads.items():
                if op.key.startswith(prefix):
                    self.counts["s3:slow_read"] += 1
                    await asyncio.sleep(seconds)
                    return

    def _note_receives(self, body: bytes) -> None:
        """Name the receipt handles of a receive's messages; mark the slow tasks' ones."""
        for message in json_object(body).get("Messages", []):
            self._receipts[message["ReceiptHandle"]] = message["MessageId"]
            if self._reads_slowly(str(message.get("Body", ""))):
                self._slow_receipts.add(message["ReceiptHandle"])

    def _reads_slowly(self, body: str) -> bool:
        """Whether a task message's input (`s3://bucket/key`) is a key read slowly here."""
        key = str(json_object(body).get("input", "")).removeprefix("s3://").partition("/")[2]
        return any(key.startswith(prefix) for prefix in self.plan.slow_reads)

    def _allowed(self, op: Operation, kind: str) -> bool:
        """Whether `plan.limits` leaves room for one more fault of this kind."""
        limit = self.plan.limits.get(f"{op.service}:{kind}")
        return limit is None or self.counts[f"{op.service}:{kind}"] < limit

    def _count(self, op: Operation, kind: str, response: web.Response) -> web.Response | None:
        if kind != "marker_503" and not self._allowed(op, kind):
            return None  # over its limit: forwarded untouched
        self.counts[f"{op.service}:{kind}"] += 1
        return response

    def _dropped(self, op: Operation) -> str:
        """The kind of answer loss chosen for this request (a `..._reset` or a `...dropped`
        kind), or ''."""
        p = self.plan
        if op.name in SEND_OPERATIONS:
            for kind, rate, queue in (
                ("send_reset", p.send_reset, p.send_reset_queue),
                ("send_dropped", p.send_drop, p.send_drop_queue),
            ):
                if op.queue.endswith(queue) and self._chance(rate) and self._allowed(op, kind):
                    return kind
        if op.name in p.reset_operations and self._chance(p.reset) and self._allowed(op, "reset"):
            return "reset"
        if op.name in p.drop_operations and self._chance(p.drop) and self._allowed(op, "dropped"):
            return "dropped"
        return ""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        # Read whole before any answer, an injected one too: aiohttp 3.9.2 (the floor) leaves
        # the body of a request answered unread (a PUT sent with `Expect: 100-continue`) on
        # the kept-alive connection and parses it as the next request's start: 400.
        body = await request.read()
        op = classify(request.method, request.path, request.query_string, request.headers)
        if op.service == "sqs":
            doc = json_object(body)
            op = sqs_operation(op, doc)
            self._write_record(sent_messages(op, doc))
        self.seen[op.name] += 1
        await asyncio.sleep(self.plan.delays_s.get(op.name, 0.0))
        if op.name not in self.plan.spare_operations:
            await self.hold(op, request, len(body))
        await self._hold(op)
        injected = self._injected(op)
        if injected is not None:
            return injected
        drop = "" if op.name in self.plan.spare_operations else self._dropped(op)
        status, headers, body = await self.forward(request)
        if op.name not in self.plan.spare_operations:
            await self.hold_answer(op, len(body))
        if op.name == "ReceiveMessage" and status == 200 and self.plan.visibility_delay_s > 0:
            self._note_receives(body)
        if drop:
            self.counts[f"{op.service}:{drop}"] += 1
            if drop.endswith("reset"):
                return self._reset(request, op, status)
            return await self._drop(request, status, headers, body)
        return web.Response(status=status, headers=headers, body=body)

    def _write_record(self, messages: list[dict[str, Any]]) -> None:
        """Every message asked of SQS through the proxy, whether it then got there or not."""
        if self.record_path and messages:
            at = {"at": time.time()}  # when the request reached the proxy (epoch seconds)
            with open(self.record_path, "ab") as fh:  # a few a second: kept simple
                fh.write(b"".join(orjson.dumps(m | at) + b"\n" for m in messages))

    def _reset(self, request: web.Request, op: Operation, status: int) -> web.StreamResponse:
        """Reset the connection (RST) before a byte of the real answer is sent: the client's
        read fails with ECONNRESET, as when a load balancer or a NAT drops the flow."""
        transport = request.transport
        if transport is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:  # linger on, for 0 s: the close sends RST, not FIN
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
        log.info(RESET_LINE, extra={"operation": op.name, "queue": op.queue})
        return web.Response(status=status)  # never sent: the connection is gone

    async def _drop(
        self, request: web.Request, status: int, headers: dict[str, str], body: bytes
    ) -> web.StreamResponse:
        """Start the real answer, then close the connection before it is complete."""
        response = web.StreamResponse(status=status, headers=headers)
        response.content_length = max(len(body), 1) + 1  # promise more than will come
        await response.prepare(request)
        await response.write(body[: len(body) // 2])
        if request.transport is not None:
            request.transport.close()
        return response


async def serve(target: str, plan: FaultPlan, port: int, record_path: str = "") -> None:
    """Run a proxy until cancelled (`python -m proving.faults`)."""
    proxy = FaultProxy(target, plan, port=port, record_path=record_path)
    await proxy.start()
    print(f"fault proxy on {proxy.url} -> {target}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        log.info("fault proxy stopping", extra={"injected": dict(proxy.counts)})
        await proxy.stop()


_RATES = (
    "s3_5xx",
    "s3_slowdown",
    "s3_conflict",
    "sqs_errors",
    "sqs_throttling",
    "latency_ms",
    "drop",
    "reset",
    "send_drop",
    "send_reset",
    "marker_failures",
    "visibility_delay_s",
    "visibility_delay_rate",
)
# The other plan fields the command sets, each from its own option.
_OPTIONS = (
    "seed",
    "latency",
    "send_drop_queue",
    "send_reset_queue",
    "marker_burst",
    "marker_burst_max",
    "marker_updates_only",
    "visibility_delay_calls",
    "visibility_delay_min_s",
    "visibility_delay_once",
    "visibility_delay_slow_only",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m proving.faults",
        description="A fault-injecting proxy in front of a local S3/SQS endpoint.",
        epilog="example:\n  python -m proving.faults --target http://127.0.0.1:5000 --port 5001 "
        "--s3-5xx 0.1 --s3-conflict 0.02 --sqs-errors 0.02 --latency-ms 20 --drop 0.01\n"
        "      --reset 0.005 --send-drop 0.02 --send-drop-queue stage2 --send-reset 0.02\n"
        "      --send-reset-queue stage2 --marker-failures 0.02",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", required=True, help="the endpoint to front (loopback only)")
    p.add_argument("--port", type=int, default=0, help="port to listen on (0: any free)")
    p.add_argument("--seed", type=int, default=0)
    for name in _RATES:
        p.add_argument("--" + name.replace("_", "-"), type=float, default=0.0)
    p.add_argument(
        "--latency",
        default="",
        metavar="PROFILE",
        help="add a profile's latency per operation (aws, loopback; not with --latency-ms)",
    )
    p.add_argument(
        "--send-drop-queue", default="", help="drop only sends to a queue whose URL ends in this"
    )
    p.add_argument(
        "--send-reset-queue", default="", help="reset only sends to a queue whose URL ends in this"
    )
    p.add_argument(
        "--marker-burst", type=int, default=SDK_ATTEMPTS, help="503s in a row per marker burst"
    )
    p.add_argument(
        "--marker-burst-max", type=int, default=0, help="draw each burst's length up to this"
    )
    p.add_argument(
        "--marker-updates-only",
        action="store_true",
        help="fail only the marker's If-Match rewrites (a taken-over intent's 'sent' "
        "record), not its creation (a writer's 'sent' record)",
    )
    p.add_argument(
        "--visibility-delay-calls",
        type=int,
        default=0,
        help="hold at most this many calls (0: no limit)",
    )
    p.add_argument(
        "--visibility-delay-min-s",
        type=int,
        default=0,
        help="hold only calls whose every entry asks for at least this visibility",
    )
    p.add_argument(
        "--visibility-delay-once",
        action="store_true",
        help="hold at most one visibility call per receipt handle",
    )
    p.add_argument(
        "--visibility-delay-slow-only",
        action="store_true",
        help="hold only calls carrying a message whose input is a --slow-read key",
    )
    p.add_argument(
        "--slow-read",
        action="append",
        default=[],
        metavar="PREFIX=SECONDS",
        help="hold each GetObject of a key under PREFIX this long (repeatable)",
    )
    p.add_argument(
        "--record-sends", default="", metavar="PATH", help="append every message sent to PATH"
    )
    return p


def parse_slow_reads(items: list[str]) -> dict[str, float]:
    """`PREFIX=SECONDS` items as prefix -> seconds."""
    found = {}
    for item in items:
        prefix, sep, seconds = item.rpartition("=")
        if not sep or not prefix:
            raise ValueError(f"--slow-read wants PREFIX=SECONDS, not {item!r}")
        found[prefix] = float(seconds)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    from sqsinfer import logs

    args = build_parser().parse_args(argv)
    logs.configure("INFO", "json")
    try:
        target = check_target(args.target)
        plan = FaultPlan(
            slow_reads=parse_slow_reads(args.slow_read),
            **{name: getattr(args, name) for name in _RATES + _OPTIONS},
        )
        plan.latency_model()  # a profile that exists, and not beside --latency-ms
    except ValueError as exc:
        print(f"proving.faults: {exc}", file=sys.stderr)
        return 2

    async def serve_until_stopped() -> int:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await serve(target, plan, args.port, args.record_sends)
        return 0

    return asyncio.run(serve_until_stopped())


if __name__ == "__main__":
    sys.exit(main())
