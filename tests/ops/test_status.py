"""`sqsinfer status`: figures against known queue states, drain rate and ETA arithmetic."""

from __future__ import annotations

import json

import pytest

from sqsinfer import cli
from sqsinfer.aws.session import open_clients
from sqsinfer.ops.status import History, QueueRef, Sample, discover, drain, sample, status
from tests.conftest import Stage

REF = QueueRef("https://sqs/q", "queue")


def _s(total: int, at_s: float, in_flight: int = 0) -> Sample:
    return Sample(REF, visible=total - in_flight, in_flight=in_flight, delayed=0, at_s=at_s)


def test_drain_rate_and_eta_by_hand():
    assert drain(_s(1000, 0.0), _s(900, 10.0)) == (10.0, 90.0)  # 100 in 10 s; 900 left
    assert drain(_s(900, 0.0), _s(1000, 10.0)) == (-10.0, None)  # growing: no ETA
    assert drain(_s(50, 0.0), _s(50, 5.0)) == (0.0, None)  # stalled
    assert drain(_s(10, 0.0), _s(0, 5.0)) == (2.0, 0.0)  # drained
    assert drain(_s(10, 3.0), _s(10, 3.0)) == (None, None)  # one sample: no rate


def test_history_rates_over_the_window():
    history = History(window_s=60)
    assert history.add([_s(1200, 0.0)])[0].drain_per_s is None
    assert history.add([_s(1100, 30.0)])[0].drain_per_s == pytest.approx(100 / 30)
    row = history.add([_s(900, 60.0)])[0]
    assert row.drain_per_s == pytest.approx(300 / 60) and row.window_s == 60
    row = history.add([_s(840, 90.0)])[0]  # the 0 s sample has left the window
    assert row.drain_per_s == pytest.approx((1100 - 840) / 60)
    assert row.eta_s == pytest.approx(840 / ((1100 - 840) / 60))


def _known_state(stage: Stage) -> None:
    """Queue: 7 visible, 3 in flight, 2 delayed. DLQ: 4 visible."""
    for i in range(10):
        stage.send({"task_id": f"v{i}"})
    for _ in range(2):
        stage.sqs.send_message(QueueUrl=stage.queue_url, MessageBody="d", DelaySeconds=600)
    got = stage.sqs.receive_message(
        QueueUrl=stage.queue_url, MaxNumberOfMessages=3, VisibilityTimeout=600
    )
    assert len(got["Messages"]) == 3
    for i in range(4):
        stage.send({"task_id": f"dead{i}"}, stage.dlq_url)


def test_status_figures_for_known_queue_states(stage: Stage, capsys):
    _known_state(stage)
    argv = ["status", "--queue-url", stage.queue_url, "--endpoint-url", stage.endpoint]
    assert cli.main([*argv, "--interval-s", "0.2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    queue, dlq = doc["queues"]
    assert (queue["url"], queue["role"]) == (stage.queue_url, "queue")
    assert (queue["visible"], queue["in_flight"], queue["delayed"], queue["total"]) == (7, 3, 2, 12)
    assert queue["drain_per_s"] == 0 and queue["eta_s"] is None
    assert (dlq["url"], dlq["role"], dlq["source"]) == (stage.dlq_url, "dlq", stage.queue_url)
    assert (dlq["visible"], dlq["in_flight"], dlq["delayed"]) == (4, 0, 0)
    # the table, for people
    assert cli.main([*argv, "--interval-s", "0"]) == 0
    out = capsys.readouterr().out
    assert stage.queue_url.rsplit("/", 1)[-1] in out and "DLQ" in out
    assert "not draining" not in out  # one sample: no rate, no claim


async def test_drain_rate_between_two_samples_of_a_real_queue(stage: Stage):
    for i in range(12):
        stage.send({"task_id": f"v{i}"})
    async with open_clients("us-east-1", stage.endpoint) as clients:
        refs = await discover(clients.sqs, [stage.queue_url, stage.next_url])
        assert [(r.url, r.role) for r in refs] == [
            (stage.queue_url, "queue"),
            (stage.dlq_url, "dlq"),
            (stage.next_url, "queue"),
            (stage.next_dlq_url, "dlq"),
        ]
        first = await sample(clients.sqs, refs[:1])
        for message in stage.sqs.receive_message(QueueUrl=stage.queue_url, MaxNumberOfMessages=5)[
            "Messages"
        ]:
            stage.sqs.delete_message(
                QueueUrl=stage.queue_url, ReceiptHandle=message["ReceiptHandle"]
            )
        last = await sample(clients.sqs, refs[:1])
    row = status(first[0], last[0])
    assert (first[0].total, row.total) == (12, 7)
    assert row.drain_per_s == pytest.approx(5 / row.window_s, rel=1e-3)
    assert row.eta_s == pytest.approx(7 / row.drain_per_s)


def test_watch_refreshes_until_count(stage: Stage, capsys):
    argv = ["status", "--queue-url", stage.queue_url, "--endpoint-url", stage.endpoint]
    assert cli.main([*argv, "--watch", "--interval-s", "0.1", "--count", "3", "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    last = json.loads(lines[-1])
    assert [q["eta_s"] for q in last["queues"]] == [0.0, 0.0]  # both empty: drained
    assert last["queues"][0]["window_s"] > 0
    assert cli.main([*argv, "--watch", "--interval-s", "0.1", "--count", "2", "--no-dlq"]) == 0
    out = capsys.readouterr().out
    assert stage.queue_url.rsplit("/", 1)[-1] in out and "DLQ" not in out


def test_status_usage_errors(stage: Stage, capsys, monkeypatch):
    monkeypatch.delenv("SQSINFER_QUEUE_URL", raising=False)
    monkeypatch.delenv("SQSINFER_NEXT_QUEUE_URL", raising=False)
    assert cli.main(["status"]) == 2
    missing = ["status", "--queue-url", stage.queue_url + "-nope", "--endpoint-url", stage.endpoint]
    assert cli.main([*missing, "--interval-s", "0"]) == 2
    assert "cannot read" in capsys.readouterr().err
