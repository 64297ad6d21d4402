"""`sqsinfer enqueue`: manifests and listings, bad lines, batching, retries, --skip-done.

The 10,000-line run uses an in-memory SendMessageBatch: moto's SendMessage is O(queue
depth) per message (it recomputes every queue attribute, three scans of the queue, to
read ContentBasedDeduplication), so 10,000 messages in one moto queue cost minutes of
emulator CPU. Everything else runs against the moto server through the command.
"""

from __future__ import annotations

import asyncio
import io
import json

import pytest

from sqsinfer import cli
from sqsinfer.messages import S3Uri
from sqsinfer.ops.enqueue import (
    EnqueueOptions,
    Enqueuer,
    EnqueueSummary,
    PlainProgress,
    RichProgress,
    in_thread,
)
from sqsinfer.ops.manifest import BadLine, Entry, KeyPattern, Validator, read_csv, read_jsonl
from tests.conftest import Stage, make_stage

BUCKET = "bkt"


def _validator() -> Validator:
    return Validator(allowed_inputs=(S3Uri(BUCKET, "in/"),), output_prefix=S3Uri(BUCKET, "out/"))


def _task(n: int, **extra: object) -> str:
    return json.dumps({"task_id": f"t{n}", "input": f"s3://{BUCKET}/in/{n}.npy", **extra})


# -- reading --------------------------------------------------------------------------
def test_jsonl_bad_lines_carry_line_numbers_and_the_workers_reason():
    lines = [
        _task(1).encode() + b"\n",
        b"{not json\n",
        b"\n",  # blank: no task, not an error
        json.dumps({"input": f"s3://{BUCKET}/in/x.npy"}).encode() + b"\n",
        _task(5, task_id="../up").encode() + b"\n",
        json.dumps({"task_id": "t6", "input": "s3://other/in/6.npy"}).encode() + b"\n",
        json.dumps({"task_id": "t7", "input": f"s3://{BUCKET}/in/7.txt"}).encode() + b"\n",
        b"\xff\xfe\n",
        _task(9, output=f"s3://{BUCKET}/out/nine.json").encode() + b"\n",
    ]
    items = list(read_jsonl(lines, "m.jsonl", _validator()))
    bad = {item.where: item.reason for item in items if isinstance(item, BadLine)}
    assert bad == {
        "m.jsonl:2": "malformed_json",
        "m.jsonl:4": "missing_field",
        "m.jsonl:5": "invalid_field",
        "m.jsonl:6": "input_not_allowed",
        "m.jsonl:7": "unsupported_format",
        "m.jsonl:8": "malformed_json",
    }
    good = [item for item in items if isinstance(item, Entry)]
    assert [e.task.task_id for e in good] == ["t1", "t9"]
    assert str(good[0].task.output) == f"s3://{BUCKET}/out/t1.npy"  # as the worker derives it
    assert str(good[1].task.output) == f"s3://{BUCKET}/out/nine.json"
    assert sum(item.size_bytes for item in items) == sum(map(len, lines)) - 1  # not the blank


def test_csv_with_and_without_header():
    with_header = [b"task_id,input,output\n", b"a,s3://bkt/in/a.csv,\n", b"b,s3://bkt/in/b.npy\n"]
    items = list(read_csv(with_header, "m.csv", _validator()))
    assert [(i.where, i.task.task_id) for i in items if isinstance(i, Entry)] == [
        ("m.csv:2", "a"),
        ("m.csv:3", "b"),
    ]
    plain = [b"c,s3://bkt/in/c.npy,s3://bkt/out/c.json\n", b"only-one-column\n", b"d,nowhere\n"]
    items = list(read_csv(plain, "p.csv", _validator()))
    assert isinstance(items[0], Entry) and str(items[0].task.output) == "s3://bkt/out/c.json"
    assert [(i.where, i.reason) for i in items[1:] if isinstance(i, BadLine)] == [
        ("p.csv:2", "invalid_field"),
        ("p.csv:3", "invalid_field"),
    ]


def test_without_an_allow_list_any_bucket_is_allowed_but_the_rest_is_checked():
    lenient = Validator()
    ok = lenient.check(json.dumps({"task_id": "x", "input": "s3://any-bucket/k/x.npy"}))
    assert ok.input == S3Uri("any-bucket", "k/x.npy")
    items = list(read_jsonl([b'{"task_id": "x", "input": "s3://any-bucket/x.exe"}'], "m", lenient))
    assert isinstance(items[0], BadLine) and items[0].reason == "unsupported_format"


