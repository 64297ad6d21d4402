"""S3: bounded GET into shared memory, HEAD, and the conditional PUT that commits a result.

The GET of each input and the PUT of each output go through obstore (`DataPath`), the
rest through the SDK client; both read and write the same objects the same way.

The conditional put (`If-None-Match: *`) is where exactly-once is decided: the first
writer of a key gets 200, every later one 412, and no output is ever overwritten. The
chain marker's steps are compare-and-swap writes (`If-Match: <ETag>`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any, TypeVar, cast

import aiohttp
import obstore
from botocore.exceptions import ClientError
from obstore.exceptions import AlreadyExistsError, GenericError
from obstore.store import S3Store

from sqsinfer.aws.endpoints import BucketRoute
from sqsinfer.aws.session import SDK_RETRIES, error_code, http_status
from sqsinfer.backoff import Backoff
from sqsinfer.compute.errors import InputError
from sqsinfer.limits import S3_LIST_PAGE_MAX
from sqsinfer.logs import Event
from sqsinfer.messages import DOT_SEGMENTS, S3Uri
from sqsinfer.shm import Segments, SharedInput

if TYPE_CHECKING:
    from obstore import GetOptions
    from obstore.store import ClientConfig, S3CredentialProvider

log = logging.getLogger("sqsinfer.storage")

_CHUNK_BYTES = 1 << 20
_BODY_ATTEMPTS = 2
# S3 answers 409 ConditionalRequestConflict when two conditional writes of one key race;
# botocore does not retry it, so the put is retried here, briefly.
_CONFLICT_BACKOFF = Backoff(base_s=0.05, max_s=0.8)
_CONFLICT_RETRIES = 5
_CONFLICT_STATUS = "409 Conflict"  # how object_store's message names S3's 409
_PUT_BACKOFF = Backoff(base_s=0.1, max_s=2.0)
# In object_store's message once it retried a call itself (5xx, throttling): not again.
# ("after 3 retries, max_retries: 3"; the debug dump obstore appends names max_retries
# even when it made no retry, as for a connection reset in flight.)
_SPENT_RETRIES = " retries, max_retries: "
# What a GET whose body broke off half-way raises (the SDK's, or obstore's).
_BROKEN_BODY = (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, OSError, GenericError)
# Request timeouts as the SDK client's: connect 5 s; a whole call (obstore times whole
# calls, the SDK each read) long enough for the largest input.
_CONNECT_TIMEOUT = "5s"
_CALL_TIMEOUT = "300s"
# S3 answers 503 (SlowDown) while it scales a prefix to a new request rate, "temporarily,
# until the optimization completes" (AWS). object_store retries a 503 as any 5xx, briefly
# (its three retries take about half a second); past those, every call of the data path
# waits behind one gate (`Throttle`) that backs off, then tries again: the worker slows
# down (its slots stay taken, it receives less) rather than failing tasks. About a
# minute of backing off in all before a task gives up (and is retried as transient).
THROTTLE_BACKOFF = Backoff(base_s=0.5, max_s=10.0)
THROTTLE_ROUNDS = 8
_THROTTLED = ("<Code>SlowDown</Code>", "503 Service Unavailable")

T = TypeVar("T")


@dataclass(frozen=True)
class ObjectInfo:
    metadata: dict[str, str]
    # By the server's own clock: its Date header minus Last-Modified (without a Date
    # header, the worker's clock stands in: docs/running.md, the chain link).
    age_s: float
    etag: str = ""  # what a compare-and-swap write (`put_if_match`) names


def _age_s(response: dict[str, Any]) -> float:
    modified = response.get("LastModified")
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    if modified is None:
        return 0.0
    try:
        now = parsedate_to_datetime(date) if date else datetime.now(UTC)
    except (TypeError, ValueError):
        now = datetime.now(UTC)
    return max(0.0, float((now - modified).total_seconds()))


def throttled(exc: BaseException) -> bool:
    """Whether obstore's error is S3 asking to slow down (a 503), its retries spent."""
    return isinstance(exc, GenericError) and any(sign in str(exc) for sign in _THROTTLED)


class Throttle:
    """One gate in front of every call of a data path. When S3 says to slow down, the
    gate closes for a backoff that grows with each such answer while closed (answers of
    calls already under way when it closed do not count again) and starts over after a
    call goes through."""

    def __init__(self, backoff: Backoff = THROTTLE_BACKOFF) -> None:
        self.backoff = backoff
        self._opens_at = 0.0  # monotonic
        self._in_a_row = 0

    async def passed(self) -> None:
        wait_s = self._opens_at - time.monotonic()
        if wait_s > 0:
            await asyncio.sleep(wait_s)

    def slow_down(self) -> float | None:
        """Close the gate for the next backoff; its length, or None when it was closed."""
        now = time.monotonic()
        if now < self._opens_at:
            return None
        delay_s = self.backoff.delay_s(self._in_a_row)
        self._in_a_row += 1
        self._opens_at = now + delay_s
        return delay_s

    def went_through(self) -> None:
        self._in_a_row = 0


