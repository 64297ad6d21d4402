"""AWS's latency in front of the local stand-in: a forwarding proxy that holds each call.

On loopback an S3 GET or an SQS call costs well under a millisecond of waiting; on AWS
it costs tens of milliseconds, with a long tail, and that is where a worker that overlaps
its calls with its compute parts company with one that does one thing at a time. This
proxy sits between the clients and a stand-in (moto or LocalStack, loopback only) and
holds every request for a time drawn from its operation's distribution (`Spread`: a
log-normal body given by its median and 99th percentile, and rare stalls at a rate),
plus, for S3, the body's transfer at one connection's throughput, and, on a connection's
first request, the set-up of a new connection. The draws are seeded: one seed, one
sequence of delays.

The time is added to what the stand-in itself takes, before the request is forwarded. A
long poll therefore waits its draw and then as long as the stand-in holds it: an empty
receive that waited 20 s for a message is 20 s of waiting, not a 20 s latency draw, and
the proxy's own figures (`Latency.summary`) hold only what it added.

Profiles (`PROFILES`, documented with their sources in docs/performance.md):
- `aws`: S3 Standard and SQS called from the same region;
- `loopback`: nothing added (the stand-in as it is, through the same hop).

`sqsinfer bench --latency aws` runs every scenario through one proxy process
(`python -m sqsinfer.lab.latency`); the proving ground's fault proxy extends
`LatencyProxy` with its faults, and its `--latency` takes the same profiles.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import math
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from sqsinfer.lab import standin
from sqsinfer.worker.chain import MARKER_SUFFIX

# The standard normal's 99th percentile: a log-normal's p99 is p50 × exp(Z99 × sigma).
Z99 = 2.3263478740408408
# Hop-by-hop and recomputed headers are not passed through.
SKIP_HEADERS = frozenset({"transfer-encoding", "connection", "content-length", "keep-alive"})
# A connection not seen for this long is taken to be a new one when its address comes
# back (clients close idle connections well before: aiohttp after 15 s).
_CONNECTION_IDLE_S = 60.0
STATS_PATH = "/_latency/stats"  # the proxy's own figures (no bucket is named `_latency`)
_START_TIMEOUT_S = 30.0
_NORMAL = NormalDist()
_READ_BUFFER_BYTES = 4 << 20


@dataclass(frozen=True)
class Operation:
    service: str  # "s3" or "sqs"
    name: str
    conditional: bool = False
    key: str = ""  # S3: the object key
    if_match: bool = False  # S3: a compare-and-swap write (If-Match), not a create
    queue: str = ""  # SQS: the QueueUrl of the request
    visibility_s: tuple[int, ...] = ()  # SQS visibility changes: each entry's new timeout
    receipts: tuple[str, ...] = ()  # SQS visibility changes: each entry's receipt handle

    @property
    def marker(self) -> bool:
        return self.name == "PutObject" and self.key.endswith(MARKER_SUFFIX)


def classify(method: str, path: str, query: str, headers: Any) -> Operation:
    """What one request to an S3 or SQS endpoint asks for."""
    target = headers.get("X-Amz-Target", "")
    if target.startswith("AmazonSQS."):
        return Operation("sqs", target.split(".", 1)[1])
    if "Action=" in query or (method == "POST" and path.count("/") == 2 and "sqs" in target):
        return Operation("sqs", "Query")
    has_key = path.strip("/").count("/") >= 1
    conditional = "If-None-Match" in headers or "If-Match" in headers
    key = path.strip("/").split("/", 1)[1] if has_key else ""
    names = {
        ("GET", True): "GetObject",
        ("HEAD", True): "HeadObject",
        ("PUT", True): "PutObject",
        ("DELETE", True): "DeleteObject",
        ("GET", False): "ListObjects",
        ("HEAD", False): "HeadBucket",
        ("PUT", False): "CreateBucket",
    }
    name = names.get((method, has_key), method)
    return Operation("s3", name, conditional, key=key, if_match="If-Match" in headers)


# -- the distributions ------------------------------------------------------------------------


@dataclass(frozen=True)
class Spread:
    """One operation's latency in milliseconds: a log-normal body with this median and
    99th percentile; at `spike_rate` a call also stalls for `spike_ms` more. With
    `uniform`, the body is drawn evenly from 0 to twice the median instead."""

    p50_ms: float
    p99_ms: float
    spike_rate: float = 0.0
    spike_ms: float = 0.0
    uniform: bool = False

    @classmethod
    def evenly(cls, up_to_ms: float) -> Spread:
        """Evenly from 0 to `up_to_ms` (the fault proxy's `--latency-ms`)."""
        return cls(up_to_ms / 2, up_to_ms * 0.99, uniform=True)

    @property
    def sigma(self) -> float:
        """The log-normal's shape, from the ratio of its p99 to its median."""
        return math.log(self.p99_ms / self.p50_ms) / Z99 if self.p50_ms > 0 else 0.0

    def draw_ms(self, rng: random.Random) -> float:
        """One call's delay. Both draws are always made: a seed gives one sequence."""
        body, stall = rng.random(), rng.random()
        if self.p50_ms <= 0:
            ms = 0.0
        elif self.uniform:
            ms = body * 2 * self.p50_ms
        else:  # the body's quantile: p50 × exp(sigma × Φ⁻¹(u))
            ms = self.p50_ms * math.exp(self.sigma * _normal_quantile(body))
        return ms + (self.spike_ms if stall < self.spike_rate else 0.0)


def _normal_quantile(u: float) -> float:
    """Φ⁻¹(u), by the standard library's inverse (u kept inside (0, 1))."""
    return _NORMAL.inv_cdf(min(max(u, 1e-12), 1 - 1e-12))


NONE = Spread(0.0, 0.0)


@dataclass(frozen=True)
class Profile:
    """A latency per operation, per service for the rest, and what S3 bodies and new
    connections add. Operation names are the APIs' (`GetObject`, `ReceiveMessage`)."""

    name: str
    operations: Mapping[str, Spread] = field(default_factory=dict)
    s3_other: Spread = NONE  # bucket calls, listings, deletes
    sqs_other: Spread = NONE  # queue URLs and attributes, purges, the query protocol
    s3_mb_per_s: float = 0.0  # one connection's throughput for S3 bodies (0: instant)
    connect_ms: float = 0.0  # a new connection's set-up, added to its first request

    def spread(self, op: Operation) -> Spread:
        found = self.operations.get(op.name)
        if found is not None:
            return found
        return self.sqs_other if op.service == "sqs" else self.s3_other

    def transfer_ms(self, op: Operation, body_bytes: int) -> float:
        if op.service != "s3" or self.s3_mb_per_s <= 0:
            return 0.0
        return 1000.0 * body_bytes / (self.s3_mb_per_s * 1e6)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "operations": {k: dataclasses.asdict(v) for k, v in self.operations.items()},
            "s3_other": dataclasses.asdict(self.s3_other),
            "sqs_other": dataclasses.asdict(self.sqs_other),
            "s3_mb_per_s": self.s3_mb_per_s,
            "connect_ms": self.connect_ms,
        }


