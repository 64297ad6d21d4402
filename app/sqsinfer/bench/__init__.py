"""`sqsinfer bench`: the design measured against the designs it replaces, in one run.

This module only declares the command; the work lives in `sqsinfer.bench.command`, imported
when the command runs (so `sqsinfer --help` stays fast).
"""

from __future__ import annotations

import argparse
from typing import Any

# sqsinfer.bench.workload.REGIMES, without numpy
REGIME_NAMES = ("chained", "heavy", "medium", "quick", "small")
HANDLERS = ("xgboost", "onnx")  # the model kinds a regime has (sqsinfer.bench.workload)
NEXT_QUEUES = ("standard", "fifo")  # the chained regime's (sqsinfer.bench.chained)
LATENCY_PROFILES = ("aws", "loopback")  # sqsinfer.lab.latency.PROFILES, without aiohttp

BENCH_EPILOG = """\
Scenarios (each on its own fresh queues and bucket of a local moto server):
  compute-only                   decode + predict in N processes: no queue, no S3 (the limit)
  sqsinfer                       the real worker (python -m sqsinfer worker), N processes
  sqsinfer-traced                the same, every task traced and exported (only when named)
  sqsinfer-alone                 the same, each task scored alone: coalescing off (small regime)
  http-service                   consumer POSTs each input as JSON to N model-service processes
  http-service-load-per-request  the same, the service loading the model per request
  naive                          N processes of sync boto3, one message at a time
  emulator-ceiling               the worker's SQS/S3 calls with no compute (the stand-in's limit)

examples:
  sqsinfer bench                       # medium and heavy regimes, a few minutes
  sqsinfer bench --quick               # a smoke run in under a minute (asserts no speed)
  sqsinfer bench --regime medium --repeat 3 --plot
  sqsinfer bench --handler onnx --regime medium   # an ONNX MLP of the same cost per task
  sqsinfer bench --regime medium --scenarios sqsinfer,sqsinfer-traced \
      --side-by-side --rate 10 --tasks 500 --max-window-s 50      # tracing's CPU
  sqsinfer bench --regime chained --next-queue standard   # two stages, calls and their cost
  sqsinfer bench --regime small --repeat 3   # small tasks coalesced, beside each alone
  sqsinfer bench --regime small --rows 300 --rows 1000 --rows 3000   # where it stops paying
  sqsinfer bench --regime medium --latency aws --repeat 3  # every call held as long as on AWS
The chained regime runs two workers, stage 2 fed by stage 1 through a standard or FIFO
next queue, beside stage 1 alone (unchained): end-to-end tasks/s, each stage's CPU, and
its SQS and S3 calls per task as the stand-in served them, with their AWS price.
The small regime runs tasks of 10 and 100 rows, coalesced and each alone: the pool fed
from shared memory (no queue, no S3), then the worker (sqsinfer, sqsinfer-alone).
With --latency PROFILE every scenario's calls go through one proxy that holds each as
long as the profile draws for its operation (aws: S3 and SQS from the same region;
loopback: nothing added, the hop alone); the bench's own set-up and feeding do not.
Writes <out-dir>/bench-<regime>.json (bench-<regime>-onnx.json with --handler onnx; and
bench.png with --plot, which needs matplotlib). With --handler onnx the scenarios are those
that run the worker's handler: compute-only, sqsinfer, emulator-ceiling.
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="measure the worker against compute-only, an HTTP model service and a naive loop",
        epilog=BENCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--regime",
        action="append",
        choices=REGIME_NAMES,
        help="workload regime, repeatable (default: medium and heavy; quick with --quick)",
    )
    p.add_argument(
        "--next-queue",
        action="append",
        choices=NEXT_QUEUES,
        help="the chained regime's next queue, repeatable (default: standard and fifo; "
        "each beside the unchained baseline)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: small tasks, few of them")
    p.add_argument(
        "--rows",
        type=int,
        action="append",
        help="the small regime's rows per task, repeatable (default: 10 and 100)",
    )
    p.add_argument(
        "--handler",
        choices=HANDLERS,
        default="xgboost",
        help="the model kind: XGBoost trees, or an ONNX MLP of the same cost (xgboost)",
    )
    p.add_argument(
        "--scenarios",
        default="",
        help="comma-separated subset (default: all but sqsinfer-traced)",
    )
    p.add_argument("--processes", type=int, default=0, help="processes (default: usable CPUs)")
    p.add_argument("--threads-per-process", type=int, default=1, help="model threads (1)")
    p.add_argument(
        "--prefetch",
        type=_prefetch,
        default="auto",
        help="the worker's prefetch: auto (its default) or messages per process",
    )
    p.add_argument(
        "--queue-depth", type=int, default=20, help="messages the feeder keeps waiting (20)"
    )
    p.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="tasks fed a second at most, the same for every scenario (default: as fast "
        "as each takes them)",
    )
    p.add_argument("--tasks", type=int, default=0, help="tasks measured per scenario")
    p.add_argument("--warmup", type=int, default=-1, help="tasks finished before measuring")
    p.add_argument("--max-window-s", type=float, default=0.0, help="longest measurement")
    p.add_argument(
        "--repeat",
        type=int,
        default=0,
        help="paired runs (every scenario once per run); medians and ranges are reported "
        "(default 3; 1 with --quick)",
    )
    p.add_argument(
        "--side-by-side",
        action="store_true",
        help="run the worker scenarios named (sqsinfer, sqsinfer-traced) at once, each on its "
        "own queue, in one window: their difference then shares the machine's speed; "
        "feed with --rate",
    )
    p.add_argument(
        "--latency",
        choices=LATENCY_PROFILES,
        default="",
        help="run every scenario's S3 and SQS calls through a proxy that adds this "
        "profile's latency per operation (default: none, straight to the stand-in)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the model, inputs and latency draws (0)"
    )
    p.add_argument("--out-dir", default="bench-results", help="where JSON, logs, chart go")
    p.add_argument("--cache-dir", default="", help="model cache (~/.cache/sqsinfer/bench)")
    p.add_argument("--plot", action="store_true", help="also write bench.png (matplotlib)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="sample the worker with py-spy during its window (figures then include py-spy)",
    )
    p.add_argument("--log-level", default="WARNING", help="log level of the bench (WARNING)")
    p.set_defaults(func=cmd_bench)


def _prefetch(text: str) -> int | str:
    from sqsinfer.config import parse_prefetch

    value = parse_prefetch(text)
    if isinstance(value, int) and value < 1:
        raise argparse.ArgumentTypeError("auto or at least 1")
    return value


def cmd_bench(args: argparse.Namespace) -> int:
    from sqsinfer import logs
    from sqsinfer.bench import command

    logs.configure(args.log_level, "console")
    return command.main(args)
