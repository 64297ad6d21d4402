"""The in-flight limit: how many messages may hold a slot of the worker at once.

The one home of its arithmetic, which the worker, `sqsinfer plan`, the bench and the
chart's helpers (`sqsinfer.inFlight`, a test keeps them equal) follow:

- pinned (`prefetch` N): processes × N, always;
- auto: it starts at processes × min(`AUTO_START_PREFETCH`, max_prefetch) and is then
  sized from measured times (`InFlightLimit.observe_task`). Its ceiling is processes ×
  max_prefetch inputs of the largest size (`max_input_bytes`): what /dev/shm is sized
  for. Messages measured smaller hold less of it, and auto may then hold as many as that
  room takes at their measured size, up to processes × `AUTO_MOST_PREFETCH` (what the
  connection pools are sized for). A throttling answer halves it for a while
  (`InFlightLimit.slow_down`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

from sqsinfer import config, shm
from sqsinfer.limits import SQS_BATCH_MAX

AUTO_START_PREFETCH = 2  # auto's limit per process until the first tasks are measured
# Auto's most messages per process, when they are small: under S3's and SQS's latency (a
# GET, a PUT and a receive of tens of milliseconds each) a task of 25 ms of compute holds
# its slot about 200 ms, and Little's law wants 9 a process, 18 with the headroom; 8 left
# the processes idle a quarter of the time (docs/performance.md, "Under AWS latency").
AUTO_MOST_PREFETCH = 32


def starting(processes: int, prefetch: int | str, max_prefetch: int) -> int:
    """Messages held at start: pinned, or auto's starting point (at most its maximum)."""
    if isinstance(prefetch, int):
        return processes * prefetch
    return processes * min(AUTO_START_PREFETCH, max_prefetch)


def most(processes: int, prefetch: int | str, max_prefetch: int) -> int:
    """The most inputs of the largest size: the pinned prefetch, or max_prefetch when auto
    (what /dev/shm is sized for)."""
    if isinstance(prefetch, int):
        return processes * prefetch
    return processes * max_prefetch


def most_messages(processes: int, prefetch: int | str, max_prefetch: int) -> int:
    """The most the limit can become: the pinned prefetch, or, when auto, as many as
    small messages may reach (`AUTO_MOST_PREFETCH`, or max_prefetch if it is higher)."""
    if isinstance(prefetch, int):
        return processes * prefetch
    return processes * max(max_prefetch, AUTO_MOST_PREFETCH)


# A receive is worth its call once this share of the limit is free (and at least one,
# at most a full batch): fewer calls than one per freed slot, no process left waiting.
RECEIVE_SHARE = 0.25


def receive_batch(limit: int) -> int:
    """The free slots that make a receive worth its call, under an in-flight `limit`."""
    return max(1, min(SQS_BATCH_MAX, math.ceil(limit * RECEIVE_SHARE)))


LIMIT_ALPHA = 0.05  # the averages behind the auto limit follow about the last 20 tasks
# A message's measured bytes are an average; inputs vary around it, and /dev/shm must
# still hold those in flight when larger ones come together.
BYTES_HEADROOM = 1.5


@dataclass
class Ema:
    """An exponential moving average (None until the first sample)."""

    alpha: float
    value: float | None = None

    def add(self, sample: float) -> float:
        self.value = (
            sample if self.value is None else self.value + self.alpha * (sample - self.value)
        )
        return self.value


