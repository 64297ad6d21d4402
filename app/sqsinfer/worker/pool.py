"""The inference pool: one spawned process per slot, each with the model loaded once.

Why slots and not one `ProcessPoolExecutor(max_workers=N)`: when any child of a shared
executor dies (OOM kill, segfault in native code), the executor fails *every* pending
future with `BrokenProcessPool`, including tasks running on healthy children. Here each
slot is a single-process executor, so a crash costs only the task that caused it; the
slot is restarted in the background while the other slots keep working.

Processes are always started with the *spawn* method: native ML libraries hold thread
pools and locks that a forked child inherits without the threads, and hangs on.

Small tasks are coalesced (`compute`): when several are waiting for a process, the next
process that becomes free takes them together (all of them, or its even share when other
processes are free too; never waiting for more), decodes each input on its own, scores
their rows in one predict call and encodes each output on its own (`inference.run_batch`).
A predict call costs a fixed part (XGBoost about 0.2 ms) and a task's handing over and
back another; a task of tens of rows pays several times its own compute in them, and
shares them when coalesced. Each task still ends on its
own: a failure in the process is its task's, and a shared call that fails, or a process
that dies under several tasks, makes each of them run alone again, so that whatever
failed is told by its own task.

Nothing of a slot outlives the worker in /dev/shm: each executor's queues hold five
named semaphores (`sem.mp-*`) that its process opens by name when it starts; once it
has, the names are removed (the semaphores live on in both processes), so a SIGKILL of
the whole worker leaves none of them behind. Orphans: a process exits by itself as soon
as the worker is gone (`inference`), so an OOM kill of the worker alone leaves nothing
running either.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing
import os
import signal
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing import synchronize
from multiprocessing import util as mp_util
from typing import Any, TypeVar

from sqsinfer import lineage, procfs
from sqsinfer.backoff import Backoff
from sqsinfer.compute import inference
from sqsinfer.compute.errors import ModelLoadError
from sqsinfer.logs import Event
from sqsinfer.metrics import Metrics

log = logging.getLogger("sqsinfer.pool")
T = TypeVar("T")
# What a batch's runner never takes for a failure of its tasks: a cancel, and what stops
# the process.
NOT_FAILURES = (asyncio.CancelledError, KeyboardInterrupt, SystemExit)

_RESTART_BACKOFF = Backoff(base_s=1.0, max_s=30.0)
_SPAWN_ATTEMPTS = 3
# Restarts keep being tried, but after this many failures in a row (about 8 s) the pool
# is reported unusable on /livez, so the kubelet replaces the pod.
_UNUSABLE_AFTER = 3
# The most tasks one process takes at once: beyond tens of tasks a shared call gains
# nothing more (at 1,000 rows a task, 64 tasks are 64,000 rows, about 0.2 s of medium
# compute), and a batch's tasks all wait for the last of them.
MAX_BATCH_TASKS = 64
# An input larger than this many bytes per value of its rows cannot be small in any
# format (a float in text takes at most about 25 bytes with its separator, in .npy 8):
# it goes to a process alone, at once, as every task did before coalescing.
_SMALL_INPUT_BYTES_PER_VALUE = 32
_SMALL_INPUT_SLACK_BYTES = 64 << 10  # headers: .npy's, a CSV's column names, Parquet's footer


def _written(key: str, value: str, what: str) -> str:
    """What the handler reports for output metadata (`key`), refused when it cannot go there."""
    problem = lineage.value_problem(key, value)
    if problem:
        raise ModelLoadError(f"{what} goes into every output's metadata: {problem}")
    return value


class PoolCrashed(Exception):
    """The process running a task died; the task is retried, the slot restarted."""


class DeadOnArrival(Exception):
    """The process was found dead before the task reached it; nothing ran."""


@dataclass(frozen=True)
class PoolConfig:
    processes: int
    handler: str
    model_path: str
    threads: int
    model_sha256: str
    max_decoded_bytes: int
    model_output: str = ""  # by name, of a model of several ("": the handler's default)
    # Tasks of at most this many rows are coalesced when several wait for a process and
    # the handler allows it (`rows_independent`); 0: never.
    coalesce_max_rows: int = 0


@dataclass(eq=False)
class Slot:
    index: int
    executor: ProcessPoolExecutor | None = None
    pid: int = 0
    busy: bool = False
    generation: int = 0  # bumped by each restart, so a lease never returns a stale slot
    failures: int = 0
    restart_task: asyncio.Task[None] | None = field(default=None, repr=False)


@dataclass(eq=False)
class _Waiting:
    """A small task waiting for a process to take it with others."""

    job: inference.Job
    started: Callable[[], None]  # told when a process takes it
    future: asyncio.Future[dict[str, Any]]
    batch: list[_Waiting] | None = None  # once taken: the tasks it went with
    runner: asyncio.Task[None] | None = None  # and what waits for their process


class InferencePool:
    def __init__(self, config: PoolConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        self.context = multiprocessing.get_context("spawn")
        self.slots = [Slot(i) for i in range(config.processes)]
        # Entries carry the slot's generation: a slot lost and restarted is queued anew,
        # and the entry from before the loss is recognised as stale and dropped.
        self._free: asyncio.Queue[tuple[Slot, int]] = asyncio.Queue()
        self._closing = False
        self.startup_s = 0.0
        self.last_error = ""
        # What the loaded handler reports as its version, and the model output it serves
        # ("" when the model has one), for output metadata.
        self.handler_version = ""
        self.model_output = ""
        # Told when a restart fails or succeeds: the worker acts on `stalled` at once.
        self.on_change: Callable[[], None] | None = None
        # Coalescing: on once the processes say their handler allows it (`start`).
        self.coalesce_max_rows = 0
        self.small_input_bytes = 0
        self._waiting: deque[_Waiting] = deque()
        self._dispatcher: asyncio.Task[None] | None = None
        self._runners: set[asyncio.Task[None]] = set()

    # -- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn every process, load the model and make one prediction in each.

        Raises `ModelLoadError` (or whatever the initializer raised) when a
        process cannot load the model: start-up must stop, not limp on.
        """
        started = time.perf_counter()
        results = await asyncio.gather(
            *(self._spawn(slot) for slot in self.slots), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            raise errors[0]
        self.startup_s = time.perf_counter() - started
        for slot in self.slots:
            self._free.put_nowait((slot, slot.generation))
        self._update_ready()

    async def _spawn(self, slot: Slot) -> None:
        """Start a process for the slot; a process that dies while loading gets retries."""
        for attempt in range(1, _SPAWN_ATTEMPTS + 1):
            try:
                executor, info = await self._spawn_once()
            except BrokenProcessPool:
                log.warning(
                    Event.POOL_PROCESS_DIED_WHILE_LOADING,
                    extra={"slot": slot.index, "attempt": attempt},
                )
                continue
            slot.executor, slot.pid = executor, int(info["pid"])
            self._note_lineage(info)
            self._coalesce_if_allowed(info)
            break
        else:
            raise ModelLoadError(
                f"inference process died {_SPAWN_ATTEMPTS} times while loading "
                f"{self.config.model_path} (out of memory?)"
            )
        log.debug(
            Event.POOL_PROCESS_READY,
            extra={"slot": slot.index, "pid": slot.pid, "warmup_s": round(info["warmup_s"], 4)},
        )

    def _note_lineage(self, info: dict[str, Any]) -> None:
        """What a loaded process reports for output metadata: the handler's version and
        the model output it serves."""
        version = str(info.get("handler_version", ""))
        self.handler_version = _written(lineage.HANDLER_VERSION, version, "the handler's version")
        served = str(info.get("model_output", ""))
        what = "the name of the model output served"
        self.model_output = served and _written(lineage.MODEL_OUTPUT, served, what)

    async def _spawn_once(self) -> tuple[ProcessPoolExecutor, dict[str, Any]]:
        c = self.config
        executor = ProcessPoolExecutor(max_workers=1, mp_context=self.context)
        loop = asyncio.get_running_loop()
        try:
            # Any answer means the process is up and has opened the queues' semaphores.
            await loop.run_in_executor(executor, os.getpid)
            _unlink_semaphore_names(executor)
            start = functools.partial(inference.start_process, model_output=c.model_output)
            info = await loop.run_in_executor(
                executor,
                start,
                c.handler,
                c.model_path,
                c.threads,
                c.model_sha256,
                c.max_decoded_bytes,
            )
        except BaseException:
            executor.shutdown(wait=False, cancel_futures=True)
            raise
        return executor, info

    def _coalesce_if_allowed(self, info: dict[str, Any]) -> None:
        """Coalesce small tasks when the settings ask for it and the handler allows it."""
        max_rows = self.config.coalesce_max_rows
        if max_rows <= 0 or not info.get("rows_independent"):
            return
        self.coalesce_max_rows = max_rows
        values = max_rows * max(1, int(info.get("n_features", 1)))
        self.small_input_bytes = values * _SMALL_INPUT_BYTES_PER_VALUE + _SMALL_INPUT_SLACK_BYTES

    def stop_restarting(self) -> None:
        """From now on a lost process is not replaced (the worker is shutting down)."""
        self._closing = True

    async def close(self) -> None:
        """Stop every process. Idempotent."""
        self._closing = True
        for slot in self.slots:
            if slot.restart_task is not None:
                slot.restart_task.cancel()
        if self._dispatcher is not None:
            self._dispatcher.cancel()
        executors = [s.executor for s in self.slots if s.executor is not None]
        for slot in self.slots:
            if slot.busy:  # still running past the drain: nobody waits for its answer
                self._kill(slot)
            slot.executor = None
        loop = asyncio.get_running_loop()
        for executor in executors:
            await loop.run_in_executor(None, _shutdown_executor, executor)
        self._update_ready()

    # -- state ----------------------------------------------------------------------
    @property
    def ready_count(self) -> int:
        return sum(1 for s in self.slots if s.executor is not None)

    @property
    def stalled(self) -> bool:
        """No process is running and the last start of each failed: nothing received
        now could be computed until one comes back (restarts go on meanwhile)."""
        return (
            not self._closing and self.ready_count == 0 and all(s.failures > 0 for s in self.slots)
        )

    @property
    def usable(self) -> bool:
        """False once some process could not be restarted: the pod should be replaced."""
        return not self._closing and all(s.failures < _UNUSABLE_AFTER for s in self.slots)

    @property
    def waiting(self) -> int:
        """Small tasks waiting for a process to take them together."""
        return len(self._waiting)

    def pids(self) -> dict[int, int]:
        """Slot index -> pid of each live inference process."""
        return {s.index: s.pid for s in self.slots if s.executor is not None and s.pid}

    def _update_ready(self) -> None:
        self.metrics.processes_ready.set(self.ready_count)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # -- running tasks --------------------------------------------------------------
    async def _acquire(self) -> tuple[Slot, int]:
        """An idle slot whose process is alive, and the generation it was taken at."""
        while True:
            slot, generation = await self._free.get()
            if generation != slot.generation or slot.executor is None:
                continue  # a stale entry: the slot was lost and comes back by its restart
            if _alive(slot.pid):
                return slot, generation
            self._lost(slot, f"process {slot.index} pid={slot.pid} died while idle")

    def _release(self, slot: Slot, generation: int) -> None:
        if slot.generation == generation and slot.executor is not None and not self._closing:
            self._free.put_nowait((slot, generation))

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[Lease]:
        """Wait for an idle process and hold it for one task."""
        lease = Lease(self, *await self._acquire())
        try:
            yield lease
        finally:
            lease.release()

    # -- one task's compute, alone or with others -------------------------------------
    async def compute(self, job: inference.Job, started: Callable[[], None]) -> dict[str, Any]:
        """Decode, predict and encode one task's input in a process; `started` is told
        when a process takes it. The child's result, with `handoff_s`: the task's part of
        the time spent handing work over and back.

        A small task (its input within `small_input_bytes`) waiting for a process goes
        with the others waiting by the time one is free; any other, alone, as soon as a
        process is free.
        """
        if not self.coalesce_max_rows or job.size > self.small_input_bytes:
            return await self._alone(job, started)
        entry = _Waiting(job, started, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = asyncio.get_running_loop().create_task(self._dispatch())
        try:
            return await entry.future
        finally:
            if entry.batch is None:
                with contextlib.suppress(ValueError):
                    self._waiting.remove(entry)  # cancelled before a process took it
            elif entry.runner is not None and all(e.future.cancelled() for e in entry.batch):
                entry.runner.cancel()  # nobody waits for this batch: its process is killed

    async def _alone(self, job: inference.Job, started: Callable[[], None]) -> dict[str, Any]:
        async with self.lease() as lease:
            started()
            began = time.perf_counter()
            result: dict[str, Any] = await lease.run(inference.run_task, *job.args())
        self.metrics.tasks_per_predict.observe(1)
        return result | {"handoff_s": _handoff_share_s([result], time.perf_counter() - began)}

    async def _dispatch(self) -> None:
        """Hand each process that becomes free its share of the small tasks waiting by
        then: all of them, or with other processes idle too, an even part (so that a
        process does not take everything while another has nothing to do)."""
        while self._waiting:
            lease = Lease(self, *await self._acquire())
            idle = 1 + self._free.qsize()  # this one and those not taken yet
            share = min(-(-len(self._waiting) // idle), MAX_BATCH_TASKS)
            batch = [self._waiting.popleft() for _ in range(share)]
            if not batch:  # all cancelled while the process was awaited
                lease.release()
                continue
            runner = asyncio.get_running_loop().create_task(self._run_batch(lease, batch))
            self._runners.add(runner)
            runner.add_done_callback(self._runners.discard)
            for entry in batch:
                entry.batch, entry.runner = batch, runner
                entry.started()

    async def _run_batch(self, lease: Lease, batch: list[_Waiting]) -> None:
        """One call to the process for the batch; each task's result or failure to it."""
        jobs = [entry.job for entry in batch]
        began = time.perf_counter()
        try:
            found = await lease.run(inference.run_batch, jobs, self.coalesce_max_rows)
        except NOT_FAILURES:
            raise  # a cancel: every task of it was cancelled (and the process is killed)
        except BaseException as exc:  # a crash, or a batch that could not return
            lease.release()
            if len(batch) == 1:
                _settle(batch[0], exc)
            else:  # which task did it cannot be told: each runs alone
                await self._each_alone(batch, exc)
            return
        finally:
            lease.release()
        for tasks in found.predict_calls:
            self.metrics.tasks_per_predict.observe(tasks)
        share_s = _handoff_share_s(found.outcomes, time.perf_counter() - began)
        for entry, outcome in zip(batch, found.outcomes, strict=True):
            _settle(
                entry,
                outcome if isinstance(outcome, BaseException) else outcome | {"handoff_s": share_s},
            )

    async def _each_alone(self, batch: list[_Waiting], failure: BaseException) -> None:
        """After a process died under several tasks (or their batch failed as a whole):
        each task again, alone, so that only the one that does it again fails."""

        async def again(entry: _Waiting) -> None:
            if entry.future.done():
                return
            if self._closing:
                _settle(entry, failure)
                return
            try:
                _settle(entry, await self._alone(entry.job, lambda: None))
            except NOT_FAILURES:
                raise
            except BaseException as exc:  # this task's own
                _settle(entry, exc)

        await asyncio.gather(*(again(entry) for entry in batch))

    async def run(self, slot: Slot, fn: Callable[..., T], *args: Any) -> T:
        executor = slot.executor
        loop = asyncio.get_running_loop()
        try:
            if executor is None:
                raise BrokenProcessPool("the process is gone")
            future = loop.run_in_executor(executor, fn, *args)
        except (BrokenProcessPool, RuntimeError):
            # Died while idle (the executor refuses new work): nothing ran.
            if slot.executor is not None:
                self._lost(slot, f"process {slot.index} pid={slot.pid} died while idle")
            raise DeadOnArrival from None
        slot.busy = True
        try:
            return await future
        except BrokenProcessPool:
            self._lost(slot, f"process {slot.index} pid={slot.pid} died during a task")
            raise PoolCrashed(f"inference process pid={slot.pid} died") from None
        except asyncio.CancelledError:
            # Cancelling the await cancels the asyncio future too, but not the child.
            if future.cancelled() or not future.done():
                # The child cannot be interrupted; kill it so a stuck or abandoned task
                # does not hold the slot, and start a fresh one.
                self._kill(slot)
                self._lost(slot, f"process {slot.index} pid={slot.pid} killed: task cancelled")
            raise
        finally:
            slot.busy = False

    async def watch(self, interval_s: float = 2.0) -> None:
        """Notice processes that died while idle (an OOM kill picks any) and restart them."""
        while not self._closing:
            await asyncio.sleep(interval_s)
            for slot in self.slots:
                if not slot.busy and slot.executor is not None and not _alive(slot.pid):
                    self._lost(slot, f"process {slot.index} pid={slot.pid} died while idle")

    def _kill(self, slot: Slot) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(slot.pid, signal.SIGKILL)

    def _lost(self, slot: Slot, why: str) -> None:
        executor, slot.executor = slot.executor, None
        slot.generation += 1
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        self._update_ready()
        if self._closing:
            return
        log.warning(Event.POOL_PROCESS_LOST, extra={"slot": slot.index, "why": why})
        slot.restart_task = asyncio.get_running_loop().create_task(self._restart(slot))

    async def _restart(self, slot: Slot) -> None:
        started = time.perf_counter()
        while not self._closing:
            try:
                await self._spawn(slot)
            except Exception as exc:  # keep trying with backoff; /livez reports it
                self.last_error = str(exc)
                delay = _RESTART_BACKOFF.delay_s(slot.failures)
                slot.failures += 1
                log.error(
                    Event.POOL_PROCESS_RESTART_FAILED,
                    extra={"slot": slot.index, "error": str(exc), "retry_in_s": delay},
                )
                self._changed()
                await asyncio.sleep(delay)
                continue
            slot.failures = 0
            self.metrics.pool_rebuilds.inc()
            self._update_ready()
            self._free.put_nowait((slot, slot.generation))
            self._changed()
            restore_s = round(time.perf_counter() - started, 3)
            log.info(
                Event.POOL_PROCESS_RESTARTED,
                extra={"slot": slot.index, "pid": slot.pid, "restore_s": restore_s},
            )
            return


@dataclass(eq=False)
class Lease:
    pool: InferencePool
    slot: Slot
    generation: int
    released: bool = False

    def release(self) -> None:
        """Give the process back. Idempotent. A slot lost during the lease comes back
        through its restart instead."""
        if not self.released:
            self.released = True
            self.pool._release(self.slot, self.generation)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        while True:
            try:
                return await self.pool.run(self.slot, fn, *args)
            except DeadOnArrival:
                # Nothing ran; the dead process is restarting. Take another one.
                self.slot, self.generation = await self.pool._acquire()


def _handoff_share_s(outcomes: list[dict[str, Any] | BaseException], round_trip_s: float) -> float:
    """Each task's `handoff_s`: what the child did not account for of the call's round
    trip (handing the work over and the results back), in equal parts per task."""
    spent_s = sum(
        float(o["decode_s"] + o["infer_s"] + o["encode_s"]) for o in outcomes if isinstance(o, dict)
    )
    return max(0.0, round_trip_s - spent_s) / max(1, len(outcomes))


def _settle(entry: _Waiting, outcome: dict[str, Any] | BaseException) -> None:
    if entry.future.done():  # cancelled meanwhile: its result is dropped
        return
    if isinstance(outcome, BaseException):
        entry.future.set_exception(outcome)
    else:
        entry.future.set_result(outcome)


def _alive(pid: int) -> bool:
    """Alive and not a zombie: a process that died idle stays one until its executor
    reaps it, and must not be leased meanwhile."""
    return procfs.alive(pid)


def _semlocks(executor: ProcessPoolExecutor) -> Iterator[synchronize.SemLock]:
    """The semaphores of the executor's call and result queues."""
    for queue in (getattr(executor, "_call_queue", None), getattr(executor, "_result_queue", None)):
        for attr in ("_rlock", "_wlock", "_sem"):
            lock = getattr(queue, attr, None)
            if isinstance(lock, synchronize.SemLock):
                yield lock


def _unlink_semaphore_names(executor: ProcessPoolExecutor) -> None:
    """Remove the names of the executor's semaphores now that its one process has them.

    multiprocessing names each semaphore so that a spawned process can open it, and
    unlinks the name only when the semaphore is collected, or its resource tracker does
    at exit: a SIGKILL of the whole worker leaves them in /dev/shm for good, with nothing
    in the name to say whose they were. A single-process executor never starts another
    process, so the names serve no purpose once its process is up. This runs the
    finalizer multiprocessing registered for each (unlink, then unregister from the
    tracker) early. Should its internals change, the names are simply left as before.
    """
    names = {getattr(getattr(lock, "_semlock", None), "name", None) for lock in _semlocks(executor)}
    names.discard(None)
    cleanup = getattr(synchronize.SemLock, "_cleanup", None)
    registry: dict[Any, Any] = getattr(mp_util, "_finalizer_registry", {})
    if cleanup is None or not names:
        return
    for finalizer in list(registry.values()):
        args = getattr(finalizer, "_args", None) or (None,)
        if getattr(finalizer, "_callback", None) is cleanup and args[0] in names:
            finalizer()


def _shutdown_executor(executor: ProcessPoolExecutor) -> None:
    executor.shutdown(wait=True, cancel_futures=True)
