"""Runs one scenario as its own process tree and measures it from the outside.

    fresh bucket + queues ─▶ launch ─▶ "ready" ─▶ feeder keeps the queue shallow
        ─▶ warm-up tasks ─▶ window opens (CPU snapshot) ─▶ N tasks or max time
        ─▶ window closes (CPU snapshot, peak RSS, /metrics) ─▶ SIGTERM

Throughput, latency and phases come from the tasks finished inside the window, CPU
from the kernel's counters of the scenario's processes between the two snapshots.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import orjson
import psutil

from sqsinfer import config
from sqsinfer.bench import emulator, probe, profile
from sqsinfer.bench.otlp import SAMPLER_VARIABLES, OtlpReceiver
from sqsinfer.bench.workload import Regime
from sqsinfer.lab import feeder as feeding
from sqsinfer.lab import stage, standin
from sqsinfer.limits import SQS_BATCH_MAX
from sqsinfer.logs import Event
from sqsinfer.worker import inflight

log = logging.getLogger("sqsinfer.bench")

_READY_TIMEOUT_S = 300.0
_STALL_S = 90.0  # no task finished for this long: the scenario is broken
_STOP_TIMEOUT_S = 60.0
POLL_S = 0.02  # the bench's own polling costs about 0.5 % of one core
PHASES = (
    "receive",
    "check",
    "s3_get",
    "wait_process",
    "handoff",
    "decode",
    "infer",
    "encode",
    "commit",
    "delete",
)


class ScenarioFailed(Exception):
    """A scenario did not start or stopped making progress."""


@dataclass(frozen=True)
class Scenario:
    name: str
    label: str
    uses_queue: bool = True
    any_handler: bool = True  # False: it runs XGBoost itself, not the worker's handler
    default: bool = True  # False: run only when --scenarios names it


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "compute-only",
        "decode + predict + encode in N spawned processes; no queue, no S3 (the limit)",
        uses_queue=False,
    ),
    Scenario("sqsinfer", "the real worker: `python -m sqsinfer worker`, N processes"),
    Scenario(
        "sqsinfer-traced",
        "the real worker with every task traced (100 % sampled), exported over OTLP/HTTP "
        "to a receiver in the bench process",
        default=False,
    ),
    Scenario(
        "sqsinfer-alone",
        "the real worker with each task scored alone (SQSINFER_COALESCE=false): the small "
        "regime's baseline",
        default=False,
    ),
    Scenario(
        "http-service",
        "async consumer POSTs each input as JSON to N model-service processes (aiohttp)",
        any_handler=False,
    ),
    Scenario(
        "http-service-load-per-request",
        "the same, with the service loading the model for every request",
        any_handler=False,
    ),
    Scenario(
        "naive",
        "N spawned processes, each: sync boto3, one message at a time, delete each",
        any_handler=False,
    ),
    Scenario(
        "emulator-ceiling",
        "the worker's SQS and S3 calls per task with no compute (the stand-in's limit)",
    ),
)
SCENARIO_NAMES = tuple(s.name for s in SCENARIOS)
# The scenarios that run the real worker (`python -m sqsinfer worker`).
WORKERS = frozenset({"sqsinfer", "sqsinfer-traced", "sqsinfer-alone"})
# What a worker scenario sets beyond the worker's defaults.
WORKER_ENV = {"sqsinfer-alone": {"SQSINFER_COALESCE": "false"}}
# The worker's traces: off in `sqsinfer` whatever the bench's environment says (so it
# measures the untraced worker), all of them exported in `sqsinfer-traced`.
UNTRACED = {"OTEL_SDK_DISABLED": "true"}


@dataclass
class Context:
    """What every scenario of one regime shares."""

    regime: Regime
    seed: int
    processes: int
    threads: int
    prefetch: int | str  # "auto", or messages per process
    queue_depth: int
    model_path: str
    inputs: list[bytes]
    work_dir: str
    endpoint: str = ""
    moto_pid: int = 0
    region: str = "us-east-1"
    max_input_bytes: int = 256 * 2**20
    profile: bool = False  # sample the worker with py-spy during its window
    handler: str = "xgboost"  # the worker's SQSINFER_HANDLER for this regime's model
    cpus: int = 0  # CPUs the machine gives this run (for the CPU-bound estimate)
    rate_per_s: float = 0.0  # tasks fed a second at most (0: as fast as they are taken)
    # With --latency: the proxy in front of each stand-in endpoint, and its process.
    routes: dict[str, str] = field(default_factory=dict)
    proxy_pid: int = 0

    def reach(self, endpoint: str) -> str:
        """Where a scenario reaches a stand-in endpoint: through the latency proxy, if any."""
        return self.routes.get(endpoint, endpoint)

    def in_flight(self, name: str) -> int:
        """Messages the scenario may hold at once (the feeder keeps the depth beyond them)."""
        if name == "naive":
            return self.processes
        # auto: the worker may reach its most; the other consumers keep the fixed
        # prefetch they were measured with before auto existed (auto's starting point).
        max_prefetch = config.Settings.max_prefetch
        if name in WORKERS:
            held = inflight.most_messages(self.processes, self.prefetch, max_prefetch)
        else:
            held = inflight.starting(self.processes, self.prefetch, max_prefetch)
        if name == "emulator-ceiling":
            return max(SQS_BATCH_MAX, held)
        return held


@dataclass
class Snapshot:
    at: float
    done: int
    tree: dict[int, float]
    moto_s: float
    bench_s: float
    worker: dict[str, float] = field(default_factory=dict)  # the worker's /metrics
    proxy_s: float = 0.0  # the latency proxy's CPU (with --latency)


@dataclass
class Launched:
    process: subprocess.Popen[bytes]
    log_path: str
    health_port: int = 0
    tree: probe.TreeProbe = field(init=False)

    def __post_init__(self) -> None:
        self.tree = probe.TreeProbe(self.process.pid)


# -- launching ------------------------------------------------------------------------------


def _sqsinfer_env(ctx: Context, res: emulator.Resources, port: int) -> dict[str, str]:
    settings = stage.stage_settings(
        ctx.endpoint,
        res.queue_url,
        ctx.model_path,
        reads=f"s3://{res.bucket}/in/",
        writes=f"s3://{res.bucket}/out/",
    )
    return stage.worker_env(
        "bench",
        stage.SHORT_DRAIN
        | settings
        | {
            "SQSINFER_DLQ_URL": res.dlq_url,
            "SQSINFER_REGION": ctx.region,
            "SQSINFER_HANDLER": ctx.handler,
            "SQSINFER_PROCESSES": str(ctx.processes),
            "SQSINFER_THREADS_PER_PROCESS": str(ctx.threads),
            "SQSINFER_PREFETCH": str(ctx.prefetch),
            "SQSINFER_MAX_INPUT_BYTES": str(ctx.max_input_bytes),
            "SQSINFER_LOG_LEVEL": "INFO",
        },
        port,
    )


def _child_config(ctx: Context, name: str, res: emulator.Resources | None) -> dict[str, Any]:
    return {
        "processes": ctx.processes,
        "threads": ctx.threads,
        "handler": ctx.handler,
        "model_path": ctx.model_path,
        "regime": ctx.regime.describe(),
        "seed": ctx.seed,
        "max_decoded_bytes": 256 * 2**20,
        "max_input_bytes": ctx.max_input_bytes,
        "endpoint": ctx.endpoint,
        "region": ctx.region,
        "queue_url": res.queue_url if res else "",
        "bucket": res.bucket if res else "",
        "in_flight": ctx.in_flight(name),
    }


def launch(
    ctx: Context, name: str, res: emulator.Resources | None, traces: dict[str, str] | None = None
) -> Launched:
    """Start a scenario's process tree; a worker's traces go where `traces` says (None: off)."""
    stem = os.path.join(ctx.work_dir, f"{ctx.regime.name}-{name}")
    log_path = stem + ".log"
    env = {**os.environ, **standin.FAKE_CREDENTIALS}
    port = 0
    if name in WORKERS:
        assert res is not None
        port = standin.free_port()
        env = _sqsinfer_env(ctx, res, port) | (traces or UNTRACED) | WORKER_ENV.get(name, {})
        if traces is not None:
            env.pop("OTEL_SDK_DISABLED", None)
        argv = [sys.executable, "-m", "sqsinfer", "worker"]
    else:
        with open(stem + ".json", "wb") as fh:
            fh.write(orjson.dumps(_child_config(ctx, name, res)))
        argv = [sys.executable, "-m", "sqsinfer.bench.child", name, stem + ".json"]
    with open(log_path, "wb") as out:
        process = subprocess.Popen(
            argv, env=env, stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True
        )
    return Launched(process, log_path, port)


def stop(launched: Launched) -> None:
    """SIGTERM the root and wait; kill whatever of its tree is left after that."""
    family = launched.tree.processes()
    process = launched.process
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("scenario did not stop in %.0f s; killing it", _STOP_TIMEOUT_S)
    # The rest (the resource tracker above all) usually exits by itself once the root is
    # gone, after cleaning up; only what is still there after a grace period is killed.
    _, alive = psutil.wait_procs([m for m in family if m.pid != process.pid], timeout=5)
    for member in alive:
        with contextlib.suppress(psutil.Error):
            member.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(10)


# -- measuring ------------------------------------------------------------------------------


class Tracker:
    """Follows a scenario's log: readiness, finished tasks and the feeder."""

    def __init__(self, launched: Launched, feeder: feeding.Backlog | None) -> None:
        self.launched = launched
        self.tail = stage.LogTail(launched.log_path)
        self.feeder = feeder
        self.finished: list[dict[str, Any]] = []
        self.failures = 0
        self.facts: dict[str, Any] = {}
        self.last_progress = time.monotonic()

    def poll(self) -> None:
        for record in self.tail.read():
            msg = record.get("msg")
            if msg == "task finished":
                self.finished.append(record)
                self.last_progress = time.monotonic()
            elif msg == "task failed":
                self.failures += 1
            elif msg in ("ready", "pool ready"):
                self.facts[str(msg)] = record
        if self.feeder is not None and "ready" in self.facts:
            self.feeder.top_up(len(self.finished))
        if self.launched.process.poll() is not None:
            raise ScenarioFailed(
                f"exited with code {self.launched.process.returncode}:\n{self.tail.tail_text()}"
            )

    def wait_ready(self) -> float:
        started = time.monotonic()
        while "ready" not in self.facts:
            self.poll()
            if time.monotonic() - started > _READY_TIMEOUT_S:
                raise ScenarioFailed(f"not ready after {_READY_TIMEOUT_S:.0f} s")
            time.sleep(POLL_S)
        return time.monotonic() - started

    def snapshot(self, moto_pid: int, proxy_pid: int = 0) -> Snapshot:
        return Snapshot(
            at=time.monotonic(),
            done=len(self.finished),
            tree=self.launched.tree.cpu(),
            moto_s=probe.own_cpu_seconds(moto_pid) if moto_pid else 0.0,
            bench_s=probe.own_cpu_seconds(os.getpid()),
            worker=self._worker_metrics(),
            proxy_s=probe.own_cpu_seconds(proxy_pid) if proxy_pid else 0.0,
        )

    def _worker_metrics(self) -> dict[str, float]:
        if not self.launched.health_port:
            return {}
        try:
            return scrape_metrics(self.launched.health_port)
        except (OSError, ValueError):
            return {}

    def wait_for(self, count: int, until: float) -> None:
        wait_all([self], [count], until)

    def check_progress(self) -> None:
        if time.monotonic() - self.last_progress > _STALL_S:
            raise ScenarioFailed(f"no task finished for {_STALL_S:.0f} s:\n{self.tail.tail_text()}")


