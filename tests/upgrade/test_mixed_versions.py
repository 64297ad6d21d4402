"""The previous release and this tree side by side on one two-stage chain.

A rolling update runs two versions on one queue, so each release must lose nothing
beside the one before it (docs/upgrading.md). On a moto server: stage 1 and stage 2, each
with a dead-letter queue; on stage 2 a worker of each version throughout, on stage 1 one
of each at a time or side by side; each is the `sqsinfer worker` command of its own venv
(the previous release's from `previous.py`). Some tasks are sent twice.

Twice, a stage-1 worker starts behind a proxy that holds its next-stage sends, takes part
of a batch while the other version works beside it, and is SIGKILLed with its proxy: it
dies between chain intents and their sends, with nothing left in flight to land later.
Its messages come back to the other version alone, which must send every link the dead
one never did (a worker that took the dead one's intent for a sent link would delete the
message, and the task would never reach stage 2). This tree's worker dies first, then
the previous release's.

Then, from S3 and the queues: every task has exactly one output per stage, every chain
marker says sent, both stages' queues and dead-letter queues are empty, and the stage-2
messages beyond one per task are within what the stage-1 workers of both versions
report in `sqsinfer_chain_duplicates_total` (at least `certain`, at most `possible`).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sqsinfer.lab import stage, standin, synthetic
from tests.upgrade import previous

BATCH = 20  # tasks per round
SENT_TWICE = 5  # of each batch, tasks whose message is sent a second time
N_FEATURES = 8
ROWS = 20
MAX_RECEIVE_COUNT = 6  # each kill and takeover spends a receive
HELD_EACH = 2  # next-stage messages each stage-1 worker holds when it is killed
WAIT_S = 240.0
SETTINGS = stage.SHORT_DRAIN | {
    "SQSINFER_PROCESSES": "1",
    "SQSINFER_WAIT_TIME_S": "1",
    "SQSINFER_VISIBILITY_TIMEOUT_S": "6",
    "SQSINFER_HEARTBEAT_S": "2",
    "SQSINFER_CHAIN_SETTLE_S": "3",
    "SQSINFER_RETRY_BASE_S": "1",
    "SQSINFER_RETRY_MAX_S": "4",
}
NEW = [str(Path(sys.executable).with_name("sqsinfer"))]  # this tree's, in the test's venv


@pytest.fixture(scope="module")
def old() -> previous.Release:
    return previous.ensure(previous.named())


@dataclass
class Worker(stage.WorkerProcess):
    """`sqsinfer worker` of a given venv, run in its own folder (so that a spawned process,
    whose path starts with its working directory, can import nothing from this tree)."""

    command: list[str] = field(default_factory=list)
    cwd: str = ""

    def start(self) -> None:
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                [*self.command, "worker"],
                env=self.env,
                cwd=self.cwd,
                stdout=log_file,
                stderr=log_file,
                stdin=subprocess.DEVNULL,
            )

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def duplicates(self) -> dict[str, float]:
        """sqsinfer_chain_duplicates_total by kind, from /metrics."""
        found = {"certain": 0.0, "possible": 0.0}
        for line in self.metrics_text().splitlines():
            if line.startswith("sqsinfer_chain_duplicates_total{"):
                found[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
        return found

    def ended_message_ids(self) -> set[str]:
        """Messages this worker finished for good (not retried or released), from its log."""
        return {
            str(r["message_id"])
            for r in self.log_records()
            if r.get("msg") == "task finished"
            and r.get("outcome") in ("committed", "duplicate", "rejected")
        }


@dataclass
class Chain:
    endpoint: str
    s3: Any
    sqs: Any
    bucket: str
    queues: dict[str, str]
    models: dict[str, str]
    workdir: Path
    running: list[Worker] = field(default_factory=list)

    def settings(self, name: str, endpoint: str) -> dict[str, str]:
        chain = stage.chain_settings(endpoint, self.queues, self.models, self.bucket)
        return SETTINGS | chain[name]

    def start(self, name: str, command: list[str], stage_name: str, endpoint: str = "") -> Worker:
        port = standin.free_port()
        env = stage.worker_env(name, self.settings(stage_name, endpoint or self.endpoint), port)
        env.pop("PYTHONPATH", None)
        log_path = str(self.workdir / f"{name}.log")
        worker = Worker(name, env, log_path, port, command=command, cwd=str(self.workdir))
        worker.start()
        self.running.append(worker)
        return worker

    def depth(self, queue: str) -> int:
        return stage.queue_depth(self.sqs, self.queues[queue])

    def keys(self, prefix: str) -> set[str]:
        return set(stage.list_keys(self.s3, self.bucket, prefix))

    def marker_state(self, key: str) -> str:
        head = self.s3.head_object(Bucket=self.bucket, Key=key)
        return str(head["Metadata"].get("chain-state", "(none)"))

    def logs(self) -> str:
        return "\n".join(f"--- {w.name}\n{w.tail_text(15)}" for w in self.running)


@contextlib.contextmanager
def holding_proxy(target: str, record: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The proxy that holds every send (holding_proxy.py), as a process of its own."""
    port = standin.free_port()
    args = [sys.executable, "-m", "tests.upgrade.holding_proxy", target, str(port), str(record)]
    root = str(Path(__file__).resolve().parents[2])
    proxy = subprocess.Popen(args, cwd=root, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(url) or proxy.poll() is not None, "the holding proxy")
        assert proxy.poll() is None, "the holding proxy exited"
        yield url, proxy
    finally:
        proxy.kill()
        proxy.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True  # an answer: the proxy forwarded to the stand-in
    except OSError:
        return False


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.2)


