"""Visibility keeping, task time limits, pool crashes, draining and health, in a live worker."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import aiohttp
import numpy as np

from sqsinfer.lab import synthetic
from sqsinfer.worker.lifecycle import Worker
from tests.conftest import Stage, eventually, outcome_count, running, sample
from tests.handlers import KILL


def _input(stage: Stage, name: str, first_cell: float = 0.0) -> str:
    rows = np.ones((2, 3), dtype=np.float32)
    rows[0, 0] = first_cell
    return stage.put_input(name, synthetic.encode_input(rows, "npy"))


def _scripted(make_settings, **overrides):
    return make_settings(handler="tests.handlers:ScriptedHandler", **overrides)


class Poacher:
    """Another consumer polling the same queue once the worker holds what was sent;
    records what it got.

    It starts only when nothing on the queue is visible: started earlier, it could take
    a message before the worker's first receive does, which is no lapse at all.
    """

    def __init__(self, stage: Stage) -> None:
        self.stage, self.got, self.stop = stage, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            response = self.stage.sqs.receive_message(
                QueueUrl=self.stage.queue_url, WaitTimeSeconds=1, VisibilityTimeout=0
            )
            self.got += response.get("Messages", [])

    async def __aenter__(self) -> Poacher:
        await eventually(lambda: self.stage.counts(self.stage.queue_url)[0] == 0, timeout_s=30)
        self.thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        await asyncio.to_thread(self.thread.join)


async def test_task_three_times_longer_than_visibility_is_never_redelivered(
    stage: Stage, make_settings
):
    stage.send({"task_id": "long", "input": _input(stage, "long.npy", first_cell=16)})
    # A 5 s visibility extended every 0.5 s: a loaded machine's stall of the worker or the
    # stand-in (seen past 1.5 s at a load average of 8) cannot outlast it by accident.
    settings = _scripted(make_settings, visibility_timeout_s=5, heartbeat_s=0.5)
    async with running(settings) as worker, Poacher(stage) as poacher:
        await eventually(lambda: outcome_count(worker, "committed") == 1, timeout_s=60)
    assert poacher.got == []  # 16 s of work under a 5 s visibility: nobody else saw it
    assert sample(worker.metrics, "sqsinfer_visibility_extensions_total") >= 3
    assert worker.metrics.outcomes == {"committed": 1}


async def test_task_over_max_time_is_abandoned_and_its_process_replaced(
    stage: Stage, make_settings
):
    stage.send({"task_id": "stuck", "input": _input(stage, "stuck.npy", first_cell=30)})
    settings = _scripted(
        make_settings, task_time_s=1, max_task_time_s=1, heartbeat_s=0.25, retry_base_s=60
    )
    async with running(settings) as worker:
        first_pid = worker.pool.slots[0].pid
        await eventually(lambda: outcome_count(worker, "retried") == 1)
        await eventually(lambda: worker.pool.ready_count == 1)
        assert worker.pool.slots[0].pid != first_pid
        assert sample(worker.metrics, "sqsinfer_pool_rebuilds_total") == 1
    visible, in_flight = stage.counts(stage.queue_url)
    assert (visible, in_flight) == (0, 1)  # waiting out its retry delay, not lost


async def test_a_killed_process_costs_one_retry_then_the_task_succeeds(stage: Stage, make_settings):
    stage.send({"task_id": "victim", "input": _input(stage, "victim.npy", first_cell=3)})
    settings = _scripted(make_settings, retry_base_s=1)
    async with running(settings) as worker:
        await eventually(lambda: worker.pool.slots[0].busy)
        os.kill(worker.pool.slots[0].pid, signal.SIGKILL)  # an OOM kill, as the pool sees it
        await eventually(lambda: outcome_count(worker, "retried") == 1)
        await eventually(lambda: outcome_count(worker, "committed") == 1, timeout_s=30)
        assert sample(worker.metrics, "sqsinfer_pool_rebuilds_total") == 1
        assert worker.pool.usable
    assert set(stage.outputs()) == {"out/victim.npy"}


async def test_a_message_that_always_kills_its_process_ends_in_the_dlq(stage: Stage, make_settings):
    stage.send({"task_id": "poison", "input": _input(stage, "poison.npy", first_cell=KILL)})
    async with running(_scripted(make_settings, retry_base_s=1)) as worker:
        await eventually(lambda: stage.counts(stage.dlq_url)[0] == 1, timeout_s=60)
        await eventually(lambda: outcome_count(worker, "rejected") == 1)
        # Retried until its last allowed receive, then copied to the DLQ with a reason.
        assert worker.metrics.outcomes == {"retried": 2, "rejected": 1}
        assert worker.pool.usable
    assert stage.outputs() == {}


async def test_shutdown_finishes_started_work_and_releases_the_rest(stage: Stage, make_settings):
    for i in range(3):
        stage.send({"task_id": f"s{i}", "input": _input(stage, f"s{i}.npy", first_cell=1.5)})
    settings = _scripted(make_settings, prefetch=3, drain_deadline_s=10)
    async with running(settings) as worker:
        await eventually(lambda: len(worker.held) == 3 and worker.pool.slots[0].busy)
        worker.stop()
        await eventually(lambda: not worker.held)
    assert worker.metrics.outcomes == {"committed": 1, "released": 2}
    assert stage.counts(stage.queue_url) == (2, 0)  # visible again at once
    assert len(stage.outputs()) == 1


async def test_drain_deadline_releases_work_still_running(stage: Stage, make_settings):
    stage.send({"task_id": "slow", "input": _input(stage, "slow.npy", first_cell=20)})
    settings = _scripted(make_settings, task_time_s=0.5, drain_deadline_s=0.5)
    async with running(settings) as worker:
        await eventually(lambda: worker.pool.slots[0].busy)
        pid = worker.pool.slots[0].pid
    assert worker.metrics.outcomes == {"released": 1}
    assert stage.counts(stage.queue_url) == (1, 0)
    assert not _alive(pid)  # the abandoned computation was stopped, not left running


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_health_endpoints_follow_the_lifecycle(stage: Stage, make_settings):
    stage.send({"task_id": "h", "input": _input(stage, "h.npy")})
    async with running(_scripted(make_settings)) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == 1)
        base = f"http://127.0.0.1:{worker.health.port}"
        async with aiohttp.ClientSession() as http:
            for path in ("/livez", "/readyz"):
                async with http.get(base + path) as response:
                    assert response.status == 200, path
            async with http.get(base + "/metrics") as response:
                text = await response.text()
            stage.send({"task_id": "h2", "input": _input(stage, "h2.npy", first_cell=2)})
            await eventually(lambda: worker.pool.slots[0].busy)
            worker.stop()  # the slow task keeps the worker draining for a while
            await asyncio.sleep(0.1)
            async with http.get(base + "/readyz") as response:
                assert (response.status, await response.text()) == (503, "draining\n")
            async with http.get(base + "/livez") as response:
                assert response.status == 200
    assert 'sqsinfer_tasks_total{outcome="committed"} 1.0' in text
    assert 'sqsinfer_tasks_total{outcome="rejected"} 0.0' in text
    for phase in ("s3_get", "wait_process", "infer", "commit"):
        assert f'sqsinfer_phase_seconds_count{{phase="{phase}"}} 1.0' in text
    assert "sqsinfer_processes_ready 1.0" in text
    assert "sqsinfer_in_flight 0.0" in text


async def test_livez_fails_when_a_lost_process_cannot_be_restarted(
    stage: Stage, make_settings, tmp_path
):
    model = tmp_path / "model.bin"
    model.write_bytes(b"any")
    settings = make_settings(handler="tests.handlers:LoadsOnceHandler", model_path=str(model))
    async with running(settings) as worker:
        base = f"http://127.0.0.1:{worker.health.port}"
        (tmp_path / "model.bin.broken").write_bytes(b"")
        os.kill(worker.pool.slots[0].pid, signal.SIGKILL)
        async with aiohttp.ClientSession() as http:

            async def livez() -> tuple[int, str]:
                async with http.get(base + "/livez") as response:
                    return response.status, await response.text()

            await eventually(lambda: not worker.pool.usable, timeout_s=30)
            status, text = await livez()
    assert status == 503
    assert text.startswith("inference pool cannot be rebuilt: cannot load model")


async def _watch_counts(stage: Stage, seconds: float) -> set[tuple[int, int]]:
    """Every (visible, in flight) the queue showed over a while."""
    seen = set()
    deadline = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < deadline:
        seen.add(await asyncio.to_thread(stage.counts, stage.queue_url))
        await asyncio.sleep(0.2)
    return seen


async def test_messages_released_at_shutdown_are_not_taken_back_by_its_own_long_poll(
    stage: Stage, make_settings
):
    """Free slots at SIGTERM mean a long poll is open at SQS. Cut at this end, it would go
    on there and take the messages the shutdown releases: hidden for a visibility
    timeout, one receive spent. They are released only once it has ended."""
    for i in range(3):
        stage.send({"task_id": f"r{i}", "input": _input(stage, f"r{i}.npy", first_cell=3)})
    wait_s = 3
    settings = _scripted(make_settings, prefetch=8, wait_time_s=wait_s)  # 8 slots, 3 held
    async with running(settings) as worker:
        await eventually(lambda: len(worker.held) == 3 and worker.pool.slots[0].busy)
        assert worker.room() >= worker.limit.receive_batch  # so a receive is out
    assert worker.metrics.outcomes == {"committed": 1, "released": 2}
    # Watched longer than a long poll lasts: they stay visible, nobody holds them.
    assert await _watch_counts(stage, 2 * wait_s) == {(2, 0)}
    released = stage.drain_queue(stage.queue_url)
    # Received once by the worker, once just now: no receive in between.
    assert [int(m["Attributes"]["ApproximateReceiveCount"]) for m in released] == [2, 2]


# -- a worker that ends by itself (a job's) ------------------------------------------------
async def _ends_by_itself(settings) -> Worker:
    """Serve until the worker ends on its own (no stop is ever asked)."""
    worker = Worker(settings)
    await asyncio.wait_for(worker.serve(), 90)
    return worker


async def test_exit_when_idle_waits_for_every_task_held_however_long(stage: Stage, make_settings):
    """Idle is nothing received and nothing held: two tasks of 3 s each on one process,
    the second waiting for it, keep a worker of exit_when_idle_s 1 going; ended early, the
    second would have been handed back unstarted (released)."""
    for i in range(2):
        stage.send({"task_id": f"w{i}", "input": _input(stage, f"w{i}.npy", first_cell=3)})
    settings = _scripted(make_settings, prefetch=2, exit_when_idle_s=1)
    worker = await _ends_by_itself(settings)
    assert worker.metrics.outcomes == {"committed": 2}
    assert stage.counts(stage.queue_url) == (0, 0)


async def test_max_tasks_counts_messages_whatever_they_end_in(stage: Stage, make_settings):
    """A rejected message counts toward max_tasks as a committed one does: the bound is on
    what this worker took, not on what succeeded."""
    for _ in range(5):
        stage.send("{not json")
    worker = await _ends_by_itself(_scripted(make_settings, prefetch=8, max_tasks=3))
    assert worker.metrics.outcomes == {"rejected": 3}
    assert stage.counts(stage.dlq_url) == (3, 0)
    assert stage.counts(stage.queue_url) == (2, 0)  # never received: visible, not held
