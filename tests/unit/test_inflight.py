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


def test_a_change_smaller_than_one_message_is_noise_and_ignored():
    limit = _auto()
    limit.value = 11
    _feed(limit, io_s=0.042, compute_s=0.025)  # 2 x (1 + 42 / 25) x 2 = 10.7 wanted
    assert limit.value == 11


def test_a_pinned_limit_never_moves():
    limit = InFlightLimit(2, value=4, auto=False, ceiling=4)
    _feed(limit, io_s=1.0, compute_s=0.001)
    assert limit.value == 4


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


@pytest.fixture
def model_path_file(tmp_path) -> str:
    path = tmp_path / "model.ubj"
    path.write_bytes(b"model")
    return str(path)
