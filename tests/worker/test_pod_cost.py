"""The pod's deletion cost, kept by a live worker against a Kubernetes API stand-in (HTTPS on
loopback, the pod's token and CA as a service account mounts them): high while it holds
messages, low when idle, low at shutdown; an API that refuses never touches a task."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from sqsinfer import config
from sqsinfer.lab import synthetic
from sqsinfer.logs import Event
from sqsinfer.worker.lifecycle import Worker
from sqsinfer.worker.pod_cost import BUSY_COST, IDLE_COST
from tests.conftest import Stage, eventually, outcome_count, running, sample
from tests.worker.kube_api import POD, KubeApi

BUSY, IDLE = str(BUSY_COST), str(IDLE_COST)


@pytest.fixture
async def kube_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeApi]:
    api = KubeApi(tmp_path)
    await api.start()
    for name, value in api.environ().items():
        monkeypatch.setenv(name, value)
    yield api
    await api.stop()


def _task(stage: Stage, name: str, seconds: float) -> dict[str, str]:
    rows = np.ones((2, 3), dtype=np.float32)
    rows[0, 0] = seconds  # the scripted handler sleeps this long
    return {
        "task_id": name,
        "input": stage.put_input(f"{name}.npy", synthetic.encode_input(rows, "npy")),
    }


def _settings(make_settings, api: KubeApi, **overrides):
    return make_settings(
        handler="tests.handlers:ScriptedHandler",
        pod_deletion_cost="true",
        kube_token_dir=str(api.token_dir),
        **overrides,
    )


async def test_the_pod_costs_much_while_it_works_and_little_when_idle(
    stage: Stage, make_settings, kube_api: KubeApi
):
    idle_s = 2.0
    settings = _settings(make_settings, kube_api, prefetch=2, pod_deletion_cost_idle_s=idle_s)
    async with running(settings) as worker:
        await eventually(lambda: kube_api.costs() == [IDLE])  # set at start
        for i in range(4):
            stage.send(_task(stage, f"t{i}", 1.0))
        await eventually(lambda: kube_api.cost == BUSY, timeout_s=10)
        await eventually(lambda: outcome_count(worker, "committed") == 4)
        done = time.monotonic()
        await eventually(lambda: kube_api.cost == IDLE, timeout_s=30)
        assert sample(worker.metrics, "sqsinfer_pod_deletion_cost", pod=POD) == IDLE_COST
    # One patch each way: none between tasks, none for a value already set.
    assert kube_api.costs() == [IDLE, BUSY, IDLE]
    assert all(p.authorized for p in kube_api.patches)
    # Low only once idle for idle_s (less the poll that saw the last commit).
    assert kube_api.patches[-1].at - done >= idle_s - 0.5


async def test_shutdown_sets_the_cost_low_while_its_tasks_still_finish(
    stage: Stage, make_settings, kube_api: KubeApi
):
    stage.send(_task(stage, "long", 4.0))
    settings = _settings(make_settings, kube_api, pod_deletion_cost_idle_s=60)
    async with running(settings) as worker:
        await eventually(lambda: kube_api.cost == BUSY and worker.pool.slots[0].busy)
        worker.stop()
        await eventually(lambda: kube_api.cost == IDLE, timeout_s=5)
        assert worker.held  # the task is still running: low at the drain's start
        await eventually(lambda: not worker.held)
    assert worker.metrics.outcomes == {"committed": 1}
    assert kube_api.costs() == [IDLE, BUSY, IDLE]


async def test_an_api_that_refuses_never_touches_a_task(
    stage: Stage, make_settings, kube_api: KubeApi, caplog: pytest.LogCaptureFixture
):
    kube_api.refuse = True  # RBAC says no
    caplog.set_level(logging.INFO, logger="sqsinfer.worker")
    settings = _settings(make_settings, kube_api, pod_deletion_cost_idle_s=0.5)
    async with running(settings) as worker:
        for i in range(3):
            stage.send(_task(stage, f"r{i}", 0.2))
        await eventually(lambda: outcome_count(worker, "committed") == 3)
        await eventually(lambda: len(kube_api.patches) >= 3)  # tried again, backing off
        errors = sample(worker.metrics, "sqsinfer_pod_deletion_cost_errors_total")
        assert errors == len(kube_api.patches)
        kube_api.refuse = False
        await eventually(lambda: kube_api.costs() != [], timeout_s=15)
    assert worker.metrics.outcomes == {"committed": 3}
    messages = [r.getMessage() for r in caplog.records]
    assert messages.count(Event.POD_COST_NOT_SET) == 1  # once, however many failed
    assert messages.count(Event.POD_COST_SET_AGAIN) == 1


@pytest.mark.parametrize(
    ("unset", "named"),
    [("POD_NAME", "POD_NAME"), ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_HOST")],
)
async def test_start_up_names_what_the_pod_lacks(
    make_settings, kube_api: KubeApi, monkeypatch: pytest.MonkeyPatch, unset: str, named: str
):
    monkeypatch.delenv(unset)
    with pytest.raises(config.ConfigError) as caught:
        Worker(_settings(make_settings, kube_api))
    assert caught.value.setting == named


async def test_a_token_dir_without_its_token_is_named(make_settings, kube_api: KubeApi):
    (kube_api.token_dir / "token").unlink()
    with pytest.raises(config.ConfigError) as caught:
        Worker(_settings(make_settings, kube_api))
    assert caught.value.setting == "SQSINFER_KUBE_TOKEN_DIR"