class DataPath:
    """The two S3 calls of every task, the input's GET and the output's conditional PUT,
    through obstore (the Rust `object_store` crate): about half the client CPU per call
    of the SDK's (measured: GET of 2 MB into shared memory 2.2 -> 1.6 ms, PUT 1.9 -> 0.4).

    One S3Store per bucket, built from what the SDK's S3 client does for that bucket
    (`route`, see `endpoints`): its URL (virtual-hosted or path style, a FIPS or
    dual-stack host, a custom endpoint), its proxy, its CA bundle, its region, with the
    session's credentials (`credentials`, asked again every few minutes) and the SDK's
    number of retries. Everything else (the HEAD that reads an owner, the chain
    marker's compare-and-swap writes, whose age comes from the server's Date header)
    stays on the SDK client. `on_call(operation, failed)` counts each call;
    `on_throttled("s3")` is told of each 503 once obstore's retries of it are spent.
    """

    def __init__(
        self,
        route: Callable[[str], Awaitable[BucketRoute]],
        credentials: Callable[[], Awaitable[dict[str, Any]]],
        on_call: Callable[[str, bool], None] | None = None,
        on_throttled: Callable[[str], None] | None = None,
    ) -> None:
        self._route = route
        self._credentials = credentials
        self._on_call = on_call or (lambda operation, failed: None)
        self._on_throttled = on_throttled or (lambda service: None)
        self._stores: dict[str, S3Store] = {}
        self._making = asyncio.Lock()
        self.throttle = Throttle()

    async def store(self, bucket: str) -> S3Store:
        found = self._stores.get(bucket)
        if found is None:
            async with self._making:
                found = self._stores.get(bucket)
                if found is None:
                    route = await self._route(bucket)
                    found = self._stores[bucket] = self._new_store(route)
                    log.info(Event.DATA_PATH_ROUTED, extra=route.describe())
        return found

    def _new_store(self, route: BucketRoute) -> S3Store:
        """The bucket's store, told explicitly every setting obstore would otherwise read
        from `AWS_*` and proxy variables by rules of its own."""
        options: ClientConfig = {
            "connect_timeout": _CONNECT_TIMEOUT,
            "timeout": _CALL_TIMEOUT,
            "allow_http": route.endpoint.startswith("http:"),
        }
        if route.proxy_url:
            options["proxy_url"] = route.proxy_url
        if route.proxy_excludes:
            options["proxy_excludes"] = route.proxy_excludes
        if route.root_certificate:
            options["root_certificate"] = route.root_certificate
        return S3Store(
            route.bucket,
            endpoint=route.endpoint,
            # obstore prefers this one, read from AWS_ENDPOINT_URL_S3, to `endpoint`.
            aws_endpoint_url_s3=route.endpoint,
            virtual_hosted_style_request=route.virtual_hosted,
            region=route.region,
            # What the commit depends on, whatever AWS_CONDITIONAL_PUT says.
            conditional_put="etag",
            skip_signature=False,
            client_options=options,
            retry_config={"max_retries": SDK_RETRIES},
            # The session's: a plain dict with the keys of obstore's S3Credential.
            credential_provider=cast("S3CredentialProvider", self._credentials),
        )

    @contextlib.contextmanager
    def counted(self, operation: str) -> Iterator[None]:
        """Count one call; an error answer (a 404) counts as failed, as the SDK's do, but
        a conditional put's 412 is the answer it asks for: every first delivery of a
        finished task meets one, and alerts on failed calls must not."""
        try:
            yield
        except AlreadyExistsError as exc:
            self._on_call(operation, _CONFLICT_STATUS in str(exc))
            raise
        except Exception:
            self._on_call(operation, True)
            raise
        self._on_call(operation, False)

    async def paced(self, operation: str, call: Callable[[], Awaitable[T]]) -> T:
        """One call (each attempt counted), behind the throttle's gate: S3's 503, once
        obstore's retries are spent, closes the gate and the call waits and goes again."""
        for rounds in range(THROTTLE_ROUNDS + 1):
            await self.throttle.passed()
            try:
                with self.counted(operation):
                    found = await call()
            except GenericError as exc:
                if not throttled(exc):
                    raise
                self._on_throttled("s3")
                if rounds == THROTTLE_ROUNDS:
                    raise
                delay_s = self.throttle.slow_down()
                if delay_s is not None:
                    log.info(
                        Event.S3_SLOW_DOWN,
                        extra={"operation": operation, "delay_s": round(delay_s, 3)},
                    )
                continue
            self.throttle.went_through()
            return found
        raise AssertionError("unreachable")  # pragma: no cover

    async def get_shared(
        self, uri: S3Uri, max_bytes: int, segments: Segments, version: str | None = None
    ) -> SharedInput:
        options: GetOptions = {"version": version} if version is not None else {}
        store = await self.store(uri.bucket)
        try:
            result = await self.paced(
                "GetObject", lambda: obstore.get_async(store, uri.key, options=options)
            )
        except FileNotFoundError:
            raise InputError("input_not_found", _not_found(uri, version)) from None
        chunks = result.stream(min_chunk_size=_CHUNK_BYTES)
        shared = await _into_shared(uri, int(result.meta["size"]), max_bytes, chunks, segments)
        return _read_version(shared, result.meta.get("e_tag"), result.meta.get("version"))

    async def put_if_absent(
        self, uri: S3Uri, body: bytes, metadata: dict[str, str], content_type: str
    ) -> str | None:
        """Create the object unless it exists (If-None-Match: *): its ETag, or None on 412.

        object_store reads S3's 409 ConditionalRequestConflict as "exists" too: that one
        is retried here, as the SDK path does. A PUT that failed in the middle (a dropped
        connection, which object_store does not retry for a conditional write) is retried
        too, as the SDK would: if it had landed, the retry's 412 tells, and the caller's
        HEAD finds its own delivery id there.
        """
        attributes: dict[str, str] = {"Content-Type": content_type} | metadata
        conflicts = failures = 0
        store = await self.store(uri.bucket)
        while True:
            try:
                result = await self.paced(
                    "PutObject",
                    lambda: obstore.put_async(
                        store,
                        uri.key,
                        body,
                        mode="create",
                        attributes=attributes,
                        use_multipart=False,
                    ),
                )
                return str(result["e_tag"] or "written")
            except AlreadyExistsError as exc:
                if _CONFLICT_STATUS not in str(exc):
                    return None
                conflicts += 1
                if conflicts > _CONFLICT_RETRIES:
                    raise
                delay_s = _CONFLICT_BACKOFF.delay_s(conflicts - 1)
            except GenericError as exc:
                failures += 1
                if failures > SDK_RETRIES or _SPENT_RETRIES in str(exc):
                    raise
                delay_s = _PUT_BACKOFF.delay_s(failures - 1)
            log.debug(Event.CONDITIONAL_PUT_RETRIED, extra={"uri": str(uri), "delay_s": delay_s})
            await asyncio.sleep(delay_s)


