"""The SDK side of `sqsinfer.tracing`: imported by `from_env` only, once tracing is on.

One TracerProvider per worker (or command), never the global one, so that several
workers in one process (tests, the demo) keep their own resource and exporter. Spans go
through a BatchSpanProcessor per exporter; `shutdown` flushes and stops it within the
time it is given. Span names and attributes follow OpenTelemetry's messaging semantic
conventions (`messaging.system=aws_sqs`, `messaging.operation.type` ...); sqsinfer's own
facts are `sqsinfer.*` attributes.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.status import Status, StatusCode

from sqsinfer import __version__
from sqsinfer.config import ExternalConfigError
from sqsinfer.metrics import Phase
from sqsinfer.outcomes import Outcome
from sqsinfer.tracing import (
    EXEMPLAR_LABEL,
    TRACEPARENT,
    TRACESTATE,
    Received,
    TaskTrace,
    Tracer,
    queue_name,
)

if TYPE_CHECKING:
    from sqsinfer.messages import Task

_PROPAGATOR = TraceContextTextMapPropagator()
_ROOT = Context()  # a parent of nothing: a new trace
_KINDS = {
    "internal": SpanKind.INTERNAL,
    "client": SpanKind.CLIENT,
    "producer": SpanKind.PRODUCER,
    "consumer": SpanKind.CONSUMER,
}
_SYSTEM = {"messaging.system": "aws_sqs"}
# messaging.operation.type of each SQS call (ChangeMessageVisibilityBatch has none).
_OPERATION_TYPES = {
    "ReceiveMessage": "receive",
    "SendMessage": "send",
    "SendMessageBatch": "send",
    "DeleteMessageBatch": "settle",
}
# The phases the pipeline times that become a child span of the task, by name. The child's
# decode, predict and encode are events of the `compute` span instead (`SdkTask.compute`).
_PHASE_SPANS = {
    Phase.S3_GET.value: "GET input",
    Phase.WAIT_PROCESS.value: "wait for a process",
    Phase.COMMIT.value: "PUT output",
    Phase.CHAIN.value: "chain link",
}
_CHILD_STEPS = (("decode_s", "decode"), ("infer_s", "predict"), ("encode_s", "encode"))
_FAILED = frozenset({Outcome.REJECTED, Outcome.RETRIED})
_UNSET = Status(StatusCode.UNSET)
_SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
_PROTOCOLS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


# -- configuration -----------------------------------------------------------------------------
def _check_sampler(environ: Mapping[str, str]) -> None:
    """The SDK falls back to its default on a sampler it does not know: refuse it instead."""
    name = environ.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if name and name not in _SAMPLERS:
        raise ExternalConfigError("OTEL_TRACES_SAMPLER", f"{name!r} is not one of {_SAMPLERS}")
    if name.endswith("traceidratio"):
        text = environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0")
        try:
            ratio = float(text)
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:
            raise ExternalConfigError(
                "OTEL_TRACES_SAMPLER_ARG", f"{text!r}: a ratio from 0 to 1 for {name}"
            )


def _otlp(environ: Mapping[str, str]) -> SpanExporter:
    variable = next((v for v in _PROTOCOLS if environ.get(v)), _PROTOCOLS[1])
    protocol = environ.get(variable, "http/protobuf").strip().lower()
    if protocol == "http/protobuf":
        from sqsinfer.tracing.otlp import Exporter

        return Exporter()
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )
        except ImportError:
            raise ExternalConfigError(
                variable,
                "grpc needs opentelemetry-exporter-otlp-proto-grpc installed "
                "(the otel extra exports http/protobuf)",
            ) from None
        return Expanded(GrpcExporter())
    raise ExternalConfigError(variable, f"{protocol!r}: use http/protobuf or grpc")


def _exporters(environ: Mapping[str, str]) -> list[SpanExporter]:
    found: list[SpanExporter] = []
    for listed in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(","):
        name = listed.strip().lower()
        if name == "otlp":
            found.append(_otlp(environ))
        elif name == "console":
            found.append(Expanded(ConsoleSpanExporter(out=sys.stdout)))  # as it is now
        elif name not in ("none", ""):
            raise ExternalConfigError(
                "OTEL_TRACES_EXPORTER", f"{name!r}: sqsinfer exports to otlp, console or none"
            )
    return found


def _resource(service_instance: str, component: str) -> Resource:
    """The SDK's resource, with sqsinfer's facts where the variables (OTEL_SERVICE_NAME,
    OTEL_RESOURCE_ATTRIBUTES) leave them unset, and `sqsinfer` as the service's name."""
    given = OTELResourceDetector().detect().attributes
    ours: dict[str, str] = {
        SERVICE_NAME: "sqsinfer",
        "service.version": __version__,
        "service.instance.id": service_instance,
        "sqsinfer.component": component,
    }
    return Resource.create({k: v for k, v in ours.items() if v and k not in given})


