"""FIFO queues: a group's order kept on the way in, SQS's deduplication on the way out.

Each test runs against the stand-in `stand_in` names: moto here; tests/localstack runs the
same tests against LocalStack.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from proving.faults import FaultPlan, FaultProxy, classify
from sqsinfer.aws.sqs import REASON_ATTR
from sqsinfer.lab import standin, synthetic
from sqsinfer.worker.chain import SEND_ATTEMPTS
from sqsinfer.worker.pipeline import Step
from tests.conftest import (
    Stage,
    eventually,
    fault_proxy,
    make_stage,
    outcome_count,
    running,
    sample,
    stage_settings,
)

GROUP = "g-1"


@pytest.fixture
def stand_in(moto: standin.MotoServer) -> str:
    return moto.url


def _settings(stage: Stage, model_path: str, **overrides: Any):
    return stage_settings(
        stage,
        model_path,
        handler="tests.handlers:ScriptedHandler",
        next_queue_url=stage.next_url,
        **overrides,
    )


def _input(stage: Stage, name: str, sleep_s: float = 0.0) -> str:
    rows = np.ones((3, 4), np.float32)
    rows[0, 0] = sleep_s  # ScriptedHandler: a positive first cell sleeps that long
    return stage.put_input(name, synthetic.encode_input(rows, "npy"))


def _send(stage: Stage, body: dict[str, Any] | str, group: str = GROUP) -> None:
    text = body if isinstance(body, str) else json.dumps(body)
    stage.sqs.send_message(
        QueueUrl=stage.queue_url,
        MessageBody=text,
        MessageGroupId=group,
        MessageDeduplicationId=uuid.uuid4().hex,
    )


def _next_tasks(stage: Stage) -> list[str]:
    return [json.loads(m["Body"])["task_id"] for m in stage.drain_queue(stage.next_url)]


def _counted(worker) -> tuple[float, float]:
    """Chain duplicates counted, (certain, possible)."""
    name = "sqsinfer_chain_duplicates_total"
    metrics = worker.metrics
    return sample(metrics, name, kind="certain"), sample(metrics, name, kind="possible")


class _FailingGets(FaultProxy):
    """Answers 500 to every GET of the keys in `keys` while `failing` (S3 in trouble for
    them): each task that reads one fails, transiently, and is retried. (Not a 503: S3's
    SlowDown makes the worker wait and try again, not fail the task.)"""

    def __init__(self, target: str, keys: set[str]) -> None:
        super().__init__(target, FaultPlan())
        self.keys = keys
        self.failing = True
        self.failed = 0

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        op = classify(request.method, request.path, request.query_string, request.headers)
        if self.failing and op.name == "GetObject" and op.key in self.keys:
            await request.read()
            self.failed += 1
            return web.Response(status=500, text="<Error><Code>InternalError</Code></Error>")
        return await super()._handle(request)


async def test_a_group_keeps_its_order_when_one_of_it_is_retried(stand_in: str, model_path: str):
    """Four tasks of one group in one receive; the second fails (S3 in trouble for its
    input) and is retried: the third and fourth go back unstarted, and every task is
    committed, and handed on, in the group's order."""
    stage = make_stage(stand_in, fifo_input=True, fifo_next=True)
    tasks = [f"o{n}" for n in range(1, 5)]
    for task in tasks:  # all queued before the worker's first receive: one receive brings all
        _send(stage, {"task_id": task, "input": _input(stage, f"{task}.npy"), "group": GROUP})
    proxy = _FailingGets(stage.endpoint, {"in/o2.npy"})
    await proxy.start()
    try:
        settings = _settings(stage, model_path, endpoint_url=proxy.url, prefetch=8)
        async with running(settings) as worker:
            await eventually(lambda: outcome_count(worker, "retried") >= 1, timeout_s=60)
            proxy.failing = False
            await eventually(lambda: outcome_count(worker, "committed") == 4, timeout_s=60)
    finally:
        await proxy.stop()
    assert proxy.failed >= 1
    assert _next_tasks(stage) == tasks
    outcomes = worker.metrics.outcomes
    # The two after the retried one went back unstarted, at least once.
    assert outcomes["released"] >= 2
    assert outcomes["retried"] >= 1
    assert sample(worker.metrics, "sqsinfer_rows_total") == 3 * 4  # none computed twice
    assert stage.counts(stage.queue_url) == (0, 0)


async def test_a_group_runs_one_message_at_a_time_in_its_order(stand_in: str, model_path: str):
    """Three of one group in one receive, the first slow, two processes free: the second
    and third wait for the first, so they are handed on after it; another group's task
    runs beside them."""
    stage = make_stage(stand_in, fifo_input=True, fifo_next=True)
    tasks = ["s1", "s2", "s3"]
    for task in tasks:
        sleep_s = 2.0 if task == "s1" else 0.0
        _send(
            stage, {"task_id": task, "input": _input(stage, f"{task}.npy", sleep_s), "group": GROUP}
        )
    _send(stage, {"task_id": "other", "input": _input(stage, "other.npy")}, group="g-2")
    settings = _settings(stage, model_path, processes=2, prefetch=4)
    async with running(settings) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == 4, timeout_s=60)
    sent = _next_tasks(stage)
    assert [t for t in sent if t != "other"] == tasks
    assert sent.index("other") < sent.index("s1")  # not held up by the slow group
    assert worker.metrics.outcomes == {"committed": 4}


