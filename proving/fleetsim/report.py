"""A run's figures beside the plan's for the same inputs: the JSON, the table, the chart."""

from __future__ import annotations

import itertools
from typing import Any

from proving.fleetsim.engine import API, GONE, Outcome, Simulation
from proving.fleetsim.model import HOUR_S, FleetConfig
from sqsinfer.ops.plan import Api, Plan, tier_of

# What the comparison leaves out of "requests": the enqueue is not simulated (both count
# it the same), the idle polls depend on how long the fleet is followed after the job.
COMPARED = tuple(a for a in Api if a not in (Api.ENQUEUE, Api.RECEIVE_IDLE))


def results(sim: Simulation, out: Outcome, plan: Plan, runtime_s: float) -> dict[str, Any]:
    cfg = sim.cfg
    requests = {api.value: round(out.calls[i]) for i, api in enumerate(API) if out.calls[i]}
    pod_s = sum(p.gone_at - p.created_at for p in sim.pods)
    after_s = sum(max(0.0, p.gone_at - max(p.created_at, out.last_task_at)) for p in sim.pods)
    request_cost = sum(
        out.calls[i] * cfg.prices.per_request(tier_of(api, cfg.worker.next_stage))
        for i, api in enumerate(API)
    )
    compute_cost = None if cfg.pod_hour_price is None else pod_s / HOUR_S * cfg.pod_hour_price
    planned = {r.api: r.total for r in plan.requests}
    return {
        "input": describe(cfg),
        "simulated_wall_s": round(out.last_task_at, 1),
        "tasks_done": out.done,
        "tasks_lost": out.lost,
        "dead_lettered": sim.queue.dead_lettered,
        "duplicate_runs": out.recomputed,
        "wasted_process_s": round(out.wasted_s, 1),
        "scale_in_kills": out.scale_in_kills,
        "scale_ins": out.scale_ins,
        "kills": out.kills,
        "peak_pods": out.peak_pods,
        "pods_made": len(sim.pods),
        "pod_hours": round(pod_s / HOUR_S, 2),
        "pod_hours_after_last_task": round(after_s / HOUR_S, 2),
        "followed_until_s": round(out.ended_at, 1),
        "extensions": out.extensions,
        "s3_slowdowns": out.s3_slowdowns,
        "sqs_throttled": out.sqs_throttled,
        "requests": requests,
        "cost": {
            "requests": round(request_cost, 2),
            "compute": None if compute_cost is None else round(compute_cost, 2),
            "total": round(request_cost + (compute_cost or 0.0), 2),
        },
        "plan": {
            "pods": plan.pods,
            "wall_s": plan.wall_s,
            "pod_hours": round(plan.pod_hours, 2),
            "requests": {api: round(n) for api, n in planned.items()},
            "request_cost": round(plan.request_cost, 2),
        },
        "simulated_over_planned": {
            "wall": ratio(out.last_task_at, plan.wall_s),
            "requests": {
                api.value: ratio(out.calls[API.index(api)], planned.get(api.value, 0.0))
                for api in COMPARED
                if out.calls[API.index(api)] or planned.get(api.value)
            },
        },
        "runtime_s": round(runtime_s, 1),
    }


def ratio(simulated: float, planned: float) -> float | None:
    return round(simulated / planned, 4) if planned else None


def describe(cfg: FleetConfig) -> dict[str, Any]:
    k, w, p = cfg.keda, cfg.worker, cfg.pods
    return {
        "tasks": cfg.tasks,
        "task_times": cfg.times.describe(),
        "mode": k.mode,
        "processes": w.processes,
        "prefetch": w.prefetch,
        "next_stage": str(w.next_stage),
        "keda": {
            "queue_length": k.queue_length,
            "min_replicas": k.min_replicas,
            "max_replicas": k.max_replicas,
            "polling_interval_s": k.polling_interval_s,
        },
        "exit_when_idle_s": w.exit_when_idle_s,
        "max_tasks": w.max_tasks,
        "pod_start_s": p.start_s,
        "model_load_s": p.load_s,
        "kills_per_pod_hour": p.kills_per_hour,
        "visibility_timeout_s": w.visibility_timeout_s,
        "heartbeat_s": w.heartbeat_s,
        "seed": cfg.seed,
    }


