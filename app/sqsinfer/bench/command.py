"""`sqsinfer bench`: every scenario of every regime, back to back, in one process tree.

One moto server (its own process, loopback) serves the whole run and is reset between
scenarios. The bench process itself is the producer (the feeder) and the observer; its
CPU, like moto's, is reported apart from the scenarios'.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import os
import signal
import sys
import time
from typing import Any

import orjson

from sqsinfer import config
from sqsinfer.bench import chained, handoff, report, runner, small, tracecost, workload
from sqsinfer.lab import latency, standin

_FULL_REGIMES = ["medium", "heavy"]
_HANDOFF_REPS = {True: 20, False: 300}
_POOL_REPEATS = {True: 1, False: 3}
_TRACED_TASKS = {True: 500, False: 5000}  # the tracing micro-benchmark's


def _regimes(args: argparse.Namespace) -> list[workload.Regime]:
    names = args.regime or (["quick"] if args.quick else _FULL_REGIMES)
    found = []
    for name in dict.fromkeys(names):
        regime = workload.REGIMES[name]
        changes: dict[str, Any] = {}
        if args.tasks > 0:
            changes["tasks"] = args.tasks
        if args.warmup >= 0:
            changes["warmup_tasks"] = args.warmup
        if args.max_window_s > 0:
            changes["max_window_s"] = args.max_window_s
        found.append(dataclasses.replace(regime, **changes))
    return found


def _scenarios(args: argparse.Namespace) -> list[runner.Scenario]:
    """The scenarios asked for (default: all that can run the chosen handler)."""
    wanted = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(runner.SCENARIO_NAMES))
    if unknown:
        raise SystemExit(
            f"sqsinfer bench: unknown scenario(s) {', '.join(unknown)}; "
            f"choose from {', '.join(runner.SCENARIO_NAMES)}"
        )
    runnable = [s for s in runner.SCENARIOS if s.any_handler or args.handler == "xgboost"]
    refused = sorted(set(wanted) - {s.name for s in runnable})
    if refused:
        raise SystemExit(
            f"sqsinfer bench: {', '.join(refused)} run(s) XGBoost itself, not --handler "
            f"{args.handler}; choose from {', '.join(s.name for s in runnable)}"
        )
    return [s for s in runnable if s.name in wanted or (not wanted and s.default)]


def _sha256(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_regime(
    args: argparse.Namespace,
    regime: workload.Regime,
    moto: standin.MotoServer,
    shared: dict[str, Any],
) -> dict[str, Any]:
    cache_dir = args.cache_dir or os.path.expanduser("~/.cache/sqsinfer/bench")
    _progress(
        f"regime {regime.name}: preparing the {args.handler} model and "
        f"{regime.distinct_inputs} inputs"
    )
    regime, model = workload.for_handler(regime, args.handler, args.seed, cache_dir)
    ctx = _context(args, regime, model, moto, shared)
    if regime.name == "chained":
        return _run_chained(args, ctx, moto, cache_dir)
    if regime.name == "small":
        return _run_small(args, ctx, moto)
    if "handoff" not in shared:
        _progress("handoff micro-benchmark (2 MB array)")
        shared["handoff"] = asyncio.run(
            handoff.handoff_benchmark(model, _HANDOFF_REPS[args.quick], args.handler)
        )
    _progress(f"pool start-up, {ctx.processes} processes")
    pool = asyncio.run(
        handoff.pool_startup(model, ctx.processes, _POOL_REPEATS[args.quick], args.handler)
    )
    if "tracing" not in shared and "sqsinfer-traced" in {s.name for s in _scenarios(args)}:
        _progress("tracing micro-benchmark (a task's spans, exported)")
        shared["tracing"] = tracecost.measure(_TRACED_TASKS[args.quick])
    runs = _run_scenarios(args, ctx, moto)
    extras = _extras(args, ctx) | {
        "handoff": shared["handoff"],
        "pool_startup": pool,
    }
    if "proxy" in shared:
        extras["latency"] = _latency_facts(args, shared["proxy"], moto.url)
    if "tracing" in shared:
        extras["tracing_hooks"] = shared["tracing"]
    return report.build(regime, runs, extras)


def _context(
    args: argparse.Namespace,
    regime: workload.Regime,
    model: str,
    moto: standin.MotoServer,
    shared: dict[str, Any],
) -> runner.Context:
    return runner.Context(
        regime=regime,
        seed=args.seed,
        processes=args.processes or config.available_cpus(),
        threads=args.threads_per_process,
        prefetch=args.prefetch,
        queue_depth=args.queue_depth,
        model_path=model,
        inputs=workload.input_bytes(regime, args.seed),
        work_dir=shared["work_dir"],
        endpoint=shared.get("routes", {}).get(moto.url, moto.url),
        moto_pid=moto.process.pid,
        routes=shared.get("routes", {}),
        proxy_pid=shared.get("proxy_pid", 0),
        profile=args.profile,
        cpus=config.available_cpus(),
        handler=args.handler,
        rate_per_s=args.rate,
    )


def _extras(args: argparse.Namespace, ctx: runner.Context) -> dict[str, Any]:
    """What every regime's report says of the run: command, machine, settings, workload."""
    return {
        "quick": bool(args.quick),
        "command": ["sqsinfer", *sys.argv[1:]],
        "machine": report.machine_facts(),
        "settings": {
            "processes": ctx.processes,
            "threads_per_process": ctx.threads,
            "prefetch": ctx.prefetch,
            "queue_depth": ctx.queue_depth,
            "rate_per_s": ctx.rate_per_s,
            "seed": ctx.seed,
            "handler": ctx.handler,
            "repeat": args.repeat,
            "profiled": bool(args.profile),
            "side_by_side": bool(args.side_by_side),
            "latency": args.latency,
        },
        "workload": {
            "model_mb": round(os.path.getsize(ctx.model_path) / 1e6, 2),
            "model_sha256": _sha256(ctx.model_path),
            "input_bytes": len(ctx.inputs[0]),
        },
    }


