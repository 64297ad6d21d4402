"""`sqsinfer worker` as a real process: signals, exit codes and the exact lifecycle lines."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

import numpy as np
import psutil
import pytest

from sqsinfer.lab import standin, synthetic
from tests.conftest import Stage


def _env(stage: Stage, model_path: str, **extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        **standin.FAKE_CREDENTIALS,
        "SQSINFER_QUEUE_URL": stage.queue_url,
        "SQSINFER_MODEL_PATH": model_path,
        "SQSINFER_HANDLER": "tests.handlers:ScriptedHandler",
        "SQSINFER_ALLOWED_INPUT_PREFIXES": f"s3://{stage.bucket}/in/",
        "SQSINFER_OUTPUT_PREFIX": f"s3://{stage.bucket}/out/",
        "SQSINFER_ENDPOINT_URL": stage.endpoint,
        "SQSINFER_PROCESSES": "1",
        "SQSINFER_WAIT_TIME_S": "1",
        "SQSINFER_HEALTH_HOST": "127.0.0.1",
        "SQSINFER_HEALTH_PORT": str(standin.free_port()),
        "SQSINFER_LOG_FORMAT": "json",
    }
    return env | extra


def _start(env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "sqsinfer", "worker"],
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )


def _wait_ready(process: subprocess.Popen[str], port: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("worker never became ready")


def _wait_until(check, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.1)


def _computing(env: dict[str, str]) -> float:
    """Tasks that got an inference process so far, from the worker's /metrics."""
    url = f"http://127.0.0.1:{env['SQSINFER_HEALTH_PORT']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    prefix = 'sqsinfer_phase_seconds_count{phase="wait_process"} '
    return sum(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))


def _lines(stderr: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def _lifecycle(lines: list[dict[str, Any]]) -> list[str]:
    return [line["msg"] for line in lines if line["logger"] == "sqsinfer.worker"]


def _slow_input(stage: Stage, name: str, seconds: float) -> str:
    rows = np.ones((2, 2), dtype=np.float32)
    rows[0, 0] = seconds
    return stage.put_input(name, synthetic.encode_input(rows, "npy"))


def test_sigterm_drains_started_work_releases_the_rest_and_exits_0(stage: Stage, model_path):
    for i in range(3):
        stage.send({"task_id": f"t{i}", "input": _slow_input(stage, f"t{i}.npy", 1.5)})
    env = _env(stage, model_path, SQSINFER_PREFETCH="3")
    process = _start(env)
    _wait_ready(process, env["SQSINFER_HEALTH_PORT"])
    _wait_until(lambda: stage.counts(stage.queue_url) == (0, 3))
    _wait_until(lambda: _computing(env) >= 1)  # the first task computes, two wait for it
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0
    lines = _lines(stderr)
    assert _lifecycle(lines) == [
        "starting",
        "pool ready",
        "ready",
        "signal received",
        "draining",
        "stopped",
    ]
    draining = next(line for line in lines if line["msg"] == "draining")
    assert (draining["in_flight"], draining["releasing"]) == (3, 2)
    stopped = next(line for line in lines if line["msg"] == "stopped")
    assert stopped["outcomes"] == {"committed": 1, "released": 2}
    finished = [line for line in lines if line["msg"] == "task finished"]
    assert sorted(line["outcome"] for line in finished) == ["committed", "released", "released"]
    for line in finished:
        assert {"task_id", "message_id", "receive_count", "outcome", "seconds", "phases"} <= set(
            line
        )
    assert stage.counts(stage.queue_url) == (2, 0)  # handed back at once, not after a timeout


def test_a_second_signal_skips_the_drain_and_still_releases(stage: Stage, model_path):
    stage.send({"task_id": "long", "input": _slow_input(stage, "long.npy", 60)})
    env = _env(stage, model_path, SQSINFER_DRAIN_DEADLINE_S="120")
    process = _start(env)
    _wait_ready(process, env["SQSINFER_HEALTH_PORT"])
    _wait_until(lambda: _computing(env) >= 1)
    process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=30)  # far below the 120 s drain deadline
    assert process.returncode == 0
    lines = _lines(stderr)
    assert _lifecycle(lines) == [
        "starting",
        "pool ready",
        "ready",
        "signal received",
        "draining",
        "signal received",
        "drain deadline passed, releasing",
        "stopped",
    ]
    assert [line["forced"] for line in lines if line["msg"] == "signal received"] == [False, True]
    assert next(line for line in lines if line["msg"] == "stopped")["outcomes"] == {"released": 1}
    assert stage.counts(stage.queue_url) == (1, 0)


