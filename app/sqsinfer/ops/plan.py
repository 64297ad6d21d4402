"""`sqsinfer plan`: size a stage's fleet for a deadline, and what its requests cost.

The arithmetic (`make_plan`) is pure and follows the worker's own flow per task:

- compute: a process does one task at a time, `seconds_per_task` each (the bench's
  process-seconds per task). A pod of P processes finishes P tasks per "wave";
  `waves = ceil(tasks / (P × pods))`, `wall = waves × seconds_per_task`.
- SQS, per task: SendMessageBatch 1/10 (the enqueue); ReceiveMessage 1/m_r and
  DeleteMessageBatch 1/m_d, where m_r, m_d are messages per call (1 by default: a pod
  frees one slot at a time, so a receive asks for one message and a delete's 5 ms
  batch window rarely catches a second); ChangeMessageVisibilityBatch as the keeper
  does it (below); SendMessage 1 when the stage hands on to a next one.
- S3, per task: HEAD output, GET input, PUT output; when chained, two PUTs of the marker
  (the intent before the send, "sent" after it; its HEAD happens only for duplicates, so
  it is not counted).
- visibility: a message is held `prefetch × seconds_per_task` (Little's law: the pod
  keeps processes × prefetch messages and finishes processes per `seconds_per_task`).
  The keeper extends a message once it has been held `visibility − 2 × heartbeat`, then
  every `heartbeat × max(1, ceil((visibility − 2 × heartbeat) / heartbeat))`; each tick
  extends the due messages of a pod in batches of ten.
- prices (defaults, us-east-1): SQS $0.40 per million requests; S3 PUT $0.005 per
  1,000; GET $0.0004 per 1,000, HEAD priced as GET.
- KEDA `queueLength`: one pod's capacity, processes × prefetch.
- pod sizing (/dev/shm, /tmp, memory): `sqsinfer.sizing`, the chart's own formula.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from sqsinfer import sizing
from sqsinfer.limits import SQS_BATCH_MAX
from sqsinfer.ops import common
from sqsinfer.worker import inflight

SQS_PER_MILLION = 0.40
S3_PUT_PER_1000 = 0.005
S3_GET_PER_1000 = 0.0004
BENCH_SCENARIO = "sqsinfer"

EPILOG = f"""\
seconds per task: process-seconds per task, as `sqsinfer bench` measures it: given,
or read from a bench JSON at scenarios.<--bench-scenario>.seconds_per_task, e.g.
  {{"scenarios": {{"{BENCH_SCENARIO}": {{"seconds_per_task": 21.0}}}}}}
prices (override them for your region): SQS ${SQS_PER_MILLION:.2f} per million requests,
S3 PUT ${S3_PUT_PER_1000} per 1,000, GET ${S3_GET_PER_1000} per 1,000 (HEAD priced as GET).

examples:
  sqsinfer plan --tasks 15.8M --seconds-per-task 45 --processes 8 --deadline-h 48
  sqsinfer plan --tasks 15.8M --from-bench bench-medium.json --processes 8 --pods-max 400
  sqsinfer plan --tasks 2M --seconds-per-task 3 --processes 4 --pods-max 50 --next-stage --json

