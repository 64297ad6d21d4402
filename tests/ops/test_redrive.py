"""`sqsinfer redrive`: filter, dry run, attributes, limits, and nothing lost when interrupted."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from sqsinfer import cli
from sqsinfer.aws.session import open_clients
from sqsinfer.aws.sqs import REASON_ATTR, SOURCE_QUEUE_ATTR, Message, dead_letter_attributes
from sqsinfer.ops.redrive import NO_REASON, RedriveError, RedriveOptions, Redriver
from tests.conftest import Stage


def _reject(stage: Stage, task_id: str, reason: str | None, trace: str = "") -> None:
    """A message in the DLQ as the worker (reason) or the redrive policy (None) leaves it."""
    body = json.dumps({"task_id": task_id, "input": f"s3://{stage.bucket}/in/{task_id}.npy"})
    own = {"trace": {"DataType": "String", "StringValue": trace}} if trace else {}
    attrs: dict[str, Any] = own
    if reason is not None:
        original = Message("mid-" + task_id, "rh", body, 1, own)
        attrs = dead_letter_attributes(original, reason, "detail", stage.queue_url)
    kwargs: dict[str, Any] = {"QueueUrl": stage.dlq_url, "MessageBody": body}
    if attrs:
        kwargs["MessageAttributes"] = attrs
    stage.sqs.send_message(**kwargs)


def _fill(stage: Stage) -> set[str]:
    for i in range(6):
        _reject(stage, f"nf{i}", "input_not_found", trace=f"trace-{i}")
    for i in range(3):
        _reject(stage, f"mj{i}", "malformed_json")
    for i in range(3):
        _reject(stage, f"mr{i}", None)
    return (
        {f"nf{i}" for i in range(6)} | {f"mj{i}" for i in range(3)} | {f"mr{i}" for i in range(3)}
    )


def _ids(messages: list[dict]) -> list[str]:
    return [json.loads(m["Body"])["task_id"] for m in messages]


def _argv(stage: Stage, *extra: str) -> list[str]:
    return ["redrive", "--endpoint-url", stage.endpoint, "--wait-time-s", "0", *extra]


def test_dry_run_counts_by_reason_and_moves_nothing(stage: Stage, capsys):
    _fill(stage)
    assert cli.main([*_argv(stage, "--queue-url", stage.queue_url), "--dry-run", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["received"] == 12 and report["would_move"] == 12
    by_reason = {row["reason"]: row["messages"] for row in report["by_reason"]}
    assert by_reason == {"input_not_found": 6, "malformed_json": 3, NO_REASON: 3}
    assert {row["target"] for row in report["by_reason"]} == {stage.queue_url}
    assert stage.counts(stage.queue_url) == (0, 0)
    assert stage.counts(stage.dlq_url) == (12, 0)  # released at once when the run ended


def test_reason_filter_moves_only_matching_messages_and_keeps_attributes(stage: Stage, capsys):
    _fill(stage)
    argv = _argv(stage, "--queue-url", stage.queue_url, "--reason", "input_not_found")
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "moved 6" in out and "left by the filter 6" in out
    assert stage.counts(stage.dlq_url) == (6, 0)  # the rest, visible again
    moved = stage.drain_queue(stage.queue_url)
    assert sorted(_ids(moved)) == [f"nf{i}" for i in range(6)]
    for message in moved:
        attrs = message.get("MessageAttributes", {})
        assert set(attrs) == {"trace"}  # the original kept, sqsinfer's own dropped
        task = json.loads(message["Body"])["task_id"]
        assert attrs["trace"]["StringValue"] == "trace-" + task[2:]
        assert message["Attributes"]["ApproximateReceiveCount"] == "1"
    left = stage.drain_queue(stage.dlq_url)
    assert sorted(_ids(left)) == sorted([f"mj{i}" for i in range(3)] + [f"mr{i}" for i in range(3)])


def test_messages_without_a_source_need_a_target(stage: Stage, capsys):
    _fill(stage)
    # only the DLQ: the policy-moved ones name no source queue, so they stay
    argv = _argv(stage, "--dlq-url", stage.dlq_url, "--reason", NO_REASON, "--json")
    assert cli.main(argv) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["moved"], report["no_target"]) == (0, 3)
    assert stage.counts(stage.dlq_url) == (12, 0)
    # with --to they go where they are told
    argv = _argv(stage, "--dlq-url", stage.dlq_url, "--reason", NO_REASON, "--to", stage.next_url)
    assert cli.main(argv) == 0
    assert sorted(_ids(stage.drain_queue(stage.next_url))) == ["mr0", "mr1", "mr2"]
    assert stage.counts(stage.dlq_url) == (9, 0)


def test_max_messages_limits_the_move(stage: Stage, capsys):
    _fill(stage)
    argv = _argv(stage, "--queue-url", stage.queue_url, "--max-messages", "4", "--json")
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["moved"] == 4
    assert stage.counts(stage.queue_url) == (4, 0)
    assert stage.counts(stage.dlq_url) == (8, 0)


# -- interrupted half-way -------------------------------------------------------------
class Faulty:
    """The SQS client, with a fault injected after the n-th SendMessageBatch landed."""

    def __init__(self, sqs: Any, after_sends: int, fault: str) -> None:
        self.sqs, self.after_sends, self.fault = sqs, after_sends, fault
        self.sends = 0
        self.run: asyncio.Task | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sqs, name)

    async def send_message_batch(self, **kwargs: Any) -> dict:
        result = await self.sqs.send_message_batch(**kwargs)  # the messages are in the target
        self.sends += 1
        if self.sends == self.after_sends:
            if self.fault == "interrupt":  # Ctrl-C between the send and the delete
                assert self.run is not None
                self.run.cancel()
            else:  # the answer is lost on the way back
                raise ConnectionResetError("connection reset after the send")
        return result


def _everything(stage: Stage) -> tuple[list[str], list[str]]:
    return _ids(stage.drain_queue(stage.queue_url)), _ids(stage.drain_queue(stage.dlq_url))


@pytest.mark.parametrize("fault", ["interrupt", "lost_answer"])
async def test_interrupted_between_send_and_delete_loses_nothing(stage: Stage, fault: str):
    everything = set()
    for i in range(30):  # three receives' worth, all with the worker's attributes
        _reject(stage, f"x{i}", "input_not_found")
        everything.add(f"x{i}")
    options = RedriveOptions(dlq_url=stage.dlq_url, wait_s=0, hold_s=120)
    async with open_clients("us-east-1", stage.endpoint) as clients:
        faulty = Faulty(clients.sqs, after_sends=2, fault=fault)
        redriver = Redriver(faulty, options)
        run = asyncio.create_task(redriver.run())
        faulty.run = run
        if fault == "interrupt":
            with pytest.raises(asyncio.CancelledError):
                await run
            assert redriver.report.interrupted
        else:  # the run stops and says so; what it held is released
            with pytest.raises(RedriveError, match="connection reset"):
                await run
            assert redriver.report.failed == 10
    moved, left = await asyncio.to_thread(_everything, stage)
    assert set(moved) | set(left) == everything  # nothing in neither queue
    in_both = set(moved) & set(left)
    assert len(in_both) == 10  # the batch whose delete never came: harmless duplicates
    assert len(moved) == len(set(moved))  # and nothing sent twice to the target
    assert redriver.report.moved_total == 10  # the first batch, deleted before the fault


class Watched(Redriver):
    """Says when the first ten have moved, so the test can cancel it part-way."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.moved_some = asyncio.Event()

    async def _move(self, target: str, messages: list[Message]) -> None:
        await super()._move(target, messages)
        if self.report.moved_total >= 10:
            self.moved_some.set()


