"""The in-flight limit: pinned, or sized by Little's law from measured times."""

from __future__ import annotations

import pytest

from sqsinfer.config import Settings
from sqsinfer.worker.lifecycle import InFlightLimit


def _auto(processes: int = 2, ceiling: int = 16) -> InFlightLimit:
    return InFlightLimit(processes, value=processes * 2, auto=True, ceiling=ceiling)


def _feed(limit: InFlightLimit, io_s: float, compute_s: float, times: int = 200) -> None:
    for _ in range(times):
        limit.observe_task(io_s, compute_s)


def test_auto_keeps_each_process_fed_through_the_io_of_its_messages():
    limit = _auto()
    limit.observe_receive(0.010)
    _feed(limit, io_s=0.040, compute_s=0.025)
    # 2 x (1 + (40 + 10) / 25) = 6 messages, with the headroom for the spread: 12
    assert limit.value == 12


def test_auto_comes_down_for_long_tasks_and_never_below_one_per_process():
    limit = _auto()
    _feed(limit, io_s=0.040, compute_s=2.0)
    assert limit.value == 4  # 2 x 1.02 x 2 = 4.08


def test_auto_stays_within_its_ceiling():
    limit = _auto(ceiling=10)
    _feed(limit, io_s=1.0, compute_s=0.001)
    assert limit.value == 10


def _budgeted(ceiling: int = 16, most: int = 64) -> InFlightLimit:
    # The ceiling's inputs at 64 MiB each: /dev/shm's room for in-flight inputs.
    limit = InFlightLimit(2, value=4, auto=True, ceiling=ceiling, most=most)
    limit.budget_bytes = ceiling * (64 << 20)
    return limit


def _feed_sized(limit: InFlightLimit, message_bytes: int, times: int = 200) -> None:
    for _ in range(times):
        limit.observe_task(1.0, 0.001, message_bytes)  # I/O bound: the limit wants its most


def test_auto_holds_more_small_messages_than_the_ceiling_up_to_its_most():
    limit = _budgeted()
    _feed_sized(limit, message_bytes=(1 << 20) + 40_000)  # a 1 MiB segment and its output
    assert limit.value == 64


def test_auto_holds_no_more_than_the_room_holds_at_the_measured_size():
    limit = _budgeted()
    _feed_sized(limit, message_bytes=24 << 20)
    # 16 x 64 MiB of room, 24 MiB a message with its headroom of 1.5: 28
    assert limit.value == 28


def test_messages_of_the_largest_size_keep_the_ceiling():
    limit = _budgeted()
    _feed_sized(limit, message_bytes=64 << 20)
    assert limit.value == 16


def test_a_change_smaller_than_one_message_is_noise_and_ignored():
    limit = _auto()
    limit.value = 11
    _feed(limit, io_s=0.042, compute_s=0.025)  # 2 x (1 + 42 / 25) x 2 = 10.7 wanted
    assert limit.value == 11


def test_a_pinned_limit_never_moves():
    limit = InFlightLimit(2, value=4, auto=False, ceiling=4)
    _feed(limit, io_s=1.0, compute_s=0.001)
    assert limit.value == 4


def test_throttling_halves_auto_once_a_while_and_holds_it_until_quiet():
    limit = _budgeted()
    _feed_sized(limit, message_bytes=1 << 20)
    assert limit.value == 64
    assert limit.slow_down(now=100.0) == 32
    assert limit.slow_down(now=101.0) is None  # the same burst: halved once
    assert limit.value == 32
    assert limit.slow_down(now=100.0 + limit.THROTTLE_HALVE_S) == 16  # throttling goes on
    last = 100.0 + limit.THROTTLE_HALVE_S
    # The measured I/O (the SDK's backoffs in it) wants more: no growth while throttled.
    for _ in range(50):
        limit.observe_task(1.0, 0.001, 1 << 20, now=last + limit.THROTTLE_QUIET_S - 1)
    assert limit.value == 16
    # Quiet long enough: it grows from measured times again.
    assert limit.observe_task(1.0, 0.001, 1 << 20, now=last + limit.THROTTLE_QUIET_S) == 64


def test_throttling_never_takes_auto_below_one_a_process_nor_moves_a_pinned_limit():
    limit = _auto(processes=2)
    limit.value = 3
    assert limit.slow_down(now=0.0) == 2
    assert limit.slow_down(now=60.0) is None and limit.value == 2
    pinned = InFlightLimit(2, value=8, auto=False, ceiling=8)
    assert pinned.slow_down(now=0.0) is None and pinned.value == 8


@pytest.mark.parametrize(
    ("prefetch", "start", "ceiling"), [("auto", 4, 16), ("3", 6, 6), ("1", 2, 2)]
)
def test_settings_start_the_limit_and_bound_it(prefetch, start, ceiling, model_path_file):
    settings = Settings.load(
        {
            "SQSINFER_QUEUE_URL": "https://q",
            "SQSINFER_MODEL_PATH": model_path_file,
            "SQSINFER_ALLOWED_INPUT_PREFIXES": "s3://bucket/in/",
            "SQSINFER_OUTPUT_PREFIX": "s3://bucket/out/",
            "SQSINFER_PROCESSES": "2",
            "SQSINFER_PREFETCH": prefetch,
            "SQSINFER_MAX_INPUT_BYTES": "1024",  # /dev/shm holds many
        }
    )
    limit = InFlightLimit.from_settings(settings)
    assert (limit.value, limit.ceiling, limit.auto) == (start, ceiling, prefetch == "auto")
    # auto may hold up to 32 small messages a process; a pinned prefetch, exactly its own
    assert limit.most == (64 if prefetch == "auto" else ceiling)
    assert limit.budget_bytes == ceiling * (1 << 20)  # 1024 bytes take a segment of 1 MiB


@pytest.fixture
def model_path_file(tmp_path) -> str:
    path = tmp_path / "model.ubj"
    path.write_bytes(b"model")
    return str(path)