# -- where a task's trace comes from -----------------------------------------------------------
def xray_parent(header: str) -> SpanContext | None:
    """The span context of an X-Ray trace header (`Root=1-<8 hex>-<24 hex>;Parent=<16 hex>;
    Sampled=1`), or None when it is not one. Only `Sampled=1` is taken as sampled."""
    fields = dict(part.strip().split("=", 1) for part in header.split(";") if "=" in part)
    version, epoch, unique = ([*fields.get("Root", "").split("-"), "", "", ""])[:3]
    parent = fields.get("Parent", "")
    if version != "1" or len(epoch) != 8 or len(unique) != 24 or len(parent) != 16:
        return None
    try:
        trace_id, span_id = int(epoch + unique, 16), int(parent, 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    flags = TraceFlags(TraceFlags.SAMPLED if fields.get("Sampled") == "1" else TraceFlags.DEFAULT)
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=flags)


def parent_context(message: Received) -> Context:
    """The producer's context: the `traceparent` attribute, else `AWSTraceHeader`, else none."""
    carrier = {
        name: str(value.get("StringValue", ""))
        for name, value in message.attributes.items()
        if name in (TRACEPARENT, TRACESTATE) and isinstance(value, dict)
    }
    if TRACEPARENT in carrier:
        context = _PROPAGATOR.extract(carrier)
        if trace.get_current_span(context).get_span_context().is_valid:
            return context
    found = xray_parent(message.trace_header) if message.trace_header else None
    if found is not None:
        return trace.set_span_in_context(NonRecordingSpan(found))
    return _ROOT


# -- spans -------------------------------------------------------------------------------------
# A step of a task, ended: (span id, name, kind, start ns, end ns, attributes or None,
# events as (name, attributes, ns) tuples, status). It is in its task's trace, a child of
# its span, sampled with it.
Step = tuple[int, str, SpanKind, int, int, "Mapping[str, Any] | None", tuple[Any, ...], Status]


class Spans:
    """Spans that ended together, one item of the span processor's queue: a task's span
    with its steps, or the span of a call alone.

    The SDK's tracer makes a live span per step (a lock, attributes checked and copied,
    a copy again when it ends) and the processor queues each; a traced task cost the
    worker about 0.8 ms that way. A step here is a tuple appended to its task's list, and
    the task's spans reach the processor as one item when the task ends: the exporter
    (`otlp.Exporter`) encodes the tuples straight to OTLP, any other exporter is handed
    the same spans as the SDK's `ReadableSpan`s (`expand`). So OTEL_BSP_MAX_QUEUE_SIZE and
    OTEL_BSP_MAX_EXPORT_BATCH_SIZE count tasks (and calls), not spans.
    """

    __slots__ = (
        "attributes",
        "context",
        "end_time",
        "instrumentation_scope",
        "kind",
        "links",
        "name",
        "parent",
        "resource",
        "start_time",
        "status",
        "steps",
    )

    def __init__(
        self,
        recorder: Recorder,
        context: SpanContext,
        parent: SpanContext | None,
        name: str,
        kind: SpanKind,
        *,
        start_time: int,
        end_time: int,
        attributes: Mapping[str, Any] | None = None,
        links: Sequence[Link] = (),
        status: Status = _UNSET,
        steps: Sequence[Step] = (),
    ) -> None:
        self.context = context  # what the span processor reads: only a sampled one is kept
        self.parent = parent
        self.name = name
        self.kind = kind
        self.start_time = start_time
        self.end_time = end_time
        self.attributes = attributes
        self.links = links
        self.status = status
        self.steps = steps
        self.resource = recorder.resource
        self.instrumentation_scope = recorder.scope

    def head(self) -> ReadableSpan:
        """The first span (the task's, or the call's) as the SDK's exporters take it."""
        return self._made(
            name=self.name,
            context=self.context,
            parent=self.parent,
            kind=self.kind,
            attributes=self.attributes,
            links=self.links,
            status=self.status,
            start_time=self.start_time,
            end_time=self.end_time,
        )

    def readable(self) -> list[ReadableSpan]:
        """All of them as the SDK's exporters take them."""
        found = [self.head()]
        for span_id, name, kind, start, end, attributes, events, status in self.steps:
            context = _in_trace(self.context, span_id)
            step = self._made(
                name=name,
                context=context,
                parent=self.context,
                kind=kind,
                attributes=attributes,
                events=[Event(n, a, at) for n, a, at in events],
                status=status,
                start_time=start,
                end_time=end,
            )
            found.append(step)
        return found

    def _made(self, **fields: Any) -> ReadableSpan:
        return ReadableSpan(
            resource=self.resource, instrumentation_scope=self.instrumentation_scope, **fields
        )