# -- a worker that ends by itself (a job's) ----------------------------------------------
def _run_to_the_end(env: dict[str, str], *flags: str) -> tuple[int, list[dict[str, Any]]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "sqsinfer", "worker", *flags],
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    _, stderr = process.communicate(timeout=120)  # no signal: it must end by itself
    return process.returncode, _lines(stderr)


def test_exit_when_idle_ends_with_0_once_the_queue_is_empty_and_every_task_committed(
    stage: Stage, model_path
):
    for i in range(4):
        stage.send({"task_id": f"i{i}", "input": _slow_input(stage, f"i{i}.npy", 0.2)})
    # prefetch pinned: an auto limit's change would log a line among the lifecycle's.
    env = _env(stage, model_path, SQSINFER_PREFETCH="2")
    code, lines = _run_to_the_end(env, "--exit-when-idle-s", "2")
    assert code == 0
    assert _lifecycle(lines) == [
        "starting",
        "pool ready",
        "ready",
        "work done, stopping",
        "draining",
        "stopped",
    ]
    done = next(line for line in lines if line["msg"] == "work done, stopping")
    assert (done["reason"], done["taken"]) == ("idle", 4)
    assert done["idle_s"] >= 2
    assert next(line for line in lines if line["msg"] == "stopped")["outcomes"] == {"committed": 4}
    assert len(stage.outputs()) == 4
    assert stage.counts(stage.queue_url) == (0, 0)  # every message deleted


def test_max_tasks_commits_exactly_that_many_and_leaves_the_rest_visible(stage: Stage, model_path):
    for i in range(8):
        stage.send({"task_id": f"m{i}", "input": _slow_input(stage, f"m{i}.npy", 0.1)})
    # Room for all 8 at once (one process, 8 in flight): only the limit stops it.
    env = _env(stage, model_path, SQSINFER_PREFETCH="8")
    code, lines = _run_to_the_end(env, "--max-tasks", "5")
    assert code == 0
    assert "work done, stopping" in _lifecycle(lines)
    done = next(line for line in lines if line["msg"] == "work done, stopping")
    assert (done["reason"], done["taken"]) == ("max_tasks", 5)
    assert next(line for line in lines if line["msg"] == "stopped")["outcomes"] == {"committed": 5}
    assert len(stage.outputs()) == 5
    # The other 3 were never taken: visible at once, their receive count untouched.
    assert stage.counts(stage.queue_url) == (3, 0)
    rest = stage.drain_queue(stage.queue_url)
    assert [int(m["Attributes"]["ApproximateReceiveCount"]) for m in rest] == [1, 1, 1]


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether the process has a handler for `sig` (its SigCgt mask in /proc)."""
    with open(f"/proc/{pid}/status") as status:
        caught = next(line for line in status if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (sig - 1) & 1)


def test_a_sigterm_as_soon_as_it_is_caught_stops_start_up_with_exit_0(stage: Stage, model_path):
    # The first moment a SIGTERM is not fatal: a scale-in just after a scale-out. Nothing
    # answers at the endpoint, so start-up is still waiting wherever the signal lands.
    env = _env(stage, model_path, SQSINFER_ENDPOINT_URL=f"http://127.0.0.1:{standin.free_port()}")
    process = _start(env)
    deadline = time.monotonic() + 60
    while process.poll() is None and not _catches(process.pid, signal.SIGTERM):
        assert time.monotonic() < deadline, "SIGTERM never caught"
        time.sleep(0.005)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    lifecycle = _lifecycle(_lines(stderr))
    assert lifecycle.count("signal received") == 1
    assert [m for m in lifecycle if m != "signal received"] == ["starting", "stopped before ready"]


def test_a_model_that_cannot_load_exits_1_with_the_reason(stage: Stage, tmp_path):
    corrupt = tmp_path / "model.ubj"
    corrupt.write_bytes(b"\x00 not a model")
    env = _env(stage, str(corrupt), SQSINFER_HANDLER="xgboost")
    result = subprocess.run(
        [sys.executable, "-m", "sqsinfer", "worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert "cannot start: cannot load model " in result.stderr
    assert "XGBoostError" in result.stderr


@pytest.mark.parametrize("which", ["queue", "sha"])
def test_start_up_problems_exit_1_naming_the_setting(stage: Stage, model_path, which):
    extra = {
        "queue": {"SQSINFER_QUEUE_URL": stage.queue_url + "-missing"},
        "sha": {"SQSINFER_MODEL_SHA256": "0" * 64},
    }[which]
    result = subprocess.run(
        [sys.executable, "-m", "sqsinfer", "worker"],
        env=_env(stage, model_path, **extra),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    setting = {"queue": "SQSINFER_QUEUE_URL", "sha": "SQSINFER_MODEL_SHA256"}[which]
    assert f"cannot start: {setting}" in result.stderr


# -- what a killed worker leaves behind ---------------------------------------------------
def _tree(process: subprocess.Popen[str]) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """The worker's inference processes and its resource tracker."""
    children = psutil.Process(process.pid).children()
    spawned = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
    trackers = [c for c in children if "resource_tracker" in " ".join(c.cmdline())]
    return spawned, trackers


