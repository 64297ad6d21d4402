"""The fleet simulator against hand calculations: small fleets whose every event can be
worked out on paper (the AWS latencies are the `aws` profile's medians: a receive 10 ms,
a GET 25 ms, a HEAD 15 ms, a PUT 35 ms)."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from typing import Any

import pytest

import proving
from proving.fleetsim import command, keda
from proving.fleetsim.engine import DRAINING, GONE, INDEX, READY, Rate, Simulation
from proving.fleetsim.model import Aws, FleetConfig, Keda, Pods, TaskTimes, WorkerSettings
from sqsinfer.limits import S3_PUT_PER_S_PER_PREFIX
from sqsinfer.ops.plan import Api
from sqsinfer.worker.visibility import expected_extensions

RECEIVE_S, GET_S, HEAD_S, PUT_S = 0.010, 0.025, 0.015, 0.035


def fleet(tasks: int, seconds: float, **changes: Any) -> FleetConfig:
    """`tasks` of `seconds` each (fixed) on one warm pod of 2 processes, prefetch 2."""
    worker = WorkerSettings(processes=2, prefetch=2)
    cfg = FleetConfig(
        tasks=tasks,
        times=TaskTimes(seconds, spread=0.0),
        worker=worker,
        keda=Keda(queue_length=4, max_replicas=1),
    )
    for name, value in changes.items():
        part = {"worker": cfg.worker, "keda": cfg.keda, "pods": cfg.pods, "aws": cfg.aws}.get(name)
        cfg = dataclasses.replace(cfg, **{name: value if part is None else value(part)})
    return cfg


def calls(sim: Simulation, api: Api) -> float:
    return sim.out.calls[INDEX[api]]


def test_one_pod_in_step_runs_its_tasks_back_to_back():
    sim = Simulation(fleet(40, 10.0))
    out = sim.run()
    # The first receive (at 0) takes 4 messages: GET done at 0.010 + 0.025; both processes
    # start then, and each takes the next prefetched message as it finishes: 20 tasks of
    # 10 s each, the last computed at 0.035 + 200 and written 0.035 later.
    assert out.done == 40
    assert out.last_task_at == pytest.approx(RECEIVE_S + GET_S + 200 + PUT_S)
    # A slot freed per task refills it: one receive per task after the first four.
    assert calls(sim, Api.RECEIVE) == 1 + 36
    # Fixed times keep the two processes in step: their deletes always share a call.
    assert calls(sim, Api.DELETE) == 20
    assert calls(sim, Api.GET) == calls(sim, Api.PUT) == 40
    assert calls(sim, Api.HEAD) == 0  # first deliveries go straight to the work
    # Held 20 s (10 waiting, 10 computing): the first extension is due only once a message
    # has been held 60 − 2 × 20 = 20 s and a tick comes after that.
    assert out.extensions == calls(sim, Api.EXTEND) == 0
    assert out.recomputed == out.lost == sim.queue.dead_lettered == 0


def test_the_keeper_extends_at_its_cadence():
    # One process, prefetch 1, 50 s tasks. Ticks every 20 s from the pod's start (0).
    # Task 1, received at 0.010 (held until 60.010), is due at the first tick before which
    # its hold ends within two heartbeats: 40 (60.010 < 80); extended to 100, it would be
    # due again at 80 (100 < 120) but is done at 50.035. Task 2, received at
    # 50.035 + 0.035 (its commit) + 0.010: extended at 80, done at 100.105. One each.
    cfg = fleet(5, 50.0, worker=lambda w: dataclasses.replace(w, processes=1, prefetch=1))
    sim = Simulation(cfg)
    out = sim.run()
    assert expected_extensions(50.0, 60, 20) == 1
    assert out.extensions == calls(sim, Api.EXTEND) == 5
    assert out.last_task_at == pytest.approx(5 * (RECEIVE_S + GET_S + 50 + PUT_S))


def test_a_killed_pods_messages_come_back_when_their_visibility_lapses():
    cfg = fleet(1, 100.0, worker=lambda w: dataclasses.replace(w, processes=1, prefetch=1))
    sim = Simulation(cfg)
    sim.at(50.0, lambda *_: sim._kill(sim.pods[0], None))
    out = sim.run()
    # Received at 0.010 (held until 60.010), extended at the tick at 40 to 100; killed at
    # 50. The new pod is ready at 50 + 30 + 15 = 95 and long-polls; the message is visible
    # at 100, received at once: its second delivery looks first (HEAD), fetches, computes.
    assert out.kills == 1
    assert out.recomputed == 1
    assert out.wasted_s == pytest.approx(50 - 0.035)
    assert calls(sim, Api.HEAD) == 1
    assert calls(sim, Api.GET) == 2
    assert calls(sim, Api.PUT) == 1
    assert out.done == 1
    assert out.last_task_at == pytest.approx(100 + RECEIVE_S + HEAD_S + GET_S + 100 + PUT_S)


def test_a_message_received_max_receive_count_times_goes_to_the_dlq():
    cfg = fleet(
        1,
        100.0,
        worker=lambda w: dataclasses.replace(w, processes=1, prefetch=1),
        aws=lambda a: dataclasses.replace(a, max_receive_count=2),
    )
    sim = Simulation(cfg)
    sim.at(50.0, lambda *_: sim._kill(sim.pods[0], None))
    sim.at(150.0, lambda *_: sim._kill(sim.pods[1], None))  # its second delivery too
    out = sim.run()
    # Received twice: the redrive policy (maxReceiveCount 2) moves it on the third receive.
    assert out.kills == 2
    assert sim.queue.dead_lettered == 1
    assert out.done == out.lost == 0


def test_a_scale_in_cuts_a_task_longer_than_the_drain():
    # Two warm pods; at 10 s one is told to stop: its unstarted messages go back at once,
    # its started tasks may run 70 s (task_time_s 60 + 10): 100 s tasks are cut at 80.
    cfg = fleet(4, 100.0, keda=lambda k: dataclasses.replace(k, min_replicas=2, max_replicas=2))
    sim = Simulation(cfg)
    sim.at(10.0, lambda *_: sim._drain(sim.pods[0]))
    out = sim.run()
    assert out.scale_in_kills == 2  # both of its processes were computing
    assert out.wasted_s == pytest.approx(2 * (80 - 0.035))
    assert out.recomputed == 2
    assert out.done == 4


@pytest.mark.parametrize("cost", [False, True])
def test_a_scale_in_takes_idle_pods_first_with_the_deletion_cost(cost):
    # Two pods ready together; the first takes the one task, the second idles. A scale-in
    # to one removes the first of the newest (a tie: the first), unless the pods keep
    # their deletion cost: then the idle one.
    cfg = fleet(
        1,
        10.0,
        keda=lambda k: dataclasses.replace(k, min_replicas=2, max_replicas=2),
        worker=lambda w: dataclasses.replace(w, pod_deletion_cost=cost),
    )
    sim = Simulation(cfg)
    states: list[tuple[int, ...]] = []
    sim.at(5.0, lambda *_: sim._scale_to(1))
    sim.at(5.0, lambda *_: states.append(tuple(p.state for p in sim.pods[:2])))
    sim.run()
    busy, idle = sim.pods[0], sim.pods[1]
    assert busy.taken == 1 and idle.taken == 0
    if cost:  # the idle one goes at once, the busy one keeps its task
        assert states == [(READY, GONE)]
    else:  # the busy one drains (its task finishes within the drain), the idle one stays
        assert states == [(DRAINING, READY)]


def test_the_hpa_doubles_a_minute_or_adds_four_whichever_is_more():
    hpa = keda.Hpa(Keda(queue_length=4, max_replicas=100))
    replicas, seen = 1, []
    for now in range(0, 241, 15):
        replicas = hpa.replicas(float(now), replicas, metric=1e6)
        seen.append(replicas)
    # 1 → 5 (one more pod than doubling), held for the minute; → 10 → 20 → 40.
    assert seen[0] == 5
    assert seen[3] == 5 and seen[4] == 10
    assert seen[8] == 20 and seen[12] == 40 and seen[16] == 80


def test_the_hpa_waits_out_its_window_then_removes_a_quarter_a_minute():
    hpa = keda.Hpa(Keda(queue_length=4, max_replicas=100))
    hpa.replicas(0.0, 80, metric=320)  # 80 wanted: the window remembers it
    assert hpa.replicas(15.0, 80, metric=0) == 80
    assert hpa.replicas(285.0, 80, metric=0) == 80  # the desire at 0 is still in the window
    assert hpa.replicas(300.0, 80, metric=0) == 60  # out of it (300 s ago): int(80 × 0.75)
    assert hpa.replicas(315.0, 60, metric=0) == 60  # from 80 at the period's start: 60
    assert hpa.replicas(360.0, 60, metric=0) == 45  # a minute after the first step


def test_a_scaled_job_starts_what_the_queue_asks_less_what_runs():
    k = Keda(queue_length=4, max_replicas=10, mode="job")
    assert keda.jobs_to_start(k, metric=100, running=0) == 10  # at most max
    assert keda.jobs_to_start(k, metric=13, running=2) == 2  # ceil(13 / 4) − 2
    assert keda.jobs_to_start(k, metric=0, running=3) == 0


def test_job_mode_jobs_end_once_idle_and_nothing_is_scaled_in():
    cfg = fleet(
        200,
        10.0,
        keda=lambda k: dataclasses.replace(k, mode="job", max_replicas=5),
        worker=lambda w: dataclasses.replace(w, exit_when_idle_s=60.0),
    )
    sim = Simulation(cfg)
    out = sim.run()
    # Five Jobs at the first poll (ceil(200 / 4) ≥ 5), each ready at 45 s: 20 waves of 10 s.
    assert len(sim.pods) == out.peak_pods == 5
    assert out.last_task_at == pytest.approx(45 + RECEIVE_S + GET_S + 200 + PUT_S)
    assert out.scale_ins == out.scale_in_kills == 0
    # Each worker exits once it held nothing and found its queue empty 60 s after its last
    # task: its long polls after the commit wait 20, 20, then the 20 s left (the worker's
    # `receive_wait_s`).
    for pod in sim.pods:
        assert pod.gone_at == pytest.approx(pod.last_activity + PUT_S + 60)
    # Each read its queues' depth (two calls) every minute from its start.
    samples = sum(math.ceil((p.gone_at - p.ready_at) / 60) for p in sim.pods)
    assert calls(sim, Api.DEPTH) == 2 * samples


def test_a_job_bounded_by_max_tasks_takes_no_more():
    cfg = fleet(
        20,
        10.0,
        keda=lambda k: dataclasses.replace(k, mode="job", max_replicas=2),
        worker=lambda w: dataclasses.replace(w, max_tasks=6, exit_when_idle_s=60.0),
    )
    sim = Simulation(cfg)
    out = sim.run()
    # Two Jobs take 6 each (a receive of 4, then of the 2 left); KEDA starts no more while
    # they run (8 visible: ceil(8 / 4) = 2, less the 2 running). Once they end, two more
    # split the 8: each fills its 4 slots, and the queue is empty.
    assert out.done == 20
    assert [p.taken for p in sim.pods] == [6, 6, 4, 4]


def test_s3_slows_a_fleet_down_to_a_prefixs_rate():
    rate = Rate(2)
    assert [rate.take(5.1), rate.take(5.5), rate.take(5.9), rate.take(6.0)] == [
        True,
        True,
        False,
        True,
    ]
    assert rate.take(5.95) is False  # a second already spent, looked at late

    def warm(pods: int, prefixes: int) -> FleetConfig:
        return fleet(
            40_000,
            0.2,
            worker=lambda w: dataclasses.replace(w, processes=8),
            keda=lambda k: dataclasses.replace(k, min_replicas=pods, max_replicas=pods),
            aws=lambda a: dataclasses.replace(a, s3_prefixes=prefixes),
        )

    # 100 pods of 8 processes could finish 4,000 tasks a second; one prefix takes 3,500 PUTs.
    one = Simulation(warm(100, 1))
    one.run()
    assert one.out.s3_slowdowns > 0
    # 3,500 a whole second: seconds 0 to 10 take 38,500, the last 1,500 go in second 11.
    assert 40_000 // S3_PUT_PER_S_PER_PREFIX == 11
    assert 11 <= one.out.last_task_at < 14
    # Eight prefixes take 28,000 a second: every process runs its 50 tasks back to back
    # (each pod's 8 in step, their next 8 received and fetched while they compute).
    eight = Simulation(warm(100, 8))
    eight.run()
    assert eight.out.s3_slowdowns == 0
    assert eight.out.last_task_at == pytest.approx(RECEIVE_S + GET_S + 50 * 0.2 + PUT_S)


def run_json(*argv: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "proving.fleetsim", *argv, "--json"],
        capture_output=True,
        text=True,
        check=True,
        env=proving.module_env(),
        timeout=120,
    )
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


SEED_SHAPE = ("--tasks", "150k", "--seconds-per-task", "21", "--deadline-h", "72")


def test_a_smaller_seed_job_agrees_with_its_plan():
    # The seed's job at a hundredth: 7 pods of 2 processes for 72 h.
    doc = run_json(*SEED_SHAPE, "--processes", "2")
    assert doc["plan"]["pods"] == doc["peak_pods"] == 7
    assert doc["tasks_done"] == 150_000 and doc["tasks_lost"] == 0
    compared = doc["simulated_over_planned"]
    assert compared["wall"] == pytest.approx(1.0, abs=0.15)
    for api, ratio in compared["requests"].items():
        assert ratio == pytest.approx(1.0, abs=0.05), api
    # Seeded: the same inputs give the same figures.
    again = run_json(*SEED_SHAPE, "--processes", "2")
    assert {k: v for k, v in again.items() if k != "runtime_s"} == {
        k: v for k, v in doc.items() if k != "runtime_s"
    }


def test_the_command_borrows_the_workers_settings_and_plots(tmp_path):
    plot = tmp_path / "fleet.png"
    argv = ["--tasks", "2000", "--seconds-per-task", "5", "--max-replicas", "4"]
    done = subprocess.run(
        [sys.executable, "-m", "proving.fleetsim", *argv, "--plot", str(plot)],
        capture_output=True,
        text=True,
        check=True,
        env=proving.module_env({"SQSINFER_PROCESSES": "3", "PATH": "/usr/bin:/bin"}),
        timeout=120,
    )
    assert "fleet: simulated and planned" in done.stdout
    assert plot.read_bytes().startswith(b"\x89PNG")
    doc = run_json(*argv, "--processes", "3", "--mode", "job", "--next-stage-fifo")
    assert doc["input"]["processes"] == 3 and doc["input"]["mode"] == "job"
    for key in ("simulated_wall_s", "tasks_lost", "duplicate_runs", "scale_in_kills"):
        assert key in doc
    assert doc["requests"][Api.SEND_NEXT.value] > 0
    assert Api.MARKER.value not in doc["requests"]  # a FIFO next stage: no marker
    assert doc["cost"]["requests"] == pytest.approx(doc["plan"]["request_cost"], rel=0.05)


def test_bad_input_is_refused_with_the_setting_named():
    args = command.parser().parse_args(["--tasks", "10", "--seconds-per-task", "1"])
    with pytest.raises(Exception, match="processes"):
        command.fleet_config(args)
    assert math.isfinite(Aws().retention_s) and Pods().start_s > 0