def _in_trace(parent: SpanContext, span_id: int) -> SpanContext:
    """The context of a step: in its task's trace and sampling."""
    return SpanContext(
        parent.trace_id,
        span_id,
        is_remote=False,
        trace_flags=parent.trace_flags,
        trace_state=parent.trace_state,
    )


def expand(items: Sequence[Any]) -> list[ReadableSpan]:
    """The `ReadableSpan`s of what a span processor hands its exporter."""
    found: list[ReadableSpan] = []
    for item in items:
        found.extend(item.readable() if isinstance(item, Spans) else (item,))
    return found


class Expanded(SpanExporter):
    """An SDK exporter (console, OTLP/gRPC) fed `Spans` as the `ReadableSpan`s it takes."""

    def __init__(self, exporter: SpanExporter) -> None:
        self.exporter = exporter

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        return self.exporter.export(expand(spans))

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)


class Recorder:
    """Decides a span's context as the SDK's tracer would, with the provider's own parts
    (the sampler, OTEL_TRACES_SAMPLER; the id generator; the resource), and hands ended
    spans to the span processors as `Spans`. Attributes are not truncated to the
    OTEL_ATTRIBUTE_* limits: sqsinfer's are few and short (an S3 URI is the longest).
    """

    def __init__(self, provider: TracerProvider, processors: Sequence[SpanProcessor]) -> None:
        self.resource = provider.resource
        self.scope = InstrumentationScope("sqsinfer", __version__)
        self.span_id = provider.id_generator.generate_span_id
        self._ids = provider.id_generator
        self._sampler = provider.sampler
        self._processors = tuple(processors)

    def start(
        self,
        parent: Context,
        name: str,
        kind: SpanKind,
        attributes: Mapping[str, Any] | None = None,
        links: Sequence[Link] = (),
    ) -> tuple[SpanContext, SpanContext | None]:
        """A new span's context, sampled as the tracer would; and its parent's (None: a root)."""
        found = trace.get_current_span(parent).get_span_context()
        parent_context = found if found.is_valid else None
        trace_id = found.trace_id if parent_context else self._ids.generate_trace_id()
        decided = self._sampler.should_sample(parent, trace_id, name, kind, attributes, links)
        sampled = decided.decision.is_sampled()  # type: ignore[no-untyped-call]
        flags = TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT
        if parent_context is None:
            random = getattr(self._ids, "is_trace_id_random", bool)()
        else:
            random = getattr(parent_context.trace_flags, "random_trace_id", False)
        if random:  # W3C trace context level 2, where the API knows the flag
            flags |= getattr(TraceFlags, "RANDOM_TRACE_ID", 0)
        context = SpanContext(
            trace_id,
            self.span_id(),
            is_remote=False,
            trace_flags=TraceFlags(flags),
            trace_state=decided.trace_state,
        )
        return context, parent_context

    def emit(self, spans: Spans) -> None:
        """Ended spans to every processor (only sampled ones are exported)."""
        for processor in self._processors:
            processor.on_end(spans)  # type: ignore[arg-type]  # see `Spans`


def _failed(error: type[BaseException] | None) -> Status:
    # A cancel too: the step did not finish.
    return _UNSET if error is None else Status(StatusCode.ERROR, error.__name__)


