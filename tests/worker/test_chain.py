"""Chaining: the next stage gets each output exactly once in effect."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from aiohttp import web

from proving.faults import FaultPlan, FaultProxy
from sqsinfer.aws.s3 import Storage
from sqsinfer.aws.session import open_clients
from sqsinfer.aws.sqs import BatchSender, Sender
from sqsinfer.lab import standin, synthetic
from sqsinfer.messages import S3Uri, Task
from sqsinfer.metrics import Metrics
from sqsinfer.worker.chain import (
    SEND_ATTEMPTS,
    Delivery,
    Linker,
    LinkNotSent,
    Written,
    WrittenAt,
)
from sqsinfer.worker.pipeline import Step
from tests.conftest import Stage, eventually, fault_proxy, outcome_count, running, sample
from tests.worker.test_lifecycle import Poacher


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


def _written(stage: Stage, task_id: str, message_id: str, delivery: str = "gone") -> None:
    """An output as a delivery of `message_id` would have written it."""
    metadata = {"task-id": task_id, "message-id": message_id, "delivery": delivery}
    key = f"out/{task_id}.npy"
    stage.s3.put_object(Bucket=stage.bucket, Key=key, Body=b"written", Metadata=metadata)


def _intent(stage: Stage, task_id: str, message_id: str) -> None:
    """The link claimed by a delivery of `message_id` that has not recorded a send."""
    metadata = {"chain-state": "sending", "delivery": "gone", "message-id": message_id}
    key = f"out/{task_id}.npy.chain"
    stage.s3.put_object(Bucket=stage.bucket, Key=key, Body=b"{}", Metadata=metadata)


def _by(delivery: Delivery) -> Written:
    """An output `delivery` has just written: the link is its own."""
    return Written(delivery.delivery_id, WrittenAt(0.0))


def _marker(stage: Stage, task_id: str) -> dict:
    return json.loads(stage.outputs()[f"out/{task_id}.npy.chain"])


def _next_inputs(stage: Stage) -> list[str]:
    return [json.loads(m["Body"])["input"] for m in stage.drain_queue(stage.next_url)]


def _counted(worker) -> tuple[float, float]:
    """Chain duplicates counted, (certain, possible)."""
    name = "sqsinfer_chain_duplicates_total"
    return sample(worker.metrics, name, kind="certain"), sample(
        worker.metrics, name, kind="possible"
    )


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


async def test_an_output_without_a_link_is_linked_once_its_writer_is_presumed_dead(
    stage: Stage, make_settings
):
    """A delivery elsewhere wrote the output and then died: output, no marker. The output
    is its writer's intent: taken over once it is older than the settle, in the worker
    (never handed back to wait), and counted, for the writer may have sent first."""
    uri = _input(stage, "a.npy")
    _written(stage, "crashed", message_id="an-earlier-message")
    stage.send({"task_id": "crashed", "input": uri})
    async with running(_scripted(make_settings, stage, chain_settle_s=1)) as worker:
        await eventually(lambda: outcome_count(worker, "duplicate") == 1)
    assert worker.metrics.outcomes == {"duplicate": 1}
    assert _next_inputs(stage) == [f"s3://{stage.bucket}/out/crashed.npy"]
    assert stage.outputs()["out/crashed.npy"] == b"written"
    assert _marker(stage, "crashed")["state"] == "sent"
    assert _counted(worker) == (0, 1)


async def test_one_task_delivered_to_two_workers_at_once(stage: Stage, make_settings):
    """Both compute; one output wins, the other is a duplicate; one downstream message."""
    uri = _input(stage, "slow.npy", first_cell=1.0)  # each prediction takes a second
    body = {"task_id": "twice", "input": uri}
    # A settle far longer than the owner's send: on a loaded machine the owner can take
    # over a second between its intent and "sent", and a 1 s settle let the other worker
    # take the link over and send again (a `possible` duplicate, by design, not this test's).
    settings = _scripted(make_settings, stage, prefetch=1, chain_settle_s=60, retry_base_s=1)
    async with running(settings) as first, running(settings) as second:
        workers = (first, second)
        # Sent once both poll: one slot each, so each takes one (sent before the second
        # was ready, both could go to the first, the second waiting for the first).
        stage.send(body)
        stage.send(body)

        def total(outcome: str) -> int:
            return sum(outcome_count(w, outcome) for w in workers)

        await eventually(lambda: total("committed") == 1 and total("duplicate") == 1)
        await asyncio.sleep(0.5)
    assert [sample(w.metrics, "sqsinfer_rows_total") for w in workers] == [
        3,
        3,
    ]  # both really computed
    assert len(stage.drain_queue(stage.next_url)) == 1
    assert [_counted(w) for w in workers] == [(0, 0), (0, 0)]
    assert [k for k in stage.outputs() if not k.endswith(".chain")] == ["out/twice.npy"]
    assert stage.counts(stage.queue_url) == (0, 0)


async def test_a_marker_write_failing_past_the_sdk_retries_adds_no_downstream_message(
    stage: Stage, make_settings
):
    """One burst of 503s on the marker, longer than the SDK's retries: still one link."""
    stage.send({"task_id": "m1", "input": _input(stage, "a.npy")})
    async with fault_proxy(stage, FaultPlan(marker_failures=1.0)) as proxy:
        settings = _scripted(make_settings, stage, endpoint_url=proxy.url, chain_settle_s=1)
        async with running(settings) as worker:
            await eventually(
                lambda: (
                    outcome_count(worker, "committed") + outcome_count(worker, "duplicate") >= 1
                    and stage.counts(stage.queue_url) == (0, 0)
                )
            )
    assert proxy.counts["s3:marker_503"] >= 4
    assert _next_inputs(stage) == [f"s3://{stage.bucket}/out/m1.npy"]
    assert _counted(worker) == (0, 0)


