"""The worker's lifecycle: startup → main loop → shutdown. It orchestrates, nothing more.

- startup: health server, model hash, AWS clients, queue checks, pool warm-up, ready.
- main loop: receive only while there is capacity (processes × prefetch in flight), and
  start one pipeline task per message.
- shutdown (SIGTERM/SIGINT, or `stop()`): not ready; stop receiving; release messages
  whose work has not started; let started tasks finish until the drain deadline; then
  cancel the rest (their messages are released); close the pool. A second signal skips
  the wait. Signal handlers only set flags.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import time
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from sqsinfer import __version__, config, shm
from sqsinfer.aws import Clients, open_clients
from sqsinfer.backoff import Backoff
from sqsinfer.health import HealthServer
from sqsinfer.messages import MessageRules
from sqsinfer.metrics import Metrics, Phase
from sqsinfer.outcomes import Outcome
from sqsinfer.pipeline import FINISHING_STEPS, Held, Pipeline
from sqsinfer.pool import InferencePool, PoolConfig
from sqsinfer.preflight import Preflight, StartupError, StoppedWhileStarting
from sqsinfer.queue import Message, Sender, SqsQueue
from sqsinfer.storage import Storage
from sqsinfer.visibility import VisibilityKeeper

log = logging.getLogger("sqsinfer.worker")

_RECEIVE_BACKOFF = Backoff(base_s=1.0, max_s=20.0)
__all__ = ["StartupError", "Worker", "run_worker"]
_IDLE_TICK_S = 1.0


class Worker:
    def __init__(self, settings: config.Settings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.held: dict[asyncio.Task[Outcome], Held] = {}
        self.should_exit = False
        self.force_exit = False
        self.ready = False
        self.draining = False
        self.last_receive_ok = False
        self.last_progress = time.monotonic()
        self.keeper: VisibilityKeeper | None = None
        self.health = HealthServer(self, settings.health_host, settings.health_port)
        self.pool = InferencePool(
            PoolConfig(
                processes=settings.processes,
                handler=settings.handler,
                model_path=settings.model_path,
                threads=settings.threads_per_process,
                model_sha256=settings.model_sha256,
                max_decoded_bytes=settings.max_decoded_bytes,
            ),
            self.metrics,
        )
        self.metrics.in_flight_limit.set(settings.in_flight_limit)
        self.metrics.child_rss.pids = self.pool.pids
        # Receive once the held messages are down to one per process, not at every freed
        # slot: the processes still have work, and a receive then brings several
        # messages instead of one (each SQS call costs the pod milliseconds of CPU).
        self._receive_threshold = max(1, settings.in_flight_limit - settings.processes)
        self._wake = asyncio.Event()
        self._exit_requested = asyncio.Event()
        self._background: list[asyncio.Task[Any]] = []

    # -- the plan -------------------------------------------------------------------
    async def serve(self) -> None:
        """Run until told to stop. Raises StartupError when the worker cannot start."""
        async with contextlib.AsyncExitStack() as stack:
            await self.health.start()
            stack.push_async_callback(self.health.stop)
            clients = await stack.enter_async_context(self._clients())
            try:
                pipeline = await self.startup(clients)
            except StoppedWhileStarting:
                log.info("stopped before ready")
                return
            stack.push_async_callback(self.pool.close)
            if not self.should_exit:
                await self.main_loop(pipeline)
            await self.shutdown(pipeline)

    def _clients(self) -> contextlib.AbstractAsyncContextManager[Clients]:
        s = self.settings
        return open_clients(s.region, s.endpoint_url, s.in_flight_limit, s.wait_time_s + 30.0)

    def stop(self) -> None:
        """Ask the worker to stop; asking again forces it (no wait for the drain)."""
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True
        self._exit_requested.set()
        self._wake.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        log.info(
            "signal received",
            extra={"signal": signal.Signals(sig).name, "forced": self.should_exit},
        )
        self.stop()

    # -- startup --------------------------------------------------------------------
    async def startup(self, clients: Clients) -> Pipeline:
        s = self.settings
        log.info("starting", extra={"settings": config.describe(s)})
        for client in (clients.s3, clients.sqs, clients.sqs_single_attempt):
            self.metrics.count_aws_calls(client)
        await asyncio.to_thread(shm.sweep)  # what workers killed before this one left
        queue = SqsQueue(clients.sqs, s.queue_url)
        found = await Preflight(s, clients, self._exit_requested).run()
        self.last_receive_ok = True  # the queue answered; readiness waits for no first poll
        # The processes load the verified local copy, and check its hash once more.
        self.pool.config = dataclasses.replace(
            self.pool.config, model_path=found.model.path, model_sha256=found.model.sha256
        )
        await self.pool.start()
        self.metrics.running(__version__, found.model.sha256, s.handler)
        self._background.append(asyncio.create_task(self.pool.watch(), name="pool-watch"))
        log.info(
            "pool ready",
            extra={"processes": s.processes, "startup_s": round(self.pool.startup_s, 3)},
        )
        pipeline = Pipeline(
            settings=s,
            rules=MessageRules(
                allowed_input_prefixes=s.allowed_input_prefixes,
                allowed_output_prefixes=s.allowed_output_prefixes,
                output_prefix=s.output_prefix,  # type: ignore[arg-type]  # validated
                output_suffix=s.output_suffix,
                max_message_bytes=s.max_message_bytes,
                dead_letter_max_bytes=found.dlq_max_message_bytes,
            ),
            storage=Storage(clients.s3),
            queue=queue,
            dead_letters=Sender(clients.sqs, found.dlq_url),
            next_stage=(
                Sender(clients.sqs_single_attempt, s.next_queue_url) if s.next_queue_url else None
            ),
            pool=self.pool,
            metrics=self.metrics,
            model_sha256=found.model.sha256,
            max_receive_count=found.max_receive_count,
        )
        self.keeper = VisibilityKeeper(
            queue,
            visibility_timeout_s=s.visibility_timeout_s,
            heartbeat_s=s.heartbeat_s,
            max_task_time_s=s.max_task_time_s,
            metrics=self.metrics,
            on_expired=self._expire,
        )
        self._background.append(asyncio.create_task(self.keeper.run(), name="visibility"))
        return pipeline

    # -- main loop --------------------------------------------------------------------
    async def main_loop(self, pipeline: Pipeline) -> None:
        self.ready = True
        log.info("ready", extra={"in_flight_limit": self.settings.in_flight_limit})
        failures = 0
        while not self.should_exit:
            self.last_progress = time.monotonic()
            capacity = self.settings.in_flight_limit - len(self.held)
            if capacity < self._receive_threshold:
                await self._wait_for_wake(_IDLE_TICK_S)
                continue
            messages = await self._receive(pipeline.queue, capacity)
            if messages is None:
                failures += 1
                await self._wait_for_wake(_RECEIVE_BACKOFF.delay_s(failures - 1))
                continue
            failures = 0
            for message in messages:
                self._start(pipeline, message)

    async def _receive(self, queue: SqsQueue, capacity: int) -> list[Message] | None:
        """One long poll, abandoned at once when shutdown begins. None on failure."""
        s = self.settings
        started = time.perf_counter()
        receive = asyncio.create_task(
            queue.receive(capacity, s.wait_time_s, s.visibility_timeout_s)
        )
        stop = asyncio.create_task(self._exit_requested.wait())
        await asyncio.wait({receive, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not receive.done():
            # Messages SQS handed out in the abandoned answer come back after their
            # visibility timeout: delayed, not lost.
            receive.cancel()
            return []
        try:
            messages = receive.result()
        except (TimeoutError, ClientError, BotoCoreError, OSError) as exc:
            self.last_receive_ok = False
            log.warning("receive failed", extra={"error": str(exc)})
            return None
        self.last_receive_ok = True
        self.metrics.observe(Phase.RECEIVE, time.perf_counter() - started)
        return messages

    def _start(self, pipeline: Pipeline, message: Message) -> None:
        held = Held(message)
        task = asyncio.create_task(pipeline.handle(held), name=f"message-{message.message_id}")
        self.held[task] = held
        assert self.keeper is not None  # made by startup
        self.keeper.add(message)
        self.metrics.in_flight.set(len(self.held))
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[Outcome]) -> None:
        held = self.held.pop(task, None)
        if held is not None and self.keeper is not None:
            self.keeper.discard(held.message)
        self.metrics.in_flight.set(len(self.held))
        self._wake.set()

    def _expire(self, message: Message) -> None:
        for task, held in self.held.items():
            if held.message is message:
                held.expired = True
                task.cancel()

    async def _wait_for_wake(self, timeout_s: float) -> None:
        self._wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout_s)

    # -- shutdown ---------------------------------------------------------------------
    async def shutdown(self, pipeline: Pipeline) -> None:
        self.ready = False
        self.draining = True
        self.pool.stop_restarting()
        unstarted = [t for t, h in self.held.items() if not h.started]
        log.info(
            "draining",
            extra={
                "in_flight": len(self.held),
                "releasing": len(unstarted),
                "deadline_s": self.settings.drain_deadline_s,
            },
        )
        for task in unstarted:
            task.cancel()
        await self._drain()
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await pipeline.queue.drain()
        log.info("stopped", extra={"outcomes": dict(self.metrics.outcomes)})

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.settings.drain_deadline_s
        while self.held and not self.force_exit and time.monotonic() < deadline:
            await self._wait_for_wake(min(_IDLE_TICK_S, deadline - time.monotonic()))
        late = [t for t, h in self.held.items() if h.step not in FINISHING_STEPS or self.force_exit]
        if late:
            log.warning(
                "drain deadline passed, releasing",
                extra={"tasks": len(late), "forced": self.force_exit},
            )
        for task in late:
            task.cancel()
        # Commits, links and DLQ copies under way are short: let them land, not redo them.
        pending = list(self.held)
        if pending:
            limit = config.FORCED_RELEASE_S if self.force_exit else config.COMMIT_GRACE_S
            _, still = await asyncio.wait(pending, timeout=limit)
            for task in still:
                task.cancel()
            if still:
                await asyncio.wait(still, timeout=config.FORCED_RELEASE_S)

    # -- health -----------------------------------------------------------------------
    def livez(self) -> tuple[bool, str]:
        stalled_s = time.monotonic() - self.last_progress
        if self.ready and stalled_s > self.settings.stall_s:
            return False, f"main loop made no progress for {stalled_s:.0f} s"
        if not self.pool.usable and not self.draining:
            return False, f"inference pool cannot be rebuilt: {self.pool.last_error}"
        return True, ""

    def readyz(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        if not self.ready:
            return False, "starting"
        if not self.last_receive_ok:
            return False, "last receive failed"
        return True, ""

    def metrics_text(self) -> bytes:
        return self.metrics.render()


async def run_worker(settings: config.Settings, *, signals: bool = True) -> Worker:
    worker = Worker(settings)
    if signals:
        worker.install_signal_handlers()
    await worker.serve()
    return worker
