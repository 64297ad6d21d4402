"""S3 event notifications as tasks: every shape S3 sends to a queue, parsed into tasks.

A bucket's own notification configuration sends a message for each new object, in one
of these shapes, which `parse_body` tells apart by structure alone:

- S3 → SQS: `{"Records": [...]}`, each record naming a bucket, a URL-encoded key (a
  space as `+`, `+` as `%2B`), maybe a version id. Also what SNS delivers with raw
  message delivery on: the same body.
- S3 → SNS → SQS: an SNS notification (`"Type": "Notification"`) whose `Message` is
  that body as a JSON string.
- S3 → EventBridge → SQS: an event with `"source": "aws.s3"` and `"detail-type":
  "Object Created"`, the bucket and key (not URL-encoded) in `detail`.
- `s3:TestEvent` (S3 sends one when a notification is configured), other S3 events
  (removals, restores, tags) and EventBridge's other detail types: ignored, counted.

Each record that names a new object becomes a Task by one rule: the longest allowed
input prefix the object lies under is replaced by the output prefix, the input's suffix
by the output format's, so every delivery of one event writes the same key (a segment of
dots alone, which an S3 key may hold, escaped as in the task id, so that no output key
holds one); the task id is the remaining key without its suffix, written in the task-id
alphabet (`task_id_for`).

Pure, as `messages` is: no I/O, so every shape and every hostile body is fuzzed.
"""

from __future__ import annotations

import hashlib
import json
import string
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from urllib.parse import unquote_plus

from sqsinfer import lineage
from sqsinfer.compute.errors import InputError
from sqsinfer.messages import (
    DOT_SEGMENTS,
    MAX_TASK_ID_CHARS,
    MessageRules,
    S3Uri,
    Task,
    allowed_prefix,
    build_task,
    input_format,
    load_object,
    object_uri,
    output_key,
    task_from_document,
    task_id_problem,
)

# The values of the `message_shape` setting.
SQSINFER, S3_EVENT, AUTO = "sqsinfer", "s3-event", "auto"
MESSAGE_SHAPES = (SQSINFER, S3_EVENT, AUTO)
# S3's event names in records (`ObjectCreated:Put`; the `s3:` prefix is taken off where
# a sender leaves it on) and EventBridge's detail type, for a new object.
CREATED_PREFIX = "ObjectCreated:"
TEST_EVENT = "s3:TestEvent"
EVENTBRIDGE_CREATED = "Object Created"
_VERSION_CHARS = frozenset(string.printable) - frozenset(string.whitespace)
# An event's version is written into its output's lineage (`input-version-id`), and read
# back from one found there: it must fit (S3's own are 32 characters).
_MAX_VERSION_CHARS = lineage.MAX_VALUE_BYTES[lineage.INPUT_VERSION_ID]
# The characters a task id keeps as they are; every other one is written `=XX`, a byte of
# its UTF-8 at a time (`=` itself included), so distinct keys give distinct ids.
_ID_KEEP = frozenset(string.ascii_letters + string.digits + "._-/:@+")
_LEAD_MARK = "0="  # before an id whose first character is escaped (`0==XX`)
_DIGEST_MARK = "=sha256:"  # never made by the escapes, which are `=` and two hex digits
_DIGEST_CHARS = 64


class Shape(StrEnum):
    """What a body was: the `shape` label of sqsinfer_events_total (events only)."""

    SQSINFER = "sqsinfer"  # a task message
    S3 = "s3"  # S3's own body: sent to SQS directly, or by SNS with raw delivery
    SNS = "sns"  # wrapped in an SNS notification
    EVENTBRIDGE = "eventbridge"


class Kind(StrEnum):
    """What one event was: the `kind` label of sqsinfer_events_total."""

    CREATED = "created"  # a new object: a task
    TEST = "test"  # s3:TestEvent: ignored
    OTHER = "other"  # a removal, a restore, tags...: ignored
    INVALID = "invalid"  # a new object, but not one a task can be made of: rejected


EVENT_SHAPES = (Shape.S3, Shape.SNS, Shape.EVENTBRIDGE)


@dataclass(frozen=True)
class Ignored:
    """An event that names no new object: the message is deleted, counted as `ignored`."""

    kind: Kind
    event: str  # its event name or detail type


@dataclass(frozen=True)
class Record:
    """One record of a body: a task, an ignored event, or why it is rejected."""

    item: Task | Ignored | InputError
    raw: Any = None  # the record as it came (S3 records only: a DLQ copy of it alone)

    @property
    def kind(self) -> Kind:
        if isinstance(self.item, Ignored):
            return self.item.kind
        return Kind.INVALID if isinstance(self.item, InputError) else Kind.CREATED

    def alone(self) -> str:
        """An S3 body holding this record alone: what its DLQ copy carries."""
        return json.dumps({"Records": [self.raw]}, ensure_ascii=False)


@dataclass(frozen=True)
class Body:
    shape: Shape
    records: tuple[Record, ...]


