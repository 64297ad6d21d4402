"""`sqsinfer plan`: the arithmetic against cases computed by hand, and the command."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from sqsinfer import cli
from sqsinfer.ops.plan import PlanError, PlanInput, Prices, make_plan, visibility_extensions
from tests.conftest import Stage

SEED = 15_800_000
DAY_S = 86_400


def _request(plan, api_start: str):
    (found,) = [r for r in plan.requests if r.api.startswith(api_start)]
    return found


def test_seed_case_at_45_s_meets_48_h_with_515_pods():
    plan = make_plan(
        PlanInput(SEED, 45.0, processes=8, deadline_s=2 * DAY_S, pods_max=1000),
    )
    # a process does floor(172800 / 45) = 3840 tasks by the deadline; 8 × 3840 per pod
    assert plan.pods_needed == plan.pods == 515  # ceil(15.8M / 30720) = ceil(514.32)
    assert plan.meets_deadline is True
    assert plan.waves == 3835  # ceil(15.8M / (8 × 515)) = ceil(3834.95)
    assert plan.wall_s == 3835 * 45 == 172_575
    assert plan.tasks_per_s == pytest.approx(8 * 515 / 45)
    assert plan.process_hours == pytest.approx(197_500)  # 15.8M × 45 / 3600
    assert plan.pod_hours == pytest.approx(515 * 172_575 / 3600)
    assert plan.queue_length == 16
    # held 2 × 45 = 90 s; extended after 60 − 2×20 = 20 s, then every 20 s: 70/20 = 3.5
    assert plan.hold_s == 90
    assert plan.extensions_per_task == pytest.approx(3.5)
    # due per tick per pod 16 × 70/90 = 12.44 → 2 calls a tick: 3.5 × 2 / 12.44 = 0.5625
    assert _request(plan, "ChangeMessageVisibilityBatch").per_task == pytest.approx(0.5625)
    assert plan.sqs_requests == pytest.approx(SEED * (0.1 + 1 + 1 + 0.5625))  # 42,067,500
    assert plan.s3_requests == pytest.approx(SEED * 3)
    sqs_cost = 42_067_500 * 0.40 / 1e6  # $16.83
    s3_cost = SEED * 0.005 / 1000 + 2 * SEED * 0.0004 / 1000  # PUT $79 + GET/HEAD $12.64
    assert plan.request_cost == pytest.approx(sqs_cost + s3_cost)
    assert plan.request_cost == pytest.approx(108.467)


def test_seed_case_at_21_s_needs_241_pods():
    plan = make_plan(PlanInput(SEED, 21.0, processes=8, deadline_s=2 * DAY_S, pods_max=1000))
    # floor(172800 / 21) = 8228 waves; ceil(15.8M / (8 × 8228)) = ceil(240.03) = 241
    assert plan.pods == 241
    assert plan.wall_s == math.ceil(SEED / (8 * 241)) * 21 == 8196 * 21  # 15.8M / 1928 = 8195.02
    # held 42 s: (42 − 20) / 20 = 1.1 extensions; due 16 × 22/42 = 8.38 → one call a tick
    assert plan.extensions_per_task == pytest.approx(1.1)
    calls = _request(plan, "ChangeMessageVisibilityBatch").per_task
    assert calls == pytest.approx(1.1 / (16 * 22 / 42))


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
    p = PlanInput(100, 5.0, processes=4)  # held 10 s, extended only after 20 s
    assert visibility_extensions(p) == (0.0, 0.0)


def test_extensions_with_a_long_visibility():
    # visibility 300, heartbeat 20: first after 260 s, then every 20 × ceil(260/20) = 260 s
    p = PlanInput(100, 200.0, processes=4, prefetch=2, visibility_timeout_s=300)
    extensions, calls = visibility_extensions(p)
    assert extensions == pytest.approx(140 / 260)  # held 400 s
    due = 8 * 140 / 400  # 2.8 messages due per tick per pod: one call
    assert calls == pytest.approx(extensions / due)
    one = PlanInput(100, 200.0, processes=4, prefetch=1, visibility_timeout_s=300)
    assert visibility_extensions(one) == (0.0, 0.0)  # held 200 s < 260 s


def test_chained_stage_fed_by_the_previous_one():
    plan = make_plan(PlanInput(1000, 1.0, processes=2, pods_max=1, next_stage=True, enqueue=False))
    apis = [r.api for r in plan.requests]
    assert "SendMessageBatch (enqueue)" not in apis
    assert _request(plan, "SendMessage (next").total == 1000
    assert _request(plan, "PutObject (chain").total == 2000  # the intent, then "sent"
    assert plan.sqs_requests == 1000 * 3  # receive, delete, next-stage send
    assert plan.s3_requests == 1000 * 5  # HEAD, GET, PUT output, two PUTs of the marker


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
        )
    )
    assert _request(plan, "ReceiveMessage").total == 100_000
    assert _request(plan, "DeleteMessageBatch").total == 200_000
    assert plan.sqs_requests == pytest.approx(100_000 + 100_000 + 200_000)
    expected = 400_000 * 1.0 / 1e6 + 1e6 * 0.01 / 1e3 + 2e6 * 0.001 / 1e3
    assert plan.request_cost == pytest.approx(expected)
    assert plan.compute_cost == pytest.approx(10 * 10_000 / 3600 * 2.0)  # 10 pods, 10,000 s


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"pods_max": None}, "deadline"),
        ({"heartbeat_s": 60.0}, "heartbeat"),
        ({"messages_per_receive": 11}, "at most 10"),
        ({"seconds_per_task": 0}, "seconds"),
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
    assert doc["pods"] == 241
    assert doc["queue_length"] == 16


def test_command_table_and_exit_status(capsys):
    base = ["plan", "--tasks", "15.8M", "--seconds-per-task", "45", "--processes", "8"]
    assert cli.main([*base, "--deadline-h", "48"]) == 0
    out = capsys.readouterr().out
    assert "515" in out and "KEDA queueLength" in out and "$108.47" in out
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