@dataclass
class Storage:
    client: Any  # an aiobotocore S3 client
    segments: Segments = field(default_factory=Segments)
    # The input's GET and the output's PUT through obstore; None: through the SDK client.
    data: DataPath | None = None

    async def head(self, uri: S3Uri) -> ObjectInfo | None:
        """The object's metadata and age, or None when it does not exist."""
        try:
            response = await self.client.head_object(Bucket=uri.bucket, Key=uri.key)
        except ClientError as exc:
            if http_status(exc) == 404 or error_code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return ObjectInfo(
            dict(response.get("Metadata", {})), _age_s(response), str(response.get("ETag", ""))
        )

    async def keys(self, prefix: S3Uri) -> AsyncIterator[list[str]]:
        """The keys under a prefix (latest versions only), a listing page at a time."""
        paginator = self.client.get_paginator("list_objects_v2")
        pages = paginator.paginate(
            Bucket=prefix.bucket, Prefix=prefix.key, PaginationConfig={"PageSize": S3_LIST_PAGE_MAX}
        )
        async for page in pages:
            yield [item["Key"] for item in page.get("Contents", [])]

    async def get_shared(
        self, uri: S3Uri, max_bytes: int, version: str | None = None
    ) -> SharedInput:
        """Stream an object (that version of it, when given) into shared memory, refusing
        it when larger than `max_bytes`.

        The SDK retries a GET that fails before its body, not one whose body breaks off
        half-way; that is retried here, once, before the task is given up as transient.
        """
        for attempt in range(_BODY_ATTEMPTS):
            try:
                return await self._get_shared_once(uri, max_bytes, version)
            except _BROKEN_BODY as exc:
                if attempt + 1 == _BODY_ATTEMPTS:
                    raise
                log.debug(Event.GET_BODY_BROKE_OFF, extra={"uri": str(uri), "error": str(exc)})
        raise AssertionError("unreachable")  # pragma: no cover

    async def _get_shared_once(
        self, uri: S3Uri, max_bytes: int, version: str | None
    ) -> SharedInput:
        if self.data is not None and not _dot_segments(uri.key):
            return await self.data.get_shared(uri, max_bytes, self.segments, version)
        which = {"VersionId": version} if version is not None else {}
        try:
            response = await self.client.get_object(Bucket=uri.bucket, Key=uri.key, **which)
        except ClientError as exc:
            if error_code(exc) in ("NoSuchKey", "NoSuchVersion", "404") or http_status(exc) == 404:
                raise InputError("input_not_found", _not_found(uri, version)) from None
            raise
        body = response["Body"]
        async with body:
            size = int(response["ContentLength"])
            chunks = body.iter_chunks(_CHUNK_BYTES)
            shared = await _into_shared(uri, size, max_bytes, chunks, self.segments)
        return _read_version(shared, response.get("ETag"), response.get("VersionId"))

    async def commit(
        self, uri: S3Uri, body: bytes, metadata: dict[str, str], content_type: str
    ) -> str | None:
        """`put_if_absent` of an output: through the data path when there is one."""
        if self.data is not None:
            return await self.data.put_if_absent(uri, body, metadata, content_type)
        return await self.put_if_absent(uri, body, metadata, content_type)

    async def put_if_absent(
        self, uri: S3Uri, body: bytes, metadata: dict[str, str], content_type: str
    ) -> str | None:
        """Create the object unless it exists: its ETag when this call wrote it, else None."""
        return await self._put_unless(uri, body, metadata, content_type, IfNoneMatch="*")

    async def put_if_match(
        self, uri: S3Uri, body: bytes, metadata: dict[str, str], content_type: str, etag: str
    ) -> str | None:
        """Replace the object if it is still the version `etag` names: the new ETag, or None
        when it changed meanwhile (or is gone)."""
        return await self._put_unless(uri, body, metadata, content_type, IfMatch=etag)

    async def _put_unless(
        self, uri: S3Uri, body: bytes, metadata: dict[str, str], content_type: str, **condition: str
    ) -> str | None:
        for attempt in range(_CONFLICT_RETRIES + 1):
            try:
                response = await self.client.put_object(
                    Bucket=uri.bucket,
                    Key=uri.key,
                    Body=body,
                    Metadata=metadata,
                    ContentType=content_type,
                    **condition,
                )
                return str(response.get("ETag", "")) or "written"
            except ClientError as exc:
                code = error_code(exc)
                if code == "PreconditionFailed" or http_status(exc) == 412:
                    return None
                if "IfMatch" in condition and (code == "NoSuchKey" or http_status(exc) == 404):
                    return None
                if code != "ConditionalRequestConflict" or attempt == _CONFLICT_RETRIES:
                    raise
                log.debug(
                    Event.CONDITIONAL_PUT_CONFLICT, extra={"uri": str(uri), "attempt": attempt + 1}
                )
                await asyncio.sleep(_CONFLICT_BACKOFF.delay_s(attempt))
        raise AssertionError("unreachable")  # pragma: no cover


