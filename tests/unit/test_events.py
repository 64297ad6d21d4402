"""S3 event notifications as tasks: every shape, the key encodings, the key → task rule."""

from __future__ import annotations

import dataclasses
import json
from typing import Any
from urllib.parse import quote_plus

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sqsinfer import events, lineage
from sqsinfer.compute.errors import InputError
from sqsinfer.events import Ignored, Kind, Shape, parse_body, task_id_for
from sqsinfer.messages import (
    MAX_OUTPUT_KEY_BYTES,
    MAX_TASK_ID_CHARS,
    MessageRules,
    S3Uri,
    Task,
    next_stage_body,
    parse_prefixes,
    parse_s3_uri,
    parse_task,
    task_id_problem,
)

RULES = MessageRules(
    allowed_input_prefixes=parse_prefixes("s3://data/in/, s3://data/in/deep/, s3://raw/", "in"),
    allowed_output_prefixes=parse_prefixes("s3://data/out/", "out"),
    output_prefix=parse_s3_uri("s3://data/out/", "out", prefix=True),
    output_suffix=".npy",
    message_shape="s3-event",
)
AUTO = dataclasses.replace(RULES, message_shape="auto")
TASKS = dataclasses.replace(RULES, message_shape="sqsinfer")
# The stage after RULES': task messages naming RULES' outputs as inputs.
STAGE2 = MessageRules(
    allowed_input_prefixes=parse_prefixes("s3://data/out/", "in"),
    allowed_output_prefixes=parse_prefixes("s3://data/stage2/", "out"),
    output_prefix=parse_s3_uri("s3://data/stage2/", "out", prefix=True),
)


def record(key: str, name: str = "ObjectCreated:Put", bucket: str = "data", **obj: Any) -> dict:
    """A record as S3 sends it: the key already URL-encoded by the caller."""
    return {
        "eventVersion": "2.1",
        "eventSource": "aws:s3",
        "eventName": name,
        "s3": {"bucket": {"name": bucket}, "object": {"key": key, "size": 5, **obj}},
    }


def s3_body(*records: dict) -> str:
    return json.dumps({"Records": list(records)})


def sns_body(inner: str) -> str:
    return json.dumps(
        {"Type": "Notification", "MessageId": "m", "TopicArn": "arn:t", "Message": inner}
    )


def eventbridge_body(key: str, detail_type: str = "Object Created", **obj: Any) -> str:
    return json.dumps(
        {
            "version": "0",
            "detail-type": detail_type,
            "source": "aws.s3",
            "detail": {"bucket": {"name": "data"}, "object": {"key": key, **obj}},
        }
    )


def only_task(body: str, rules: MessageRules = RULES) -> Task:
    [found] = parse_body(body, rules).records
    assert isinstance(found.item, Task), found.item
    return found.item


def refusal(body: str, rules: MessageRules = RULES) -> str:
    """The reason the body's one record (or the body itself) is refused."""
    try:
        [found] = parse_body(body, rules).records
    except InputError as exc:
        return exc.reason
    assert isinstance(found.item, InputError), found.item
    assert found.kind == Kind.INVALID
    return found.item.reason


# -- the keys: decoded as AWS documents it, per shape ----------------------------------------


def test_a_records_key_is_url_decoded_space_plus_slash_and_unicode():
    # As moto sends it: a space `+`, `+` `%2B`, `/` `%2F`, `ü` in UTF-8, `=` `%3D`.
    task = only_task(s3_body(record("in%2Fa+b%2Bc%2F%C3%BC%3D1.npy")))
    assert task.input == S3Uri("data", "in/a b+c/ü=1.npy")
    assert task.output == S3Uri("data", "out/a b+c/ü=1.npy")
    assert task.task_id == "a=20b+c/=C3=BC=3D1"
    assert (task.from_event, task.input_version, task.params) == (True, None, {})


def test_a_slash_left_as_it_is_decodes_the_same():
    # AWS leaves `/` unencoded; quote_plus (moto) encodes it: both name one key.
    assert only_task(s3_body(record("in/x/y+z.csv"))) == only_task(
        s3_body(record("in%2Fx%2Fy+z.csv"))
    )


def test_an_eventbridge_key_is_the_key_itself():
    task = only_task(eventbridge_body("in/a+b c.npy"))
    assert task.input == S3Uri("data", "in/a+b c.npy")  # `+` stays a plus
    assert task.task_id == "a+b=20c"


