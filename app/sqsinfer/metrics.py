"""Prometheus metrics of one worker (parent process only; children return their timings).

Each worker owns its own registry rather than the global one, so that several workers
can live in one process (tests, benchmarks) without their counts mixing.
"""

from __future__ import annotations

import collections
from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sqsinfer.outcomes import Outcome


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
        self.in_flight = Gauge("sqsinfer_in_flight", "Messages held by this worker", registry=r)
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
        self.aws_errors = Counter(
            "sqsinfer_aws_errors", "Failed AWS calls, by operation", ["operation"], registry=r
        )
        self.outcomes: collections.Counter[str] = collections.Counter()
        for outcome in Outcome:
            self.tasks.labels(outcome)  # every outcome shows 0 before it first happens
        for phase in Phase:
            self.phase_seconds.labels(phase)
        for kind in DuplicateKind:
            self.chain_duplicates.labels(kind)

    def observe(self, phase: Phase, seconds: float) -> None:
        self.phase_seconds.labels(phase).observe(seconds)

    def outcome(self, outcome: Outcome, seconds: float) -> None:
        self.tasks.labels(outcome).inc()
        self.task_seconds.labels(outcome).observe(seconds)
        self.outcomes[outcome] += 1

    def render(self) -> bytes:
        return generate_latest(self.registry)