@pytest.mark.parametrize(
    ("text", "key", "task_id"),
    [
        ("s3://bkt/in/2026-*/*.npy", "in/2026-11/user-1.npy", "2026-11/user-1"),
        ("s3://bkt/in/*.npy", "in/a/b.c.npy", "a/b.c"),
        ("s3://bkt/in", "in/x.csv", "x"),
        ("s3://bkt/in/", "in/y", "y"),
    ],
)
def test_key_patterns_and_task_ids(text, key, task_id):
    pattern = KeyPattern.parse(text)
    assert pattern.bucket == "bkt"
    assert pattern.matches(key)
    assert pattern.task_id(key) == task_id


def test_key_pattern_matching():
    pattern = KeyPattern.parse("s3://bkt/in/2026-*/*.npy")
    assert pattern.list_prefix == "in/2026-"
    assert not pattern.matches("in/2026-11/user-1.csv")
    assert not pattern.matches("in/2026-11/")
    assert not KeyPattern.parse("s3://bkt/in").matches("inside/x.npy")  # a folder boundary
    with pytest.raises(ValueError, match="bucket"):
        KeyPattern.parse("s3://B*/x")


# -- 10,000 lines through the sender, SendMessageBatch in memory ------------------------
class FakeSqs:
    """SendMessageBatch as SQS answers it: limits enforced, entries failed on demand."""

    def __init__(self, flaky: set[str], broken: set[str], read: list[int]) -> None:
        self.flaky, self.broken, self.read = flaky, broken, read
        self.bodies: list[str] = []
        self.calls = self.active = self.max_active = 0
        self.read_at_first_call = -1

    async def send_message_batch(self, QueueUrl: str, Entries: list[dict]) -> dict:
        assert QueueUrl == "https://queue"
        assert 1 <= len(Entries) <= 10
        assert len({e["Id"] for e in Entries}) == len(Entries)
        assert sum(len(e["MessageBody"].encode()) for e in Entries) <= 262_144
        if self.calls == 0:
            self.read_at_first_call = self.read[0]
        self.calls += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        await asyncio.sleep(0.002)
        self.active -= 1
        ok, failed = [], []
        for entry in Entries:
            task_id = json.loads(entry["MessageBody"])["task_id"]
            if task_id in self.broken:
                failed.append({"Id": entry["Id"], "SenderFault": True, "Code": "InvalidMessage"})
            elif task_id in self.flaky:
                self.flaky.discard(task_id)  # fails once, then goes through
                failed.append({"Id": entry["Id"], "SenderFault": False, "Code": "InternalError"})
            else:
                self.bodies.append(entry["MessageBody"])
                ok.append({"Id": entry["Id"], "MessageId": "m"})
        return {"Successful": ok, "Failed": failed}


def _big_manifest(n: int, bad: dict[int, bytes]) -> list[bytes]:
    return [bad.get(i, _task(i).encode()) + b"\n" for i in range(1, n + 1)]


def _counting(lines: list[bytes], read: list[int]):
    for line in lines:
        read[0] += 1
        yield line


async def test_ten_thousand_line_manifest_streams_with_bounded_concurrency():
    bad = {
        17: b"{not json",
        500: json.dumps({"input": f"s3://{BUCKET}/in/x.npy"}).encode(),
        1234: _task(1234, task_id="bad id").encode(),
        5000: json.dumps({"task_id": "x", "input": "s3://elsewhere/in/x.npy"}).encode(),
        7000: b"   ",
        9999: _task(9999, input=f"s3://{BUCKET}/in/9999.xlsx").encode(),
    }
    lines = _big_manifest(10_000, bad)
    read = [0]
    sqs = FakeSqs(flaky={"t2", "t3", "t4000"}, broken={"t8000"}, read=read)
    stderr = io.StringIO()
    options = EnqueueOptions("https://queue", concurrency=8, retry_base_s=0.01)
    enqueuer = Enqueuer(sqs, None, options, PlainProgress(stderr))
    items = in_thread(read_jsonl(_counting(lines, read), "big.jsonl", _validator()))
    summary = await enqueuer.run(items)

    assert summary.bad == 5 and summary.failed == 1
    assert summary.sent == 10_000 - 5 - 1 - 1  # bad lines, the blank one, the broken one
    assert summary.retried == 3
    assert dict(summary.bad_reasons) == {
        "malformed_json": 1,
        "missing_field": 1,
        "invalid_field": 1,
        "input_not_allowed": 1,
        "unsupported_format": 1,
    }
    problems = stderr.getvalue().splitlines()
    assert [line.split(":")[1] for line in problems if line.startswith("bad line")] == [
        "17",
        "500",
        "1234",
        "5000",
        "9999",
    ]
    assert any("t8000" in line and "InvalidMessage" in line for line in problems)
    assert summary.exit_code() == 1
    sent_ids = [json.loads(body)["task_id"] for body in sqs.bodies]
    assert len(sent_ids) == len(set(sent_ids)) == summary.sent
    assert sqs.max_active <= 8
    assert sqs.calls <= 1000 + 3  # batches of ten, plus the retried entries
    assert 0 < sqs.read_at_first_call <= 1000  # sending began long before the end: a stream


