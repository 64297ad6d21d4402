"""Where `sqsinfer enqueue` gets tasks: a manifest (JSONL or CSV) or an S3 listing.

Both are read as streams: a line (or a listed key) at a time, so a manifest of
millions of lines never sits in memory. Each item becomes the message body the worker
accepts and is checked by the worker's own parser (`sqsinfer.messages.parse_task`), so a
line is refused here for exactly the reasons the worker would refuse its message.
"""

from __future__ import annotations

import csv
import fnmatch
import os
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

import orjson

from sqsinfer.aws.s3 import Storage
from sqsinfer.compute.errors import InputError
from sqsinfer.limits import SQS_DEFAULT_MAX_MESSAGE_BYTES, SQS_GROUP_ID_MAX_CHARS, is_group_id
from sqsinfer.messages import (
    MessageRules,
    S3Uri,
    Task,
    load_object,
    parse_s3_uri,
    task_from_document,
)
from sqsinfer.ops import common
from sqsinfer.tracing.api import NO_TRACE, TaskTrace

MANIFEST_FORMATS = ("jsonl", "csv")
_CSV_COLUMNS = ("task_id", "input", "output")
_GLOB_CHARS = "*?["


@dataclass(frozen=True)
class Entry:
    """A valid task: the body to send, where it came from, and the parsed task."""

    where: str  # "manifest.jsonl:17" or "s3://bucket/key"
    body: str
    task: Task
    size_bytes: int = 0  # bytes of the manifest it used (for progress)
    group_id: str = ""  # its MessageGroupId (from `--group-field`; "": none)
    # The task's trace, begun when `sqsinfer enqueue` batches it (traces on).
    trace: TaskTrace = field(default=NO_TRACE, compare=False, repr=False)


@dataclass(frozen=True)
class BadLine:
    where: str
    reason: str
    detail: str
    size_bytes: int = 0

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}: {self.detail}"


Item = Entry | BadLine


class Validator:
    """The worker's message rules. Without an input allow-list, any bucket is allowed.

    With the stage's own settings (`--allowed-input-prefixes`, `--output-prefix`, or
    their SQSINFER_ variables) a line passes exactly when the worker would accept it.
    With `group_field`, a task must also name its group there (`group_of`).
    """

    def __init__(
        self,
        allowed_inputs: tuple[S3Uri, ...] = (),
        *,
        output_prefix: S3Uri | None = None,
        allowed_outputs: tuple[S3Uri, ...] = (),
        output_suffix: str = ".npy",
        max_message_bytes: int = SQS_DEFAULT_MAX_MESSAGE_BYTES,
        placeholders: Mapping[str, str] | None = None,
        group_field: str = "",
    ) -> None:
        if not allowed_outputs and output_prefix is not None:
            allowed_outputs = (output_prefix,)  # the worker's default
        self.allowed_inputs = allowed_inputs
        self.allowed_outputs = allowed_outputs
        self.output_prefix = output_prefix
        self.output_suffix = output_suffix
        self.max_message_bytes = max_message_bytes
        self.placeholders = placeholders  # a stage's model, when known: outputs name it
        self.group_field = group_field  # the top-level field naming a task's group ("": none)

    def check(self, body: str | bytes) -> Task:
        """The task, or InputError with the worker's reason."""
        return self.read(body)[0]

    def read(self, body: str | bytes) -> tuple[Task, str]:
        """The task and its group id ("" without a group field), or InputError."""
        rules = self._rules(body)
        doc = load_object(body, rules)
        task = task_from_document(doc, rules)
        return task, group_of(doc, self.group_field) if self.group_field else ""

    def _rules(self, body: str | bytes) -> MessageRules:
        roots = () if self.allowed_inputs and self.allowed_outputs else _bucket_roots(body)
        fallback = roots[:1] or (S3Uri("placeholder", ""),)
        return MessageRules(
            allowed_input_prefixes=self.allowed_inputs or roots,
            allowed_output_prefixes=self.allowed_outputs or roots,
            output_prefix=self.output_prefix or fallback[0],
            output_suffix=self.output_suffix,
            max_message_bytes=self.max_message_bytes,
            require_installed_formats=False,  # the worker's packages, not this machine's
            placeholders=self.placeholders,
        )


