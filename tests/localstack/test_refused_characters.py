"""A task carrying a character SQS refuses (outside XML's range) must still end cleanly.

The producer's JSON escapes it (`\\uffff` is plain ASCII), so SQS takes the message; once
parsed, the character is in the task. Correct is either of: rejected into the DLQ with
reason `invalid_field` (nothing written, nothing sent on), or processed with every send
succeeding (the next stage gets the same values). moto accepts every send, so only a
stand-in that refuses the character, as AWS does, can tell.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from sqsinfer.aws.sqs import REASON_ATTR
from sqsinfer.lab import synthetic
from tests.conftest import N_FEATURES, Stage, eventually, running

REFUSED = "\uffff"


def _task(stage: Stage, field: str) -> dict[str, Any]:
    uri = stage.put_input(
        "a.npy", synthetic.encode_input(synthetic.make_rows(2, N_FEATURES, 1), "npy")
    )
    task: dict[str, Any] = {"task_id": "odd-1", "input": uri, "params": {"note": "plain"}}
    if field == "params":
        task["params"] = {"note": f"a{REFUSED}b"}
    elif field == "task_id":
        task["task_id"] = f"odd{REFUSED}1"
    else:  # an input key that passes the allow-list and is then not found
        task["input"] = uri.replace("a.npy", f"a{REFUSED}.npy")
    return task


# The correct endings: rejected with one of these reasons, or processed. An input key with
# the character cannot be processed (no such object); if the fix escapes rather than
# refuses, its rejection for being absent is also a clean ending.
CLEAN_REASONS = {"params": {"invalid_field"}, "task_id": {"invalid_field"}}
CLEAN_REASONS["input"] = {"invalid_field", "input_not_found"}


def what_happened(stage: Stage, task: dict[str, Any]) -> str:
    """How the message ended, in words: "rejected: REASON", "processed", or the facts."""
    outputs = stage.outputs()
    dead = stage.drain_queue(stage.dlq_url)
    sent = [json.loads(m["Body"]) for m in stage.drain_queue(stage.next_url)]
    reasons = [m.get("MessageAttributes", {}).get(REASON_ATTR, {}).get("StringValue") for m in dead]
    if len(reasons) == 1 and reasons[0] and not outputs and not sent:
        return f"rejected: {reasons[0]}"
    processed = (
        not dead
        and len(sent) == 1
        and sent[0]["task_id"] == task["task_id"]
        and sent[0]["params"] == task["params"]
        and sorted(outputs) == [f"out/{task['task_id']}.npy", f"out/{task['task_id']}.npy.chain"]
    )
    if processed:
        return "processed"
    return (
        f"outputs {sorted(outputs)}, {len(sent)} next-stage message(s), "
        f"DLQ {len(dead)} message(s) with reasons {reasons}"
    )


def _ended(worker: Any) -> bool:
    """Whether a delivery reached an outcome that ends its message (not a retry)."""
    return any(worker.metrics.outcomes[o] for o in ("committed", "duplicate", "rejected"))


@pytest.mark.parametrize(
    "field",
    [
        "params",  # escaped: the next-stage body is ASCII-only JSON
        "task_id",  # refused by the task id's alphabet; the detail does not quote it
        "input",  # refused as invalid_field; the DLQ copy's attributes are sanitised
    ],
)
async def test_a_task_with_a_refused_character_ends_cleanly(stage: Stage, make_settings, field):
    task = _task(stage, field)
    stage.send(json.dumps(task))  # ensure_ascii: the body itself is plain ASCII
    settings = make_settings(next_queue_url=stage.next_url, chain_settle_s=1, retry_base_s=1)
    async with running(settings) as worker:
        # An ending outcome as well as an empty queue: a count taken while a receive is
        # under way can read (0, 0) with the message still about to be in flight.
        await eventually(
            lambda: _ended(worker) and stage.counts(stage.queue_url) == (0, 0), timeout_s=90
        )
        outcomes = {k: v for k, v in worker.metrics.outcomes.items() if v}
    happened = what_happened(stage, task)
    clean = {"processed"} | {f"rejected: {reason}" for reason in CLEAN_REASONS[field]}
    assert happened in clean, f"{happened}; worker outcomes {outcomes}"
