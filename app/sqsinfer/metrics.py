"""Prometheus metrics of one worker (parent process only; children return their timings).

Each worker owns its own registry rather than the global one, so that several workers
can live in one process (tests, benchmarks) without their counts mixing.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from enum import StrEnum
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.openmetrics import exposition as openmetrics

from sqsinfer import procfs
from sqsinfer.events import EVENT_SHAPES, Kind
from sqsinfer.outcomes import REJECTION_REASONS, Outcome

# `_created` series double the series count for a timestamp nobody queries.
disable_created_metrics()  # type: ignore[no-untyped-call]

# The operations the worker makes, shown at 0 from the start (an error ratio needs both).
AWS_OPERATIONS = (
    "ReceiveMessage",
    "DeleteMessageBatch",
    "ChangeMessageVisibilityBatch",
    "SendMessage",
    "SendMessageBatch",
    "GetObject",
    "HeadObject",
    "PutObject",
    "GetQueueAttributes",
)


class DuplicateKind(StrEnum):
    """The `kind` label of sqsinfer_chain_duplicates_total."""

    CERTAIN = "certain"  # this delivery saw that another also sent the next stage's message
    POSSIBLE = "possible"  # a send may have gone out twice: a lost answer, or a link taken over


class Phase(StrEnum):
    """A timed part of a message's life: the `phase` label of sqsinfer_phase_seconds."""

    RECEIVE = "receive"
    S3_GET = "s3_get"
    WAIT_PROCESS = "wait_process"
    HANDOFF = "handoff"
    DECODE = "decode"
    INFER = "infer"
    ENCODE = "encode"
    COMMIT = "commit"
    CHAIN = "chain"


# Phases from about a millisecond (a HEAD on a local endpoint) to many minutes of compute.
_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
    900,
)


