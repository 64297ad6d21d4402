"""Where a message ends: retries used up, squatted outputs, shutdown mid-rejection, lost
deletes, and two messages for one output inside one worker."""

from __future__ import annotations

import json

import numpy as np
import pytest

from proving.faults import SDK_ATTEMPTS, FaultPlan
from sqsinfer.aws.sqs import DETAIL_ATTR, REASON_ATTR
from sqsinfer.lab import synthetic
from sqsinfer.worker.pipeline import Step
from tests.conftest import (
    MAX_RECEIVE_COUNT,
    Stage,
    eventually,
    fault_proxy,
    outcome_count,
    running,
    sample,
)
from tests.handlers import EXIT, KILL, PANIC, PREDICTIONS_FILE_ENV
from tests.worker.test_lifecycle import _input, _scripted


def _dead(stage: Stage) -> list[tuple[str, str, str]]:
    """Every DLQ entry as (body, reason, detail); a missing reason reads as ''."""
    found = []
    for m in stage.drain_queue(stage.dlq_url):
        attrs = m.get("MessageAttributes", {})
        reason = attrs.get(REASON_ATTR, {}).get("StringValue", "")
        found.append((m["Body"], reason, attrs.get(DETAIL_ATTR, {}).get("StringValue", "")))
    return found


def _squat(stage: Stage, task_id: str, owner: str | None) -> None:
    """A producer's object at the output key of `task_id`, claiming `owner` (or nobody)."""
    metadata = {"task-id": owner} if owner else {}
    key = f"out/{task_id}.npy"
    stage.s3.put_object(Bucket=stage.bucket, Key=key, Body=b"squatted", Metadata=metadata)


# -- item: every message ends in an outcome, whatever its task raised ------------------------


@pytest.mark.parametrize(
    ("instruction", "named"), [(PANIC, "NativePanic"), (EXIT, "SystemExit")], ids=["panic", "exit"]
)
async def test_a_task_that_raises_no_exception_is_retried_with_an_outcome(
    stage: Stage, make_settings, instruction: float, named: str
):
    """A BaseException that is no Exception reaches the worker's task: a native panic
    (pyo3's PanicException, from obstore in the worker itself, or here from a model) ends
    the task as a transient failure; a handler's sys.exit() does not stop the worker."""
    stage.send({"task_id": "odd", "input": _input(stage, "odd.npy", first_cell=instruction)})
    async with running(_scripted(make_settings, retry_base_s=1)) as worker:
        await eventually(lambda: stage.counts(stage.dlq_url)[0] == 1, timeout_s=60)
        await eventually(lambda: outcome_count(worker, "rejected") == 1)
        assert worker.pool.usable
    [(_, reason, detail)] = _dead(stage)
    assert reason == "retries_exhausted"
    assert named in detail
    assert worker.metrics.outcomes == {"retried": MAX_RECEIVE_COUNT - 1, "rejected": 1}
    assert stage.counts(stage.queue_url) == (0, 0)


# -- item: every message that ends in the DLQ carries a reason ------------------------------


async def test_a_message_whose_retries_run_out_reaches_the_dlq_with_a_reason(
    stage: Stage, make_settings
):
    body = json.dumps({"task_id": "poison", "input": _input(stage, "p.npy", first_cell=KILL)})
    stage.send(body)
    async with running(_scripted(make_settings, retry_base_s=1)) as worker:
        await eventually(lambda: stage.counts(stage.dlq_url)[0] == 1, timeout_s=60)
        await eventually(lambda: outcome_count(worker, "rejected") == 1)
    # Its last allowed receive failed again: copied with a reason, not moved silently.
    [(got, reason, detail)] = _dead(stage)
    assert (got, reason) == (body, "retries_exhausted")
    assert "PoolCrashed" in detail  # the last error
    assert worker.metrics.outcomes == {"retried": MAX_RECEIVE_COUNT - 1, "rejected": 1}
    assert sample(worker.metrics, "sqsinfer_rejections_total", reason="retries_exhausted") == 1
    assert stage.counts(stage.queue_url) == (0, 0)


