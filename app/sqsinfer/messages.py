"""The task message: schema, parsing, validation, S3 URIs and the prefix allow-list.

Everything here is pure: no I/O, so the whole hostile-input surface of a message can
be tested (and fuzzed) without a queue.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from sqsinfer.compute import formats
from sqsinfer.compute.errors import InputError
from sqsinfer.limits import S3_MAX_KEY_BYTES, SQS_DEFAULT_MAX_MESSAGE_BYTES, SQS_MAX_FIFO_ID_CHARS

# Every pattern here validates a whole value: always `fullmatch`, never `match` with `$`
# (which also matches before a final newline).
# A task id becomes part of an S3 key, so it is held to a conservative alphabet.
MAX_TASK_ID_CHARS = 512
_TASK_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-/=:@+]{0,511}")
# S3 bucket naming rules (the subset that matters: no dots-and-dashes games, 3-63 chars).
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
# Bytes kept free after every output key for the objects written next to it, named
# `<output><suffix>` (the chain marker `.chain` and any other marker): an output key is
# refused when its longest marker could not be written.
OUTPUT_MARKER_RESERVE_BYTES = 16
MAX_OUTPUT_KEY_BYTES = S3_MAX_KEY_BYTES - OUTPUT_MARKER_RESERVE_BYTES
# Segments a path resolver would collapse: refused in every key a task names (tools that
# resolve them read another object), taken only in the key of an S3 event's object.
DOT_SEGMENTS = frozenset({".", ".."})
# What SQS accepts in a message body or attribute: the XML 1.0 character range. Anything
# else (U+FFFE, U+FFFF, most C0 controls, lone surrogates) makes SendMessage fail.
_NOT_XML_RE = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
# What an output prefix (a setting, or a message's `output`) may name in braces, filled
# once at start from the worker's model, so that a new model's outputs sit beside the
# old one's instead of meeting them as duplicates.
PLACEHOLDERS: tuple[str, ...] = ("model_sha256_12", "model_version")
# A task's `group`: what SQS takes as a MessageGroupId (letters, digits, punctuation).
_GROUP_RE = re.compile(r"[!-~]{1,%d}" % SQS_MAX_FIFO_ID_CHARS)  # noqa: UP031 (regex braces)
_PLACEHOLDER_RE = re.compile(r"\{([^{}/]*)\}")


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


def sendable(text: str) -> bool:
    """True when SQS accepts this text in a message body or attribute value."""
    return _NOT_XML_RE.search(text) is None


def xml_safe(text: str) -> str:
    """`text` with every character SQS refuses written as a visible `\\uXXXX` escape."""
    return _NOT_XML_RE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _check_key(
    key: str,
    what: str,
    *,
    allow_empty: bool,
    max_bytes: int = S3_MAX_KEY_BYTES,
    dot_segments: bool = False,
) -> None:
    if not key:
        if allow_empty:
            return
        raise ValueError(f"{what} has no object key")
    size = len(key.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise ValueError(_too_long(what, size, max_bytes))
    if key.startswith("/") or "//" in key:
        raise ValueError(f"{what} key has an empty path segment")
    if not dot_segments and any(seg in DOT_SEGMENTS for seg in key.split("/")):
        raise ValueError(f"{what} key has a '.' or '..' segment")
    # A key travels in later messages (the next stage's input, a rejection's detail): one
    # with a character SQS refuses could never be handed on, so it is refused here, once.
    if any(ord(ch) < 0x20 or ch in "\\\x7f?#%" for ch in key) or not sendable(key):
        raise ValueError(f"{what} key has a control, backslash, '?', '#', '%' or non-XML character")


def _too_long(what: str, size: int, max_bytes: int) -> str:
    if max_bytes == S3_MAX_KEY_BYTES:
        return f"{what} key is {size} bytes, longer than S3's {S3_MAX_KEY_BYTES}"
    return (
        f"{what} key is {size} bytes: at most {max_bytes}, so that the markers written "
        f"next to it ({OUTPUT_MARKER_RESERVE_BYTES} bytes reserved) stay within S3's "
        f"{S3_MAX_KEY_BYTES}-byte key limit"
    )


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
    if _BUCKET_RE.fullmatch(bucket) is None or ".." in bucket:
        raise ValueError(f"{what} has an invalid bucket name {bucket[:64]!r}")
    _check_key(key, what, allow_empty=prefix)
    if prefix and key and not key.endswith("/"):
        key += "/"  # a prefix always ends on a folder boundary: in/ must not admit inside/
    return S3Uri(bucket, key)


def placeholder_values(model_sha256: str, model_version: str = "") -> dict[str, str]:
    """What each placeholder stands for with this model (`model_version` only when set)."""
    values = {"model_sha256_12": model_sha256[:12]}
    if model_version:
        values["model_version"] = model_version
    return values


def has_placeholders(text: str) -> bool:
    return _PLACEHOLDER_RE.search(text) is not None


def check_placeholders(text: str, values: Mapping[str, str] | None = None) -> None:
    """Raise ValueError for a placeholder no one fills: an unknown name, or (given the
    values a worker fills in) one it has no value for."""
    for name in _PLACEHOLDER_RE.findall(text):
        if name not in PLACEHOLDERS:
            known = ", ".join("{" + p + "}" for p in PLACEHOLDERS)
            raise ValueError(f"unknown placeholder {{{name}}}: known are {known}")
        if values is not None and name not in values:
            raise ValueError(f"{{{name}}} has no value here (is the model version set?)")


def fill_placeholders(text: str, values: Mapping[str, str]) -> str:
    """`text` with every placeholder replaced by its value (ValueError: see `check`)."""
    check_placeholders(text, values)
    return _PLACEHOLDER_RE.sub(lambda m: values[m.group(1)], text)


def filled_uri(uri: S3Uri, values: Mapping[str, str]) -> S3Uri:
    """An output prefix with its placeholders filled, held to the key rules again."""
    if not has_placeholders(uri.key):
        return uri
    return parse_s3_uri(
        f"s3://{uri.bucket}/{fill_placeholders(uri.key, values)}", "output prefix", prefix=True
    )


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
    input_options: formats.InputOptions = formats.NO_OPTIONS  # from params, checked
    # From an S3 event notification (`events`): the version of the input it names (read
    # exactly that one), and whether the output must record and match its input.
    input_version: str | None = None
    from_event: bool = False
    # The message's `group`: its MessageGroupId on a FIFO next stage (None: the task id).
    group: str | None = None


@dataclass(frozen=True)
class MessageRules:
    """What a message may ask for: the allow-lists and the default output location."""

    allowed_input_prefixes: tuple[S3Uri, ...]
    allowed_output_prefixes: tuple[S3Uri, ...]
    output_prefix: S3Uri
    output_suffix: str = ".npy"
    max_message_bytes: int = SQS_DEFAULT_MAX_MESSAGE_BYTES
    # The dead-letter queue's MaximumMessageSize: a rejected message's copy is cut to fit.
    dead_letter_max_bytes: int = SQS_DEFAULT_MAX_MESSAGE_BYTES
    # Refuse formats whose package is not installed in this process (the worker). A tool
    # that checks messages for a worker elsewhere cannot know what that worker has.
    require_installed_formats: bool = True
    # The values of the placeholders a message's `output` may carry (the worker's model);
    # None: a tool that does not know the model checks their names and leaves them.
    placeholders: Mapping[str, str] | None = None
    # What a body is: a task message (`sqsinfer`), an S3 event notification (`s3-event`),
    # or either (`auto`); `events.parse_body` reads it.
    message_shape: str = "sqsinfer"


def _field_uri(doc: dict[str, Any], name: str) -> S3Uri:
    try:
        return parse_s3_uri(doc[name], name)
    except ValueError as exc:
        raise InputError("invalid_field", str(exc)) from None


def _given_output(doc: dict[str, Any], rules: MessageRules) -> S3Uri:
    """The message's own `output`, its placeholders filled with the worker's values."""
    text = doc["output"]
    if isinstance(text, str) and has_placeholders(text):
        try:
            check_placeholders(text, rules.placeholders)
        except ValueError as exc:
            raise InputError("invalid_field", f"output: {exc}") from None
        if rules.placeholders is not None:
            doc = dict(doc, output=fill_placeholders(text, rules.placeholders))
    return _field_uri(doc, "output")


def _output_uri(doc: dict[str, Any], task_id: str, rules: MessageRules) -> S3Uri:
    """The given `output`, or the key derived from the task id, held to the same rules."""
    derived = doc.get("output") is None
    if derived:
        target = rules.output_prefix.child(task_id + rules.output_suffix)
    else:
        target = _given_output(doc, rules)
        if not any(target.within(p) for p in rules.allowed_output_prefixes):
            raise InputError("output_not_allowed", f"{target} is outside the allowed prefixes")
    return output_key(target, " (derived from task_id and the output prefix)" if derived else "")


def _task_id(doc: dict[str, Any]) -> str:
    task_id = doc["task_id"]
    problem = task_id_problem(task_id)
    if problem:
        raise InputError("invalid_field", problem)
    return str(task_id)


def task_id_problem(task_id: Any) -> str:
    """What makes `task_id` no task id ("" when it is one)."""
    if not isinstance(task_id, str) or _TASK_ID_RE.fullmatch(task_id) is None:
        return (
            f"task_id must be 1-{MAX_TASK_ID_CHARS} characters of A-Z a-z 0-9 . _ - / = : @ + "
            "starting with a letter or digit"
        )
    if any(seg in (".", "..", "") for seg in task_id.split("/")):
        return "task_id has an empty, '.' or '..' segment"
    return ""


def load_object(body: str | bytes, rules: MessageRules, what: str = "the body") -> dict[str, Any]:
    """A message body (or a JSON document inside one) as a JSON object, or InputError."""
    size = len(body.encode() if isinstance(body, str) else body)
    if size > rules.max_message_bytes:
        raise InputError(
            "message_too_large", f"body is {size} bytes, limit {rules.max_message_bytes}"
        )
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InputError("malformed_json", str(exc)[:200]) from None
    if not isinstance(doc, dict):
        raise InputError("malformed_json", f"{what} must be a JSON object")
    return doc


def _format(
    found: formats.Format | None,
    what: str,
    uri: S3Uri,
    suffixes: tuple[str, ...],
    rules: MessageRules,
) -> formats.Format:
    """The format a key's suffix names, when this worker can read or write it."""
    if found is None:
        raise InputError(
            "unsupported_format",
            f"{what} suffix {uri.suffix or '(none)'!r}; expected one of " + ", ".join(suffixes),
        )
    missing = found.missing if rules.require_installed_formats else ""
    if missing:
        raise InputError("unsupported_format", f"{what} {uri}: {missing}")
    return found


