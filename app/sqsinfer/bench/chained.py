"""The chained regime: two stages, the second fed by the first, measured end to end.

    feeder ─▶ stage 1 queue ─▶ stage-1 worker ─▶ stage1/<task>.npy (+ .chain marker)
                                     └─ next queue (standard or FIFO) ─▶ stage-2 worker
                                                                         ─▶ stage2/<task>.npy

Each variant runs on a fresh bucket and fresh queues: `unchained` (stage 1 alone, no
next queue: the baseline), then the chain with a `standard` next queue, then with a
`fifo` one (`ContentBasedDeduplication` off). Both workers are real `sqsinfer worker`
processes, each its own process tree, each talking to the stand-in on its own port, so
that the requests the stand-in counts at each port are that stage's and no one else's
(the feeder's are on a third). A warm-up batch goes through both stages first; then the
measured batch: from its first enqueue to its last stage-2 output. CPU is each tree's,
from the kernel's counters, between the two ends; calls are what the stand-in served.

What the calls cost on AWS is computed from the counted calls and the price list below.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqsinfer.bench import probe, report, runner
from sqsinfer.lab import counting, stage, standin, synthetic
from sqsinfer.lab import feeder as feeding

NEXT_QUEUES = ("standard", "fifo")  # each run beside "unchained": stage 1 alone
STAGES = ("stage1", "stage2")
MARKER = ".chain"  # the extension of a chain's marker object (sqsinfer.worker.chain)
# AWS's price list, us-east-1, in USD per request (S3 Standard; SQS per 64 KiB chunk).
S3_TIER1_USD = 0.005 / 1000  # PUT, COPY, POST, LIST
S3_TIER2_USD = 0.0004 / 1000  # GET, HEAD and all other requests
S3_FREE = frozenset({"DeleteObject", "DeleteObjects"})
S3_TIER1 = frozenset(
    {
        "PutObject",
        "CopyObject",
        "UploadPart",
        "CreateMultipartUpload",
        "CompleteMultipartUpload",
        "ListObjects",
        "PostBucket",
        "PutBucket",
    }
)
SQS_USD = {"standard": 0.40 / 1e6, "fifo": 0.50 / 1e6}
_STAGE2_TREES = 20
_STALL_S = 90.0


class ChainFailed(runner.ScenarioFailed):
    """A variant did not carry its tasks through (a worker exited, a stage stalled)."""


@dataclass
class Chain:
    """One variant's bucket and queues."""

    bucket: str
    inputs: list[str]
    stage1: stage.QueuePair
    stage2: stage.QueuePair | None  # the next queue; None when unchained


def create_chain(s3: Any, sqs: Any, inputs: list[bytes], variant: str) -> Chain:
    name = stage.create_bucket(s3, "chain-" + uuid.uuid4().hex[:12])
    uris = stage.put_objects(
        s3, name, {f"in/{index}.npy": body for index, body in enumerate(inputs)}, threads=4
    )
    visibility = {"VisibilityTimeout": "60"}
    first = stage.create_queue(sqs, f"{name}-stage1", attributes=visibility)
    second = None
    if variant == "standard":
        second = stage.create_queue(sqs, f"{name}-stage2", attributes=visibility)
    elif variant == "fifo":  # each send names its own deduplication id
        attributes = visibility | {"ContentBasedDeduplication": "false"}
        second = stage.create_queue(sqs, f"{name}-stage2", attributes=attributes, fifo=True)
    return Chain(name, uris, first, second)


