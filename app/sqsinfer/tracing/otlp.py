"""OTLP/HTTP export of spans, encoded here: the exporter's thread at a fraction of its CPU.

The SDK's exporter builds a protobuf object per span, attribute, value, event and link,
then serializes the tree: about 0.18 ms per medium task (6 to 7 spans) on the 2-vCPU
bench machine, more than all of a task's tracing calls. `encode` writes the same
`ExportTraceServiceRequest` straight to the wire format (an attribute's key, and the
resource and scope, encoded once), and `Exporter` sends it with the SDK exporter's own
HTTP client: its endpoint, headers, timeout, compression, TLS and retries, all from the
OTEL_EXPORTER_OTLP_* variables as before. Where that client is not there (an SDK older
than the one this was written against), the SDK's own export runs instead.

The decoded request equals `encode_spans(spans)`'s (tests/worker/test_tracing.py).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext
from opentelemetry.trace.status import Status

from sqsinfer.logs import Event
from sqsinfer.tracing.sdk import Spans, expand

log = logging.getLogger("sqsinfer.tracing")

_FIXED64 = struct.Struct("<Q")
_DOUBLE = struct.Struct("<d")
_FIXED32 = struct.Struct("<I")
# SpanFlags: the context's is_remote is known (always), and it is remote.
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200
_PAIRS_CACHED = 4096  # attribute pairs whose encoding is kept


def _varint(value: int) -> bytes:
    if value < 0x80:
        return bytes((value,)) if value >= 0 else _varint(value + (1 << 64))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field: `tag` is (number << 3) | 2."""
    return bytes((tag,)) + _varint(len(payload)) + payload


