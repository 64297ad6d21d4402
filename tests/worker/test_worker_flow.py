"""End to end against the moto server: each outcome, formats, metadata, chaining."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from sqsinfer.aws.sqs import DETAIL_ATTR, REASON_ATTR, SOURCE_QUEUE_ATTR
from sqsinfer.compute.handlers.xgboost_impl import XGBoostHandler
from sqsinfer.lab import synthetic
from tests.conftest import N_FEATURES, Stage, eventually, outcome_count, running, sample


def direct_prediction(model_path: str, array: np.ndarray) -> np.ndarray:
    handler = XGBoostHandler()
    handler.load(model_path, 1)
    return handler.predict(array)


@pytest.mark.parametrize("fmt", ["npy", "json", "jsonl", "csv"])
async def test_commits_prediction_for_each_input_format(
    stage: Stage, make_settings, model_path, fmt
):
    rows = synthetic.make_rows(5, N_FEATURES, seed=3)
    uri = stage.put_input(f"a.{fmt}", synthetic.encode_input(rows, fmt))
    stage.send({"task_id": f"task-{fmt}", "input": uri})
    async with running(make_settings()) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == 1)
    outputs = stage.outputs()
    assert list(outputs) == [f"out/task-{fmt}.npy"]
    got = synthetic.decode_output(outputs[f"out/task-{fmt}.npy"], "npy")
    np.testing.assert_allclose(got, direct_prediction(model_path, rows).reshape(-1, 1), rtol=1e-6)
    head = stage.s3.head_object(Bucket=stage.bucket, Key=f"out/task-{fmt}.npy")
    assert head["Metadata"]["task-id"] == f"task-{fmt}"
    assert len(head["Metadata"]["model-sha256"]) == 64
    assert stage.counts(stage.queue_url) == (0, 0)


def _npy(rows: np.ndarray) -> bytes:
    return synthetic.encode_input(rows, "npy")


async def test_a_fair_queues_group_id_is_in_the_tasks_log_line(stage: Stage, make_settings, caplog):
    caplog.set_level(logging.INFO, logger="sqsinfer.task")
    uri = stage.put_input("g.npy", _npy(synthetic.make_rows(2, N_FEATURES, seed=4)))
    for task_id, group in (("grouped", {"MessageGroupId": "acme"}), ("plain", {})):
        body = json.dumps({"task_id": task_id, "input": uri})
        stage.sqs.send_message(QueueUrl=stage.queue_url, MessageBody=body, **group)
    async with running(make_settings()) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == 2)
    finished = {r.task_id: r.__dict__ for r in caplog.records if r.getMessage() == "task finished"}
    assert finished["grouped"]["group_id"] == "acme"
    assert "group_id" not in finished["plain"]


async def test_a_fair_queues_rejected_message_keeps_its_group_in_the_dead_letter_queue(
    stage: Stage, make_settings
):
    """Copied to a standard DLQ, a fair queue's message stays its tenant's: a redrive
    hands it back to that tenant's share of the queue."""
    for task_id, group in (("grouped", {"MessageGroupId": "acme"}), ("plain", {})):
        body = json.dumps({"task_id": task_id})  # no input: rejected as missing_field
        stage.sqs.send_message(QueueUrl=stage.queue_url, MessageBody=body, **group)
    async with running(make_settings()) as worker:
        await eventually(lambda: outcome_count(worker, "rejected") == 2)
    dead = stage.drain_queue(stage.dlq_url)
    got = {json.loads(m["Body"])["task_id"]: m["Attributes"].get("MessageGroupId") for m in dead}
    assert got == {"grouped": "acme", "plain": None}


async def test_existing_output_is_a_duplicate_and_never_overwritten(stage: Stage, make_settings):
    uri = stage.put_input("a.npy", _npy(synthetic.make_rows(3, N_FEATURES, seed=1)))
    stage.s3.put_object(
        Bucket=stage.bucket,
        Key="out/done.npy",
        Body=b"earlier result",
        Metadata={"task-id": "done"},  # written by this task: another's would be a conflict
    )
    stage.send({"task_id": "done", "input": uri})
    async with running(make_settings(always_head_output=True)) as worker:
        await eventually(lambda: outcome_count(worker, "duplicate") == 1)
        rows_predicted = sample(worker.metrics, "sqsinfer_rows_total")
    assert stage.outputs() == {"out/done.npy": b"earlier result"}
    assert rows_predicted == 0  # the HEAD pre-check saved the computation (a first delivery
    # without the setting computes, and its conditional put finds the output: test_slots)
    assert stage.counts(stage.queue_url) == (0, 0)