def test_sns_wraps_the_same_body_and_raw_delivery_is_the_body_itself():
    body = s3_body(record(quote_plus("in/sub dir/ä.npy")))
    wrapped, raw = parse_body(sns_body(body), RULES), parse_body(body, RULES)
    assert (wrapped.shape, raw.shape) == (Shape.SNS, Shape.S3)
    assert wrapped.records[0].item == raw.records[0].item
    assert raw.records[0].item.input.key == "in/sub dir/ä.npy"


def test_eventbridge_through_sns_is_read_too():
    found = parse_body(sns_body(eventbridge_body("in/a.npy")), RULES)
    assert found.shape == Shape.SNS and isinstance(found.records[0].item, Task)


def test_a_key_that_is_not_url_encoded_utf8_is_refused():
    assert refusal(s3_body(record("in/%C3%28.npy"))) == "invalid_field"


# -- the key → task id → output rule ----------------------------------------------------------


def test_the_longest_allowed_prefix_is_taken_off():
    task = only_task(s3_body(record("in/deep/x.json")))
    assert task.output == S3Uri("data", "out/x.npy") and task.task_id == "x"
    other = only_task(eventbridge_body("in/deep2/x.json"))
    assert other.output == S3Uri("data", "out/deep2/x.npy")


def test_another_bucket_under_an_allowed_prefix_writes_to_the_output_prefix():
    task = only_task(s3_body(record("2026/11/x.parquet", bucket="raw")))
    assert task.input == S3Uri("raw", "2026/11/x.parquet")
    assert task.output == S3Uri("data", "out/2026/11/x.npy")
    assert task.input_format == "parquet" and task.output_format == "npy"


def test_the_output_format_sets_the_output_suffix():
    json_rules = dataclasses.replace(RULES, output_suffix=".json")
    assert only_task(s3_body(record("in/a.b.csv")), json_rules).output.key == "out/a.b.json"


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        ("secret/x.npy", "input_not_allowed"),
        ("in/x.txt", "unsupported_format"),
        ("in/folder/", "unsupported_format"),
        ("in/a%25b.npy", "invalid_field"),  # `%`: refused in every key, as in task messages
        ("in/a%3Fb.npy", "invalid_field"),  # `?`
        ("in/a%EF%BF%BF.npy", "invalid_field"),  # U+FFFF: SQS refuses it in a message
    ],
)
def test_keys_no_task_can_be_made_of_are_refused_with_a_reason(key, reason):
    assert refusal(s3_body(record(key))) == reason


@pytest.mark.parametrize(
    ("key", "task_id", "output"),
    [
        ("in/a/../x.npy", "a/=2E=2E/x", "out/a/=2E=2E/x.npy"),
        ("in/./x.npy", "0==2E/x", "out/=2E/x.npy"),
        ("in/../x.npy", "0==2E=2E/x", "out/=2E=2E/x.npy"),
        ("in/a/./../b/x.csv", "a/=2E/=2E=2E/b/x", "out/a/=2E/=2E=2E/b/x.npy"),
        ("in/.../x.npy", "0=.../x", "out/.../x.npy"),  # three dots: a name like any other
    ],
)
def test_a_segment_of_dots_alone_is_escaped_in_the_task_id_and_the_output_key(key, task_id, output):
    task = only_task(s3_body(record(quote_plus(key, safe="/"))), RULES)
    assert (task.task_id, task.input.key, task.output.key) == (task_id, key, output)
    # The next stage takes the output as the input of a task message, which refuses dots.
    handed_on = parse_task(next_stage_body(task), STAGE2)
    assert (handed_on.task_id, handed_on.input) == (task.task_id, task.output)


def test_a_task_message_naming_a_key_with_a_segment_of_dots_is_still_refused():
    body = json.dumps({"task_id": "t", "input": "s3://data/in/a/../x.npy"})
    with pytest.raises(InputError) as refused:
        parse_task(body, TASKS)
    assert refused.value.reason == "invalid_field" and "'..'" in refused.value.detail


def test_an_output_key_over_the_limit_is_refused_naming_the_input():
    key = "in/" + "k" * (MAX_OUTPUT_KEY_BYTES - len("out/") - len(".npy") + 1) + ".csv"
    assert len(key.encode()) <= 1024  # a key S3 takes, whose output would not fit
    [found] = parse_body(s3_body(record(key)), RULES).records
    assert isinstance(found.item, InputError) and found.item.reason == "invalid_field"
    assert "derived from the input key" in found.item.detail


