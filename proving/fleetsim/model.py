"""What a simulated fleet is made of: the job, the worker's settings, KEDA's, the pods',
AWS's; and the task times.

Every default is someone's own: the worker's settings are `config.Settings`' (read by the
command through the worker's own flags and `SQSINFER_*` variables), KEDA's and the HPA's
are the chart's `keda.*` values (helm/sqsinfer/values.yaml), the request limits are
`sqsinfer.limits`', the AWS latencies the medians of the `aws` latency profile
(`sqsinfer.lab.latency`). What is this model's own (a pod's start and model load, the
kill rate, the HPA's sync period) is said where it is set.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from sqsinfer import config
from sqsinfer.lab.latency import AWS
from sqsinfer.ops.plan import NextStage, Prices

AUTO = config.AUTO
HOUR_S = 3600.0
DAY_S = 86_400.0


@dataclass(frozen=True)
class Behavior:
    """One direction of the HPA's `behavior`: a stabilization window and the two policy
    kinds (a share of the pods, a number of pods; 0: that policy is absent) per period,
    the one allowing the most change winning (`selectPolicy: Max`)."""

    window_s: float
    percent: float
    pods: int
    period_s: float = 60.0


# The chart's keda.behavior.
SCALE_UP = Behavior(window_s=0.0, percent=100.0, pods=4)
SCALE_DOWN = Behavior(window_s=300.0, percent=25.0, pods=0)


@dataclass(frozen=True)
class Keda:
    """The ScaledObject (deployment mode) or ScaledJob (job mode) and, for a Deployment,
    the HPA KEDA makes. The metric is the queue's visible messages (the chart's
    scaleOnInFlight false) unless `scale_on_in_flight`."""

    queue_length: int  # target messages per replica
    max_replicas: int
    mode: str = "deployment"  # or "job"
    min_replicas: int = 1
    polling_interval_s: float = 15.0
    # The HPA controller's sync period (Kubernetes' --horizontal-pod-autoscaler-sync-period
    # default), and the ratio of metric to target it leaves alone (its tolerance).
    hpa_sync_s: float = 15.0
    tolerance: float = 0.1
    cooldown_s: float = 300.0  # to zero replicas, with scale_to_zero
    scale_to_zero: bool = False
    activation: int = 0
    scale_on_in_flight: bool = False
    scale_up: Behavior = SCALE_UP
    scale_down: Behavior = SCALE_DOWN


# Job mode: a Job's worker exits once its queue stayed empty this long unless
# worker.exit_when_idle_s is set (the chart's default in job mode).
JOB_EXIT_WHEN_IDLE_S = 60.0


@dataclass(frozen=True)
class Pods:
    """A pod's life: from its creation to running (scheduling, the image, the container:
    on a node that has room; a new node adds a minute or two), then the model's load and
    the pool's warm-up before it receives; SIGKILLs (a lost node, a Spot reclaim, an OOM
    kill of the whole pod) at a rate per pod-hour, each pod replaced at once."""

    start_s: float = 30.0
    load_s: float = 15.0
    kills_per_hour: float = 0.0


@dataclass(frozen=True)
class WorkerSettings:
    """The worker's settings the fleet runs with (`config.Settings`' names and meaning)."""

    processes: int
    prefetch: int | str = AUTO
    max_prefetch: int = 8
    visibility_timeout_s: float = 60.0
    heartbeat_s: float = 20.0
    wait_time_s: float = 20.0
    drain_s: float = 70.0  # config.drain_s of task_time_s 60
    retry_base_s: float = 5.0
    retry_max_s: float = 900.0
    always_head_output: bool = False
    next_stage: NextStage = NextStage.NONE
    queue_sample_s: float = 60.0
    # A worker that ends by itself (job mode; in a Deployment's pod it would be restarted).
    exit_when_idle_s: float = 0.0
    max_tasks: int = 0
    pod_deletion_cost: bool = False  # a scale-in removes idle pods first


@dataclass(frozen=True)
class Aws:
    """The queue's redrive policy and retention, S3's partitioned prefixes (each with its
    own request limits), and the calls' latencies (the `aws` profile's medians)."""

    max_receive_count: int = 5
    retention_s: float = 4 * DAY_S  # SQS's default MessageRetentionPeriod
    s3_prefixes: int = 1
    receive_s: float = AWS.operations["ReceiveMessage"].p50_ms / 1000
    get_s: float = AWS.operations["GetObject"].p50_ms / 1000
    put_s: float = AWS.operations["PutObject"].p50_ms / 1000
    head_s: float = AWS.operations["HeadObject"].p50_ms / 1000
    send_s: float = AWS.operations["SendMessageBatch"].p50_ms / 1000


@dataclass(frozen=True)
class TaskTimes:
    """Process-seconds per task: log-normal around `mean_s` with shape `spread` (the
    standard deviation of its log; 0: every task takes `mean_s`)."""

    mean_s: float
    spread: float = 0.1

    def draws(self, seed: int, chunk: int = 1 << 16) -> Iterator[float]:
        """An endless, seeded sequence of task times."""
        rng = np.random.default_rng(seed)
        if self.spread <= 0:
            while True:
                yield self.mean_s
        mu = math.log(self.mean_s) - self.spread**2 / 2  # so that the mean is mean_s
        while True:
            yield from rng.lognormal(mu, self.spread, chunk).tolist()

    def describe(self) -> str:
        if self.spread <= 0:
            return f"{self.mean_s:g} s each"
        return f"log-normal, mean {self.mean_s:g} s, spread {self.spread:g}"


# The standard normal's 95th percentile: a log-normal's p95 / p50 = exp(Z95 × sigma).
Z95 = 1.6448536269514722


def times_from_bench(path: str, scenario: str = "sqsinfer") -> TaskTimes:
    """A bench JSON's task times: the mean is its seconds_per_task (what `sqsinfer plan
    --from-bench` reads), the spread that of its task latencies (p95 over p50)."""
    from sqsinfer.ops.plan import seconds_from_bench

    mean_s = seconds_from_bench(path, scenario)
    with open(path, "rb") as fh:
        latency = json.load(fh)["scenarios"][scenario].get("latency_s") or {}
    p50, p95 = latency.get("p50"), latency.get("p95")
    spread = math.log(p95 / p50) / Z95 if p50 and p95 and p95 > p50 else 0.0
    return TaskTimes(mean_s, spread)


@dataclass(frozen=True)
class FleetConfig:
    tasks: int
    times: TaskTimes
    worker: WorkerSettings
    keda: Keda
    pods: Pods = field(default_factory=Pods)
    aws: Aws = field(default_factory=Aws)
    prices: Prices = field(default_factory=Prices)
    pod_hour_price: float | None = None
    seed: int = 1
    # After the last task: how long the fleet is followed while it scales in (at most).
    tail_limit_s: float = 2 * HOUR_S