def held(record: Path, queue_url: str) -> int:
    """Next-stage messages a worker asked for through its holding proxy."""
    if not record.exists():
        return 0
    lines = record.read_text().splitlines()
    return sum(1 for line in lines if line and json.loads(line)["queue"] == queue_url)


def make_chain(moto: standin.MotoServer, workdir: Path) -> Chain:
    s3, sqs = standin.clients(moto.url)
    bucket = stage.create_bucket(s3, "up" + uuid.uuid4().hex[:10])
    queues: dict[str, str] = {}
    for name in ("stage1", "stage2"):
        pair = stage.create_queue(sqs, f"{bucket}-{name}", max_receive_count=MAX_RECEIVE_COUNT)
        queues[name], queues[f"{name}-dlq"] = pair.url, pair.dlq_url
    models = {
        "stage1": synthetic.train_model(str(workdir / "m1.ubj"), N_FEATURES, trees=10, seed=3),
        "stage2": synthetic.train_model(str(workdir / "m2.ubj"), 1, trees=5, seed=4),
    }
    return Chain(moto.url, s3, sqs, bucket, queues, models, workdir)


def feed(chain: Chain, first: int, count: int) -> list[str]:
    """`count` inputs and their messages from task number `first`, some sent twice."""
    tasks = [f"t{i:03d}" for i in range(first, first + count)]
    objects = {
        f"in/{t}.npy": synthetic.encode_input(synthetic.make_rows(ROWS, N_FEATURES, i), "npy")
        for i, t in enumerate(tasks, start=first)
    }
    stage.put_objects(chain.s3, chain.bucket, objects)
    bodies = [json.dumps({"task_id": t, "input": f"s3://{chain.bucket}/in/{t}.npy"}) for t in tasks]
    for body in bodies + bodies[:SENT_TWICE]:
        chain.sqs.send_message(QueueUrl=chain.queues["stage1"], MessageBody=body)
    return tasks


