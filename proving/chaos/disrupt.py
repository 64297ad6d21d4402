"""The cluster under fire: the fault proxy in front of the stand-in, two stages of
workers, and the kills (inference processes mid-task, a worker SIGTERMed, another
SIGKILLed), each restarted, until the queues drain."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import proving
from proving.chaos.workload import BUCKET, SLOW_PREFIX, ChaosConfig, queue_name
from proving.faults import SDK_ATTEMPTS
from sqsinfer.lab import stage, standin
from sqsinfer.worker.chain import WRITE_ATTEMPTS

if TYPE_CHECKING:  # imported where used: without the local extra the command says so
    import psutil


PROXY_LOG = "proxy.log"
SENDS = "sends.jsonl"  # every message the workers sent, as the proxy recorded it
_POLL_S = 0.5
EXTENSIONS_METRIC = "sqsinfer_visibility_extensions_total"


# A slow task's input read is held this many visibility timeouts. The stalled call is
# the first extension of its message, sent within a timeout of the receive (else the
# message lapsed, which the verdict finds anyway); the hold must outlast that call by a
# timeout to prove anything, which leaves a whole timeout to spare on a loaded machine.
SLOW_READ_TIMEOUTS = 3


def _visibility_faults(config: ChaosConfig) -> list[str]:
    """Slow tasks, whose messages the keeper must extend, and stalled extensions."""
    slow = ["--slow-read", f"{SLOW_PREFIX}={SLOW_READ_TIMEOUTS * config.visibility_timeout_s}"]
    if not config.visibility_delay_calls:  # (0 calls would mean no limit to the proxy)
        return slow
    return [
        *slow,
        # Only extensions (they ask for the whole timeout; hand-backs for less) of the
        # slow tasks' messages, each receipt's at most once: one stalled call per
        # delivery of a slow task, and its retry gets through.
        "--visibility-delay-s",
        str(config.visibility_delay_s),
        "--visibility-delay-rate",
        str(config.visibility_delay_rate),
        "--visibility-delay-calls",
        str(config.visibility_delay_calls),
        "--visibility-delay-min-s",
        str(config.visibility_timeout_s),
        "--visibility-delay-once",
        "--visibility-delay-slow-only",
    ]


def start_proxy(
    target: str, config: ChaosConfig, workdir: str, queues: dict[str, str]
) -> tuple[subprocess.Popen[bytes], str]:
    port = standin.free_port()
    args = [
        sys.executable,
        "-m",
        "proving.faults",
        "--target",
        target,
        "--port",
        str(port),
        "--seed",
        str(config.seed),
        "--s3-5xx",
        str(config.s3_5xx),
        "--s3-conflict",
        str(config.s3_conflict),
        "--sqs-errors",
        str(config.sqs_errors),
        "--latency-ms",
        str(config.latency_ms),
        "--drop",
        str(config.drop),
        # Sends (to stage 2 and to the DLQs), puts and deletes: answers reset (RST).
        "--reset",
        str(config.reset),
        # Answers lost only for stage 1's sends to stage 2: a duplicate there is counted.
        "--send-drop",
        str(config.send_drop),
        "--send-drop-queue",
        queue_name(queues["stage2"]),
        "--send-reset",
        str(config.send_reset),
        "--send-reset-queue",
        queue_name(queues["stage2"]),
        # Bursts on the "sent" record (now created, If-None-Match, by the output's writer)
        # from just past the SDK's attempts (the worker's own retries recover) to past the
        # worker's too (the link is taken over later).
        "--marker-failures",
        str(config.marker_failures),
        "--marker-burst",
        str(SDK_ATTEMPTS),
        "--marker-burst-max",
        str(SDK_ATTEMPTS * (WRITE_ATTEMPTS + 1)),
        *_visibility_faults(config),
        "--record-sends",
        os.path.join(workdir, SENDS),
    ]
    with open(os.path.join(workdir, PROXY_LOG), "ab") as log_file:
        process = subprocess.Popen(args, stdout=log_file, stderr=log_file, env=proving.module_env())
    url = f"http://127.0.0.1:{port}"
    standin.wait_until_up(url, process)
    return process, url


def worker_timings(visibility_timeout_s: int) -> dict[str, str]:
    """A worker under fire: one process, short polls, retries and settles, and a
    visibility timeout short enough that a killed worker's messages soon come back."""
    return {
        "SQSINFER_PROCESSES": "1",
        "SQSINFER_WAIT_TIME_S": "1",
        "SQSINFER_VISIBILITY_TIMEOUT_S": str(visibility_timeout_s),
        "SQSINFER_HEARTBEAT_S": str(max(1, visibility_timeout_s // 3)),
        "SQSINFER_RETRY_BASE_S": "1",
        "SQSINFER_RETRY_MAX_S": "8",
        "SQSINFER_CHAIN_SETTLE_S": "4",
    }


def _settings(
    name: str, queues: dict[str, str], endpoint: str, models: dict[str, str], config: ChaosConfig
) -> dict[str, str]:
    timings = worker_timings(config.visibility_timeout_s)
    which = name.split("-", maxsplit=1)[0]
    if which == "stage1" and config.s3_events:  # its bucket's events, and task messages
        timings["SQSINFER_MESSAGE_SHAPE"] = "auto"
    return (
        stage.SHORT_DRAIN | timings | stage.chain_settings(endpoint, queues, models, BUCKET)[which]
    )


def _computing(process: psutil.Process) -> bool:
    """Seen on a CPU twice a millisecond apart: most likely inside a prediction."""
    import psutil

    try:
        if process.status() != psutil.STATUS_RUNNING:
            return False
        time.sleep(0.001)
        return bool(process.status() == psutil.STATUS_RUNNING)
    except psutil.Error:
        return False


@dataclass
class Events:
    """What chaos did, for the report."""

    child_kills: int = 0
    sigterm_exit: int | None = None
    sigkills: int = 0
    log: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        self.log.append(f"{time.strftime('%H:%M:%S')} {text}")


class Chaos:
    def __init__(self, config: ChaosConfig, workdir: str) -> None:
        self.config = config
        self.workdir = workdir
        self.events = Events()
        self.rng = random.Random(config.seed)
        self.workers: list[stage.WorkerProcess] = []
        self.extensions = 0.0  # sqsinfer_visibility_extensions of every worker process

    def count_extensions(self, worker: stage.WorkerProcess) -> None:
        """Add a worker's extensions so far (read before it stops: counters die with it)."""
        with contextlib.suppress(OSError):
            self.extensions += worker.counter(EXTENSIONS_METRIC)

    def start_workers(self, queues: dict[str, str], endpoint: str, models: dict[str, str]) -> None:
        for which in ("stage1", "stage2"):
            for n in range(self.config.workers_per_stage):
                name = f"{which}-{'abcdefgh'[n]}"
                settings = _settings(name, queues, endpoint, models, self.config)
                self.workers.append(stage.start_worker(name, settings, self.workdir))

    def kill_a_child(self) -> None:
        """SIGKILL an inference process, one caught computing if possible (up to 2 s)."""
        deadline = time.monotonic() + 2.0
        while True:
            candidates = [(w, c) for w in self.workers for c in w.pool_children()]
            busy = [(w, c) for w, c in candidates if _computing(c)]
            if busy or (candidates and time.monotonic() > deadline):
                worker, child = self.rng.choice(busy or candidates)
                child.kill()
                self.events.child_kills += 1
                state = "seen computing" if busy else "none seen computing"
                self.events.note(f"SIGKILL inference process of {worker.name} ({state})")
                return
            time.sleep(0.005)

    def sigterm_and_restart(self, worker: stage.WorkerProcess) -> None:
        self.count_extensions(worker)
        self.events.sigterm_exit = worker.stop()
        self.events.note(f"SIGTERM {worker.name}: exit {self.events.sigterm_exit}; restarted")
        worker.start()

    def sigkill_and_restart(self, worker: stage.WorkerProcess) -> None:
        # A pod killed outright: the worker and its processes, no drain, no release.
        self.count_extensions(worker)
        for child in worker.pool_children():
            child.kill()
        worker.process.kill()
        worker.process.wait()
        self.events.sigkills += 1
        self.events.note(f"SIGKILL {worker.name} (no drain); restarted")
        worker.start()

    def schedule(self) -> list[tuple[float, Any]]:
        """Actions by the fraction of tasks finished at stage 2."""
        plan: list[tuple[float, Any]] = []
        for k in range(self.config.child_kills):
            plan.append((0.15 + 0.6 * k / max(1, self.config.child_kills), self.kill_a_child))
        stage1 = [w for w in self.workers if w.name.startswith("stage1")]
        stage2 = [w for w in self.workers if w.name.startswith("stage2")]
        plan.append((0.25, lambda: self.sigterm_and_restart(stage1[0])))
        plan.append((0.45, lambda: self.sigkill_and_restart(stage2[-1])))
        return sorted(plan, key=lambda item: item[0])


def _count_outputs(s3: Any, prefix: str) -> int:
    count = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        count += sum(1 for item in page.get("Contents", []) if item["Key"].endswith(".npy"))
    return count


class Feeding(Protocol):
    """A thread that feeds stage 1 (the feeder, the uploader, the relay)."""

    error: BaseException | None

    def is_alive(self) -> bool: ...


def run_until_drained(
    chaos: Chaos, feeds: list[Feeding], endpoint: str, queues: dict[str, str], tasks: int
) -> bool:
    s3, sqs = standin.clients(endpoint)
    pending = chaos.schedule()
    deadline = time.monotonic() + chaos.config.timeout_s
    while time.monotonic() < deadline:
        done = _count_outputs(s3, "stage2/")
        while pending and done >= pending[0][0] * tasks:
            pending.pop(0)[1]()
        failed = [feed.error for feed in feeds if feed.error is not None]
        if failed:
            raise RuntimeError(f"feeding failed: {failed[0]}")
        if (
            done >= tasks
            and not any(feed.is_alive() for feed in feeds)
            and not pending
            and all(stage.queue_depth(sqs, queues[q]) == 0 for q in ("stage1", "stage2"))
        ):
            return True
        for worker in chaos.workers:
            if worker.process.poll() is not None:
                raise RuntimeError(f"{worker.name} exited unexpectedly:\n{worker.tail_text()}")
        time.sleep(_POLL_S)
    return False