def test_task_ids_are_valid_and_distinct_for_keys_that_are_not():
    stems = ["a b", "a=20b", "a+b", "a%b", "-x", "0=-x", "_s", ".hidden/x", "a/.", "a/..", "ü"]
    ids = [task_id_for(s) for s in stems]
    assert len(set(ids)) == len(stems)
    assert all(task_id_problem(i) == "" for i in ids), ids


def test_a_long_key_gets_a_short_task_id_ending_in_its_digest():
    long_a, long_b = "é" * 300 + "a", "é" * 300 + "b"
    id_a, id_b = task_id_for(long_a), task_id_for(long_b)
    assert id_a != id_b and len(id_a) <= MAX_TASK_ID_CHARS and "=sha256:" in id_a
    assert task_id_problem(id_a) == ""


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=300), min_size=2, max_size=2, unique=True))
def test_distinct_stems_never_share_a_task_id(stems):
    try:
        ids = [task_id_for(s) for s in stems]
    except InputError:
        return  # a stem no key can have (an empty segment: refused before, in the key)
    assert ids[0] != ids[1]
    assert all(task_id_problem(i) == "" and i.isascii() for i in ids)


def test_the_next_stage_gets_a_task_message_it_accepts():
    task = only_task(s3_body(record(quote_plus("in/α β+γ.csv"))))
    handed = parse_task(next_stage_body(task), STAGE2)
    assert (handed.task_id, handed.input) == (task.task_id, task.output)


# -- versions -----------------------------------------------------------------------------


def test_the_version_an_event_names_is_kept():
    assert (
        only_task(
            s3_body(record("in/a.npy", versionId="3sL4kqtJlcpXroDTDmJ+rmSpXd3dIbrHY"))
        ).input_version
        == "3sL4kqtJlcpXroDTDmJ+rmSpXd3dIbrHY"
    )
    assert only_task(eventbridge_body("in/a.npy", **{"version-id": "v2"})).input_version == "v2"
    assert only_task(s3_body(record("in/a.npy", versionId=None))).input_version is None
    assert only_task(s3_body(record("in/a.npy", versionId="null"))).input_version is None


@pytest.mark.parametrize("version", ["", "a b", "v\u00e9", 7, "x" * 257])
def test_a_version_id_that_is_no_version_id_is_refused(version):
    """Nor one longer than its output's lineage holds (S3's own are 32 characters)."""
    assert refusal(s3_body(record("in/a.npy", versionId=version))) == "invalid_field"


def test_the_longest_version_an_event_may_name_is_written_in_its_outputs_lineage():
    longest = "x" * lineage.MAX_VALUE_BYTES[lineage.INPUT_VERSION_ID]
    task = only_task(s3_body(record("in/a.npy", versionId=longest)))
    producer = lineage.Producer("f" * 64, "xgboost", "2.1", "pod-7")
    written = lineage.Written(
        task.task_id, "m", "d", "o" * 64, "e", task.input_version or "", events.input_digest(task)
    )
    metadata = lineage.output_metadata(producer, written)
    assert metadata["input-version-id"] == longest
    assert events.provenance_conflict(task, metadata) == ""


def test_an_output_made_from_another_input_or_version_is_told_apart():
    task = only_task(s3_body(record("in/a.npy", versionId="v1")))
    made = {"input-uri-sha256": events.input_digest(task), "input-version-id": "v1"}
    assert events.provenance_conflict(task, made) == ""
    newer = dataclasses.replace(task, input_version="v2")
    assert "version v1" in events.provenance_conflict(newer, made)
    csv = only_task(s3_body(record("in/a.csv")))  # the same task id and output key
    assert (csv.task_id, csv.output) == (task.task_id, task.output)
    assert "another input key" in events.provenance_conflict(csv, made)
    # A key that spells a dot segment's escape shares its output key (not its task id):
    # whichever comes second is told apart by the input it was made from.
    dots = only_task(s3_body(record("in/d/../e.npy")))
    spelled = only_task(s3_body(record("in/d/%3D2E%3D2E/e.npy")))
    assert dots.output == spelled.output and dots.task_id != spelled.task_id
    dots_made = {"input-uri-sha256": events.input_digest(dots)}
    assert "another input key" in events.provenance_conflict(spelled, dots_made)
    # A task message's output records nothing of its input, and is checked by owner alone.
    plain = dataclasses.replace(task, from_event=False)
    assert events.input_digest(plain) == "" and events.provenance_conflict(plain, made) == ""


# -- what is ignored, and what a body of several records holds ---------------------------------