async def test_a_send_whose_record_is_given_up_is_counted_when_taken_over(
    stage: Stage, make_settings
):
    """Sent, but the marker could not say so: the next delivery sends again, and counts it.

    Both deliveries are this worker's: the first ended (retried), so its intent (its
    output) is known to be dead and is taken over at once, though the settle is 600 s."""
    stage.send({"task_id": "m2", "input": _input(stage, "a.npy")})
    plan = FaultPlan(marker_failures=1.0, marker_burst=10_000)
    async with fault_proxy(stage, plan) as proxy:
        settings = _scripted(make_settings, stage, endpoint_url=proxy.url, chain_settle_s=600)
        async with running(settings) as worker:
            # Each marker write meets SlowDown until its retries are spent: the SDK's
            # adaptive mode slows its client down as it should, so this takes a while.
            await eventually(lambda: outcome_count(worker, "committed") == 1, timeout_s=120)
            proxy.plan.marker_failures = 0  # S3 recovers
            await eventually(lambda: outcome_count(worker, "duplicate") == 1)
    assert _next_inputs(stage) == [f"s3://{stage.bucket}/out/m2.npy"] * 2
    assert _counted(worker) == (0, 1)  # the redelivery cannot know the first send went out
    assert _marker(stage, "m2")["state"] == "sent"
    assert worker.metrics.outcomes == {"committed": 1, "duplicate": 1}


async def test_a_lost_send_answer_is_counted_as_a_possible_duplicate(stage: Stage, make_settings):
    """SQS took the message, its answer was lost: a retry may send it twice, and is counted."""
    stage.send({"task_id": "m3", "input": _input(stage, "a.npy")})
    next_queue = stage.next_url.rsplit("/", 1)[1]
    plan = FaultPlan(send_drop=1.0, send_drop_queue=next_queue, limits={"sqs:send_dropped": 1})
    async with fault_proxy(stage, plan) as proxy:
        settings = _scripted(make_settings, stage, endpoint_url=proxy.url)
        async with running(settings) as worker:
            await eventually(lambda: outcome_count(worker, "committed") == 1)
    assert proxy.counts["sqs:send_dropped"] == 1
    sent = _next_inputs(stage)
    assert sent == [f"s3://{stage.bucket}/out/m3.npy"] * 2  # standard queues cannot dedupe
    assert _counted(worker) == (0, 1)


