"""`sqsinfer audit`: every task of a batch in one category per stage, from S3 and SQS alone,
the dead-letter queues read and handed back, and the same report after a kill."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from sqsinfer import cli
from sqsinfer.aws.session import open_clients
from sqsinfer.aws.sqs import Message, dead_letter_copy
from sqsinfer.lab import standin
from sqsinfer.ops import ledger
from sqsinfer.ops.audit import report_lines
from sqsinfer.ops.deadletters import DeadLetterReader, Ended
from tests.conftest import Stage

MODEL = "ab" * 32
OTHER = "cd" * 32


class Chain:
    """A two-stage chain's state, written the way workers leave it."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self.b = stage.bucket

    def output(
        self, n: int, task_id: str, owner: str = "", model: str = MODEL, folder: str = ""
    ) -> None:
        meta = {"task-id": owner or task_id, "model-sha256": model}
        key = f"out{n}/{folder}{task_id}.npy"
        self.stage.s3.put_object(Bucket=self.b, Key=key, Body=b"scores", Metadata=meta)

    def marker(self, task_id: str, state: str) -> None:
        self.stage.s3.put_object(
            Bucket=self.b,
            Key=f"out1/{task_id}.npy.chain",
            Body=json.dumps({"state": state}).encode(),
            Metadata={"chain-state": state, "task-id": task_id},
        )

    def done(self, task_id: str) -> None:
        self.output(1, task_id)
        self.marker(task_id, "sent")
        self.output(2, task_id)

    def dead(self, n: int, task_id: str, reason: str) -> None:
        queue = self.stage.queue_url if n == 1 else self.stage.next_url
        body = json.dumps({"task_id": task_id, "input": f"s3://{self.b}/in/{task_id}.npy"})
        copy = dead_letter_copy(Message("m-" + task_id, "rh", body, 1), reason, "why", queue)
        dlq = self.stage.dlq_url if n == 1 else self.stage.next_dlq_url
        self.stage.sqs.send_message(
            QueueUrl=dlq, MessageBody=copy.body, MessageAttributes=copy.attributes
        )