exit status: 0, or 1 when the deadline cannot be met within --pods-max.
"""


@dataclass(frozen=True)
class Prices:
    sqs_per_million: float = SQS_PER_MILLION
    s3_put_per_1000: float = S3_PUT_PER_1000
    s3_get_per_1000: float = S3_GET_PER_1000


@dataclass(frozen=True)
class PlanInput:
    tasks: int
    seconds_per_task: float
    processes: int
    prefetch: int = 2
    pods_max: int | None = None
    deadline_s: float | None = None
    visibility_timeout_s: float = 60.0
    heartbeat_s: float = 20.0
    next_stage: bool = False
    enqueue: bool = True
    messages_per_receive: float = 1.0
    messages_per_delete: float = 1.0
    prices: Prices = field(default_factory=Prices)
    pod_hour_price: float | None = None


@dataclass(frozen=True)
class Request:
    service: str  # "sqs", "s3"
    api: str
    per_task: float
    total: float
    tier: str  # what it is priced as: "sqs", "put", "get"
    cost: float


@dataclass(frozen=True)
class Plan:
    input: PlanInput
    pods: int  # the fleet the plan runs on
    pods_needed: int | None  # the fewest that meet the deadline (None: no deadline, or none do)
    meets_deadline: bool | None
    waves: int
    wall_s: float
    tasks_per_s: float
    process_hours: float
    pod_hours: float
    queue_length: int
    hold_s: float
    extensions_per_task: float
    requests: tuple[Request, ...]
    sqs_requests: float
    s3_requests: float
    request_cost: float
    compute_cost: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class PlanError(ValueError):
    pass


def _pods_needed(p: PlanInput) -> int | None:
    """The fewest pods that finish by the deadline; None when no number can."""
    assert p.deadline_s is not None
    waves_allowed = math.floor(p.deadline_s / p.seconds_per_task)
    if waves_allowed < 1:
        return None  # one task takes longer than the deadline
    return max(1, math.ceil(p.tasks / (p.processes * waves_allowed)))


def _fleet(p: PlanInput) -> tuple[int, int | None, bool | None]:
    if p.deadline_s is None:
        if p.pods_max is None:
            raise PlanError("give a deadline, a maximum number of pods, or both")
        return p.pods_max, None, None
    needed = _pods_needed(p)
    if needed is None:
        return p.pods_max or 1, None, False
    if p.pods_max is not None and needed > p.pods_max:
        return p.pods_max, needed, False
    return needed, needed, True


def visibility_extensions(p: PlanInput) -> tuple[float, float]:
    """(extensions per message, ChangeMessageVisibilityBatch calls per message)."""
    hold_s = p.prefetch * p.seconds_per_task
    first_s = p.visibility_timeout_s - 2 * p.heartbeat_s
    if hold_s <= max(0.0, first_s):
        return 0.0, 0.0
    every_s = p.heartbeat_s * max(1, math.ceil(first_s / p.heartbeat_s))
    extensions = (hold_s - max(0.0, first_s)) / every_s
    due_per_tick = p.processes * p.prefetch * (hold_s - max(0.0, first_s)) / hold_s
    calls_per_extension = (
        math.ceil(due_per_tick / SQS_BATCH_MAX) / due_per_tick if due_per_tick >= 1 else 1
    )
    return extensions, extensions * calls_per_extension


def _requests(p: PlanInput, visibility_calls: float) -> tuple[Request, ...]:
    rows: list[tuple[str, str, float, str]] = []
    if p.enqueue:
        rows.append(("sqs", "SendMessageBatch (enqueue)", 1 / SQS_BATCH_MAX, "sqs"))
    rows += [
        ("sqs", "ReceiveMessage", 1 / p.messages_per_receive, "sqs"),
        ("sqs", "DeleteMessageBatch", 1 / p.messages_per_delete, "sqs"),
        ("sqs", "ChangeMessageVisibilityBatch", visibility_calls, "sqs"),
    ]
    if p.next_stage:
        rows.append(("sqs", "SendMessage (next stage)", 1.0, "sqs"))
    rows += [
        ("s3", "HeadObject (output)", 1.0, "get"),
        ("s3", "GetObject (input)", 1.0, "get"),
        ("s3", "PutObject (output)", 1.0, "put"),
    ]
    if p.next_stage:
        rows.append(("s3", "PutObject (chain marker: intent, sent)", 2.0, "put"))
    price = {
        "sqs": p.prices.sqs_per_million / 1e6,
        "put": p.prices.s3_put_per_1000 / 1e3,
        "get": p.prices.s3_get_per_1000 / 1e3,
    }
    out = []
    for service, api, per_task, tier in rows:
        total = per_task * p.tasks
        out.append(Request(service, api, per_task, total, tier, total * price[tier]))
    return tuple(out)


def validate(p: PlanInput) -> None:
    checks = [
        (p.tasks >= 0, "tasks must be 0 or more"),
        (p.seconds_per_task > 0, "seconds per task must be above 0"),
        (p.processes >= 1 and p.prefetch >= 1, "processes and prefetch must be at least 1"),
        (p.pods_max is None or p.pods_max >= 1, "pods max must be at least 1"),
        (p.deadline_s is None or p.deadline_s > 0, "the deadline must be above 0"),
        (0 < p.heartbeat_s < p.visibility_timeout_s, "heartbeat must be below the visibility"),
        (p.messages_per_receive >= 1 and p.messages_per_delete >= 1, "messages per call >= 1"),
        (
            p.messages_per_receive <= SQS_BATCH_MAX and p.messages_per_delete <= SQS_BATCH_MAX,
            "at most 10",
        ),
    ]
    for ok, problem in checks:
        if not ok:
            raise PlanError(problem)


def make_plan(p: PlanInput) -> Plan:
    validate(p)
    pods, needed, meets = _fleet(p)
    per_wave = p.processes * pods
    waves = math.ceil(p.tasks / per_wave)
    wall_s = waves * p.seconds_per_task
    extensions, visibility_calls = visibility_extensions(p)
    requests = _requests(p, visibility_calls)
    pod_hours = pods * wall_s / 3600
    return Plan(
        input=p,
        pods=pods,
        pods_needed=needed,
        meets_deadline=meets,
        waves=waves,
        wall_s=wall_s,
        tasks_per_s=per_wave / p.seconds_per_task,
        process_hours=p.tasks * p.seconds_per_task / 3600,
        pod_hours=pod_hours,
        queue_length=p.processes * p.prefetch,
        hold_s=p.prefetch * p.seconds_per_task,
        extensions_per_task=extensions,
        requests=requests,
        sqs_requests=sum(r.total for r in requests if r.service == "sqs"),
        s3_requests=sum(r.total for r in requests if r.service == "s3"),
        request_cost=sum(r.cost for r in requests),
        compute_cost=None if p.pod_hour_price is None else pod_hours * p.pod_hour_price,
    )


def seconds_from_bench(path: str, scenario: str = BENCH_SCENARIO) -> float:
    """scenarios.<scenario>.seconds_per_task of a `sqsinfer bench` JSON report."""
    try:
        with open(path, "rb") as fh:
            doc = json.load(fh)
        value = doc["scenarios"][scenario]["seconds_per_task"]
    except OSError as exc:
        raise PlanError(f"cannot read {path}: {exc}") from None
    except (ValueError, KeyError, TypeError):
        raise PlanError(
            f"{path} has no scenarios.{scenario}.seconds_per_task (a sqsinfer bench JSON)"
        ) from None
    if not isinstance(value, int | float) or value <= 0:
        raise PlanError(f"{path}: scenarios.{scenario}.seconds_per_task is {value!r}")
    return float(value)


# -- rendering ------------------------------------------------------------------------
def _fleet_rows(plan: Plan) -> list[tuple[str, str]]:
    p = plan.input
    rows = [
        ("tasks", f"{p.tasks:,} at {p.seconds_per_task:g} s each"),
        ("processes per pod", f"{p.processes} (prefetch {p.prefetch})"),
    ]
    if p.deadline_s is not None:
        rows.append(
            ("deadline", f"{common.format_duration(p.deadline_s)} ({p.deadline_s / 3600:g} h)")
        )
        needed = f"{plan.pods_needed:,}" if plan.pods_needed else "none can (a task is longer)"
        rows.append(("pods needed", needed))
    if p.pods_max is not None:
        rows.append(("pods max", f"{p.pods_max:,}"))
    rows += [
        ("pods", f"{plan.pods:,}"),
        ("wall time", f"{common.format_duration(plan.wall_s)} ({plan.wall_s / 3600:,.1f} h)"),
        ("throughput", f"{plan.tasks_per_s:,.1f} tasks/s"),
        ("compute", f"{plan.process_hours:,.0f} process-hours, {plan.pod_hours:,.0f} pod-hours"),
        ("KEDA queueLength", f"{plan.queue_length} (processes × prefetch)"),
        ("held per message", f"{plan.hold_s:g} s, {plan.extensions_per_task:.2f} extensions"),
    ]
    if plan.extensions_per_task > 0:  # hold ≤ visibility − 2 × heartbeat: no extension calls
        rows.append(("visibility for none", f"≥ {plan.hold_s + 2 * p.heartbeat_s:g} s"))
    if p.deadline_s is not None:
        verdict = "yes" if plan.meets_deadline else "NO"
        rows.append(("meets the deadline", verdict))
    return rows


def render(plan: Plan) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console()
    fleet = Table(title="fleet", title_justify="left", show_header=False, box=box.SIMPLE)
    fleet.add_column()
    fleet.add_column(justify="right")
    for name, value in _fleet_rows(plan):
        fleet.add_row(name, value)
    console.print(fleet)
    reqs = Table(title="requests", title_justify="left", box=box.SIMPLE)
    for name in ("service", "request", "per task", "total", "cost"):
        reqs.add_column(name, justify="left" if name in ("service", "request") else "right")
    for r in plan.requests:
        reqs.add_row(
            r.service,
            r.api,
            f"{r.per_task:.3g}",
            f"{math.ceil(r.total):,}",
            common.format_money(r.cost),
        )
    reqs.add_section()
    reqs.add_row(
        "",
        "total",
        "",
        f"{math.ceil(plan.sqs_requests + plan.s3_requests):,}",
        common.format_money(plan.request_cost),
    )
    console.print(reqs)
    if plan.compute_cost is not None:
        console.print(
            f"compute at ${plan.input.pod_hour_price:g} per pod-hour: "
            f"{common.format_money(plan.compute_cost)}"
        )


def render_sizing(pod: sizing.PodSizing) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(title="pod sizing", title_justify="left", show_header=False, box=box.SIMPLE)
    table.add_column()
    table.add_column()
    for name, text in pod.explain().items():
        table.add_row(name, text)
    Console().print(table)


def pod_settings(args: argparse.Namespace) -> sizing.PodSettings:
    """The pod's sizing inputs from the borrowed settings, as the chart takes them."""
    pinned = isinstance(args.prefetch, int)
    in_tmp = sizing.model_in_tmp(args.model_path, args.model_dir)
    return sizing.PodSettings(
        processes=args.processes,
        in_flight_per_process=args.prefetch if pinned else args.max_prefetch,
        max_input_bytes=args.max_input_bytes,
        max_decoded_bytes=args.max_decoded_bytes,
        fetched_model_bytes=args.max_model_bytes if in_tmp else 0,
        model_resident_mib=args.model_resident_mib,
    )