def parse_task(body: str | bytes, rules: MessageRules) -> Task:
    """Parse and validate one message body into a Task, or raise InputError."""
    return task_from_document(load_object(body, rules), rules)


def task_from_document(doc: dict[str, Any], rules: MessageRules) -> Task:
    """The Task a task message's JSON object asks for, or InputError."""
    missing = [name for name in ("task_id", "input") if name not in doc]
    if missing:
        raise InputError("missing_field", "missing " + ", ".join(missing))
    task_id = _task_id(doc)
    source = _field_uri(doc, "input")
    allowed_prefix(source, rules)
    target = _output_uri(doc, task_id, rules)
    params = doc.get("params", {})
    if not isinstance(params, dict):
        raise InputError("invalid_field", "params must be a JSON object")
    return build_task(task_id, source, target, params, rules, group=_group(doc))


def _group(doc: dict[str, Any]) -> str | None:
    group = doc.get("group")
    if group is None:
        return None
    if not isinstance(group, str) or _GROUP_RE.fullmatch(group) is None:
        raise InputError(
            "invalid_field",
            f"group must be 1-{SQS_MAX_FIFO_ID_CHARS} ASCII letters, digits or punctuation",
        )
    return group


def message_group(task_id: str, group: str | None = None) -> str:
    """The MessageGroupId of a task's message on a FIFO queue: its `group`, else its
    task id (a task id longer than SQS allows is replaced by its digest)."""
    if group is not None:
        return group
    if len(task_id) <= SQS_MAX_FIFO_ID_CHARS:
        return task_id
    return "sha256-" + deduplication_id(task_id)


