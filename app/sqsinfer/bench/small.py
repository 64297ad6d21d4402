"""The small regime: tasks of tens of rows, coalesced or each scored alone, side by side.

For each row count (`ROWS`: 10 and 100 rows a task by default, `--rows` for others; the
medium regime's model), two measurements, each with coalescing on and off:

- the pool: the worker's own `InferencePool` and `compute` (the path every task takes),
  fed from shared memory with as many tasks in flight as the worker may hold (with
  prefetch auto, the most of small messages: `inflight.most_messages`), no queue, no
  S3. What coalescing changes where it acts: tasks/s, the processes' and the parent's
  CPU per task, tasks per predict call. Coalesced, every task counts as small here
  whatever its rows (the threshold at least the row count): a sweep of `--rows` shows
  where it stops paying.
- the worker: `sqsinfer` (its defaults: coalesced up to `coalesce_max_rows`) and
  `sqsinfer-alone` (`SQSINFER_COALESCE=false`) on the stand-in, measured as every
  regime measures it.

A run takes each pair once, the order alternating from run to run; each ratio is taken
within its run, and the report gives the median of the runs and their range.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import time
from collections.abc import Callable
from typing import Any

from sqsinfer.bench import chained, probe, report, runner, workload
from sqsinfer.compute import inference
from sqsinfer.config import Settings
from sqsinfer.lab import standin
from sqsinfer.shm import Segments, SharedInput
from sqsinfer.worker.pool import InferencePool, PoolConfig

ROWS = (10, 100)
WORKER_SCENARIOS = ("sqsinfer", "sqsinfer-alone")
MODES = ("coalesced", "alone")
_POOL_TASKS = {True: 300, False: 3000}  # measured per mode and run (--quick: fewer)
_POOL_WARMUP = 200
# What coalescing must reach on the pool at 100 rows a task: tasks/s coalesced ÷ alone.
TARGET = ("pool_ratio_at_100_rows", ">=", 4.0)


def regime_with(regime: workload.Regime, rows: int) -> workload.Regime:
    """The regime at `rows` rows a task (its inputs are generated for that count)."""
    return dataclasses.replace(regime, rows=rows)


# -- the pool --------------------------------------------------------------------------------


async def pool_rate(
    ctx: runner.Context, max_rows: int, tasks: int, in_flight: int
) -> dict[str, Any]:
    """The pool fed `tasks` tasks, `in_flight` at a time, from shared memory: tasks/s,
    CPU per task of its processes and of this (the parent) process, tasks per call."""
    config = PoolConfig(
        processes=ctx.processes,
        handler=ctx.handler,
        model_path=ctx.model_path,
        threads=ctx.threads,
        model_sha256="",
        max_decoded_bytes=Settings.max_decoded_bytes,
        coalesce_max_rows=max_rows,
    )
    pool = InferencePool(config)
    await pool.start()
    segments = Segments()
    shared = [SharedInput(len(data), segments) for data in ctx.inputs]
    try:
        for one, data in zip(shared, ctx.inputs, strict=True):
            one.write_at(0, data)
        jobs = [inference.Job(s.name, s.size, "npy", "npy") for s in shared]
        run = _feeder(pool, jobs, in_flight)
        await run(_POOL_WARMUP)
        pids = list(pool.pids().values())
        calls = _calls(pool)
        children, parent = _cpu(pids), time.process_time()
        started = time.perf_counter()
        await run(tasks)
        wall_s = time.perf_counter() - started
        children, parent = _cpu(pids) - children, time.process_time() - parent
        after = _calls(pool)
        calls = (after[0] - calls[0], after[1] - calls[1])
    finally:
        await pool.close()
        for one in shared:
            one.close()
        segments.clear()
    return {
        "tasks": tasks,
        "tasks_per_s": round(tasks / wall_s, 1),
        "processes_cpu_ms_per_task": round(children / tasks * 1000, 4),
        "parent_cpu_ms_per_task": round(parent / tasks * 1000, 4),
        "tasks_per_call": round(calls[1] / calls[0], 2) if calls[0] else None,
    }


def _feeder(pool: InferencePool, jobs: list[inference.Job], in_flight: int) -> Callable[[int], Any]:
    """Run n tasks through the pool, at most `in_flight` at once (as the worker's slots)."""

    async def run(n: int) -> None:
        slots = asyncio.Semaphore(in_flight)

        async def one(index: int) -> None:
            async with slots:
                await pool.compute(jobs[index % len(jobs)], lambda: None)

        await asyncio.gather(*(one(i) for i in range(n)))

    return run


def _cpu(pids: list[int]) -> float:
    return sum(probe.precise_cpu_seconds(pid) for pid in pids)


def _calls(pool: InferencePool) -> tuple[float, float]:
    """Predict calls made, and the tasks they scored."""
    registry = pool.metrics.registry
    count = registry.get_sample_value("sqsinfer_tasks_per_predict_count") or 0.0
    total = registry.get_sample_value("sqsinfer_tasks_per_predict_sum") or 0.0
    return count, total


# -- the regime -------------------------------------------------------------------------------


def _one_run(
    ctx: runner.Context,
    moto: standin.MotoServer,
    counts: tuple[int, ...],
    attempt: int,
    *,
    quick: bool,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Each row count's pool pair and worker pair, once."""
    s3, sqs = standin.clients(moto.url, ctx.region)
    order = MODES if attempt % 2 == 0 else MODES[::-1]
    found: dict[str, Any] = {}
    for rows in counts:
        regime = regime_with(ctx.regime, rows)
        at = dataclasses.replace(ctx, regime=regime, inputs=workload.input_bytes(regime, ctx.seed))
        in_flight = ctx.in_flight("sqsinfer")
        pool: dict[str, Any] = {}
        for mode in order:
            max_rows = max(rows, Settings.coalesce_max_rows) if mode == "coalesced" else 0
            pool[mode] = asyncio.run(pool_rate(at, max_rows, _POOL_TASKS[quick], in_flight))
            progress(f"    {rows} rows, pool {mode}: {pool[mode]['tasks_per_s']:.0f} tasks/s")
        workers: dict[str, Any] = {}
        names = WORKER_SCENARIOS if attempt % 2 == 0 else WORKER_SCENARIOS[::-1]
        for name in names:
            moto.reset()
            scenario = next(s for s in runner.SCENARIOS if s.name == name)
            try:
                workers[name] = runner.run_scenario(at, scenario, s3, sqs)
            except runner.ScenarioFailed as exc:
                workers[name] = {"label": scenario.label, "error": str(exc)}
                progress(f"    FAILED: {str(exc)[:2000]}")
                continue
            progress(f"    {rows} rows, {name}: {workers[name]['tasks_per_s']:.1f} tasks/s")
        found[str(rows)] = {"pool": pool, "workers": workers}
    return found


def run_regime(
    ctx: runner.Context,
    moto: standin.MotoServer,
    *,
    counts: tuple[int, ...] = ROWS,
    repeat: int,
    quick: bool,
    progress: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Every row count's pairs once per run, `repeat` runs: every run's figures."""
    per_run = []
    for attempt in range(repeat):
        suffix = f" (run {attempt + 1}/{repeat})" if repeat > 1 else ""
        progress(f"  small / rows {', '.join(map(str, counts))}{suffix}")
        per_run.append(_one_run(ctx, moto, counts, attempt, quick=quick, progress=progress))
    return per_run


# -- the report --------------------------------------------------------------------------------


def _spawned_cpu_ms(result: dict[str, Any]) -> float | None:
    """The inference processes' CPU per task: the tree's less what is not spawned."""
    tree, outside = result.get("cpu_s_per_task"), result.get("cpu_s_per_task_outside_spawned")
    if tree is None or outside is None:
        return None
    return round((float(tree) - float(outside)) * 1000, 4)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(float(a) / float(b), 3) if a and b else None


def _pairs(run: dict[str, Any]) -> dict[str, float | None]:
    """One run's ratios at one row count: coalesced over alone."""
    pool, workers = run["pool"], run["workers"]
    ours, alone = workers.get("sqsinfer", {}), workers.get("sqsinfer-alone", {})
    ok = "error" not in ours and "error" not in alone
    return {
        "pool_tasks_per_s": _ratio(pool["coalesced"]["tasks_per_s"], pool["alone"]["tasks_per_s"]),
        "pool_processes_cpu_alone_over_coalesced": _ratio(
            pool["alone"]["processes_cpu_ms_per_task"],
            pool["coalesced"]["processes_cpu_ms_per_task"],
        ),
        "worker_tasks_per_s": _ratio(ours.get("tasks_per_s"), alone.get("tasks_per_s"))
        if ok
        else None,
        "worker_processes_cpu_alone_over_coalesced": _ratio(
            _spawned_cpu_ms(alone), _spawned_cpu_ms(ours)
        )
        if ok
        else None,
    }


def combine(per_run: list[dict[str, Any]]) -> dict[str, Any]:
    """Each row count: the medians and ranges of the pool's figures, the workers' median
    runs (with their processes' CPU per task), and the ratios taken within each run."""
    found: dict[str, Any] = {}
    for rows in per_run[0] if per_run else ():
        runs = [run[rows] for run in per_run]
        pool = {
            mode: {
                key: chained.median_and_range([r["pool"][mode][key] for r in runs])
                for key in runs[0]["pool"][mode]
                if key != "tasks"
            }
            for mode in MODES
        }
        workers = {}
        for name in WORKER_SCENARIOS:
            chosen = report.median_run([r["workers"][name] for r in runs])
            if "error" not in chosen:
                chosen["processes_cpu_ms_per_task"] = _spawned_cpu_ms(chosen)
            workers[name] = chosen
        pairs = [_pairs(r) for r in runs]
        ratios = {
            key: chained.median_and_range([v for p in pairs if (v := p[key]) is not None])
            for key in pairs[0]
        }
        found[rows] = {"pool": pool, "workers": workers, "ratios": ratios}
    return found


def _target(combined: dict[str, Any]) -> dict[str, Any]:
    name, op, limit = TARGET
    if "100" not in combined:
        return {}
    figure = combined["100"]["ratios"].get("pool_tasks_per_s")
    measured = figure["median"] if figure else None
    met = measured is not None and measured >= limit
    return {name: {"target": f"{op} {limit}", "measured": measured, "met": met}}


def build(
    regime: workload.Regime, per_run: list[dict[str, Any]], extras: dict[str, Any]
) -> dict[str, Any]:
    combined = combine(per_run)
    return {
        "schema": report.SCHEMA,
        "regime": regime.name,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **extras,
        "workload": regime.describe() | extras.get("workload", {}) | {"rows": list(combined)},
        "rows": combined,
        "targets": _target(combined),
        "paired_runs": len(per_run),
        "runs": per_run,
    }


def failed(found: dict[str, Any]) -> bool:
    return any(
        "error" in worker for at in found["rows"].values() for worker in at["workers"].values()
    )


def table(built: dict[str, Any]) -> str:
    w, m, s = built["workload"], built["machine"], built["settings"]
    runs = built["paired_runs"]
    lines = [
        f"regime small: {w['description']}",
        f"{s['processes']} processes, {m['cpus_usable']} usable CPUs ({m['cpu_model']}), "
        f"Python {m['python']}; median of {runs} paired run{'s' if runs != 1 else ''} [range]",
        "",
        f"{'rows':>5}  {'':<22}{'tasks/s':>22}{'processes CPU ms/task':>26}"
        f"{'parent CPU ms/task':>24}{'tasks/call':>18}",
    ]
    for rows, at in built["rows"].items():
        for mode in MODES:
            p = at["pool"][mode]
            lines.append(
                f"{rows:>5}  {'pool, ' + mode:<22}{chained._mr(p['tasks_per_s'], '.0f'):>22}"
                f"{chained._mr(p['processes_cpu_ms_per_task'], '.3f'):>26}"
                f"{chained._mr(p['parent_cpu_ms_per_task'], '.3f'):>24}"
                f"{chained._mr(p['tasks_per_call'], '.1f'):>18}"
            )
        for name, r in at["workers"].items():
            if "error" in r:
                lines.append(f"{rows:>5}  {name:<22}FAILED: {r['error'].splitlines()[0][:200]}")
                continue
            lines.append(
                f"{rows:>5}  {name:<22}{r['tasks_per_s']:>22.1f}"
                f"{report._fmt(r.get('processes_cpu_ms_per_task'), '.3f'):>26}"
                f"{report._fmt(r.get('cpu_s_per_task_parent'), '.3f', 1000):>24}"
                f"{report._fmt(r.get('tasks_per_predict_call'), '.1f'):>18}"
            )
        ratio = {key: chained._mr(figure) for key, figure in at["ratios"].items()}
        lines.append(
            f"{rows:>5}  coalesced ÷ alone: pool tasks/s {ratio['pool_tasks_per_s']}, its "
            f"processes' CPU {ratio['pool_processes_cpu_alone_over_coalesced']} × less; worker "
            f"tasks/s {ratio['worker_tasks_per_s']}, its processes' CPU "
            f"{ratio['worker_processes_cpu_alone_over_coalesced']} × less"
        )
    for name, t in built["targets"].items():
        state = "met" if t["met"] else "missed"
        lines.append(f"target {name} {t['target']}: {report._fmt(t['measured'], '.2f')} {state}")
    return "\n".join(lines)