def parse_body(body: str | bytes, rules: MessageRules) -> Body:
    """What a message body asks for, by the `message_shape` rule; InputError for a body
    none of whose records can be read (or, for a task message, any problem)."""
    if rules.message_shape == SQSINFER:
        return _task_message(load_object(body, rules), rules)
    doc = load_object(body, rules)
    if rules.message_shape == AUTO and ("task_id" in doc or "input" in doc):
        return Body(Shape.SQSINFER, (Record(task_from_document(doc, rules)),))
    found = _event(doc, rules, Shape.S3)
    if found is not None:
        return found
    if doc.get("Type") == "Notification" and "Message" in doc:
        return _sns(doc["Message"], rules)
    expected = "task_id and input, or " if rules.message_shape == AUTO else ""
    raise InputError(
        "missing_field",
        f"expected {expected}an S3 event notification: Records, an SNS Notification or "
        f"an EventBridge event (message_shape is {rules.message_shape})",
    )


def _task_message(doc: dict[str, Any], rules: MessageRules) -> Body:
    try:
        return Body(Shape.SQSINFER, (Record(task_from_document(doc, rules)),))
    except InputError as exc:
        if exc.reason == "missing_field" and _event(doc, rules, Shape.S3) is not None:
            hint = "; it is an S3 event notification: set message_shape to s3-event or auto"
            raise InputError(exc.reason, exc.detail + hint) from None
        raise


def _event(doc: dict[str, Any], rules: MessageRules, shape: Shape) -> Body | None:
    """The S3 event `doc` is (its records), or None when it is none of their shapes."""
    if "Records" in doc:
        return Body(shape, _records(doc["Records"], rules))
    if doc.get("Event") == TEST_EVENT:
        return Body(shape, (Record(Ignored(Kind.TEST, TEST_EVENT)),))
    if "detail-type" in doc and "source" in doc and "detail" in doc:
        return Body(Shape.EVENTBRIDGE if shape == Shape.S3 else shape, (_eventbridge(doc, rules),))
    return None


def _sns(message: Any, rules: MessageRules) -> Body:
    if not isinstance(message, str):
        raise InputError("invalid_field", "the SNS notification's Message must be a string")
    inner = load_object(message, rules, "the SNS notification's Message")
    found = _event(inner, rules, Shape.SNS)
    if found is None:
        raise InputError(
            "missing_field", "the SNS notification's Message is no S3 event notification"
        )
    return found


def _records(records: Any, rules: MessageRules) -> tuple[Record, ...]:
    if not isinstance(records, list):
        raise InputError("invalid_field", "Records must be a list")
    if not records:
        raise InputError("missing_field", "Records is empty")
    return tuple(_s3_record(raw, rules) for raw in records)


def _s3_record(raw: Any, rules: MessageRules) -> Record:
    """One record of S3's own body: its key is URL-encoded, as S3 documents."""
    try:
        record = _object(raw, "a record")
        name = _text(record, "eventName", "a record").removeprefix("s3:")
        source = record.get("eventSource", "aws:s3")
        if source != "aws:s3":
            raise InputError("invalid_field", f"eventSource is {str(source)[:40]!r}, not aws:s3")
        if not name.startswith(CREATED_PREFIX):
            return Record(Ignored(Kind.OTHER, name[:80]), raw)
        s3 = _object(record.get("s3"), "s3", missing="a record has no s3")
        bucket = _text(_object(s3.get("bucket"), "s3.bucket"), "name", "s3.bucket")
        obj = _object(s3.get("object"), "s3.object", missing="a record has no s3.object")
        key = _decoded(_text(obj, "key", "s3.object"))
        return Record(task_for_object(bucket, key, obj.get("versionId"), rules), raw)
    except InputError as exc:
        return Record(exc, raw)


def _eventbridge(doc: dict[str, Any], rules: MessageRules) -> Record:
    """EventBridge's event: its key is the key itself, not URL-encoded."""
    try:
        if doc["source"] != "aws.s3":
            raise InputError("invalid_field", f"source is {str(doc['source'])[:40]!r}, not aws.s3")
        detail_type = doc["detail-type"]
        if not isinstance(detail_type, str):
            raise InputError("invalid_field", "detail-type must be a string")
        if detail_type != EVENTBRIDGE_CREATED:
            return Record(Ignored(Kind.OTHER, detail_type[:80]))
        detail = _object(doc["detail"], "detail")
        bucket = _text(_object(detail.get("bucket"), "detail.bucket"), "name", "detail.bucket")
        obj = _object(detail.get("object"), "detail.object", missing="detail has no object")
        key = _text(obj, "key", "detail.object")
        return Record(task_for_object(bucket, key, obj.get("version-id"), rules))
    except InputError as exc:
        return Record(exc)


