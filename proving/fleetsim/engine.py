"""The simulation: one event heap, pods that run the worker's own rules, one queue.

Granularity. An event is a process finishing a task (`_complete`); around it, what a
pod does at that moment is worked out in place, without events of its own: the slot's
release after the commit and the receive that refills it (its messages taken from the
queue now, stamped with the receive's latency), the GET of what it brought, the delete
and the next-stage send that join the pod's open batch calls, and the visibility
keeper's ticks that fell since the pod's last event (`_catch_up`: each tick judges every
held message by `visibility.due`, as the keeper does). Other events are rare: pods
ready, long polls that end empty, SIGKILLs, lapsed visibilities, KEDA's and the HPA's
periods, the samples. A message is an object only while a pod holds it (`Held`); on the
queue it is a count (never received) or its receive count (visible again), so 15.8 M
tasks make about 16 M events and as many short-lived objects, not 16 M long-lived ones.

What is left out, and why it changes nothing the outputs count: a kill that lands
between a task's commit and its delete (tens of milliseconds of each task's 21 s: the
task is then simply done); the delete's and send's own latency (they hold no slot);
extension calls that fail (the proving ground's chaos runs cover them); a task longer
than max_task_time_s (tasks are drawn well within it).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from proving.fleetsim.keda import Hpa, jobs_to_start
from proving.fleetsim.model import FleetConfig
from sqsinfer.aws.s3 import THROTTLE_BACKOFF, THROTTLE_ROUNDS
from sqsinfer.aws.sqs import LINGER_S, SEND_LINGER_S
from sqsinfer.limits import (
    S3_GET_PER_S_PER_PREFIX,
    S3_PUT_PER_S_PER_PREFIX,
    SQS_BATCH_MAX,
    SQS_FIFO_CALLS_PER_S,
)
from sqsinfer.ops.plan import Api, NextStage, delivery_requests
from sqsinfer.worker import chain, inflight, queue_depth
from sqsinfer.worker.lifecycle import idle_long_enough, receive_wait_s
from sqsinfer.worker.pipeline import looks_first
from sqsinfer.worker.visibility import due

API = list(Api)
INDEX = {api: i for i, api in enumerate(API)}
# An extension holds the message from its call, a moment after its tick.
_CALL_AFTER_TICK_S = 1e-6


class Rate:
    """Requests per whole second against a limit (S3's per prefix, a FIFO queue's per
    action): `take` answers whether one more fits in the second of `t`."""

    def __init__(self, per_s: int) -> None:
        self.per_s = per_s
        self.second = -1
        self.count = 0
        self.other: dict[int, int] = {}  # seconds other than the current one

    def take(self, t: float) -> bool:
        second = int(t)
        if second > self.second:  # a new current second
            if self.second >= 0:
                self.other[self.second] = self.count
            self.second, self.count = second, self.other.pop(second, 0)
        if second == self.second:
            if self.count < self.per_s:
                self.count += 1
                return True
            return False
        taken = self.other.get(second, 0)
        if taken >= self.per_s:
            return False
        self.other[second] = taken + 1
        return True

    def forget_before(self, t: float) -> None:
        for second in [s for s in self.other if s < t - 1]:
            del self.other[second]


LOOKED, RAN = 1, 2


class Held:
    """One delivery of a message, while a pod holds it."""

    __slots__ = (
        "count",
        "hold_until",
        "looked",
        "proc",
        "ran",
        "ready_at",
        "received_at",
        "started_at",
    )

    def __init__(self, count: int, received_at: float, ready_at: float, flags: int) -> None:
        self.count = count  # its receive count: 1 on its first delivery
        self.looked = bool(flags & LOOKED)  # it HEADs its output first (`pipeline.looks_first`)
        self.ran = bool(flags & RAN)  # a run of its task had started before this delivery
        self.received_at = received_at
        self.hold_until = received_at  # the keeper's: set at the receive (`_deliver`)
        self.ready_at = ready_at  # its input fetched
        self.started_at = 0.0
        self.proc = -1


STARTING, READY, DRAINING, GONE = range(4)
# What a receive of k messages never received before brings (read, never changed).
_NEVER_RECEIVED = [[0] * k for k in range(SQS_BATCH_MAX + 1)]


class Pod:
    __slots__ = (
        "batch",
        "created_at",
        "delete_n",
        "delete_until",
        "gone_at",
        "held",
        "idle",
        "last_activity",
        "limit",
        "name",
        "next_tick",
        "polling",
        "procs",
        "ready_at",
        "send_n",
        "send_until",
        "state",
        "taken",
        "waiting",
    )

    def __init__(
        self, name: int, created_at: float, processes: int, limit: inflight.InFlightLimit
    ) -> None:
        self.name = name
        self.created_at = created_at
        self.ready_at = math.inf
        self.gone_at = math.inf
        self.state = STARTING
        self.procs: list[Held | None] = [None] * processes
        self.idle = list(range(processes))  # processes with nothing to do
        self.waiting: collections.deque[Held] = collections.deque()
        self.held = 0  # messages holding a slot
        self.limit = limit
        self.batch = limit.receive_batch
        self.next_tick = math.inf
        self.polling = 0  # >0: a long poll is open (its number, to tell a stale end)
        # When it last received a message or ended a task (exit_when_idle_s), and the
        # messages it took (max_tasks).
        self.last_activity = created_at
        self.taken = 0
        self.delete_until = self.send_until = -1.0
        self.delete_n = self.send_n = 0


class Queue:
    """The stage's queue, aggregated: messages never received are a count; those visible
    again are an int each, oldest first (SQS hands those out first too, mostly): their
    receive count × 2, plus 1 when a run of their task had started."""

    def __init__(self, tasks: int, max_receive_count: int, clock: Callable[[], float]) -> None:
        self.fresh = tasks
        self.clock = clock
        self.dead_at = 0.0  # when the last message went to the DLQ
        self.returned: collections.deque[int] = collections.deque()
        self.max_receive_count = max_receive_count
        self.dead_lettered = 0
        self.waiters: collections.deque[Pod] = collections.deque()

    @property
    def visible(self) -> int:
        return self.fresh + len(self.returned)

    def take(self, k: int) -> list[int]:
        """Up to `k` messages (as `returned` holds them). One received as often as the
        redrive policy allows goes to the DLQ instead (SQS moves it on that receive)."""
        if not self.returned and self.fresh >= k:
            self.fresh -= k
            return _NEVER_RECEIVED[k]
        got: list[int] = []
        while self.returned and len(got) < k:
            message = self.returned.popleft()
            if message // 2 >= self.max_receive_count:
                self.dead_lettered += 1
                self.dead_at = self.clock()
            else:
                got.append(message)
        n = min(k - len(got), self.fresh)
        if n:
            self.fresh -= n
            got += [0] * n
        return got


@dataclass
class Sample:
    at_s: float
    visible: int
    in_flight: int
    pods: int
    ready: int
    done: int


@dataclass
class Outcome:
    """What a run counted."""

    calls: list[float] = field(default_factory=lambda: [0.0] * len(API))
    done: int = 0
    lost: int = 0
    recomputed: int = 0  # runs of a task after one of it that had started
    wasted_s: float = 0.0  # process-seconds of those earlier runs
    scale_in_kills: int = 0  # started tasks cut by a scale-in's drain deadline
    kills: int = 0
    scale_ins: int = 0
    extensions: int = 0
    s3_slowdowns: int = 0
    sqs_throttled: int = 0
    peak_pods: int = 0
    last_task_at: float = 0.0
    ended_at: float = 0.0
    samples: list[Sample] = field(default_factory=list)


class Simulation:
    def __init__(
        self,
        cfg: FleetConfig,
        progress: Callable[[int], None] | None = None,
        sample_s: float = 60.0,
    ) -> None:
        self.cfg = cfg
        w = cfg.worker
        self.w = w
        self.progress = progress
        self.sample_s = sample_s
        self.rng = random.Random(cfg.seed)
        random.seed(cfg.seed)  # the package's backoff jitter draws from the global one
        self.times: Iterator[float] = cfg.times.draws(cfg.seed)
        self.queue = Queue(cfg.tasks, cfg.aws.max_receive_count, lambda: self.now)
        self.out = Outcome()
        self.events: list[tuple[float, int, Callable[[Any, Any], None], Any, Any]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.pods: list[Pod] = []
        self.names = itertools.count()
        self.hpa = Hpa(cfg.keda)
        self.replicas = 0
        self.last_active = 0.0
        self.expired = False
        self.expired_at = 0.0
        self.lapsing = 0  # messages that will be visible again
        self.stopped = False
        self.last_done_at = 0.0
        self.complete = self._complete  # bound once: one per task goes on the heap
        self.s3_get = Rate(S3_GET_PER_S_PER_PREFIX * cfg.aws.s3_prefixes)
        self.s3_put = Rate(S3_PUT_PER_S_PER_PREFIX * cfg.aws.s3_prefixes)
        self.fifo_sends = Rate(SQS_FIFO_CALLS_PER_S)
        # What one delivery asks of S3 and the next stage, `plan`'s own list: its HEAD
        # and GET before the work, its PUTs after it, its link's send.
        aws = cfg.aws
        latency = {Api.HEAD: aws.head_s, Api.GET: aws.get_s, Api.PUT: aws.put_s}
        self.fetch: dict[bool, list[tuple[int, float]]] = {}
        self.commit: dict[bool, list[tuple[int, float]]] = {}
        for looked in (False, True):
            asks = delivery_requests(w.next_stage, looked_first=looked)
            before = [a for a in (Api.HEAD, Api.GET) if a in asks]
            after = [a for a in (Api.PUT, Api.MARKER) if a in asks]
            self.fetch[looked] = [(INDEX[a], latency[a]) for a in before]
            self.commit[looked] = [(INDEX[a], aws.put_s) for a in after]
        self.sends = Api.SEND_NEXT in delivery_requests(w.next_stage, looked_first=False)
        self.send_s, self.get_s = aws.send_s, aws.get_s
        self.calls = self.out.calls

    # -- the event loop -----------------------------------------------------------------
    def at(self, t: float, fn: Callable[[Any, Any], None], a: Any = None, b: Any = None) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn, a, b))

    def run(self) -> Outcome:
        k = self.cfg.keda
        if k.mode == "job":
            self.at(0.0, self._job_poll)
        else:
            for _ in range(k.min_replicas):
                self._ready(self._new_pod(ready_at=0.0), None)
            self.replicas = k.min_replicas
            self.at(0.0, self._hpa_sync)
        self.at(self.cfg.aws.retention_s, self._expire)
        self.at(0.0, self._sample)
        events = self.events
        pop = heapq.heappop
        while not self.stopped:
            t, _, fn, a, b = pop(events)
            self.now = t
            fn(a, b)
        self.out.ended_at = self.now
        self.out.calls[INDEX[Api.ENQUEUE]] = self.cfg.tasks / SQS_BATCH_MAX  # not simulated
        for pod in self.pods:
            if pod.state != GONE:
                self._sampled(pod, self.now)
            pod.gone_at = min(pod.gone_at, self.now)
        self._sample("final")
        return self.out

    def _fleet_gone(self) -> bool:
        alive = [p for p in self.pods if p.state != GONE]
        if self.cfg.keda.mode == "job":
            return not alive
        floor = 0 if self.cfg.keda.scale_to_zero else self.cfg.keda.min_replicas
        return len(alive) <= floor and all(not p.held for p in alive)

    # -- a task -------------------------------------------------------------------------
    def _complete(self, pod: Pod, m: Held) -> None:
        i = m.proc
        if pod.procs[i] is not m:
            return  # killed, or cut by a drain deadline: the message went back
        now = self.now
        if pod.next_tick <= now:
            self._catch_up(pod, now)
        commit_s = self._commit(pod, m, now)
        self.out.done += 1
        self.last_done_at = max(self.last_done_at, now + commit_s)  # done once written
        pod.last_activity = now
        pod.procs[i] = None
        pod.held -= 1
        limit = pod.limit
        if limit.auto and limit.observe_task(self.get_s + commit_s, now - m.started_at, now=now):
            pod.batch = limit.receive_batch
        if pod.waiting:
            self._start(pod, i, pod.waiting.popleft(), now)
        else:
            pod.idle.append(i)
            if pod.state == DRAINING and not pod.held:
                self._gone(pod, now)
                return
        if pod.state == READY:
            self._receive(pod, now + commit_s)

    def _commit(self, pod: Pod, m: Held, now: float) -> float:
        """The output's PUT, then the link (the send, and a standard next queue's marker),
        then the delete; how long until the slot is free."""
        calls = self.calls
        commit_s = 0.0
        put = self.s3_put
        for api, latency_s in self.commit[m.looked]:
            calls[api] += 1
            t = now + commit_s
            if int(t) == put.second and put.count < put.per_s:
                put.count += 1
                commit_s += latency_s
            else:
                commit_s += self._s3(pod, put, t, latency_s)
        settle = now + commit_s
        if self.sends:
            self._send(pod, settle)
            settle += self.send_s
        # The delete joins the pod's open batch call, or opens one (LINGER_S, ten at most).
        if settle <= pod.delete_until and pod.delete_n < SQS_BATCH_MAX:
            pod.delete_n += 1
        else:
            calls[_DELETE] += 1
            pod.delete_until, pod.delete_n = settle + LINGER_S, 1
        return commit_s

    def _start(self, pod: Pod, i: int, m: Held, free_at: float) -> None:
        start = m.ready_at if m.ready_at > free_at else free_at
        if m.ran:
            self.out.recomputed += 1
        m.started_at = start
        m.proc = i
        pod.procs[i] = m
        heapq.heappush(
            self.events, (start + next(self.times), next(self.seq), self._complete, pod, m)
        )

    def _s3(self, pod: Pod, rate: Rate, t: float, latency_s: float) -> float:
        """How long one S3 request takes from `t`: its latency, and when S3 answers SlowDown
        (the prefix's rate spent for that second), the data path's backoff before it goes
        again, each SlowDown halving auto's limit as the worker's does. (obstore's own
        three quick retries are folded into the first wait.)"""
        waited = 0.0
        for rounds in range(THROTTLE_ROUNDS + 1):
            if rate.take(t + waited):
                return waited + latency_s
            self.out.s3_slowdowns += 1
            if pod.limit.slow_down(now=t + waited) is not None:
                pod.batch = pod.limit.receive_batch
            waited += THROTTLE_BACKOFF.delay_s(rounds)
        return waited + latency_s  # past the rounds: the worker would retry the message

    def _send(self, pod: Pod, at: float) -> None:
        """A next-stage send joins the pod's open SendMessageBatch, or opens one; a FIFO
        queue past its calls per second refuses it, and the link sends again after the
        chain's retry backoff."""
        if at <= pod.send_until and pod.send_n < SQS_BATCH_MAX:
            pod.send_n += 1
            return
        if self.w.next_stage == NextStage.FIFO:
            attempt = 0
            while not self.fifo_sends.take(at):
                self.out.sqs_throttled += 1
                at += chain.RETRY.delay_s(attempt)
                attempt += 1
        pod.send_until, pod.send_n = at + SEND_LINGER_S, 1
        self.calls[_SEND_NEXT] += 1

    # -- receiving ----------------------------------------------------------------------
    def _receive(self, pod: Pod, at: float) -> None:
        """The worker's main loop: receive while a receive batch of slots is free (and,
        with max_tasks, no more than it has left to take)."""
        max_tasks = self.w.max_tasks
        while not pod.polling:
            room, batch = pod.limit.value - pod.held, pod.batch
            if max_tasks:
                left = max_tasks - pod.taken
                room, batch = min(room, left), min(batch, left)
            if room <= 0 or room < batch:
                if max_tasks and pod.taken >= max_tasks and not pod.held:
                    self._gone(pod, at)  # took its max_tasks and ended them: it exits 0
                return
            k = room if room < SQS_BATCH_MAX else SQS_BATCH_MAX
            got = self.queue.take(k)
            if not got:
                self._long_poll(pod, at)
                return
            self.calls[_RECEIVE] += 1
            at += self.cfg.aws.receive_s
            self._deliver(pod, got, at)

    def _deliver(self, pod: Pod, messages: list[int], at: float) -> None:
        """Messages a receive brought at `at`: each makes its delivery's S3 requests up to
        its input (its HEAD first when it looks first), then waits for a process."""
        pod.last_activity = at
        pod.taken += len(messages)
        calls = self.calls
        hold_until = at + self.w.visibility_timeout_s
        always_head = self.w.always_head_output
        get = self.s3_get
        for message in messages:
            count = (message >> 1) + 1
            looked = looks_first(always_head, count)
            ready = at
            for api, latency_s in self.fetch[looked]:
                calls[api] += 1
                if int(ready) == get.second and get.count < get.per_s:
                    get.count += 1
                    ready += latency_s
                else:
                    ready += self._s3(pod, get, ready, latency_s)
            m = Held(count, at, ready, (message & 1) * RAN + looked * LOOKED)
            m.hold_until = hold_until
            pod.held += 1
            if pod.idle:
                self._start(pod, pod.idle.pop(), m, at)
            else:
                pod.waiting.append(m)

    def _long_poll(self, pod: Pod, at: float) -> None:
        """The queue is empty: a long poll, ended by a message visible again or by its
        wait (shortened, with exit_when_idle_s, to when the worker would be done)."""
        pod.polling = next(self.seq) + 1
        wait_s = receive_wait_s(
            int(self.w.wait_time_s), self.w.exit_when_idle_s, at - pod.last_activity, pod.held > 0
        )
        self.queue.waiters.append(pod)
        self.at(at + wait_s, self._poll_end, pod, pod.polling)

    def _poll_end(self, pod: Pod, token: int) -> None:
        if pod.polling != token:
            return
        pod.polling = 0
        self.out.calls[_RECEIVE_IDLE] += 1
        if pod.state != READY:
            return
        idle_s = self.now - pod.last_activity
        if not pod.held and idle_long_enough(self.w.exit_when_idle_s, True, idle_s):
            self._gone(pod, self.now)  # its worker exits 0: the Job is complete
            return
        self._catch_up(pod, self.now)
        self._receive(pod, self.now)

    def _wake_waiters(self) -> None:
        """Messages visible again end the open long polls, oldest first."""
        queue = self.queue
        while queue.waiters and queue.visible:
            pod = queue.waiters.popleft()
            if not pod.polling or pod.state != READY:
                continue
            k = min(SQS_BATCH_MAX, pod.limit.value - pod.held)
            got = queue.take(k) if k > 0 else []
            pod.polling = 0
            at = self.now + self.cfg.aws.receive_s
            if got:
                self.out.calls[_RECEIVE] += 1
                self._catch_up(pod, self.now)
                self._deliver(pod, got, at)
            self._receive(pod, at)

    def _visible_again(self, message: int, _: Any) -> None:
        self.lapsing -= 1
        if self.expired:
            return
        self.queue.returned.append(message)
        self._wake_waiters()

    def _back_on_queue(self, m: Held, at: float) -> None:
        """A held message goes back: visible again at `at` (its lapse, or at once when
        handed back), its receive count kept and whether a run of it had started."""
        self.lapsing += 1
        self.at(at, self._visible_again, m.count * 2 + int(m.ran))

    # -- the visibility keeper ----------------------------------------------------------
    def _catch_up(self, pod: Pod, now: float) -> None:
        """The keeper's ticks of this pod up to `now` (every heartbeat from its start)."""
        tick = pod.next_tick
        if tick > now:
            return
        hb = self.w.heartbeat_s
        if not pod.held:
            pod.next_tick = tick + hb * (math.floor((now - tick) / hb) + 1)
            return
        hold_s = self.w.visibility_timeout_s + _CALL_AFTER_TICK_S
        out = self.out
        while tick <= now:
            n = 0
            for m in itertools.chain(pod.procs, pod.waiting):
                if m is not None and m.received_at <= tick and due(m.hold_until, tick, hb):
                    m.hold_until = tick + hold_s
                    n += 1
            if n:
                out.calls[_EXTEND] += -(-n // SQS_BATCH_MAX)
                out.extensions += n
            tick += hb
        pod.next_tick = tick

    # -- pods ---------------------------------------------------------------------------
    def _limit(self) -> inflight.InFlightLimit:
        w = self.w
        ceiling = inflight.most(w.processes, w.prefetch, w.max_prefetch)
        first = inflight.starting(w.processes, w.prefetch, w.max_prefetch)
        return inflight.InFlightLimit(w.processes, first, isinstance(w.prefetch, str), ceiling)

    def _new_pod(self, ready_at: float | None = None) -> Pod:
        pod = Pod(next(self.names), self.now, self.w.processes, self._limit())
        self.pods.append(pod)
        if ready_at is None:
            ready_at = self.now + self.cfg.pods.start_s + self.cfg.pods.load_s
        self.at(ready_at, self._ready, pod)
        rate = self.cfg.pods.kills_per_hour
        if rate > 0:
            self.at(self.now + self.rng.expovariate(rate / 3600), self._kill, pod)
        alive = sum(1 for p in self.pods if p.state != GONE)
        self.out.peak_pods = max(self.out.peak_pods, alive)
        return pod

    def _ready(self, pod: Pod, _: Any) -> None:
        if pod.state != STARTING:
            return
        pod.state = READY
        pod.ready_at = self.now
        pod.next_tick = self.now + self.w.heartbeat_s
        self._receive(pod, self.now)

    def _gone(self, pod: Pod, at: float) -> None:
        pod.state = GONE
        pod.gone_at = at
        pod.polling = 0
        self._sampled(pod, at)

    def _sampled(self, pod: Pod, until: float) -> None:
        """Its reads of the queues' depth: one of each queue every queue_sample_s, from
        its start (`worker.queue_depth`)."""
        every_s = self.w.queue_sample_s
        if every_s > 0 and until > pod.ready_at:
            samples = math.ceil((until - pod.ready_at) / every_s)
            self.calls[_DEPTH] += samples * len(queue_depth.SAMPLED)

    def _release(self, pod: Pod, m: Held) -> None:
        """Handed back with visibility 0 (a drain): visible again at once."""
        pod.held -= 1
        pod.taken -= 0 if m.started_at else 1  # unstarted: not counted by max_tasks
        self._back_on_queue(m, self.now)

    def _kill(self, pod: Pod, _: Any) -> None:
        """SIGKILL: whatever the pod holds comes back when its visibility lapses; the work
        under way is lost. The ReplicaSet (or the Job) makes a new pod at once."""
        if pod.state == GONE:
            return
        self.out.kills += 1
        self._catch_up(pod, self.now)
        for m in pod.procs:
            if m is not None:  # its work so far is lost
                self.out.wasted_s += max(0.0, self.now - m.started_at)
                m.ran = True
        for m in itertools.chain(pod.procs, pod.waiting):
            if m is not None:
                self._back_on_queue(m, max(self.now, m.hold_until))
        pod.procs = [None] * len(pod.procs)
        pod.waiting.clear()
        pod.held = 0
        was = pod.state
        self._gone(pod, self.now)
        if was != DRAINING:
            self._new_pod()

    # -- scaling ------------------------------------------------------------------------
    def _metric(self) -> float:
        visible = self.queue.visible
        if self.cfg.keda.scale_on_in_flight:
            visible += sum(p.held for p in self.pods if p.state != GONE)
        return visible

    def _hpa_sync(self, *_: Any) -> None:
        k = self.cfg.keda
        metric = self._metric()
        if metric > k.activation:
            self.last_active = self.now
        current = self._serving()
        if (
            k.scale_to_zero
            and metric <= k.activation
            and self.now - self.last_active >= k.cooldown_s
        ):
            self._scale_to(0)
        elif current == 0 and metric <= k.activation:
            pass  # KEDA keeps a stage at zero until the queue is active
        else:
            self._scale_to(self.hpa.replicas(self.now, max(current, 1), metric))
        self.at(self.now + k.hpa_sync_s, self._hpa_sync)

    def _done(self) -> bool:
        return self.out.done + self.out.lost + self.queue.dead_lettered >= self.cfg.tasks

    def _serving(self) -> int:
        return sum(1 for p in self.pods if p.state in (STARTING, READY))

    def _scale_to(self, replicas: int) -> None:
        serving = [p for p in self.pods if p.state in (STARTING, READY)]
        for _ in range(replicas - len(serving)):
            self._new_pod()
        if replicas >= len(serving):
            return

        # The ReplicaSet deletes pods not ready first, then (with pod_deletion_cost) the
        # idle ones, then the most recently ready.
        def order(pod: Pod) -> tuple[bool, bool, float]:
            busy = self.w.pod_deletion_cost and pod.held > 0
            return (pod.state == READY, busy, -pod.ready_at)

        for pod in sorted(serving, key=order)[: len(serving) - replicas]:
            self._drain(pod)

    def _drain(self, pod: Pod) -> None:
        """SIGTERM: stop receiving, hand back what has not started, let the started tasks
        finish until the drain deadline."""
        self.out.scale_ins += 1
        if pod.state == STARTING:
            self._gone(pod, self.now)
            return
        self._catch_up(pod, self.now)
        pod.state = DRAINING
        if pod.polling:  # its long poll ends empty; what it holds is handed back
            self.out.calls[_RECEIVE_IDLE] += 1
            pod.polling = 0
        while pod.waiting:
            self._release(pod, pod.waiting.popleft())
        if not pod.held:
            self._gone(pod, self.now)
            return
        self.at(self.now + self.w.drain_s, self._drain_deadline, pod)

    def _drain_deadline(self, pod: Pod, _: Any) -> None:
        if pod.state != DRAINING:
            return
        for i, m in enumerate(pod.procs):
            if m is not None:  # cancelled: handed back, its work lost
                self.out.scale_in_kills += 1
                self.out.wasted_s += self.now - m.started_at
                m.ran = True
                pod.procs[i] = None
                self._release(pod, m)
        self._gone(pod, self.now)

    def _job_poll(self, *_: Any) -> None:
        k = self.cfg.keda
        running = sum(1 for p in self.pods if p.state != GONE)
        for _job in range(jobs_to_start(k, self._metric(), running)):
            self._new_pod()
        if not self._done():
            self.at(self.now + k.polling_interval_s, self._job_poll)

    def _expire(self, *_: Any) -> None:
        """The retention period ends: what waits on the queue, visible or to be visible
        again, is gone. (What a pod holds still gets its output: only its delete fails.)"""
        q = self.queue
        self.expired = True
        self.expired_at = self.now
        self.out.lost += q.visible + self.lapsing
        q.fresh = 0
        q.returned.clear()

    def _sample(self, final: Any = None, _: Any = None) -> None:
        alive = [p for p in self.pods if p.state != GONE]
        self.out.samples.append(
            Sample(
                self.now,
                self.queue.visible,
                sum(p.held for p in alive),
                len(alive),
                sum(1 for p in alive if p.state == READY),
                self.out.done,
            )
        )
        self.out.peak_pods = max(self.out.peak_pods, len(alive))
        self.s3_get.forget_before(self.now)
        self.s3_put.forget_before(self.now)
        self.fifo_sends.forget_before(self.now)
        if self.progress is not None:
            self.progress(self.out.done)
        if final is None:
            self._stop_when_over()
            self.at(self.now + self.sample_s, self._sample)

    def _stop_when_over(self) -> None:
        """Every task settled (done, dead-lettered, lost): note when; stop once the fleet
        has scaled in (or it has been followed `tail_limit_s`)."""
        if not self._done():
            return
        out = self.out
        if not out.last_task_at:
            out.last_task_at = max(self.last_done_at, self.queue.dead_at, self.expired_at)
        if self._fleet_gone() or self.now > out.last_task_at + self.cfg.tail_limit_s:
            self.stopped = True


_RECEIVE, _RECEIVE_IDLE, _DELETE, _EXTEND, _SEND_NEXT, _DEPTH = (
    INDEX[a]
    for a in (Api.RECEIVE, Api.RECEIVE_IDLE, Api.DELETE, Api.EXTEND, Api.SEND_NEXT, Api.DEPTH)
)
