"""The one backoff schedule: doubling, capped, jitter that only shortens."""

from __future__ import annotations

import pytest

from sqsinfer import backoff


@pytest.mark.parametrize("attempt", [0, 1, 2, 5, 10, 100, 10_000])
def test_a_delay_lies_between_its_jittered_floor_and_its_ceiling(attempt: int) -> None:
    ceiling = min(20.0, 0.5 * 2 ** min(attempt, 100))
    for _ in range(200):
        delay = backoff.delay_s(attempt, 0.5, 20.0)
        assert ceiling * (1 - backoff.JITTER) <= delay <= ceiling


def test_delays_double_until_the_cap() -> None:
    schedule = backoff.Backoff(base_s=1.0, max_s=8.0)
    upper = [max(schedule.delay_s(n) for _ in range(300)) for n in range(6)]
    assert [round(u) for u in upper] == [1, 2, 4, 8, 8, 8]


def test_a_negative_attempt_waits_the_base() -> None:
    assert 0.8 <= backoff.delay_s(-3, 1.0, 10.0) <= 1.0