def deduplication_id(text: str) -> str:
    """A MessageDeduplicationId for what `text` names: its sha256, in hex. The link of an
    output is named by the output's URI, so every delivery of its task sends the same id
    and a FIFO queue drops all but the first in its window."""
    return hashlib.sha256(text.encode()).hexdigest()


def allowed_prefix(source: S3Uri, rules: MessageRules) -> S3Uri:
    """The longest allowed input prefix `source` lies under, or InputError."""
    found = [p for p in rules.allowed_input_prefixes if source.within(p)]
    if not found:
        raise InputError("input_not_allowed", f"{source} is outside the allowed prefixes")
    return max(found, key=lambda p: len(p.key))


def input_format(source: S3Uri, rules: MessageRules) -> formats.Format:
    """The format an input's suffix names, when this worker reads it; else InputError."""
    return _format(formats.for_input(source.suffix), "input", source, formats.INPUT_SUFFIXES, rules)


def build_task(
    task_id: str,
    source: S3Uri,
    target: S3Uri,
    params: dict[str, Any],
    rules: MessageRules,
    **event: Any,
) -> Task:
    """The Task for checked ids and keys: their formats, and the options `params` give.
    `event` holds the fields an S3 event notification adds (`Task.input_version`, ...)."""
    read = input_format(source, rules)
    written = _format(
        formats.for_output(target.suffix), "output", target, formats.OUTPUT_SUFFIXES, rules
    )
    try:
        options = formats.input_options(params, read)
    except ValueError as exc:
        raise InputError("invalid_field", str(exc)) from None
    return Task(task_id, source, target, read.name, written.name, params, options, **event)


