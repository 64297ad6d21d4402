"""The SDK side of `sqsinfer.tracing`, imported by `from_env` alone once tracing is on.

OpenTelemetry's spans, from a TracerProvider of each worker or command (never the global
one: several workers in one process keep their own resource and exporters), exported by a
BatchSpanProcessor per exporter. Names and attributes follow the messaging semantic
conventions (`messaging.system=aws_sqs` ...); sqsinfer's own facts are `sqsinfer.*`.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagators.aws import AwsXRayPropagator
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, TracerProvider, sampling
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from sqsinfer import __version__
from sqsinfer.config import ExternalConfigError
from sqsinfer.tracing import api

_PROPAGATOR = TraceContextTextMapPropagator()
_XRAY, _XRAY_KEY = AwsXRayPropagator(), "X-Amzn-Trace-Id"  # the header AWSTraceHeader holds
_ROOT = Context()  # a parent of nothing: a new trace
_KINDS = {"client": SpanKind.CLIENT, "producer": SpanKind.PRODUCER}
_SYSTEM = {"messaging.system": "aws_sqs"}
_CREATE = dict.fromkeys(("messaging.operation.type", "messaging.operation"), "create")
# messaging.operation.type of each SQS call (ChangeMessageVisibilityBatch has none).
_TYPES = {"ReceiveMessage": "receive", "DeleteMessageBatch": "settle"}
_TYPES |= {"SendMessage": "send", "SendMessageBatch": "send"}
_SAMPLERS: tuple[str, ...] = ("always_on", "always_off", "traceidratio")
_SAMPLERS += tuple(f"parentbased_{name}" for name in _SAMPLERS)
# Without OTEL_TRACES_SAMPLER: a tenth of new traces, and whatever the producer sampled.
DEFAULT_RATIO = 0.1
_PROTOCOLS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


# -- configuration -----------------------------------------------------------------------------
def _sampler(environ: Mapping[str, str]) -> sampling.Sampler | None:
    """sqsinfer's default sampler; None when OTEL_TRACES_SAMPLER names one (the SDK reads
    it). The SDK falls back to its default on a name or ratio it cannot use: refused here."""
    name = environ.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if not name:
        return sampling.ParentBasedTraceIdRatio(DEFAULT_RATIO)
    if name not in _SAMPLERS:
        raise ExternalConfigError("OTEL_TRACES_SAMPLER", f"{name!r} is not one of {_SAMPLERS}")
    text = environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0")
    try:
        ratio = float(text)
    except ValueError:
        ratio = math.nan
    if name.endswith("traceidratio") and not 0.0 <= ratio <= 1.0:
        raise ExternalConfigError("OTEL_TRACES_SAMPLER_ARG", f"{text!r}: a ratio from 0 to 1")
    return None


def _otlp(environ: Mapping[str, str]) -> SpanExporter:
    """The SDK's OTLP exporter (endpoint, headers, timeout ... from OTEL_EXPORTER_OTLP_*)."""
    variable = next((v for v in _PROTOCOLS if environ.get(v)), _PROTOCOLS[1])
    protocol = environ.get(variable, "http/protobuf").strip().lower()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol != "grpc":
        raise ExternalConfigError(variable, f"{protocol!r}: use http/protobuf or grpc")
    try:
        from opentelemetry.exporter.otlp.proto.grpc import trace_exporter
    except ImportError:
        why = "grpc needs opentelemetry-exporter-otlp-proto-grpc (the extra's is http/protobuf)"
        raise ExternalConfigError(variable, why) from None
    exporter: SpanExporter = trace_exporter.OTLPSpanExporter()
    return exporter


def _exporters(environ: Mapping[str, str]) -> list[SpanExporter]:
    found: list[SpanExporter] = []
    for listed in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(","):
        name = listed.strip().lower()
        if name == "otlp":
            found.append(_otlp(environ))
        elif name == "console":
            found.append(ConsoleSpanExporter(out=sys.stdout))  # as it is now
        elif name not in ("none", ""):
            why = f"{name!r}: sqsinfer exports to otlp, console or none"
            raise ExternalConfigError("OTEL_TRACES_EXPORTER", why)
    return found