def dies_holding_links(
    chain: Chain, name: str, command: list[str], record: Path, first: int
) -> list[str]:
    """A stage-1 worker behind a holding proxy takes part of a batch, holds HELD_EACH of
    its next-stage sends, and is SIGKILLed with its proxy while the other version works
    beside it. Returns the batch's tasks once the other version has finished them all."""
    with holding_proxy(chain.endpoint, record) as (proxy_url, _):
        doomed = chain.start(name, command, "stage1", proxy_url)
        stage.wait_ready([doomed], timeout_s=120)
        tasks = feed(chain, first, BATCH)
        wait_for(
            lambda: held(record, chain.queues["stage2"]) >= HELD_EACH,
            f"{name} holding {HELD_EACH} next-stage sends",
        )
        doomed.kill()
        chain.running.remove(doomed)
    # Its messages come back once their visibility lapses, to the other version alone,
    # which must send each link the dead one never did before it deletes the message.
    wait_for(lambda: chain.depth("stage1") == 0, f"stage 1 empty after {name} died")
    keys = [f"stage1/{t}.npy.chain" for t in tasks]
    states = {k: chain.marker_state(k) for k in keys}
    assert states == dict.fromkeys(keys, "sent"), f"links lost after {name} died"
    return tasks


def test_previous_release_and_this_one_share_a_chain(
    moto: standin.MotoServer, old: previous.Release, tmp_path: Path
) -> None:
    chain = make_chain(moto, tmp_path)
    try:
        chain.start("stage2-old", old.command, "stage2")
        chain.start("stage2-new", NEW, "stage2")
        chain.start("stage1-old", old.command, "stage1")
        stage.wait_ready(chain.running, timeout_s=120)
        # This tree's worker dies between intents and sends; the previous release's
        # takes its links over. Then the other way round.
        tasks = dies_holding_links(chain, "stage1-new-held", NEW, tmp_path / "held-new", 0)
        old1 = next(w for w in chain.running if w.name == "stage1-old")
        new1 = chain.start("stage1-new", NEW, "stage1")
        stage.wait_ready([new1], timeout_s=120)
        retired = [old1.duplicates()]  # what it counted dies with it
        assert old1.stop() == 0  # drained, as a rolling update stops it
        chain.running.remove(old1)
        record = tmp_path / "held-old"
        tasks += dies_holding_links(chain, "stage1-old-held", old.command, record, BATCH)
        stage.wait_ready([chain.start("stage1-old-again", old.command, "stage1")], 120)

        stage1_keys = {f"stage1/{t}.npy" for t in tasks}
        stage2_keys = {f"stage2/{t}.npy" for t in tasks}
        markers = {k + ".chain" for k in stage1_keys}
        wait_for(
            lambda: (
                chain.keys("stage2/") >= stage2_keys
                and all(chain.depth(q) == 0 for q in chain.queues)
            ),
            "every task through both stages, every queue empty",
        )
        assert chain.keys("stage1/") == stage1_keys | markers
        assert chain.keys("stage2/") == stage2_keys  # one output each, and no marker
        assert {k: chain.marker_state(k) for k in markers} == dict.fromkeys(markers, "sent")

        stage1 = [w for w in chain.running if w.name.startswith("stage1")]
        stage2 = [w for w in chain.running if w.name.startswith("stage2")]
        # The killed workers' counts died with them, but so did their held sends.
        counted = [w.duplicates() for w in stage1] + retired
        certain = sum(c["certain"] for c in counted)
        possible = sum(c["possible"] for c in counted)
        stage2_messages = set().union(*(w.ended_message_ids() for w in stage2))
        extra = len(stage2_messages) - len(tasks)
        assert certain <= extra <= possible, (certain, extra, possible)
        assert possible >= 2 * HELD_EACH  # each dead worker's links taken over, in doubt
        assert [w.stop() for w in chain.running] == [0] * len(chain.running)
    except BaseException:
        print(chain.logs(), file=sys.stderr)
        raise
    finally:
        for worker in chain.running:
            if worker.process.poll() is None:
                worker.process.kill()