def _manifest(tmp_path: Path, stage: Stage, task_ids: list[str], extra: str = "") -> str:
    lines = [
        json.dumps({"task_id": t, "input": f"s3://{stage.bucket}/in/{t}.npy"}) for t in task_ids
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n" + extra)
    return str(path)


def _argv(stage: Stage, manifest: str, *extra: str) -> list[str]:
    return [
        "audit",
        manifest,
        "--endpoint-url",
        stage.endpoint,
        "--stage",
        f"queue={stage.queue_url},prefix=s3://{stage.bucket}/out1/,model={MODEL}",
        "--stage",
        f"queue={stage.next_url},prefix=s3://{stage.bucket}/out2/",
        "--dlq-hold-s",
        "5",
        *extra,
    ]


def _audit(capsys: Any, argv: list[str]) -> tuple[int, dict[str, Any]]:
    code = cli.main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _found(report: dict[str, Any]) -> set[tuple[str, str, str, str]]:
    return {
        (f["task_id"], f["stage"], f["category"], f.get("reason", "")) for f in report["findings"]
    }


def test_every_task_is_in_one_category_at_every_stage(stage: Stage, tmp_path, capsys):
    stage.s3.put_bucket_versioning(
        Bucket=stage.bucket, VersioningConfiguration={"Status": "Enabled"}
    )
    chain = Chain(stage)
    chain.done("t0")
    # t1: nothing anywhere. t2: rejected at stage 1.
    chain.dead(1, "t2", "input_not_found")
    chain.output(1, "t3", owner="someone-else")  # t3: its key holds another task's output
    chain.output(1, "t4", model=OTHER)  # t4: another model's, handed on
    chain.marker("t4", "sent")
    chain.output(2, "t4")
    chain.output(1, "t5")  # t5: the link's intent only, never sent
    chain.marker("t5", "sending")
    chain.output(1, "t6")  # t6: sent, and lost at stage 2
    chain.marker("t6", "sent")
    chain.output(1, "t7")  # t7: rejected at stage 2
    chain.marker("t7", "sent")
    chain.dead(2, "t7", "wrong_feature_count")
    chain.done("t8")
    chain.output(2, "t8")  # t8: its stage-2 output written again over the first
    chain.dead(1, "elsewhere", "malformed_json")  # a dead letter of no task in the manifest
    chain.output(1, "stray")  # an output of no task in the manifest
    tasks = [f"t{i}" for i in range(9)] + ["t0"]  # t0 twice: one task
    manifest = _manifest(tmp_path, stage, tasks, extra="{not json\n")
    tasks_out = tmp_path / "problems.jsonl"
    code, report = _audit(capsys, _argv(stage, manifest, "--tasks-out", str(tasks_out)))
    assert code == 1  # missing ones
    assert _found(report) == {
        ("t1", stage.queue_url.rsplit("/", 1)[1], "missing", ""),
        ("t2", stage.queue_url.rsplit("/", 1)[1], "dead_lettered", "input_not_found"),
        ("t3", stage.queue_url.rsplit("/", 1)[1], "output_conflict", "task 'someone-else'"),
        ("t4", stage.queue_url.rsplit("/", 1)[1], "other_model", OTHER),
        ("t5", stage.queue_url.rsplit("/", 1)[1], "link_pending", "sending"),
        ("t6", stage.next_url.rsplit("/", 1)[1], "missing", ""),
        ("t7", stage.next_url.rsplit("/", 1)[1], "dead_lettered", "wrong_feature_count"),
        ("t8", stage.next_url.rsplit("/", 1)[1], "written_twice", ""),
    }
    assert [json.loads(line) for line in tasks_out.read_text().splitlines()] == report["findings"]
    first, second = report["stages"]
    assert (first["committed"], second["committed"]) == (4, 2)  # t0 t6 t7 t8; t0 t4
    assert report["tasks"] == 9 and report["repeated_lines"] == 1 and report["bad_lines"] == 1
    assert first["by_model"] == {MODEL: 4, OTHER: 1}  # the model is checked: HEADs were made
    assert first["dead_letter_reasons"] == {"input_not_found": 1, "malformed_json": 1}
    assert first["dead_letters_not_in_manifest"] == 1
    assert first["outputs_not_in_manifest"] == 1
    assert report["complete"] is False and report["tasks_not_done"] == 8
    # Named where they stopped; the stages after count them as not reached.
    assert second["not_reached"] == 4
    # Read, not consumed: every dead letter is visible again at once.
    assert stage.counts(stage.dlq_url) == (2, 0)
    assert stage.counts(stage.next_dlq_url) == (1, 0)


def _one_stage(stage: Stage, manifest: str, *extra: str) -> list[str]:
    return [
        "audit",
        manifest,
        "--endpoint-url",
        stage.endpoint,
        "--queue-url",
        stage.queue_url,
        "--output-prefix",
        f"s3://{stage.bucket}/out1/{{model_sha256_12}}/",
        *extra,
    ]


def test_a_whole_batch_exits_0_and_one_accounted_for_elsewhere_exits_3(
    stage: Stage, tmp_path, capsys
):
    chain = Chain(stage)
    for task_id in ("a", "b"):
        chain.output(1, task_id, folder=MODEL[:12] + "/")  # under the model's own prefix
    manifest = _manifest(tmp_path, stage, ["a", "b"])
    assert cli.main(_one_stage(stage, manifest, "--model-sha256", MODEL)) == 0
    out = capsys.readouterr().out
    assert "2 tasks, 1 stage: every task committed once at every stage by the model asked" in out
    chain.output(1, "c", owner="squatter", folder=MODEL[:12] + "/")
    chain.dead(1, "d", "undecodable_input")
    manifest = _manifest(tmp_path, stage, ["a", "b", "c", "d"])
    # The listing alone says c is there; only its HEAD says whose it is.
    code, report = _audit(capsys, _one_stage(stage, manifest, "--model-sha256", MODEL))
    assert code == 3 and report["unaccounted"] == 0
    assert {(f["task_id"], f["category"]) for f in report["findings"]} == {
        ("c", "output_conflict"),
        ("d", "dead_lettered"),
    }


def test_a_prefix_naming_the_model_needs_the_model(stage: Stage, tmp_path, capsys):
    manifest = _manifest(tmp_path, stage, ["a"])
    assert cli.main(_one_stage(stage, manifest)) == 2
    assert "give the model (--model-sha256)" in capsys.readouterr().err


def _hold_dead_letters(stage: Stage, hold_s: int) -> int:
    """Receive every dead letter and keep it hidden, as an audit killed mid-read leaves them."""
    held = 0
    while got := stage.sqs.receive_message(
        QueueUrl=stage.dlq_url, MaxNumberOfMessages=10, VisibilityTimeout=hold_s
    ).get("Messages", []):
        held += len(got)
    return held


def test_dead_letters_another_reader_holds_are_waited_for_not_taken_as_missing(
    stage: Stage, tmp_path, capsys
):
    chain = Chain(stage)
    for i in range(12):
        chain.dead(1, f"d{i}", "input_not_found")
    manifest = _manifest(tmp_path, stage, [f"d{i}" for i in range(12)])
    argv = _one_stage(stage, manifest, "--model-sha256", MODEL, "--dlq-hold-s", "20")
    code, before = _audit(capsys, argv)
    assert code == 3 and before["stages"][0]["dead_lettered"] == 12
    assert _hold_dead_letters(stage, hold_s=3) == 12
    code, after = _audit(capsys, argv)
    assert code == 3 and after == before
    assert stage.counts(stage.dlq_url) == (12, 0)


async def test_dead_letters_held_as_long_as_the_reader_waits_are_still_read(stage: Stage):
    """An audit killed at its dead-letter read leaves them hidden for a hold; the next
    run, started at once with the same hold, must still read them when they come back,
    however its polls fall against the moment the hold lapses."""
    chain = Chain(stage)
    for i in range(3):
        chain.dead(1, f"d{i}", "input_not_found")
    async with open_clients("us-east-1", stage.endpoint, 4) as clients:
        assert _hold_dead_letters(stage, hold_s=3) == 3
        found = await DeadLetterReader(clients.sqs, stage.dlq_url, 3, 3).read()
    assert (found.unread, sorted(d.task_id for d in found.letters)) == (0, ["d0", "d1", "d2"])
    assert found.released and stage.counts(stage.dlq_url) == (3, 0)


def test_a_killed_audit_and_the_next_one_report_the_same(stage: Stage, tmp_path, capsys):
    chain = Chain(stage)
    for i in range(30):
        chain.dead(1, f"d{i}", "input_not_found")
        chain.output(1, f"c{i}", folder=MODEL[:12] + "/")
    tasks = [f"d{i}" for i in range(30)] + [f"c{i}" for i in range(30)]
    manifest = _manifest(tmp_path, stage, tasks)
    argv = _one_stage(stage, manifest, "--model-sha256", MODEL, "--dlq-hold-s", "3")
    started = time.monotonic()
    _, whole = _audit(capsys, argv)
    whole_s = time.monotonic() - started
    env = {**os.environ, **standin.FAKE_CREDENTIALS}
    for _attempt in range(5):  # until a kill lands before the run ends by itself
        process = subprocess.Popen(
            [sys.executable, "-m", "sqsinfer", *argv, "--json"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # Killed while it holds dead letters (the case a restart must wait out), or
        # half-way through a run as long as the whole one, whichever comes first.
        deadline = time.monotonic() + whole_s / 2
        while process.poll() is None and time.monotonic() < deadline:
            if stage.counts(stage.dlq_url)[1]:
                break
            time.sleep(0.02)
        killed = process.poll() is None
        process.send_signal(signal.SIGKILL)
        process.wait()
        if killed:
            break
    else:
        pytest.fail("every run ended before it could be killed")
    code, again = _audit(capsys, argv)
    assert (code, again) == (3, whole)


def test_an_output_outside_the_prefix_is_looked_up_and_a_recompute_is_no_overwrite(
    stage: Stage, tmp_path, capsys
):
    stage.s3.put_bucket_versioning(
        Bucket=stage.bucket, VersioningConfiguration={"Status": "Enabled"}
    )
    b, chain = stage.bucket, Chain(stage)
    lines = [  # two tasks name their own outputs, outside the stage's output prefix
        json.dumps(
            {"task_id": t, "input": f"s3://{b}/in/{t}.npy", "output": f"s3://{b}/own/{t}.npy"}
        )
        for t in ("e1", "e2")
    ]
    lines += [json.dumps({"task_id": t, "input": f"s3://{b}/in/{t}.npy"}) for t in ("r1", "w1")]
    stage.s3.put_object(Bucket=b, Key="own/e1.npy", Body=b"s", Metadata={"task-id": "e1"})
    chain.output(1, "r1")  # computed, removed by hand, computed again: no overwrite
    stage.s3.delete_object(Bucket=b, Key="out1/r1.npy")
    chain.output(1, "r1")
    chain.output(1, "w1")  # written over: an overwrite
    chain.output(1, "w1")
    manifest = tmp_path / "tasks.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    argv = ["audit", str(manifest), "--endpoint-url", stage.endpoint, "--queue-url"]
    argv += [stage.queue_url, "--output-prefix", f"s3://{b}/out1/", "--lineage"]
    code, report = _audit(capsys, [*argv, "--allowed-output-prefixes", f"s3://{b}/"])
    assert code == 1
    assert {(f["task_id"], f["category"]) for f in report["findings"]} == {
        ("e2", "missing"),
        ("w1", "written_twice"),
    }
    (found,) = report["stages"]
    assert (found["committed"], found["outputs_looked_up"]) == (2, 2)  # e1 and r1; e1 and e2


def test_the_tasks_an_enqueue_from_a_listing_made_are_audited_from_that_listing(
    stage: Stage, capsys
):
    for name in ("a", "b", "sub/c"):
        stage.put_input(f"{name}.npy", b"features")
    chain = Chain(stage)
    chain.output(1, "a")
    chain.output(1, "sub/c")
    argv = ["audit", "--from-prefix", f"s3://{stage.bucket}/in/*.npy"]
    argv += ["--endpoint-url", stage.endpoint, "--queue-url", stage.queue_url]
    code, report = _audit(capsys, [*argv, "--output-prefix", f"s3://{stage.bucket}/out1/"])
    assert code == 1 and report["tasks"] == 3
    assert [(f["task_id"], f["category"], f["where"]) for f in report["findings"]] == [
        ("b", "missing", f"s3://{stage.bucket}/in/b.npy")
    ]


def _many_dead_letters(stage: Stage, count: int) -> None:
    """`count` letters in the first stage's DLQ, sent ten to a call."""
    body = dead_letter_copy(Message("m", "rh", '{"task_id": "x"}', 1), "why", "why", "q")
    for start in range(0, count, 10):
        entries = [
            {"Id": str(i), "MessageBody": body.body, "MessageAttributes": body.attributes}
            for i in range(start, min(start + 10, count))
        ]
        stage.sqs.send_message_batch(QueueUrl=stage.dlq_url, Entries=entries)


async def _read(stage: Stage, hold_s: int, deadline_s: float = 600.0) -> Any:
    async with open_clients("us-east-1", stage.endpoint, 4) as clients:
        reader = DeadLetterReader(clients.sqs, stage.dlq_url, hold_s, hold_s, deadline_s)
        return await reader.read()


async def test_a_pass_longer_than_its_hold_ends_and_says_how_much_it_read(stage: Stage):
    """Read with a hold shorter than the pass, the first letters come back before the last
    are read: a pass that waited for an empty receive would never end, a receive more on
    every letter each lap. It ends where it comes round, saying so."""
    # A thousand letters: a pass of a hundred receives, many holds of 1 s long. (The
    # stand-in's SendMessageBatch slows as a queue deepens: more would cost the test
    # minutes on a busy machine, and show nothing more.)
    _many_dead_letters(stage, 1000)
    found = await _read(stage, hold_s=1)
    assert found.ended == Ended.LAPPED and found.in_queue == 1000
    assert 0 < len(found.letters) < 1000 and found.released
    assert stage.counts(stage.dlq_url) == (1000, 0)  # every letter handed back, none taken
    # Bounded by a deadline too, whatever the hold.
    found = await _read(stage, hold_s=30, deadline_s=1.0)
    assert found.ended == Ended.DEADLINE and 0 < len(found.letters) < 1000
    assert stage.counts(stage.dlq_url) == (1000, 0)


async def test_a_pass_ends_once_it_read_as_many_letters_as_the_queue_held(stage: Stage):
    _many_dead_letters(stage, 35)
    found = await _read(stage, hold_s=30)
    assert (found.ended, found.in_queue, len(found.letters)) == (Ended.READ, 35, 35)


async def test_a_letter_at_its_queues_receive_limit_is_never_received_again(stage: Stage):
    """A DLQ with a redrive policy of its own moves a letter on the receive after its
    maxReceiveCount: letters the audit's receive brought to that count are held for the
    rest of the pass, even past a hold far shorter than the pass."""
    onward = stage.sqs.create_queue(QueueName="dead-letters-of-dead-letters")["QueueUrl"]
    arn = stage.sqs.get_queue_attributes(QueueUrl=onward, AttributeNames=["QueueArn"])
    policy = {"deadLetterTargetArn": arn["Attributes"]["QueueArn"], "maxReceiveCount": 1}
    stage.sqs.set_queue_attributes(
        QueueUrl=stage.dlq_url, Attributes={"RedrivePolicy": json.dumps(policy)}
    )
    _many_dead_letters(stage, 150)
    found = await _read(stage, hold_s=1)
    assert (found.ended, len(found.letters), found.at_limit) == (Ended.READ, 150, 150)
    assert stage.counts(stage.dlq_url) == (150, 0) and stage.counts(onward) == (0, 0)


def test_the_report_says_how_many_letters_it_read_of_how_many(stage: Stage, tmp_path, capsys):
    _many_dead_letters(stage, 300)
    manifest = _manifest(tmp_path, stage, ["x"])
    argv = _one_stage(stage, manifest, "--model-sha256", MODEL, "--dlq-hold-s", "1")
    code, report = _audit(capsys, argv)
    [first] = report["stages"]
    # Whole, or in part when its holds of 1 s lapsed first (how fast the stand-in is).
    assert first["dead_letters_ended"] in ("read", "lapped")
    assert first["dead_letters_in_queue"] == 300 and code == 3
    whole = first["dead_letters_ended"] == "read"
    assert (first["dead_letters_read"] == 300) == whole
    assert cli.main(argv) == 3
    text = capsys.readouterr().out
    assert re.search(r"dead-letter queue read (whole|in part): \d+ letters of about 300", text)


@pytest.mark.parametrize(
    ("ended", "says"),
    [
        ("read", "dead-letter queue read whole: 1,000 letters of about 1,000"),
        ("empty", "dead-letter queue read whole: 1,000 letters of about 1,000"),
        (
            "lapped",
            "dead-letter queue read in part: 1,000 letters of about 1,000: the holds lapsed "
            "before the pass ended (raise --dlq-hold-s); missing tasks may be among the rest",
        ),
        (
            "deadline",
            "dead-letter queue read in part: 1,000 letters of about 1,000: --dlq-deadline-s "
            "passed; missing tasks may be among the rest",
        ),
    ],
)
def test_each_end_of_a_dead_letter_read_is_told(ended: str, says: str) -> None:
    report = ledger.StageReport("s1", "q", "dlq", "s3://b/out/", "")
    report.dead_letters_in_queue = report.dead_letters_read = 1000
    report.dead_letters_ended = ended
    report.dead_letters_at_limit = 2
    lines = list(report_lines(ledger.AuditReport([report])))
    assert f"s1: {says}" in lines
    assert any("2 dead letters have been received as often as" in line for line in lines)


def test_the_json_says_where_lineage_was_checked(stage: Stage, tmp_path, capsys):
    """A model asked for implies the HEADs of lineage (`--lineage`): the report says so,
    for the whole chain and for each stage."""
    chain = Chain(stage)
    chain.done("a")
    manifest = _manifest(tmp_path, stage, ["a"])
    _, report = _audit(capsys, _argv(stage, manifest))  # a model for stage 1 only
    assert [s["lineage_checked"] for s in report["stages"]] == [True, False]
    assert report["lineage_checked"] is False
    _, report = _audit(capsys, _argv(stage, manifest, "--lineage"))
    assert [s["lineage_checked"] for s in report["stages"]] == [True, True]
    assert report["lineage_checked"] is True
    _, report = _audit(capsys, _one_stage(stage, manifest, "--model-sha256", MODEL))
    assert report["lineage_checked"] is True
    # Every field of the JSON is documented (docs/operating.md, "The fields of --json").
    docs = (Path(__file__).parents[2] / "docs" / "operating.md").read_text()
    fields = set(report) | set(report["stages"][0]) | set(report["stages"][0]["queue"])
    assert {f for f in fields if f"`{f}`" not in docs} == set()