class Call:
    """The span of a call made for several tasks, a trace of its own linked to each (a
    context manager: the span is decided, and emitted if sampled, when the call ends)."""

    __slots__ = ("_attributes", "_kind", "_links", "_name", "_recorder", "_start")

    def __init__(
        self,
        recorder: Recorder,
        name: str,
        kind: SpanKind,
        attributes: dict[str, Any],
        links: Sequence[Link],
    ) -> None:
        self._recorder = recorder
        self._name = name
        self._kind = kind
        self._attributes = attributes
        self._links = links
        self._start = 0

    def __enter__(self) -> None:
        self._start = time.time_ns()

    def __exit__(self, error: type[BaseException] | None, *_: object) -> None:
        end = time.time_ns()
        name, kind, attributes, links = self._name, self._kind, self._attributes, self._links
        context = self._recorder.start(_ROOT, name, kind, attributes, links)[0]
        if context.trace_flags.sampled:
            spans = Spans(
                self._recorder, context, None, name, kind, start_time=self._start, end_time=end,
                attributes=attributes, links=links, status=_failed(error),
            )  # fmt: skip
            self._recorder.emit(spans)


class StepTimer:
    """A step of a task around a call (a context manager): its span ends when the call does."""

    __slots__ = ("_attributes", "_kind", "_name", "_start", "_task")

    def __init__(
        self, task: SdkTask, name: str, kind: SpanKind, attributes: Mapping[str, Any] | None
    ) -> None:
        self._task = task
        self._name = name
        self._kind = kind
        self._attributes = attributes
        self._start = 0

    def __enter__(self) -> None:
        self._start = time.time_ns()

    def __exit__(self, error: type[BaseException] | None, *_: object) -> None:
        end = time.time_ns()
        self._task.add(
            self._name, self._start, end, kind=self._kind, attributes=self._attributes,
            status=_failed(error),
        )  # fmt: skip