# -- the command against the moto server ----------------------------------------------
def _args(stage: Stage, *extra: str) -> list[str]:
    return [
        "enqueue",
        "--queue-url",
        stage.queue_url,
        "--endpoint-url",
        stage.endpoint,
        "--allowed-input-prefixes",
        f"s3://{stage.bucket}/in/",
        "--output-prefix",
        f"s3://{stage.bucket}/out/",
        "--quiet",
        *extra,
    ]


def _write(path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_manifest_with_bad_lines_to_the_queue(stage: Stage, tmp_path, capsys):
    b = stage.bucket
    lines = [json.dumps({"task_id": f"m{i}", "input": f"s3://{b}/in/{i}.npy"}) for i in range(200)]
    lines[16] = "{broken"
    lines[99] = json.dumps({"task_id": "x", "input": f"s3://{b}/private/x.npy"})
    lines[150] = json.dumps({"task_id": "y", "input": f"s3://{b}/in/y.npy", "params": [1]})
    path = _write(tmp_path / "tasks.jsonl", lines)
    code = cli.main([*_args(stage, path), "--json"])
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert code == 3  # bad lines skipped, everything else sent
    assert (summary["sent"], summary["bad"], summary["failed"]) == (197, 3, 0)
    assert f"{path}:17: malformed_json" in captured.err
    assert f"{path}:100: input_not_allowed" in captured.err
    assert f"{path}:151: invalid_field: params must be a JSON object" in captured.err
    assert stage.counts(stage.queue_url) == (197, 0)


def test_csv_manifest_bodies_are_what_the_worker_reads(stage: Stage, tmp_path, capsys):
    b = stage.bucket
    rows = ["task_id,input,output"]
    rows += [f"c{i},s3://{b}/in/{i}.csv," for i in range(8)]
    rows += [f"c8,s3://{b}/in/8.csv,s3://{b}/out/eight.json"]
    path = _write(tmp_path / "tasks.csv", rows)
    assert cli.main(_args(stage, path)) == 0
    assert "sent 9," in capsys.readouterr().out
    bodies = {
        json.loads(m["Body"])["task_id"]: json.loads(m["Body"])
        for m in stage.drain_queue(stage.queue_url)
    }
    assert bodies["c0"] == {"task_id": "c0", "input": f"s3://{b}/in/0.csv"}
    assert bodies["c8"]["output"] == f"s3://{b}/out/eight.json"
    assert len(bodies) == 9


def test_from_prefix_enqueues_matching_objects(stage: Stage, capsys):
    for i in range(12):
        stage.put_input(f"batch/u{i}.npy", b"x")
    stage.put_input("batch/README.txt", b"x")
    stage.put_input("other/z.npy", b"x")
    pattern = f"s3://{stage.bucket}/in/batch/*.npy"
    assert cli.main(_args(stage, "--from-prefix", pattern)) == 0
    assert "sent 12," in capsys.readouterr().out
    got = {
        json.loads(m["Body"])["task_id"]: json.loads(m["Body"])["input"]
        for m in stage.drain_queue(stage.queue_url)
    }
    assert got == {f"u{i}": f"s3://{stage.bucket}/in/batch/u{i}.npy" for i in range(12)}
    # a plain prefix takes every key under it, and the odd file out is reported
    assert cli.main(_args(stage, "--from-prefix", f"s3://{stage.bucket}/in/batch/")) == 3
    captured = capsys.readouterr()
    assert f"s3://{stage.bucket}/in/batch/README.txt: unsupported_format" in captured.err
    assert "sent 12," in captured.out


def test_skip_done_skips_tasks_whose_output_exists(stage: Stage, tmp_path, capsys):
    b = stage.bucket
    lines = [json.dumps({"task_id": f"s{i}", "input": f"s3://{b}/in/{i}.npy"}) for i in range(18)]
    lines += [
        json.dumps(
            {"task_id": "own", "input": f"s3://{b}/in/o.npy", "output": f"s3://{b}/out/own.json"}
        )
    ]
    lines += [
        json.dumps(
            {"task_id": "own2", "input": f"s3://{b}/in/o.npy", "output": f"s3://{b}/out/own2.json"}
        )
    ]
    for i in range(0, 18, 3):  # six of the derived outputs are committed already
        stage.s3.put_object(Bucket=b, Key=f"out/s{i}.npy", Body=b"done")
    stage.s3.put_object(Bucket=b, Key="out/own.json", Body=b"done")
    path = _write(tmp_path / "t.jsonl", lines)
    assert cli.main([*_args(stage, path, "--skip-done"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["sent"], summary["skipped_done"]) == (13, 7)
    sent = {json.loads(m["Body"])["task_id"] for m in stage.drain_queue(stage.queue_url)}
    assert sent == {f"s{i}" for i in range(18) if i % 3} | {"own2"}


def test_dry_run_validates_and_sends_nothing(stage: Stage, tmp_path, capsys):
    path = _write(tmp_path / "t.jsonl", [_task(1).replace(BUCKET, stage.bucket), "[]"])
    assert cli.main([*_args(stage, path), "--dry-run"]) == 3
    captured = capsys.readouterr()
    assert "would send 1," in captured.out and ":2: malformed_json" in captured.err
    assert stage.counts(stage.queue_url) == (0, 0)


def test_usage_and_fatal_errors(stage: Stage, tmp_path, capsys):
    path = _write(tmp_path / "t.jsonl", [_task(1).replace(BUCKET, stage.bucket)])
    assert cli.main(_args(stage)) == 2  # neither a manifest nor --from-prefix
    assert cli.main(_args(stage, path, "--from-prefix", f"s3://{stage.bucket}/in/")) == 2
    no_prefix = ["enqueue", path, "--queue-url", stage.queue_url, "--skip-done"]
    assert cli.main(no_prefix) == 2
    assert "--skip-done needs --output-prefix" in capsys.readouterr().err
    assert cli.main(_args(stage, "--from-prefix", "http://x/y")) == 2
    missing = stage.queue_url + "-missing"
    args = _args(stage, path)
    args[args.index(stage.queue_url)] = missing
    assert cli.main(args) == 1
    assert "cannot use queue" in capsys.readouterr().err


def test_progress_bar_reports_problems_above_the_bar(capsys):
    summary = EnqueueSummary()
    with RichProgress(summary, total_bytes=100, label="enqueue") as progress:
        progress.bad(BadLine("m.jsonl:3", "malformed_json", "unexpected [character]"))
        summary.sent = 5
        progress.advance(5, 60)
    err = capsys.readouterr().err
    assert "bad line m.jsonl:3: malformed_json: unexpected [character]" in err
    assert "5 sent" in err


def test_skip_done_looks_for_the_given_models_outputs_under_a_per_model_prefix(
    stage: Stage, tmp_path, capsys
):
    b, sha = stage.bucket, "ab" * 32
    lines = [json.dumps({"task_id": f"s{i}", "input": f"s3://{b}/in/{i}.npy"}) for i in range(4)]
    stage.s3.put_object(Bucket=b, Key=f"out/{sha[:12]}/s0.npy", Body=b"done")
    stage.s3.put_object(Bucket=b, Key="out/cdcdcdcdcdcd/s1.npy", Body=b"another model's")
    path = _write(tmp_path / "t.jsonl", lines)
    argv = [
        "enqueue",
        path,
        "--endpoint-url",
        stage.endpoint,
        "--queue-url",
        stage.queue_url,
        "--output-prefix",
        f"s3://{b}/out/{{model_sha256_12}}/",
        "--skip-done",
    ]
    assert cli.main(argv) == 2
    assert "give --model-sha256" in capsys.readouterr().err
    assert cli.main([*argv, "--model-sha256", sha, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["sent"], summary["skipped_done"]) == (3, 1)


def test_to_a_fifo_queue_each_task_has_its_group_and_a_second_run_adds_nothing(
    moto, tmp_path, capsys
):
    """A task's `group` (else its id) is its MessageGroupId; its output key's digest is its
    deduplication id, so the same manifest sent twice within 5 minutes is queued once."""
    stage = make_stage(moto.url, fifo_input=True)
    b = stage.bucket
    lines = [json.dumps({"task_id": "f1", "input": f"s3://{b}/in/1.npy", "group": "user-1"})]
    lines += [json.dumps({"task_id": "f2", "input": f"s3://{b}/in/2.npy"})]
    path = _write(tmp_path / "tasks.jsonl", lines)
    assert cli.main(_args(stage, path)) == 0
    assert cli.main(_args(stage, path)) == 0
    got = stage.drain_queue(stage.queue_url)
    groups = {json.loads(m["Body"])["task_id"]: m["Attributes"]["MessageGroupId"] for m in got}
    assert groups == {"f1": "user-1", "f2": "f2"}
