"""sqsinfer's OTLP encoding of spans: the request the SDK's own encoder makes, byte for byte
once decoded, for every kind of value, event, link and status; and the exporter sends it."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http import trace_exporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags, TraceState
from opentelemetry.trace.status import Status, StatusCode

from sqsinfer.bench.otlp import OtlpReceiver, count_spans
from sqsinfer.tracing import otlp, sdk

RESOURCE = Resource.create({"service.name": "sqsinfer", "sqsinfer.component": "worker"})
SCOPE = InstrumentationScope("sqsinfer", "1.0")
REMOTE = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(1))
VALUES = {
    "text": "aws_sqs",
    "unicode": "s3://b/é/ü.npy",
    "empty": "",
    "int": 42,
    "zero": 0,
    "negative": -7,
    "big": 2**62,
    "float": 0.25,
    "true": True,
    "false": False,
    "strings": ["committed", "ignored"],
    "ints": [1, 2, 3],
    "none": None,
}


def _span(name: str, **fields) -> ReadableSpan:
    context = SpanContext(
        0x0AF7651916CD43DD8448EB211C80319C,
        fields.pop("span_id", 0x00F067AA0BA902B7),
        is_remote=False,
        trace_flags=TraceFlags(1),
        trace_state=fields.pop("trace_state", TraceState()),
    )
    return ReadableSpan(
        name=name,
        context=context,
        resource=fields.pop("resource", RESOURCE),
        instrumentation_scope=fields.pop("scope", SCOPE),
        start_time=1_796_000_000_000_000_000,
        end_time=1_796_000_000_250_000_000,
        **fields,
    )


SPANS = [
    _span("process q", kind=SpanKind.CONSUMER, parent=REMOTE, attributes=VALUES),
    _span(
        "compute",
        span_id=2,
        parent=SpanContext(0xABC, 0x12, is_remote=False),
        attributes={"sqsinfer.rows": 10_000},
        events=[Event("decode", {"sqsinfer.duration_s": 0.0007}, 1_796_000_000_100_000_000)],
    ),
    _span(
        "DeleteMessageBatch q",
        span_id=3,
        kind=SpanKind.CLIENT,
        links=[Link(REMOTE), Link(SpanContext(1, 2, False), {"n": 1})],
        status=Status(StatusCode.ERROR, "ClientError"),
        trace_state=TraceState([("vendor", "value"), ("other", "x")]),
    ),
    _span("PUT output", span_id=4, status=Status(StatusCode.OK)),
    # Another resource, and an equal one that is not the same object, and another scope.
    _span("create q", span_id=5, kind=SpanKind.PRODUCER, resource=Resource.create({"a": "b"})),
    _span("delete", span_id=6, resource=Resource.create(dict(RESOURCE.attributes))),
    _span("step", span_id=7, scope=InstrumentationScope("other", None, "https://schema")),
]


# The exporter sends its own encoding only through the client of the SDK from 1.45; with an
# older SDK (the declared floor is 1.27) every export is the SDK's own, encoder included,
# so what `encode` must equal is the encoding of the SDKs it is used with.
_OWN = otlp.Exporter(endpoint="http://127.0.0.1:9/v1/traces").own_client() is not None
_USED = pytest.mark.skipif(not _OWN, reason="this SDK's exporter encodes its own requests")


def test_the_bench_counts_the_spans_of_a_request():
    """What the tracing micro-benchmark checks its export by: every span, none dropped."""
    assert count_spans(encode_spans(SPANS).SerializeToString()) == len(SPANS)
    assert count_spans(encode_spans(SPANS[:1]).SerializeToString()) == 1
    assert count_spans(b"") == 0


@_USED
def test_the_request_decodes_equal_to_the_sdk_encoders():
    ours = ExportTraceServiceRequest.FromString(otlp.encode(SPANS))
    assert ours == encode_spans(SPANS)
    assert ours.SerializeToString() == encode_spans(SPANS).SerializeToString()


@_USED
@pytest.mark.parametrize("count", [1, 3])
def test_each_span_alone_and_a_few_decode_equal(count: int):
    for first in range(len(SPANS)):
        batch = SPANS[first : first + count]
        assert ExportTraceServiceRequest.FromString(otlp.encode(batch)) == encode_spans(batch)


@_USED
def test_the_exporter_sends_this_encoding_through_the_sdks_client(monkeypatch):
    """The SDK's own encoder is not called: the request the receiver got is `encode`'s."""

    def refused(spans):
        raise AssertionError("the SDK's encoder was used")

    monkeypatch.setattr(trace_exporter, "encode_spans", refused)
    with OtlpReceiver(keep=True) as receiver:
        exporter = otlp.Exporter(endpoint=receiver.url + "/v1/traces")
        assert exporter.export(SPANS) is SpanExportResult.SUCCESS
        exporter.shutdown()
        (body,) = receiver.kept()
    assert body == otlp.encode(SPANS)


def test_without_the_sdks_client_the_export_is_the_sdks_own(monkeypatch):
    """An SDK without the client (before 1.45): the request is the SDK's encoding."""
    monkeypatch.setattr(otlp.Exporter, "own_client", lambda self: None)
    with OtlpReceiver(keep=True) as receiver:
        exporter = otlp.Exporter(endpoint=receiver.url + "/v1/traces")
        assert exporter.export(SPANS) is SpanExportResult.SUCCESS
        exporter.shutdown()
        (body,) = receiver.kept()
    assert body == encode_spans(SPANS).SerializeToString()