def _shm_mapped(processes: list[psutil.Process]) -> set[str]:
    """The /dev/shm entries these processes have mapped (and that still have a name)."""
    found = set()
    for proc in processes:
        with open(f"/proc/{proc.pid}/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if path.startswith("/dev/shm/") and not path.endswith("(deleted)"):
                    found.add(path)
    return found


def _gone(processes: list[psutil.Process]) -> bool:
    """Exited (a zombie not yet reaped by its new parent counts: it holds nothing)."""
    for proc in processes:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def _kill_all(processes: list[psutil.Process]) -> None:
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def _busy_worker(stage: Stage, model_path: str) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """A worker with two processes that has run a few tasks, with one still computing."""
    for i in range(3):
        stage.send({"task_id": f"k{i}", "input": _slow_input(stage, f"k{i}.npy", 0.1)})
    stage.send({"task_id": "long", "input": _slow_input(stage, "long.npy", 60)})
    env = _env(stage, model_path, SQSINFER_PROCESSES="2")
    process = _start(env)
    try:
        _wait_ready(process, env["SQSINFER_HEALTH_PORT"])
        _wait_until(lambda: stage.counts(stage.queue_url) == (0, 1) and len(stage.outputs()) == 3)
    except BaseException:
        main = psutil.Process(process.pid)
        _kill_all([*main.children(), main])
        raise
    return process, env


def test_children_and_the_tracker_follow_a_killed_parent_and_leave_no_shm(stage: Stage, model_path):
    # An OOM kill of the worker's main process alone: nothing may outlive it for long.
    process, _ = _busy_worker(stage, model_path)
    main = psutil.Process(process.pid)
    spawned, trackers = _tree(process)
    try:
        assert len(spawned) == 2 and len(trackers) == 1
        held = _shm_mapped([main, *spawned])
        assert held  # the input segments, at least
        process.kill()
        process.wait()
        _wait_until(lambda: _gone(spawned), timeout_s=5)
        _wait_until(lambda: _gone(trackers), timeout_s=5)
    finally:
        _kill_all([main, *spawned, *trackers])
        process.wait()
        process.stderr.close()  # type: ignore[union-attr]
    assert {path for path in held if os.path.exists(path)} == set()


def test_a_new_worker_sweeps_what_a_killed_worker_tree_left_in_dev_shm(stage: Stage, model_path):
    # A pod killed outright: the worker, its processes and its resource tracker at once.
    process, env = _busy_worker(stage, model_path)
    main = psutil.Process(process.pid)
    spawned, trackers = _tree(process)
    held = _shm_mapped([main, *spawned])
    _kill_all([main, *spawned, *trackers])
    process.wait()
    process.stderr.close()  # type: ignore[union-attr]
    _wait_until(lambda: _gone(spawned + trackers), timeout_s=5)
    assert {path for path in held if os.path.exists(path)}  # a SIGKILL cleans up nothing
    env |= {"SQSINFER_HEALTH_PORT": str(standin.free_port())}
    successor = _start(env)
    try:
        _wait_ready(successor, env["SQSINFER_HEALTH_PORT"])
    finally:
        successor.send_signal(signal.SIGTERM)
        _, stderr = successor.communicate(timeout=60)
    assert {path for path in held if os.path.exists(path)} == set()
    # Any worker starting on the machine sweeps (in a parallel test run, another may have
    # come first): when this one did, it said so in one line.
    swept = [line for line in _lines(stderr) if line["msg"] == "swept what dead workers left"]
    assert len(swept) <= 1 and all(line["segments"] >= 1 for line in swept), swept