async def test_a_rejected_message_of_a_group_goes_to_the_fifo_dlq_and_the_group_goes_on(
    stand_in: str, model_path: str
):
    stage = make_stage(stand_in, fifo_input=True, fifo_next=True)
    _send(stage, "not json")
    _send(stage, {"task_id": "after", "input": _input(stage, "after.npy")})
    async with running(_settings(stage, model_path, prefetch=8)) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == 1)
    dead = stage.drain_queue(stage.dlq_url)
    assert [m["MessageAttributes"][REASON_ATTR]["StringValue"] for m in dead] == ["malformed_json"]
    assert dead[0]["Body"] == "not json"
    assert dead[0]["Attributes"]["MessageGroupId"] == GROUP  # the message's own group
    assert worker.metrics.outcomes["rejected"] == 1
    assert _next_tasks(stage) == ["after"]


async def test_lost_send_answers_to_a_fifo_next_stage_add_no_message(
    stand_in: str, model_path: str
):
    """Every send's answer but the last is lost after SQS took it, and the task is then
    delivered again: SQS drops each send after the first (one deduplication id), so one
    message, nothing counted, and no marker written."""
    stage = make_stage(stand_in, fifo_next=True)
    body = {"task_id": "d1", "input": _input(stage, "d1.npy")}
    stage.send(body)
    next_queue = stage.next_url.rsplit("/", 1)[1]
    limits = {"sqs:send_dropped": SEND_ATTEMPTS - 1}
    plan = FaultPlan(send_drop=1.0, send_drop_queue=next_queue, limits=limits)
    async with fault_proxy(stage, plan) as proxy:
        settings = _settings(stage, model_path, endpoint_url=proxy.url)
        async with running(settings) as worker:
            await eventually(lambda: outcome_count(worker, "committed") == 1)
            stage.send(body)  # the same task again: it finds its output, and links again
            await eventually(lambda: outcome_count(worker, "duplicate") == 1)
    assert proxy.counts["sqs:send_dropped"] == SEND_ATTEMPTS - 1
    assert proxy.seen["SendMessageBatch"] == SEND_ATTEMPTS + 1  # each went out
    sent = stage.drain_queue(stage.next_url)
    assert [json.loads(m["Body"])["task_id"] for m in sent] == ["d1"]
    assert sent[0]["Attributes"]["MessageGroupId"] == "d1"  # the task id, no group given
    assert _counted(worker) == (0, 0)
    assert list(stage.outputs()) == ["out/d1.npy"]  # no marker
    assert worker.metrics.outcomes == {"committed": 1, "duplicate": 1}


async def test_sends_outside_the_dedup_window_are_counted_possible(stand_in: str, model_path: str):
    """A window of 0 s: every send may fall outside SQS's, so each is counted (SQS, whose
    real window is 300 s, still drops the second: the count bounds the extra from above)."""
    stage = make_stage(stand_in, fifo_next=True)
    body = {"task_id": "w1", "input": _input(stage, "w1.npy"), "group": "tenant-7"}
    stage.send(body)
    async with running(_settings(stage, model_path, chain_dedup_window_s=0)) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == 1)
        stage.send(body)
        await eventually(lambda: outcome_count(worker, "duplicate") == 1)
    sent = stage.drain_queue(stage.next_url)
    assert [json.loads(m["Body"]) for m in sent] == [
        {
            "task_id": "w1",
            "input": f"s3://{stage.bucket}/out/w1.npy",
            "params": {},
            "group": "tenant-7",
        }
    ]
    assert sent[0]["Attributes"]["MessageGroupId"] == "tenant-7"
    assert _counted(worker) == (0, 2)


async def test_a_standard_queues_groups_are_tenants_with_no_order_to_keep(
    stage: Stage, make_settings, tmp_path
):
    """A group id on a standard queue makes it a fair queue, whose groups are tenants:
    two messages of one group compute at once (only a FIFO queue's wait in turn)."""
    model = tmp_path / "model.bin"
    model.write_bytes(b"any")
    for name in ("t1", "t2"):
        body = json.dumps({"task_id": name, "input": _input(stage, f"{name}.npy")})
        stage.sqs.send_message(QueueUrl=stage.queue_url, MessageBody=body, MessageGroupId=GROUP)
    settings = make_settings(
        handler="tests.worker.gates:GatedHandler", model_path=str(model), processes=2
    )
    async with running(settings) as worker:
        computing = lambda: [h for h in worker.held.values() if h.step == Step.COMPUTING]  # noqa: E731
        await eventually(lambda: len(computing()) == 2, timeout_s=60)
        assert {h.message.group_id for h in computing()} == {GROUP}
        (tmp_path / "model.bin.go").write_text("go")
        await eventually(lambda: outcome_count(worker, "committed") == 2, timeout_s=60)