# -- the command ----------------------------------------------------------------------
BORROWED = ("processes", "prefetch", "max_prefetch", "visibility_timeout_s", "heartbeat_s")
SIZED_BY = ("max_input_bytes", "max_decoded_bytes", "model_path", "model_dir", "max_model_bytes")
_NOTES = {
    "processes": "per pod, required here",
    "prefetch": "auto plans with where auto starts",
    "max_prefetch": "the pod is sized for it when prefetch is auto",
    "model_path": "an s3:// model is fetched into /tmp, which is sized for it",
}


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="pods, wall time, requests and their cost for a batch and a deadline",
        description="Capacity planning for one stage: how many pods meet a deadline, how "
        "long it takes, and the SQS and S3 requests it makes.",
        epilog=EPILOG,
        formatter_class=common.formatter(),
    )
    p.add_argument("--tasks", type=common.parse_count, required=True, help="e.g. 15.8M")
    p.add_argument("--seconds-per-task", type=common.positive_float, help="process-seconds")
    p.add_argument("--from-bench", metavar="FILE", help="read seconds per task from a bench JSON")
    p.add_argument("--bench-scenario", default=BENCH_SCENARIO, help=f"({BENCH_SCENARIO})")
    common.borrow(p, BORROWED + SIZED_BY, notes=_NOTES)
    p.add_argument("--pods-max", type=common.positive_int, help="the largest fleet allowed")
    p.add_argument("--deadline-h", type=common.positive_float, help="hours to finish in")
    p.add_argument("--next-stage", action="store_true", help="the stage hands on its outputs")
    p.add_argument(
        "--no-enqueue",
        action="store_true",
        help="the stage is fed by a previous stage, not by sqsinfer enqueue",
    )
    p.add_argument("--messages-per-receive", type=float, default=1.0, help="1-10 (1)")
    p.add_argument("--messages-per-delete", type=float, default=1.0, help="1-10 (1)")
    p.add_argument("--sqs-price-per-million", type=float, default=SQS_PER_MILLION)
    p.add_argument("--s3-put-price-per-1000", type=float, default=S3_PUT_PER_1000)
    p.add_argument("--s3-get-price-per-1000", type=float, default=S3_GET_PER_1000)
    p.add_argument("--pod-hour-price", type=float, help="add the compute cost")
    p.add_argument(
        "--model-resident-mib",
        type=int,
        default=sizing.MODEL_RESIDENT_MIB,
        help=f"memory one process holds for the model, for the pod sizing "
        f"({sizing.MODEL_RESIDENT_MIB}; the chart's model.residentMiB)",
    )
    p.add_argument("--json", action="store_true", help="the plan as JSON on stdout")
    p.set_defaults(func=cmd_plan)


