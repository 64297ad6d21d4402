"""Traces of every task (OpenTelemetry), when the `otel` extra is installed and not disabled.

This package alone imports opentelemetry (an import-linter contract holds the rest of
sqsinfer to it), and only once tracing is on: a caller holds `api.TaskTrace` and
`api.Tracer`, switched off by default (`NO_TRACE`, `OFF`); `sdk` makes and exports spans
with OpenTelemetry's SDK, imported by `from_env` alone. Configuration is OpenTelemetry's
own variables (`OTEL_*`); a bad one stops start-up with a message naming it. A task's
context travels as SQS message attributes: W3C `traceparent` (and `tracestate`) in, out
to the next stage and on every DLQ copy; X-Ray's `AWSTraceHeader` when there is none.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

from sqsinfer.logs import Event
from sqsinfer.tracing.api import NO_TRACE, OFF, TaskTrace, Tracer

log = logging.getLogger("sqsinfer.tracing")

_DISABLED = "OTEL_SDK_DISABLED"
_EXPORTER = "OTEL_TRACES_EXPORTER"

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
) -> contextlib.AbstractContextManager[Any]:
    """A span around one batch call made for several tasks, linked to each recorded one:
    a root of its own (one call serves tasks of many traces), none when none is recorded."""
    served = list(traces)
    recorded = [t for t in served if t.recording]
    if not recorded:
        return contextlib.nullcontext()
    return recorded[0].batch(operation, destination, len(served), recorded, kind)


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
    tracing is not switched off; `config.ExternalConfigError` names a bad variable.
    `service_instance` names this process (`service.instance.id`), `component` what it is
    (`worker`, `enqueue`: the resource's `sqsinfer.component`)."""
    if disabled_by(os.environ):
        return OFF
    try:
        from sqsinfer.tracing import sdk
    except ImportError as exc:  # the extra is not installed: say so if traces were asked for
        if any(name.startswith("OTEL_") for name in os.environ):
            log.warning(Event.TRACING_UNAVAILABLE, extra={"error": str(exc)})
        return OFF
    return sdk.SdkTracer.from_env(os.environ, service_instance, component)