def test_the_test_event_is_ignored_directly_and_through_sns():
    test = json.dumps({"Service": "Amazon S3", "Event": "s3:TestEvent", "Bucket": "data"})
    for body, shape in ((test, Shape.S3), (sns_body(test), Shape.SNS)):
        found = parse_body(body, RULES)
        assert found.shape == shape
        assert [r.item for r in found.records] == [Ignored(Kind.TEST, "s3:TestEvent")]


def test_events_that_name_no_new_object_are_ignored():
    removed = parse_body(s3_body(record("in/a.npy", "ObjectRemoved:Delete")), RULES)
    assert removed.records[0].item == Ignored(Kind.OTHER, "ObjectRemoved:Delete")
    deleted = parse_body(eventbridge_body("in/a.npy", "Object Deleted"), RULES)
    assert deleted.records[0].item == Ignored(Kind.OTHER, "Object Deleted")
    # Ignored whatever else it holds: a removal needs no readable key.
    bare = parse_body(s3_body({"eventName": "ObjectRestore:Completed"}), RULES)
    assert bare.records[0].kind == Kind.OTHER


def test_a_body_of_several_records_gives_each_its_own_item():
    found = parse_body(
        s3_body(
            record("in/a.npy"),
            record("in/b.npy", "ObjectRemoved:Delete"),
            record("secret/c.npy"),
            {"eventName": "ObjectCreated:Put"},
        ),
        RULES,
    )
    kinds = [r.kind for r in found.records]
    assert kinds == [Kind.CREATED, Kind.OTHER, Kind.INVALID, Kind.INVALID]
    assert found.records[3].item.reason == "missing_field"
    # Each record alone, as S3's body of one record: what a rejected one's DLQ copy holds.
    alone = json.loads(found.records[2].alone())
    assert alone == {"Records": [record("secret/c.npy")]}
    assert isinstance(parse_body(found.records[0].alone(), RULES).records[0].item, Task)


# -- the setting: which shapes a worker reads -------------------------------------------------


def test_auto_reads_task_messages_and_events_alike():
    task = json.dumps({"task_id": "t", "input": "s3://data/in/t.npy"})
    assert parse_body(task, AUTO).shape == Shape.SQSINFER
    assert parse_body(s3_body(record("in/a.npy")), AUTO).shape == Shape.S3
    assert parse_body(eventbridge_body("in/a.npy"), AUTO).shape == Shape.EVENTBRIDGE


def test_each_setting_refuses_the_other_shape_with_a_reason_that_says_so():
    task = json.dumps({"task_id": "t", "input": "s3://data/in/t.npy"})
    with pytest.raises(InputError) as caught:
        parse_body(task, RULES)
    assert caught.value.reason == "missing_field" and "s3-event" in caught.value.detail
    with pytest.raises(InputError) as caught:
        parse_body(s3_body(record("in/a.npy")), TASKS)
    assert caught.value.reason == "missing_field"
    assert "set message_shape to s3-event or auto" in caught.value.detail


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("{", "malformed_json"),
        ("[]", "malformed_json"),
        ('{"Records": []}', "missing_field"),
        ('{"Records": {}}', "invalid_field"),
        ('{"Records": [1]}', "invalid_field"),
        ('{"Records": [{"eventName": 1}]}', "invalid_field"),
        ('{"Records": [{"eventName": "ObjectCreated:Put"}]}', "missing_field"),
        (
            '{"Records": [{"eventName": "ObjectCreated:Put", "s3": {"bucket": {}}}]}',
            "missing_field",
        ),
        (
            '{"Records": [{"eventName": "ObjectCreated:Put", "eventSource": "aws:sqs"}]}',
            "invalid_field",
        ),
        (sns_body("not json"), "malformed_json"),
        (sns_body('{"hello": 1}'), "missing_field"),
        (json.dumps({"Type": "Notification", "Message": 5}), "invalid_field"),
        (json.dumps({"source": "aws.ec2", "detail-type": "x", "detail": {}}), "invalid_field"),
        (
            json.dumps({"source": "aws.s3", "detail-type": "Object Created", "detail": []}),
            "invalid_field",
        ),
        (s3_body(record("in/a.npy", bucket="Not_A_Bucket")), "invalid_field"),
        (s3_body(record("in/a.npy", bucket="a/b")), "invalid_field"),
        ('{"hello": "world"}', "missing_field"),
    ],
)
def test_malformed_events_are_refused_never_guessed(body, reason):
    for rules in (RULES, AUTO):
        assert refusal(body, rules) == reason
