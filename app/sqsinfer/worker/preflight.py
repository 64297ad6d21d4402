"""Start-up checks of everything the worker depends on, before it reports ready.

Each problem is sorted into one of two kinds:
- it may pass by itself (the endpoint is down, throttling, a 5xx): wait and ask again,
  for as long as it takes; readiness stays false meanwhile;
- it will not (no such queue or bucket, credentials refused): stop at once with a
  message that names the setting to change.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from sqsinfer import config, shm
from sqsinfer.aws.session import Clients, error_code, http_status
from sqsinfer.aws.sqs import SqsQueue
from sqsinfer.backoff import Backoff
from sqsinfer.limits import SQS_DEFAULT_MAX_MESSAGE_BYTES
from sqsinfer.logs import Event
from sqsinfer.worker import inflight, model_source
from sqsinfer.worker.inflight import InFlightLimit
from sqsinfer.worker.model_source import ModelFile

log = logging.getLogger("sqsinfer.preflight")
T = TypeVar("T")

_BACKOFF = Backoff(base_s=0.5, max_s=20.0)
_CREDENTIAL_CODES = frozenset(
    {
        "InvalidClientTokenId",
        "SignatureDoesNotMatch",
        "UnrecognizedClientException",
        "ExpiredToken",
        "ExpiredTokenException",
        "InvalidAccessKeyId",
        "AccessDenied",
        "AccessDeniedException",
        "InvalidSecurity",
        "MissingAuthenticationToken",
    }
)
# A policy may grant sending to a queue without reading its attributes.
_DENIED_CODES = frozenset({"AccessDenied", "AccessDeniedException"})
_MISSING_CODES = frozenset(
    {
        "AWS.SimpleQueueService.NonExistentQueue",
        "QueueDoesNotExist",
        "NoSuchBucket",
        "404",
    }
)


class StartupError(Exception):
    """The worker cannot start; the message says why and which setting to change."""


class StoppedWhileStarting(Exception):
    """Shutdown was asked for while start-up waited on a dependency."""


@dataclass(frozen=True)
class Dependencies:
    dlq_url: str
    model: ModelFile
    # Receives the queue's redrive policy allows (None without one): on the last, a
    # transient failure sends the message to the DLQ with a reason instead of retrying.
    max_receive_count: int | None = None
    dlq_max_message_bytes: int = SQS_DEFAULT_MAX_MESSAGE_BYTES


def _diagnose(exc: Exception) -> str:
    """'' when the problem may pass by itself, else what kind of lasting problem it is."""
    if isinstance(exc, NoCredentialsError):
        return "credentials"
    if not isinstance(exc, ClientError):
        return ""
    code = error_code(exc)
    if code in _CREDENTIAL_CODES or http_status(exc) in (401, 403):
        return "credentials"
    if code in _MISSING_CODES or http_status(exc) == 404:
        return "missing"
    throttled = "throttl" in code.lower() or code in ("RequestThrottled", "SlowDown")
    return "" if throttled or http_status(exc) >= 500 else "refused"


def check_shared_memory(s: config.Settings, shm_dir: str = shm.SHM_DIR) -> None:
    """Refuse an in-flight bound whose inputs /dev/shm cannot hold all at once.

    Each input in flight is copied into a segment there. The worker never writes into
    pages the tmpfs has no room for (an input waits, or is retried), but a bound that
    cannot fit would make that the steady state.
    """
    found = shm.room(shm_dir)
    if found is None:
        return
    ceiling = InFlightLimit.from_settings(s, shm_dir).ceiling
    if inflight.shm_need_bytes(ceiling, s.processes, s.max_input_bytes) > found.total_bytes:
        raise StartupError(_shm_refusal(s, ceiling, found.total_bytes))


def _shm_refusal(s: config.Settings, ceiling: int, total_bytes: int) -> str:
    env = config.env_name
    segment = shm.segment_bytes(s.max_input_bytes)
    if s.prefetch == config.AUTO:  # auto holds what /dev/shm has room for, but one a process
        what = (
            f"{env('prefetch')}=auto holds at least one input per process (at most "
            f"{env('max_prefetch')}={s.max_prefetch}), and that"
        )
        per, lower = 1, env("processes")
    else:
        what, per, lower = f"{env('prefetch')}={s.prefetch}", int(s.prefetch), env("prefetch")
    return (
        f"{what} does not fit /dev/shm with {env('max_input_bytes')}={s.max_input_bytes}: "
        f"{env('processes')}={s.processes} x {per} in flight, {shm.mib_text(segment)} MiB a "
        f"segment, need {shm.mib_text(ceiling * segment)} MiB (and "
        f"{shm.SEMAPHORE_BYTES_PER_PROCESS >> 10} KiB a process for semaphores), /dev/shm "
        f"holds {shm.mib_text(total_bytes)} MiB; lower {lower} or {env('max_input_bytes')}, or "
        "give /dev/shm more room (docker run --shm-size, the chart's shm.sizeLimit)"
    )


class Preflight:
    def __init__(
        self, settings: config.Settings, clients: Clients, stopping: asyncio.Event
    ) -> None:
        self.settings = settings
        self.clients = clients
        self.stopping = stopping

    async def run(self) -> Dependencies:
        s = self.settings
        check_shared_memory(s)
        # A local model is checked first: a wrong pin needs no AWS endpoint to be reported.
        local = None if model_source.is_remote(s.model_path) else await self._local_model()
        queue = SqsQueue(self.clients.sqs, s.queue_url)
        policy = await self._ask("queue_url", f"read queue {s.queue_url}", queue.redrive_policy)
        dlq_url = s.dlq_url or (policy.dlq_url if policy else "")
        if not dlq_url:
            raise StartupError(
                f"{config.env_name('dlq_url')}: not set, and {s.queue_url} has no redrive "
                "policy; rejected messages need a dead-letter queue"
            )
        for name, url in (("dlq_url", dlq_url), ("next_queue_url", s.next_queue_url)):
            if url:
                await self._ask(
                    name, f"read queue {url}", functools.partial(self._queue_exists, url)
                )
        dlq_max = await self._ask(
            "dlq_url", f"read queue {dlq_url}", functools.partial(self._max_message_bytes, dlq_url)
        )
        await self._buckets()
        return Dependencies(
            dlq_url=dlq_url,
            model=local or await self._remote_model(),
            max_receive_count=policy.max_receive_count if policy else None,
            dlq_max_message_bytes=dlq_max,
        )

    async def _local_model(self) -> ModelFile:
        s = self.settings
        return await asyncio.to_thread(model_source.local, s.model_path, s.model_sha256)

    async def _remote_model(self) -> ModelFile:
        s = self.settings
        fetch = functools.partial(model_source.fetch, self.clients.s3, s)
        return await self._ask("model_path", f"fetch model {s.model_path}", fetch)

    async def _max_message_bytes(self, url: str) -> int:
        """The queue's MaximumMessageSize; SQS's default when the policy may not read it."""
        try:
            response = await self.clients.sqs.get_queue_attributes(
                QueueUrl=url, AttributeNames=["MaximumMessageSize"]
            )
        except ClientError as exc:
            if error_code(exc) not in _DENIED_CODES and http_status(exc) != 403:
                raise
            log.info(
                Event.DLQ_SIZE_ASSUMED,
                extra={"queue": url, "assumed_bytes": SQS_DEFAULT_MAX_MESSAGE_BYTES},
            )
            return SQS_DEFAULT_MAX_MESSAGE_BYTES
        size = response.get("Attributes", {}).get("MaximumMessageSize")
        return int(size) if size else SQS_DEFAULT_MAX_MESSAGE_BYTES

    async def _queue_exists(self, url: str) -> None:
        # GetQueueUrl, not GetQueueAttributes: a stage may send to these queues, and that
        # is all its IAM policy needs to grant on them (with sqs:GetQueueUrl).
        *_, account, name = url.rstrip("/").split("/")
        await self.clients.sqs.get_queue_url(QueueName=name, QueueOwnerAWSAccountId=account)

    async def _buckets(self) -> None:
        s = self.settings
        wanted: dict[str, str] = {}
        for prefix in s.allowed_input_prefixes:
            wanted.setdefault(prefix.bucket, "allowed_input_prefixes")
        if s.output_prefix is not None:
            wanted[s.output_prefix.bucket] = "output_prefix"
        for bucket, setting in wanted.items():
            await self._ask(
                setting, f"find bucket {bucket}", functools.partial(self._bucket, bucket)
            )

    async def _bucket(self, bucket: str) -> None:
        try:
            await self.clients.s3.head_bucket(Bucket=bucket)
        except ClientError as exc:
            # A policy may grant object access without s3:ListBucket: 403 is not "missing".
            if http_status(exc) != 403:
                raise
            log.warning(Event.BUCKET_NOT_LISTABLE, extra={"bucket": bucket})

    async def _ask(self, setting: str, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """Call until it answers; fail at once on a problem that will not pass."""
        attempt = 0
        while True:
            try:
                return await call()
            except (ClientError, BotoCoreError) as exc:
                problem = _diagnose(exc)
                if problem == "credentials":
                    raise StartupError(
                        f"{config.env_name(setting)}: AWS credentials or policy refused "
                        f"trying to {what}: {exc}"
                    ) from None
                if problem:
                    raise StartupError(
                        f"{config.env_name(setting)}: cannot {what}: {exc}"
                    ) from None
                wait_s = _BACKOFF.delay_s(attempt)
                attempt += 1
                log.warning(
                    Event.DEPENDENCY_NOT_ANSWERING,
                    extra={"what": what, "error": str(exc), "retry_in_s": wait_s},
                )
                await self._pause(wait_s)

    async def _pause(self, seconds: float) -> None:
        """Sleep, unless shutdown is asked for meanwhile."""
        try:
            await asyncio.wait_for(self.stopping.wait(), seconds)
        except TimeoutError:
            return
        raise StoppedWhileStarting
