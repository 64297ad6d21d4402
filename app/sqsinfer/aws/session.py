"""AWS: one aioboto3 session, long-lived S3 and SQS clients, and reading error codes.

Every client is made from one resolution of AWS's configuration (`endpoints.resolve`):
region, endpoint and CA bundle the same for each, with the worker's settings first.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import aioboto3
import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession
from botocore.exceptions import BotoCoreError, ClientError
from botocore.retries import standard

from sqsinfer.aws import endpoints
from sqsinfer.aws.endpoints import AwsTarget, BucketRoute

# Connections beyond the in-flight bound: the keeper, the receive loop, DLQ and chain sends.
_SPARE_CONNECTIONS = 8
# The SDK's retries after the first attempt (botocore's `max_attempts` counts retries).
SDK_RETRIES = 3
# Standard mode: exponential backoff with jitter (to 20 s) and a retry quota. Not
# botocore's adaptive mode, whose client-side rate limiter (one per client) AWS's SDKs
# warn "assumes that the client is working against a single resource": throttling of one
# slows every call of the client. Measured in the small chaos run (32 messages a
# process, 3 paired runs): bursts of 503s on a few chain markers cut the S3 client's
# rate to its floor (0.5 calls/s) for every HEAD and marker of the worker; links waited
# up to 226 s and the run took 284 s (one of three did not drain in its 300 s), against
# 18 s and 48 s in standard mode (docs/performance.md). Throttling still slows the
# worker down: a throttled call backs off holding its slot, auto halves its in-flight
# limit on each throttling answer (`watch_throttling`, `InFlightLimit.slow_down`), and
# the data path's GETs and PUTs wait behind a gate of their own (`s3.Throttle`).
RETRY_MODE = "standard"
# A next-stage send is retried by the worker itself, which must see each lost answer; an
# attempt that hears nothing for this long counts as one that may have reached SQS.
SINGLE_ATTEMPT_READ_TIMEOUT_S = 10.0
CREDENTIALS_REUSE = timedelta(minutes=5)


def error_code(exc: BaseException) -> str:
    if isinstance(exc, ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


def http_status(exc: BaseException) -> int:
    if isinstance(exc, ClientError):
        return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
    return 0


# What aiohttp raises only while it gets a connection, before a byte of the request is
# written: a refused or failed connect, DNS, the TLS handshake, a proxy's CONNECT (all
# ClientConnectorError), and its connect timeout (which covers waiting for the pool too;
# aiohttp 3.9 has no class of its own for it, and its timeouts all read as maybe sent).
_BEFORE_THE_REQUEST = (
    aiohttp.ClientConnectorError,
    socket.gaierror,
    getattr(aiohttp, "ConnectionTimeoutError", aiohttp.ClientConnectorError),
)


def may_have_taken_effect(exc: BaseException) -> bool:
    """Whether a failed request may still have been carried out by the service.

    No: the service answered with a refusal (4xx, throttling included), or the request
    never left (no connection was made). Yes: a 5xx, a timeout, and every connection
    error after the request may have been written (a reset, a close), however it is named.

    The SDK's error type does not tell: aiobotocore raises `EndpointConnectionError` for
    every aiohttp `ClientConnectionError`, a connection reset while waiting for the answer
    (`ClientOSError`, ECONNRESET) as much as a refused connect, and `ConnectTimeoutError`
    for any aiohttp timeout whose text starts with "connect". So the error aiohttp raised,
    which the SDK's keeps (`kwargs["error"]`), decides. One attempt only: through a client
    that retries, an earlier attempt may have gone out before the last one failed.
    """
    if isinstance(exc, ClientError):
        return http_status(exc) >= 500 or http_status(exc) == 0
    cause = exc.kwargs.get("error") if isinstance(exc, BotoCoreError) else exc
    return not isinstance(cause, _BEFORE_THE_REQUEST)


@dataclass
class Clients:
    s3: Any
    sqs: Any
    sqs_single_attempt: Any  # no SDK retries: for sends whose retries the worker counts
    session: Any = None  # the aioboto3 session the clients came from
    target: AwsTarget | None = None  # what every client was given, and from where
    router: endpoints.Router | None = None  # where the SDK sends each bucket's calls

    async def route(self, bucket: str) -> BucketRoute:
        """How the SDK's S3 client reaches `bucket`: what obstore's store is built from."""
        assert self.router is not None, "clients made by open_clients route buckets"
        return await self.router.route(bucket)

    def describe(self) -> dict[str, Any]:
        """Where the calls go, for the start-up log line."""
        if self.target is None:
            return {}
        t, clients = self.target, {"s3": self.s3, "sqs": self.sqs}
        return {
            "region": t.region,
            "region_from": t.region_from,
            "endpoints": {service: c.meta.endpoint_url for service, c in clients.items()},
            "endpoints_from": t.endpoints_from,
            "proxies": {service: endpoints.proxies_of(c) for service, c in clients.items()},
            "ca_bundle": t.ca_bundle,
            "ca_bundle_from": t.ca_bundle_from,
        }

    def watch_throttling(self, on_throttled: Callable[[str], None]) -> None:
        """Call `on_throttled(service)` on each answer of the SDK's clients that asks to
        slow down (each attempt's, those the SDK retries included)."""
        for client in (self.s3, self.sqs, self.sqs_single_attempt):
            watch_throttling(client, on_throttled)

    async def credentials(self) -> dict[str, Any]:
        """The session's credentials now, in obstore's shape, good for a few minutes (an
        S3Store asks again then: a refreshed role's keys are picked up)."""
        found = await self.session.get_credentials()
        frozen = await found.get_frozen_credentials()
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": datetime.now(UTC) + CREDENTIALS_REUSE,
        }


