"""Slots: what holds one, what does not, how many there are, and what each task costs.

A message holds a slot of the in-flight limit until its result is committed; its delete
(and its chain link) run without one, under a cap on everything held. The limit is
pinned or sized from measured times. A first delivery goes to work without a HEAD.
"""

from __future__ import annotations

import logging

from proving.faults import FaultPlan
from sqsinfer.worker.lifecycle import HELD_CAP_FACTOR
from tests.conftest import Stage, eventually, fault_proxy, outcome_count, running, sample
from tests.worker.test_lifecycle import _input, _scripted

_CALLS = "sqsinfer_aws_requests_total"


def _calls(worker, operation: str) -> float:
    return sample(worker.metrics, _CALLS, operation=operation)


async def test_a_stalled_delete_holds_no_slot_and_the_cap_holds_the_rest(
    stage: Stage, make_settings
):
    for i in range(4):
        stage.send({"task_id": f"d{i}", "input": _input(stage, f"d{i}.npy")})
    plan = FaultPlan(delays_s={"DeleteMessageBatch": 10.0})
    async with fault_proxy(stage, plan) as proxy:
        settings = _scripted(make_settings, endpoint_url=proxy.url, prefetch=1)
        async with running(settings) as worker:
            # One slot, and the first delete has not answered: the second message was
            # received and committed all the same.
            await eventually(lambda: len(stage.outputs()) == 2)
            assert sum(worker.metrics.outcomes.values()) == 0
            # Two held, none holding a slot: the cap (2 x the limit) stops the receives.
            assert len(worker.held) == HELD_CAP_FACTOR * 1 and worker.working() == 0
            assert worker.room() == 0
            await eventually(lambda: outcome_count(worker, "committed") == 4)
    assert len(stage.outputs()) == 4
    assert stage.counts(stage.queue_url) == (0, 0)


async def test_auto_prefetch_sizes_the_limit_from_measured_times(
    stage: Stage, make_settings, caplog
):
    """Compute is tiny next to the calls: the limit rises to its ceiling, and says so.
    /dev/shm's room is sized for 3 inputs of 2 MiB: the inputs measured (a segment of
    1 MiB each, with their headroom) leave no room for a fourth."""
    for i in range(12):
        stage.send({"task_id": f"a{i}", "input": _input(stage, f"a{i}.npy")})
    caplog.set_level(logging.INFO, logger="sqsinfer.worker")
    settings = _scripted(make_settings, max_prefetch=3, max_input_bytes=2 << 20)
    async with running(settings) as worker:
        assert worker.limit.auto and worker.limit.value == 2  # one process, 2 to start
        await eventually(lambda: outcome_count(worker, "committed") == 12)
    assert sample(worker.metrics, "sqsinfer_in_flight_limit") == worker.limit.value == 3
    changes = [r for r in caplog.records if r.getMessage() == "in-flight limit changed"]
    assert [(r.__dict__["from"], r.__dict__["to"]) for r in changes] == [(2, 3)]
    assert changes[0].__dict__["compute_ms"] < changes[0].__dict__["io_ms"]


async def test_auto_prefetch_holds_small_messages_past_the_ceiling(
    stage: Stage, make_settings, caplog
):
    """The same, with room sized for 3 inputs of 64 MiB: small messages take a sliver of
    it each, and the limit rises past the ceiling, as far as its measured times want."""
    for i in range(16):
        stage.send({"task_id": f"s{i}", "input": _input(stage, f"s{i}.npy")})
    caplog.set_level(logging.INFO, logger="sqsinfer.worker")
    async with running(_scripted(make_settings, max_prefetch=3)) as worker:
        assert (worker.limit.ceiling, worker.limit.most) == (3, 32)
        await eventually(lambda: outcome_count(worker, "committed") == 16)
    changes = [r for r in caplog.records if r.getMessage() == "in-flight limit changed"]
    assert changes and changes[0].__dict__["from"] == 2 and changes[0].__dict__["to"] > 3
    assert 3 < changes[-1].__dict__["to"] == worker.limit.value <= 32
    assert sample(worker.metrics, "sqsinfer_in_flight_limit") == worker.limit.value


def _written(stage: Stage, task_id: str) -> None:
    """The output of `task_id`, as an earlier delivery left it."""
    key = f"out/{task_id}.npy"
    stage.s3.put_object(Bucket=stage.bucket, Key=key, Body=b"x", Metadata={"task-id": task_id})


async def test_a_first_delivery_goes_to_work_without_a_head(stage: Stage, make_settings):
    """The conditional put decides: a new task costs no HEAD, a done one is found there."""
    _written(stage, "done")
    stage.send({"task_id": "done", "input": _input(stage, "d.npy")})
    stage.send({"task_id": "new", "input": _input(stage, "n.npy")})
    async with running(_scripted(make_settings)) as worker:
        await eventually(lambda: sum(worker.metrics.outcomes.values()) == 2)
    assert worker.metrics.outcomes == {"committed": 1, "duplicate": 1}
    # Both computed and put; only the 412 was followed by a HEAD (whose output is it?).
    assert (_calls(worker, "GetObject"), _calls(worker, "PutObject")) == (2, 2)
    assert _calls(worker, "HeadObject") == 1
    assert stage.outputs()["out/done.npy"] == b"x"  # never overwritten


async def test_a_redelivery_looks_first_and_spares_the_work(stage: Stage, make_settings):
    _written(stage, "again")
    stage.send({"task_id": "again", "input": _input(stage, "a.npy")})
    # Received once before, by a consumer that died: this is its second delivery.
    (first,) = stage.sqs.receive_message(QueueUrl=stage.queue_url)["Messages"]
    stage.sqs.change_message_visibility(
        QueueUrl=stage.queue_url, ReceiptHandle=first["ReceiptHandle"], VisibilityTimeout=0
    )
    async with running(_scripted(make_settings)) as worker:
        await eventually(lambda: outcome_count(worker, "duplicate") == 1)
    assert (_calls(worker, "HeadObject"), _calls(worker, "GetObject")) == (1, 0)


async def test_always_head_output_looks_on_a_first_delivery_too(stage: Stage, make_settings):
    _written(stage, "seen")
    stage.send({"task_id": "seen", "input": _input(stage, "s.npy")})
    async with running(_scripted(make_settings, always_head_output=True)) as worker:
        await eventually(lambda: outcome_count(worker, "duplicate") == 1)
    assert (_calls(worker, "HeadObject"), _calls(worker, "GetObject")) == (1, 0)


async def test_the_busy_counter_adds_up_what_the_processes_computed(stage: Stage, make_settings):
    for i in range(3):
        stage.send({"task_id": f"b{i}", "input": _input(stage, f"b{i}.npy", first_cell=0.2)})
    async with running(_scripted(make_settings)) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == 3)
    busy = sample(worker.metrics, "sqsinfer_process_busy_seconds_total")
    phases = sum(
        sample(worker.metrics, "sqsinfer_phase_seconds_sum", phase=p)
        for p in ("decode", "infer", "encode")
    )
    assert busy >= 0.6  # three predictions that each slept 0.2 s
    assert abs(busy - phases) < 1e-6