class SdkTask(TaskTrace):
    """One task's span (`process <queue>`, or `create <queue>` in `sqsinfer enqueue`), and
    its steps, emitted together when it ends."""

    __slots__ = (
        "_attributes",
        "_context",
        "_end_ns",
        "_ended",
        "_kind",
        "_name",
        "_outgoing",
        "_parent",
        "_recorder",
        "_start_ns",
        "_status",
        "_steps",
        "recording",
    )

    def __init__(
        self,
        recorder: Recorder,
        parent: Context,
        name: str,
        *,
        kind: SpanKind,
        attributes: dict[str, Any],
        start_ns: int,
    ) -> None:
        self._recorder = recorder
        self._context, self._parent = recorder.start(parent, name, kind, attributes)
        self._name = name
        self._kind = kind
        self._attributes = attributes
        self._start_ns = start_ns
        self._end_ns: int | None = None
        self._ended = False
        self._status = _UNSET
        self._outgoing: dict[str, dict[str, str]] | None = None
        self._steps: list[Step] = []
        self.recording = self._context.trace_flags.sampled

    def add(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        events: tuple[Any, ...] = (),
        status: Status = _UNSET,
    ) -> None:
        """A step, ended: kept until the task ends; emitted alone when that was before."""
        step = (self._recorder.span_id(), name, kind, start_ns, end_ns, attributes, events, status)
        if not self._ended:
            self._steps.append(step)
            return
        context = _in_trace(self._context, step[0])
        late = Spans(
            self._recorder, context, self._context, name, kind, start_time=start_ns,
            end_time=end_ns, attributes=attributes, status=status,
        )  # fmt: skip
        self._recorder.emit(late)

    def phase(self, phase: str, seconds: float) -> None:
        name = _PHASE_SPANS.get(phase)
        if name is not None and self.recording:
            end = time.time_ns()
            self.add(name, end - _ns(seconds), end)

    def compute(self, total_s: float, child: Mapping[str, Any]) -> None:
        """`compute`: the lease of a process, with the child's steps as events where they
        ran. The child measures each step's length, not its clock: the steps are laid end
        to end, the time of the hand-over (there and back) split either side of them."""
        if not self.recording:
            return
        end = time.time_ns()
        start = end - _ns(total_s)
        spent_s = sum(float(child[key]) for key, _ in _CHILD_STEPS)
        at = start + _ns(max(0.0, total_s - spent_s) / 2)
        events = []
        for key, name in _CHILD_STEPS:
            seconds = float(child[key])
            events.append((name, {"sqsinfer.duration_s": seconds}, at))
            at += _ns(seconds)
        rows = {"sqsinfer.rows": int(child.get("rows", 0))}
        self.add("compute", start, end, attributes=rows, events=tuple(events))

    def step(
        self, name: str, kind: str = "internal", attributes: Mapping[str, Any] | None = None
    ) -> contextlib.AbstractContextManager[None]:
        if not self.recording:
            return contextlib.nullcontext()
        return StepTimer(self, name, _KINDS[kind], attributes)

    def call(
        self, operation: str, destination: str, kind: str = "client"
    ) -> contextlib.AbstractContextManager[None]:
        if not self.recording:
            return contextlib.nullcontext()
        name, attributes = _call_attributes(operation, destination, 1)
        return StepTimer(self, name, _KINDS[kind], attributes)

    def outgoing(self) -> dict[str, dict[str, str]]:
        if self._outgoing is None:
            carrier: dict[str, str] = {}
            context = trace.set_span_in_context(NonRecordingSpan(self._context))
            _PROPAGATOR.inject(carrier, context=context)
            self._outgoing = {
                name: {"DataType": "String", "StringValue": value}
                for name, value in carrier.items()
            }
        return self._outgoing

    def note(self, attributes: Mapping[str, str]) -> None:
        if self.recording:
            self._attributes.update(attributes)

    def child(self, name: str, attributes: Mapping[str, Any]) -> TaskTrace:
        start = time.time_ns()  # first: the span ends `seconds` after it (one clock's reading)
        parent = trace.set_span_in_context(NonRecordingSpan(self._context))
        return SdkTask(
            self._recorder,
            parent,
            name,
            kind=SpanKind.INTERNAL,
            attributes=dict(attributes),
            start_ns=start,
        )

    def finish_records(self, outcomes: Sequence[str], seconds: float) -> None:
        self._end_ns = self._start_ns + _ns(seconds)
        if not self.recording:
            return
        listed = [str(outcome) for outcome in outcomes]
        self._attributes["sqsinfer.records"] = len(listed)
        self._attributes["sqsinfer.outcomes"] = listed
        failed = sum(outcome in _FAILED for outcome in outcomes)
        if failed:
            self._status = Status(StatusCode.ERROR, f"{failed} of {len(listed)} records")

    def finish(self, outcome: str, reason: str, seconds: float, task: Task | None) -> None:
        self._end_ns = self._start_ns + _ns(seconds)
        if not self.recording:
            return
        found = self._attributes
        found["sqsinfer.outcome"] = str(outcome)
        if reason:
            found["sqsinfer.reason"] = reason
        if task is not None:
            found["sqsinfer.task_id"] = task.task_id
            found["sqsinfer.input"] = str(task.input)
            found["sqsinfer.output"] = str(task.output)
        if outcome in _FAILED:
            self._status = Status(StatusCode.ERROR, reason or str(outcome))

    def end(self, error: str = "") -> None:
        if self._ended:
            return
        self._ended = True
        if not self.recording:
            return
        if error:
            self._status = Status(StatusCode.ERROR, error)
        spans = Spans(
            self._recorder,
            self._context,
            self._parent,
            self._name,
            self._kind,
            start_time=self._start_ns,
            end_time=time.time_ns() if self._end_ns is None else self._end_ns,
            attributes=self._attributes,
            status=self._status,
            steps=self._steps,
        )
        self._steps = []
        self._recorder.emit(spans)

    def exemplar(self) -> dict[str, str] | None:
        if not self.recording:
            return None
        return {EXEMPLAR_LABEL: format(self._context.trace_id, "032x")}

    @property
    def link(self) -> Any:
        return self._context if self.recording else None


def batch_span(
    operation: str, destination: str, count: int, traces: Sequence[TaskTrace], kind: str
) -> contextlib.AbstractContextManager[None]:
    """`<operation> <queue>`: one SQS call for `count` entries, linked to each recorded task."""
    first = traces[0]
    assert isinstance(first, SdkTask)
    name, attributes = _call_attributes(operation, destination, count)
    links = [Link(t.link) for t in traces]
    return Call(first._recorder, name, _KINDS[kind], attributes, links)


