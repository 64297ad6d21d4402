"""One backoff schedule for every retry in the project.

    delay(attempt) = min(max_s, base_s × 2^attempt) × uniform(1 − jitter, 1)

`attempt` counts from 0 (the first retry waits about `base_s`). The jitter only ever
shortens a delay, so `max_s` is a true ceiling, and it spreads the retries of many
workers that failed together (an endpoint restart) instead of having them return in
step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

JITTER = 0.2


def delay_s(attempt: int, base_s: float, max_s: float, *, jitter: float = JITTER) -> float:
    """How long to wait before retry number `attempt` (0-based)."""
    exponent = min(max(0, attempt), 62)  # past the cap anyway; keeps 2**n an exact float
    return min(max_s, base_s * 2.0**exponent) * random.uniform(1.0 - jitter, 1.0)


def visibility_delay_s(receive_count: int, base_s: float, max_s: float) -> int:
    """The visibility a retried message is handed back with, in whole seconds (SQS's
    unit, at least 1): the schedule's delay for its receive count (1 on its first)."""
    return max(1, int(delay_s(receive_count - 1, base_s, max_s)))


@dataclass(frozen=True)
class Backoff:
    """A named schedule: `base_s` doubling per attempt up to `max_s`."""

    base_s: float
    max_s: float

    def delay_s(self, attempt: int) -> float:
        return delay_s(attempt, self.base_s, self.max_s)
