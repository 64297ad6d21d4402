"""Micro-benchmarks of the pool: handing a 2 MB input to a process, and pool start-up.

Each handoff is one task on a real pool slot (`InferencePool`, the worker's own code):
the child maps or unpickles the input and views it as an array, and reports how long
that took; the handoff is the round trip minus the child's own time — the same
definition as the worker's `handoff` phase.

- shared memory: the worker's way. The input's bytes are already in a segment (the S3
  body is streamed there), and the task carries only its name.
- pickle: the array itself as the task's argument.
- raw bytes: the `.npy` file's bytes as the argument; the child decodes them.
"""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from sqsinfer.bench import probe
from sqsinfer.lab import synthetic
from sqsinfer.shm import SharedInput
from sqsinfer.worker.pool import InferencePool, PoolConfig

HANDOFF_ROWS, HANDOFF_FEATURES = 10_000, 50  # 2 MB of float32


def _view_npy(buf: memoryview) -> int:
    """The child's work in every method: view the .npy bytes as an array (no copy)."""
    head = io.BytesIO(bytes(buf[:128]))
    np.lib.format.read_magic(head)
    shape, _, dtype = np.lib.format.read_array_header_1_0(head)
    array = np.frombuffer(buf, dtype=dtype, count=shape[0] * shape[1], offset=head.tell())
    return int(array.shape[0])


def child_noop() -> float:
    return 0.0


def child_shared(name: str, size: int) -> float:
    """Map the segment as the worker's child does (`inference.run_task`) and time the
    view only: mapping counts as handoff, as it does in the worker's own phase."""
    shm = shared_memory.SharedMemory(name=name)
    assert shm.buf is not None
    buf = shm.buf[:size]
    started = time.perf_counter()
    _view_npy(buf)
    elapsed = time.perf_counter() - started
    buf.release()
    shm.close()
    return elapsed


def child_array(array: np.ndarray) -> float:
    started = time.perf_counter()
    _ = array.shape  # already unpickled before this call
    return time.perf_counter() - started


def child_bytes(data: bytes) -> float:
    started = time.perf_counter()
    _view_npy(memoryview(data))
    return time.perf_counter() - started


def _stats_ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median": round(statistics.median(ordered) * 1000, 4),
        "p90": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 4),
    }


async def _time_method(
    pool: InferencePool, reps: int, fn: Callable[..., float], *args: Any
) -> dict[str, Any]:
    """Round trip and handoff per task; and the CPU both sides spend on it per task."""
    child = pool.slots[0].pid
    trips, handoffs = [], []
    child_cpu = parent_cpu = 0.0
    for i in range(reps + 3):
        if i == 3:  # the first few warm the pipes and the child's imports
            child_cpu, parent_cpu = probe.precise_cpu_seconds(child), time.process_time()
        async with pool.lease() as lease:
            started = time.perf_counter()
            child_s = await lease.run(fn, *args)
            trip = time.perf_counter() - started
        if i >= 3:
            trips.append(trip)
            handoffs.append(max(0.0, trip - child_s))
    child_cpu = probe.precise_cpu_seconds(child) - child_cpu
    parent_cpu = time.process_time() - parent_cpu
    return {
        "round_trip_ms": _stats_ms(trips),
        "handoff_ms": _stats_ms(handoffs),
        "cpu_ms_per_task": {
            "parent": round(parent_cpu / reps * 1000, 4),
            "child": round(child_cpu / reps * 1000, 4),
        },
    }


def _pool_config(model_path: str, processes: int, handler: str) -> PoolConfig:
    return PoolConfig(
        processes=processes,
        handler=handler,
        model_path=model_path,
        threads=1,
        model_sha256="",
        max_decoded_bytes=256 * 2**20,
    )


async def handoff_benchmark(model_path: str, reps: int, handler: str) -> dict[str, Any]:
    """Round trip and handoff of a 2 MB array by each method, on a one-process pool."""
    array = synthetic.make_rows(HANDOFF_ROWS, HANDOFF_FEATURES, seed=7)
    data = synthetic.encode_input(array, "npy")
    pool = InferencePool(_pool_config(model_path, 1, handler))
    await pool.start()
    try:
        shared = SharedInput(len(data))
        copy_started = time.perf_counter()
        shared.write_at(0, data)
        copy_s = time.perf_counter() - copy_started
        with shared:
            methods = {
                "no_payload": await _time_method(pool, reps, child_noop),
                "shared_memory": await _time_method(
                    pool, reps, child_shared, shared.name, len(data)
                ),
                "pickle_array": await _time_method(pool, reps, child_array, array),
                "raw_bytes": await _time_method(pool, reps, child_bytes, data),
            }
    finally:
        await pool.close()
    return {
        "array_bytes": len(data),
        "shape": [HANDOFF_ROWS, HANDOFF_FEATURES],
        "repetitions": reps,
        "copy_into_shared_memory_ms": round(copy_s * 1000, 4),
        "methods": methods,
    }


async def pool_startup(
    model_path: str, processes: int, repeats: int, handler: str
) -> dict[str, Any]:
    """Seconds from spawning the pool to every process warmed up (model loaded, predicted)."""
    times = []
    for _ in range(repeats):
        pool = InferencePool(_pool_config(model_path, processes, handler))
        await pool.start()
        times.append(pool.startup_s)
        await pool.close()
    return {
        "processes": processes,
        "runs_s": [round(t, 3) for t in times],
        "median_s": round(statistics.median(times), 3),
    }