def _resource(service_instance: str, component: str) -> Resource:
    """The SDK's resource, with sqsinfer's facts where the variables (OTEL_SERVICE_NAME,
    OTEL_RESOURCE_ATTRIBUTES) leave them unset, and `sqsinfer` as the service's name."""
    given = OTELResourceDetector().detect().attributes
    ours = {SERVICE_NAME: "sqsinfer", "service.version": __version__}
    ours |= {"service.instance.id": service_instance, "sqsinfer.component": component}
    return Resource.create({k: v for k, v in ours.items() if v and k not in given})


# -- where a task's trace comes from -----------------------------------------------------------
def parent_context(message: api.Received) -> Context:
    """The producer's context: the `traceparent` attribute, else `AWSTraceHeader`, else none
    (a new trace). X-Ray's header is sampled only where it says `Sampled=1`."""
    carrier = {
        name: str(value.get("StringValue", ""))
        for name, value in message.attributes.items()
        if name in (api.TRACEPARENT, api.TRACESTATE) and isinstance(value, dict)
    }
    for context in (_PROPAGATOR.extract(carrier), _XRAY.extract({_XRAY_KEY: message.trace_header})):
        if trace.get_current_span(context).get_span_context().is_valid:
            return context
    return _ROOT


def _call(operation: str, destination: str, count: int | None) -> tuple[str, dict[str, Any]]:
    """The name and attributes of the span of one SQS call (a batch call's for `count`)."""
    queue = api.queue_name(destination)
    attributes: dict[str, Any] = _SYSTEM | {"messaging.operation.name": operation}
    attributes["messaging.destination.name"] = queue
    if operation in _TYPES:
        attributes["messaging.operation.type"] = _TYPES[operation]
    if count is not None:
        attributes["messaging.batch.message_count"] = count
    return f"{operation} {queue}", attributes


def _around(span: trace.Span) -> contextlib.AbstractContextManager[Any]:
    """The span open while the call it is around runs (status error if the call raises)."""
    return trace.use_span(span, end_on_exit=True, record_exception=False)


# -- spans -------------------------------------------------------------------------------------
class SdkTask(api.TaskTrace):
    """A task's span (`process <queue>`, `create <queue>` in `sqsinfer enqueue`, or a
    `record`), open until `end`; its steps are spans within it, made as they end."""

    __slots__ = ("_context", "_span", "_start_ns", "_tracer", "recording")

    def __init__(self, tracer: SdkTracer, span: trace.Span, start_ns: int) -> None:
        self._tracer, self._span, self._start_ns = tracer, span, start_ns
        self._context = trace.set_span_in_context(span)  # its steps' parent
        self.recording = span.is_recording()  # asked once: an ended span says False

    def step(
        self,
        name: str,
        seconds: float,
        *,
        attributes: Mapping[str, Any] | None = None,
        events: Sequence[api.StepEvent] = (),
        error: str = "",
    ) -> None:
        if not self.recording:
            return
        # Ended as it is made, and sampled with its task: the SDK's finished span, straight
        # to the processors, without a live span's bookkeeping (half of tracing's calls).
        end, tracer, own = time.time_ns(), self._tracer, self._span.get_span_context()
        start = end - _ns(seconds)
        span_id = tracer.provider.id_generator.generate_span_id()
        context = trace.SpanContext(own.trace_id, span_id, False, own.trace_flags, own.trace_state)
        span = ReadableSpan(
            name,
            context,
            own,
            tracer.provider.resource,
            attributes,
            tuple(Event(event, facts, start + _ns(at_s)) for event, at_s, facts in events),
            status=Status(StatusCode.ERROR, error) if error else Status(),
            start_time=start,
            end_time=end,
            instrumentation_scope=tracer.scope,
        )
        for processor in tracer.processors:
            processor.on_end(span)

    def call(
        self, operation: str, queue_url: str, kind: str = "client"
    ) -> contextlib.AbstractContextManager[Any]:
        if not self.recording:
            return contextlib.nullcontext()
        name, attributes = _call(operation, queue_url, None)
        return _around(self._tracer.otel.start_span(name, self._context, _KINDS[kind], attributes))

    def batch(
        self,
        operation: str,
        queue_url: str,
        served: int,
        linked: Sequence[api.TaskTrace],
        kind: str,
    ) -> contextlib.AbstractContextManager[Any]:
        name, attributes = _call(operation, queue_url, served)
        links = [Link(t.link) for t in linked]
        return _around(self._tracer.otel.start_span(name, _ROOT, _KINDS[kind], attributes, links))

    def outgoing(self) -> dict[str, dict[str, str]]:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=self._context)
        return {k: {"DataType": "String", "StringValue": v} for k, v in carrier.items()}

    def note(self, attributes: Mapping[str, Any]) -> None:
        if self.recording:
            self._span.set_attributes(attributes)

    def child(self, name: str, attributes: Mapping[str, Any]) -> api.TaskTrace:
        return self._tracer.start(name, self._context, SpanKind.INTERNAL, attributes)

    def end(self, seconds: float | None = None, error: str = "") -> None:
        if not self._span.is_recording():  # not sampled, or ended already
            return
        if error:
            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end(None if seconds is None else self._start_ns + _ns(seconds))

    @property
    def link(self) -> Any:
        return self._span.get_span_context() if self.recording else None