def _resets(stage: Stage, count: int) -> FaultPlan:
    """The next stage's sends reset (RST) after SQS took them, `count` times."""
    next_queue = stage.next_url.rsplit("/", 1)[1]
    return FaultPlan(send_reset=1.0, send_reset_queue=next_queue, limits={"sqs:send_reset": count})


async def test_a_reset_send_answer_is_counted_as_a_possible_duplicate(stage: Stage, make_settings):
    """The connection is reset after SQS took the message: the SDK names it as it names a
    refused connect, yet it may have gone out, so the retry's second message is counted."""
    stage.send({"task_id": "r1", "input": _input(stage, "a.npy")})
    async with fault_proxy(stage, _resets(stage, 1)) as proxy:
        settings = _scripted(make_settings, stage, endpoint_url=proxy.url)
        async with running(settings) as worker:
            await eventually(lambda: outcome_count(worker, "committed") == 1)
    assert proxy.counts["sqs:send_reset"] == 1
    sent = _next_inputs(stage)
    assert sent == [f"s3://{stage.bucket}/out/r1.npy"] * 2
    certain, possible = _counted(worker)
    assert (certain, possible) == (0, 1)
    assert certain <= len(sent) - 1 <= certain + possible
    assert _marker(stage, "r1")["state"] == "sent"


async def test_a_link_whose_every_send_was_reset_is_not_released(stage: Stage, make_settings):
    """Every attempt reset: each may have gone out, so the intent stays, and the next
    delivery takes it over and counts that too. Five messages, five counted."""
    stage.send({"task_id": "r4", "input": _input(stage, "a.npy")})
    async with fault_proxy(stage, _resets(stage, SEND_ATTEMPTS)) as proxy:
        settings = _scripted(make_settings, stage, endpoint_url=proxy.url, chain_settle_s=600)
        async with running(settings) as worker:
            await eventually(lambda: outcome_count(worker, "duplicate") == 1)
    assert proxy.counts["sqs:send_reset"] == SEND_ATTEMPTS
    sent = _next_inputs(stage)
    assert sent == [f"s3://{stage.bucket}/out/r4.npy"] * (SEND_ATTEMPTS + 1)
    certain, possible = _counted(worker)
    assert (certain, possible) == (0, SEND_ATTEMPTS + 1)
    assert certain <= len(sent) - 1 <= certain + possible
    assert worker.metrics.outcomes == {"committed": 1, "duplicate": 1}
    assert _marker(stage, "r4")["state"] == "sent"


async def test_a_send_that_never_connected_hands_the_link_back_clean(stage: Stage):
    """Nothing listens where the sends go: refused before a byte was written, not sent."""
    task = Task(
        "c", S3Uri(stage.bucket, "in/c.npy"), S3Uri(stage.bucket, "out/c.npy"), "npy", "npy"
    )
    metrics = Metrics()
    nowhere = f"http://127.0.0.1:{standin.free_port()}"
    async with (
        open_clients("us-east-1", stage.endpoint) as clients,
        open_clients("us-east-1", nowhere) as unreachable,
    ):
        sender = Sender(unreachable.sqs_single_attempt, stage.next_url)
        linker = Linker(Storage(clients.s3), sender, metrics, settle_s=600)
        delivery = Delivery("d-c", "m-c", "c")
        claim = await linker.claim(delivery, task.output, lambda: None, _by(delivery))
        assert claim is not None
        with pytest.raises(LinkNotSent, match="next stage send failed") as failed:
            await linker.hand_on(delivery, task, claim)
    assert failed.value.code == "chain_send_failed"
    assert sample(metrics, "sqsinfer_chain_duplicates_total", kind="possible") == 0
    assert _marker(stage, "c")["state"] == "released"
    assert stage.drain_queue(stage.next_url) == []


