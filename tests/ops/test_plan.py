"""`sqsinfer plan`: the arithmetic against cases computed by hand, against the calls a
fleet of real workers makes on the stand-in, and the command."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from sqsinfer import cli
from sqsinfer.lab import counting, standin, synthetic
from sqsinfer.ops.plan import (
    Api,
    NextStage,
    PlanError,
    PlanInput,
    Prices,
    delivery_requests,
    make_plan,
    visibility_calls,
)
from sqsinfer.worker.lifecycle import Worker
from sqsinfer.worker.visibility import expected_extensions, extension_every_ticks
from tests.conftest import Stage, make_stage, running, stage_settings

SEED = 15_800_000
DAY_S = 86_400


def _request(plan, api: Api):
    (found,) = [r for r in plan.requests if r.api == api.value]
    return found


def test_seed_case_at_45_s_meets_48_h_with_515_pods():
    plan = make_plan(
        PlanInput(SEED, 45.0, processes=8, deadline_s=2 * DAY_S, pods_max=1000),
    )
    # a process does floor(172800 / 45) = 3840 tasks by the deadline; 8 × 3840 per pod
    assert plan.pods_needed == plan.pods == plan.keda_max_replicas == 515  # ceil(514.32)
    assert plan.meets_deadline is True
    assert plan.waves == 3835  # ceil(15.8M / (8 × 515)) = ceil(3834.95)
    assert plan.wall_s == 3835 * 45 == 172_575
    assert plan.tasks_per_s == pytest.approx(8 * 515 / 45)
    assert plan.process_hours == pytest.approx(197_500)  # 15.8M × 45 / 3600
    assert plan.pod_hours == pytest.approx(515 * 172_575 / 3600)
    assert plan.queue_length == 16
    # Held 2 × 45 = 90 s. The first extension comes at the first tick (every 20 s) after
    # 60 − 2 × 20 = 20 s held, so at an age in (20, 40]; the next two ticks later, in
    # (60, 80]; a third would be at (100, 120], past 90: 2 each. A pod's first 8 are
    # held 45 s: 1 each (the first at (20, 40], the second past 45).
    assert plan.hold_s == 90
    extensions = SEED * 2 - 515 * 8 * (2 - 1)
    assert plan.extensions_per_task == pytest.approx(extensions / SEED)
    # 2 × 8 / 45 × 20 = 7.1 due per tick per pod: one call at every tick (20 s) of a pod
    # from its first messages' first extension to its last message's last: that message
    # is received once all but the pod's last 16 of its 30,680 tasks are done (8 at a
    # time, 45 s each), and extended a second time 40 s after its first
    busy_s = (SEED / 515 - 16) * 45 / 8 + 40
    calls = 515 * (1 + busy_s / 20)
    assert _request(plan, Api.EXTEND).total == pytest.approx(calls)  # 4,442,978
    # 16 held: two receives fill a pod (10 + 6), then one per 4 freed (a quarter of 16)
    receives = 515 * 2 + (SEED - 515 * 16) / 4
    assert _request(plan, Api.RECEIVE).total == pytest.approx(receives)  # 3,948,970
    # idle: each pod long-polls (20 s) while its last 90 s of messages finish, then 480 s
    assert _request(plan, Api.RECEIVE_IDLE).total == pytest.approx(515 * (90 + 480) / 20)
    # a delete waits 50 ms for the pod's 7 other processes, one finishing every 45 s each
    deletes = SEED / (1 + 7 * 0.05 / 45)
    assert _request(plan, Api.DELETE).total == pytest.approx(deletes)  # 15,678,060
    apis = [r.api for r in plan.requests]
    assert Api.HEAD.value not in apis  # a first delivery goes straight to the work
    assert plan.s3_requests == pytest.approx(SEED * 2)  # GET and PUT
    # each pod reads its queue's and its DLQ's depth once a minute while it lives
    depth = 515 * math.ceil((172_575 + 480) / 60) * 2
    assert _request(plan, Api.DEPTH).total == depth  # 2,971,550
    sqs = SEED / 10 + receives + 515 * 570 / 20 + deletes + calls + depth
    assert plan.sqs_requests == pytest.approx(sqs)
    s3_cost = SEED * 0.005 / 1000 + SEED * 0.0004 / 1000  # PUT $79 + GET $6.32
    assert plan.request_cost == pytest.approx(sqs * 0.40 / 1e6 + s3_cost)
    assert plan.request_cost == pytest.approx(96.775, abs=0.001)


def test_the_seeds_job_at_21_s_on_2_processes_in_72_h_needs_641_pods():
    plan = make_plan(PlanInput(SEED, 21.0, processes=2, deadline_s=3 * DAY_S))
    # floor(259200 / 21) = 12342 waves; ceil(15.8M / (2 × 12342)) = ceil(640.09) = 641
    assert plan.pods == plan.keda_max_replicas == 641
    assert plan.wall_s == math.ceil(SEED / (2 * 641)) * 21 == 12325 * 21  # 71.9 h
    # held 42 s: one extension at an age in (20, 40] (the next, at (60, 80], is past 42);
    # a pod's first 2 are held 21 s: extended when the tick falls in (20, 21], 1 in 20
    assert plan.extensions_per_task == pytest.approx((SEED - 641 * 2 * (1 - 0.05)) / SEED)
    # 2 / 21 × 20 = 1.9 due per tick per pod: one call at every tick of a pod's busy time
    calls = 641 * (1 + (SEED / 641 - 4) * 21 / 2 / 20)
    assert _request(plan, Api.EXTEND).total == pytest.approx(calls)  # 0.525 per task
    # 4 held: one receive fills a pod, then one per slot freed (a quarter of 4, at least 1)
    assert _request(plan, Api.RECEIVE).total == pytest.approx(641 + SEED - 641 * 4)
    assert _request(plan, Api.DELETE).per_task == pytest.approx(1 / (1 + 0.05 / 21))


def test_deadline_out_of_reach_runs_on_pods_max_and_says_so():
    plan = make_plan(PlanInput(SEED, 45.0, processes=8, deadline_s=2 * DAY_S, pods_max=400))
    assert plan.pods_needed == 515
    assert plan.pods == 400
    assert plan.meets_deadline is False
    assert plan.wall_s == math.ceil(SEED / 3200) * 45 == 4938 * 45  # 61.7 h


def test_no_deadline_gives_the_wall_time_of_the_fleet():
    plan = make_plan(PlanInput(1000, 3.0, processes=4, pods_max=10))
    assert (plan.pods, plan.pods_needed, plan.meets_deadline) == (10, None, None)
    assert plan.waves == 25  # 1000 / 40
    assert plan.wall_s == 75


def test_a_deadline_shorter_than_one_task_cannot_be_met():
    plan = make_plan(PlanInput(10, 45.0, processes=1, deadline_s=10))
    assert plan.pods_needed is None
    assert plan.meets_deadline is False


def test_short_tasks_need_no_visibility_extensions():
    plan = make_plan(PlanInput(100, 5.0, processes=4, pods_max=1))  # held 10 s: due after 20
    assert visibility_calls(PlanInput(100, 5.0, processes=4), pods=1) == (0.0, 0.0)
    assert _request(plan, Api.EXTEND).total == 0


def test_the_keepers_cadence():
    # The first extension at the first tick after visibility − 2 × heartbeat held; the
    # next when that extension's hold comes within two heartbeats of a tick: strictly,
    # and it holds from a moment at or after its tick, so one tick later than the ratio.
    assert extension_every_ticks(60, 20) == 2  # 20 s after: not yet; 40 s after: due
    assert extension_every_ticks(300, 20) == 14  # 260 / 20 = 13, so the 14th tick
    assert extension_every_ticks(70, 20) == 2  # 30 / 20 = 1.5: the 2nd tick
    assert extension_every_ticks(3, 1) == 2
    # visibility 300, heartbeat 20: first at an age in (260, 280], then every 280 s
    assert expected_extensions(400, 300, 20) == 1  # the second, (540, 560], is past 400
    assert expected_extensions(270, 300, 20) == pytest.approx(0.5)  # (260, 270] of 20
    assert expected_extensions(260, 300, 20) == 0
    assert expected_extensions(90, 60, 20) == 2  # (20, 40] and (60, 80]
    assert expected_extensions(70, 60, 20) == pytest.approx(1.5)  # the second: (60, 70]


def test_extensions_with_a_long_visibility():
    # visibility 300, heartbeat 20, held 400 s: one extension (above); a pod's first 4
    # are held 200 s: none. Due per tick: 1 × 4 / 200 × 20 = 0.4: a call each.
    p = PlanInput(100, 200.0, processes=4, prefetch=2, visibility_timeout_s=300)
    assert visibility_calls(p, pods=1) == (100 - 4, 100 - 4)
    one = PlanInput(100, 200.0, processes=4, prefetch=1, visibility_timeout_s=300)
    assert visibility_calls(one, pods=1) == (0.0, 0.0)  # held 200 s < 260 s


def test_a_standard_next_stage_costs_one_marker_and_a_send_per_task():
    p = PlanInput(1000, 1.0, processes=2, pods_max=1, next_stage=NextStage.STANDARD)
    plan = make_plan(dataclasses.replace(p, enqueue=False))
    apis = [r.api for r in plan.requests]
    assert Api.ENQUEUE.value not in apis
    assert _request(plan, Api.MARKER).total == 1000  # "sent", after the send
    # a send waits 20 ms for the pod's other process, which finishes once a second
    assert _request(plan, Api.SEND_NEXT).total == pytest.approx(1000 / (1 + 0.02 / 1))
    assert _request(plan, Api.SEND_NEXT).tier == "sqs"
    assert plan.s3_requests == 1000 * 3  # GET, PUT output, PUT marker


def test_a_fifo_next_stage_needs_no_marker_and_sends_at_fifo_prices():
    p = PlanInput(1000, 1.0, processes=2, pods_max=1, next_stage=NextStage.FIFO)
    plan = make_plan(p)
    assert Api.MARKER.value not in [r.api for r in plan.requests]
    send = _request(plan, Api.SEND_NEXT)
    assert send.tier == "sqs_fifo"
    assert send.cost == pytest.approx(send.total * 0.50 / 1e6)
    assert plan.s3_requests == 1000 * 2
    # the seed's job, chained: a standard next queue costs a marker PUT ($79) per 15.8M
    seed = PlanInput(SEED, 21.0, processes=2, deadline_s=3 * DAY_S)
    standard = make_plan(dataclasses.replace(seed, next_stage=NextStage.STANDARD))
    fifo = make_plan(dataclasses.replace(seed, next_stage=NextStage.FIFO))
    sends = _request(fifo, Api.SEND_NEXT).total
    assert standard.request_cost - fifo.request_cost == pytest.approx(79.0 - sends * 0.10 / 1e6)


def test_redeliveries_and_always_head_output_look_first():
    assert delivery_requests(NextStage.NONE, looked_first=False) == {Api.GET: 1, Api.PUT: 1}
    found = delivery_requests(NextStage.STANDARD, looked_first=True, output_found=True)
    assert found == {Api.HEAD: 1, Api.HEAD_MARKER: 1}  # the link recorded as sent
    again = delivery_requests(NextStage.FIFO, looked_first=True, output_found=True)
    assert again == {Api.HEAD: 1, Api.SEND_NEXT: 1}  # dropped by SQS's deduplication
    plan = make_plan(PlanInput(1000, 1.0, processes=2, pods_max=1, always_head_output=True))
    assert _request(plan, Api.HEAD).total == 1000


def test_prices_and_batching_are_overridable():
    prices = Prices(sqs_per_million=1.0, s3_put_per_1000=0.01, s3_get_per_1000=0.001)
    plan = make_plan(
        PlanInput(
            1_000_000,
            1.0,
            processes=10,
            pods_max=10,
            messages_per_receive=10,
            messages_per_delete=5,
            prices=prices,
            pod_hour_price=2.0,
            idle_s=0,
            wait_time_s=0,
            queue_sample_s=0,
        )
    )
    assert _request(plan, Api.RECEIVE).total == 100_000
    assert _request(plan, Api.DELETE).total == 200_000
    assert plan.sqs_requests == pytest.approx(100_000 + 100_000 + 200_000)
    expected = 400_000 * 1.0 / 1e6 + 1e6 * 0.01 / 1e3 + 1e6 * 0.001 / 1e3
    assert plan.request_cost == pytest.approx(expected)
    assert plan.compute_cost == pytest.approx(10 * 10_000 / 3600 * 2.0)  # 10 pods, 10,000 s


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"pods_max": None}, "deadline"),
        ({"heartbeat_s": 60.0}, "heartbeat"),
        ({"messages_per_receive": 11}, "at most 10"),
        ({"seconds_per_task": 0}, "seconds"),
        ({"idle_s": -1}, "idle"),
    ],
)
def test_invalid_inputs_are_refused(changes, problem):
    values = {"tasks": 10, "seconds_per_task": 1.0, "processes": 1, "pods_max": 1} | changes
    with pytest.raises(PlanError, match=problem):
        make_plan(PlanInput(**values))


def test_command_reads_seconds_from_a_bench_json(tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"scenarios": {"sqsinfer": {"seconds_per_task": 21.0}}}))
    argv = ["plan", "--tasks", "15.8M", "--from-bench", str(bench), "--processes", "8"]
    code = cli.main([*argv, "--deadline-h", "48", "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["input"]["seconds_per_task"] == 21.0
    assert doc["input"]["tasks"] == SEED
    assert doc["pods"] == doc["keda_max_replicas"] == 241
    assert doc["queue_length"] == 16


def test_command_table_and_exit_status(capsys):
    base = ["plan", "--tasks", "15.8M", "--seconds-per-task", "45", "--processes", "8"]
    assert cli.main([*base, "--deadline-h", "48"]) == 0
    out = capsys.readouterr().out
    assert "515" in out and "KEDA queueLength" in out and "$96.77" in out
    assert "KEDA maxReplicas" in out and "keda.maxReplicas" in out
    assert cli.main([*base, "--deadline-h", "48", "--pods-max", "400"]) == 1
    assert "cannot be met" in capsys.readouterr().err


def test_command_usage_errors(tmp_path, capsys):
    base = ["plan", "--tasks", "100", "--processes", "2", "--pods-max", "1"]
    assert cli.main(base) == 2  # neither seconds nor bench
    assert "--seconds-per-task or --from-bench" in capsys.readouterr().err
    (tmp_path / "b.json").write_text('{"scenarios": {"other": {}}}')
    assert cli.main([*base, "--from-bench", str(tmp_path / "b.json")]) == 2
    assert "scenarios.sqsinfer.seconds_per_task" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["plan", "--tasks", "1.5", "--seconds-per-task", "1", "--processes", "1"])


@pytest.mark.parametrize("command", ["enqueue", "status", "redrive", "plan"])
def test_every_operator_command_has_help_with_examples(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"sqsinfer {command} " in out


# -- Output into a pipe its reader closed early (`| head -1`, `| true`) -----------------
PLAN_ARGS = ["plan", "--tasks", "15.8M", "--seconds-per-task", "45", "--processes", "8"]


def into_closed_pipe(argv: list[str], lines_read: int) -> tuple[int, str, list[bytes]]:
    """Run `sqsinfer argv` with stdout into a real pipe whose reader closes after reading
    `lines_read` lines (0: before the command writes anything)."""
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sqsinfer", *argv], stdout=write_fd, stderr=subprocess.PIPE
    )
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as reader:
        lines = [reader.readline() for _ in range(lines_read)]
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err.decode(), lines


@pytest.mark.parametrize("lines_read", [0, 1])
@pytest.mark.parametrize("output", [["--json"], []], ids=["json", "table"])
def test_plan_into_a_closed_pipe_exits_quietly(output: list[str], lines_read: int):
    code, err, lines = into_closed_pipe([*PLAN_ARGS, "--deadline-h", "48", *output], lines_read)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert err == ""
    assert code in (0, 1)  # 0 when the reader took all of it before closing
    if lines_read:
        assert lines[0].strip() in (b"{", b"fleet")


def test_status_watch_into_a_closed_pipe_exits_quietly(stage: Stage):
    argv = ["status", "--queue-url", stage.queue_url, "--endpoint-url", stage.endpoint]
    argv += ["--watch", "--interval-s", "0.1", "--count", "50", "--json"]
    code, err, lines = into_closed_pipe(argv, lines_read=1)
    assert json.loads(lines[0])["queues"]  # one refresh read, the next write fails
    assert (code, err) == (1, "")


def test_redrive_into_a_closed_pipe_moves_and_exits_quietly(stage: Stage):
    for i in range(3):
        stage.send({"task_id": f"t{i}", "input": f"s3://{stage.bucket}/in/t{i}.npy"}, stage.dlq_url)
    argv = ["redrive", "--queue-url", stage.queue_url, "--endpoint-url", stage.endpoint]
    code, err, _ = into_closed_pipe([*argv, "--wait-time-s", "0", "--json"], lines_read=0)
    assert (code, err) == (1, "")
    assert stage.counts(stage.queue_url)[0] == 3  # the work was done; only its report was lost


# -- against real workers ----------------------------------------------------------------
# What the stand-in counts, by operation and target, as the plan names it.
PLAN_API = {
    ("s3", "HeadObject", ".npy"): Api.HEAD,
    ("s3", "GetObject", ".npy"): Api.GET,
    ("s3", "PutObject", ".npy"): Api.PUT,
    ("s3", "PutObject", ".chain"): Api.MARKER,
    ("s3", "HeadObject", ".chain"): Api.HEAD_MARKER,
    ("sqs", "ReceiveMessage", "standard"): Api.RECEIVE,
    ("sqs", "DeleteMessageBatch", "standard"): Api.DELETE,
    ("sqs", "ChangeMessageVisibilityBatch", "standard"): Api.EXTEND,
    ("sqs", "SendMessageBatch", "standard"): Api.SEND_NEXT,
}
FLEET = 6  # workers of one process each: no two of a worker's deletes or sends share a call
FLEET_TASKS = 120
TASK_S = 1.05  # each task sleeps this long (tests.handlers.ScriptedHandler)


@pytest.fixture(scope="module")
def counted() -> Iterator[standin.MotoServer]:
    """A stand-in with a second port: the workers' calls are counted apart from the test's."""
    standin.use_fake_credentials()
    with standin.moto_server(more_endpoints=1) as server:
        yield server


def _fleet_plan(seconds_per_task: float) -> PlanInput:
    """The fleet below as the plan sees it. Held 4 × about 1.05 s, under a 5 s visibility
    and a 1.5 s heartbeat: one extension each, at an age in (2, 3.5] (the next would be at
    (5, 6.5]), and about one message due at each tick of a worker (1 / 1.05 × 1.5)."""
    return PlanInput(
        FLEET_TASKS,
        seconds_per_task,
        processes=1,
        prefetch=4,
        pods_max=FLEET,
        visibility_timeout_s=5,
        heartbeat_s=1.5,
        next_stage=NextStage.STANDARD,
        enqueue=False,
        wait_time_s=20,
    )


class Commits:
    """When each worker's first and last commits happened (looked at every 20 ms): its
    seconds per task as `sqsinfer bench` gives them to the plan, processes ÷ tasks/s,
    whatever a loaded machine adds between one task and the next."""

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers
        self.seen = [(0, 0.0, 0.0)] * len(workers)  # (commits, first at, last at)

    def look(self) -> int:
        now = time.monotonic()
        for i, worker in enumerate(self.workers):
            count, first, _ = self.seen[i]
            new = worker.metrics.outcomes["committed"]
            if new != count:
                self.seen[i] = (new, first or now, now)
        return sum(count for count, _, _ in self.seen)

    async def wait_for(self, tasks: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.look() < tasks:
            assert time.monotonic() < deadline, f"{self.look()} of {tasks} committed"
            await asyncio.sleep(0.02)

    def seconds_per_task(self) -> float:
        """The fleet's: each worker's time from its first commit to its last, per task."""
        spans = [(last - first, count - 1) for count, first, last in self.seen if count > 1]
        return sum(s for s, _ in spans) / sum(n for _, n in spans)


async def test_a_fleet_of_workers_makes_the_calls_the_plan_counts(
    counted: standin.MotoServer, model_path: str
):
    stage = make_stage(counted.url)
    rows = np.ones((2, 3), dtype=np.float32)
    rows[0, 0] = TASK_S
    uri = stage.put_input("sleep.npy", synthetic.encode_input(rows, "npy"))
    for first in range(0, FLEET_TASKS, 10):
        entries = [
            {"Id": str(i), "MessageBody": json.dumps({"task_id": f"t{i}", "input": uri})}
            for i in range(first, first + 10)
        ]
        stage.sqs.send_message_batch(QueueUrl=stage.queue_url, Entries=entries)
    port = int(counted.endpoints[0].rsplit(":", 1)[1])
    settings = stage_settings(
        stage,
        model_path,
        endpoint_url=counted.endpoints[0],
        handler="tests.handlers:ScriptedHandler",
        next_queue_url=stage.next_url,
        prefetch=4,
        visibility_timeout_s=5,
        heartbeat_s=1.5,
        wait_time_s=20,  # the idle pods' empty polls are still open when the count is read
    )
    before = counted.request_counts()
    async with contextlib.AsyncExitStack() as stack:
        workers = await asyncio.gather(
            *(stack.enter_async_context(running(settings)) for _ in range(FLEET))
        )
        commits = Commits(workers)
        await commits.wait_for(FLEET_TASKS, timeout_s=120)
        served = counting.difference(before, counted.request_counts())
        for worker in workers:
            worker.stop()  # and again on the way out: no wait for the open long polls
    made = {api: 0 for api in Api}
    for kind, n in served.items():
        if kind.port == port and (kind.service, kind.operation, kind.target) in PLAN_API:
            made[PLAN_API[kind.service, kind.operation, kind.target]] += n.requests
    # A message whose visibility lapsed on a loaded machine is delivered again: that
    # delivery looks first (HEAD). None is planned, each is counted. A redelivery that
    # looked while the first was still computing finds nothing, computes, meets the first's
    # output with its own put (412) and looks again, whose it is: a second HEAD.
    deliveries = sum(sum(w.metrics.outcomes.values()) for w in workers)
    again = deliveries - FLEET_TASKS
    assert again <= made[Api.HEAD] <= 2 * again
    assert made[Api.HEAD_MARKER] <= again
    seconds_per_task = commits.seconds_per_task()
    assert 0.95 * TASK_S < seconds_per_task < 2 * TASK_S  # (commits seen every 20 ms)
    planned = make_plan(_fleet_plan(seconds_per_task)).totals()
    for api in (Api.RECEIVE, Api.DELETE, Api.EXTEND, Api.SEND_NEXT, Api.GET, Api.PUT):
        assert made[api] == pytest.approx(planned[api.value], rel=0.05), (api, made, planned)
    assert made[Api.MARKER] == FLEET_TASKS == planned[Api.MARKER.value]
