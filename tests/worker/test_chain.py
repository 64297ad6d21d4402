"""Chaining: the next stage gets each output exactly once in effect."""

from __future__ import annotations

import asyncio
import json

import numpy as np

from sqsinfer.lab import synthetic
from tests.conftest import Stage, eventually, outcome_count, running, sample


def _scripted(make_settings, stage: Stage, **overrides):
    return make_settings(
        handler="tests.handlers:ScriptedHandler",
        next_queue_url=stage.next_url,
        **overrides,
    )


def _input(stage: Stage, name: str, first_cell: float = 0.0) -> str:
    rows = np.full((3, 4), 1.0, dtype=np.float32)
    rows[0, 0] = first_cell
    return stage.put_input(name, synthetic.encode_input(rows, "npy"))


async def test_committed_output_is_sent_to_the_next_stage_with_a_marker(
    stage: Stage, make_settings
):
    uri = _input(stage, "a.npy")
    stage.send({"task_id": "job/1", "input": uri, "params": {"k": 1}})
    async with running(_scripted(make_settings, stage)) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == 1)
    sent = stage.drain_queue(stage.next_url)
    assert [json.loads(m["Body"]) for m in sent] == [
        {"task_id": "job/1", "input": f"s3://{stage.bucket}/out/job/1.npy", "params": {"k": 1}}
    ]
    marker = json.loads(stage.outputs()["out/job/1.npy.chain"])
    assert marker["next_message_id"] == sent[0]["MessageId"]


async def test_redelivery_after_the_link_adds_no_downstream_message(stage: Stage, make_settings):
    uri = _input(stage, "a.npy")
    body = {"task_id": "again", "input": uri}
    stage.send(body)
    async with running(_scripted(make_settings, stage)) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == 1)
        stage.send(body)  # the same task delivered again later
        await eventually(lambda: outcome_count(worker, "duplicate") == 1)
    assert len(stage.drain_queue(stage.next_url)) == 1
    assert worker.metrics.outcomes["retried"] == 0


async def test_crash_between_commit_and_send_does_not_lose_the_link(stage: Stage, make_settings):
    # A delivery wrote the output and died before sending: output present, no marker.
    uri = _input(stage, "a.npy")
    settings = _scripted(make_settings, stage, chain_settle_s=4)
    async with running(settings) as worker:
        stage.s3.put_object(Bucket=stage.bucket, Key="out/crashed.npy", Body=b"written")
        stage.send({"task_id": "crashed", "input": uri})
        # First it waits for the (dead) writer to link; after the settle time it links.
        await eventually(lambda: outcome_count(worker, "duplicate") == 1)
    assert worker.metrics.outcomes["retried"] >= 1
    sent = stage.drain_queue(stage.next_url)
    assert [json.loads(m["Body"])["input"] for m in sent] == [
        f"s3://{stage.bucket}/out/crashed.npy"
    ]
    assert stage.outputs()["out/crashed.npy"] == b"written"
    assert "out/crashed.npy.chain" in stage.outputs()


async def test_one_task_delivered_to_two_workers_at_once(stage: Stage, make_settings):
    """Both compute; one output wins, the other is a duplicate; one downstream message."""
    uri = _input(stage, "slow.npy", first_cell=1.0)  # each prediction takes a second
    body = {"task_id": "twice", "input": uri}
    stage.send(body)
    stage.send(body)
    settings = _scripted(make_settings, stage, prefetch=1, chain_settle_s=1, retry_base_s=1)
    async with running(settings) as first, running(settings) as second:
        workers = (first, second)

        def total(outcome: str) -> int:
            return sum(outcome_count(w, outcome) for w in workers)

        await eventually(lambda: total("committed") == 1 and total("duplicate") == 1)
        await asyncio.sleep(0.5)
    assert [sample(w.metrics, "sqsinfer_rows_total") for w in workers] == [
        3,
        3,
    ]  # both really computed
    assert len(stage.drain_queue(stage.next_url)) == 1
    assert sum(sample(w.metrics, "sqsinfer_chain_duplicates_total") for w in workers) == 0
    assert [k for k in stage.outputs() if not k.endswith(".chain")] == ["out/twice.npy"]
    assert stage.counts(stage.queue_url) == (0, 0)
