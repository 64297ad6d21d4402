"""`sqsinfer status`: figures against known queue states, drain rate and ETA, per group."""

from __future__ import annotations

import asyncio
import json

import pytest

from sqsinfer import cli
from sqsinfer.aws.session import open_clients
from sqsinfer.lab import synthetic
from sqsinfer.messages import S3Uri
from sqsinfer.ops.groups import outermost
from sqsinfer.ops.status import History, QueueRef, Sample, discover, drain, sample, status
from tests.conftest import N_FEATURES, Stage, eventually, outcome_count, running

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


# -- per group: the manifest against the outputs ----------------------------------------
def _npy(rows) -> bytes:
    return synthetic.encode_input(rows, "npy")


def _tenant_manifest(stage: Stage, tmp_path, inputs: str = "") -> str:
    """acme 6 tasks, globex 3, 7 (an integer) 1; a bad line; a task on two lines."""
    tenants = ["acme"] * 6 + ["globex"] * 3 + [7]
    lines = [
        json.dumps(
            {
                "task_id": f"t{i}",
                "input": inputs or f"s3://{stage.bucket}/in/{i}.npy",
                "tenant": tenant,
            }
        )
        for i, tenant in enumerate(tenants)
    ]
    lines.insert(3, "{broken")
    lines.append(lines[0])  # enqueued twice, one task
    path = tmp_path / "tenants.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _group_argv(stage: Stage, path: str, *extra: str) -> list[str]:
    return [
        "status",
        "--queue-url",
        stage.queue_url,
        "--endpoint-url",
        stage.endpoint,
        "--manifest",
        path,
        "--group-field",
        "tenant",
        "--output-prefix",
        f"s3://{stage.bucket}/out/",
        "--interval-s",
        "0",
        *extra,
    ]


def _by_group(doc: dict) -> dict[str, tuple[int, int, int]]:
    return {g["group"]: (g["tasks"], g["done"], g["left"]) for g in doc["groups"]["groups"]}


