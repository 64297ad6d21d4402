"""`sqsinfer plan`: size a stage's fleet for a deadline, and what its requests cost.

The arithmetic (`make_plan`) is pure and counts what the worker's own code does, from
the rules it imports (the in-flight limit and its receive batch, the keeper's cadence,
the batchers' linger, whether a delivery looks first):

- compute: a process does one task at a time, `seconds_per_task` each (the bench's
  process-seconds per task). A pod of P processes finishes P tasks per "wave";
  `waves = ceil(tasks / (P × pods))`, `wall = waves × seconds_per_task`.
- receives: a pod holds L = P × prefetch messages; its first receive(s) fill them (ten
  at most a call), then it receives again whenever `inflight.receive_batch(L)` slots are
  free, each receive bringing that many. Once the queue is empty each pod long-polls,
  one empty receive per `wait_time_s`, while its last messages finish and until it is
  gone (`idle_s`). Every `queue_sample_s` each pod reads its queue's and its DLQ's depth
  (`worker.queue_depth`: one GetQueueAttributes a queue), from its start until it is gone.
- deletes and next-stage sends are batched for `LINGER_S` / `SEND_LINGER_S` after their
  first entry: a call carries its first entry and those of the pod's other processes
  finishing within the linger, 1 + (P − 1) × linger / seconds_per_task.
- visibility: a message is held `prefetch × seconds_per_task` (Little's law: the pod
  keeps L messages and finishes P per `seconds_per_task`); a pod's first messages less
  (the k-th group of P, k × seconds_per_task). `visibility.expected_extensions` counts
  the keeper's extensions of such a hold; each tick extends the pod's due messages in
  batches of ten, about `P / seconds_per_task × heartbeat` of them at each tick.
- S3, per delivery (`delivery_requests`): the output's HEAD only when the delivery looks
  first (a redelivery, or `always_head_output`), the input's GET, the output's PUT; on a
  standard next queue one PUT of the chain marker ("sent", after the send); a FIFO next
  queue needs none (SQS drops a second send with the same deduplication id).
- prices (defaults, us-east-1): SQS $0.40 per million requests ($0.50 on a FIFO queue);
  S3 PUT $0.005 per 1,000; GET $0.0004 per 1,000, HEAD priced as GET.
- KEDA: `queueLength` is one pod's capacity, P × prefetch; `maxReplicas` must be at least
  the pods planned (KEDA never runs more, whatever the queue's depth).
- pod sizing (/dev/shm, /tmp, memory): `sqsinfer.sizing`, the chart's own formula.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from sqsinfer import sizing
from sqsinfer.aws.sqs import LINGER_S, SEND_LINGER_S
from sqsinfer.limits import SQS_BATCH_MAX
from sqsinfer.ops import common
from sqsinfer.worker import inflight, queue_depth, visibility
from sqsinfer.worker.pipeline import looks_first

SQS_PER_MILLION = 0.40
SQS_FIFO_PER_MILLION = 0.50
S3_PUT_PER_1000 = 0.005
S3_GET_PER_1000 = 0.0004
BENCH_SCENARIO = "sqsinfer"
# How long a pod idles after its last task before it is gone, with the chart's scaling
# defaults (keda.behavior): the scale-down waits out its 300 s window, then removes a
# quarter of the pods a minute, so the average pod stays 300 + 60 × (1/4 + 3/4 × ...)
# ≈ 300 + 60 × 3 = 480 s. (Job mode's Jobs exit after worker.exit_when_idle_s.)
IDLE_S = 480.0

EPILOG = f"""\
seconds per task: process-seconds per task, as `sqsinfer bench` measures it: given,
or read from a bench JSON at scenarios.<--bench-scenario>.seconds_per_task, e.g.
  {{"scenarios": {{"{BENCH_SCENARIO}": {{"seconds_per_task": 21.0}}}}}}
prices (override them for your region): SQS ${SQS_PER_MILLION:.2f} per million requests
(${SQS_FIFO_PER_MILLION:.2f} on a FIFO queue), S3 PUT ${S3_PUT_PER_1000} per 1,000, GET
${S3_GET_PER_1000} per 1,000 (HEAD priced as GET).

examples:
  sqsinfer plan --tasks 15.8M --seconds-per-task 21 --processes 2 --deadline-h 72
  sqsinfer plan --tasks 15.8M --from-bench bench-medium.json --processes 8 --pods-max 400
  sqsinfer plan --tasks 2M --seconds-per-task 3 --processes 4 --pods-max 50 --next-stage --json
  sqsinfer plan --tasks 2M --seconds-per-task 3 --processes 4 --pods-max 50 --next-stage-fifo