def _any_value(value: Any) -> bytes:
    """An AnyValue (a oneof: its field is written even when it holds the default)."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _field(0x0A, value.encode())
    if isinstance(value, int):
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE.pack(value)
    if isinstance(value, bytes):
        return _field(0x3A, value)
    if isinstance(value, Sequence):
        return _field(0x2A, b"".join(_field(0x0A, _any_value(v)) for v in value))
    if isinstance(value, Mapping):
        pairs = b"".join(_field(0x0A, _key_value(str(k), v)) for k, v in value.items())
        return _field(0x32, pairs)
    raise TypeError(f"an attribute value of type {type(value).__name__}")


# Encoded KeyValue pairs by (key, string) for the values that repeat (the system, the queue,
# an outcome); emptied when full, so that unique values (ids) cannot crowd them out for long.
_pairs: dict[tuple[str, Any], bytes] = {}


def _key_value(key: str, value: Any) -> bytes:
    if type(value) is not str:  # 1, 1.0 and True are one key of a dict: strings alone
        return _field(0x0A, key.encode()) + _field(0x12, _any_value(value))
    cached = (key, value)
    pair = _pairs.get(cached)
    if pair is None:
        pair = _field(0x0A, key.encode()) + _field(0x12, _field(0x0A, value.encode()))
        if len(_pairs) >= _PAIRS_CACHED:
            _pairs.clear()
        _pairs[cached] = pair
    return pair


def _attributes(tag: int, attributes: Mapping[str, Any] | None) -> bytes:
    """Each attribute as a repeated KeyValue field numbered by `tag`."""
    if not attributes:
        return b""
    head = bytes((tag,))
    parts = []
    for key, value in attributes.items():
        try:
            pair = _key_value(key, value)
        except TypeError as exc:  # the SDK's encoder logs and leaves the attribute out
            log.warning(Event.SPAN_ATTRIBUTE_NOT_EXPORTED, extra={"key": key, "error": str(exc)})
            continue
        parts.append(head + _varint(len(pair)) + pair)
    return b"".join(parts)


def _flags(context: SpanContext | None) -> int:
    remote = context is not None and context.is_remote
    return _HAS_IS_REMOTE | _IS_REMOTE if remote else _HAS_IS_REMOTE


_LOCAL = b"\x85\x01" + _FIXED32.pack(_HAS_IS_REMOTE)  # the flags of a span of a local parent
_REMOTE = b"\x85\x01" + _FIXED32.pack(_HAS_IS_REMOTE | _IS_REMOTE)
_NO_STATUS = b"\x7a\x00"


def _state(context: SpanContext) -> bytes:
    if not context.trace_state:
        return b""
    state = ",".join(f"{k}={v}" for k, v in context.trace_state.items())
    return _field(0x1A, state.encode())


def _status(status: Status) -> bytes:
    if not status.description and not status.status_code.value:
        return _NO_STATUS
    body = _field(0x12, status.description.encode()) if status.description else b""
    if status.status_code.value:
        body += b"\x18" + _varint(status.status_code.value)
    return _field(0x7A, body)


def _span(span: ReadableSpan) -> bytes:
    context = span.get_span_context()
    assert context is not None
    parts = [
        b"\x0a\x10" + context.trace_id.to_bytes(16, "big"),
        b"\x12\x08" + context.span_id.to_bytes(8, "big"),
        _state(context),
    ]
    if span.parent is not None:
        parts.append(b"\x22\x08" + span.parent.span_id.to_bytes(8, "big"))
    parts.append(_field(0x2A, span.name.encode()))
    parts.append(b"\x30" + _varint(span.kind.value + 1))
    if span.start_time:
        parts.append(b"\x39" + _FIXED64.pack(span.start_time))
    if span.end_time:
        parts.append(b"\x41" + _FIXED64.pack(span.end_time))
    parts.append(_attributes(0x4A, span.attributes))
    if span.dropped_attributes:
        parts.append(b"\x50" + _varint(span.dropped_attributes))
    parts.extend(_events_and_links(span))
    parts.append(_status(span.status))
    parts.append(_REMOTE if span.parent is not None and span.parent.is_remote else _LOCAL)
    return b"".join(parts)


def _steps(spans: Spans) -> list[bytes]:
    """The steps of a task, as `_span` encodes each of `spans.readable()`: in the task's
    trace, each a child of its span (a local parent), with no links and nothing dropped."""
    context = spans.context
    head = b"\x0a\x10" + context.trace_id.to_bytes(16, "big")
    tail = _state(context) + b"\x22\x08" + context.span_id.to_bytes(8, "big")
    found = []
    for span_id, name, kind, start, end, attributes, events, status in spans.steps:
        parts = [
            head,
            b"\x12\x08" + span_id.to_bytes(8, "big"),
            tail,
            _field(0x2A, name.encode()),
            b"\x30" + _varint(kind.value + 1),
            b"\x39" + _FIXED64.pack(start) if start else b"",
            b"\x41" + _FIXED64.pack(end) if end else b"",
            _attributes(0x4A, attributes),
        ]
        for event_name, event_attributes, at in events:
            body = b"\x09" + _FIXED64.pack(at) + _field(0x12, event_name.encode())
            parts.append(_field(0x5A, body + _attributes(0x1A, event_attributes)))
        parts.append(_status(status))
        parts.append(_LOCAL)
        found.append(b"".join(parts))
    return found


def _encoded(item: ReadableSpan | Spans) -> list[bytes]:
    """The spans of what the span processor queued: a `ReadableSpan`, or `Spans`."""
    if not isinstance(item, Spans):
        return [_span(item)]
    return [_span(item.head()), *_steps(item)]


def _events_and_links(span: ReadableSpan) -> list[bytes]:
    parts = []
    for event in span.events:
        body = b"\x09" + _FIXED64.pack(event.timestamp) + _field(0x12, event.name.encode())
        body += _attributes(0x1A, event.attributes)
        if event.dropped_attributes:
            body += b"\x20" + _varint(event.dropped_attributes)
        parts.append(_field(0x5A, body))
    if span.dropped_events:
        parts.append(b"\x60" + _varint(span.dropped_events))
    for link in span.links:
        body = b"\x0a\x10" + link.context.trace_id.to_bytes(16, "big")
        body += b"\x12\x08" + link.context.span_id.to_bytes(8, "big")
        body += _attributes(0x22, link.attributes)
        if link.dropped_attributes:
            body += b"\x28" + _varint(link.dropped_attributes)
        body += b"\x35" + _FIXED32.pack(_flags(link.context))
        parts.append(_field(0x6A, body))
    if span.dropped_links:
        parts.append(b"\x70" + _varint(span.dropped_links))
    return parts


def _scope(scope: InstrumentationScope | None) -> bytes:
    if scope is None:
        return b""
    body = _field(0x0A, scope.name.encode()) if scope.name else b""
    if scope.version:
        body += _field(0x12, scope.version.encode())
    return body + _attributes(0x1A, scope.attributes)


def _resource(resource: Resource) -> tuple[bytes, bytes]:
    body = _field(0x0A, _attributes(0x0A, resource.attributes))
    return body, _field(0x1A, resource.schema_url.encode()) if resource.schema_url else b""


# The encoded resource and scope of the spans seen (one of each per tracer), by identity:
# Resource's own hash serializes its attributes to JSON every time it is asked.
_heads: dict[int, tuple[object, Any]] = {}


def _head(thing: Any, make: Any) -> Any:
    found = _heads.get(id(thing))
    if found is None or found[0] is not thing:
        if len(_heads) >= 64:
            _heads.clear()
        found = _heads[id(thing)] = (thing, make(thing))
    return found[1]


def _scoped(scope: InstrumentationScope | None) -> tuple[bytes, bytes]:
    tail = b""
    if scope is not None and scope.schema_url:
        tail = _field(0x1A, scope.schema_url.encode())
    return _field(0x0A, _scope(scope)), tail


def encode(spans: Sequence[ReadableSpan | Spans]) -> bytes:
    """The serialized ExportTraceServiceRequest of `spans` (`Spans` as their `readable()`),
    grouped by resource and scope."""
    grouped: dict[int, tuple[Resource, dict[Any, list[bytes]]]] = {}
    for span in spans:
        resource = span.resource
        by_scope = grouped.setdefault(id(resource), (resource, {}))[1]
        by_scope.setdefault(span.instrumentation_scope or None, []).extend(_encoded(span))
    merged: list[tuple[Resource, dict[Any, list[bytes]]]] = []
    for resource, by_scope in grouped.values():  # equal resources, distinct objects: one group
        same = next((m for m in merged if m[0] == resource), None)
        if same is None:
            merged.append((resource, by_scope))
            continue
        for scope, encoded in by_scope.items():
            same[1].setdefault(scope, []).extend(encoded)
    out = []
    for resource, by_scope in merged:
        head, tail = _head(resource, _resource)
        body = [head]
        for scope, encoded in by_scope.items():
            scope_head, scope_tail = _head(scope, _scoped)
            scoped = scope_head + b"".join(_field(0x12, s) for s in encoded) + scope_tail
            body.append(_field(0x12, scoped))
        body.append(tail)
        out.append(_field(0x0A, b"".join(body)))
    return b"".join(out)


class Exporter(OTLPSpanExporter):
    """The SDK's OTLP/HTTP exporter, configured as it is, with the request encoded by `encode`."""

    def own_client(self) -> Any | None:
        """The SDK's HTTP client that takes encoded bytes (the SDK from 1.45 has one), or
        None: then each export is the SDK's own, its encoder included."""
        client = getattr(self, "_client", None)
        if client is None or getattr(self, "_shutdown", True) or not hasattr(client, "export"):
            return None
        return client

    def export(self, spans: Sequence[ReadableSpan | Spans]) -> SpanExportResult:
        client = self.own_client()
        if client is None:
            return super().export(expand(spans))
        try:
            data = encode(spans)
        except Exception as exc:  # the SDK's encoder says so and drops the batch as well
            log.error(Event.SPANS_NOT_ENCODED, extra={"spans": len(spans), "error": str(exc)})
            return SpanExportResult.FAILURE
        if client.export(data).success:
            return SpanExportResult.SUCCESS
        return SpanExportResult.FAILURE