def _bad_messages(stage: Stage) -> dict[str, str]:
    """Message bodies that must be rejected, each with its reason."""
    b = stage.bucket
    stage.put_input("garbage.npy", b"\x93NUMPY\x01\x00garbage")
    good = _npy(synthetic.make_rows(4, N_FEATURES, seed=2))
    stage.put_input("truncated.npy", good[: len(good) // 2])
    stage.put_input("narrow.npy", _npy(synthetic.make_rows(4, 3, seed=2)))
    stage.put_input("text.csv", b"f1,f2\n1.0,abc\n")
    stage.put_input("empty.json", b"[]")
    objects = np.empty((2, 2), dtype=object)
    stage.put_input("pickled.npy", b"\x93NUMPY\x01\x00" + _object_header(objects))
    stage.put_input("x.txt", b"1,2")
    stage.s3.put_object(Bucket=b, Key="private/x.npy", Body=good)

    def task(**fields: str) -> str:
        return json.dumps({"task_id": "t1", **fields})

    return {
        "{not json": "malformed_json",
        "[1, 2]": "malformed_json",
        json.dumps({"input": f"s3://{b}/in/a.npy"}): "missing_field",
        json.dumps({"task_id": "../escape", "input": f"s3://{b}/in/a.npy"}): "invalid_field",
        task(input="http://example.com/a.npy"): "invalid_field",
        task(input=f"s3://{b}/in/../private/x.npy"): "invalid_field",
        task(input=f"s3://{b}/private/x.npy"): "input_not_allowed",
        task(input="s3://other-bucket/in/x.npy"): "input_not_allowed",
        task(input=f"s3://{b}/in/x.txt"): "unsupported_format",
        task(input=f"s3://{b}/in/missing.npy"): "input_not_found",
        task(input=f"s3://{b}/in/garbage.npy"): "undecodable_input",
        task(input=f"s3://{b}/in/truncated.npy"): "undecodable_input",
        task(input=f"s3://{b}/in/pickled.npy"): "undecodable_input",
        task(input=f"s3://{b}/in/text.csv"): "undecodable_input",
        task(input=f"s3://{b}/in/empty.json"): "undecodable_input",
        task(input=f"s3://{b}/in/narrow.npy"): "wrong_feature_count",
        task(
            input=f"s3://{b}/in/garbage.npy", output=f"s3://{b}/elsewhere/o.npy"
        ): "output_not_allowed",
        json.dumps(
            {"task_id": "t1", "input": f"s3://{b}/in/a.npy", "params": [1]}
        ): "invalid_field",
    }


def _object_header(array: np.ndarray) -> bytes:
    header = repr({"descr": "|O", "fortran_order": False, "shape": array.shape}).encode()
    header += b" " * (63 - len(header) % 64) + b"\n"
    return len(header).to_bytes(2, "little") + header + b"\x80\x04pickled-objects"


async def test_every_kind_of_bad_message_reaches_the_dlq_with_its_reason(
    stage: Stage, make_settings
):
    bad = _bad_messages(stage)
    for body in bad:
        stage.sqs.send_message(
            QueueUrl=stage.queue_url,
            MessageBody=body,
            MessageAttributes={"trace-id": {"DataType": "String", "StringValue": "abc"}},
        )
    async with running(make_settings()) as worker:
        await eventually(lambda: outcome_count(worker, "rejected") == len(bad))
    dead = stage.drain_queue(stage.dlq_url)
    found = {m["Body"]: m["MessageAttributes"] for m in dead}
    assert {body: attrs[REASON_ATTR]["StringValue"] for body, attrs in found.items()} == bad
    for attrs in found.values():
        assert attrs["trace-id"]["StringValue"] == "abc"  # the producer's attributes are kept
        assert attrs[DETAIL_ATTR]["StringValue"]
        assert attrs[SOURCE_QUEUE_ATTR]["StringValue"] == stage.queue_url
    assert stage.counts(stage.queue_url) == (0, 0)
    assert stage.outputs() == {}
    assert worker.metrics.outcomes["committed"] == 0