async def test_a_task_over_max_time_on_its_last_receive_reaches_the_dlq_with_a_reason(
    stage: Stage, make_settings
):
    body = json.dumps({"task_id": "stuck", "input": _input(stage, "s.npy", first_cell=30)})
    stage.send(body)
    settings = _scripted(
        make_settings, task_time_s=1, max_task_time_s=1, heartbeat_s=0.25, retry_base_s=1
    )
    async with running(settings) as worker:
        await eventually(lambda: outcome_count(worker, "rejected") == 1, timeout_s=60)
    [(got, reason, detail)] = _dead(stage)
    assert (got, reason) == (body, "retries_exhausted")
    assert "max_task_time_s" in detail
    assert worker.metrics.outcomes == {"retried": MAX_RECEIVE_COUNT - 1, "rejected": 1}


# -- item: output squatting -----------------------------------------------------------------


@pytest.mark.parametrize(("owner", "named"), [("someone-else", "someone-else"), (None, "no task")])
async def test_an_output_owned_by_another_task_is_a_conflict(
    stage: Stage, make_settings, owner, named
):
    _squat(stage, "mine", owner)
    body = json.dumps({"task_id": "mine", "input": _input(stage, "a.npy")})
    stage.send(body)
    settings = _scripted(make_settings, next_queue_url=stage.next_url)
    async with running(settings) as worker:
        await eventually(lambda: outcome_count(worker, "rejected") == 1)
    [(got, reason, detail)] = _dead(stage)
    assert (got, reason) == (body, "output_conflict")
    assert named in detail
    assert stage.outputs() == {"out/mine.npy": b"squatted"}  # untouched, and no link
    assert stage.drain_queue(stage.next_url) == []


async def test_an_output_of_the_same_task_is_a_duplicate(stage: Stage, make_settings):
    _squat(stage, "same", "same")
    stage.send({"task_id": "same", "input": _input(stage, "a.npy")})
    async with running(_scripted(make_settings)) as worker:
        await eventually(lambda: outcome_count(worker, "duplicate") == 1)
    assert _dead(stage) == []


async def test_an_output_squatted_while_computing_is_a_conflict(stage: Stage, make_settings):
    """The conditional put's 412 is checked like the HEAD: whose output is it?"""
    stage.send({"task_id": "slow", "input": _input(stage, "slow.npy", first_cell=2)})
    settings = _scripted(make_settings, next_queue_url=stage.next_url)
    async with running(settings) as worker:
        await eventually(lambda: worker.pool.slots[0].busy)
        _squat(stage, "slow", "the-squatter")
        await eventually(lambda: sum(worker.metrics.outcomes.values()) == 1)
    assert worker.metrics.outcomes == {"rejected": 1}
    [(_, reason, detail)] = _dead(stage)
    assert reason == "output_conflict" and "the-squatter" in detail
    assert stage.outputs() == {"out/slow.npy": b"squatted"}
    assert stage.drain_queue(stage.next_url) == []


# -- item: shutdown during a rejection ------------------------------------------------------


@pytest.mark.parametrize("forced", [False, True])
async def test_shutdown_during_a_dlq_copy_deletes_the_message(stage: Stage, make_settings, forced):
    stage.send("{not json")
    plan = FaultPlan(delays_s={"SendMessage": 2.0})
    async with (
        fault_proxy(stage, plan) as proxy,
        running(make_settings(endpoint_url=proxy.url)) as worker,
    ):
        await eventually(lambda: proxy.seen["SendMessage"] == 1)  # the copy is on its way
        worker.stop()
        if forced:
            worker.stop()  # a second signal: no drain
        await eventually(lambda: not worker.held)
    assert worker.metrics.outcomes == {"rejected": 1}
    assert [reason for _, reason, _ in _dead(stage)] == ["malformed_json"]
    assert stage.counts(stage.queue_url) == (0, 0)  # nobody will reject it a second time