def hours(seconds: float) -> str:
    return f"{seconds / HOUR_S:,.2f} h"


def rows(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(figure, simulated, planned) for people."""
    plan = doc["plan"]
    found = [
        ("wall time", hours(doc["simulated_wall_s"]), hours(plan["wall_s"])),
        (
            "tasks done / lost / dead-lettered",
            f"{doc['tasks_done']:,} / {doc['tasks_lost']:,} / {doc['dead_lettered']:,}",
            "",
        ),
        (
            "duplicate runs (work thrown away)",
            f"{doc['duplicate_runs']:,} ({doc['wasted_process_s'] / HOUR_S:,.1f} process-h)",
            "",
        ),
        (
            "kills / scale-ins / tasks cut by a scale-in",
            f"{doc['kills']:,} / {doc['scale_ins']:,} / {doc['scale_in_kills']:,}",
            "",
        ),
        ("peak pods", f"{doc['peak_pods']:,}", f"{plan['pods']:,}"),
        (
            "pod-hours (after the last task)",
            f"{doc['pod_hours']:,.0f} ({doc['pod_hours_after_last_task']:,.1f})",
            f"{plan['pod_hours']:,.0f}",
        ),
    ]
    for api in Api:
        simulated = doc["requests"].get(api.value)
        planned = plan["requests"].get(api.value)
        if simulated or planned:
            found.append((api.value, f"{simulated or 0:,}", f"{planned or 0:,}"))
    if doc["s3_slowdowns"] or doc["sqs_throttled"]:
        found.append(
            (
                "S3 SlowDown / SQS throttled",
                f"{doc['s3_slowdowns']:,} / {doc['sqs_throttled']:,}",
                "",
            )
        )
    cost = doc["cost"]
    found.append(("requests' cost", f"${cost['requests']:,.2f}", f"${plan['request_cost']:,.2f}"))
    if cost["compute"] is not None:
        found.append(("compute's cost", f"${cost['compute']:,.2f}", ""))
    return found


def render(doc: dict[str, Any]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(title="fleet: simulated and planned", title_justify="left", box=box.SIMPLE)
    table.add_column("")
    table.add_column("simulated", justify="right")
    table.add_column("planned", justify="right")
    for row in rows(doc):
        table.add_row(*row)
    console = Console()
    console.print(table)
    console.print(f"simulated in {doc['runtime_s']:,.1f} s")


def plot(sim: Simulation, out: Outcome, path: str) -> None:
    """Queue depth, pods and throughput over the run, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = out.samples
    at_h = [s.at_s / HOUR_S for s in samples]
    figure, (depth, pods, rate) = plt.subplots(3, 1, sharex=True, figsize=(9, 8))
    depth.plot(at_h, [s.visible for s in samples], label="visible")
    depth.plot(at_h, [s.in_flight for s in samples], label="in flight")
    depth.set_ylabel("messages")
    depth.legend()
    pods.plot(at_h, [s.pods for s in samples], label="pods")
    pods.plot(at_h, [s.ready for s in samples], label="ready")
    pods.set_ylabel("pods")
    pods.legend()
    rates = [0.0] + [
        (b.done - a.done) / (b.at_s - a.at_s) if b.at_s > a.at_s else 0.0
        for a, b in itertools.pairwise(samples)
    ]
    rate.plot(at_h, rates)
    rate.set_ylabel("tasks/s")
    rate.set_xlabel("hours")
    figure.suptitle(f"{sim.cfg.tasks:,} tasks, {sim.cfg.keda.mode} mode")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


__all__ = ["GONE", "plot", "render", "results"]