async def test_an_earlier_receive_of_the_same_message_still_linking_is_waited_for(
    stage: Stage, make_settings
):
    """SQS hands a message out again while its earlier receive may still be working on it,
    on another worker: the worker waits for that receive's link as for any other, and the
    next stage gets one message."""
    uri = _input(stage, "a.npy")
    message_id = stage.send({"task_id": "live", "input": uri})
    # The earlier receive, elsewhere: it wrote the output and claimed the link; its
    # message's visibility lapses while it is still sending.
    stage.sqs.receive_message(QueueUrl=stage.queue_url, VisibilityTimeout=2)
    task = Task(
        "live", S3Uri(stage.bucket, "in/a.npy"), S3Uri(stage.bucket, "out/live.npy"), "npy", "npy"
    )
    earlier = Delivery("elsewhere", message_id, "live")
    _written(stage, "live", message_id, delivery=earlier.delivery_id)
    elsewhere = Metrics()
    async with open_clients("us-east-1", stage.endpoint) as clients:
        sender = Sender(clients.sqs_single_attempt, stage.next_url)
        linker = Linker(Storage(clients.s3), sender, elsewhere, settle_s=600)
        claim = await linker.claim(earlier, task.output, lambda: None, _by(earlier))
        assert claim is not None
        async with running(_scripted(make_settings, stage, chain_settle_s=600)) as worker:

            def waiting_or_done() -> bool:
                steps = [held.step for held in worker.held.values()]
                return Step.LINK_WAIT in steps or outcome_count(worker, "duplicate") == 1

            await eventually(waiting_or_done)  # the second receive reached the link
            await linker.hand_on(earlier, task, claim)  # the earlier one sends after all
            await eventually(lambda: outcome_count(worker, "duplicate") == 1)
    assert worker.metrics.outcomes == {"duplicate": 1}
    assert _next_inputs(stage) == [f"s3://{stage.bucket}/out/live.npy"]
    assert _counted(worker) == (0, 0)
    assert sample(elsewhere, "sqsinfer_chain_duplicates_total", kind="certain") == 0
    assert _marker(stage, "live")["delivery"] == "elsewhere"


async def test_a_takeover_whose_answer_was_lost_still_counts_what_it_took_over(
    stage: Stage, make_settings
):
    """The answer to the takeover's marker write is lost; reading the marker again, the
    delivery finds its own intent there. It is still a takeover: the receive it took the
    link from may have sent, so its own send is a possible duplicate."""
    uri = _input(stage, "a.npy")
    message_id = stage.send({"task_id": "lost", "input": uri})
    _written(stage, "lost", message_id)
    _intent(stage, "lost", message_id)  # a receive elsewhere that died: taken after the settle
    # The first PutObject is the takeover (the output exists: nothing else is written first).
    plan = FaultPlan(drop=1.0, drop_operations=frozenset({"PutObject"}), limits={"s3:dropped": 1})
    async with fault_proxy(stage, plan) as proxy:
        settings = _scripted(make_settings, stage, endpoint_url=proxy.url, chain_settle_s=1)
        async with running(settings) as worker:
            await eventually(lambda: outcome_count(worker, "duplicate") == 1)
    assert proxy.counts["s3:dropped"] == 1
    assert _next_inputs(stage) == [f"s3://{stage.bucket}/out/lost.npy"]
    assert _counted(worker) == (0, 1)
    assert _marker(stage, "lost")["state"] == "sent"


