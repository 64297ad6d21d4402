"""`sqsinfer redrive --server-side` against LocalStack: SQS's message move task
(StartMessageMoveTask, ListMessageMoveTasks, CancelMessageMoveTask), which moto does not
implement (5.2: no such action)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from sqsinfer import cli
from sqsinfer.aws.session import open_clients
from sqsinfer.aws.sqs import Message, dead_letter_attributes
from sqsinfer.lab import standin
from sqsinfer.ops.move_task import CANCELLED, CANCELLING, ServerMove
from tests.conftest import Stage, eventually


def _fill_dlq(stage: Stage, n: int) -> set[str]:
    """n messages in the DLQ, half rejected by a worker (with its attributes), half moved
    by the redrive policy (none)."""
    ids = set()
    for i in range(n):
        body = json.dumps({"task_id": f"t{i}", "input": f"s3://{stage.bucket}/in/t{i}.npy"})
        kwargs: dict[str, Any] = {"QueueUrl": stage.dlq_url, "MessageBody": body}
        if i % 2:
            original = Message(f"mid-{i}", "rh", body, 1, {})
            kwargs["MessageAttributes"] = dead_letter_attributes(
                original, "input_not_found", "detail", stage.queue_url
            )
        stage.sqs.send_message(**kwargs)
        ids.add(f"t{i}")
    return ids


def test_server_side_moves_every_message_to_the_queue(stage: Stage, capsys) -> None:
    ids = _fill_dlq(stage, 24)
    argv = ["redrive", "--endpoint-url", stage.endpoint, "--region", standin.REGION]
    argv += ["--queue-url", stage.queue_url, "--server-side", "--max-per-second", "20", "--json"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    assert (report["status"], report["moved"], report["interrupted"]) == ("COMPLETED", 24, False)
    assert report["destination"] == stage.queue_url and report["max_per_second"] == 20
    assert stage.counts(stage.dlq_url) == (0, 0)
    moved = stage.drain_queue(stage.queue_url)
    assert {json.loads(m["Body"])["task_id"] for m in moved} == ids
    rejected = [m for m in moved if m.get("MessageAttributes")]
    assert len(rejected) == 12
    # Moved as they were: a message's attributes, sqsinfer's own included, go along.
    assert all(
        m["MessageAttributes"]["sqsinfer.reason"]["StringValue"] == "input_not_found"
        for m in rejected
    )


async def test_a_cancelled_move_leaves_the_rest_in_the_dlq(stage: Stage) -> None:
    await asyncio.to_thread(_fill_dlq, stage, 30)
    async with open_clients(standin.REGION, stage.endpoint) as clients:
        mover = ServerMove(clients.sqs, stage.dlq_url, stage.queue_url, rate=2, poll_s=0.2)
        running = asyncio.create_task(mover.run())
        await eventually(lambda: mover.report.moved >= 1, timeout_s=30)
        running.cancel()  # what Ctrl-C and SIGTERM do
        await asyncio.gather(running, return_exceptions=True)
        report = mover.report
        assert report.interrupted and report.status == CANCELLING
        arn = (
            await clients.sqs.get_queue_attributes(
                QueueUrl=stage.dlq_url, AttributeNames=["QueueArn"]
            )
        )["Attributes"]["QueueArn"]

        async def status() -> str:
            found = await clients.sqs.list_message_move_tasks(SourceArn=arn, MaxResults=1)
            return str(found["Results"][0]["Status"])

        for _ in range(50):
            if await status() == CANCELLED:
                break
            await asyncio.sleep(0.2)
        assert await status() == CANCELLED
    left, _ = stage.counts(stage.dlq_url)
    arrived, _ = stage.counts(stage.queue_url)
    assert left + arrived == 30  # nothing lost, nothing doubled
    assert 1 <= arrived < 30  # the rate held it: cancelled long before the end