def _sqs(spread: Spread) -> dict[str, Spread]:
    """The SQS calls a worker makes, single and batched, each with this spread."""
    batched = ("SendMessage", "DeleteMessage", "ChangeMessageVisibility")
    return {"ReceiveMessage": spread} | {
        name: spread for one in batched for name in (one, one + "Batch")
    }


# S3 Standard and SQS from the same region. What AWS publishes (docs/performance.md has
# the pages): small S3 requests have median latencies "in the tens of milliseconds", a
# GET or PUT not answered in 2 s is worth retrying, latency-sensitive applications see
# "roughly 100-200 milliseconds" for small objects, one connection carries 85-90 MB/s;
# an SQS call from EC2 in the same region "averages 20 ms" in the SQS guide's example.
# The medians and 99th percentiles below are read into those ranges (AWS publishes no
# percentiles per operation), the stalls at their rates are assumptions, as is the
# set-up of a new connection (TCP and TLS, in-region).
_SQS_AWS = Spread(p50_ms=10.0, p99_ms=200.0, spike_rate=0.001, spike_ms=1000.0)
AWS = Profile(
    "aws",
    operations={
        "GetObject": Spread(p50_ms=25.0, p99_ms=150.0, spike_rate=0.001, spike_ms=2000.0),
        "PutObject": Spread(p50_ms=35.0, p99_ms=200.0, spike_rate=0.001, spike_ms=2000.0),
        "HeadObject": Spread(p50_ms=15.0, p99_ms=80.0, spike_rate=0.001, spike_ms=2000.0),
        **_sqs(_SQS_AWS),
    },
    s3_other=Spread(p50_ms=25.0, p99_ms=150.0),
    sqs_other=Spread(p50_ms=10.0, p99_ms=200.0),
    s3_mb_per_s=90.0,
    connect_ms=30.0,
)
LOOPBACK = Profile("loopback")
PROFILES: dict[str, Profile] = {p.name: p for p in (AWS, LOOPBACK)}