async def test_waiting_for_another_deliverys_link_holds_the_message(stage: Stage, make_settings):
    """The settle wait happens in the worker: no receive spent, no other consumer sees it."""
    settings = _scripted(
        make_settings, stage, chain_settle_s=5, visibility_timeout_s=2, heartbeat_s=0.5
    )
    async with running(settings) as worker:
        # Planted once the worker is up: a slow start must not use up the intent's settle.
        _written(stage, "theirs", message_id="another-message")
        _intent(stage, "theirs", message_id="another-message")
        stage.send({"task_id": "theirs", "input": _input(stage, "a.npy")})
        async with Poacher(stage) as poacher:
            await eventually(lambda: outcome_count(worker, "duplicate") == 1)
    assert poacher.got == []
    assert worker.metrics.outcomes == {"duplicate": 1}
    assert sample(worker.metrics, "sqsinfer_visibility_extensions_total") >= 1
    assert _next_inputs(stage) == [f"s3://{stage.bucket}/out/theirs.npy"]
    assert _counted(worker) == (0, 1)  # taken over from a delivery presumed dead


async def test_a_send_sqs_refused_hands_the_link_back_clean(stage: Stage, make_settings):
    """Refused on every attempt: nothing went out, so the next delivery counts nothing."""
    stage.send({"task_id": "m4", "input": _input(stage, "a.npy")})
    async with fault_proxy(stage, FaultPlan(refusing={"SendMessageBatch": 1.0})) as proxy:
        settings = _scripted(make_settings, stage, endpoint_url=proxy.url, chain_settle_s=600)
        async with running(settings) as worker:
            await eventually(lambda: outcome_count(worker, "committed") == 1)
            assert _marker(stage, "m4")["state"] == "released"
            proxy.plan.refusing = {}
            await eventually(lambda: outcome_count(worker, "duplicate") == 1)
    assert proxy.counts["sqs:SendMessageBatch_400"] == SEND_ATTEMPTS
    assert _next_inputs(stage) == [f"s3://{stage.bucket}/out/m4.npy"]
    assert _counted(worker) == (0, 0)
    assert _marker(stage, "m4")["state"] == "sent"


async def test_an_owner_whose_sent_link_was_taken_over_and_sent_counts_it_certain(stage: Stage):
    """Two linkers on one output: the owner stalls past the settle, another takes over."""
    task = Task(
        "t", S3Uri(stage.bucket, "in/t.npy"), S3Uri(stage.bucket, "out/t.npy"), "npy", "npy"
    )
    owner_metrics, taker_metrics = Metrics(), Metrics()
    async with open_clients("us-east-1", stage.endpoint) as clients:
        storage = Storage(clients.s3)
        sender = Sender(clients.sqs_single_attempt, stage.next_url)
        owner = Linker(storage, sender, owner_metrics, settle_s=600)
        taker = Linker(storage, sender, taker_metrics, settle_s=0)  # presumes every intent dead
        first = Delivery("first", "message-1", "t")
        claim = await owner.claim(first, task.output, lambda: None, _by(first))
        assert claim is not None
        second = Delivery("second", "message-2", "t")
        took = await taker.claim(second, task.output, lambda: None, _by(first))
        assert took is not None and took.inherited_doubt
        await taker.hand_on(second, task, took)
        await owner.hand_on(first, task, claim)  # the stalled owner goes on and sends
    assert len(stage.drain_queue(stage.next_url)) == 2
    name = "sqsinfer_chain_duplicates_total"
    assert sample(taker_metrics, name, kind="possible") == 1
    assert sample(owner_metrics, name, kind="certain") == 1
    assert _marker(stage, "t")["delivery"] == "second"


class _FailingEntries(FaultProxy):
    """Answers SendMessageBatch, while `failing`, with every entry listed under `Failed`
    (as SQS does for entries it did not take), sending nothing."""

    failing = True
    answered = 0

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if self.failing and request.headers.get("X-Amz-Target", "").endswith(".SendMessageBatch"):
            entries = json.loads(await request.read())["Entries"]
            self.answered += 1
            failed = [
                {"Id": e["Id"], "SenderFault": False, "Code": "InternalError", "Message": "no"}
                for e in entries
            ]
            return web.json_response(
                {"Successful": [], "Failed": failed}, content_type="application/x-amz-json-1.0"
            )
        return await super()._handle(request)