def _dot_segments(key: str) -> bool:
    """Whether a key holds a segment of dots alone (an S3 event's object may: S3 keys are
    not paths). object_store refuses to name such a key, so its GET takes the SDK, which
    sends it as it is."""
    return any(segment in DOT_SEGMENTS for segment in key.split("/"))


def _read_version(shared: SharedInput, etag: str | None, version_id: str | None) -> SharedInput:
    """Note which version of its object an input is (an unversioned bucket has no id)."""
    shared.etag = (etag or "").strip('"')
    shared.version_id = "" if version_id in (None, "null") else str(version_id)
    return shared


def _not_found(uri: S3Uri, version: str | None) -> str:
    return f"{uri} version {version} does not exist" if version else f"{uri} does not exist"


async def _into_shared(
    uri: S3Uri, size: int, max_bytes: int, chunks: AsyncIterable[Any], segments: Segments
) -> SharedInput:
    """The object's body (`chunks`, not read yet) in shared memory, unless it is too large:
    refused before a byte of it is read or a segment made. A full /dev/shm makes it wait
    for a segment of this worker to come back, or, with none out, fails it as transient
    (`SharedMemoryFull`): never a write into pages the tmpfs has no room for."""
    if size > max_bytes:
        raise InputError("input_too_large", f"{uri} is {size} bytes, limit {max_bytes}")
    shared = await SharedInput.made(size, segments)
    try:
        await _read_into(chunks, shared)
    except BaseException:
        shared.close()
        raise
    return shared


async def _read_into(chunks: AsyncIterable[Any], shared: SharedInput) -> None:
    offset = 0
    async for chunk in chunks:
        if offset + len(chunk) > shared.size:
            raise OSError("S3 sent more bytes than its Content-Length")
        shared.write_at(offset, chunk)
        offset += len(chunk)
    if offset != shared.size:
        raise OSError(f"S3 body ended after {offset} of {shared.size} bytes")