def _task_spans() -> sdk.Spans:
    """A task's spans as the worker queues them: the task's span (its parent remote, a trace
    state, attributes of each type) and its steps (one with events, one failed, a kind)."""
    recorder = sdk.Recorder(TracerProvider(resource=RESOURCE), [])
    context = SpanContext(
        0x0AF7651916CD43DD8448EB211C80319C,
        0x00F067AA0BA902B7,
        is_remote=False,
        trace_flags=TraceFlags(1),
        trace_state=TraceState([("vendor", "value")]),
    )
    start = 1_796_000_000_000_000_000
    events = (("decode", {"sqsinfer.duration_s": 0.0007}, start + 5), ("predict", None, start + 9))
    steps = [
        (11, "GET input", SpanKind.INTERNAL, start + 1, start + 2, None, (), sdk._UNSET),
        (12, "compute", SpanKind.INTERNAL, start + 3, start + 20, {"sqsinfer.rows": 10}, events,
         sdk._UNSET),
        (13, "SendMessage next", SpanKind.PRODUCER, start + 21, start + 30, VALUES, (),
         Status(StatusCode.ERROR, "CancelledError")),
    ]  # fmt: skip
    return sdk.Spans(
        recorder,
        context,
        REMOTE,
        "process q",
        SpanKind.CONSUMER,
        start_time=start,
        end_time=start + 40,
        attributes={"sqsinfer.outcome": "committed", "sqsinfer.receive_count": 2},
        links=[Link(REMOTE)],
        steps=steps,
    )


@_USED
def test_a_tasks_spans_decode_equal_to_the_sdk_encoding_of_them_as_readable_spans():
    spans = _task_spans()
    readable = spans.readable()
    assert [s.name for s in readable] == ["process q", "GET input", "compute", "SendMessage next"]
    assert {s.parent.span_id for s in readable[1:]} == {spans.context.span_id}
    for batch in ([spans], [spans, *SPANS[:3]], [SPANS[4], spans]):
        expected = encode_spans([*sdk.expand(batch)])
        assert ExportTraceServiceRequest.FromString(otlp.encode(batch)) == expected


def test_without_the_sdks_client_a_tasks_spans_go_as_the_sdk_encodes_them(monkeypatch):
    monkeypatch.setattr(otlp.Exporter, "own_client", lambda self: None)
    spans = _task_spans()
    with OtlpReceiver(keep=True) as receiver:
        exporter = otlp.Exporter(endpoint=receiver.url + "/v1/traces")
        assert exporter.export([spans]) is SpanExportResult.SUCCESS
        exporter.shutdown()
        (body,) = receiver.kept()
    request = ExportTraceServiceRequest.FromString(body)
    assert request == encode_spans(spans.readable())
    (scoped,) = request.resource_spans[0].scope_spans
    assert len(scoped.spans) == 4