def wait_all(trackers: list[Tracker], counts: list[int], until: float) -> None:
    """Until each tracker has seen its count of finished tasks, or `until`; every one
    polled meanwhile (so each feeder keeps its queue topped up)."""
    while time.monotonic() < until:
        for tracker in trackers:
            tracker.poll()
            tracker.check_progress()
        if all(len(t.finished) >= n for t, n in zip(trackers, counts, strict=True)):
            return
        time.sleep(POLL_S)


def measure_together(ctx: Context, trackers: list[Tracker]) -> list[tuple[Snapshot, Snapshot]]:
    """One window for all of them, opened and closed at once: side by side, the machine's
    speed (which drifts on a shared VM) is the same for each."""
    regime = ctx.regime
    for tracker in trackers:
        tracker.last_progress = time.monotonic()
    wait_all(trackers, [regime.warmup_tasks] * len(trackers), float("inf"))
    firsts = [t.snapshot(ctx.moto_pid, ctx.proxy_pid) for t in trackers]
    wanted = [first.done + regime.tasks for first in firsts]
    wait_all(trackers, wanted, firsts[0].at + regime.max_window_s)
    lasts = [t.snapshot(ctx.moto_pid, ctx.proxy_pid) for t in trackers]
    for tracker in trackers:
        tracker.launched.tree.record_peaks()
    return list(zip(firsts, lasts, strict=True))


