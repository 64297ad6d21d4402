"""Throttling: S3's 503 SlowDown and SQS's RequestThrottled slow the worker down; no task
fails for them, and the worker carries on at its pace once they stop.

The SDK's clients retry in standard mode (a throttled call backs off, holding its slot);
the data path (obstore) has a gate of its own (`s3.Throttle`) behind which every GET and
PUT waits once obstore's own retries of a 503 are spent. Each throttling answer is counted
(`sqsinfer_throttled_total`), and auto prefetch halves its limit for it.
"""

from __future__ import annotations

import logging

import pytest

from proving.faults import FaultPlan
from sqsinfer.aws import s3
from sqsinfer.aws.session import RETRY_MODE, client_config
from sqsinfer.backoff import Backoff
from tests.conftest import Stage, eventually, fault_proxy, outcome_count, running, sample
from tests.worker.test_lifecycle import _input, _scripted

BEFORE, AFTER = 24, 12  # tasks sent into the throttling, and after it stopped


def _failed_data_calls(worker) -> float:
    """Data-path attempts that failed: each one is obstore's retries of a 503 spent."""
    return sum(
        sample(worker.metrics, "sqsinfer_aws_errors_total", operation=name)
        for name in ("GetObject", "PutObject")
    )


async def test_throttling_slows_the_worker_down_and_fails_no_task(stage: Stage, make_settings):
    plan = FaultPlan(seed=5)
    async with fault_proxy(stage, plan) as proxy:
        settings = _scripted(make_settings, endpoint_url=proxy.url, prefetch=4)
        async with running(settings) as worker:
            # Three S3 calls in four refused: obstore's four attempts of a call all fail
            # about one time in three, so the gate closes again and again.
            plan.s3_slowdown, plan.sqs_throttling = 0.75, 0.2
            for i in range(BEFORE):
                stage.send({"task_id": f"b{i}", "input": _input(stage, f"b{i}.npy")})
            await eventually(
                lambda: (
                    _failed_data_calls(worker) >= 3
                    and outcome_count(worker, "committed") >= BEFORE // 2
                ),
                timeout_s=120,
            )
            plan.s3_slowdown, plan.sqs_throttling = 0.0, 0.0  # the throttling ends here
            throttled = dict(proxy.counts)
            committed_by_then = outcome_count(worker, "committed")
            for i in range(AFTER):
                stage.send({"task_id": f"a{i}", "input": _input(stage, f"a{i}.npy")})
            await eventually(lambda: len(stage.outputs()) == BEFORE + AFTER, timeout_s=120)
    assert throttled["s3:slowdown"] > 0 and throttled["sqs:throttling"] > 0, throttled
    # Each counted: the data path's 503s past obstore's retries, the SDK's every attempt.
    assert sample(worker.metrics, "sqsinfer_throttled_total", service="s3") > 0
    assert sample(worker.metrics, "sqsinfer_throttled_total", service="sqs") > 0
    # Not one task failed or was handed back for a retry: every one committed, once.
    assert outcome_count(worker, "committed") == BEFORE + AFTER
    for outcome in ("retried", "rejected", "released", "duplicate"):
        assert outcome_count(worker, outcome) == 0, outcome
    assert stage.counts(stage.dlq_url) == (0, 0)
    # Progress after the throttling stopped: the rest of the first tasks and every later one.
    assert outcome_count(worker, "committed") - committed_by_then >= AFTER
    assert proxy.counts["s3:slowdown"] == throttled["s3:slowdown"]  # none after the window


async def test_the_gate_backs_off_once_per_closing_and_starts_over_after_a_call():
    gate = s3.Throttle(Backoff(base_s=0.2, max_s=0.8))
    first = gate.slow_down()
    assert first is not None and 0.16 <= first <= 0.2
    assert gate.slow_down() is None  # already closed: the calls under way do not count again
    await gate.passed()  # waits the backoff out
    second = gate.slow_down()
    assert second is not None and 0.32 <= second <= 0.4  # a second answer in a row: longer
    await gate.passed()
    gate.went_through()
    again = gate.slow_down()
    assert again is not None and again <= 0.2  # a call went through: from the start


async def test_throttling_halves_auto_prefetch_and_keeps_it_from_growing(
    stage: Stage, make_settings, caplog
):
    """SQS throttles half the calls from the start: the limit halves (two processes: never
    below 2), says why, and from then on does not grow on the tasks' measured times while
    throttled (their I/O holds the SDK's backoffs); the tasks all commit all the same."""
    caplog.set_level(logging.INFO, logger="sqsinfer.worker")
    plan = FaultPlan(seed=6, sqs_throttling=0.5)
    async with fault_proxy(stage, plan) as proxy:
        settings = _scripted(make_settings, endpoint_url=proxy.url, processes=2)
        for i in range(12):
            stage.send({"task_id": f"t{i}", "input": _input(stage, f"t{i}.npy")})
        async with running(settings) as worker:
            await eventually(lambda: len(stage.outputs()) == 12, timeout_s=120)
            plan.sqs_throttling = 0.0
    assert proxy.counts["sqs:throttling"] > 0
    changes = [r.__dict__ for r in caplog.records if r.getMessage() == "in-flight limit changed"]
    reasons = [c["reason"] for c in changes]
    assert "throttled" in reasons, changes
    first = reasons.index("throttled")
    # Most often the preflight's calls meet the first throttling: 4 to 2 before any task.
    assert changes[first]["to"] == max(2, changes[first]["from"] // 2), changes
    after = changes[first:]
    assert all(c["to"] < c["from"] for c in after), changes  # never grown meanwhile
    assert sample(worker.metrics, "sqsinfer_throttled_total", service="sqs") > 0
    assert outcome_count(worker, "committed") == 12


@pytest.mark.parametrize("retries", [0, 3])
def test_the_sdk_clients_retry_in_standard_mode(retries):
    config = client_config(4, retries=retries)
    assert RETRY_MODE == "standard"
    assert config.retries == {"mode": "standard", "max_attempts": retries}