def task_for_object(bucket: Any, key: str, version: Any, rules: MessageRules) -> Task:
    """The task of a new object: the rule of this module's docstring, checked throughout."""
    source = object_uri(bucket, key, "input")
    prefix = allowed_prefix(source, rules)
    input_format(source, rules)  # a key with no suffix a format reads has no stem either
    stem = source.key[len(prefix.key) : len(source.key) - len(source.suffix)]
    target = rules.output_prefix.child(_without_dot_segments(stem) + rules.output_suffix)
    output_key(target, f" (derived from the input key {source.key[:80]!r})")
    return build_task(
        task_id_for(stem),
        source,
        target,
        {},
        rules,
        input_version=_version(version),
        from_event=True,
    )


def task_id_for(stem: str) -> str:
    """The task id of an input key (its part under the allowed prefix, without its suffix).

    The characters of the task-id alphabet stay; every other one (a space, `=`, `%`,
    anything beyond ASCII, a segment of dots alone) is written `=XX` per UTF-8 byte. An id
    must start with a letter or digit: one that would not starts `0=` instead (`0==XX`:
    the escapes never make `==`). So distinct keys get distinct ids, each a valid task id
    for the next stage too. An id longer than the alphabet allows keeps its first part
    and ends in `=sha256:` and the digest of the whole key part.
    """
    text = "".join(ch if ch in _ID_KEEP else _escaped(ch) for ch in stem)
    text = _without_dot_segments(text)
    if not text[:1].isalnum():
        text = _LEAD_MARK + text
    if len(text) > MAX_TASK_ID_CHARS:
        cut = MAX_TASK_ID_CHARS - len(_DIGEST_MARK) - _DIGEST_CHARS
        while "=" in text[cut - 2 : cut]:  # never inside an escape
            cut -= 1
        digest = hashlib.sha256(stem.encode("utf-8", "surrogatepass")).hexdigest()
        text = text[:cut] + _DIGEST_MARK + digest
    problem = task_id_problem(text)
    if problem:  # not reached by any key the checks before admit; kept as a guard
        raise InputError("invalid_field", f"the input key gives no task id: {problem}")
    return text


def _without_dot_segments(path: str) -> str:
    """`path` with each segment of dots alone written `=2E` per dot: in an output key, as
    in a task id, no `.` or `..` is left for a resolver to move it out of its prefix."""
    return "/".join(_escaped(s) if s in DOT_SEGMENTS else s for s in path.split("/"))


def _escaped(text: str) -> str:
    return "".join(f"={b:02X}" for b in text.encode("utf-8", "surrogatepass"))


def _decoded(key: str) -> str:
    """A record's key as S3 documents it: URL-encoded, a space written `+`."""
    try:
        return unquote_plus(key, errors="strict")
    except UnicodeDecodeError:
        raise InputError("invalid_field", "s3.object.key is not URL-encoded UTF-8") from None


def _version(version: Any) -> str | None:
    """The version id an event names (None: none, or the `null` of an unversioned object)."""
    if version is None or version == "null":
        return None
    if (
        not isinstance(version, str)
        or not 0 < len(version) <= _MAX_VERSION_CHARS
        or not set(version) <= _VERSION_CHARS
    ):
        raise InputError("invalid_field", "the object's version id is no S3 version id")
    return version


def _object(value: Any, what: str, missing: str = "") -> dict[str, Any]:
    if value is None and missing:
        raise InputError("missing_field", missing)
    if not isinstance(value, dict):
        raise InputError("invalid_field", f"{what} must be a JSON object")
    return value


def _text(doc: dict[str, Any], name: str, what: str) -> str:
    if name not in doc:
        raise InputError("missing_field", f"{what} has no {name}")
    value = doc[name]
    if not isinstance(value, str):
        raise InputError("invalid_field", f"{what}.{name} must be a string")
    return value


# -- what an event's output records of its input ----------------------------------------


def input_digest(task: Task) -> str:
    """What an event's output records of its input's key (`input-uri-sha256`; its version
    is the lineage's `input-version-id`, the version read): "" for a task message."""
    return _source_digest(task.input) if task.from_event else ""


def provenance_conflict(task: Task, metadata: dict[str, str]) -> str:
    """Why an existing output of this task's id was made from another input than this
    event's ("" when it was not, or cannot say): another key that maps to the same output,
    or another version of the same key."""
    if not task.from_event:
        return ""
    made_from = metadata.get(lineage.INPUT_URI_SHA256)
    if made_from is not None and made_from != _source_digest(task.input):
        return f"{task.output} was made from another input key than {task.input}"
    version = metadata.get(lineage.INPUT_VERSION_ID)
    if version is not None and task.input_version is not None and version != task.input_version:
        return (
            f"{task.output} was made from version {version[:80]} of {task.input}; "
            f"this event names version {task.input_version[:80]}"
        )
    return ""


def _source_digest(uri: S3Uri) -> str:
    # A digest, not the key: metadata is ASCII and at most 2 KB, a key up to 1 KB of UTF-8.
    return hashlib.sha256(str(uri).encode("utf-8", "surrogatepass")).hexdigest()