def measure(ctx: Context, tracker: Tracker, profile_path: str = "") -> tuple[Snapshot, Snapshot]:
    regime = ctx.regime
    tracker.last_progress = time.monotonic()
    tracker.wait_for(regime.warmup_tasks, float("inf"))
    first = tracker.snapshot(ctx.moto_pid, ctx.proxy_pid)
    spy = None
    if profile_path:
        spy = profile.start(tracker.launched.process.pid, profile_path, regime.max_window_s)
        if spy is None:
            log.warning(Event.PY_SPY_MISSING)
    tracker.wait_for(first.done + regime.tasks, first.at + regime.max_window_s)
    last = tracker.snapshot(ctx.moto_pid, ctx.proxy_pid)
    tracker.launched.tree.record_peaks()
    if spy is not None:
        profile.stop(spy)
    return first, last


def scrape_metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return probe.prometheus_samples(response.read().decode())


# -- summarising ------------------------------------------------------------------------------


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def phase_means_ms(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """Mean milliseconds per task in each phase; `other` is what no phase accounts for."""
    found: dict[str, float | None] = {}
    for phase in PHASES:
        values = [r["phases"][phase] for r in records if phase in r.get("phases", {})]
        found[phase] = _ms(probe.mean(values)) if values else None
    rest = [
        r["seconds"] - sum(v for k, v in r.get("phases", {}).items() if k != "receive")
        for r in records
    ]
    found["other"] = _ms(probe.mean(max(0.0, v) for v in rest))
    return found


def busy_share(records: list[dict[str, Any]], window_s: float, processes: int) -> float | None:
    """How much of the window the inference processes spent computing (decode, predict,
    encode), as a share of what `processes` processes could have: 1.0 keeps every one busy."""
    if not records or window_s <= 0:
        return None
    busy_s = sum(
        sum(float(r.get("phases", {}).get(p, 0.0)) for p in ("decode", "infer", "encode"))
        for r in records
    )
    return round(busy_s / (window_s * processes), 3)


def summarize(
    ctx: Context, name: str, tracker: Tracker, first: Snapshot, last: Snapshot
) -> dict[str, Any]:
    tasks = last.done - first.done
    window_s = last.at - first.at
    records = tracker.finished[first.done : last.done]
    latencies = [float(r["seconds"]) for r in records]
    tasks_per_s = tasks / window_s if tasks and window_s > 0 else 0.0

    def per_task(seconds: float) -> float | None:
        return round(seconds / tasks, 6) if tasks else None

    ready = tracker.facts.get("ready", {})
    root = tracker.launched.process.pid
    tree = tracker.launched.tree
    outcomes: dict[str, int] = {}
    for r in records:
        outcomes[r.get("outcome", "?")] = outcomes.get(r.get("outcome", "?"), 0) + 1
    return {
        "processes": ctx.processes,
        "tasks": tasks,
        "window_s": round(window_s, 3),
        "tasks_per_s": round(tasks_per_s, 3),
        "seconds_per_task": round(ctx.processes / tasks_per_s, 6) if tasks_per_s else None,
        "latency_s": {
            "p50": _round(probe.percentile(latencies, 0.5)),
            "p95": _round(probe.percentile(latencies, 0.95)),
            "mean": _round(probe.mean(latencies)),
        },
        "phases_ms": phase_means_ms(records),
        "busy_share": busy_share(records, window_s, ctx.processes),
        "cpu_s_per_task": per_task(probe.cpu_delta(first.tree, last.tree)),
        "cpu_s_per_task_parent": per_task(
            probe.cpu_delta(_only(first.tree, root), _only(last.tree, root))
        ),
        # The parent with its helpers (resource tracker), apart from spawned processes.
        "cpu_s_per_task_outside_spawned": per_task(
            probe.cpu_delta(
                tree.only(first.tree, spawned=False), tree.only(last.tree, spawned=False)
            )
        ),
        "emulator_cpu_s_per_task": per_task(last.moto_s - first.moto_s) if ctx.moto_pid else None,
        "proxy_cpu_s_per_task": per_task(last.proxy_s - first.proxy_s) if ctx.proxy_pid else None,
        "bench_cpu_s_per_task": per_task(last.bench_s - first.bench_s),
        "cpu_bound": cpu_bound(ctx, tasks, window_s, first, last),
        "peak_rss_mb": tracker.launched.tree.peak_rss_mb(),
        "startup_s": tracker.facts.get("startup_wall_s"),
        "pool_ready_s": ready.get("startup_s"),
        "outcomes": outcomes,
        "failures": tracker.failures,
    }


def cpu_bound(
    ctx: Context, tasks: int, window_s: float, first: Snapshot, last: Snapshot
) -> dict[str, float] | None:
    """What the machine's CPUs allow: all CPU spent per task (scenario, emulator, bench,
    latency proxy), the tasks/s that would fill every CPU, and how much of them the
    window used."""
    if not tasks or window_s <= 0:
        return None
    spent_s = probe.cpu_delta(first.tree, last.tree) + (last.moto_s - first.moto_s)
    spent_s += (last.bench_s - first.bench_s) + (last.proxy_s - first.proxy_s)
    cpus = ctx.cpus or 1
    return {
        "cpu_s_per_task_all": round(spent_s / tasks, 6),
        "tasks_per_s": round(cpus * tasks / spent_s, 3) if spent_s > 0 else 0.0,
        "cpu_utilization": round(spent_s / (window_s * cpus), 3),
    }


def _only(cpu: dict[int, float], pid: int) -> dict[int, float]:
    return {pid: cpu[pid]} if pid in cpu else {}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


_RECEIVE_SUM = 'sqsinfer_phase_seconds_sum{phase="receive"}'
_RECEIVE_COUNT = 'sqsinfer_phase_seconds_count{phase="receive"}'
_BUSY = "sqsinfer_process_busy_seconds_total"
_LIMIT = "sqsinfer_in_flight_limit"
_CALLS = "sqsinfer_aws_requests_total"
_PREDICTS = "sqsinfer_tasks_per_predict"


def _sqsinfer_extras(
    result: dict[str, Any], tracker: Tracker, first: Snapshot, last: Snapshot
) -> None:
    """The worker's own figures from its /metrics over the window: its receive calls, the
    busy share of its processes, its in-flight limit and AWS calls per task; and its pool
    start-up (from its log). The busy share from /metrics replaces the one from the task
    lines (kept beside it: the two should agree)."""
    result["pool_ready_s"] = tracker.facts.get("pool ready", {}).get("startup_s")
    tasks = max(1, last.done - first.done)

    def delta(name: str) -> float:
        return last.worker.get(name, 0.0) - first.worker.get(name, 0.0)

    calls = delta(_RECEIVE_COUNT)
    if calls > 0:
        result["phases_ms"]["receive"] = _ms(delta(_RECEIVE_SUM) / calls)
        result["receive_calls_per_task"] = round(calls / tasks, 3)
    window_s = last.at - first.at
    if _BUSY in last.worker and window_s > 0:
        result["busy_share_from_logs"] = result["busy_share"]
        result["busy_share"] = round(delta(_BUSY) / (window_s * int(result["processes"])), 3)
    if _LIMIT in last.worker:
        result["in_flight_limit"] = int(last.worker[_LIMIT])
    predicts = delta(_PREDICTS + "_count")
    if predicts > 0:  # how far small tasks were coalesced
        result["tasks_per_predict_call"] = round(delta(_PREDICTS + "_sum") / predicts, 2)
    per_operation = {
        key.split('"')[1]: round(delta(key) / tasks, 3)
        for key in last.worker
        if key.startswith(_CALLS + "{") and delta(key) > 0
    }
    if per_operation:
        result["aws_calls_per_task"] = per_operation


def _receiver(name: str) -> contextlib.AbstractContextManager[OtlpReceiver | None]:
    """A receiver for the traced worker's spans (none for the other scenarios)."""
    if name != "sqsinfer-traced":
        return contextlib.nullcontext()
    try:
        importlib.metadata.version("opentelemetry-exporter-otlp-proto-http")
    except importlib.metadata.PackageNotFoundError:
        raise ScenarioFailed("needs the otel extra: pip install 'sqsinfer[otel]'") from None
    return OtlpReceiver()


@dataclass
class Started:
    """A scenario's process tree launched on its own queue and bucket."""

    scenario: Scenario
    tracker: Tracker
    feeder: feeding.Backlog | None
    receiver: OtlpReceiver | None
    traces: dict[str, str] | None


def _start(
    ctx: Context, scenario: Scenario, s3: Any, sqs: Any, stack: contextlib.ExitStack
) -> Started:
    """Resources, a receiver for its traces, the tree (stopped when `stack` closes)."""
    name = scenario.name
    res = None
    feeder = None
    if scenario.uses_queue:
        res = emulator.create_resources(s3, sqs, ctx.inputs)
        feeder = feeding.Backlog(
            feeding.Feeder(sqs, res.queue_url, feeding.cycling(name, res.inputs)),
            ctx.queue_depth,
            ctx.in_flight(name),
            ctx.rate_per_s,
        )
    receiver = stack.enter_context(_receiver(name))
    traces = receiver.traced_env() if receiver is not None else None
    launched = launch(ctx, name, res, traces)
    stack.callback(stop, launched)
    return Started(scenario, Tracker(launched, feeder), feeder, receiver, traces)


def _result(ctx: Context, started: Started, first: Snapshot, last: Snapshot) -> dict[str, Any]:
    name, tracker = started.scenario.name, started.tracker
    result = summarize(ctx, name, tracker, first, last)
    if name in WORKERS:
        _sqsinfer_extras(result, tracker, first, last)
    return result


def _finish(ctx: Context, started: Started, result: dict[str, Any]) -> dict[str, Any]:
    """What is known once the tree has stopped: its traces, its feeder's count, its log."""
    scenario, launched = started.scenario, started.tracker.launched
    receiver, traces = started.receiver, started.traces or {}
    if receiver is not None:
        result["traces_exported"] = {
            "requests": receiver.requests,
            "bytes": receiver.received_bytes,
            "sampler": " ".join(traces.get(k, "") for k in SAMPLER_VARIABLES).strip(),
        }
    result["label"] = scenario.label
    result["in_flight"] = ctx.in_flight(scenario.name) if scenario.uses_queue else ctx.processes
    if started.feeder is not None:
        result["messages_sent"] = started.feeder.feeder.sent
    result["log"] = launched.log_path
    return result


def run_scenario(ctx: Context, scenario: Scenario, s3: Any, sqs: Any) -> dict[str, Any]:
    name = scenario.name
    profile_path = ""
    if ctx.profile and name in WORKERS:
        profile_path = os.path.join(ctx.work_dir, f"profile-{ctx.regime.name}-{name}.txt")
    with contextlib.ExitStack() as stack:
        started = _start(ctx, scenario, s3, sqs, stack)
        tracker = started.tracker
        tracker.facts["startup_wall_s"] = round(tracker.wait_ready(), 3)
        first, last = measure(ctx, tracker, profile_path)
        result = _result(ctx, started, first, last)
    if profile_path and os.path.exists(profile_path):
        found = profile.summarize(profile_path, tracker.launched.process.pid)
        result["profile"] = found | {"file": profile_path}
    return _finish(ctx, started, result)


def run_together(
    ctx: Context, scenarios: list[Scenario], s3: Any, sqs: Any
) -> dict[str, dict[str, Any]]:
    """The scenarios side by side, each on its own queue and bucket, measured in one
    window (`measure_together`); the stand-in's and the bench's CPU are then theirs
    together. Each is fed at `--rate`: give one that each of them keeps up with."""
    with contextlib.ExitStack() as stack:
        started = [_start(ctx, scenario, s3, sqs, stack) for scenario in scenarios]
        for one in started:
            one.tracker.facts["startup_wall_s"] = round(one.tracker.wait_ready(), 3)
        windows = measure_together(ctx, [one.tracker for one in started])
        results = [_result(ctx, one, *window) for one, window in zip(started, windows, strict=True)]
    return {
        one.scenario.name: _finish(ctx, one, result)
        for one, result in zip(started, results, strict=True)
    }