def profile_named(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown latency profile {name!r}; choose from {', '.join(PROFILES)}"
        ) from None


class Latency:
    """A profile's delays, drawn from one seeded generator, and what was added."""

    def __init__(self, profile: Profile, seed: int = 0) -> None:
        self.profile = profile
        self._rng = random.Random(seed)
        self._connections: dict[Any, float] = {}  # peer address -> last request (monotonic)
        self._added: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])

    def before_ms(self, op: Operation, connection: Any = None, request_bytes: int = 0) -> float:
        """What to hold a request for before it is forwarded: its draw, its body's upload,
        and a new connection's set-up (`connection`: its peer address; None: not known)."""
        ms = self.profile.spread(op).draw_ms(self._rng)
        ms += self.profile.transfer_ms(op, request_bytes)
        if connection is not None and self._is_new(connection):
            ms += self.profile.connect_ms
        self._note(op.name, ms)
        return ms

    def after_ms(self, op: Operation, answer_bytes: int) -> float:
        """What to hold the answer for: its body's download."""
        ms = self.profile.transfer_ms(op, answer_bytes)
        if ms > 0:
            self._note(op.name, ms, call=False)
        return ms

    def _is_new(self, connection: Any) -> bool:
        now = time.monotonic()
        last = self._connections.get(connection)
        self._connections[connection] = now
        if len(self._connections) > 4096:  # forget the long idle
            self._connections = {
                k: t for k, t in self._connections.items() if now - t < _CONNECTION_IDLE_S
            }
        return last is None or now - last > _CONNECTION_IDLE_S

    def _note(self, name: str, ms: float, call: bool = True) -> None:
        added = self._added[name]
        added[0] += 1 if call else 0
        added[1] += ms
        added[2] = max(added[2], ms)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per operation: calls held, and the mean and most milliseconds added to one."""
        return {
            name: {
                "calls": int(calls),
                "mean_added_ms": round(total / calls, 3) if calls else 0.0,
                "max_added_ms": round(most, 3),
            }
            for name, (calls, total, most) in sorted(self._added.items())
        }


# -- the proxy --------------------------------------------------------------------------------


@dataclass
class LatencyProxy:
    """Forwards every request to `target`, held as `latency` says (None: not held)."""

    target: str
    latency: Latency | None = field(default=None, kw_only=True)
    host: str = field(default="127.0.0.1", kw_only=True)
    port: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        # No cookies to keep, a read buffer that takes a large body in few steps: the
        # proxy's CPU is taken from the machine the scenarios are measured on.
        self._session = aiohttp.ClientSession(
            auto_decompress=False,
            connector=aiohttp.TCPConnector(limit=256),
            cookie_jar=aiohttp.DummyCookieJar(),
            read_bufsize=_READ_BUFFER_BYTES,
        )
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get(STATS_PATH, self._stats)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        sockets = getattr(site._server, "sockets", None)
        if sockets:
            self.port = int(sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _stats(self, request: web.Request) -> web.Response:
        found = self.latency.summary() if self.latency is not None else {}
        return web.json_response(found)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        op = classify(request.method, request.path, request.query_string, request.headers)
        await self.hold(op, request, len(body))
        status, headers, payload = await self.forward(request)
        await self.hold_answer(op, len(payload))
        return web.Response(status=status, headers=headers, body=payload)

    async def hold(self, op: Operation, request: web.Request, request_bytes: int) -> None:
        """Wait as long as the profile says a request of `op` takes to be answered."""
        if self.latency is None:
            return
        peer = request.transport.get_extra_info("peername") if request.transport else None
        ms = self.latency.before_ms(op, peer, request_bytes)
        if ms > 0:
            await asyncio.sleep(ms / 1000)

    async def hold_answer(self, op: Operation, answer_bytes: int) -> None:
        if self.latency is not None:
            ms = self.latency.after_ms(op, answer_bytes)
            if ms > 0:
                await asyncio.sleep(ms / 1000)

    async def forward(self, request: web.Request) -> tuple[int, dict[str, str], bytes]:
        """The target's answer to the request (read whole)."""
        assert self._session is not None
        url = self.target + request.path_qs
        body = await request.read()
        async with self._session.request(
            request.method, url, headers=_passed(request.headers), data=body, allow_redirects=False
        ) as upstream:
            payload = await upstream.read()
            return upstream.status, _passed(upstream.headers), payload


