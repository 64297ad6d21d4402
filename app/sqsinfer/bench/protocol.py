"""What every bench scenario's process tree shares: its JSON line protocol and set-up.

Scenarios report to the runner as the worker does, one JSON object per line on
stderr: `{"msg": "ready"}` once loaded, then `{"msg": "task finished", ...}` per task.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import orjson

from sqsinfer.bench.workload import Regime
from sqsinfer.compute.inference import THREAD_VARS

SPAWN = multiprocessing.get_context("spawn")


def emit(doc: dict[str, Any]) -> None:
    """One JSON line on stderr, in a single write (lines from processes never interleave)."""
    os.write(2, orjson.dumps(doc) + b"\n")


def task_finished(seconds: float, phases: dict[str, float]) -> None:
    emit(
        {
            "msg": "task finished",
            "outcome": "committed",
            "seconds": round(seconds, 6),
            "phases": {k: round(v, 6) for k, v in phases.items()},
        }
    )


def pin_threads(threads: int) -> None:
    for var in THREAD_VARS:
        os.environ[var] = str(threads)


def regime_of(cfg: dict[str, Any]) -> Regime:
    return Regime(**cfg["regime"])


# -- compute-only ------------------------------------------------------------------------