exit status: 0, or 1 when the deadline cannot be met within --pods-max.
"""


class NextStage(StrEnum):
    """Where a stage hands its outputs on: nowhere, a standard queue, a FIFO queue."""

    NONE = "none"
    STANDARD = "standard"
    FIFO = "fifo"


class Api(StrEnum):
    """The requests a stage makes, by what they are for (S3's by the object they touch)."""

    ENQUEUE = "SendMessageBatch (enqueue)"
    RECEIVE = "ReceiveMessage"
    RECEIVE_IDLE = "ReceiveMessage (empty, idle)"
    DELETE = "DeleteMessageBatch"
    EXTEND = "ChangeMessageVisibilityBatch"
    DEPTH = "GetQueueAttributes (depth)"
    SEND_NEXT = "SendMessageBatch (next stage)"
    HEAD = "HeadObject (output)"
    GET = "GetObject (input)"
    PUT = "PutObject (output)"
    MARKER = "PutObject (chain marker)"
    HEAD_MARKER = "HeadObject (chain marker)"

    @property
    def service(self) -> str:
        return "s3" if "Object" in self.value else "sqs"


@dataclass(frozen=True)
class Prices:
    sqs_per_million: float = SQS_PER_MILLION
    s3_put_per_1000: float = S3_PUT_PER_1000
    s3_get_per_1000: float = S3_GET_PER_1000
    sqs_fifo_per_million: float = SQS_FIFO_PER_MILLION

    def per_request(self, tier: str) -> float:
        """The price of one request priced as `tier` (`tier_of`)."""
        return {
            "put": self.s3_put_per_1000 / 1e3,
            "get": self.s3_get_per_1000 / 1e3,
            "sqs": self.sqs_per_million / 1e6,
            "sqs_fifo": self.sqs_fifo_per_million / 1e6,
        }[tier]


def tier_of(api: Api, next_stage: NextStage) -> str:
    """What a request is priced as: an S3 PUT, an S3 GET (HEAD too), an SQS request
    (a FIFO queue's for the sends to a FIFO next stage)."""
    if api in (Api.PUT, Api.MARKER):
        return "put"
    if api.service == "s3":
        return "get"
    return "sqs_fifo" if api == Api.SEND_NEXT and next_stage == NextStage.FIFO else "sqs"


@dataclass(frozen=True)
class PlanInput:
    tasks: int
    seconds_per_task: float
    processes: int
    prefetch: int = 2  # messages held per process
    pods_max: int | None = None
    deadline_s: float | None = None
    visibility_timeout_s: float = 60.0
    heartbeat_s: float = 20.0
    next_stage: NextStage = NextStage.NONE
    enqueue: bool = True
    always_head_output: bool = False
    wait_time_s: float = 20.0
    queue_sample_s: float = 60.0
    idle_s: float = IDLE_S
    # Messages per receive and per delete call; None: the worker's own rules (above).
    messages_per_receive: float | None = None
    messages_per_delete: float | None = None
    prices: Prices = field(default_factory=Prices)
    pod_hour_price: float | None = None


@dataclass(frozen=True)
class Request:
    service: str  # "sqs", "s3"
    api: str
    per_task: float
    total: float
    tier: str  # what it is priced as: "sqs", "sqs_fifo", "put", "get"
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
    keda_max_replicas: int  # the chart's keda.maxReplicas to set: the pods planned
    hold_s: float
    extensions_per_task: float
    requests: tuple[Request, ...]
    sqs_requests: float
    s3_requests: float
    request_cost: float
    compute_cost: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def totals(self) -> dict[str, float]:
        """Requests by `Api` value, in all."""
        return {r.api: r.total for r in self.requests}


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


def delivery_requests(
    next_stage: NextStage, *, looked_first: bool, output_found: bool = False
) -> dict[Api, int]:
    """The S3 requests and next-stage messages of one delivery, as the pipeline makes them.

    One that computes: its HEAD when it looks first (`pipeline.looks_first`), the input's
    GET, the output's conditional PUT, then the link: on a standard next queue the send
    and one PUT of the marker ("sent"; the writer owns the link without reading it), on a
    FIFO one the send alone. One that finds its output at the HEAD: on a standard next
    queue the marker's HEAD (a link recorded as sent: nothing more), on a FIFO one the
    send again (SQS drops it within its deduplication window).
    """
    found: dict[Api, int] = {Api.HEAD: 1} if looked_first else {}
    if output_found:
        if next_stage == NextStage.STANDARD:
            found[Api.HEAD_MARKER] = 1
        elif next_stage == NextStage.FIFO:
            found[Api.SEND_NEXT] = 1
        return found
    found |= {Api.GET: 1, Api.PUT: 1}
    if next_stage != NextStage.NONE:
        found[Api.SEND_NEXT] = 1
    if next_stage == NextStage.STANDARD:
        found[Api.MARKER] = 1
    return found


def entries_per_call(processes: int, seconds_per_task: float, linger_s: float) -> float:
    """Entries one batch call of a pod carries: its first, and those of the pod's other
    processes that finish within its linger (finishing evenly spread)."""
    return min(float(SQS_BATCH_MAX), 1 + (processes - 1) * linger_s / seconds_per_task)


def calls_per_tick(due: float) -> float:
    """The keeper's calls at a tick where `due` messages are due on average, spread as
    evenly as whole messages allow (floor or ceil of it), ten a call."""
    low = math.floor(due)
    share = due - low
    return (1 - share) * math.ceil(low / SQS_BATCH_MAX) + share * math.ceil(
        (low + 1) / SQS_BATCH_MAX
    )


def _hold_s(p: PlanInput, group: int) -> float:
    """How long the `group`-th P messages a pod holds are held (the last: every later one)."""
    return group * p.seconds_per_task


def visibility_calls(p: PlanInput, pods: int) -> tuple[float, float]:
    """(extensions, ChangeMessageVisibilityBatch calls) in all.

    Calls: where fewer than one message of a pod is due at a tick, each extension is a
    call of its own. Otherwise every tick of a pod's busy time carries its due messages,
    ten a call: from the first extension of its first messages to the last one of its
    last message, received when all but its last L tasks were done.
    """
    v, hb = p.visibility_timeout_s, p.heartbeat_s

    def extensions(group: int) -> float:
        return visibility.expected_extensions(_hold_s(p, group), v, hb)

    steady = extensions(p.prefetch)
    limit = p.processes * p.prefetch
    # A pod's first messages: the k-th group of P computes after k − 1 before it.
    filled = min(p.tasks, pods * limit) / limit
    short = sum(steady - extensions(k) for k in range(1, p.prefetch)) * p.processes * filled
    total = max(0.0, p.tasks * steady - short)
    due = steady * p.processes / p.seconds_per_task * hb  # per tick per pod, steady
    if due < 1:
        return total, total
    every_s = hb * visibility.extension_every_ticks(v, hb)
    last_received_s = max(0.0, p.tasks / pods - limit) * p.seconds_per_task / p.processes
    busy_s = last_received_s + max(0.0, steady - 1) * every_s
    return total, pods * (1 + busy_s / hb) * calls_per_tick(due)


def _receives(p: PlanInput, pods: int, wall_s: float) -> tuple[float, float]:
    """(receives that bring messages, empty receives of idle pods) in all."""
    if p.messages_per_receive is not None:
        busy = p.tasks / p.messages_per_receive
    else:
        limit = p.processes * p.prefetch
        filled = min(p.tasks, pods * limit)
        busy = math.ceil(limit / SQS_BATCH_MAX) * filled / limit
        busy += (p.tasks - filled) / inflight.receive_batch(limit)
    # Idle: while a pod's last messages finish, then until it is gone.
    idle_s = min(wall_s, p.prefetch * p.seconds_per_task) + p.idle_s
    idle = pods * idle_s / p.wait_time_s if p.wait_time_s > 0 else 0.0
    return busy, idle


def _requests(p: PlanInput, pods: int, wall_s: float) -> tuple[Request, ...]:
    per_delivery = delivery_requests(
        p.next_stage, looked_first=looks_first(p.always_head_output, receive_count=1)
    )
    totals: dict[Api, float] = {api: n * float(p.tasks) for api, n in per_delivery.items()}
    if p.enqueue:
        totals[Api.ENQUEUE] = p.tasks / SQS_BATCH_MAX
    totals[Api.RECEIVE], totals[Api.RECEIVE_IDLE] = _receives(p, pods, wall_s)
    delete = p.messages_per_delete or entries_per_call(p.processes, p.seconds_per_task, LINGER_S)
    totals[Api.DELETE] = p.tasks / delete
    totals[Api.EXTEND] = visibility_calls(p, pods)[1]
    if p.queue_sample_s > 0:  # each pod, from its start until it is gone
        samples = pods * math.ceil((wall_s + p.idle_s) / p.queue_sample_s)
        totals[Api.DEPTH] = samples * len(queue_depth.SAMPLED)
    if Api.SEND_NEXT in totals:
        per_call = entries_per_call(p.processes, p.seconds_per_task, SEND_LINGER_S)
        totals[Api.SEND_NEXT] /= per_call
    out = []
    for api in (a for a in Api if a in totals):
        total, tier = totals[api], tier_of(api, p.next_stage)
        per_task = total / p.tasks if p.tasks else 0.0
        cost = total * p.prices.per_request(tier)
        out.append(Request(api.service, api.value, per_task, total, tier, cost))
    return tuple(out)


def validate(p: PlanInput) -> None:
    checks = [
        (p.tasks >= 0, "tasks must be 0 or more"),
        (p.seconds_per_task > 0, "seconds per task must be above 0"),
        (p.processes >= 1 and p.prefetch >= 1, "processes and prefetch must be at least 1"),
        (p.pods_max is None or p.pods_max >= 1, "pods max must be at least 1"),
        (p.deadline_s is None or p.deadline_s > 0, "the deadline must be above 0"),
        (0 < p.heartbeat_s < p.visibility_timeout_s, "heartbeat must be below the visibility"),
        (
            min(p.wait_time_s, p.idle_s, p.queue_sample_s) >= 0,
            "wait time, idle time and queue sample interval must be 0 or more",
        ),
    ]
    for per_call in (p.messages_per_receive, p.messages_per_delete):
        if per_call is not None:
            checks.append((1 <= per_call <= SQS_BATCH_MAX, "messages per call: 1 to at most 10"))
    for ok, problem in checks:
        if not ok:
            raise PlanError(problem)


def make_plan(p: PlanInput) -> Plan:
    validate(p)
    pods, needed, meets = _fleet(p)
    per_wave = p.processes * pods
    waves = math.ceil(p.tasks / per_wave)
    wall_s = waves * p.seconds_per_task
    extensions = visibility_calls(p, pods)[0]
    requests = _requests(p, pods, wall_s)
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
        keda_max_replicas=pods,
        hold_s=_hold_s(p, p.prefetch),
        extensions_per_task=extensions / p.tasks if p.tasks else 0.0,
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
        ("KEDA maxReplicas", f"{plan.keda_max_replicas:,} (set keda.maxReplicas to it, at least)"),
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
BORROWED = (
    "processes",
    "prefetch",
    "max_prefetch",
    "visibility_timeout_s",
    "heartbeat_s",
    "wait_time_s",
    "always_head_output",
    "queue_sample_s",
)
SIZED_BY = ("max_input_bytes", "max_decoded_bytes", "model_path", "model_dir", "max_model_bytes")
_NOTES = {
    "processes": "per pod, required here",
    "prefetch": "auto plans with where auto starts",
    "max_prefetch": "the pod is sized for it when prefetch is auto",
    "model_path": "an s3:// model is fetched into /tmp, which is sized for it",
    "wait_time_s": "the empty long polls of idle pods",
    "queue_sample_s": "each pod's reads of its queues' depth",
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
    chain = p.add_mutually_exclusive_group()
    chain.add_argument(
        "--next-stage",
        dest="next_stage",
        action="store_const",
        const=NextStage.STANDARD,
        default=NextStage.NONE,
        help="the stage hands its outputs on to a standard queue (a chain marker each)",
    )
    chain.add_argument(
        "--next-stage-fifo",
        dest="next_stage",
        action="store_const",
        const=NextStage.FIFO,
        help="the stage hands its outputs on to a FIFO queue (no marker; FIFO prices)",
    )
    p.add_argument(
        "--no-enqueue",
        action="store_true",
        help="the stage is fed by a previous stage, not by sqsinfer enqueue",
    )
    p.add_argument(
        "--idle-s",
        type=float,
        default=IDLE_S,
        help=f"how long a pod idles after its last task before it is gone ({IDLE_S:g}: the "
        "chart's scale-down; job mode: worker.exit_when_idle_s)",
    )
    p.add_argument("--messages-per-receive", type=float, help="1-10 (default: the worker's)")
    p.add_argument("--messages-per-delete", type=float, help="1-10 (default: the worker's)")
    p.add_argument("--sqs-price-per-million", type=float, default=SQS_PER_MILLION)
    p.add_argument("--sqs-fifo-price-per-million", type=float, default=SQS_FIFO_PER_MILLION)
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
        always_head_output=args.always_head_output,
        wait_time_s=args.wait_time_s,
        queue_sample_s=args.queue_sample_s,
        idle_s=args.idle_s,
        messages_per_receive=args.messages_per_receive,
        messages_per_delete=args.messages_per_delete,
        prices=Prices(
            args.sqs_price_per_million,
            args.s3_put_price_per_1000,
            args.s3_get_price_per_1000,
            args.sqs_fifo_price_per_million,
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