# -- item: a lost delete after a commit -----------------------------------------------------


async def test_a_failed_delete_after_a_commit_keeps_the_outcome_committed(
    stage: Stage, make_settings
):
    stage.send({"task_id": "kept", "input": _input(stage, "k.npy")})
    # One delete call fails (every SDK attempt of it); the next delivery's delete goes through.
    failures = {"sqs:DeleteMessageBatch_500": SDK_ATTEMPTS}
    plan = FaultPlan(failing={"DeleteMessageBatch": 1.0}, limits=failures)
    async with fault_proxy(stage, plan) as proxy:
        settings = _scripted(
            make_settings, endpoint_url=proxy.url, visibility_timeout_s=4, heartbeat_s=1
        )
        async with running(settings) as worker:
            await eventually(lambda: outcome_count(worker, "duplicate") == 1)
    assert proxy.counts["sqs:DeleteMessageBatch_500"] == SDK_ATTEMPTS
    # The write decides the outcome: committed outcomes equal outputs written.
    assert worker.metrics.outcomes == {"committed": 1, "duplicate": 1}
    assert list(stage.outputs()) == ["out/kept.npy"]
    assert stage.counts(stage.queue_url) == (0, 0)


# -- item: two messages for one output inside one worker ------------------------------------


async def test_the_same_task_twice_in_one_worker_is_computed_once(
    stage: Stage, make_settings, tmp_path, monkeypatch
):
    calls = tmp_path / "predictions"
    calls.touch()
    monkeypatch.setenv(PREDICTIONS_FILE_ENV, str(calls))  # the spawned processes inherit it
    body = {"task_id": "twice", "input": _input(stage, "t.npy", first_cell=1)}
    stage.send(body)
    stage.send(body)
    settings = make_settings(handler="tests.handlers:RecordingHandler", prefetch=2)
    async with running(settings) as worker:
        await eventually(lambda: sum(worker.metrics.outcomes.values()) == 2)
    assert worker.metrics.outcomes == {"committed": 1, "duplicate": 1}
    assert len(calls.read_text().splitlines()) == 1
    assert stage.counts(stage.queue_url) == (0, 0)


async def test_a_message_waiting_for_its_output_gives_its_slot_to_another(
    stage: Stage, make_settings, tmp_path
):
    """The second message for an output being computed waits without a slot, so another
    message is received meanwhile; when the first fails, the waiter computes, holding a
    slot again, and the count of slots held comes back to zero."""

    def zeros(name: str) -> str:  # passes the gate at once
        return stage.put_input(name, synthetic.encode_input(np.zeros((2, 3), np.float32), "npy"))

    model = tmp_path / "model.bin"
    model.write_bytes(b"any")
    gate = tmp_path / "model.bin.go"
    settings = make_settings(
        handler="tests.worker.gates:GatedHandler",
        model_path=str(model),
        prefetch=2,  # one process: two slots
        retry_base_s=60,  # the failed first message stays away
    )
    async with running(settings) as worker:
        stage.send({"task_id": "same", "input": _input(stage, "gated.npy", first_cell=1)})
        await eventually(lambda: worker.pool.slots[0].busy)  # held at the gate
        stage.send({"task_id": "same", "input": zeros("zeros.npy")})
        await eventually(lambda: Step.WAITING_OUTPUT in [h.step for h in worker.held.values()])
        assert worker.working() == 1
        stage.send({"task_id": "other", "input": zeros("other.npy")})
        await eventually(lambda: len(worker.held) == 3, timeout_s=15)  # received meanwhile
        assert worker.pool.slots[0].busy  # and the first still computing
        gate.write_text("fail")
        await eventually(lambda: sum(worker.metrics.outcomes.values()) == 3)
        assert worker.metrics.outcomes == {"retried": 1, "committed": 2}
        assert worker.working() == 0
        assert sample(worker.metrics, "sqsinfer_in_flight") == 0
    assert sorted(stage.outputs()) == ["out/other.npy", "out/same.npy"]