# Tasks per predict call: 1 alone, up to the pool's MAX_BATCH_TASKS coalesced.
_TASKS_PER_CALL = (1, 2, 4, 8, 16, 32, 64)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.tasks = Counter(
            "sqsinfer_tasks", "Messages finished, by outcome", ["outcome"], registry=r
        )
        self.rejections = Counter(
            "sqsinfer_rejections", "Rejected messages, by reason", ["reason"], registry=r
        )
        self.events = Counter(
            "sqsinfer_events",
            "S3 event notifications read, one per record, by shape (s3, sns, eventbridge) "
            "and kind (created, test, other, invalid)",
            ["shape", "kind"],
            registry=r,
        )
        self.in_flight = Gauge(
            "sqsinfer_in_flight",
            "Messages holding a slot of this worker (received, result not yet committed)",
            registry=r,
        )
        self.processes_ready = Gauge(
            "sqsinfer_processes_ready", "Inference processes loaded and idle or busy", registry=r
        )
        self.phase_seconds = Histogram(
            "sqsinfer_phase_seconds",
            "Time spent per task in each phase",
            ["phase"],
            buckets=_BUCKETS_S,
            registry=r,
        )
        self.task_seconds = Histogram(
            "sqsinfer_task_seconds",
            "Receive to outcome, per message",
            ["outcome"],
            buckets=_BUCKETS_S,
            registry=r,
        )
        self.rows = Counter("sqsinfer_rows", "Input rows predicted", registry=r)
        self.process_busy = Counter(
            "sqsinfer_process_busy_seconds",
            "Seconds the inference processes spent computing (decode, predict, encode); "
            "rate / sqsinfer_processes_ready = the share of the time they are busy",
            registry=r,
        )
        self.tasks_per_predict = Histogram(
            "sqsinfer_tasks_per_predict",
            "Tasks whose rows one predict call scored: 1 for a task alone, more when small "
            "tasks waiting for a process were coalesced (_sum / _count: tasks per call)",
            buckets=_TASKS_PER_CALL,
            registry=r,
        )
        self.pool_rebuilds = Counter(
            "sqsinfer_pool_rebuilds", "Inference processes restarted after a crash", registry=r
        )
        self.visibility_extensions = Counter(
            "sqsinfer_visibility_extensions",
            "In-flight messages whose visibility was extended",
            registry=r,
        )
        self.chain_duplicates = Counter(
            "sqsinfer_chain_duplicates",
            "Next-stage messages that were, or may have been, sent a second time, by kind",
            ["kind"],
            registry=r,
        )
        self.other_model_outputs = Counter(
            "sqsinfer_other_model_outputs",
            "Messages whose task's output existed, written by another model than this "
            "worker's (each ends as a duplicate; a new model needs a per-model output prefix)",
            registry=r,
        )
        self.aws_requests = Counter(
            "sqsinfer_aws_requests",
            "AWS API calls made (each call once, whatever the SDK retried), by operation",
            ["operation"],
            registry=r,
        )
        self.aws_errors = Counter(
            "sqsinfer_aws_errors",
            "AWS API calls that failed (an error answer or none at all), by operation",
            ["operation"],
            registry=r,
        )
        self.throttled = Counter(
            "sqsinfer_throttled",
            "Answers of S3 or SQS asking this worker to slow down (SlowDown, throttling), "
            "each attempt's, by service",
            ["service"],
            registry=r,
        )
        self.in_flight_limit = Gauge(
            "sqsinfer_in_flight_limit",
            "Slots: messages this worker may work on at once, pinned or sized from measured "
            "times (in_flight / in_flight_limit = utilisation)",
            registry=r,
        )
        self.queue_messages = Gauge(
            "sqsinfer_queue_messages",
            "Approximate messages of this stage's queue (queue=source) and its dead-letter "
            "queue (queue=dead_letter), by state (visible, in_flight, delayed), as SQS "
            "answered the worker's latest sample (queue_sample_s)",
            ["queue", "state"],
            registry=r,
        )
        self.received_age = Gauge(
            "sqsinfer_received_message_age_seconds",
            "Seconds since SQS took the oldest message of this worker's latest receive "
            "(SentTimestamp); 0 after a receive that brought nothing",
            registry=r,
        )
        self.pod_deletion_cost = Gauge(
            "sqsinfer_pod_deletion_cost",
            "The pod-deletion-cost this worker last set on its pod (pod_deletion_cost): "
            "high while it holds messages, low when idle; none while it is off",
            ["pod"],
            registry=r,
        )
        self.pod_deletion_cost_errors = Counter(
            "sqsinfer_pod_deletion_cost_errors",
            "Patches of this pod's deletion cost the Kubernetes API refused or never "
            "answered (tasks go on; the next one is tried later)",
            registry=r,
        )
        self.info = Gauge(
            "sqsinfer_info",
            "Always 1; the labels say what this worker runs",
            ["version", "model_sha256", "handler"],
            registry=r,
        )
        self.child_rss = _ChildRss(registry=r)
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.outcomes: collections.Counter[str] = collections.Counter()
        for outcome in Outcome:
            self.tasks.labels(outcome)  # every outcome shows 0 before it first happens
        for phase in Phase:
            self.phase_seconds.labels(phase)
        for kind in DuplicateKind:
            self.chain_duplicates.labels(kind)
        for reason in REJECTION_REASONS:
            self.rejections.labels(reason)
        for shape in EVENT_SHAPES:
            for event_kind in Kind:
                self.events.labels(shape, event_kind)
        for operation in AWS_OPERATIONS:
            self.aws_requests.labels(operation)
            self.aws_errors.labels(operation)
        for service in ("s3", "sqs"):
            self.throttled.labels(service)

    def observe(self, phase: Phase, seconds: float) -> None:
        self.phase_seconds.labels(phase).observe(seconds)

    def outcome(
        self, outcome: Outcome, seconds: float, exemplar: dict[str, str] | None = None
    ) -> None:
        """Count a message's outcome; `exemplar` (a sampled task's trace id) goes with its
        duration, shown in the OpenMetrics exposition."""
        self.tasks.labels(outcome).inc()
        self.task_seconds.labels(outcome).observe(seconds, exemplar)
        self.outcomes[outcome] += 1

    def queue_depth(self, queue: str, counts: dict[str, int] | None) -> None:
        """Show a queue's latest counts, or none (`counts` None: it could not be read, and
        a stale count would keep an alert on it firing, or silent)."""
        for state in ("visible", "in_flight", "delayed"):
            if counts is None:
                with contextlib.suppress(KeyError):
                    self.queue_messages.remove(queue, state)
            else:
                self.queue_messages.labels(queue, state).set(counts[state])

    def running(self, version: str, model_sha256: str, handler: str) -> None:
        """Say what this worker runs (sqsinfer_info), once it knows."""
        self.info.clear()
        self.info.labels(version, model_sha256, handler).set(1)

    def count_aws_calls(self, client: Any) -> None:
        """Count every API call of an SDK client and every one that failed, by operation.

        botocore emits `before-call` once per call (not per retry), `after-call` with the
        answer (an error answer included) and `after-call-error` when there was none (that
        one names the operation only in its event name: `after-call-error.sqs.SendMessage`).
        """
        events = client.meta.events
        events.register("before-call", self._before_call)
        events.register("after-call", self._after_call)
        events.register("after-call-error", self._after_call_error)

    def count_call(self, operation: str, failed: bool) -> None:
        """Count one call made outside the SDK (the data path's GET and PUT)."""
        self.aws_requests.labels(operation).inc()
        if failed:
            self.aws_errors.labels(operation).inc()

    def _before_call(self, model: Any, **_: Any) -> None:
        self.aws_requests.labels(model.name).inc()

    def _after_call(self, model: Any, http_response: Any = None, **_: Any) -> None:
        if http_response is not None and getattr(http_response, "status_code", 200) >= 400:
            self.aws_errors.labels(model.name).inc()

    def _after_call_error(self, event_name: str, **_: Any) -> None:
        # This event carries no operation model: its name ends with the operation's.
        self.aws_errors.labels(event_name.rsplit(".", 1)[-1]).inc()

    def render(self, openmetrics_format: bool = False) -> bytes:
        """The Prometheus text exposition, or OpenMetrics (which alone carries exemplars)."""
        if openmetrics_format:
            return bytes(openmetrics.generate_latest(self.registry))  # type: ignore[no-untyped-call]
        return generate_latest(self.registry)


class _ChildRss:
    """sqsinfer_child_rss_bytes{slot}: each inference process's resident memory, read from
    /proc when scraped (the parent's own is process_resident_memory_bytes)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.pids: Callable[[], dict[int, int]] = dict
        registry.register(self)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "sqsinfer_child_rss_bytes", "Resident memory of each inference process", labels=["slot"]
        )
        for slot, pid in sorted(self.pids().items()):
            rss = procfs.rss_bytes(pid)
            if rss is not None:
                family.add_metric([str(slot)], rss)
        yield family