def _latency_facts(
    args: argparse.Namespace, proxy: latency.ProxyProcess, target: str
) -> dict[str, Any]:
    """The profile every scenario's calls went through, and what the proxy added to each
    operation's calls over the whole run (every scenario's, the failed ones' too)."""
    return {"profile": latency.profile_named(args.latency).describe(), "added": proxy.stats(target)}


def _run_chained(
    args: argparse.Namespace, ctx: runner.Context, moto: standin.MotoServer, cache_dir: str
) -> dict[str, Any]:
    models = {"stage1": ctx.model_path, "stage2": chained.stage2_model(cache_dir, args.seed)}
    variants = chained.variants_of(args.next_queue)
    combined, per_run = chained.run_regime(
        ctx, moto, models, variants, repeat=args.repeat, progress=_progress
    )
    extras = _extras(args, ctx)
    extras["settings"]["next_queues"] = variants[1:]
    extras["workload"]["stage2_model_sha256"] = _sha256(models["stage2"])
    return chained.build(ctx.regime, combined, per_run, extras)


def _run_small(
    args: argparse.Namespace, ctx: runner.Context, moto: standin.MotoServer
) -> dict[str, Any]:
    counts = tuple(dict.fromkeys(args.rows or small.ROWS))
    per_run = small.run_regime(
        ctx, moto, counts=counts, repeat=args.repeat, quick=bool(args.quick), progress=_progress
    )
    return small.build(ctx.regime, per_run, _extras(args, ctx))


def _run_scenarios(
    args: argparse.Namespace, ctx: runner.Context, moto: standin.MotoServer
) -> dict[str, list[dict[str, Any]]]:
    s3, sqs = standin.clients(moto.url, ctx.region)
    runs: dict[str, list[dict[str, Any]]] = {}
    for attempt in range(args.repeat):
        suffix = f" (run {attempt + 1}/{args.repeat})" if args.repeat > 1 else ""
        for group in _groups(args):
            moto.reset()
            names = " + ".join(s.name for s in group)
            _progress(f"  {ctx.regime.name} / {names}{suffix}")
            started = time.monotonic()
            for name, result in _run_group(ctx, group, s3, sqs).items():
                runs.setdefault(name, []).append(result)
                if "error" not in result:
                    _progress(
                        f"    {name}: {result['tasks_per_s']:.2f} tasks/s over "
                        f"{result['tasks']} tasks ({time.monotonic() - started:.0f} s)"
                    )
    return runs


