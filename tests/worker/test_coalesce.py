"""Small tasks coalesced: several tasks' rows in one predict call, each task still its own.

Against the stand-in, a worker with one process whose process the test holds (a lease,
as a task computing would) while small tasks arrive: they all wait for it, and are given
to it together once it is free. The same tasks through a worker that scores each alone
give the reference.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from sqsinfer import shm
from sqsinfer.aws.sqs import REASON_ATTR
from sqsinfer.compute import inference
from sqsinfer.compute.handlers import import_handler, rows_independent
from sqsinfer.compute.handlers.xgboost_impl import XGBoostHandler
from sqsinfer.config import Settings
from sqsinfer.lab import synthetic
from sqsinfer.worker.pipeline import Step
from sqsinfer.worker.pool import InferencePool, PoolConfig, PoolCrashed
from tests import handlers
from tests.conftest import N_FEATURES, Stage, eventually, outcome_count, running, sample

# Per-delivery facts of an output's metadata: the rest is the same however it was scored.
_PER_DELIVERY = frozenset({"message-id", "delivery"})


def _npy(rows: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, rows, allow_pickle=False)
    return out.getvalue()


def _small_tasks(stage: Stage) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Good tasks (their rows, by task id) in every input format and two dtypes, and bad
    ones (their reasons), all small."""
    good = {
        "npy": synthetic.make_rows(3, N_FEATURES, seed=11),
        "csv": synthetic.make_rows(5, N_FEATURES, seed=12),
        "json": synthetic.make_rows(1, N_FEATURES, seed=13),
        "jsonl": synthetic.make_rows(4, N_FEATURES, seed=14),
        "f64": synthetic.make_rows(6, N_FEATURES, seed=15).astype(np.float64),
    }
    for task_id, rows in good.items():
        fmt = "npy" if task_id == "f64" else task_id
        data = _npy(rows) if task_id == "f64" else synthetic.encode_input(rows, fmt)
        stage.put_input(f"{task_id}.{fmt}", data)
    stage.put_input("garbage.npy", b"\x93NUMPY\x01\x00garbage")
    stage.put_input("narrow.npy", synthetic.encode_input(synthetic.make_rows(4, 3, seed=2), "npy"))
    bad = {"garbage": "undecodable_input", "narrow": "wrong_feature_count"}
    return good, bad


def _send_all(stage: Stage, names: list[str]) -> None:
    for task_id in names:
        fmt = "npy" if task_id in ("f64", "garbage", "narrow") else task_id
        stage.send({"task_id": task_id, "input": f"s3://{stage.bucket}/in/{task_id}.{fmt}"})


def _waiting(worker) -> int:
    return sum(held.step == Step.WAITING for held in worker.held.values())


def _written(stage: Stage, prefix: str) -> dict[str, tuple[bytes, dict[str, str]]]:
    """Each output under `prefix` by task id: its bytes and its metadata."""
    found = {}
    for key, body in stage.outputs(prefix).items():
        head = stage.s3.head_object(Bucket=stage.bucket, Key=key)
        found[key.removeprefix(prefix).removesuffix(".npy")] = (body, head["Metadata"])
    return found


async def test_waiting_small_tasks_share_a_predict_call_and_each_ends_on_its_own(
    stage: Stage, make_settings: Callable[..., Settings], model_path: str
):
    good, bad = _small_tasks(stage)
    names = [*good, *bad]
    settings = make_settings(prefetch=len(names) + 1)
    async with running(settings) as worker:
        assert worker.pool.coalesce_max_rows == 1000  # the default, the handler allowing it
        async with worker.pool.lease():  # the one process is busy: every task waits for it
            _send_all(stage, names)
            await eventually(lambda: _waiting(worker) == len(names))
        await eventually(
            lambda: (
                outcome_count(worker, "committed") == len(good)
                and outcome_count(worker, "rejected") == len(bad)
            )
        )
        metrics = worker.metrics
        # The float32 inputs in one call, the float64 one alone (each task's rows reach
        # the handler as they would alone); the bad ones in none.
        assert sample(metrics, "sqsinfer_tasks_per_predict_count") == 2
        assert sample(metrics, "sqsinfer_tasks_per_predict_sum") == len(good)
        assert sample(metrics, "sqsinfer_tasks_per_predict_bucket", le="1.0") == 1
        assert sample(metrics, "sqsinfer_rows_total") == sum(len(r) for r in good.values())
    dead = stage.drain_queue(stage.dlq_url)
    reasons = {json.loads(m["Body"])["task_id"]: m["MessageAttributes"][REASON_ATTR] for m in dead}
    assert {task: attr["StringValue"] for task, attr in reasons.items()} == bad
    coalesced = _written(stage, "out/")
    assert set(coalesced) == set(good)

    # The same tasks, each alone: the reference.
    alone_settings = make_settings(
        coalesce=False,
        output_prefix=f"s3://{stage.bucket}/alone/",
        allowed_output_prefixes=f"s3://{stage.bucket}/alone/",
    )
    async with running(alone_settings) as worker:
        assert worker.pool.coalesce_max_rows == 0
        _send_all(stage, list(good))
        await eventually(lambda: outcome_count(worker, "committed") == len(good))
        assert sample(worker.metrics, "sqsinfer_tasks_per_predict_sum") == len(good)
        assert sample(worker.metrics, "sqsinfer_tasks_per_predict_count") == len(good)
    alone = _written(stage, "alone/")
    direct = XGBoostHandler()
    direct.load(model_path, 1)
    for task_id, rows in good.items():
        body, metadata = coalesced[task_id]
        assert body == alone[task_id][0]  # bit for bit
        got = synthetic.decode_output(body, "npy")
        assert got.tobytes() == direct.predict(rows).reshape(-1, 1).tobytes()
        lineage = {k: v for k, v in metadata.items() if k not in _PER_DELIVERY}
        assert lineage == {k: v for k, v in alone[task_id][1].items() if k not in _PER_DELIVERY}
        assert metadata["task-id"] == task_id


