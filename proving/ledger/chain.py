"""The three-stage chain the ledger run accounts for: its stages on a stand-in, the fault
proxy in front, a worker per stage, duplicate deliveries, and kills until it drains."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import proving
from proving.chaos.disrupt import Chaos, worker_timings
from proving.chaos.workload import ChaosConfig
from sqsinfer.compute.inference import file_sha256
from sqsinfer.lab import feeder, stage, standin, synthetic

BUCKET = "sqsinfer-ledger"
STAGES = ("stage1", "stage2", "stage3")
FEATURES = 6
_POLL_S = 0.5


@dataclass
class LedgerConfig:
    tasks: int = 5000
    workers_per_stage: int = 1
    seed: int = 1
    rows: int = 20
    duplicate_rate: float = 0.05
    s3_5xx: float = 0.05
    s3_conflict: float = 0.02
    sqs_errors: float = 0.02
    drop: float = 0.01  # answers cut off after the service acted (PUT, GET, receive, delete)
    send_drop: float = 0.02  # next-stage send answers lost after SQS took the message
    reset: float = 0.01  # sends, puts and deletes whose connection is reset (RST) after they acted
    send_reset: float = 0.02  # next-stage sends reset after SQS took the message
    latency_ms: float = 10.0
    child_kills: int = 3  # inference processes SIGKILLed while computing
    worker_kills: int = 3  # workers SIGKILLed (no drain) and restarted, a stage each in turn
    visibility_timeout_s: int = 8
    feed_depth: int = 200
    timeout_s: float = 3600.0
    stand_in: str = "moto"  # or "localstack"


@dataclass
class Chain:
    """What was prepared: the queues, the models, the manifest and what it holds."""

    endpoint: str
    queues: dict[str, str]  # stage -> queue URL, stage-dlq -> its DLQ
    models: dict[str, str]  # stage -> model path
    manifest: str  # the JSONL of what was enqueued
    task_ids: list[str] = field(default_factory=list)
    bodies: list[str] = field(default_factory=list)  # in feeding order, duplicates included

    def sha256(self, name: str) -> str:
        return file_sha256(self.models[name])

    def prefix(self, name: str) -> str:
        return f"s3://{BUCKET}/{name}/"


def prepare(endpoint: str, config: LedgerConfig, workdir: str) -> Chain:
    s3, sqs = standin.clients(endpoint)
    stage.create_bucket(s3, BUCKET, versioned=True)  # an overwrite shows as a second version
    queues: dict[str, str] = {}
    for name in STAGES:
        pair = stage.create_queue(sqs, f"ledger-{name}", max_receive_count=10)
        queues[name], queues[f"{name}-dlq"] = pair.url, pair.dlq_url
    models = {
        "stage1": synthetic.train_model(
            os.path.join(workdir, "m1.ubj"), FEATURES, trees=20, seed=1
        ),
        "stage2": synthetic.train_model(os.path.join(workdir, "m2.ubj"), 1, trees=5, seed=2),
        "stage3": synthetic.train_model(os.path.join(workdir, "m3.ubj"), 1, trees=5, seed=3),
    }
    inputs = {
        f"in/task-{i:05d}.npy": synthetic.encode_input(
            synthetic.make_rows(config.rows, FEATURES, seed=config.seed * 100_000 + i), "npy"
        )
        for i in range(config.tasks)
    }
    uris = stage.put_objects(s3, BUCKET, inputs)
    chain = Chain(endpoint, queues, models, os.path.join(workdir, "tasks.jsonl"))
    rng = random.Random(config.seed)
    with open(chain.manifest, "w") as manifest:
        for key, uri in zip(inputs, uris, strict=True):
            task_id = key.removeprefix("in/").removesuffix(".npy")
            body = json.dumps({"task_id": task_id, "input": uri})
            manifest.write(body + "\n")
            chain.task_ids.append(task_id)
            chain.bodies.append(body)
            if rng.random() < config.duplicate_rate:  # delivered twice, side by side
                chain.bodies.append(body)
    return chain


def start_proxy(
    target: str, config: LedgerConfig, workdir: str
) -> tuple[subprocess.Popen[bytes], str]:
    """The fault proxy the workers reach the stand-in through (set-up and checks do not).
    Send answers are lost or reset on every queue the workers send to: the next stages'
    (and the dead-letter queues', which a run without poison never uses)."""
    port = standin.free_port()
    rates = {
        "--s3-5xx": config.s3_5xx,
        "--s3-conflict": config.s3_conflict,
        "--sqs-errors": config.sqs_errors,
        "--drop": config.drop,
        "--send-drop": config.send_drop,
        "--reset": config.reset,
        "--send-reset": config.send_reset,
        "--latency-ms": config.latency_ms,
    }
    args = [sys.executable, "-m", "proving.faults", "--target", target, "--port", str(port)]
    args += ["--seed", str(config.seed)]
    for flag, value in rates.items():
        args += [flag, str(value)]
    with open(os.path.join(workdir, "proxy.log"), "ab") as log_file:
        process = subprocess.Popen(args, stdout=log_file, stderr=log_file, env=proving.module_env())
    url = f"http://127.0.0.1:{port}"
    _wait_for_proxy(url, process)
    return process, url


def _wait_for_proxy(url: str, process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """Until the proxy answers anything: whatever is behind it (moto, LocalStack) may
    answer its path with an error."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the fault proxy exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/", timeout=1):
                return
        except urllib.error.HTTPError:
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    raise RuntimeError(f"the fault proxy did not answer at {url} within {timeout_s} s")


def _settings(name: str, chain: Chain, endpoint: str, config: LedgerConfig) -> dict[str, str]:
    n = STAGES.index(name)
    reads = f"s3://{BUCKET}/in/" if n == 0 else chain.prefix(STAGES[n - 1])
    next_url = chain.queues[STAGES[n + 1]] if n + 1 < len(STAGES) else ""
    settings = stage.stage_settings(
        endpoint,
        chain.queues[name],
        chain.models[name],
        reads=reads,
        writes=chain.prefix(name),
        next_queue_url=next_url,
    )
    return stage.SHORT_DRAIN | worker_timings(config.visibility_timeout_s) | settings


class Fire(Chaos):
    """The kills: chaos's own (an inference process mid-task, a worker without a drain),
    on three stages."""

    def __init__(self, config: LedgerConfig, workdir: str) -> None:
        super().__init__(ChaosConfig(seed=config.seed), workdir)
        self.ledger = config

    def start_stages(self, chain: Chain, endpoint: str) -> None:
        for name in STAGES:
            for n in range(self.ledger.workers_per_stage):
                settings = _settings(name, chain, endpoint, self.ledger)
                self.workers.append(
                    stage.start_worker(f"{name}-{'abcdefgh'[n]}", settings, self.workdir)
                )

    def plan(self) -> list[tuple[float, Any]]:
        """Kills by the share of tasks finished at the last stage."""
        plan: list[tuple[float, Any]] = []
        for k in range(self.ledger.child_kills):
            plan.append((0.1 + 0.7 * k / max(1, self.ledger.child_kills), self.kill_a_child))
        for k in range(self.ledger.worker_kills):
            victim = self.workers[k % len(self.workers)]
            plan.append((0.2 + 0.6 * k / max(1, self.ledger.worker_kills), _kill(self, victim)))
        return sorted(plan, key=lambda item: item[0])


def _kill(fire: Fire, worker: stage.WorkerProcess) -> Any:
    return lambda: fire.sigkill_and_restart(worker)


def _finished(s3: Any) -> int:
    return sum(1 for key in stage.list_keys(s3, BUCKET, "stage3/") if key.endswith(".npy"))


def run_until_drained(fire: Fire, chain: Chain, feed: feeder.FeedThread) -> bool:
    s3, sqs = standin.clients(chain.endpoint)
    pending = fire.plan()
    deadline = time.monotonic() + fire.ledger.timeout_s
    while time.monotonic() < deadline:
        done = _finished(s3)
        while pending and done >= pending[0][0] * len(chain.task_ids):
            pending.pop(0)[1]()
        if feed.error is not None:
            raise RuntimeError(f"feeding failed: {feed.error}")
        drained = all(stage.queue_depth(sqs, chain.queues[name]) == 0 for name in STAGES)
        if done >= len(chain.task_ids) and not feed.is_alive() and not pending and drained:
            return True
        for worker in fire.workers:
            if worker.process.poll() is not None:
                raise RuntimeError(f"{worker.name} exited unexpectedly:\n{worker.tail_text()}")
        time.sleep(_POLL_S)
    return False


def start_feeding(chain: Chain, depth: int) -> feeder.FeedThread:
    sqs = standin.clients(chain.endpoint)[1]
    url = chain.queues["stage1"]
    feed = feeder.FeedThread(
        feeder.Feeder(sqs, url, feeder.listed(chain.bodies), len(chain.bodies)),
        feeder.keep_depth(sqs, url, depth),
    )
    feed.start()
    return feed