def _groups(args: argparse.Namespace) -> list[list[runner.Scenario]]:
    """Each scenario alone; with --side-by-side the workers named run together."""
    scenarios = _scenarios(args)
    workers = [s for s in scenarios if s.name in runner.WORKERS]
    if not args.side_by_side or len(workers) < 2:
        return [[s] for s in scenarios]
    return [workers] + [[s] for s in scenarios if s.name not in runner.WORKERS]


def _run_group(
    ctx: runner.Context, group: list[runner.Scenario], s3: Any, sqs: Any
) -> dict[str, dict[str, Any]]:
    try:
        if len(group) > 1:
            return runner.run_together(ctx, group, s3, sqs)
        return {group[0].name: runner.run_scenario(ctx, group[0], s3, sqs)}
    except runner.ScenarioFailed as exc:
        _progress(f"    FAILED: {exc}")
        return {s.name: {"label": s.label, "error": str(exc)} for s in group}


def write_json(out_dir: str, found: dict[str, Any]) -> str:
    handler = found["settings"]["handler"]
    name = found["regime"] + ("" if handler == "xgboost" else f"-{handler}")
    path = os.path.join(out_dir, f"bench-{name}.json")
    with open(path, "wb") as fh:
        fh.write(orjson.dumps(found, option=orjson.OPT_INDENT_2))
    return path


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds through every scenario's and moto's clean-up


def main(args: argparse.Namespace) -> int:
    if not standin.has_local_extra("sqsinfer bench"):
        return 2
    standin.use_fake_credentials()
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("sqsinfer bench: interrupted; scenarios stopped", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    if args.repeat < 0:
        print("sqsinfer bench: --repeat must be at least 1", file=sys.stderr)
        return 2
    if not args.rate >= 0:  # NaN too
        print("sqsinfer bench: --rate must be 0 (no limit) or more", file=sys.stderr)
        return 2
    if any(rows < 1 for rows in args.rows or ()):
        print("sqsinfer bench: --rows must be at least 1", file=sys.stderr)
        return 2
    if args.side_by_side and not args.rate:
        # Unfed by a rate, workers side by side race for the CPUs: neither measures itself.
        print("sqsinfer bench: --side-by-side needs --rate (tasks/s each)", file=sys.stderr)
        return 2
    args.repeat = args.repeat or (1 if args.quick else 3)
    regimes = _regimes(args)
    _scenarios(args)  # fail on a bad list before anything starts
    os.makedirs(args.out_dir, exist_ok=True)
    shared: dict[str, Any] = {"work_dir": os.path.join(args.out_dir, "logs")}
    os.makedirs(shared["work_dir"], exist_ok=True)
    reports, failed = [], False
    # A chain's stages each talk to the stand-in on a port of their own (their calls told
    # apart where they are served).
    more = len(chained.STAGES) if any(r.name == "chained" for r in regimes) else 0
    with standin.moto_server(more_endpoints=more) as moto, contextlib.ExitStack() as stack:
        if args.latency:
            _progress(f"latency proxy, profile {args.latency}, in front of the stand-in")
            proxy = stack.enter_context(
                latency.proxy_process([moto.url, *moto.endpoints], args.latency, args.seed)
            )
            shared |= {"proxy": proxy, "routes": proxy.routes, "proxy_pid": proxy.process.pid}
        for regime in regimes:
            found = run_regime(args, regime, moto, shared)
            path = write_json(args.out_dir, found)
            if "variants" in found:
                print("\n" + chained.table(found) + f"\n(written to {path})\n", flush=True)
                failed |= chained.failed(found)
                continue
            if found["regime"] == "small":
                print("\n" + small.table(found) + f"\n(written to {path})\n", flush=True)
                failed |= small.failed(found)
                continue
            print("\n" + report.table(found) + f"\n(written to {path})\n", flush=True)
            reports.append(found)
            failed |= any("error" in r for r in found["scenarios"].values())
    if args.plot and reports:
        try:
            chart = report.plot(reports, os.path.join(args.out_dir, "bench.png"))
            print(f"chart written to {chart}")
        except ImportError:
            print("--plot needs matplotlib: pip install 'sqsinfer[plot]'", file=sys.stderr)
            return 1
    return 1 if failed else 0
