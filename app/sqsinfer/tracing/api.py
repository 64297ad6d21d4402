"""What a caller of `sqsinfer.tracing` holds, switched off: every method does nothing.

These classes are the interface and its off state in one (`NO_TRACE`, `OFF`);
`tracing.sdk` implements them on OpenTelemetry's SDK. Nothing here imports opentelemetry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# The system attribute X-Ray's SDKs (and Lambda) set on a message they send.
AWS_TRACE_HEADER = "AWSTraceHeader"
# The exemplar label of a sampled task's duration (what Grafana's data source links on).
EXEMPLAR_LABEL = "trace_id"
# The longest a command waits at its exit for its last spans to reach the collector: one
# that is down or slow costs those spans, never a longer exit.
FLUSH_S = 1.0
FLUSH_THREAD = "sqsinfer-traces-flush"  # where an export at the exit is left behind
# A moment within a step's span: (name, seconds after the span's start, attributes).
StepEvent = tuple[str, float, Mapping[str, Any]]


class TaskTrace:
    """One task's span and its steps' (or one record's, of a message of several)."""

    __slots__ = ()

    recording = False

    def step(
        self,
        name: str,
        seconds: float,
        *,
        attributes: Mapping[str, Any] | None = None,
        events: Sequence[StepEvent] = (),
        error: str = "",
    ) -> None:
        """A child span that ended just now, `seconds` long: a step the pipeline timed
        (its own measurement: nothing is timed twice); `error`: what ended it."""

    def call(
        self, operation: str, queue_url: str, kind: str = "client"
    ) -> contextlib.AbstractContextManager[Any]:
        """A child span around one SQS call of this task alone (`<operation> <queue>`)."""
        return contextlib.nullcontext()

    def batch(
        self, operation: str, queue_url: str, served: int, linked: Sequence[TaskTrace], kind: str
    ) -> contextlib.AbstractContextManager[Any]:
        """A span around one call for `served` tasks: a root of its own, linked to `linked`."""
        return contextlib.nullcontext()

    def outgoing(self) -> dict[str, dict[str, str]]:
        """This task's context as SQS message attributes, for a message it sends on."""
        return {}

    def note(self, attributes: Mapping[str, Any]) -> None:
        """Attributes of the span: facts of the task found on the way, its outcome."""

    def child(self, name: str, attributes: Mapping[str, Any]) -> TaskTrace:
        """A span within this one, started now, with steps of its own (a record of a
        message of several), ended by its own `end`."""
        return self

    def end(self, seconds: float | None = None, error: str = "") -> None:
        """End the span `seconds` after its start (None: now), once; `error` marks it
        failed (its status, an error with that description)."""

    @property
    def link(self) -> Any:
        """The span context of a recorded task (what a batch call links to), else None."""
        return None

    def exemplar(self) -> dict[str, str] | None:
        """The exemplar labels of a recorded task (its trace id), else None."""
        link = self.link
        return None if link is None else {EXEMPLAR_LABEL: format(link.trace_id, "032x")}


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


class Tracer:
    """Makes the traces of one worker or command; this class itself is the switched-off one."""

    enabled = False

    def received(self, queue_url: str, spent_s: float, messages: Sequence[Received]) -> None:
        """Start each message's task span, and a span of the receive call linked to them."""

    def produce(self, queue_url: str, task_id: str) -> TaskTrace:
        """A new trace for a task `sqsinfer enqueue` sends: its `create` span."""
        return NO_TRACE

    def shutdown(self, timeout_s: float = FLUSH_S) -> bool:
        """Export what is left and stop, within `timeout_s`. False when time ran out."""
        return True


OFF = Tracer()
