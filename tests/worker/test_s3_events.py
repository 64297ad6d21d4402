"""S3 event notifications as tasks, end to end: the bucket's own notification configuration
sends the events (to the queue directly, through SNS with and without raw delivery, or
through EventBridge), the stand-in delivers them, a real worker scores them.

tests/localstack runs these same tests against LocalStack (its `stage` fixture).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any
from urllib.parse import quote_plus

import numpy as np
import pytest

from proving.faults import FaultPlan
from sqsinfer.aws.sqs import DETAIL_ATTR, REASON_ATTR
from sqsinfer.config import Settings
from sqsinfer.lab import stage as lab_stage
from sqsinfer.lab import synthetic
from sqsinfer.worker.lifecycle import Worker
from tests.conftest import (
    MAX_RECEIVE_COUNT,
    Stage,
    eventually,
    fault_proxy,
    outcome_count,
    running,
    sample,
)
from tests.handlers import KILL

# Keys as people name files: spaces, `+`, `=`, letters beyond ASCII, folders.
# And segments of dots alone, which S3 keeps as they are (`in/d/../e.npy` is a key of its
# own, under `in/`).
KEYS = (
    "in/a b.npy",
    "in/c+d=e.json",
    "in/ünï/çødé 1.csv",
    "in/x/y/z.jsonl",
    "in/d/../e.npy",
    "in/./f.csv",
)
# Where each lands: the prefix replaced, the suffix made the output format's, a segment of
# dots alone escaped (never resolved: an output stays under its prefix).
OUTPUTS = (
    "out/a b.npy",
    "out/c+d=e.npy",
    "out/ünï/çødé 1.npy",
    "out/x/y/z.npy",
    "out/d/=2E=2E/e.npy",
    "out/=2E/f.npy",
)
# Their task ids: the rest of the key in the task-id alphabet (`0=` before an escaped first
# character, which an id may not start with).
TASK_IDS = (
    "a=20b",
    "c+d=3De",
    "0==C3=BCn=C3=AF/=C3=A7=C3=B8d=C3=A9=201",
    "x/y/z",
    "d/=2E=2E/e",
    "0==2E/f",
)


def rows_for(seed: int) -> np.ndarray:
    return synthetic.make_rows(3, 3, seed=seed)


def put(stage: Stage, key: str, rows: np.ndarray) -> str:
    """Write an input in the format its key names; its version id ('' when unversioned)."""
    fmt = key.rsplit(".", 1)[1]
    made = stage.s3.put_object(Bucket=stage.bucket, Key=key, Body=synthetic.encode_input(rows, fmt))
    return str(made.get("VersionId") or "")


def event_settings(make_settings: Callable[..., Settings], **overrides: Any) -> Settings:
    """The scripted handler (each prediction a row's sum), reading S3 events, chained."""
    return make_settings(
        handler="tests.handlers:ScriptedHandler", message_shape="s3-event", **overrides
    )


def visible(stage: Stage, count: int) -> Callable[[], bool]:
    """The stand-in has delivered `count` messages to the queue (some send them late)."""
    return lambda: stage.counts(stage.queue_url)[0] >= count


def settled(stage: Stage, dead: int = 0) -> Callable[[], bool]:
    """Nothing left on the queue, and `dead` messages in the DLQ."""
    return lambda: (
        stage.counts(stage.queue_url) == (0, 0) and stage.counts(stage.dlq_url)[0] == dead
    )


def scored(stage: Stage, outputs: dict[str, np.ndarray]) -> None:
    """Each output holds the row sums of the rows it was made of, and was written once."""
    found = {k: v for k, v in stage.outputs("out/").items() if not k.endswith(".chain")}
    assert sorted(found) == sorted(outputs)
    for key, rows in outputs.items():
        got = synthetic.decode_output(found[key], "npy")
        np.testing.assert_allclose(got.ravel(), rows.sum(axis=1), rtol=1e-5)
    pages = stage.s3.get_paginator("list_object_versions").paginate(
        Bucket=stage.bucket, Prefix="out/"
    )
    # Outputs are written once; a chain marker is rewritten by design (intent, then sent).
    versions = [v["Key"] for page in pages for v in page.get("Versions", [])]
    versions = [key for key in versions if not key.endswith(".chain")]
    assert len(versions) == len(set(versions)), "an output was written twice"


def events_read(worker: Worker, shape: str, kind: str) -> float:
    return sample(worker.metrics, "sqsinfer_events_total", shape=shape, kind=kind)


def dead_letters(stage: Stage) -> list[tuple[dict[str, Any], str, str]]:
    """Every DLQ entry as (body, reason, detail)."""
    found = []
    for m in stage.drain_queue(stage.dlq_url):
        attrs = m.get("MessageAttributes", {})
        reason = attrs.get(REASON_ATTR, {}).get("StringValue", "")
        detail = attrs.get(DETAIL_ATTR, {}).get("StringValue", "")
        found.append((json.loads(m["Body"]), reason, detail))
    return found


def handed_on(stage: Stage) -> dict[str, str]:
    """The next stage's messages: task id → input."""
    docs = [json.loads(m["Body"]) for m in stage.drain_queue(stage.next_url)]
    return {doc["task_id"]: doc["input"] for doc in docs}


def versioned(stage: Stage) -> None:
    stage.s3.put_bucket_versioning(
        Bucket=stage.bucket, VersioningConfiguration={"Status": "Enabled"}
    )


# -- S3 → SQS ---------------------------------------------------------------------------------


async def test_s3_sends_its_events_to_the_queue_and_each_is_scored_once(
    stage: Stage, make_settings
):
    versioned(stage)
    lab_stage.notify_queue(stage.endpoint, stage.bucket, stage.queue_url, prefix="in/")
    rows = {key: rows_for(i) for i, key in enumerate(KEYS)}
    version = {key: put(stage, key, rows[key]) for key in KEYS}
    # The first key's object is deleted at once (a delete marker on top): its event still
    # names the version it created, and that version is what is read.
    stage.s3.delete_object(Bucket=stage.bucket, Key=KEYS[0])
    # Another object is overwritten: two events for one output key. Whichever runs first
    # writes it; the other names another version and goes to the DLQ as a conflict.
    twice = "in/twice.npy"
    first, second = rows_for(10), rows_for(11)
    twice_versions = [put(stage, twice, first), put(stage, twice, second)]
    await eventually(visible(stage, 1 + len(KEYS) + 2), timeout_s=60)  # the test event first

    async with running(event_settings(make_settings, next_queue_url=stage.next_url)) as worker:
        await eventually(settled(stage, dead=1), timeout_s=60)

    [(body, reason, detail)] = dead_letters(stage)
    assert reason == "output_conflict" and "version" in detail
    [lost] = [r["s3"]["object"]["versionId"] for r in body["Records"]]
    won = next(v for v in twice_versions if v != lost)
    won_rows = first if won == twice_versions[0] else second
    scored(stage, {**dict(zip(OUTPUTS, rows.values(), strict=True)), "out/twice.npy": won_rows})
    for key, output, task_id in zip(KEYS, OUTPUTS, TASK_IDS, strict=True):
        meta = stage.s3.head_object(Bucket=stage.bucket, Key=output)["Metadata"]
        assert (meta["task-id"], meta["input-version-id"]) == (task_id, version[key])
    twice_meta = stage.s3.head_object(Bucket=stage.bucket, Key="out/twice.npy")["Metadata"]
    assert twice_meta["input-version-id"] == won
    assert worker.metrics.outcomes == {"committed": len(KEYS) + 1, "ignored": 1, "rejected": 1}
    assert events_read(worker, "s3", "created") == len(KEYS) + 2
    assert events_read(worker, "s3", "test") == 1
    # The next stage gets task messages of its own shape, naming the outputs.
    bucket = stage.bucket
    assert handed_on(stage) == {
        **{t: f"s3://{bucket}/{o}" for t, o in zip(TASK_IDS, OUTPUTS, strict=True)},
        "twice": f"s3://{bucket}/out/twice.npy",
    }


# -- S3 → SNS → SQS ---------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [False, True], ids=["wrapped", "raw"])
async def test_sns_delivers_them_wrapped_or_raw(stage: Stage, make_settings, raw):
    lab_stage.notify_through_sns(
        stage.endpoint, stage.bucket, [(stage.queue_url, raw)], prefix="in/"
    )
    rows = {key: rows_for(20 + i) for i, key in enumerate(KEYS)}
    for key, data in rows.items():
        put(stage, key, data)
    await eventually(visible(stage, 1 + len(rows)), timeout_s=60)

    async with running(event_settings(make_settings)) as worker:
        await eventually(settled(stage), timeout_s=60)

    scored(stage, dict(zip(OUTPUTS, rows.values(), strict=True)))
    assert worker.metrics.outcomes == {"committed": len(KEYS), "ignored": 1}
    shape = "s3" if raw else "sns"  # raw delivery is S3's own body
    assert events_read(worker, shape, "created") == len(KEYS)
    assert events_read(worker, shape, "test") == 1


# -- S3 → EventBridge → SQS -------------------------------------------------------------------


async def test_eventbridge_delivers_them_with_keys_as_they_are(stage: Stage, make_settings):
    metadata = await through_eventbridge(
        stage, make_settings, dict(zip(KEYS, OUTPUTS, strict=True))
    )
    assert [m["task-id"] for m in metadata] == list(TASK_IDS)


async def through_eventbridge(
    stage: Stage, make_settings: Callable[..., Settings], outputs: dict[str, str]
) -> list[dict[str, str]]:
    """Inputs at `outputs`' keys, scored from EventBridge's events, then one of them
    removed; the metadata of each output."""
    lab_stage.notify_through_eventbridge(
        stage.endpoint, stage.bucket, stage.queue_url, prefix="in/"
    )
    rows = {key: rows_for(30 + i) for i, key in enumerate(outputs)}
    for key, data in rows.items():
        put(stage, key, data)
    await eventually(visible(stage, len(rows)), timeout_s=60)

    async with running(event_settings(make_settings)) as worker:
        await eventually(settled(stage), timeout_s=60)
        # A removal is an event too, of another detail type: ignored, deleted.
        stage.s3.delete_object(Bucket=stage.bucket, Key=next(iter(rows)))
        await eventually(lambda: worker.metrics.outcomes["ignored"] == 1, timeout_s=60)
        await eventually(settled(stage), timeout_s=60)

    scored(stage, {outputs[key]: data for key, data in rows.items()})
    assert worker.metrics.outcomes == {"committed": len(rows), "ignored": 1}
    assert events_read(worker, "eventbridge", "created") == len(rows)
    assert events_read(worker, "eventbridge", "other") == 1
    return [
        stage.s3.head_object(Bucket=stage.bucket, Key=output)["Metadata"]
        for output in outputs.values()
    ]


# -- a body of several records --------------------------------------------------------------


def _record(stage: Stage, key: str, name: str = "ObjectCreated:Put") -> dict[str, Any]:
    return {
        "eventVersion": "2.1",
        "eventSource": "aws:s3",
        "eventName": name,
        "s3": {"bucket": {"name": stage.bucket}, "object": {"key": quote_plus(key)}},
    }


async def test_each_record_of_a_body_ends_alone_and_the_message_once_all_have(
    stage: Stage, make_settings
):
    """S3 sends one record a message; a body of several is what a producer or a relay
    makes, so the test builds it. Records: a new object; the same again; a removal; one
    outside the input prefixes; one whose compute crashes its process every time."""
    rows = rows_for(40)
    put(stage, "in/m 1.npy", rows)
    crash = np.ones((2, 3), dtype=np.float32)
    crash[0, 0] = KILL
    put(stage, "in/crash.npy", crash)
    records = [
        _record(stage, "in/m 1.npy"),
        _record(stage, "in/m 1.npy"),
        _record(stage, "in/gone.npy", "ObjectRemoved:Delete"),
        _record(stage, "secret/x.npy"),
        _record(stage, "in/crash.npy"),
    ]
    stage.send({"Records": records})

    settings = event_settings(make_settings, next_queue_url=stage.next_url, retry_base_s=1)
    async with running(settings) as worker:
        await eventually(settled(stage, dead=2), timeout_s=90)

    scored(stage, {"out/m 1.npy": rows})
    # Each delivery: the first record committed once then a duplicate, the second a
    # duplicate, the removal ignored; the last two are handed back with the message until
    # its last receive, then copied to the DLQ alone, each with its own reason.
    deliveries = MAX_RECEIVE_COUNT
    assert worker.metrics.outcomes == {
        "committed": 1,
        "duplicate": 2 * deliveries - 1,
        "ignored": deliveries,
        "retried": 2 * (deliveries - 1),
        "rejected": 2,
    }
    dead = {body["Records"][0]["s3"]["object"]["key"]: (r, d) for body, r, d in dead_letters(stage)}
    assert dead.keys() == {quote_plus("secret/x.npy"), quote_plus("in/crash.npy")}
    reason, detail = dead[quote_plus("secret/x.npy")]
    assert reason == "input_not_allowed" and detail.startswith("record 4 of 5: ")
    reason, detail = dead[quote_plus("in/crash.npy")]
    assert reason == "retries_exhausted" and detail.startswith("record 5 of 5: ")
    assert "PoolCrashed" in detail
    assert handed_on(stage) == {"m=201": f"s3://{stage.bucket}/out/m 1.npy"}
    assert sample(worker.metrics, "sqsinfer_rejections_total", reason="input_not_allowed") == 1


async def test_a_record_whose_link_failed_after_its_write_brings_the_message_back(
    stage: Stage, make_settings
):
    """The write stood (the record is `committed`) but the next stage refused its send:
    the message is not settled, and its next delivery finds the output and links it."""
    first, second = rows_for(41), rows_for(42)
    put(stage, "in/l1.npy", first)
    put(stage, "in/l2.npy", second)
    stage.send({"Records": [_record(stage, "in/l1.npy"), _record(stage, "in/l2.npy")]})

    async with fault_proxy(stage, FaultPlan(refusing={"SendMessageBatch": 1.0})) as proxy:
        settings = event_settings(
            make_settings,
            next_queue_url=stage.next_url,
            endpoint_url=proxy.url,
            retry_base_s=1,
            chain_settle_s=600,
        )
        async with running(settings) as worker:
            await eventually(lambda: outcome_count(worker, "committed") == 2, timeout_s=60)
            proxy.plan.refusing = {}  # the next stage takes sends again
            await eventually(lambda: outcome_count(worker, "duplicate") == 2, timeout_s=60)
            await eventually(settled(stage), timeout_s=60)

    scored(stage, {"out/l1.npy": first, "out/l2.npy": second})
    assert handed_on(stage) == {
        "l1": f"s3://{stage.bucket}/out/l1.npy",
        "l2": f"s3://{stage.bucket}/out/l2.npy",
    }
