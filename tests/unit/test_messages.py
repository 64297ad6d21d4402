"""Message parsing and the prefix allow-lists (pure: no queue needed)."""

from __future__ import annotations

import json

import orjson
import pytest

from sqsinfer.compute.errors import InputError
from sqsinfer.messages import (
    MAX_OUTPUT_KEY_BYTES,
    OUTPUT_MARKER_RESERVE_BYTES,
    MessageRules,
    S3Uri,
    next_stage_body,
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
    with pytest.raises(InputError) as caught:
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


# -- every permanent problem is found at parse time ----------------------------------
def body_with(**fields: object) -> str:
    return json.dumps({"task_id": "t", "input": "s3://data/in/a.npy"} | fields)


@pytest.mark.parametrize("task_id", ["t\n", "user-42\n", "a/b\n"])
def test_a_task_id_with_a_trailing_newline_is_refused(task_id):
    assert reason(body_with(task_id=task_id)) == "invalid_field"


@pytest.mark.parametrize("uri", ["s3://data\n/in/a.npy", "s3://data/in/a.npy\n"])
def test_a_uri_with_a_trailing_newline_is_refused(uri):
    with pytest.raises(ValueError):
        parse_s3_uri(uri, "input")


def rules_with_prefix(prefix_key: str) -> MessageRules:
    out = parse_s3_uri(f"s3://data/{prefix_key}", "out", prefix=True)
    return MessageRules(RULES.allowed_input_prefixes, (out,), out, ".npy", 100_000)


def test_a_derived_output_key_is_held_to_the_key_length_limit():
    rules = rules_with_prefix("o" * 600 + "/")
    fits = "t" * (MAX_OUTPUT_KEY_BYTES - 601 - len(".npy"))
    assert len(parse_task(body_with(task_id=fits), rules).output.key) == MAX_OUTPUT_KEY_BYTES
    with pytest.raises(InputError) as caught:
        parse_task(body_with(task_id=fits + "x"), rules)
    assert caught.value.reason == "invalid_field"
    assert "output key" in caught.value.detail and "1024" in caught.value.detail


def test_an_output_key_leaves_room_for_its_markers():
    rules = rules_with_prefix("out/")
    head = "out/" + "k" * (MAX_OUTPUT_KEY_BYTES - len("out/") - len(".npy"))
    task = parse_task(body_with(output=f"s3://data/{head}.npy"), rules)
    assert len(task.output.key) + OUTPUT_MARKER_RESERVE_BYTES == 1024
    # Within S3's own limit, but its `.chain` marker would not be.
    too_long = f"s3://data/{head}k.npy"
    with pytest.raises(InputError) as caught:
        parse_task(body_with(output=too_long), rules)
    assert caught.value.reason == "invalid_field"
    assert "marker" in caught.value.detail


def test_the_marker_reserve_covers_the_chain_marker():
    from sqsinfer.worker.chain import MARKER_SUFFIX

    assert len(MARKER_SUFFIX.encode()) <= OUTPUT_MARKER_RESERVE_BYTES


NOT_XML = ["\uffff", "\ufffe", "\x00", "\x1f", "\x0b"]


@pytest.mark.parametrize("char", NOT_XML)
@pytest.mark.parametrize("name", ["input", "output"])
def test_characters_sqs_refuses_are_refused_in_keys(char, name):
    key = "in/a" if name == "input" else "out/a"
    assert reason(body_with(**{name: f"s3://data/{key}{char}b.npy"})) == "invalid_field"


@pytest.mark.parametrize("char", [*NOT_XML, "\U0001f600", "é", "\u2028"])
def test_params_with_any_character_make_a_sendable_next_stage_body(char):
    params = {"note" + char: ["x" + char, {"k": char}]}
    task = parse_task(body_with(params=params), RULES)
    body = next_stage_body(task)
    assert body.isascii()
    assert orjson.loads(body) == {"task_id": "t", "input": "s3://data/out/t.npy", "params": params}


def test_an_explicit_output_may_name_the_model_and_is_filled_with_the_workers():
    prefix = parse_s3_uri("s3://data/out/{model_sha256_12}", "out", prefix=True)
    rules = MessageRules(
        allowed_input_prefixes=RULES.allowed_input_prefixes,
        allowed_output_prefixes=(S3Uri("data", "out/abcdef012345/"),),
        output_prefix=S3Uri("data", "out/abcdef012345/"),
        placeholders={"model_sha256_12": "abcdef012345"},
    )
    body = {"task_id": "t", "input": "s3://data/in/a.npy", "output": str(prefix) + "t.json"}
    assert str(parse_task(json.dumps(body), rules).output) == "s3://data/out/abcdef012345/t.json"
    # Unknown, or without a value on this worker: refused, never written under the braces.
    for name in ("model_sha", "model_version"):
        body["output"] = f"s3://data/out/{{{name}}}/t.json"
        with pytest.raises(InputError) as caught:
            parse_task(json.dumps(body), rules)
        assert caught.value.reason == "invalid_field" and name in caught.value.detail
    # A tool that does not know the model checks the names and leaves them in place.
    body["output"] = "s3://data/out/{model_sha256_12}/t.json"
    assert parse_task(json.dumps(body), RULES).output.key == "out/{model_sha256_12}/t.json"