async def test_a_send_listed_as_failed_in_its_batch_hands_the_link_back_clean(
    stage: Stage, make_settings
):
    """SQS answered the batch and named this entry failed: it was not sent, nothing counted."""
    stage.send({"task_id": "m5", "input": _input(stage, "a.npy")})
    proxy = _FailingEntries(stage.endpoint, FaultPlan())
    await proxy.start()
    try:
        settings = _scripted(make_settings, stage, endpoint_url=proxy.url, chain_settle_s=600)
        async with running(settings) as worker:
            await eventually(lambda: outcome_count(worker, "committed") == 1)
            assert _marker(stage, "m5")["state"] == "released"
            assert proxy.answered == SEND_ATTEMPTS
            proxy.failing = False
            await eventually(lambda: outcome_count(worker, "duplicate") == 1)
    finally:
        await proxy.stop()
    assert _next_inputs(stage) == [f"s3://{stage.bucket}/out/m5.npy"]
    assert _counted(worker) == (0, 0)
    assert _marker(stage, "m5")["state"] == "sent"


async def test_a_lost_batch_answer_counts_a_possible_duplicate_for_each_link_in_it(stage: Stage):
    """Two links share one SendMessageBatch whose answer is lost: either may have gone out."""
    tasks = [
        Task(t, S3Uri(stage.bucket, f"in/{t}"), S3Uri(stage.bucket, f"out/{t}.npy"), "npy", "npy")
        for t in ("x", "y")
    ]
    metrics = Metrics()
    next_queue = stage.next_url.rsplit("/", 1)[1]
    plan = FaultPlan(send_drop=1.0, send_drop_queue=next_queue, limits={"sqs:send_dropped": 1})
    async with (
        fault_proxy(stage, plan) as proxy,
        open_clients("us-east-1", proxy.url) as clients,
    ):
        storage = Storage(clients.s3)
        sender = BatchSender(clients.sqs_single_attempt, stage.next_url)
        linker = Linker(storage, sender, metrics, settle_s=600)
        links = []
        for task in tasks:
            delivery = Delivery(f"d-{task.task_id}", f"m-{task.task_id}", task.task_id)
            claim = await linker.claim(delivery, task.output, lambda: None, _by(delivery))
            assert claim is not None
            links.append(linker.hand_on(delivery, task, claim))
        await asyncio.gather(*links)  # both sends are gathered into one batch
    assert proxy.counts["sqs:send_dropped"] == 1
    # One answer lost, yet both links count a possible duplicate: both were in that call.
    assert proxy.seen["SendMessageBatch"] >= 2
    sent = sorted(_next_inputs(stage))
    assert sent == [f"s3://{stage.bucket}/out/{t}.npy" for t in ("x", "x", "y", "y")]
    name = "sqsinfer_chain_duplicates_total"
    assert sample(metrics, name, kind="possible") == 2
    assert all(_marker(stage, t)["state"] == "sent" for t in ("x", "y"))


async def test_a_committed_tasks_link_costs_one_marker_put_and_no_head(stage: Stage, make_settings):
    """What S3 bills a chained task delivered once: its input's GET, its output's PUT,
    and the marker's one PUT ("sent"). The output is its writer's intent: no intent to
    write, and no HEAD (no other delivery can have claimed a link before its output
    existed)."""
    tasks = [f"cost-{n}" for n in range(3)]
    for task in tasks:
        stage.send({"task_id": task, "input": _input(stage, f"{task}.npy")})
    async with fault_proxy(stage, FaultPlan()) as proxy:
        settings = _scripted(make_settings, stage, endpoint_url=proxy.url)
        async with running(settings) as worker:
            await eventually(lambda: outcome_count(worker, "committed") == len(tasks))
    calls = {op: proxy.seen[op] for op in ("GetObject", "PutObject", "HeadObject")}
    n = len(tasks)
    assert calls == {"GetObject": n, "PutObject": 2 * n, "HeadObject": 0}
    assert sorted(_next_inputs(stage)) == [f"s3://{stage.bucket}/out/{t}.npy" for t in tasks]
    assert all(_marker(stage, t)["state"] == "sent" for t in tasks)