@pytest.mark.parametrize("threads", [1, 2])
def test_xgboost_scores_a_row_the_same_whatever_rows_share_the_call(model_path, threads):
    handler = XGBoostHandler()
    handler.load(model_path, threads)
    assert rows_independent(handler)
    tasks = [synthetic.make_rows(n, N_FEATURES, seed=n) for n in (1, 2, 7, 64, 65, 300, 1000)]
    alone = np.concatenate([handler.predict(rows) for rows in tasks])
    together = handler.predict(np.concatenate(tasks))
    assert alone.tobytes() == together.tobytes()


def test_only_a_handler_that_says_so_is_coalesced():
    assert rows_independent(import_handler("xgboost"))
    # ONNX graphs may mix rows (a normalisation over the batch) and its kernels may sum in
    # another order for another batch size: a model known to be row-wise opts in by a
    # subclass of the handler that says so.
    assert not rows_independent(import_handler("onnx"))
    assert not rows_independent(handlers.ScriptedHandler())
    assert rows_independent(handlers.RowScriptedHandler())


# -- the pool: a process's failure under several tasks ------------------------------------


def _pool_config(model_path: str, handler: str, max_rows: int = 1000) -> PoolConfig:
    return PoolConfig(
        processes=1,
        handler=handler,
        model_path=model_path,
        threads=1,
        model_sha256="",
        max_decoded_bytes=1 << 20,
        coalesce_max_rows=max_rows,
    )


@pytest.fixture
def segments() -> Iterator[shm.Segments]:
    kept = shm.Segments()
    yield kept
    kept.clear()


def _job(segments: shm.Segments, rows: np.ndarray) -> inference.Job:
    data = synthetic.encode_input(rows, "npy")
    shared = shm.SharedInput(len(data), segments)
    shared.write_at(0, data)
    return inference.Job(shared.name, shared.size, "npy", "npy")


async def _together(pool: InferencePool, jobs: list[inference.Job]) -> list[object]:
    """The jobs computed while they all wait for the pool's one process, given to it at
    once; each one's result (its predictions) or failure."""
    started: list[inference.Job] = []
    async with pool.lease():
        tasks = [
            asyncio.create_task(pool.compute(job, lambda job=job: started.append(job)))
            for job in jobs
        ]
        await eventually(lambda: pool.waiting == len(jobs))
        assert not started  # nothing goes to a process while it is busy
    found = await asyncio.gather(*tasks, return_exceptions=True)
    assert started == jobs  # given to the process together, in their order
    return [
        r if isinstance(r, BaseException) else synthetic.decode_output(r["body"], "npy").ravel()
        for r in found
    ]


def _rows(first: float, n: int = 2) -> np.ndarray:
    rows = np.ones((n, 2), dtype=np.float32)
    rows[:, 0] = first
    return rows


async def test_a_failing_shared_call_scores_each_task_alone(model_path, segments):
    pool = InferencePool(_pool_config(model_path, "tests.handlers:RowScriptedHandler"))
    await pool.start()
    try:
        jobs = [_job(segments, _rows(v)) for v in (0.0, handlers.FAIL, -0.5)]
        good, failed, other = await _together(pool, jobs)
    finally:
        await pool.close()
    assert good.tolist() == [1.0, 1.0]
    assert isinstance(failed, RuntimeError)
    assert "told to fail by a row" in str(failed)
    assert other.tolist() == [0.5, 0.5]
    # The shared call failed: the two good tasks were each scored by a call of its own.
    assert sample(pool.metrics, "sqsinfer_tasks_per_predict_count") == 2
    assert sample(pool.metrics, "sqsinfer_tasks_per_predict_sum") == 2


async def test_a_process_dying_under_several_tasks_fails_only_the_one_that_kills_it(
    model_path, segments
):
    pool = InferencePool(_pool_config(model_path, "tests.handlers:RowScriptedHandler"))
    await pool.start()
    try:
        jobs = [_job(segments, _rows(v)) for v in (0.0, handlers.KILL, -0.5)]
        good, killed, other = await _together(pool, jobs)
        rebuilds = sample(pool.metrics, "sqsinfer_pool_rebuilds_total")
    finally:
        await pool.close()
    assert good.tolist() == [1.0, 1.0]
    assert isinstance(killed, PoolCrashed)  # retried, as a task that kills its process alone
    assert other.tolist() == [0.5, 0.5]
    assert rebuilds == 2  # under the batch, then under the task alone


