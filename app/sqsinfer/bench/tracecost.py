"""Micro-benchmark of tracing: the CPU a task's trace costs the worker's process.

The paired runs (`sqsinfer` and `sqsinfer-traced`) give the whole worker's difference,
which a shared machine's other load can blur by more than the cost itself. This isolates
it: a process of its own (`python -m sqsinfer.bench.tracecost`) makes the tracing calls
the worker makes for committed first deliveries at medium (receives of `BATCH`
messages, each task's phases, compute and delete, a batched delete), then exports
everything and stops; its CPU (the calls, and the span processor's thread that encodes
and sends) per task is the cost, the calls' own thread's part given apart. Run once
traced, every span exported to the bench's receiver, and once with OTEL_SDK_DISABLED=true:
the switched-off hooks. A sampler named in the bench's environment applies to the traced
run, as to the `sqsinfer-traced` scenario (every task sampled otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from sqsinfer import tracing
from sqsinfer.aws.sqs import Message
from sqsinfer.bench.otlp import SAMPLER_VARIABLES, OtlpReceiver, count_spans
from sqsinfer.metrics import Phase
from sqsinfer.outcomes import Outcome
from sqsinfer.worker.pipeline import STEP_SPANS, compute_events, end_trace

BATCH = 5  # messages per receive and per delete call (the medium worker's, about)
_QUEUE = "https://sqs.us-east-1.amazonaws.com/000000000000/bench"
# A medium task's steps that are spans, in seconds (their values do not change the cost).
_STEPS = ((Phase.S3_GET, 0.02), (Phase.WAIT_PROCESS, 0.05), (Phase.COMMIT, 0.015))
_CHILD = {"decode_s": 0.0007, "infer_s": 0.022, "encode_s": 0.0004, "rows": 10_000}


def replay(tasks: int) -> dict[str, Any]:
    """Trace `tasks` tasks as the worker does; CPU ms per task, export included."""
    tracer = tracing.from_env(service_instance="bench", component="worker")
    started, calls_started = time.process_time(), time.thread_time()
    for first in range(0, tasks, BATCH):
        messages = [Message(f"m{first + i}", "rh", "{}", 1) for i in range(BATCH)]
        tracer.received(_QUEUE, 0.02, messages)
        for message in messages:
            trace = message.trace
            tracing.enter(trace)
            for phase, seconds in _STEPS:
                trace.step(STEP_SPANS[phase], seconds)
            events = compute_events(0.026, _CHILD)
            trace.step("compute", 0.026, attributes={"sqsinfer.rows": 10_000}, events=events)
            trace.step("delete", 0.01)
            trace.exemplar()
            end_trace(trace, Outcome.COMMITTED, "", 0.2, None)
        with tracing.batch("DeleteMessageBatch", _QUEUE, [m.trace for m in messages]):
            pass
    calls_s = time.thread_time() - calls_started
    flushed = tracer.shutdown(60.0)
    spent_s = time.process_time() - started
    return {
        "cpu_ms_per_task": round(spent_s / tasks * 1000, 4),
        # This thread's calls; the rest is the span processor's thread (encode, send).
        "calls_cpu_ms_per_task": round(calls_s / tasks * 1000, 4),
        "flushed": flushed,
    }


def measure(tasks: int) -> dict[str, Any]:
    """The replay traced (into a receiver here) and switched off, each in its own process."""
    # A queue that holds every span: a full one drops what comes (the SDK's default is
    # 2,048 items, which the replay fills in a moment) and what is dropped costs nothing.
    queue = {"OTEL_BSP_MAX_QUEUE_SIZE": str(tasks * 8)}
    with OtlpReceiver(keep=True) as receiver:
        variables = receiver.traced_env()
        traced = _run(tasks, variables | queue)
        spans_bytes = receiver.received_bytes
        spans = sum(count_spans(body) for body in receiver.kept())
    off = _run(tasks, {"OTEL_SDK_DISABLED": "true"})
    return {
        "tasks": tasks,
        "traced_cpu_ms_per_task": traced["cpu_ms_per_task"],
        "off_cpu_ms_per_task": off["cpu_ms_per_task"],
        "cpu_ms_per_task": round(traced["cpu_ms_per_task"] - off["cpu_ms_per_task"], 4),
        "calls_cpu_ms_per_task": round(
            traced["calls_cpu_ms_per_task"] - off["calls_cpu_ms_per_task"], 4
        ),
        "exported_bytes_per_task": round(spans_bytes / tasks),
        "exported_spans_per_task": round(spans / tasks, 2),
        "flushed": traced["flushed"],
        "sampler": " ".join(variables.get(k, "") for k in SAMPLER_VARIABLES).strip(),
    }


def _run(tasks: int, variables: dict[str, str]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | variables
    done = subprocess.run(
        [sys.executable, "-m", "sqsinfer.bench.tracecost", str(tasks)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


if __name__ == "__main__":
    print(json.dumps(replay(int(sys.argv[1]))))
