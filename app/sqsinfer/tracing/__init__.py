"""Traces of every task (OpenTelemetry), when the `otel` extra is installed and not disabled.

This package is the only importer of opentelemetry (an import-linter contract holds the
rest of sqsinfer to it), and it imports it only once tracing is on: this module is the
front, with the switched-off objects every caller holds by default (`NO_TRACE`, `OFF`),
whose every method does nothing; `sqsinfer.tracing.sdk` is the SDK side, imported by
`from_env` alone. Without the extra, or with `OTEL_SDK_DISABLED=true` or
`OTEL_TRACES_EXPORTER=none`, nothing of opentelemetry is imported and a task's hooks are
calls of empty methods.

Configuration is OpenTelemetry's own variables, read by the SDK (`OTEL_SERVICE_NAME`,
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER[_ARG]`, `OTEL_EXPORTER_OTLP_*`,
`OTEL_BSP_*`); the ones chosen here (`OTEL_TRACES_EXPORTER`, the OTLP protocol) are
checked at start-up, and a bad one stops it with a message naming the variable.

A task's trace context travels as SQS message attributes: W3C `traceparent` (and
`tracestate`) in, out to the next stage and on every DLQ copy; X-Ray's `AWSTraceHeader`
system attribute is read when a message has no `traceparent`.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from sqsinfer.logs import Event

if TYPE_CHECKING:
    from sqsinfer.messages import Task

log = logging.getLogger("sqsinfer.tracing")

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# The system attribute X-Ray's SDKs (and Lambda) set on a message they send.
AWS_TRACE_HEADER = "AWSTraceHeader"
# The exemplar label of a sampled task's duration (what Grafana's data source links on).
EXEMPLAR_LABEL = "trace_id"
_DISABLED = "OTEL_SDK_DISABLED"
_EXPORTER = "OTEL_TRACES_EXPORTER"


class TaskTrace:
    """One task's span and its children; this class itself is the switched-off one.

    The worker's pipeline calls these hooks with what it measures anyway (each phase's
    seconds, the child's timings), so a traced task is not timed twice.
    """

    __slots__ = ()

    recording = False

    def phase(self, phase: str, seconds: float) -> None:
        """A phase the pipeline timed (`metrics.Phase` value), ended just now."""

    def compute(self, total_s: float, child: Mapping[str, Any]) -> None:
        """The lease of a process, ended just now, with the child's own timings."""

    def step(
        self, name: str, kind: str = "internal", attributes: Mapping[str, Any] | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """A child span around a step no phase times (a HEAD, a delete, a send)."""
        return contextlib.nullcontext()

    def call(
        self, operation: str, destination: str, kind: str = "client"
    ) -> contextlib.AbstractContextManager[None]:
        """A child span around one SQS call of this task alone (`<operation> <queue>`)."""
        return contextlib.nullcontext()

    def outgoing(self) -> dict[str, dict[str, str]]:
        """This task's context as SQS message attributes, for a message it sends on."""
        return {}

    def note(self, attributes: Mapping[str, str]) -> None:
        """Facts of the task found on the way (what an S3 event was)."""

    def child(self, name: str, attributes: Mapping[str, Any]) -> TaskTrace:
        """A span within this one, started now, with steps of its own (a record of a
        message of several): it ends by its own `finish` and `end`, as a task does."""
        return self

    def finish(self, outcome: str, reason: str, seconds: float, task: Task | None) -> None:
        """The outcome, `seconds` after the receive; `end` ends the span there."""

    def finish_records(self, outcomes: Sequence[str], seconds: float) -> None:
        """A message of several records (each a `child`), ended in these outcomes `seconds`
        after the receive; `end` ends the span there."""

    def end(self, error: str = "") -> None:
        """End the span (idempotent; at once when `finish` was not called); `error` marks
        a failed step (a task `sqsinfer enqueue` could not send)."""

    def exemplar(self) -> dict[str, str] | None:
        """The exemplar labels of a sampled task (its trace id), else None."""
        return None

    @property
    def link(self) -> Any:
        """The span context a batch call's span links to (None: not recorded)."""
        return None


NO_TRACE = TaskTrace()


class Received(Protocol):
    """What a task's trace starts from: a message as received (`aws.sqs.Message`)."""

    message_id: str
    receive_count: int
    attributes: dict[str, Any]
    received_at: float  # time.monotonic() when it arrived
    trace_header: str  # AWSTraceHeader
    trace: TaskTrace  # set here


def queue_name(url: str) -> str:
    """A queue's name, the last part of its URL (`messaging.destination.name`)."""
    return url.rstrip("/").rsplit("/", 1)[-1]


_current: contextvars.ContextVar[TaskTrace] = contextvars.ContextVar(
    "sqsinfer_task_trace", default=NO_TRACE
)


def current() -> TaskTrace:
    """The trace of the task this code runs for (NO_TRACE outside one)."""
    return _current.get()


def enter(trace: TaskTrace) -> None:
    """Make `trace` current for the rest of this asyncio task (and tasks it starts)."""
    _current.set(trace)


def batch(
    operation: str, destination: str, traces: Iterable[TaskTrace], kind: str = "client"
) -> contextlib.AbstractContextManager[None]:
    """A span around one batch call made for several tasks, linked to each recorded one.

    It is a root span of its own (one call serves tasks of many traces); none is made
    when no task it serves is recorded.
    """
    served = list(traces)
    recorded = [t for t in served if t.recording]
    if not recorded:
        return contextlib.nullcontext()
    from sqsinfer.tracing.sdk import batch_span  # loaded already: a task is recorded

    return batch_span(operation, destination, len(served), recorded, kind)


class Tracer:
    """Makes the traces of one worker or command; this class itself is the switched-off one."""

    enabled = False

    def received(self, queue_url: str, spent_s: float, messages: Sequence[Received]) -> None:
        """Start each message's task span, and a span of the receive call linked to them."""

    def produce(self, queue_url: str, task_id: str) -> TaskTrace:
        """A new trace for a task `sqsinfer enqueue` sends: its `create` span."""
        return NO_TRACE

    def shutdown(self, timeout_s: float) -> bool:
        """Export what is left and stop, within `timeout_s`. False when time ran out."""
        return True


OFF = Tracer()


def disabled_by(environ: Mapping[str, str]) -> str:
    """The variable that switches tracing off ("" when none does)."""
    if environ.get(_DISABLED, "").strip().lower() == "true":
        return _DISABLED
    exporters = {e.strip().lower() for e in environ.get(_EXPORTER, "otlp").split(",")}
    if exporters <= {"none", ""}:
        return _EXPORTER
    return ""


def from_env(*, service_instance: str = "", component: str = "") -> Tracer:
    """The tracer OpenTelemetry's variables ask for: OFF unless the extra is installed and
    tracing is not switched off. Raises `config.ExternalConfigError` naming a bad variable.

    `service_instance` names this process (`service.instance.id`), `component` what it is
    (`worker`, `enqueue`: the resource's `sqsinfer.component`).
    """
    if disabled_by(os.environ):
        return OFF
    try:
        from sqsinfer.tracing import sdk
    except ImportError as exc:  # the extra is not installed: say so if traces were asked for
        if any(name.startswith("OTEL_") for name in os.environ):
            log.warning(Event.TRACING_UNAVAILABLE, extra={"error": str(exc)})
        return OFF
    return sdk.SdkTracer.from_env(os.environ, service_instance, component)