def test_per_group_counts_are_the_manifests_tasks_against_the_outputs(
    stage: Stage, tmp_path, capsys
):
    b = stage.bucket
    path = _tenant_manifest(stage, tmp_path)
    for i in (0, 1, 2, 6):  # three of acme's outputs and one of globex's exist
        stage.s3.put_object(Bucket=b, Key=f"out/t{i}.npy", Body=b"done")
    stage.s3.put_object(Bucket=b, Key="out/earlier-batch.npy", Body=b"not this batch's")
    stage.s3.put_object(Bucket=b, Key="elsewhere/t4.npy", Body=b"outside the prefix")
    assert cli.main([*_group_argv(stage, path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert _by_group(doc) == {"acme": (6, 3, 3), "globex": (3, 1, 2), "7": (1, 0, 1)}
    assert [g["group"] for g in doc["groups"]["groups"]] == ["acme", "globex", "7"]  # most left
    groups = doc["groups"]
    assert (groups["tasks"], groups["done"], groups["left"]) == (10, 4, 6)
    assert (groups["bad_lines"], groups["bad_reasons"]) == (1, {"malformed_json": 1})
    assert groups["group_field"] == "tenant" and groups["manifest"] == path
    assert [q["role"] for q in doc["queues"]] == ["queue", "dlq"]  # the queues as before
    # the table, for people: the groups under the queues
    assert cli.main(_group_argv(stage, path)) == 0
    out = capsys.readouterr().out
    assert "group (tenant)" in out and "globex" in out and "DLQ" in out
    assert "more groups" not in out  # all three shown
    assert cli.main([*_group_argv(stage, path), "--groups-shown", "2"]) == 0
    out = capsys.readouterr().out
    assert "acme" in out and "globex" in out and "and 1 more groups (--json lists all)" in out


def test_per_group_counts_follow_the_worker_end_to_end(
    stage: Stage, make_settings, tmp_path, capsys
):
    """enqueue --group-field, status per group, the worker, status again."""
    rows = synthetic.make_rows(2, N_FEATURES, seed=1)
    path = _tenant_manifest(stage, tmp_path, inputs=stage.put_input("r.npy", _npy(rows)))
    enqueue = [
        "enqueue",
        path,
        "--queue-url",
        stage.queue_url,
        "--endpoint-url",
        stage.endpoint,
        "--output-prefix",
        f"s3://{stage.bucket}/out/",
        "--group-field",
        "tenant",
        "--quiet",
    ]
    assert cli.main(enqueue) == 3  # the bad line skipped, the rest sent
    capsys.readouterr()
    argv = [*_group_argv(stage, path), "--json"]
    assert cli.main(argv) == 0
    before = json.loads(capsys.readouterr().out)
    assert _by_group(before) == {"acme": (6, 0, 6), "globex": (3, 0, 3), "7": (1, 0, 1)}
    assert before["queues"][0]["visible"] == 11  # the repeated line was sent twice

    async def work() -> None:
        async with running(make_settings()) as worker:
            await eventually(
                lambda: (
                    outcome_count(worker, "committed") + outcome_count(worker, "duplicate") == 11
                )
            )

    asyncio.run(work())
    assert cli.main(argv) == 0
    after = json.loads(capsys.readouterr().out)
    assert _by_group(after) == {"acme": (6, 6, 0), "globex": (3, 3, 0), "7": (1, 1, 0)}
    assert after["queues"][0]["total"] == 0


def test_per_group_watch_and_usage(stage: Stage, tmp_path, capsys):
    path = _tenant_manifest(stage, tmp_path)
    argv = _group_argv(stage, path)
    argv[argv.index("--interval-s") + 1] = "0.1"
    assert cli.main([*argv, "--watch", "--count", "2", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2 and all(_by_group(doc)["acme"] == (6, 0, 6) for doc in lines)
    no_field = [a for a in _group_argv(stage, path) if a not in ("--group-field", "tenant")]
    assert cli.main(no_field) == 2
    assert "--manifest and --group-field go together" in capsys.readouterr().err
    no_prefix = _group_argv(stage, path)[:-4]
    assert cli.main([*no_prefix, "--interval-s", "0"]) == 2
    assert "--manifest needs --output-prefix" in capsys.readouterr().err
    elsewhere = _group_argv(stage, path)
    elsewhere[elsewhere.index("--output-prefix") + 1] = "s3://no-such-bucket-here/out/"
    assert cli.main(elsewhere) == 2
    assert "cannot list the outputs" in capsys.readouterr().err


def test_outputs_under_each_allowed_prefix_are_counted_once(stage: Stage, tmp_path, capsys):
    b = stage.bucket
    own = {"task_id": "own", "input": f"s3://{b}/in/o.npy", "output": f"s3://{b}/own/o.json"}
    lines = [
        json.dumps({**own, "tenant": "acme"}),
        json.dumps(
            {
                "task_id": "sub",
                "input": f"s3://{b}/in/s.npy",
                "tenant": "acme",
                "output": f"s3://{b}/out/sub/s.npy",
            }
        ),
        json.dumps({"task_id": "d", "input": f"s3://{b}/in/d.npy", "tenant": "acme"}),
    ]
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(lines))
    for key in ("own/o.json", "out/sub/s.npy", "out/d.npy"):
        stage.s3.put_object(Bucket=b, Key=key, Body=b"done")
    prefixes = f"s3://{b}/out/,s3://{b}/own/,s3://{b}/out/sub/"
    argv = [*_group_argv(stage, str(path)), "--allowed-output-prefixes", prefixes, "--json"]
    assert cli.main(argv) == 0
    assert _by_group(json.loads(capsys.readouterr().out)) == {"acme": (3, 3, 0)}
    assert outermost(
        [S3Uri(b, "out/sub/"), S3Uri(b, "out/"), S3Uri(b, "own/"), S3Uri(b, "out/")]
    ) == [
        S3Uri(b, "out/"),
        S3Uri(b, "own/"),
    ]