async def test_cancelled_at_any_moment_loses_nothing(stage: Stage):
    everything = set()
    for i in range(40):
        _reject(stage, f"c{i}", "malformed_json")
        everything.add(f"c{i}")
    options = RedriveOptions(dlq_url=stage.dlq_url, wait_s=0, hold_s=120)
    async with open_clients("us-east-1", stage.endpoint) as clients:
        redriver = Watched(clients.sqs, options)
        run = asyncio.create_task(redriver.run())
        await asyncio.wait_for(redriver.moved_some.wait(), 30)  # part of the way through
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
    moved, left = await asyncio.to_thread(_everything, stage)
    assert set(moved) | set(left) == everything
    assert len(moved) >= 10 and len(left) > 0


def test_attribute_helpers():
    from sqsinfer.ops.redrive import kept_attributes, reason_of

    attrs = {
        REASON_ATTR: {"DataType": "String", "StringValue": "input_not_found"},
        SOURCE_QUEUE_ATTR: {"DataType": "String", "StringValue": "https://q"},
        "trace": {"DataType": "String", "StringValue": "t", "StringListValues": []},
        "blob": {"DataType": "Binary", "BinaryValue": b"\x00"},
    }
    message = Message("m", "rh", "{}", 1, attrs)
    assert reason_of(message) == "input_not_found"
    assert reason_of(Message("m", "rh", "{}", 1, {})) == NO_REASON
    assert kept_attributes(message) == {
        "trace": {"DataType": "String", "StringValue": "t"},
        "blob": {"DataType": "Binary", "BinaryValue": b"\x00"},
    }