def _passed(headers: Mapping[str, str]) -> dict[str, str]:
    """The headers a hop passes on (not those of one connection or one framing)."""
    return {k: v for k, v in headers.items() if k.lower() not in SKIP_HEADERS}


def check_target(target: str) -> str:
    """A loopback endpoint, without its trailing slash (a proxy fronts nothing else)."""
    host = urlsplit(target).hostname or ""
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"the proxy only fronts loopback endpoints, not {host!r}")
    return target.rstrip("/")


# -- its own process (`python -m sqsinfer.lab.latency`) ------------------------------------------


def ready_line(proxy: LatencyProxy) -> str:
    return f"latency proxy on {proxy.url} -> {proxy.target}"


async def serve(targets: Sequence[str], profile: Profile, seed: int) -> int:
    """One proxy per target, each with its own seeded draws, until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    proxies = [LatencyProxy(t, latency=Latency(profile, seed + i)) for i, t in enumerate(targets)]
    try:
        for proxy in proxies:
            await proxy.start()
            print(ready_line(proxy), flush=True)
        await stop.wait()
    finally:
        for proxy in proxies:
            await proxy.stop()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sqsinfer.lab.latency",
        description="Hold every S3 and SQS call to a local stand-in as long as AWS would.",
    )
    p.add_argument(
        "--target",
        action="append",
        required=True,
        help="a loopback endpoint to front (repeatable: one proxy each, in order)",
    )
    p.add_argument("--profile", default="aws", choices=sorted(PROFILES))
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from sqsinfer.runtime import run_async

    args = build_parser().parse_args(argv)
    try:
        targets = [check_target(t) for t in args.target]
    except ValueError as exc:
        print(f"sqsinfer.lab.latency: {exc}", file=sys.stderr)
        return 2
    return run_async(serve(targets, PROFILES[args.profile], args.seed))


@dataclass
class ProxyProcess:
    """The proxy process started by `proxy_process`: where each target is reached."""

    process: subprocess.Popen[bytes]
    routes: dict[str, str]  # target -> the proxy's URL for it

    def stats(self, target: str) -> dict[str, Any]:
        """The proxy's figures for one target so far (`Latency.summary`)."""
        with urllib.request.urlopen(self.routes[target] + STATS_PATH, timeout=10) as answer:
            found: dict[str, Any] = json.loads(answer.read())
            return found


@contextlib.contextmanager
def proxy_process(targets: Sequence[str], profile: str, seed: int = 0) -> Iterator[ProxyProcess]:
    """A proxy process in front of each target (its CPU apart from the caller's)."""
    argv = [sys.executable, "-m", "sqsinfer.lab.latency", "--profile", profile]
    argv += ["--seed", str(seed)]
    for target in targets:
        argv += ["--target", target]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        yield ProxyProcess(process, _read_routes(process, len(targets)))
    finally:
        standin.end(process)


def _read_routes(process: subprocess.Popen[bytes], count: int) -> dict[str, str]:
    """The proxies' ready lines, as target -> URL."""
    assert process.stdout is not None
    routes: dict[str, str] = {}
    deadline = time.monotonic() + _START_TIMEOUT_S
    while len(routes) < count:
        line = process.stdout.readline().decode().strip()
        if not line or time.monotonic() > deadline:
            raise RuntimeError(f"the latency proxy did not start (exit {process.poll()})")
        url, _, target = line.removeprefix("latency proxy on ").partition(" -> ")
        routes[target] = url
    return routes


if __name__ == "__main__":
    sys.exit(main())
