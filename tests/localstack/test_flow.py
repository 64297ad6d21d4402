"""The real worker's two-stage flow on LocalStack: formats, duplicates, bad messages, chain.

Two workers (stage 1 scores the inputs, stage 2 scores stage 1's outputs) serve in this
event loop as `running()` runs them against moto; only the endpoint differs.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import numpy as np
import pytest

from sqsinfer.aws.sqs import REASON_ATTR
from sqsinfer.lab import synthetic
from tests.conftest import N_FEATURES, Stage, eventually, running, sample

FORMATS = ("npy", "json", "jsonl", "csv")
VALID_TASKS = 8
# These tasks are sent twice, side by side: both deliveries are held at once, so both may
# compute and the conditional put decides (412 for the loser).
DUPLICATED = (0, 3, 5)


@pytest.fixture(scope="module")
def stage2_model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("model2") / "model2.json"
    return synthetic.train_model(str(path), 1, trees=5, depth=2, seed=2)


def _valid(stage: Stage) -> tuple[dict[str, np.ndarray], list[str]]:
    """Inputs in every format: task id → rows, and their message bodies."""
    rows, bodies = {}, []
    for i in range(VALID_TASKS):
        fmt = FORMATS[i % len(FORMATS)]
        task_id = f"task-{i}"
        rows[task_id] = synthetic.make_rows(3 + i, N_FEATURES, seed=100 + i)
        uri = stage.put_input(f"{task_id}.{fmt}", synthetic.encode_input(rows[task_id], fmt))
        bodies.append(json.dumps({"task_id": task_id, "input": uri}))
    return rows, bodies


def _bad(stage: Stage) -> dict[str, str]:
    """Bodies that must end in stage 1's DLQ, each with its reason."""
    garbage = stage.put_input("garbage.npy", b"\x93NUMPY\x01\x00not an array")
    missing = f"s3://{stage.bucket}/in/nowhere.npy"
    return {
        '{"task_id": "broken", "input": ': "malformed_json",
        json.dumps({"input": garbage}): "missing_field",
        json.dumps({"task_id": "t-missing", "input": missing}): "input_not_found",
        json.dumps({"task_id": "t-garbage", "input": garbage}): "undecodable_input",
    }


def _enqueue(stage: Stage, bodies: list[str]) -> None:
    for start in range(0, len(bodies), 10):
        entries = [
            {"Id": str(i), "MessageBody": text} for i, text in enumerate(bodies[start : start + 10])
        ]
        response = stage.sqs.send_message_batch(QueueUrl=stage.queue_url, Entries=entries)
        assert not response.get("Failed"), response["Failed"]


def _versions(stage: Stage) -> Counter[str]:
    """How many versions each object has: more than one means it was overwritten."""
    found: Counter[str] = Counter()
    pages = stage.s3.get_paginator("list_object_versions").paginate(Bucket=stage.bucket)
    for page in pages:
        found.update(v["Key"] for v in page.get("Versions", []))
    return found


def _decoded(objects: dict[str, bytes]) -> dict[str, np.ndarray]:
    return {
        key: synthetic.decode_output(data, "npy")
        for key, data in objects.items()
        if not key.endswith(".chain")
    }


def _outcomes(worker: Any) -> dict[str, int]:
    return {k: v for k, v in worker.metrics.outcomes.items() if v}


async def test_two_stages_with_duplicates_and_bad_messages(
    stage: Stage, make_settings, model_path: str, stage2_model_path: str
):
    stage.s3.put_bucket_versioning(
        Bucket=stage.bucket, VersioningConfiguration={"Status": "Enabled"}
    )
    rows, bodies = _valid(stage)
    bad = _bad(stage)
    twice = [[text, text] if i in DUPLICATED else [text] for i, text in enumerate(bodies)]
    _enqueue(stage, [text for group in twice for text in group] + list(bad))
    first = make_settings(next_queue_url=stage.next_url, chain_settle_s=2)
    second = make_settings(
        queue_url=stage.next_url,
        model_path=stage2_model_path,
        allowed_input_prefixes=f"s3://{stage.bucket}/out/",
        output_prefix=f"s3://{stage.bucket}/out2/",
    )
    async with running(first) as stage1, running(second) as stage2:

        def settled() -> bool:
            one, two = stage1.metrics.outcomes, stage2.metrics.outcomes
            return (
                one["committed"] + one["duplicate"] == VALID_TASKS + len(DUPLICATED)
                and one["rejected"] == len(bad)
                and two["committed"] + two["duplicate"] + two["rejected"] >= VALID_TASKS
            )

        await eventually(settled, timeout_s=120)

    # Stage 1: one output per task, equal to a direct prediction, and one chain link each.
    outputs1 = stage.outputs("out/")
    assert sorted(k for k in outputs1 if k.endswith(".chain")) == sorted(
        f"out/{t}.npy.chain" for t in rows
    )
    got1 = _decoded(outputs1)
    assert sorted(got1) == sorted(f"out/{t}.npy" for t in rows)
    model1, model2 = synthetic.predictor(model_path), synthetic.predictor(stage2_model_path)
    for task_id, array in rows.items():
        want = model1.predict(array).reshape(-1, 1)
        np.testing.assert_allclose(got1[f"out/{task_id}.npy"], want, rtol=1e-6)
    # Stage 2: each stage-1 output scored exactly once (no downstream duplicate message).
    got2 = _decoded(stage.outputs("out2/"))
    assert sorted(got2) == sorted(f"out2/{t}.npy" for t in rows)
    for task_id in rows:
        want = model2.predict(got1[f"out/{task_id}.npy"].reshape(-1, 1)).reshape(-1, 1)
        np.testing.assert_allclose(got2[f"out2/{task_id}.npy"], want, rtol=1e-6)
    assert _outcomes(stage2) == {"committed": VALID_TASKS}
    for kind in ("certain", "possible"):
        assert sample(stage1.metrics, "sqsinfer_chain_duplicates_total", kind=kind) == 0
    # Every delivery of a duplicated task found the output; none overwrote anything.
    assert stage1.metrics.outcomes["committed"] == VALID_TASKS
    assert stage1.metrics.outcomes["duplicate"] == len(DUPLICATED)
    # (The chain markers are rewritten on purpose: intent, then "sent", each conditional.)
    outputs_versions = {k: n for k, n in _versions(stage).items() if not k.endswith(".chain")}
    assert set(outputs_versions.values()) == {1}
    # The bad ones, and only they, in stage 1's DLQ with their reasons; nothing left over.
    dead = stage.drain_queue(stage.dlq_url)
    assert {m["Body"]: m["MessageAttributes"][REASON_ATTR]["StringValue"] for m in dead} == bad
    assert len(dead) == len(bad)
    assert stage.drain_queue(stage.next_dlq_url) == []
    for url in (stage.queue_url, stage.next_url, stage.dlq_url, stage.next_dlq_url):
        assert stage.counts(url) == (0, 0)
