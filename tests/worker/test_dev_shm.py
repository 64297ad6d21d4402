"""/dev/shm as a pod gives it: small, and shared with another container of the pod.

The worker copies each input into a segment in /dev/shm. A tmpfs that fills while the
parent writes into a mapped segment kills it with SIGBUS, so the worker refuses at start
an in-flight bound whose inputs cannot fit, and never writes into a segment whose pages
are not already its own. Its start-up sweep removes only what dead workers left, also
when the live owner is in another pid namespace (a container sharing the pod's /dev/shm).
Each test runs real workers on a real small tmpfs (see namespaces.py).
"""

from __future__ import annotations

import io
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from sqsinfer import shm
from sqsinfer.worker import preflight
from tests.conftest import Stage
from tests.worker.namespaces import (
    MIB,
    needs_root,
    on_dev_shm,
    small_tmpfs,
    wait_for,
    worker,
)
from tests.worker.test_process import _env

pytestmark = needs_root

GATED = "tests.worker.gates:GatedHandler"
INPUT_BYTES = 3 * MIB


def _ones_input(stage: Stage, name: str) -> str:
    """A .npy input of exactly INPUT_BYTES, non-zero (a gated handler waits on it)."""
    buffer = io.BytesIO()
    np.save(buffer, np.ones(((INPUT_BYTES - 128) // 4, 1), dtype=np.float32))
    data = buffer.getvalue()
    assert len(data) == INPUT_BYTES
    return stage.put_input(name, data)


def _outputs(stage: Stage) -> int:
    return len(stage.outputs())


def _fill(directory: Path, mib: int) -> Path:
    """What another container of the pod keeps in its /dev/shm."""
    other = directory / "another-container"
    other.write_bytes(b"\1" * (mib * MIB))
    return other


def _gated_env(stage: Stage, tmp_path: Path, **extra: str) -> tuple[dict[str, str], Path]:
    model = tmp_path / "model.bin"
    model.write_bytes(b"any")
    env = _env(
        stage,
        str(model),
        SQSINFER_HANDLER=GATED,
        SQSINFER_MAX_INPUT_BYTES=str(INPUT_BYTES),
        SQSINFER_RETRY_BASE_S="1",
        **extra,
    )
    return env, tmp_path / "model.bin.go"


# -- item: a prefetch that /dev/shm cannot hold ---------------------------------------------
def test_a_pinned_prefetch_whose_inputs_cannot_fit_dev_shm_stops_start_up(
    stage: Stage, tmp_path: Path
):
    env, _ = _gated_env(stage, tmp_path, SQSINFER_PREFETCH="4")  # 4 x 3 MiB in 8 MiB
    with (
        small_tmpfs(tmp_path / "shm", 8) as dev_shm,
        worker(on_dev_shm(dev_shm), env, tmp_path / "worker.log") as started,
    ):
        wait_for(lambda: started.exited or started.ready(), "exit or readiness")
        assert started.exited, "started though 4 inputs of 3 MiB cannot fit 8 MiB"
    assert started.process.returncode == 1
    text = (tmp_path / "worker.log").read_text()
    assert "cannot start: SQSINFER_PREFETCH" in text
    for named in ("SQSINFER_MAX_INPUT_BYTES", "/dev/shm holds 8 MiB", "12 MiB"):
        assert named in text


def test_auto_holds_no_more_inputs_than_dev_shm_has_room_for_in_whole_mib(
    stage: Stage, tmp_path: Path
):
    # Inputs of 1.5 MiB take segments of 2 MiB: 8 MiB holds 3 of them, not 8 / 1.5 = 5.
    env, _ = _gated_env(stage, tmp_path, SQSINFER_PREFETCH="auto")
    env["SQSINFER_MAX_INPUT_BYTES"] = str(3 * MIB // 2)
    with (
        small_tmpfs(tmp_path / "shm", 8) as dev_shm,
        worker(on_dev_shm(dev_shm), env, tmp_path / "worker.log") as started,
    ):
        started.wait_ready()
        (ready,) = started.logged("ready")
        assert started.stop() == 0
    assert ready["ceiling"] == 3  # 3 x 2 MiB, and the semaphores


@pytest.mark.parametrize(
    ("processes", "prefetch", "refused"),
    [
        (2, "auto", None),
        (3, "auto", "SQSINFER_PREFETCH=auto"),
        (1, "2", None),
        (1, "3", "SQSINFER_PREFETCH=3"),
    ],
)
def test_start_up_refuses_what_dev_shm_cannot_hold_naming_the_settings(
    make_settings, tmp_path: Path, processes: int, prefetch: str, refused: str | None
):
    # 3 MiB inputs in 8 MiB: auto holds what fits, but one per process at least.
    settings = make_settings(
        processes=str(processes), prefetch=prefetch, max_input_bytes=str(INPUT_BYTES)
    )
    with small_tmpfs(tmp_path / "shm", 8) as dev_shm:
        if refused is None:
            preflight.check_shared_memory(settings, str(dev_shm))
            return
        with pytest.raises(preflight.StartupError) as caught:
            preflight.check_shared_memory(settings, str(dev_shm))
    text = str(caught.value)
    assert text.startswith(refused)
    for named in ("SQSINFER_MAX_INPUT_BYTES", "SQSINFER_PROCESSES", "/dev/shm holds 8 MiB"):
        assert named in text


def test_an_input_waits_for_room_in_a_full_dev_shm_instead_of_crashing(
    stage: Stage, tmp_path: Path
):
    # 2 x 3 MiB fit 8 MiB, but another container holds 4 MiB of it: the second input in
    # flight has no room until the first one's segment is given back.
    env, gate = _gated_env(stage, tmp_path, SQSINFER_PREFETCH="2")
    for i in range(4):
        stage.send({"task_id": f"w{i}", "input": _ones_input(stage, f"w{i}.npy")})
    with small_tmpfs(tmp_path / "shm", 8) as dev_shm:
        _fill(dev_shm, 4)
        with worker(on_dev_shm(dev_shm), env, tmp_path / "worker.log") as started:
            started.wait_ready()
            wait_for(
                lambda: started.exited or started.logged("input waits for room in /dev/shm"),
                "the second input to wait (or the worker to die)",
            )
            gate.write_text("go")  # the first task computes and gives its segment back
            wait_for(lambda: started.exited or _outputs(stage) == 4, "every task committed")
            assert not started.exited, f"the worker died: exit {started.process.returncode}"
            assert started.stop() == 0
    finished = started.logged("task finished")
    assert sorted(line["outcome"] for line in finished) == ["committed"] * 4


def test_an_input_with_no_room_at_all_is_retried_not_a_crash(stage: Stage, tmp_path: Path):
    env, gate = _gated_env(stage, tmp_path, SQSINFER_PREFETCH="1")
    gate.write_text("go")
    stage.send({"task_id": "full", "input": _ones_input(stage, "full.npy")})
    with small_tmpfs(tmp_path / "shm", 8) as dev_shm:
        other = _fill(dev_shm, 6)  # 2 MiB left, and nothing of the worker's to give back
        with worker(on_dev_shm(dev_shm), env, tmp_path / "worker.log") as started:
            started.wait_ready()
            wait_for(
                lambda: started.exited or started.logged("task failed, will retry"),
                "the task to fail (or the worker to die)",
            )
            assert not started.exited, f"the worker died: exit {started.process.returncode}"
            (failed,) = started.logged("task failed, will retry")
            assert (
                failed["error"] == "no room in /dev/shm for a segment of 3 MiB: 2 MiB free of 8 MiB"
            )
            other.unlink()  # the other container let go
            wait_for(lambda: started.exited or _outputs(stage) == 1, "the retry committed")
            assert not started.exited, f"the worker died: exit {started.process.returncode}"
            assert started.stop() == 0
    outcomes = [line["outcome"] for line in started.logged("task finished")]
    assert outcomes == ["retried", "committed"]


# -- item: the sweep across pid namespaces ---------------------------------------------------
def _segments(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.startswith(shm.PREFIX)}


def _locks(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.endswith(".lock")}


def test_the_sweep_spares_a_live_worker_in_another_pid_namespace_and_sweeps_it_once_killed(
    stage: Stage, model_path: str, tmp_path: Path
):
    for i in range(2):
        stage.send({"task_id": f"p{i}", "input": _ones_input(stage, f"p{i}.npy")})
    logs = tmp_path / "logs"
    logs.mkdir()
    with small_tmpfs(tmp_path / "shm", 64) as dev_shm:
        # The first container: pid 1 of a namespace of its own, sharing the pod's /dev/shm.
        first_env = _env(stage, model_path, SQSINFER_MAX_INPUT_BYTES=str(INPUT_BYTES))
        with worker(on_dev_shm(dev_shm, own_pids=True), first_env, logs / "first") as first:
            first.wait_ready()
            wait_for(lambda: _outputs(stage) == 2, "the first worker's tasks")
            kept = _segments(dev_shm)
            assert kept and all(name.startswith(f"{shm.PREFIX}1-") for name in kept)
            # The second container starts beside it: it cannot see the first one's pid 1.
            second_env = _env(stage, model_path, SQSINFER_MAX_INPUT_BYTES=str(INPUT_BYTES))
            with worker(on_dev_shm(dev_shm), second_env, logs / "second") as second:
                second.wait_ready()
                assert second.logged("swept what dead workers left") == []
                assert _segments(dev_shm) == kept
                assert second.stop() == 0
            assert _segments(dev_shm) == kept
            first_lock = _locks(dev_shm)
            assert len(first_lock) == 1  # held by the first worker, named for it
            # The first container killed at once (its pid 1: the kernel kills the rest).
            os.kill(first.worker_pid(), signal.SIGKILL)
            first.process.wait(timeout=60)
        # Left behind: its lock, and its segments but those its resource tracker unlinked
        # first (the tracker sees its worker's pipe close, and the kernel's kill of the
        # rest of the namespace can reach it a moment after).
        left = _segments(dev_shm)
        assert left <= kept and _locks(dev_shm) == first_lock
        third_env = _env(stage, model_path, SQSINFER_MAX_INPUT_BYTES=str(INPUT_BYTES))
        with worker(on_dev_shm(dev_shm), third_env, logs / "third") as third:
            third.wait_ready()
            assert _segments(dev_shm) == set()
            assert _locks(dev_shm) == set()
            (swept,) = third.logged("swept what dead workers left")
            assert (swept["segments"], swept["locks"]) == (len(left), 1)
            assert third.stop() == 0
