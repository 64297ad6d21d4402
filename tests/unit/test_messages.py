"""Message parsing and the prefix allow-lists (pure: no queue needed)."""

from __future__ import annotations

import json

import pytest

from sqsinfer.messages import (
    MessageRejected,
    MessageRules,
    S3Uri,
    parse_prefixes,
    parse_s3_uri,
    parse_task,
)

RULES = MessageRules(
    allowed_input_prefixes=parse_prefixes("s3://data/in/, s3://shared/", "in"),
    allowed_output_prefixes=parse_prefixes("s3://data/out/", "out"),
    output_prefix=parse_s3_uri("s3://data/out", "out", prefix=True),
    output_suffix=".npy",
    max_message_bytes=1000,
)


def reason(body: str | dict) -> str:
    text = body if isinstance(body, str) else json.dumps(body)
    with pytest.raises(MessageRejected) as caught:
        parse_task(text, RULES)
    return caught.value.reason


def test_a_valid_message_derives_its_output_from_the_task_id():
    task = parse_task(
        json.dumps({"task_id": "user-42/2026-11-01", "input": "s3://data/in/a.csv"}), RULES
    )
    assert task.output == S3Uri("data", "out/user-42/2026-11-01.npy")
    assert (task.input_format, task.output_format, task.params) == ("csv", "npy", {})


def test_an_explicit_output_and_params_are_kept():
    task = parse_task(
        json.dumps(
            {
                "task_id": "t",
                "input": "s3://shared/x.jsonl",
                "output": "s3://data/out/t.json",
                "params": {"a": 1},
                "trace": "ignored",
            }
        ),
        RULES,
    )
    assert (str(task.output), task.output_format, task.params) == (
        "s3://data/out/t.json",
        "json",
        {"a": 1},
    )


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("{", "malformed_json"),
        ('"just a string"', "malformed_json"),
        ({"task_id": "t"}, "missing_field"),
        ({"input": "s3://data/in/a.npy"}, "missing_field"),
        ({"task_id": 7, "input": "s3://data/in/a.npy"}, "invalid_field"),
        ({"task_id": "", "input": "s3://data/in/a.npy"}, "invalid_field"),
        ({"task_id": "a//b", "input": "s3://data/in/a.npy"}, "invalid_field"),
        ({"task_id": "a/../b", "input": "s3://data/in/a.npy"}, "invalid_field"),
        ({"task_id": "a b", "input": "s3://data/in/a.npy"}, "invalid_field"),
        ({"task_id": "x" * 600, "input": "s3://data/in/a.npy"}, "invalid_field"),
        ({"task_id": "t", "input": 5}, "invalid_field"),
        ({"task_id": "t", "input": "S3://data/in/a.npy"}, "invalid_field"),
        ({"task_id": "t", "input": "s3://data/in/../secret.npy"}, "invalid_field"),
        ({"task_id": "t", "input": "s3://data/in/./a.npy"}, "invalid_field"),
        ({"task_id": "t", "input": "s3://data/in/a.npy?versionId=1"}, "invalid_field"),
        ({"task_id": "t", "input": "s3://data/in/%2e%2e/a.npy"}, "invalid_field"),
        ({"task_id": "t", "input": "s3://data@evil/in/a.npy"}, "invalid_field"),
        ({"task_id": "t", "input": "s3://data/in\\a.npy"}, "invalid_field"),
        ({"task_id": "t", "input": "s3://data/inside/a.npy"}, "input_not_allowed"),
        ({"task_id": "t", "input": "s3://data/a.npy"}, "input_not_allowed"),
        ({"task_id": "t", "input": "s3://data-in/in/a.npy"}, "input_not_allowed"),
        ({"task_id": "t", "input": "s3://data/in/a.pkl"}, "unsupported_format"),
        ({"task_id": "t", "input": "s3://data/in/noext"}, "unsupported_format"),
        (
            {"task_id": "t", "input": "s3://data/in/a.npy", "output": "s3://data/in/o.npy"},
            "output_not_allowed",
        ),
        (
            {"task_id": "t", "input": "s3://data/in/a.npy", "output": "s3://data/out/o.csv"},
            "unsupported_format",
        ),
        ({"task_id": "t", "input": "s3://data/in/a.npy", "params": "x"}, "invalid_field"),
        ({"task_id": "t", "input": "s3://data/in/a.npy", "pad": "x" * 2000}, "message_too_large"),
    ],
)
def test_bad_messages_are_rejected_with_a_reason(body, expected):
    assert reason(body) == expected


def test_prefixes_end_on_a_folder_boundary():
    (prefix,) = parse_prefixes("s3://bkt/in", "x")
    assert prefix == S3Uri("bkt", "in/")
    assert S3Uri("bkt", "in/x.npy").within(prefix)
    assert not S3Uri("bkt", "inside/x.npy").within(prefix)
    (whole,) = parse_prefixes("s3://bkt", "x")
    assert S3Uri("bkt", "any/x.npy").within(whole)
    assert not S3Uri("bkt2", "any/x.npy").within(whole)
