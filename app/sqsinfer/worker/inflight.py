"""The in-flight limit: how many messages may hold a slot of the worker at once.

The one home of its arithmetic, which the worker, `sqsinfer plan`, the bench and the
chart's helpers (`sqsinfer.inFlight`, a test keeps them equal) follow:

- pinned (`prefetch` N): processes × N, always;
- auto: it starts at processes × min(`AUTO_START_PREFETCH`, max_prefetch) and is then
  sized from measured times (`InFlightLimit.observe_task`), never above processes ×
  max_prefetch (what /dev/shm and the connection pools are sized for).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from sqsinfer import config, shm
from sqsinfer.limits import SQS_BATCH_MAX

AUTO_START_PREFETCH = 2  # auto's limit per process until the first tasks are measured


def starting(processes: int, prefetch: int | str, max_prefetch: int) -> int:
    """Messages held at start: pinned, or auto's starting point (at most its maximum)."""
    if isinstance(prefetch, int):
        return processes * prefetch
    return processes * min(AUTO_START_PREFETCH, max_prefetch)


def most(processes: int, prefetch: int | str, max_prefetch: int) -> int:
    """The most the limit can become: the pinned prefetch, or max_prefetch when auto."""
    if isinstance(prefetch, int):
        return processes * prefetch
    return processes * max_prefetch


# A receive is worth its call once this share of the limit is free (and at least one,
# at most a full batch): fewer calls than one per freed slot, no process left waiting.
RECEIVE_SHARE = 0.25


def receive_batch(limit: int) -> int:
    """The free slots that make a receive worth its call, under an in-flight `limit`."""
    return max(1, min(SQS_BATCH_MAX, math.ceil(limit * RECEIVE_SHARE)))


LIMIT_ALPHA = 0.05  # the averages behind the auto limit follow about the last 20 tasks


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
    (processes × max_prefetch, and what /dev/shm can hold at max_input_bytes each).
    """

    processes: int
    value: int
    auto: bool
    ceiling: int
    io_s: Ema = dataclasses.field(default_factory=lambda: Ema(LIMIT_ALPHA))
    compute_s: Ema = dataclasses.field(default_factory=lambda: Ema(LIMIT_ALPHA))
    receive_s: Ema = dataclasses.field(default_factory=lambda: Ema(LIMIT_ALPHA))
    samples: int = 0

    # Above the law's average, because the averages hide a spread and the count dips
    # between receives (a receive waits for a quarter of the limit to be free). Measured
    # with `sqsinfer bench` at medium, 3 paired runs: 1.2 settled at 5 in flight, the
    # processes busy 0.82; 2.0 settled at 9, busy 0.89, +7 to +11 % tasks/s in each pair.
    HEADROOM = 2.0

    @classmethod
    def from_settings(cls, s: config.Settings, shm_dir: str = shm.SHM_DIR) -> InFlightLimit:
        auto = s.prefetch == config.AUTO
        ceiling = most(s.processes, s.prefetch, s.max_prefetch)
        if auto:  # below processes, start-up refuses it (preflight.check_shared_memory)
            slots = shm_slots(s.max_input_bytes, s.processes, shm_dir)
            ceiling = max(s.processes, min(ceiling, slots))
        first = starting(s.processes, s.prefetch, s.max_prefetch)
        return cls(s.processes, min(first, ceiling), auto, ceiling)

    @property
    def receive_batch(self) -> int:
        """The free slots that make a receive worth its call."""
        return receive_batch(self.value)

    def observe_receive(self, seconds: float) -> None:
        self.receive_s.add(seconds)

    def observe_task(self, io_s: float, compute_s: float) -> int | None:
        """Note one message's I/O and compute time; the new limit when it changes."""
        io, compute = self.io_s.add(io_s), self.compute_s.add(compute_s)
        self.samples += 1
        if not self.auto or self.samples < self.processes * 2 or compute <= 0:
            return None
        wanted = self.processes * (1 + (io + (self.receive_s.value or 0.0)) / compute)
        wanted = min(float(self.ceiling), max(float(self.processes), wanted * self.HEADROOM))
        if abs(wanted - self.value) < 1.0:  # hysteresis: no change for noise around it
            return None
        self.value = round(wanted)
        return self.value


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
