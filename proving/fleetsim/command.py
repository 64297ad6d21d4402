"""`python -m proving.fleetsim` (`make fleet-sim ARGS=...`): the options, the run, the report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from proving.fleetsim import report
from proving.fleetsim.engine import Simulation
from proving.fleetsim.model import (
    DAY_S,
    HOUR_S,
    JOB_EXIT_WHEN_IDLE_S,
    Aws,
    Behavior,
    FleetConfig,
    Keda,
    Pods,
    TaskTimes,
    WorkerSettings,
    times_from_bench,
)
from sqsinfer import config
from sqsinfer.ops import common
from sqsinfer.ops import plan as planning
from sqsinfer.ops.plan import IDLE_S, NextStage, PlanError, PlanInput, Prices, make_plan
from sqsinfer.worker import inflight

# The worker's settings the fleet runs with: `sqsinfer plan`'s, and what a drain and a
# retry take.
BORROWED = (
    *planning.BORROWED,
    "task_time_s",
    "drain_deadline_s",
    "retry_base_s",
    "retry_max_s",
    "exit_when_idle_s",
    "max_tasks",
    "pod_deletion_cost",
)

EPILOG = """\
examples:
  python -m proving.fleetsim --tasks 15.8M --seconds-per-task 21 --deadline-h 72 --processes 2
  python -m proving.fleetsim --tasks 15.8M --seconds-per-task 21 --deadline-h 72 --processes 2 \\
      --mode job --kills-per-pod-hour 0.05 --json
  python -m proving.fleetsim --tasks 200k --from-bench bench-medium.json --processes 8 \\
      --max-replicas 50 --plot fleet.png

KEDA's settings default to the chart's (keda.*), with maxReplicas the pods `sqsinfer plan`
gives for the deadline; the worker's to its own (the same flags and SQSINFER_* variables).
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m proving.fleetsim",
        description="A fleet of sqsinfer workers under KEDA, simulated event by event, "
        "beside the plan for the same job.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    job = p.add_argument_group("the job")
    job.add_argument("--tasks", type=common.parse_count, required=True, help="e.g. 15.8M")
    job.add_argument("--seconds-per-task", type=common.positive_float, help="their mean")
    job.add_argument("--spread", type=float, default=0.1, help="log-normal shape (0.1; 0: fixed)")
    job.add_argument("--from-bench", metavar="FILE", help="task times from a bench JSON")
    job.add_argument("--bench-scenario", default="sqsinfer")
    job.add_argument("--deadline-h", type=common.positive_float, help="sizes maxReplicas")
    chain = job.add_mutually_exclusive_group()
    chain.add_argument(
        "--next-stage", dest="next_stage", action="store_const", const=NextStage.STANDARD
    )
    chain.add_argument(
        "--next-stage-fifo", dest="next_stage", action="store_const", const=NextStage.FIFO
    )
    config.add_arguments(p, only=BORROWED)
    keda = p.add_argument_group("KEDA (the chart's keda.* defaults)")
    keda.add_argument("--mode", choices=("deployment", "job"), default="deployment")
    keda.add_argument("--max-replicas", type=common.positive_int, help="default: the plan's pods")
    keda.add_argument("--min-replicas", type=int, default=1)
    keda.add_argument("--queue-length", type=common.positive_int, help="default: the plan's")
    keda.add_argument("--polling-interval-s", type=float, default=15.0)
    keda.add_argument("--hpa-sync-s", type=float, default=15.0, help="the HPA's period (15)")
    keda.add_argument("--cooldown-s", type=float, default=300.0)
    keda.add_argument("--scale-to-zero", action="store_true")
    keda.add_argument("--scale-up-percent", type=float, default=100.0)
    keda.add_argument("--scale-up-pods", type=int, default=4)
    keda.add_argument("--scale-down-percent", type=float, default=25.0)
    keda.add_argument("--scale-down-window-s", type=float, default=300.0)
    pods = p.add_argument_group("pods and AWS")
    pods.add_argument("--pod-start-s", type=float, default=30.0, help="created to running (30)")
    pods.add_argument("--model-load-s", type=float, default=15.0, help="running to ready (15)")
    pods.add_argument("--kills-per-pod-hour", type=float, default=0.0, help="SIGKILLs (0)")
    pods.add_argument("--max-receive-count", type=int, default=5, help="the redrive policy's")
    pods.add_argument("--retention-h", type=float, default=96.0, help="the queue's (96)")
    pods.add_argument("--s3-prefixes", type=int, default=1, help="each with S3's own limits")
    out = p.add_argument_group("the run")
    out.add_argument("--pod-hour-price", type=float, help="add the compute's cost")
    out.add_argument("--seed", type=int, default=1)
    out.add_argument("--json", action="store_true", help="the figures as JSON on stdout")
    out.add_argument("--plot", metavar="FILE", help="a PNG of queue depth, pods and throughput")
    return p