@dataclass
class InFlightLimit:
    """How many messages may hold a slot at once.

    Pinned (`prefetch` N: processes × N), or auto: Little's law. A slot is held for the
    message's I/O (its HEAD, GET, commit, and the receive that refills it) and for its
    compute; each process stays fed when processes × (1 + io / compute) messages hold
    slots. `HEADROOM` covers the spread around the averages. Bounded by `ceiling`
    (processes × max_prefetch, and what /dev/shm can hold at max_input_bytes each) until
    messages are measured; then by as many as `budget_bytes` (the ceiling's inputs at
    max_input_bytes each) holds at their measured bytes (input segment and output), never
    below `ceiling` nor above `most`.
    """

    processes: int
    value: int
    auto: bool
    ceiling: int
    most: int = 0  # the most messages (0: the ceiling)
    budget_bytes: int = 0  # /dev/shm's room for in-flight inputs (0: none measured by)
    message_bytes: Ema = dataclasses.field(default_factory=lambda: Ema(LIMIT_ALPHA))
    io_s: Ema = dataclasses.field(default_factory=lambda: Ema(LIMIT_ALPHA))
    compute_s: Ema = dataclasses.field(default_factory=lambda: Ema(LIMIT_ALPHA))
    receive_s: Ema = dataclasses.field(default_factory=lambda: Ema(LIMIT_ALPHA))
    samples: int = 0
    # When the limit last halved for throttling, and until when it may not grow.
    halved_at: float = -math.inf
    grows_after: float = -math.inf

    # Above the law's average, because the averages hide a spread and the count dips
    # between receives (a receive waits for a quarter of the limit to be free). Measured
    # with `sqsinfer bench` at medium, 3 paired runs: 1.2 settled at 5 in flight, the
    # processes busy 0.82; 2.0 settled at 9, busy 0.89, +7 to +11 % tasks/s in each pair.
    HEADROOM = 2.0
    # Throttled (S3's SlowDown, SQS's throttling), auto holds fewer messages, so that
    # fewer calls are made: the limit halves (at most once every `THROTTLE_HALVE_S`) and
    # grows again from measured times only `THROTTLE_QUIET_S` after the last throttling
    # answer. Until then the measured I/O holds the SDK's backoffs: growing on it would
    # keep up the rate of calls S3 asks to lower.
    THROTTLE_HALVE_S = 5.0
    THROTTLE_QUIET_S = 30.0

    @classmethod
    def from_settings(cls, s: config.Settings, shm_dir: str = shm.SHM_DIR) -> InFlightLimit:
        auto = s.prefetch == config.AUTO
        ceiling = most(s.processes, s.prefetch, s.max_prefetch)
        if auto:  # below processes, start-up refuses it (preflight.check_shared_memory)
            slots = shm_slots(s.max_input_bytes, s.processes, shm_dir)
            ceiling = max(s.processes, min(ceiling, slots))
        first = starting(s.processes, s.prefetch, s.max_prefetch)
        return cls(
            s.processes,
            min(first, ceiling),
            auto,
            ceiling,
            most=most_messages(s.processes, s.prefetch, s.max_prefetch) if auto else ceiling,
            budget_bytes=ceiling * shm.segment_bytes(s.max_input_bytes),
        )

    def __post_init__(self) -> None:
        self.most = max(self.most, self.ceiling)

    def bound(self) -> int:
        """The most messages now: the ceiling, or, once messages are measured smaller than
        the largest input, as many as the budget holds at their size (up to `most`)."""
        size = self.message_bytes.value
        if not self.auto or not size or self.budget_bytes <= 0:
            return self.ceiling
        fits = int(self.budget_bytes // (size * BYTES_HEADROOM))
        return max(self.ceiling, min(self.most, fits))

    @property
    def receive_batch(self) -> int:
        """The free slots that make a receive worth its call."""
        return receive_batch(self.value)

    def observe_receive(self, seconds: float) -> None:
        self.receive_s.add(seconds)

    def slow_down(self, now: float | None = None) -> int | None:
        """A throttling answer: auto halves its limit (never below one per process) and
        holds it; the new limit when it changes."""
        now = _now(now)
        if not self.auto:
            return None
        self.grows_after = now + self.THROTTLE_QUIET_S
        if now - self.halved_at < self.THROTTLE_HALVE_S:
            return None
        self.halved_at = now
        halved = max(self.processes, self.value // 2)
        if halved == self.value:
            return None
        self.value = halved
        return self.value

    def observe_task(
        self, io_s: float, compute_s: float, message_bytes: int = 0, now: float | None = None
    ) -> int | None:
        """Note one message's I/O and compute time, and the bytes it held (its input's
        segment and its output; 0: not known); the new limit when it changes."""
        io, compute = self.io_s.add(io_s), self.compute_s.add(compute_s)
        if message_bytes > 0:
            self.message_bytes.add(float(message_bytes))
        self.samples += 1
        if not self.auto or self.samples < self.processes * 2 or compute <= 0:
            return None
        wanted = self.processes * (1 + (io + (self.receive_s.value or 0.0)) / compute)
        wanted = min(float(self.bound()), max(float(self.processes), wanted * self.HEADROOM))
        if abs(wanted - self.value) < 1.0:  # hysteresis: no change for noise around it
            return None
        if wanted > self.value and self._throttled_lately(now):
            return None
        self.value = round(wanted)
        return self.value

    def _throttled_lately(self, now: float | None) -> bool:
        return _now(now) < self.grows_after


def _now(now: float | None) -> float:
    """The time given (a simulation's), else the monotonic clock's."""
    return time.monotonic() if now is None else now


def shm_need_bytes(inputs: int, processes: int, max_input_bytes: int) -> int:
    """The most /dev/shm takes: `inputs` of the largest size, each in a segment of whole
    MiB, beside the semaphores of the processes' executors."""
    return inputs * shm.segment_bytes(max_input_bytes) + processes * shm.SEMAPHORE_BYTES_PER_PROCESS


def shm_slots(max_input_bytes: int, processes: int, shm_dir: str = shm.SHM_DIR) -> int:
    """How many inputs of the largest size /dev/shm holds at once (a large number when
    it cannot be looked at)."""
    found = shm.room(shm_dir)
    if found is None:
        return 1 << 30
    free = found.total_bytes - shm_need_bytes(0, processes, max_input_bytes)
    return max(0, free // shm.segment_bytes(max_input_bytes))
