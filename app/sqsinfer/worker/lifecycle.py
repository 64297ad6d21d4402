"""The worker's lifecycle: startup → main loop → shutdown. It orchestrates, nothing more.

- startup: health server, model hash, AWS clients, queue checks, pool warm-up, ready.
- main loop: receive whenever a batch worth the call fits under the in-flight limit, and
  start one pipeline task per message. A message holds one of the limit's slots from its
  receive until its input is no longer needed and its result is committed (or its
  outcome otherwise decided); its chain link and its batched delete run without one,
  under a hard cap on everything held. The limit is pinned (`prefetch` N) or, with
  `prefetch` auto, sized by Little's law from measured times (`InFlightLimit`).
- shutdown (SIGTERM/SIGINT, or `stop()`): not ready; stop receiving; release messages
  whose work has not started; let started tasks finish until the drain deadline; then
  cancel the rest (their messages are released); close the pool. A second signal skips
  the wait. Signal handlers only set flags.

A long poll pending when shutdown begins is not abandoned: closing the connection does
not end it at SQS, which goes on handing it messages, the ones this shutdown releases
included (each then hidden for a visibility timeout, one receive spent). Every release
(visibility 0) waits until the worker's pending receive has ended, and shutdown releases
what that receive brought; it ends within `wait_time_s`, which the shutdown budget
counts. A second signal abandons it.

A worker may also end by itself, as a job's does: once `max_tasks` messages were taken
(each receive asks for no more than are left, so the rest stay on the queue, visible to
others) and have ended, or once its queue stayed empty with nothing in flight for
`exit_when_idle_s`. The main loop then ends as on a signal, with nothing to release,
and the worker exits 0. A message handed back unstarted does not count towards
`max_tasks`; one retried or rejected does (its work was spent here).

When no inference process can start (every slot lost and its restart refused), the
worker stops receiving, releases the messages still waiting for a process, and fails
/readyz at once; it receives again once a process is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import signal
import time
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from sqsinfer import __version__, config, shm, tracing
from sqsinfer.aws.session import Clients, open_clients
from sqsinfer.aws.sqs import Message, SqsQueue, oldest_age_s
from sqsinfer.backoff import Backoff
from sqsinfer.logs import Event
from sqsinfer.metrics import Metrics, Phase
from sqsinfer.outcomes import Outcome
from sqsinfer.runtime import STOP_SIGNALS, EarlySignals
from sqsinfer.tracing.api import FLUSH_S, Tracer
from sqsinfer.worker import assemble, pod_cost
from sqsinfer.worker.health import HealthServer
from sqsinfer.worker.inflight import InFlightLimit
from sqsinfer.worker.pipeline import FINISHING_STEPS, Held, Pipeline, Step
from sqsinfer.worker.pool import InferencePool, PoolConfig
from sqsinfer.worker.preflight import Preflight, StartupError, StoppedWhileStarting
from sqsinfer.worker.visibility import VisibilityKeeper

log = logging.getLogger("sqsinfer.worker")

_RECEIVE_BACKOFF = Backoff(base_s=1.0, max_s=20.0)
__all__ = ["StartupError", "Worker", "run_worker"]
_IDLE_TICK_S = 1.0
# Everything held (slots, plus messages whose link or delete is under way) stays within
# this many times the limit: a stalled delete path stops receiving, not grows memory.
HELD_CAP_FACTOR = 2


def receive_wait_s(wait_time_s: int, exit_when_idle_s: float, idle_s: float, holding: bool) -> int:
    """The long poll's wait: with `exit_when_idle_s` and nothing in flight, it ends when
    the worker would have been idle long enough (a second at least: a shorter poll
    samples only some of SQS's servers, and may miss what waits)."""
    if not exit_when_idle_s or holding:
        return wait_time_s
    return min(wait_time_s, max(1, math.ceil(exit_when_idle_s - idle_s)))


def idle_long_enough(exit_when_idle_s: float, found_empty: bool, idle_s: float) -> bool:
    """Whether a worker holding nothing is done by `exit_when_idle_s`: its last receive
    found the queue empty, and it received nothing and ended no task for that long."""
    return bool(exit_when_idle_s) and found_empty and idle_s >= exit_when_idle_s


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
                model_output=settings.model_output,
                coalesce_max_rows=settings.coalesce_max_rows if settings.coalesce else 0,
            ),
            self.metrics,
        )
        self.limit = InFlightLimit.from_settings(settings)
        self.metrics.in_flight_limit.set(self.limit.value)
        self.metrics.child_rss.pids = self.pool.pids
        self.pool.on_change = self._pool_changed
        self.paused = False  # receiving stopped: no inference process can start
        self._wake = asyncio.Event()
        self._exit_requested = asyncio.Event()
        self._forced = asyncio.Event()
        self._background: list[asyncio.Task[Any]] = []
        self._shutdown_at: float | None = None
        self.tracer = worker_tracer(settings)
        # This pod's object in the Kubernetes API, when pod_deletion_cost is on.
        self.kube = pod_cost.target(settings)
        self.deletion_cost: pod_cost.DeletionCost | None = None
        # The long poll the main loop has out (None once its answer was taken), and when
        # it was sent.
        self._receiving: asyncio.Task[list[Message]] | None = None
        self._receive_sent_at = 0.0
        # Messages taken, less those handed back unstarted (what `max_tasks` counts).
        self.taken = 0
        # When the worker last received a message or ended a task (`exit_when_idle_s`),
        # and whether its last receive found the queue empty.
        self._last_activity = time.monotonic()
        self._found_empty = False

    # -- the plan -------------------------------------------------------------------
    async def serve(self) -> None:
        """Run until told to stop. Raises StartupError when the worker cannot start."""
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(self._close_traces)  # last: after every span ended
            await self.health.start()
            stack.push_async_callback(self.health.stop)
            clients = await stack.enter_async_context(self._clients())
            try:
                pipeline = await self.startup(clients)
            except StoppedWhileStarting:
                log.info(Event.STOPPED_BEFORE_READY)
                return
            stack.push_async_callback(self.pool.close)
            if not self.should_exit:
                await self.main_loop(pipeline)
            await self.shutdown(pipeline)

    def _clients(self) -> contextlib.AbstractAsyncContextManager[Clients]:
        s = self.settings
        return open_clients(s.region, s.endpoint_url, self.limit.most, s.wait_time_s + 30.0)

    def stop(self) -> None:
        """Ask the worker to stop; asking again forces it (no wait for the drain)."""
        if self.should_exit:
            self.force_exit = True
            self._forced.set()
        self.should_exit = True
        self._exit_requested.set()
        self._wake.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        log.info(
            Event.SIGNAL_RECEIVED,
            extra={"signal": signal.Signals(sig).name, "forced": self.should_exit},
        )
        self.stop()

    # -- startup --------------------------------------------------------------------
    async def startup(self, clients: Clients) -> Pipeline:
        s = self.settings
        log.info(Event.STARTING, extra={"settings": config.describe(s), "aws": clients.describe()})
        for client in (clients.s3, clients.sqs, clients.sqs_single_attempt):
            self.metrics.count_aws_calls(client)
        clients.watch_throttling(self._throttled)
        await asyncio.to_thread(shm.sweep)  # what workers killed before this one left
        found = await Preflight(s, clients, self._exit_requested).run()
        if self.should_exit:  # asked to stop meanwhile: spare the pool its start
            raise StoppedWhileStarting
        self.last_receive_ok = True  # the queue answered; readiness waits for no first poll
        # The processes load the verified local copy, and check its hash once more.
        self.pool.config = dataclasses.replace(
            self.pool.config, model_path=found.model.path, model_sha256=found.model.sha256
        )
        await self.pool.start()
        self.metrics.running(__version__, found.model.sha256, s.handler)
        self._background.append(asyncio.create_task(self.pool.watch(), name="pool-watch"))
        log.info(
            Event.POOL_READY,
            extra={
                "processes": s.processes,
                "startup_s": round(self.pool.startup_s, 3),
                # 0: no coalescing (switched off, or the handler does not allow it).
                "coalesce_max_rows": self.pool.coalesce_max_rows,
            },
        )
        pipeline = assemble.pipeline(
            s, clients, found, self.pool, self.metrics, on_throttled=self._throttled
        )
        pipeline.receive_ended = self._receive_ended
        self.keeper = assemble.keeper(s, pipeline.queue, self.metrics, self._expire)
        self._background.append(asyncio.create_task(self.keeper.run(), name="visibility"))
        sampler = assemble.queue_depth(s, clients, found, self.metrics)
        if sampler is not None:
            self._background.append(asyncio.create_task(sampler.run(), name="queue-depth"))
        if self.kube is not None:
            self.deletion_cost = pod_cost.DeletionCost(
                self.kube, self.metrics, self._holds, s.pod_deletion_cost_idle_s
            )
            cost = asyncio.create_task(self.deletion_cost.run(), name="pod-deletion-cost")
            self._background.append(cost)
        return pipeline

    def _holds(self) -> bool:
        """Whether any message is held: the pod is busy, and costly to delete."""
        return bool(self.held)

    # -- main loop --------------------------------------------------------------------
    async def main_loop(self, pipeline: Pipeline) -> None:
        self.ready = True
        log.info(
            Event.READY,
            extra={
                "in_flight_limit": self.limit.value,
                "auto": self.limit.auto,
                "ceiling": self.limit.ceiling,
                "most": self.limit.most,
            },
        )
        self._last_activity = time.monotonic()
        failures = 0
        while not self.should_exit and not self._work_done():
            self.last_progress = time.monotonic()
            if self.pool.stalled:  # nothing received could be computed: leave it to others
                self._pause()
                await self._wait_for_wake(_IDLE_TICK_S)
                continue
            self._resume()
            size = self._receive_size()
            if size == 0:
                await self._wait_for_wake(_IDLE_TICK_S)
                continue
            messages = await self._receive(pipeline.queue, size, self._receive_wait_s())
            self._found_empty = messages == []
            if messages is None:
                failures += 1
                await self._wait_for_wake(_RECEIVE_BACKOFF.delay_s(failures - 1))
                continue
            failures = 0
            if messages:
                self.taken += len(messages)
                self._last_activity = time.monotonic()
            # On a FIFO queue, each message waits for the one before it in its group. (A
            # standard queue's groups are a fair queue's tenants: no order to keep.)
            ordered = pipeline.queue.fifo
            last_of_group: dict[str, Held] = {}
            for message in messages:
                group = message.group_id if ordered else ""
                held = self._start(pipeline, message, after=last_of_group.get(group))
                if group:
                    last_of_group[group] = held

    def _receive_size(self) -> int:
        """How many messages a receive asks for now; 0 until one is worth its call. Never
        more than `max_tasks` leaves: the rest stay on the queue, visible to others."""
        room, batch = self.room(), self.limit.receive_batch
        if self.settings.max_tasks:
            left = self.settings.max_tasks - self.taken
            room, batch = min(room, left), min(batch, left)
        return room if room > 0 and room >= batch else 0

    def _receive_wait_s(self) -> int:
        s = self.settings
        idle_s = time.monotonic() - self._last_activity
        return receive_wait_s(s.wait_time_s, s.exit_when_idle_s, idle_s, bool(self.held))

    def _work_done(self) -> bool:
        """Whether the worker has done what it was started for, nothing being in flight:
        taken its `max_tasks`, or found its queue empty for `exit_when_idle_s`."""
        s = self.settings
        if self.held:
            return False
        idle_s = time.monotonic() - self._last_activity
        if s.max_tasks and self.taken >= s.max_tasks:
            reason = "max_tasks"
        elif idle_long_enough(s.exit_when_idle_s, self._found_empty, idle_s):
            reason = "idle"
        else:
            return False
        log.info(
            Event.WORK_DONE,
            extra={"reason": reason, "taken": self.taken, "idle_s": round(idle_s, 3)},
        )
        return True

    async def _receive(self, queue: SqsQueue, capacity: int, wait_s: int) -> list[Message] | None:
        """One long poll, left to shutdown when it begins meanwhile. None on failure."""
        s = self.settings
        started = time.perf_counter()
        receive = asyncio.create_task(queue.receive(capacity, wait_s, s.visibility_timeout_s))
        self._receiving, self._receive_sent_at = receive, time.monotonic()
        stop = asyncio.create_task(self._exit_requested.wait())
        await asyncio.wait({receive, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if self.should_exit:
            # Not cancelled: the poll would stay open at SQS all the same. Shutdown waits
            # for it and releases what it brings (`_end_last_receive`).
            return []
        self._receiving = None
        try:
            messages = receive.result()
        except (TimeoutError, ClientError, BotoCoreError, OSError) as exc:
            self.last_receive_ok = False
            log.warning(Event.RECEIVE_FAILED, extra={"error": str(exc)})
            return None
        self.last_receive_ok = True
        spent_s = time.perf_counter() - started
        self.metrics.observe(Phase.RECEIVE, spent_s)
        self.tracer.received(queue.url, spent_s, messages)
        self.metrics.received_age.set(oldest_age_s(messages, time.time()))
        if messages:  # an empty long poll says nothing of how fast slots refill
            self.limit.observe_receive(spent_s)
        return messages

    def working(self) -> int:
        """Held messages that hold a slot (their input or result still in hand)."""
        return sum(1 for held in self.held.values() if not held.slot_released)

    def room(self) -> int:
        """Messages a receive may bring now: free slots, within the cap on all held."""
        cap = HELD_CAP_FACTOR * self.limit.value
        return max(0, min(self.limit.value - self.working(), cap - len(self.held)))

    async def _receive_ended(self) -> None:
        """Return once the long poll pending now (if any) has ended (`Pipeline.receive_ended`)."""
        receiving = self._receiving
        if receiving is not None and not receiving.done():
            await asyncio.wait({receiving})

    def _start(self, pipeline: Pipeline, message: Message, after: Held | None = None) -> Held:
        held = Held(message, on_release=self._released, on_take=self._taken, after=after)
        task = asyncio.create_task(pipeline.handle(held), name=f"message-{message.message_id}")
        self.held[task] = held
        assert self.keeper is not None  # made by startup
        self.keeper.add(message)
        self.metrics.in_flight.set(self.working())
        task.add_done_callback(self._finished)
        return held

    def _taken(self, held: Held) -> None:
        self.metrics.in_flight.set(self.working())

    def _released(self, held: Held) -> None:
        """A message gave its slot back: refill it, and learn from its times."""
        self.metrics.in_flight.set(self.working())
        self._wake.set()
        compute_s = held.compute_s()
        if compute_s is None:
            return
        held_s = time.monotonic() - held.message.received_at
        io_s = max(0.0, held_s - compute_s - held.timings.get(Phase.WAIT_PROCESS.value, 0.0))
        before = self.limit.value
        if self.limit.observe_task(io_s, compute_s, held.held_bytes) is not None:
            self._limit_changed(before, "measured")

    def _throttled(self, service: str) -> None:
        """S3 or SQS asked to slow down (`Clients.watch_throttling`, the data path's 503s):
        counted, and auto holds fewer messages for a while (`InFlightLimit.slow_down`)."""
        self.metrics.throttled.labels(service).inc()
        before = self.limit.value
        if self.limit.slow_down() is not None:
            self._limit_changed(before, "throttled")

    def _limit_changed(self, before: int, reason: str) -> None:
        self.metrics.in_flight_limit.set(self.limit.value)
        log.info(
            Event.IN_FLIGHT_LIMIT_CHANGED,
            extra={
                "from": before,
                "to": self.limit.value,
                "reason": reason,
                "io_ms": round(1000 * (self.limit.io_s.value or 0.0), 1),
                "compute_ms": round(1000 * (self.limit.compute_s.value or 0.0), 1),
                "receive_ms": round(1000 * (self.limit.receive_s.value or 0.0), 1),
            },
        )

    def _finished(self, task: asyncio.Task[Outcome]) -> None:
        held = self.held.pop(task, None)
        if held is not None and self.keeper is not None:
            self.keeper.discard(held.message)
        ended = not task.cancelled() and task.exception() is None
        if ended and task.result() == Outcome.RELEASED:
            self.taken -= 1  # handed back unstarted: another pod's task, not this one's
        self._last_activity = time.monotonic()
        self.metrics.in_flight.set(self.working())
        self._wake.set()

    def _expire(self, message: Message) -> None:
        for task, held in self.held.items():
            if held.message is message and not held.releasing:  # (being handed back)
                held.expired = True
                task.cancel()

    def _release(self, tasks: list[asyncio.Task[Outcome]]) -> None:
        """Cancel these tasks so that their messages are handed back (visibility 0)."""
        loop = asyncio.get_running_loop()
        for task in tasks:
            self.held[task].releasing = True
            # After the task's first step, never before: a task cancelled before it ran
            # would end without reaching the code that hands its message back.
            loop.call_soon(task.cancel)

    def _waiting_for_process(self) -> list[asyncio.Task[Outcome]]:
        """Held messages whose work has not started, but for a link being waited on (it
        needs no process)."""
        return [
            task
            for task, held in self.held.items()
            if not held.started and not held.releasing and held.step != Step.LINK_WAIT
        ]

    def _pool_changed(self) -> None:
        """The pool lost a process or got one back: act on a stall at once, whatever
        the main loop is waiting on."""
        if self.pool.stalled and self.ready and not self.draining:
            self._pause()
        self._wake.set()

    def _pause(self) -> None:
        """No process can start: hand back what waits for one (other pods take it)."""
        waiting = self._waiting_for_process()
        if not self.paused:
            self.paused = True
            log.warning(
                Event.RECEIVING_PAUSED,
                extra={"releasing": len(waiting), "error": self.pool.last_error},
            )
        self._release(waiting)

    def _resume(self) -> None:
        if self.paused:
            self.paused = False
            self._last_activity = time.monotonic()  # paused is not idle: it received nothing
            log.info(Event.RECEIVING_RESUMED, extra={"processes": self.pool.ready_count})

    async def _wait_for_wake(self, timeout_s: float) -> None:
        self._wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout_s)

    # -- shutdown ---------------------------------------------------------------------
    async def shutdown(self, pipeline: Pipeline) -> None:
        self._shutdown_at = time.monotonic()
        self.ready = False
        self.draining = True
        self.pool.stop_restarting()
        unstarted = [t for t, h in self.held.items() if not h.started and not h.releasing]
        log.info(
            Event.DRAINING,
            extra={
                "in_flight": len(self.held),
                "releasing": len(unstarted),
                "deadline_s": self.settings.drain_deadline_s,
            },
        )
        self._release(unstarted)  # each waits for the pending receive before it goes
        await asyncio.gather(
            self._drain(pipeline.queue), self._end_last_receive(pipeline), self._cost_low()
        )
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if pipeline.next_stage is not None:
            await pipeline.next_stage.drain()
        await pipeline.queue.drain()
        log.info(Event.STOPPED, extra={"outcomes": dict(self.metrics.outcomes)})

    async def _cost_low(self) -> None:
        if self.deletion_cost is not None:
            await self.deletion_cost.lowest()

    async def _drain(self, queue: SqsQueue) -> None:
        deadline = time.monotonic() + self.settings.drain_deadline_s
        while self.held and not self.force_exit and time.monotonic() < deadline:
            await self._wait_for_wake(min(_IDLE_TICK_S, deadline - time.monotonic()))
        # A message already being handed back is never cancelled again: it would stay held.
        late = [
            t
            for t, h in self.held.items()
            if not h.releasing
            and h.step != Step.RELEASING
            and (h.step not in FINISHING_STEPS or self.force_exit)
        ]
        if late:
            log.warning(
                Event.DRAIN_DEADLINE_PASSED,
                extra={"tasks": len(late), "forced": self.force_exit},
            )
        for task in late:
            task.cancel()
        # Hand-backs wait for the pending receive (bounded by `_end_last_receive`); the
        # grace below starts once they may go.
        await self._receive_ended()
        # Commits, links and DLQ copies under way are short: let them land, not redo them.
        pending = list(self.held)
        if pending:
            limit = config.FORCED_RELEASE_S if self.force_exit else config.COMMIT_GRACE_S
            _, still = await asyncio.wait(pending, timeout=limit)
            queue.hurry()  # hand-backs still waiting on a stalled extension go now
            for task in still:
                if self.held[task].step != Step.RELEASING:
                    task.cancel()
            if still:
                await asyncio.wait(still, timeout=config.FORCED_RELEASE_S)

    async def _close_traces(self) -> None:
        """Export the last spans (every task's is ended by now), within the shutdown budget."""
        if not self.tracer.enabled:
            return
        timeout_s = FLUSH_S  # less when the shutdown budget has less left
        if self._shutdown_at is not None:
            spent_s = time.monotonic() - self._shutdown_at
            timeout_s = min(timeout_s, self.settings.shutdown_budget_s - spent_s)
        if timeout_s <= 0 or not await asyncio.to_thread(self.tracer.shutdown, timeout_s):
            log.warning(Event.TRACES_NOT_FLUSHED, extra={"timeout_s": round(timeout_s, 3)})

    async def _end_last_receive(self, pipeline: Pipeline) -> None:
        """Let the long poll pending at shutdown end (within its wait), then release what
        it brought. A second signal, or an answer later than its wait allows, abandons it:
        what SQS handed out then comes back when its visibility lapses."""
        receiving = self._receiving
        if receiving is None:
            return
        if not receiving.done():
            wait_s = self.settings.wait_time_s + config.LAST_RECEIVE_GRACE_S
            ends_at = self._receive_sent_at + wait_s
            forced = asyncio.create_task(self._forced.wait())
            await asyncio.wait(
                {receiving, forced},
                timeout=max(0.0, ends_at - time.monotonic()),
                return_when=asyncio.FIRST_COMPLETED,
            )
            forced.cancel()
        if not receiving.done() or receiving.cancelled():
            receiving.cancel()
            await asyncio.gather(receiving, return_exceptions=True)
            log.debug(Event.LAST_RECEIVE_ABANDONED, extra={"forced": self.force_exit})
            return
        try:
            messages = receiving.result()
        except Exception as exc:  # nothing was handed out, or nothing that can be named
            log.warning(Event.RECEIVE_FAILED, extra={"error": str(exc)})
            return
        if messages:
            log.info(Event.LAST_RECEIVE_RELEASED, extra={"messages": len(messages)})
            spent_s = time.monotonic() - self._receive_sent_at
            self.tracer.received(pipeline.queue.url, spent_s, messages)
            await asyncio.gather(*(pipeline.release(Held(m)) for m in messages))

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
        if self.pool.stalled:
            return False, f"no inference process can start: {self.pool.last_error}"
        if not self.last_receive_ok:
            return False, "last receive failed"
        return True, ""

    def metrics_text(self, openmetrics_format: bool = False) -> bytes:
        return self.metrics.render(openmetrics_format)


def worker_tracer(settings: config.Settings) -> Tracer:
    """The worker's tracer: OpenTelemetry's variables (OTEL_*) decide; `tracing.OFF`
    without the otel extra. A bad variable raises an ExternalConfigError naming it."""
    return tracing.from_env(service_instance=settings.worker_id, component="worker")


async def run_worker(
    settings: config.Settings, *, signals: bool = True, early: EarlySignals | None = None
) -> Worker:
    """Serve until stopped; `early` holds a signal that came before the loop's handlers."""
    worker = Worker(settings)
    if signals:
        worker.install_signal_handlers()
    if early is not None and early.received is not None:
        worker._on_signal(early.received)
    await worker.serve()
    return worker