def stage2_model(cache_dir: str, seed: int) -> str:
    """Stage 2's model: one feature (stage 1's prediction), a few trees; cached."""
    path = os.path.join(cache_dir, f"chained-stage2-f1-t{_STAGE2_TREES}-s{seed}.ubj")
    if not os.path.exists(path):
        os.makedirs(cache_dir, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
            staged = os.path.join(tmp, "model.ubj")
            synthetic.train_model(staged, 1, trees=_STAGE2_TREES, seed=seed + 1)
            os.replace(staged, path)
    return path


# -- launching --------------------------------------------------------------------------------


def _settings(ctx: runner.Context, chain: Chain, name: str, model: str) -> dict[str, str]:
    bucket = f"s3://{chain.bucket}"
    if name == "stage1":
        queue, reads, writes = chain.stage1, f"{bucket}/in/", f"{bucket}/stage1/"
        next_url = chain.stage2.url if chain.stage2 else ""
    else:
        assert chain.stage2 is not None
        queue, reads, writes, next_url = chain.stage2, f"{bucket}/stage1/", f"{bucket}/stage2/", ""
    return stage.stage_settings(
        ctx.endpoint, queue.url, model, reads=reads, writes=writes, next_queue_url=next_url
    ) | {
        "SQSINFER_DLQ_URL": queue.dlq_url,
        "SQSINFER_REGION": ctx.region,
        "SQSINFER_HANDLER": ctx.handler if name == "stage1" else "xgboost",
        "SQSINFER_PROCESSES": str(ctx.processes),
        "SQSINFER_THREADS_PER_PROCESS": str(ctx.threads),
        "SQSINFER_PREFETCH": str(ctx.prefetch),
        "SQSINFER_MAX_INPUT_BYTES": str(ctx.max_input_bytes),
        "SQSINFER_LOG_LEVEL": "INFO",
    }


def _launch(ctx: runner.Context, settings: dict[str, str], log_stem: str) -> runner.Launched:
    port = standin.free_port()
    env = stage.worker_env("bench", stage.SHORT_DRAIN | settings, port) | runner.UNTRACED
    log_path = log_stem + ".log"
    with open(log_path, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "sqsinfer", "worker"],
            env=env,
            stdout=out,
            stderr=out,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return runner.Launched(process, log_path, port)


# -- measuring --------------------------------------------------------------------------------


@dataclass
class Ends:
    """What is read at either end of the measured batch."""

    at: float
    counts: dict[counting.Kind, counting.Counted]
    trees: dict[str, dict[int, float]]
    moto_s: float
    bench_s: float


@dataclass
class Variant:
    """One variant's run: its stages' trackers, and their tasks committed so far."""

    ctx: runner.Context
    moto: standin.MotoServer
    trackers: dict[str, runner.Tracker] = field(default_factory=dict)
    committed: dict[str, int] = field(default_factory=dict)
    duplicates: dict[str, int] = field(default_factory=dict)
    _seen: dict[str, int] = field(default_factory=dict)

    def wait_for(self, last_stage: str, count: int, limit_s: float) -> None:
        """Until the last stage has committed `count` tasks; fail after `limit_s`, on a
        stall, or on a task that ends otherwise (on loopback nothing should be retried or
        rejected; a duplicate is counted)."""
        deadline = time.monotonic() + limit_s
        while self.committed.get(last_stage, 0) < count:
            if time.monotonic() > deadline:
                raise ChainFailed(f"{last_stage} did not commit {count} tasks in {limit_s:.0f} s")
            for name, tracker in self.trackers.items():
                tracker.poll()  # raises when a worker exited
                self._tally(name, tracker)
            quiet_s = time.monotonic() - max(t.last_progress for t in self.trackers.values())
            if quiet_s > _STALL_S:
                tails = "\n".join(t.tail.tail_text() for t in self.trackers.values())
                raise ChainFailed(f"no task finished for {_STALL_S:.0f} s:\n{tails}")
            time.sleep(runner.POLL_S)

    def _tally(self, name: str, tracker: runner.Tracker) -> None:
        new = tracker.finished[self._seen.get(name, 0) :]
        self._seen[name] = len(tracker.finished)
        for record in new:
            if record.get("outcome") == "duplicate":  # a second message for one task
                self.duplicates[name] = self.duplicates.get(name, 0) + 1
                continue
            if record.get("outcome") != "committed":
                raise ChainFailed(
                    f"{name}: a task ended {record.get('outcome')} "
                    f"({record.get('reason', '')}):\n{tracker.tail.tail_text()}"
                )
            self.committed[name] = self.committed.get(name, 0) + 1

    def ends(self) -> Ends:
        return Ends(
            at=time.monotonic(),
            counts=self.moto.request_counts(),
            trees={n: t.launched.tree.cpu() for n, t in self.trackers.items()},
            moto_s=probe.own_cpu_seconds(self.ctx.moto_pid),
            bench_s=probe.own_cpu_seconds(os.getpid()),
        )


def run_variant(
    ctx: runner.Context, variant: str, moto: standin.MotoServer, models: dict[str, str]
) -> dict[str, Any]:
    """Warm up, then carry `ctx.regime.tasks` tasks through the variant's stages."""
    if len(moto.endpoints) < len(STAGES):
        raise ValueError("the chained regime needs a stand-in with an endpoint per stage")
    s3, sqs = standin.clients(moto.url, ctx.region)
    chain = create_chain(s3, sqs, ctx.inputs, variant)
    names = STAGES if chain.stage2 else STAGES[:1]
    warmup, tasks = ctx.regime.warmup_tasks, ctx.regime.tasks
    feeder = feeding.Backlog(
        feeding.Feeder(sqs, chain.stage1.url, feeding.cycling(variant, chain.inputs), warmup),
        ctx.queue_depth,
        ctx.in_flight("sqsinfer"),
        ctx.rate_per_s,
    )
    run = Variant(ctx, moto)
    ports = dict(zip(STAGES, moto.endpoints, strict=False))
    stem = os.path.join(ctx.work_dir, f"chained-{variant}")
    launched = []
    try:
        for name in names:
            at = dataclasses.replace(ctx, endpoint=ctx.reach(ports[name]))
            one = _launch(at, _settings(at, chain, name, models[name]), f"{stem}-{name}")
            launched.append(one)
            run.trackers[name] = runner.Tracker(one, feeder if name == "stage1" else None)
        for tracker in run.trackers.values():
            tracker.wait_ready()
        run.wait_for(names[-1], warmup, ctx.regime.max_window_s)
        first = run.ends()
        feeder.feeder.total = warmup + tasks  # the measured batch's first send comes now
        run.wait_for(names[-1], warmup + tasks, ctx.regime.max_window_s)
        last = run.ends()
    finally:
        for one in launched:
            runner.stop(one)
    found = summarize(run, first, last, tasks, {n: _port(ports[n]) for n in names})
    found["next_queue"] = variant if chain.stage2 else None
    found["duplicates"] = run.duplicates
    found["bucket_after"] = _bucket_facts(s3, chain.bucket)
    found["logs"] = [one.log_path for one in launched]
    return found


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _bucket_facts(s3: Any, bucket: str) -> dict[str, int]:
    """What the variant left: every task's output per stage, and the chain's markers."""
    stage1 = stage.list_keys(s3, bucket, "stage1/")
    markers = sum(1 for key in stage1 if key.endswith(MARKER))
    return {
        "stage1_outputs": len(stage1) - markers,
        "markers": markers,
        "stage2_outputs": len(stage.list_keys(s3, bucket, "stage2/")),
    }


# -- summarising ------------------------------------------------------------------------------


def summarize(
    run: Variant, first: Ends, last: Ends, tasks: int, ports: dict[str, int]
) -> dict[str, Any]:
    window_s = last.at - first.at
    served = counting.difference(first.counts, last.counts)
    stages = {}
    for name, tracker in run.trackers.items():
        root = tracker.launched.process.pid
        tree_s = probe.cpu_delta(first.trees[name], last.trees[name])
        own_s = probe.cpu_delta(
            {root: first.trees[name].get(root, 0.0)}, {root: last.trees[name].get(root, 0.0)}
        )
        calls = {k: v for k, v in served.items() if k.port == ports[name]}
        stages[name] = {
            "cpu_ms_per_task": round(tree_s / tasks * 1000, 3),
            "worker_process_cpu_ms_per_task": round(own_s / tasks * 1000, 3),
            **calls_per_task(calls, tasks),
        }
    emulator_s, bench_s = last.moto_s - first.moto_s, last.bench_s - first.bench_s
    all_s = sum(probe.cpu_delta(first.trees[n], last.trees[n]) for n in run.trackers)
    all_s += emulator_s + bench_s
    return {
        "tasks": tasks,
        "window_s": round(window_s, 3),
        # Every CPU the batch took, trees, stand-in and bench: what the machine paid.
        "all_cpu_ms_per_task": round(all_s / tasks * 1000, 3),
        "tasks_per_s": round(tasks / window_s, 3) if window_s > 0 else 0.0,
        "stages": stages,
        "emulator_cpu_ms_per_task": round(emulator_s / tasks * 1000, 3),
        "bench_cpu_ms_per_task": round(bench_s / tasks * 1000, 3),
        "usd_per_million_tasks": round(sum(s["usd_per_million_tasks"] for s in stages.values()), 4),
    }


def call_name(kind: counting.Kind) -> str:
    """`s3 PutObject .chain`, `sqs ReceiveMessage standard`."""
    return " ".join(part for part in (kind.service, kind.operation, kind.target) if part)


def request_usd(kind: counting.Kind, counted: counting.Counted) -> float:
    """What AWS charges for these requests (us-east-1, the price list above)."""
    if kind.service == "sqs":
        return counted.chunks * SQS_USD.get(kind.target, SQS_USD["standard"])
    if kind.service == "s3":
        if kind.operation in S3_FREE:
            return 0.0
        price = S3_TIER1_USD if kind.operation in S3_TIER1 else S3_TIER2_USD
        return counted.requests * price
    return 0.0


def calls_per_task(calls: dict[counting.Kind, counting.Counted], tasks: int) -> dict[str, Any]:
    """Calls per task by operation, the chain's markers apart, and their cost per million."""
    per_task = {
        call_name(k): round(v.requests / tasks, 3) for k, v in sorted(calls.items(), key=str)
    }
    usd = {call_name(k): request_usd(k, v) / tasks * 1e6 for k, v in calls.items()}

    def total(service: str, target: str = "") -> float:
        return sum(
            v.requests
            for k, v in calls.items()
            if k.service == service and (not target or k.target == target)
        )

    return {
        "calls_per_task": per_task,
        "sqs_calls_per_task": round(total("sqs") / tasks, 3),
        "s3_calls_per_task": round(total("s3") / tasks, 3),
        "marker_calls_per_task": round(total("s3", MARKER) / tasks, 3),
        "usd_per_million_tasks_by_call": {k: round(v, 4) for k, v in sorted(usd.items())},
        "usd_per_million_tasks": round(sum(usd.values()), 4),
    }


# -- several runs -----------------------------------------------------------------------------


def median_and_range(values: list[float]) -> dict[str, Any] | None:
    found = [v for v in values if v is not None and not math.isnan(v)]
    if not found:
        return None
    return {
        "median": round(statistics.median(found), 3),
        "range": [round(min(found), 3), round(max(found), 3)],
        "runs": found,
    }


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's runs: the medians and ranges of its figures, every run kept."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"] if runs else "not run", "runs": runs}
    found: dict[str, Any] = {
        "tasks_per_s": median_and_range([r["tasks_per_s"] for r in ok]),
        "usd_per_million_tasks": median_and_range([r["usd_per_million_tasks"] for r in ok]),
        "emulator_cpu_ms_per_task": median_and_range([r["emulator_cpu_ms_per_task"] for r in ok]),
        "all_cpu_ms_per_task": median_and_range([r["all_cpu_ms_per_task"] for r in ok]),
        "stages": {},
        "runs": runs,
    }
    for name in ok[0]["stages"]:
        per_stage = [r["stages"][name] for r in ok]
        figures = {
            key: median_and_range([s[key] for s in per_stage])
            for key in per_stage[0]
            if isinstance(per_stage[0][key], (int, float))
        }
        for key in ("calls_per_task", "usd_per_million_tasks_by_call"):
            calls = sorted({c for s in per_stage for c in s[key]})
            figures[key] = {
                c: median_and_range([s[key].get(c, 0.0) for s in per_stage]) for c in calls
            }
        found["stages"][name] = figures
    return found


def chain_costs(per_run: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Within each run, what the chain adds to stage 1 over the unchained baseline (CPU
    and calls per task), and its end-to-end tasks/s as a share of stage 1's alone; the
    median of the runs and the range."""
    gaps: dict[str, dict[str, list[float]]] = {}
    for variants in per_run:
        base = variants.get("unchained")
        for name in NEXT_QUEUES:
            chained = variants.get(name)
            if not base or not chained or "error" in base or "error" in chained:
                continue
            one, other = chained["stages"]["stage1"], base["stages"]["stage1"]
            found = gaps.setdefault(name, {})
            for key in ("cpu_ms_per_task", "worker_process_cpu_ms_per_task", "s3_calls_per_task"):
                found.setdefault(key, []).append(one[key] - other[key])
            if base["tasks_per_s"]:  # end to end through two stages, against stage 1 alone
                ratio = chained["tasks_per_s"] / base["tasks_per_s"]
                found.setdefault("tasks_per_s_ratio", []).append(ratio)
    return {
        name: {key: median_and_range(values) for key, values in keys.items()}
        for name, keys in gaps.items()
    }


# -- the regime -------------------------------------------------------------------------------


def variants_of(next_queues: list[str] | None) -> list[str]:
    """The baseline, then each next queue asked for (default: both)."""
    return ["unchained", *dict.fromkeys(next_queues or NEXT_QUEUES)]


def run_regime(
    ctx: runner.Context,
    moto: standin.MotoServer,
    models: dict[str, str],
    variants: list[str],
    *,
    repeat: int,
    progress: Callable[[str], None],
) -> tuple[dict[str, Any], list[dict[str, dict[str, Any]]]]:
    """Every variant once per run, `repeat` runs; each variant's medians, and every run."""
    per_run: list[dict[str, dict[str, Any]]] = []
    for attempt in range(repeat):
        found: dict[str, dict[str, Any]] = {}
        for variant in variants:
            moto.reset()
            suffix = f" (run {attempt + 1}/{repeat})" if repeat > 1 else ""
            progress(f"  chained / {variant}{suffix}")
            try:
                found[variant] = run_variant(ctx, variant, moto, models)
            except runner.ScenarioFailed as exc:
                found[variant] = {"error": str(exc)}
                progress(f"    FAILED: {str(exc)[:2000]}")
            else:
                progress(f"    {found[variant]['tasks_per_s']:.2f} tasks/s end to end")
        per_run.append(found)
    combined = {v: combine([run[v] for run in per_run]) for v in variants}
    return combined, per_run


def build(
    regime: Any, combined: dict[str, Any], per_run: list[dict[str, Any]], extras: dict[str, Any]
) -> dict[str, Any]:
    return {
        "schema": report.SCHEMA,
        "regime": regime.name,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **extras,
        "workload": regime.describe() | extras.get("workload", {}),
        "variants": combined,
        "chain_costs": chain_costs(per_run),
        "paired_runs": len(per_run),
        "prices_usd": {
            "s3_put_copy_post_list_per_1000": S3_TIER1_USD * 1000,
            "s3_get_head_other_per_1000": S3_TIER2_USD * 1000,
            "sqs_standard_per_million_chunks": SQS_USD["standard"] * 1e6,
            "sqs_fifo_per_million_chunks": SQS_USD["fifo"] * 1e6,
            "region": "us-east-1",
        },
    }


def failed(found: dict[str, Any]) -> bool:
    return any("error" in v for v in found["variants"].values())


# -- the table --------------------------------------------------------------------------------


def _mr(figure: dict[str, Any] | None, spec: str = ".2f") -> str:
    """`1.23 [1.10-1.30]`: a median and its range (the range only when runs differ)."""
    if not figure:
        return "-"
    low, high = figure["range"]
    text = format(figure["median"], spec)
    return text + (f" [{low:{spec}}-{high:{spec}}]" if low != high else "")


def _median(figure: dict[str, Any] | None) -> str:
    return "-" if not figure else f"{figure['median']:.2f}"


def table(built: dict[str, Any]) -> str:
    w, m = built["workload"], built["machine"]
    runs = built["paired_runs"]
    lines = [
        f"regime chained: {w['description']}",
        f"{built['settings']['processes']} processes per stage, {m['cpus_usable']} usable "
        f"CPUs ({m['cpu_model']}), Python {m['python']}; {w['tasks']} tasks per batch; "
        f"median of {runs} paired run{'s' if runs != 1 else ''} [range]",
        "",
    ]
    head = (
        f"{'variant':<11}{'stage':<8}{'tasks/s end to end':>22}{'tree CPU ms/task':>22}"
        f"{'worker ms/task':>22}{'SQS/task':>10}{'S3/task':>9}{'markers':>9}{'$/M tasks':>11}"
    )
    lines += [head, "-" * len(head)]
    for variant, found in built["variants"].items():
        if "error" in found:
            lines.append(f"{variant:<11}FAILED: {found['error'].splitlines()[0][:200]}")
            continue
        for index, (name, s) in enumerate(found["stages"].items()):
            rate = _mr(found["tasks_per_s"]) if index == 0 else ""
            lines.append(
                f"{variant if index == 0 else '':<11}{name:<8}{rate:>22}"
                f"{_mr(s['cpu_ms_per_task']):>22}{_mr(s['worker_process_cpu_ms_per_task']):>22}"
                f"{_median(s['sqs_calls_per_task']):>10}{_median(s['s3_calls_per_task']):>9}"
                f"{_median(s['marker_calls_per_task']):>9}"
                f"{_median(s['usd_per_million_tasks']):>11}"
            )
    lines += [
        "",
        "calls per task by operation, as the stand-in served them (S3 by the key's extension), "
        "and their AWS price in USD per million tasks; medians:",
    ]
    for variant, found in built["variants"].items():
        for name, s in found.get("stages", {}).items():
            usd = s["usd_per_million_tasks_by_call"]
            calls = ", ".join(
                f"{call} {figure['median']:.2f} (${usd[call]['median']:.2f})"
                for call, figure in s["calls_per_task"].items()
            )
            lines.append(f"  {variant} {name}: {calls}")
    for name, gaps in built["chain_costs"].items():
        lines.append(
            f"the chain ({name} next queue) adds to stage 1, per task: tree CPU "
            f"{_mr(gaps.get('cpu_ms_per_task'))} ms, the worker's process "
            f"{_mr(gaps.get('worker_process_cpu_ms_per_task'))} ms, S3 calls "
            f"{_mr(gaps.get('s3_calls_per_task'))}; end-to-end tasks/s "
            f"{_mr(gaps.get('tasks_per_s_ratio'))} of stage 1's alone"
        )
    lines.append(
        "all CPU per task (trees, stand-in, bench): "
        + ", ".join(
            f"{variant} {_mr(found.get('all_cpu_ms_per_task'), '.1f')} ms "
            f"(stand-in {_mr(found.get('emulator_cpu_ms_per_task'), '.1f')})"
            for variant, found in built["variants"].items()
            if "error" not in found
        )
    )
    return "\n".join(lines)