def _call_attributes(operation: str, destination: str, count: int) -> tuple[str, dict[str, Any]]:
    """The name and attributes of the span of one SQS call for `count` messages."""
    queue = queue_name(destination)
    attributes: dict[str, Any] = _SYSTEM | {
        "messaging.operation.name": operation,
        "messaging.destination.name": queue,
    }
    if operation in _OPERATION_TYPES:
        attributes["messaging.operation.type"] = _OPERATION_TYPES[operation]
    if count > 1 or operation.endswith("Batch"):
        attributes["messaging.batch.message_count"] = count
    return f"{operation} {queue}", attributes


class SdkTracer(Tracer):
    enabled = True

    def __init__(self, provider: TracerProvider, processors: Sequence[SpanProcessor]) -> None:
        self._provider = provider
        self._recorder = Recorder(provider, processors)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str], service_instance: str, component: str
    ) -> SdkTracer:
        _check_sampler(environ)
        exporters = _exporters(environ)
        # Its own atexit hook would wait for an unreachable collector: `shutdown` is bounded.
        provider = TracerProvider(
            resource=_resource(service_instance, component), shutdown_on_exit=False
        )
        processors = [BatchSpanProcessor(exporter) for exporter in exporters]
        for processor in processors:
            provider.add_span_processor(processor)
        return cls(provider, processors)

    def _task(self, message: Received, queue: str, clock_ns: int) -> SdkTask:
        # The span starts when the message arrived, as the task's `seconds` count (from
        # the monotonic clock, placed on the wall clock by `clock_ns`).
        attributes: dict[str, Any] = _SYSTEM | {
            "messaging.operation.type": "process",
            "messaging.operation": "process",  # the name before semantic conventions 1.26
            "messaging.destination.name": queue,
            "messaging.message.id": message.message_id,
            "sqsinfer.receive_count": message.receive_count,
        }
        return SdkTask(
            self._recorder,
            parent_context(message),
            f"process {queue}",
            kind=SpanKind.CONSUMER,
            attributes=attributes,
            start_ns=clock_ns + _ns(message.received_at),
        )

    def received(self, queue_url: str, spent_s: float, messages: Sequence[Received]) -> None:
        if not messages:
            return
        now = time.time_ns()
        clock_ns = now - time.monotonic_ns()  # wall-clock time of monotonic 0
        queue = queue_name(queue_url)
        for message in messages:
            message.trace = self._task(message, queue, clock_ns)
        recorded = [m.trace.link for m in messages if m.trace.recording]
        if not recorded:
            return
        name, attributes = _call_attributes("ReceiveMessage", queue_url, len(messages))
        attributes["messaging.batch.message_count"] = len(messages)
        links = [Link(link) for link in recorded]
        context, _ = self._recorder.start(_ROOT, name, SpanKind.CLIENT, attributes, links)
        if context.trace_flags.sampled:
            spans = Spans(
                self._recorder, context, None, name, SpanKind.CLIENT,
                start_time=now - _ns(spent_s), end_time=now, attributes=attributes, links=links,
            )  # fmt: skip
            self._recorder.emit(spans)

    def produce(self, queue_url: str, task_id: str) -> TaskTrace:
        queue = queue_name(queue_url)
        attributes = _SYSTEM | {
            "messaging.operation.type": "create",
            "messaging.operation": "create",
            "messaging.destination.name": queue,
            "sqsinfer.task_id": task_id,
        }
        return SdkTask(
            self._recorder,
            _ROOT,
            f"create {queue}",
            kind=SpanKind.PRODUCER,
            attributes=attributes,
            start_ns=time.time_ns(),
        )

    def shutdown(self, timeout_s: float) -> bool:
        """Flush and stop in a thread of its own, waited for `timeout_s`: an exporter stuck on
        an unreachable collector is left behind (its thread does not hold up the exit)."""
        done = threading.Event()

        def close() -> None:
            try:
                self._provider.force_flush(max(1, int(timeout_s * 1000)))
                self._provider.shutdown()
            finally:
                done.set()

        threading.Thread(target=close, name="sqsinfer-traces-flush", daemon=True).start()
        return done.wait(timeout_s)