def group_of(doc: Mapping[str, Any], name: str) -> str:
    """The group id a task's top-level field `name` gives (a string, or an integer
    written in decimal), or InputError: SQS takes it as a MessageGroupId as it is."""
    if name not in doc:
        raise InputError("missing_field", f"missing {name} (the group field)")
    value = doc[name]
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not is_group_id(text):
        raise InputError(
            "invalid_field",
            f"{name} {str(value)[:64]!r} is not a group id: 1-{SQS_GROUP_ID_MAX_CHARS} "
            "letters, digits or ASCII punctuation",
        )
    return text


def _bucket_roots(body: str | bytes) -> tuple[S3Uri, ...]:
    """The whole buckets a body names, which lenient validation then allows."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return ()
    if not isinstance(doc, dict):
        return ()
    roots = []
    for name in ("input", "output"):
        value = doc.get(name)
        try:
            if isinstance(value, str):
                roots.append(S3Uri(parse_s3_uri(value, name).bucket, ""))
        except ValueError:
            continue
    return tuple(roots)


def _item(validator: Validator, where: str, body: str, size_bytes: int) -> Item:
    try:
        task, group_id = validator.read(body)
    except InputError as exc:
        return BadLine(where, exc.reason, exc.detail, size_bytes)
    return Entry(where, body, task, size_bytes, group_id=group_id)


# -- JSONL --------------------------------------------------------------------------
def read_jsonl(lines: Iterable[bytes], name: str, validator: Validator) -> Iterator[Item]:
    """One message body per line, sent as written (extra fields are the producer's)."""
    for number, raw in enumerate(lines, start=1):
        text = _decode(raw)
        if text is None:
            yield BadLine(f"{name}:{number}", "malformed_json", "the line is not UTF-8", len(raw))
            continue
        body = text.strip()
        if not body:
            continue  # blank lines carry no task
        yield _item(validator, f"{name}:{number}", body, len(raw))


def _decode(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


# -- CSV ----------------------------------------------------------------------------
class _CountingLines:
    """Decoded lines for csv.reader, counting the bytes it consumed."""

    def __init__(self, lines: Iterable[bytes]) -> None:
        self._lines = iter(lines)
        self.consumed = 0
        self.undecodable = False

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        raw = next(self._lines)
        self.consumed += len(raw)
        text = _decode(raw)
        self.undecodable = text is None
        return "\ufffd\n" if text is None else text


def read_csv(lines: Iterable[bytes], name: str, validator: Validator) -> Iterator[Item]:
    """Rows of `task_id,input[,output]`; a first row naming the columns is a header (it
    may name the group field's column too)."""
    source = _CountingLines(lines)
    reader = csv.reader(source)
    columns: tuple[str, ...] = _CSV_COLUMNS
    used = 0
    for row in reader:
        size, used = source.consumed - used, source.consumed
        where = f"{name}:{reader.line_num}"
        cells = [cell.strip() for cell in row]
        if not any(cells):
            continue
        if reader.line_num == 1 and cells[0].lstrip("\ufeff") == "task_id":
            columns = _header(cells)
            continue
        if source.undecodable:
            yield BadLine(where, "malformed_json", "the line is not UTF-8", size)
            continue
        body = _csv_body(columns, cells, validator.group_field)
        if isinstance(body, BadLine):
            yield BadLine(where, body.reason, body.detail, size)
        else:
            yield _item(validator, where, body, size)


def _header(cells: list[str]) -> tuple[str, ...]:
    return tuple(cell.lstrip("\ufeff").lower() for cell in cells)


def _csv_body(columns: tuple[str, ...], cells: list[str], group_field: str) -> str | BadLine:
    if len(cells) > len(columns) or len(cells) < 2:
        expected = ",".join(columns)
        return BadLine("", "invalid_field", f"{len(cells)} columns, expected {expected}")
    doc: dict[str, Any] = {}
    for column, cell in zip(columns, cells, strict=False):
        if (column in _CSV_COLUMNS or column == group_field) and cell:
            doc[column] = cell
    return orjson.dumps(doc).decode()


def open_manifest(path: str) -> IO[bytes]:
    """The manifest file, or stdin for `-` (a copy of its descriptor, closed with it)."""
    return os.fdopen(os.dup(sys.stdin.fileno()), "rb") if path == "-" else open(path, "rb")


def read_manifest(fh: Iterable[bytes], name: str, fmt: str, validator: Validator) -> Iterator[Item]:
    if fmt == "csv":
        return read_csv(fh, name, validator)
    return read_jsonl(fh, name, validator)


def run_on_manifest(
    name: str,
    path: str | None,
    log_level: str,
    main: Callable[[IO[bytes] | None], Coroutine[Any, Any, int]],
) -> int:
    """Run command `name` on the manifest at `path` (`-`: stdin; None: none), then close it.

    A manifest that cannot be opened is a usage error (2), before anything runs.
    """
    try:
        fh = open_manifest(path) if path else None
    except OSError as exc:
        return common.usage_error(name, f"cannot read {path}: {exc}")
    try:
        return common.run_command(lambda: main(fh), name, log_level)
    finally:
        if fh is not None:
            fh.close()


def manifest_format(path: str, given: str | None) -> str:
    if given:
        return given
    return "csv" if path.lower().endswith(".csv") else "jsonl"


# -- an S3 listing ------------------------------------------------------------------
@dataclass(frozen=True)
class KeyPattern:
    """`s3://bucket/in/2026-*/*.npy`: list from the literal prefix, keep keys matching."""

    bucket: str
    pattern: str  # the key glob; `*` also matches `/`
    list_prefix: str  # the literal part before the first glob character
    base: str  # task ids are keys relative to this folder, without their suffix

    @classmethod
    def parse(cls, text: str) -> KeyPattern:
        """Raises ValueError with a reason, as `parse_s3_uri` does."""
        literal = _literal_part(text)
        if literal == text:  # no glob: a prefix, on a folder boundary like the worker's
            uri = parse_s3_uri(text, "--from-prefix", prefix=True)
            return cls(uri.bucket, uri.key + "*", uri.key, uri.key)
        if not text.startswith("s3://"):
            raise ValueError("--from-prefix must start with s3://")
        bucket, _, glob = text[len("s3://") :].partition("/")
        parse_s3_uri(f"s3://{bucket}/", "--from-prefix", prefix=True)  # the bucket's rules
        list_prefix = _literal_part(glob)
        return cls(bucket, glob, list_prefix, list_prefix[: list_prefix.rfind("/") + 1])

    def matches(self, key: str) -> bool:
        return not key.endswith("/") and fnmatch.fnmatchcase(key, self.pattern)

    def task_id(self, key: str) -> str:
        relative = key[len(self.base) :] if key.startswith(self.base) else key
        name = relative.rsplit("/", 1)[-1]
        dot = name.rfind(".")
        return relative[: len(relative) - len(name) + dot] if dot > 0 else relative


def _literal_part(text: str) -> str:
    cut = min((i for i, ch in enumerate(text) if ch in _GLOB_CHARS), default=len(text))
    return text[:cut]


async def list_keys(s3: Any, pattern: KeyPattern) -> AsyncIterator[str]:
    """Keys matching the pattern, a listing page (1,000 keys) at a time."""
    async for keys in Storage(s3).keys(S3Uri(pattern.bucket, pattern.list_prefix)):
        for key in keys:
            if pattern.matches(key):
                yield key


async def read_listing(s3: Any, pattern: KeyPattern, validator: Validator) -> AsyncIterator[Item]:
    async for key in list_keys(s3, pattern):
        where = f"s3://{pattern.bucket}/{key}"
        body = orjson.dumps({"task_id": pattern.task_id(key), "input": where}).decode()
        yield _item(validator, where, body, 0)