async def test_a_task_over_the_rows_threshold_is_scored_by_a_call_of_its_own(model_path, segments):
    pool = InferencePool(_pool_config(model_path, "tests.handlers:RowScriptedHandler", 4))
    await pool.start()
    try:
        jobs = [_job(segments, _rows(0.0, n)) for n in (2, 5, 4, 1)]
        found = await _together(pool, jobs)
    finally:
        await pool.close()
    assert [r.tolist() for r in found] == [[1.0] * 2, [1.0] * 5, [1.0] * 4, [1.0]]
    # One call for the three of at most 4 rows, one for the task of 5.
    assert sample(pool.metrics, "sqsinfer_tasks_per_predict_count") == 2
    assert sample(pool.metrics, "sqsinfer_tasks_per_predict_sum") == 4


async def test_a_handler_that_does_not_allow_it_is_never_coalesced(model_path, segments):
    pool = InferencePool(_pool_config(model_path, "tests.handlers:ScriptedHandler"))
    await pool.start()
    try:
        assert pool.coalesce_max_rows == 0
        jobs = [_job(segments, _rows(0.0)) for _ in range(3)]
        async with pool.lease():
            tasks = [asyncio.create_task(pool.compute(job, lambda: None)) for job in jobs]
            await asyncio.sleep(0.2)
            assert not pool.waiting  # each waits for a process of its own
        found = await asyncio.gather(*tasks)
    finally:
        await pool.close()
    assert [synthetic.decode_output(r["body"], "npy").ravel().tolist() for r in found] == [
        [1.0, 1.0]
    ] * 3
    assert sample(pool.metrics, "sqsinfer_tasks_per_predict_count") == 3
    assert sample(pool.metrics, "sqsinfer_tasks_per_predict_sum") == 3


async def _running_batch(pool: InferencePool, jobs: list[inference.Job]) -> list[asyncio.Task]:
    """The jobs' tasks, once their batch has gone to the pool's one process (told to each
    task when it goes, after the call to the process is made)."""
    gone = asyncio.Semaphore(0)
    async with pool.lease():
        tasks = [asyncio.create_task(pool.compute(job, gone.release)) for job in jobs]
        await eventually(lambda: pool.waiting == len(jobs))
    for _ in jobs:
        await gone.acquire()
    assert pool.slots[0].busy
    return tasks


async def test_a_cancelled_task_leaves_its_batch_running_for_the_others(model_path, segments):
    pool = InferencePool(_pool_config(model_path, "tests.handlers:RowScriptedHandler"))
    await pool.start()
    pid = pool.slots[0].pid
    try:
        # The batch sleeps 1 s in the process: the cancel lands while it runs.
        tasks = await _running_batch(pool, [_job(segments, _rows(v)) for v in (0.0, 1.0)])
        tasks[0].cancel()
        with pytest.raises(asyncio.CancelledError):
            await tasks[0]
        kept = await tasks[1]
        assert synthetic.decode_output(kept["body"], "npy").ravel().tolist() == [2.0, 2.0]
        assert pool.slots[0].pid == pid  # its process was not killed for the one cancel
    finally:
        await pool.close()


async def test_a_batch_all_of_whose_tasks_are_cancelled_has_its_process_replaced(
    model_path, segments
):
    pool = InferencePool(_pool_config(model_path, "tests.handlers:RowScriptedHandler"))
    await pool.start()
    pid = pool.slots[0].pid
    try:
        tasks = await _running_batch(pool, [_job(segments, _rows(v)) for v in (30.0, 0.0)])
        for task in tasks:
            task.cancel()
        for task in tasks:
            with pytest.raises(asyncio.CancelledError):
                await task
        # Nobody waits for its 30 s: the process is killed and a fresh one started.
        await eventually(lambda: pool.ready_count == 1 and pool.slots[0].pid != pid)
        assert sample(pool.metrics, "sqsinfer_pool_rebuilds_total") == 1
    finally:
        await pool.close()


async def test_processes_free_at_once_each_take_an_even_share_of_what_waits(model_path, segments):
    config = dataclasses.replace(
        _pool_config(model_path, "tests.handlers:RowScriptedHandler"), processes=2
    )
    pool = InferencePool(config)
    await pool.start()
    try:
        jobs = [_job(segments, _rows(0.0)) for _ in range(4)]
        async with pool.lease(), pool.lease():  # both busy while the tasks come
            tasks = [asyncio.create_task(pool.compute(job, lambda: None)) for job in jobs]
            await eventually(lambda: pool.waiting == len(jobs))
        found = await asyncio.gather(*tasks)
    finally:
        await pool.close()
    assert all(r["rows"] == 2 for r in found)
    # Two calls of two, one on each process: not one of four while the other idles.
    assert sample(pool.metrics, "sqsinfer_tasks_per_predict_count") == 2
    assert sample(pool.metrics, "sqsinfer_tasks_per_predict_bucket", le="2.0") == 2