class SdkTracer(api.Tracer):
    enabled = True

    def __init__(self, provider: TracerProvider, processors: Sequence[SpanProcessor]) -> None:
        self.provider, self.processors = provider, processors
        self.otel = provider.get_tracer("sqsinfer", __version__)
        self.scope = InstrumentationScope("sqsinfer", __version__)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str], service_instance: str, component: str
    ) -> SdkTracer:
        sampler, exporters = _sampler(environ), _exporters(environ)
        resource = _resource(service_instance, component)
        # Its own atexit hook would wait for an unreachable collector: `shutdown` is bounded.
        provider = TracerProvider(sampler, resource, shutdown_on_exit=False)
        processors = [BatchSpanProcessor(exporter) for exporter in exporters]
        for processor in processors:
            provider.add_span_processor(processor)
        return cls(provider, processors)

    def start(self, name: str, parent: Context, kind: SpanKind, facts: Any, at: int = 0) -> SdkTask:
        at = at or time.time_ns()
        return SdkTask(self, self.otel.start_span(name, parent, kind, facts, start_time=at), at)

    def received(self, queue_url: str, spent_s: float, messages: Sequence[api.Received]) -> None:
        now = time.time_ns()
        clock_ns = now - time.monotonic_ns()  # wall-clock time of monotonic 0
        queue = api.queue_name(queue_url)
        ours: dict[str, Any] = _SYSTEM | {
            "messaging.operation.type": "process",
            "messaging.destination.name": queue,
        }
        ours["messaging.operation"] = "process"  # its name before semantic conventions 1.26
        for message in messages:  # its span starts when it arrived, as the task's `seconds` do
            attributes = ours | {"messaging.message.id": message.message_id}
            attributes["sqsinfer.receive_count"] = message.receive_count
            at = clock_ns + _ns(message.received_at)
            parent = parent_context(message)
            message.trace = self.start(
                f"process {queue}", parent, SpanKind.CONSUMER, attributes, at
            )
        links = [Link(m.trace.link) for m in messages if m.trace.recording]
        if links:
            name, attributes = _call("ReceiveMessage", queue_url, len(messages))
            at = now - _ns(spent_s)
            self.otel.start_span(name, _ROOT, SpanKind.CLIENT, attributes, links, at).end(now)

    def produce(self, queue_url: str, task_id: str) -> api.TaskTrace:
        queue = api.queue_name(queue_url)
        attributes = _SYSTEM | _CREATE
        attributes |= {"messaging.destination.name": queue, "sqsinfer.task_id": task_id}
        return self.start(f"create {queue}", _ROOT, SpanKind.PRODUCER, attributes)

    def shutdown(self, timeout_s: float = api.FLUSH_S) -> bool:
        """Export what is left and stop, in a thread of its own waited for `timeout_s`: an export
        stuck on a down or slow collector is left behind with its spans (a daemon thread)."""
        done = threading.Event()

        def close() -> None:
            try:
                self.provider.shutdown()  # each processor exports what it holds, then stops
            finally:
                done.set()

        threading.Thread(target=close, name=api.FLUSH_THREAD, daemon=True).start()
        return done.wait(timeout_s)