def plan_input(args: argparse.Namespace) -> PlanInput:
    if (args.seconds_per_task is None) == (args.from_bench is None):
        raise PlanError("give --seconds-per-task or --from-bench (one of them)")
    if args.processes < 1:
        raise PlanError("give --processes (or set SQSINFER_PROCESSES) of at least 1")
    seconds = args.seconds_per_task or seconds_from_bench(args.from_bench, args.bench_scenario)
    return PlanInput(
        tasks=args.tasks,
        seconds_per_task=seconds,
        processes=args.processes,
        prefetch=inflight.starting(1, args.prefetch, args.max_prefetch),
        pods_max=args.pods_max,
        deadline_s=None if args.deadline_h is None else args.deadline_h * 3600,
        visibility_timeout_s=args.visibility_timeout_s,
        heartbeat_s=args.heartbeat_s,
        next_stage=args.next_stage,
        enqueue=not args.no_enqueue,
        messages_per_receive=args.messages_per_receive,
        messages_per_delete=args.messages_per_delete,
        prices=Prices(
            args.sqs_price_per_million, args.s3_put_price_per_1000, args.s3_get_price_per_1000
        ),
        pod_hour_price=args.pod_hour_price,
    )


@common.quiet_on_broken_pipe
def cmd_plan(args: argparse.Namespace) -> int:
    try:
        plan = make_plan(plan_input(args))
        pod = sizing.size(pod_settings(args))
    except (PlanError, ValueError) as exc:
        return common.usage_error("plan", str(exc))
    if args.json:
        print(json.dumps(plan.as_dict() | {"sizing": asdict(pod)}, indent=2))
    else:
        render(plan)
        render_sizing(pod)
    if plan.meets_deadline is False:
        print("sqsinfer plan: the deadline cannot be met within --pods-max", file=sys.stderr)
        return common.EXIT_FAILED
    return common.EXIT_OK