def object_uri(bucket: Any, key: Any, what: str) -> S3Uri:
    """The object an event names (bucket and decoded key apart), held to `parse_s3_uri`'s
    rules but for segments of dots alone, which S3 keys may hold (S3 never resolves them:
    `in/a/../x.npy` is a key of its own, under `in/`); InputError (`invalid_field`)
    otherwise. The output derived from such a key has those segments escaped
    (`events.task_for_object`), so no dots reach an output key."""
    if not isinstance(bucket, str) or _BUCKET_RE.fullmatch(bucket) is None or ".." in bucket:
        raise InputError("invalid_field", f"{what} has an invalid bucket name {str(bucket)[:64]!r}")
    try:
        _check_key(key, what, allow_empty=False, dot_segments=True)
    except ValueError as exc:
        raise InputError("invalid_field", str(exc)) from None
    return S3Uri(bucket, key)


def output_key(target: S3Uri, where: str) -> S3Uri:
    """`target`, when it is a key an output may have (`where` says how it was derived)."""
    try:
        _check_key(target.key, "output", allow_empty=False, max_bytes=MAX_OUTPUT_KEY_BYTES)
    except ValueError as exc:
        raise InputError("invalid_field", f"{exc}{where}") from None
    return target


def next_stage_body(task: Task) -> bytes:
    """The message that hands this task's output to the next stage, as ASCII-only JSON.

    `params` are the producer's own: any string JSON can carry, including characters SQS
    refuses in a message (U+FFFF arrives as the escape `\\uffff`, which SQS accepts, and
    decodes to a character it does not). Escaping everything beyond ASCII makes every
    next-stage body sendable and hands the params on unchanged, but for `columns`: it
    chose this stage's input columns, and the next stage reads this stage's output.
    """
    params = {k: v for k, v in task.params.items() if k != "columns"}
    doc: dict[str, Any] = {"task_id": task.task_id, "input": str(task.output), "params": params}
    if task.group is not None:  # the next stage keeps the task's order group
        doc["group"] = task.group
    return json.dumps(doc, ensure_ascii=True, separators=(",", ":")).encode("ascii")
