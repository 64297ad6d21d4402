"""The spawn pool: start method, model loading, warm-up, crash isolation."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import tests.parent_only_marker  # noqa: F401  (a module only this process has)
from sqsinfer.compute import inference
from sqsinfer.compute.errors import ModelLoadError
from sqsinfer.lab import synthetic
from sqsinfer.worker import pool as pool_module
from sqsinfer.worker.pool import InferencePool, PoolConfig, PoolCrashed
from tests import handlers
from tests.conftest import sample
from tests.worker import gates


def _config(model_path: str, processes: int = 1, **kw) -> PoolConfig:
    values = dict(
        processes=processes,
        handler="xgboost",
        model_path=model_path,
        threads=1,
        model_sha256="",
        max_decoded_bytes=1 << 20,
    )
    values.update(kw)
    return PoolConfig(**values)


async def test_processes_are_spawned_not_forked_even_after_the_parent_used_xgboost(model_path):
    import xgboost

    # A parent that already ran native multi-threaded prediction: a forked child would
    # inherit OpenMP's locks without its threads.
    booster = xgboost.Booster(model_file=model_path)
    booster.set_param({"nthread": 2})
    booster.inplace_predict(np.ones((100, booster.num_features()), dtype=np.float32))
    pool = InferencePool(_config(model_path, processes=2))
    assert pool.context.get_start_method() == "spawn"
    await pool.start()
    try:
        assert pool.ready_count == 2
        assert len({slot.pid for slot in pool.slots}) == 2
        async with pool.lease() as lease:
            assert await lease.run(handlers.start_method_marker) is False
            modules = await lease.run(handlers.loaded_modules)
        assert "xgboost" in modules  # loaded by the initializer, in the child itself
        rows = synthetic.make_rows(4, booster.num_features(), seed=5)
        async with pool.lease() as lease:
            out = await lease.run(
                handlers.predict_bytes, synthetic.encode_input(rows, "npy"), "npy", "npy"
            )
        np.testing.assert_allclose(
            synthetic.decode_output(out, "npy").ravel(), booster.inplace_predict(rows), rtol=1e-6
        )
    finally:
        await pool.close()
    assert pool.ready_count == 0


async def test_a_model_that_fails_to_load_stops_start_up(tmp_path, model_path):
    corrupt = tmp_path / "corrupt.ubj"
    corrupt.write_bytes(b"{not a model")
    pool = InferencePool(_config(str(corrupt)))
    with pytest.raises(
        ModelLoadError,
        match=r"cannot load model .*corrupt.ubj with xgboost: XGBoostError",
    ):
        await pool.start()
    failing = InferencePool(_config(model_path, handler="tests.handlers:FailingLoadHandler"))
    with pytest.raises(ModelLoadError):
        await failing.start()


async def test_a_sha256_pin_refuses_another_model_file(model_path):
    pool = InferencePool(_config(model_path, model_sha256="0" * 64))
    with pytest.raises(ModelLoadError):
        await pool.start()
    pinned = InferencePool(_config(model_path, model_sha256=inference.file_sha256(model_path)))
    await pinned.start()
    await pinned.close()


async def test_a_crash_costs_only_the_task_on_that_process(model_path):
    pool = InferencePool(_config(model_path, processes=2, handler="tests.handlers:ScriptedHandler"))
    await pool.start()
    slow = np.full((2, 2), 1.0, dtype=np.float32)  # sleeps 1 s
    doomed = np.full((2, 2), handlers.KILL, dtype=np.float32)

    async def run(rows: np.ndarray) -> bytes:
        async with pool.lease() as lease:
            return await lease.run(
                handlers.predict_bytes, synthetic.encode_input(rows, "npy"), "npy", "npy"
            )

    try:
        survivor = asyncio.create_task(run(slow))
        await asyncio.sleep(0.2)
        with pytest.raises(PoolCrashed):
            await run(doomed)
        # The other process's task was not touched by its neighbour's death.
        assert synthetic.decode_output(await survivor, "npy").ravel().tolist() == [2.0, 2.0]
        for _ in range(100):
            if pool.ready_count == 2:
                break
            await asyncio.sleep(0.05)
        assert pool.ready_count == 2
        assert sample(pool.metrics, "sqsinfer_pool_rebuilds_total") == 1
    finally:
        await pool.close()


async def test_cancelling_a_task_kills_its_process_and_restarts_it(model_path):
    pool = InferencePool(_config(model_path, handler="tests.handlers:ScriptedHandler"))
    await pool.start()
    pid = pool.slots[0].pid
    rows = np.full((1, 2), 30.0, dtype=np.float32)

    async def run() -> bytes:
        async with pool.lease() as lease:
            return await lease.run(
                handlers.predict_bytes, synthetic.encode_input(rows, "npy"), "npy", "npy"
            )

    task = asyncio.create_task(run())
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    try:
        for _ in range(100):
            if pool.ready_count == 1:
                break
            await asyncio.sleep(0.05)
        assert pool.slots[0].pid != pid
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        await pool.close()


async def test_a_process_killed_while_idle_costs_no_task(model_path):
    pool = InferencePool(_config(model_path, processes=1))
    await pool.start()
    try:
        os.kill(pool.slots[0].pid, signal.SIGKILL)  # the OOM killer may pick an idle one
        await asyncio.sleep(0.5)
        rows = synthetic.make_rows(2, 8, seed=1)
        async with pool.lease() as lease:  # finds it dead, waits for the restart
            out = await lease.run(
                handlers.predict_bytes, synthetic.encode_input(rows, "npy"), "npy", "npy"
            )
        assert synthetic.decode_output(out, "npy").shape == (2, 1)
        assert sample(pool.metrics, "sqsinfer_pool_rebuilds_total") == 1
    finally:
        await pool.close()


async def test_the_watch_restarts_a_process_that_died_idle(model_path):
    pool = InferencePool(_config(model_path, processes=2))
    await pool.start()
    watch = asyncio.create_task(pool.watch(interval_s=0.1))
    try:
        os.kill(pool.slots[1].pid, signal.SIGKILL)
        for _ in range(100):
            if sample(pool.metrics, "sqsinfer_pool_rebuilds_total") == 1 and pool.ready_count == 2:
                break
            await asyncio.sleep(0.1)
        assert sample(pool.metrics, "sqsinfer_pool_rebuilds_total") == 1
        assert pool.ready_count == 2
    finally:
        watch.cancel()
        await pool.close()


async def test_a_pinned_model_swapped_after_its_check_is_never_loaded_unverified(
    tmp_path, monkeypatch
):
    model = tmp_path / "model.bin"
    model.write_bytes(b"the pinned model")
    pin = inference.file_sha256(str(model))
    monkeypatch.setenv(gates.SWAP_PATH_VAR, str(model))  # spawned processes inherit it
    pool = InferencePool(
        _config(str(model), handler="tests.worker.gates:SwappingHandler", model_sha256=pin)
    )
    await pool.start()
    try:
        async with pool.lease() as lease:
            loaded = await lease.run(gates.loaded_sha256)
    finally:
        await pool.close()
    assert model.read_bytes() == b"bytes nobody pinned"  # the swap happened
    assert loaded == pin  # yet what was loaded is what was checked


def test_a_dead_process_not_yet_reaped_is_not_alive():
    # A pool process that exits while idle is a zombie until its executor reaps it:
    # `kill(pid, 0)` still succeeds then, and the pool would lease a dead process.
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while _state(child.pid) != "Z":  # exited; not reaped, as nobody waited for it
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert pool_module._alive(child.pid) is False
    finally:
        child.wait()
    assert pool_module._alive(os.getpid()) is True


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize(
    ("handler", "version"),
    [
        ("xgboost", "xgboost"),  # the built-in handler: XGBoost's own version
        ("tests.handlers:VersionedHandler", "2.1.0-ours"),  # its own
        ("tests.handlers:ScriptedHandler", "unknown"),  # none, and not from a distribution
    ],
)
async def test_the_pool_learns_the_handlers_version_from_the_process_that_loaded_it(
    model_path, handler, version
):
    import xgboost

    pool = InferencePool(_config(model_path, handler=handler))
    await pool.start()
    try:
        assert pool.handler_version == (xgboost.__version__ if version == "xgboost" else version)
    finally:
        await pool.close()


async def test_a_handler_version_output_metadata_cannot_carry_stops_start_up(model_path):
    pool = InferencePool(_config(model_path, handler="tests.handlers:OverlongVersionHandler"))
    with pytest.raises(ModelLoadError, match="handler-version 'vvv"):
        await pool.start()
    assert pool.ready_count == 0