_THROTTLING = standard.ThrottlingErrorDetector(standard.RetryEventAdapter())
_S3_SLOW_DOWN = 503  # S3's SlowDown; its answer to a HEAD has no body to name it


def watch_throttling(client: Any, on_throttled: Callable[[str], None]) -> None:
    """Call `on_throttled(service)` on each answer of `client` that asks to slow down: a
    throttling error code (as the SDK's retries read them), or S3's 503."""
    service = client.meta.service_model.service_name

    def answered(response: Any = None, **kwargs: Any) -> None:
        if response is None:
            return  # no answer at all: nothing asked to slow down
        status = getattr(response[0], "status_code", 0)
        if status < 400:
            return  # the answer of almost every call: spare it the detector's parsing
        if (service == "s3" and status == _S3_SLOW_DOWN) or _THROTTLING.is_throttling_error(
            response=response, **kwargs
        ):
            on_throttled(service)

    # needs-retry comes once per attempt, before the SDK decides on a retry; a handler
    # that returns None leaves that decision to the SDK.
    client.meta.events.register(f"needs-retry.{service}", answered)


def client_config(
    connections: int, read_timeout_s: float = 60.0, retries: int = SDK_RETRIES
) -> AioConfig:
    return AioConfig(
        max_pool_connections=connections,
        connect_timeout=5,
        read_timeout=read_timeout_s,
        retries={"mode": RETRY_MODE, "max_attempts": retries},
        # The SDK's per-call CPU is most of the worker's own: skip what buys nothing here.
        # Parameters are built by this code, not by users; S3 checksums of every body
        # (computed in Python on PUT, verified on GET) are left to TLS and S3's own MD5.
        parameter_validation=False,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )


def resolve_target(region: str = "", endpoint_url: str = "") -> tuple[AioSession, AwsTarget]:
    """A session and what its clients will be given (`endpoints.resolve`), from the
    worker's settings and AWS's configuration. Reads variables and files only: no
    credentials are looked for and nothing is contacted (`worker --check-settings`)."""
    core = AioSession()
    return core, endpoints.resolve(core, region, endpoint_url)


@contextlib.asynccontextmanager
async def open_clients(
    region: str = "", endpoint_url: str = "", in_flight: int = 10, read_timeout_s: float = 60.0
) -> AsyncIterator[Clients]:
    """The S3 and SQS clients, for `region` and `endpoint_url` (the worker's settings; ""
    when unset: AWS's configuration decides, as `endpoints` describes). A region or CA
    bundle that cannot be used raises a ConfigError naming its setting or variable."""
    core, target = resolve_target(region, endpoint_url)
    session = aioboto3.Session(botocore_session=core)
    kwargs = target.client_kwargs()
    config = client_config(in_flight + _SPARE_CONNECTIONS, read_timeout_s)
    single = client_config(_SPARE_CONNECTIONS, SINGLE_ATTEMPT_READ_TIMEOUT_S, retries=0)
    async with (
        session.client("s3", config=config, **kwargs) as s3,
        # Made as `s3` is; it only builds requests, to tell obstore where they go.
        session.client("s3", config=client_config(1), **kwargs) as probe,
        session.client("sqs", config=config, **kwargs) as sqs,
        session.client("sqs", config=single, **kwargs) as sqs_single_attempt,
    ):
        yield Clients(
            s3=s3,
            sqs=sqs,
            sqs_single_attempt=sqs_single_attempt,
            session=session,
            target=target,
            router=endpoints.Router(probe, target),
        )