def test_a_moved_message_keeps_its_group(stage: Stage, capsys):
    """A fair queue's message the redrive policy moved keeps its MessageGroupId; moved
    back, it is still its tenant's."""
    for i, tenant in enumerate(["acme", "globex", ""]):
        body = json.dumps({"task_id": f"g{i}", "input": f"s3://{stage.bucket}/in/g{i}.npy"})
        group = {"MessageGroupId": tenant} if tenant else {}
        stage.sqs.send_message(QueueUrl=stage.dlq_url, MessageBody=body, **group)
    assert cli.main(_argv(stage, "--queue-url", stage.queue_url)) == 0
    assert "moved 3" in capsys.readouterr().out
    moved = stage.drain_queue(stage.queue_url)
    got = {json.loads(m["Body"])["task_id"]: m["Attributes"].get("MessageGroupId") for m in moved}
    assert got == {"g0": "acme", "g1": "globex", "g2": None}


# -- the server-side path (SQS's message move task; run on LocalStack, which has it) -----
@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        (["--reason", "input_not_found"], "--reason: the client-side path's"),
        (["--dry-run"], "--dry-run: the client-side path's"),
        (["--max-messages", "5"], "--max-messages: the client-side path's"),
    ],
)
def test_server_side_refuses_what_only_the_client_side_does(stage: Stage, capsys, extra, problem):
    argv = _argv(stage, "--queue-url", stage.queue_url, "--server-side", *extra)
    assert cli.main(argv) == 2
    assert problem in capsys.readouterr().err


def test_server_side_needs_one_destination_and_a_rate_goes_with_it(stage: Stage, capsys):
    assert cli.main(_argv(stage, "--dlq-url", stage.dlq_url, "--server-side")) == 2
    assert "give --to or --queue-url" in capsys.readouterr().err
    assert cli.main(_argv(stage, "--queue-url", stage.queue_url, "--max-per-second", "5")) == 2
    assert "--max-per-second goes with --server-side" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # SQS's ceiling is 500 a second
        cli.main(
            _argv(stage, "--queue-url", stage.queue_url, "--server-side", "--max-per-second", "501")
        )


def test_server_side_on_a_stand_in_without_move_tasks_fails_saying_so(stage: Stage, capsys):
    """moto has no StartMessageMoveTask: the command stops at once, naming the call, and
    the DLQ is untouched (tests/localstack/test_redrive_server_side.py moves for real)."""
    _fill(stage)
    assert cli.main(_argv(stage, "--queue-url", stage.queue_url, "--server-side")) == 1
    assert "cannot start a message move task from" in capsys.readouterr().err
    assert stage.counts(stage.dlq_url) == (12, 0)