def fleet_config(args: argparse.Namespace) -> tuple[FleetConfig, PlanInput]:
    """The simulation's inputs, and the plan's for the same job."""
    s = config.borrowed(args, BORROWED)
    if s["processes"] < 1:
        raise PlanError("give --processes (or set SQSINFER_PROCESSES) of at least 1")
    times = _times(args)
    next_stage = args.next_stage or NextStage.NONE
    planned = PlanInput(
        tasks=args.tasks,
        seconds_per_task=times.mean_s,
        processes=s["processes"],
        prefetch=inflight.starting(1, s["prefetch"], s["max_prefetch"]),
        deadline_s=None if args.deadline_h is None else args.deadline_h * HOUR_S,
        pods_max=args.max_replicas,
        visibility_timeout_s=s["visibility_timeout_s"],
        heartbeat_s=s["heartbeat_s"],
        next_stage=next_stage,
        always_head_output=s["always_head_output"],
        wait_time_s=s["wait_time_s"],
        queue_sample_s=s["queue_sample_s"],
        # After its last task a pod idles through the chart's scale-down (the plan's
        # default), or a Job's worker until its queue stayed empty long enough.
        idle_s=(s["exit_when_idle_s"] or JOB_EXIT_WHEN_IDLE_S) if args.mode == "job" else IDLE_S,
        prices=Prices(),
        pod_hour_price=args.pod_hour_price,
    )
    plan = make_plan(planned)
    worker = WorkerSettings(
        processes=s["processes"],
        prefetch=s["prefetch"],
        max_prefetch=s["max_prefetch"],
        visibility_timeout_s=s["visibility_timeout_s"],
        heartbeat_s=s["heartbeat_s"],
        wait_time_s=s["wait_time_s"],
        drain_s=config.drain_s(s["task_time_s"], s["drain_deadline_s"]),
        retry_base_s=s["retry_base_s"],
        retry_max_s=s["retry_max_s"],
        always_head_output=s["always_head_output"],
        next_stage=next_stage,
        queue_sample_s=s["queue_sample_s"],
        pod_deletion_cost=s["pod_deletion_cost"],
    )
    if args.mode == "job":  # a Job's worker ends by itself (in a Deployment it restarts)
        idle_s = s["exit_when_idle_s"] or JOB_EXIT_WHEN_IDLE_S
        worker = dataclasses.replace(worker, exit_when_idle_s=idle_s, max_tasks=s["max_tasks"])
    keda = Keda(
        queue_length=args.queue_length or plan.queue_length,
        max_replicas=args.max_replicas or plan.keda_max_replicas,
        mode=args.mode,
        min_replicas=args.min_replicas,
        polling_interval_s=args.polling_interval_s,
        hpa_sync_s=args.hpa_sync_s,
        cooldown_s=args.cooldown_s,
        scale_to_zero=args.scale_to_zero,
        scale_up=Behavior(0.0, args.scale_up_percent, args.scale_up_pods),
        scale_down=Behavior(args.scale_down_window_s, args.scale_down_percent, 0),
    )
    cfg = FleetConfig(
        tasks=args.tasks,
        times=times,
        worker=worker,
        keda=keda,
        pods=Pods(args.pod_start_s, args.model_load_s, args.kills_per_pod_hour),
        aws=Aws(
            max_receive_count=args.max_receive_count,
            retention_s=args.retention_h * HOUR_S,
            s3_prefixes=args.s3_prefixes,
        ),
        pod_hour_price=args.pod_hour_price,
        seed=args.seed,
    )
    return cfg, planned


def _times(args: argparse.Namespace) -> TaskTimes:
    if (args.seconds_per_task is None) == (args.from_bench is None):
        raise PlanError("give --seconds-per-task or --from-bench (one of them)")
    if args.from_bench:
        return times_from_bench(args.from_bench, args.bench_scenario)
    return TaskTimes(args.seconds_per_task, max(0.0, args.spread))


def simulate(
    cfg: FleetConfig, planned: PlanInput, *, show_progress: bool = False
) -> tuple[dict[str, Any], Simulation]:
    """Run the fleet; its figures beside the plan's."""
    plan = make_plan(_on(planned, cfg.keda.max_replicas))
    sample_s = min(300.0, max(1.0, plan.wall_s / 2000))
    started = time.perf_counter()
    if show_progress:
        from rich.progress import Progress

        with Progress(transient=True) as bar:
            job = bar.add_task("simulating", total=cfg.tasks)
            sim = Simulation(cfg, lambda done: bar.update(job, completed=done), sample_s)
            out = sim.run()
    else:
        sim = Simulation(cfg, None, sample_s)
        out = sim.run()
    return report.results(sim, out, plan, time.perf_counter() - started), sim


def _on(planned: PlanInput, pods: int) -> PlanInput:
    """The plan on the fleet KEDA runs with a deep queue: its maxReplicas."""
    return dataclasses.replace(planned, pods_max=pods, deadline_s=None)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        cfg, planned = fleet_config(args)
    except (PlanError, config.ConfigError, ValueError) as exc:
        print(f"fleetsim: {exc}", file=sys.stderr)
        return 2
    doc, sim = simulate(cfg, planned, show_progress=not args.json and sys.stderr.isatty())
    if args.plot:
        report.plot(sim, sim.out, args.plot)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        report.render(doc)
    return 0


__all__ = ["DAY_S", "main"]
