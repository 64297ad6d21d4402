"""The task message: schema, parsing, validation, S3 URIs and the prefix allow-list.

Everything here is pure: no I/O, so the whole hostile-input surface of a message can
be tested (and fuzzed) without a queue.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from sqsinfer import formats

# A task id becomes part of an S3 key, so it is held to a conservative alphabet.
_TASK_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/=:@+]{0,511}$")
# S3 bucket naming rules (the subset that matters: no dots-and-dashes games, 3-63 chars).
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_MAX_KEY_BYTES = 1024


class MessageRejected(Exception):
    """A permanent problem with a message: it goes to the dead-letter queue with `reason`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


@dataclass(frozen=True, order=True)
class S3Uri:
    bucket: str
    key: str

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    @property
    def suffix(self) -> str:
        name = self.key.rsplit("/", 1)[-1]
        dot = name.rfind(".")
        return name[dot:].lower() if dot > 0 else ""

    def child(self, name: str) -> S3Uri:
        """The key `name` under this URI taken as a prefix."""
        prefix = self.key if not self.key or self.key.endswith("/") else self.key + "/"
        return S3Uri(self.bucket, prefix + name)

    def within(self, prefix: S3Uri) -> bool:
        """True when this object lies under `prefix` (normalised to a folder boundary)."""
        return self.bucket == prefix.bucket and self.key.startswith(prefix.key)


def _check_key(key: str, what: str, *, allow_empty: bool) -> None:
    if not key:
        if allow_empty:
            return
        raise ValueError(f"{what} has no object key")
    if len(key.encode()) > _MAX_KEY_BYTES:
        raise ValueError(f"{what} key is longer than {_MAX_KEY_BYTES} bytes")
    if key.startswith("/") or "//" in key:
        raise ValueError(f"{what} key has an empty path segment")
    if any(seg in (".", "..") for seg in key.split("/")):
        raise ValueError(f"{what} key has a '.' or '..' segment")
    if any(ord(ch) < 0x20 or ch in "\\\x7f?#%" for ch in key):
        raise ValueError(f"{what} key has a control, backslash, '?', '#' or '%' character")


def parse_s3_uri(text: str, what: str = "uri", *, prefix: bool = False) -> S3Uri:
    """Parse `s3://bucket/key`. Raises ValueError with a reason a person can act on.

    URL tricks (`s3://bucket@other/`, `..`, encoded characters, query strings) are
    refused outright rather than normalised: a key that needs normalising is not one
    a well-behaved producer writes.
    """
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a string")
    if not text.startswith("s3://"):
        raise ValueError(f"{what} must start with s3://")
    bucket, _, key = text[len("s3://") :].partition("/")
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise ValueError(f"{what} has an invalid bucket name {bucket[:64]!r}")
    _check_key(key, what, allow_empty=prefix)
    if prefix and key and not key.endswith("/"):
        key += "/"  # a prefix always ends on a folder boundary: in/ must not admit inside/
    return S3Uri(bucket, key)


def parse_prefixes(text: str, what: str) -> tuple[S3Uri, ...]:
    items = [part.strip() for part in text.split(",") if part.strip()]
    return tuple(parse_s3_uri(item, what, prefix=True) for item in items)


@dataclass(frozen=True)
class Task:
    task_id: str
    input: S3Uri
    output: S3Uri
    input_format: str
    output_format: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MessageRules:
    """What a message may ask for: the allow-lists and the default output location."""

    allowed_input_prefixes: tuple[S3Uri, ...]
    allowed_output_prefixes: tuple[S3Uri, ...]
    output_prefix: S3Uri
    output_suffix: str = ".npy"
    max_message_bytes: int = 262_144


def _field_uri(doc: dict[str, Any], name: str) -> S3Uri:
    try:
        return parse_s3_uri(doc[name], name)
    except ValueError as exc:
        raise MessageRejected("invalid_field", str(exc)) from None


def _task_id(doc: dict[str, Any]) -> str:
    task_id = doc["task_id"]
    if not isinstance(task_id, str) or not _TASK_ID_RE.match(task_id):
        raise MessageRejected(
            "invalid_field",
            "task_id must be 1-512 characters of A-Z a-z 0-9 . _ - / = : @ + "
            "starting with a letter or digit",
        )
    if any(seg in (".", "..", "") for seg in task_id.split("/")):
        raise MessageRejected("invalid_field", "task_id has an empty, '.' or '..' segment")
    return task_id


def _load_document(body: str | bytes, rules: MessageRules) -> dict[str, Any]:
    size = len(body.encode() if isinstance(body, str) else body)
    if size > rules.max_message_bytes:
        raise MessageRejected(
            "message_too_large", f"body is {size} bytes, limit {rules.max_message_bytes}"
        )
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise MessageRejected("malformed_json", str(exc)[:200]) from None
    if not isinstance(doc, dict):
        raise MessageRejected("malformed_json", "the body must be a JSON object")
    missing = [name for name in ("task_id", "input") if name not in doc]
    if missing:
        raise MessageRejected("missing_field", "missing " + ", ".join(missing))
    return doc


def parse_task(body: str | bytes, rules: MessageRules) -> Task:
    """Parse and validate one message body into a Task, or raise MessageRejected."""
    doc = _load_document(body, rules)
    task_id = _task_id(doc)
    source = _field_uri(doc, "input")
    if not any(source.within(p) for p in rules.allowed_input_prefixes):
        raise MessageRejected("input_not_allowed", f"{source} is outside the allowed prefixes")
    input_format = formats.for_input(source.suffix)
    if input_format is None:
        raise MessageRejected(
            "unsupported_format",
            f"input suffix {source.suffix or '(none)'!r}; expected one of "
            + ", ".join(formats.INPUT_SUFFIXES),
        )
    if doc.get("output") is None:
        target = rules.output_prefix.child(task_id + rules.output_suffix)
    else:
        target = _field_uri(doc, "output")
        if not any(target.within(p) for p in rules.allowed_output_prefixes):
            raise MessageRejected("output_not_allowed", f"{target} is outside the allowed prefixes")
    output_format = formats.for_output(target.suffix)
    if output_format is None:
        raise MessageRejected(
            "unsupported_format",
            f"output suffix {target.suffix or '(none)'!r}; expected one of "
            + ", ".join(formats.OUTPUT_SUFFIXES),
        )
    params = doc.get("params", {})
    if not isinstance(params, dict):
        raise MessageRejected("invalid_field", "params must be a JSON object")
    return Task(task_id, source, target, input_format.name, output_format.name, params)


def next_stage_body(task: Task) -> bytes:
    """The message that hands this task's output to the next stage."""
    return orjson.dumps({"task_id": task.task_id, "input": str(task.output), "params": task.params})
