"""`python -m proving.chaos`: a two-stage chain run under fire, then checked from S3 and the queues.

At once: duplicate deliveries, inference processes SIGKILLed mid-task, a worker SIGTERMed
and restarted, another SIGKILLed (no drain at all) and restarted, S3 5xx and 409s, SQS
errors, latency and dropped connections from the fault proxy, next-stage sends whose
answer is lost after SQS took the message, bursts of 503s on the chain marker's "sent"
record, visibility extensions stalled past the visibility timeout while slow tasks hold
their messages, poison messages of several kinds, messages whose JSON escapes characters
SQS refuses, and tasks whose output a producer created first under another task id.
Then, from S3 and the queues alone: every valid task has exactly one correct output per
stage, no output was ever overwritten (bucket versioning), every chain link is recorded
as sent, the queues are empty with nothing in flight, and the dead-letter queue holds
exactly the poison, refused and squatted messages, each with its reason, none without
one. From what the proxy recorded: every message a worker sent is one AWS would accept,
and stage 2 was handed the params stage 1 got. And from the logs: the downstream
duplicates stage 2 received are no more than stage 1 counted, and no message lapsed
while a worker held it. Exit status 1 on any loss.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

import proving
from proving.faults import SDK_ATTEMPTS, json_object
from proving.sqs_rules import unsendable
from sqsinfer.lab import feeder, stage, standin, synthetic
from sqsinfer.limits import SQS_DEFAULT_MAX_MESSAGE_BYTES
from sqsinfer.logs import Event
from sqsinfer.worker.chain import WRITE_ATTEMPTS

if TYPE_CHECKING:  # imported where used: the CLI builds this parser in every install
    import psutil

BUCKET = "sqsinfer-chaos"
FEATURES = 6
_POLL_S = 0.5
# Characters SQS refuses in a message, as the non-XML messages carry them (JSON-escaped).
NOT_XML = "\uffff\ufffe\x00\x01\x08\x1f"
EXTENSIONS_METRIC = "sqsinfer_visibility_extensions_total"
SLOW_PREFIX = "in/slow-"  # the inputs of the slow tasks: their reads are held
PROXY_LOG = "proxy.log"
SENDS = "sends.jsonl"  # every message the workers sent, as the proxy recorded it


@dataclass
class ChaosConfig:
    tasks: int = 2000
    workers_per_stage: int = 2
    seed: int = 1
    rows: int = 2000  # a few ms of compute: enough for a kill to land mid-task
    s3_5xx: float = 0.10
    s3_conflict: float = 0.02
    sqs_errors: float = 0.02
    latency_ms: float = 20.0
    drop: float = 0.01
    send_drop: float = 0.02  # next-stage SendMessage answers lost after SQS took the message
    marker_failures: float = 0.02  # chain markers whose "sent" record meets a burst of 503s
    poison_rate: float = 0.01
    squatters: int = 5  # tasks whose output a producer created first, under another task id
    non_xml: int = 2  # sets of messages with characters SQS refuses (six kinds a set)
    duplicate_rate: float = 0.05
    child_kills: int = 3
    visibility_timeout_s: int = 8
    # Tasks fed first whose input read the proxy holds two visibility timeouts: held
    # messages the keeper must extend while their extensions stall.
    slow_tasks: int = 4
    # Extension calls held this long, past the timeout: the first ones (at rate 1), so
    # the slow tasks' first extensions are among them; each message's at most once.
    visibility_delay_s: float = 12.0
    visibility_delay_rate: float = 1.0
    visibility_delay_calls: int = 4
    feed_depth: int = 100
    timeout_s: float = 1200.0
    logs_dir: str = ""  # keep the workers' and the proxy's logs here


@dataclass
class Workload:
    valid: dict[str, np.ndarray] = field(default_factory=dict)
    poison: dict[str, str] = field(default_factory=dict)  # body → expected reason
    bodies: list[str] = field(default_factory=list)  # in feeding order
    duplicates: int = 0
    squatted: dict[str, bytes] = field(default_factory=dict)  # output key -> producer's bytes
    params: dict[str, dict[str, Any]] = field(default_factory=dict)  # task id -> its params

    def add_valid(
        self, s3: Any, task_id: str, rows: np.ndarray, params: dict[str, Any] | None = None
    ) -> str:
        """Upload a valid task's input; its message body (JSON, non-ASCII escaped)."""
        self.valid[task_id] = rows
        key = f"in/{task_id}.npy"
        s3.put_object(Bucket=BUCKET, Key=key, Body=synthetic.encode_input(rows, "npy"))
        doc: dict[str, Any] = {"task_id": task_id, "input": f"s3://{BUCKET}/{key}"}
        if params is not None:
            self.params[task_id] = params
            doc["params"] = params
        return json.dumps(doc)

    def scatter(self, bodies: list[str]) -> None:
        """Spread these bodies evenly through the feeding order."""
        for i, body in enumerate(bodies):
            self.bodies.insert((i + 1) * len(self.bodies) // (len(bodies) + 1), body)


# -- preparing the workload ---------------------------------------------------------------


def _poison(s3: Any, i: int) -> tuple[str, str]:
    """The i-th poison message and the reason it must be rejected with."""
    task_id, uri = f"poison-{i}", f"s3://{BUCKET}/in/poison-{i}"
    kind = i % 6
    if kind == 0:
        return f'{{"task_id": "{task_id}", "input": ', "malformed_json"
    if kind == 1:
        return json.dumps({"input": uri + ".npy", "n": i}), "missing_field"
    if kind == 2:
        return json.dumps({"task_id": task_id, "input": f"s3://{BUCKET}/secret/{i}.npy"}), (
            "input_not_allowed"
        )
    data, name, reason = {
        3: (b"\x93NUMPY\x01\x00broken", ".npy", "undecodable_input"),
        4: (
            synthetic.encode_input(np.ones((2, FEATURES + 3), np.float32), "npy"),
            ".npy",
            "wrong_feature_count",
        ),
        5: (b"a,b\n1,text\n", ".csv", "undecodable_input"),
    }[kind]
    s3.put_object(Bucket=BUCKET, Key=f"in/{task_id}{name}", Body=data)
    return json.dumps({"task_id": task_id, "input": uri + name}), reason


def prepare(endpoint: str, config: ChaosConfig) -> tuple[Workload, dict[str, str]]:
    s3, sqs = standin.clients(endpoint)
    stage.create_bucket(s3, BUCKET, versioned=True)
    queues = stage.create_chain(sqs, "chaos", max_receive_count=10)
    rng = random.Random(config.seed)
    work = Workload()
    for i in range(config.slow_tasks):  # first: their held extensions are the first calls
        task_id = SLOW_PREFIX.removeprefix("in/") + str(i)
        rows = synthetic.make_rows(config.rows, FEATURES, seed=config.seed * 100_000 - 1 - i)
        work.bodies.append(work.add_valid(s3, task_id, rows))
    for i in range(config.tasks):
        rows = synthetic.make_rows(config.rows, FEATURES, seed=config.seed * 100_000 + i)
        body = work.add_valid(s3, f"task-{i:05d}", rows)
        work.bodies.append(body)
        if rng.random() < config.duplicate_rate:  # sent twice, side by side: taken at once
            work.bodies.append(body)
            work.duplicates += 1
        if rng.random() < config.poison_rate:
            poison, reason = _poison(s3, len(work.poison))
            work.poison[poison] = reason
            work.bodies.append(poison)
    return work, queues


def add_squatters(endpoint: str, config: ChaosConfig, work: Workload) -> None:
    """Tasks whose stage-1 output a producer created first, claiming another task id.

    Each must end in the DLQ as `output_conflict`, its output untouched and never handed
    on to stage 2 under the squatting task's id.
    """
    s3, _ = standin.clients(endpoint)
    bodies = []
    for i in range(config.squatters):
        task_id = f"squat-{i}"
        rows = synthetic.make_rows(4, FEATURES, seed=i)
        s3.put_object(
            Bucket=BUCKET, Key=f"in/{task_id}.npy", Body=synthetic.encode_input(rows, "npy")
        )
        key, data = f"stage1/{task_id}.npy", f"made by the producer of {task_id}".encode()
        owner = {"task-id": f"owner-of-{task_id}"}
        s3.put_object(Bucket=BUCKET, Key=key, Body=data, Metadata=owner)
        work.squatted[key] = data
        body = json.dumps({"task_id": task_id, "input": f"s3://{BUCKET}/in/{task_id}.npy"})
        work.poison[body] = "output_conflict"
        bodies.append(body)
    work.scatter(bodies)


def _not_xml_params(i: int) -> dict[str, Any]:
    """Params carrying every character SQS refuses, in values, in a key and nested."""
    return {"note": NOT_XML, f"key{NOT_XML[0]}": [NOT_XML[1:3], {"n": NOT_XML[3:]}], "i": i}


def add_non_xml(endpoint: str, config: ChaosConfig, work: Workload) -> None:
    """Messages whose JSON escapes characters SQS refuses (SQS takes the escapes).

    In params: processed, and handed on with the same params (the next-stage body must
    escape them again). In an input or output key, or in the task id: refused as
    `invalid_field` (a key travels in later messages, an id becomes a key). A lone
    surrogate escape is not text at all: `malformed_json`.
    """
    s3, _ = standin.clients(endpoint)
    bodies = []
    for i in range(config.non_xml):
        rows = synthetic.make_rows(4, FEATURES, seed=config.seed * 100_000 + 50_000 + i)
        bodies.append(work.add_valid(s3, f"xml-params-{i}", rows, _not_xml_params(i)))
        good = f"s3://{BUCKET}/in/xml-params-{i}.npy"
        refused = [
            {"task_id": f"xml-input-{i}", "input": f"s3://{BUCKET}/in/x{NOT_XML[0]}{i}.npy"},
            {"task_id": f"xml-control-{i}", "input": f"s3://{BUCKET}/in/x{NOT_XML[3]}{i}.npy"},
            {
                "task_id": f"xml-output-{i}",
                "input": good,
                "output": f"s3://{BUCKET}/stage1/x{NOT_XML[1]}{i}.npy",
            },
            {"task_id": f"xml{NOT_XML[0]}{i}", "input": good},
        ]
        for doc in refused:
            work.poison[json.dumps(doc)] = "invalid_field"
            bodies.append(json.dumps(doc))
        # json.dumps writes a lone surrogate as the escape `\ud800`, as a producer would.
        lone = json.dumps(
            {"task_id": f"xml-surrogate-{i}", "input": good, "params": {"s": "\ud800"}}
        )
        work.poison[lone] = "malformed_json"
        bodies.append(lone)
    work.scatter(bodies)


def start_feeding(endpoint: str, url: str, bodies: list[str], depth: int) -> feeder.FeedThread:
    """Keeps the first queue shallow (moto's SQS slows as a queue deepens)."""
    sqs = standin.clients(endpoint)[1]
    feed = feeder.FeedThread(
        feeder.Feeder(sqs, url, feeder.listed(bodies), len(bodies)),
        feeder.keep_depth(sqs, url, depth),
    )
    feed.start()
    return feed


# -- the cluster under test -----------------------------------------------------------------


def _settings(
    name: str, queues: dict[str, str], endpoint: str, models: dict[str, str], config: ChaosConfig
) -> dict[str, str]:
    timings = {
        "SQSINFER_PROCESSES": "1",
        "SQSINFER_WAIT_TIME_S": "1",
        "SQSINFER_VISIBILITY_TIMEOUT_S": str(config.visibility_timeout_s),
        "SQSINFER_HEARTBEAT_S": str(max(1, config.visibility_timeout_s // 3)),
        "SQSINFER_RETRY_BASE_S": "1",
        "SQSINFER_RETRY_MAX_S": "8",
        "SQSINFER_CHAIN_SETTLE_S": "4",
    }
    which = name.split("-", maxsplit=1)[0]
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


def run_until_drained(
    chaos: Chaos, feed: feeder.FeedThread, endpoint: str, queues: dict[str, str], tasks: int
) -> bool:
    s3, sqs = standin.clients(endpoint)
    pending = chaos.schedule()
    deadline = time.monotonic() + chaos.config.timeout_s
    while time.monotonic() < deadline:
        done = _count_outputs(s3, "stage2/")
        while pending and done >= pending[0][0] * tasks:
            pending.pop(0)[1]()
        if feed.error is not None:
            raise RuntimeError(f"feeding failed: {feed.error}")
        if (
            done >= tasks
            and not feed.is_alive()
            and not pending
            and all(stage.queue_depth(sqs, queues[q]) == 0 for q in ("stage1", "stage2"))
        ):
            return True
        for worker in chaos.workers:
            if worker.process.poll() is not None:
                raise RuntimeError(f"{worker.name} exited unexpectedly:\n{worker.tail_text()}")
        time.sleep(_POLL_S)
    return False


# -- checking -------------------------------------------------------------------------------


@dataclass
class Findings:
    figures: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def expect(self, ok: bool, problem: str) -> None:
        if not ok:
            self.problems.append(problem)


def _versions(s3: Any) -> Counter[str]:
    counts: Counter[str] = Counter()
    for page in s3.get_paginator("list_object_versions").paginate(Bucket=BUCKET, Prefix="stage"):
        for version in page.get("Versions", []):
            counts[version["Key"]] += 1
    return counts


def _log_lines(lines: dict[str, list[dict[str, Any]]], which: str) -> list[dict[str, Any]]:
    """The log lines of one stage's workers, worker by worker."""
    return [line for name, records in lines.items() if name.startswith(which) for line in records]


def _deliveries(lines: list[dict[str, Any]]) -> dict[str, set[str]]:
    """Task id → the distinct message ids that reached an outcome for it."""
    found: dict[str, set[str]] = defaultdict(set)
    for line in lines:
        if line.get("msg") == Event.TASK_FINISHED and line.get("task_id"):
            found[line["task_id"]].add(line["message_id"])
    return found


def _link_states(stage1: dict[str, bytes]) -> dict[str, str]:
    """Output key → the state its chain marker records."""
    return {
        key.removesuffix(".chain"): str(json.loads(body).get("state", "?"))
        for key, body in stage1.items()
        if key.endswith(".chain")
    }


def check_outputs(endpoint: str, work: Workload, models: dict[str, str], f: Findings) -> None:
    s3, _ = standin.clients(endpoint)
    model1, model2 = synthetic.predictor(models["stage1"]), synthetic.predictor(models["stage2"])
    expected1 = {f"stage1/{t}.npy": model1.predict(rows) for t, rows in work.valid.items()}
    stage1 = stage.read_objects(s3, BUCKET, "stage1/")
    squatted = {k: stage1.pop(k, None) for k in work.squatted}
    problems, decoded = stage.check_stage(stage1, expected1, "npy")
    expected2 = {
        k.replace("stage1/", "stage2/"): model2.predict(v.reshape(-1, 1))
        for k, v in decoded.items()
    }
    more, decoded2 = stage.check_stage(stage.read_objects(s3, BUCKET, "stage2/"), expected2, "npy")
    f.problems += problems + more
    links = _link_states(stage1)
    missing_links = [k for k in expected1 if links.get(k) != "sent"]
    f.expect(
        not missing_links, f"{len(missing_links)} chain links not sent, e.g. {missing_links[:3]}"
    )
    versions = _versions(s3)
    # The outputs are written once; a chain marker is rewritten by design (intent, sent).
    overwritten = {k: n for k, n in versions.items() if n > 1 and not k.endswith(".chain")}
    f.expect(not overwritten, f"objects written more than once: {list(overwritten)[:5]}")
    touched = [k for k, data in work.squatted.items() if squatted[k] != data]
    f.expect(not touched, f"squatted outputs changed: {touched}")
    f.expect(not any(k in links for k in work.squatted), "a squatted output was handed on")
    f.figures |= {
        "stage1 outputs": len(decoded),
        "stage2 outputs": len(decoded2),
        "chain links (sent)": sum(1 for state in links.values() if state == "sent"),
        "objects overwritten": len(overwritten),
        "squatted outputs (untouched / planted)": f"{len(work.squatted) - len(touched)} / "
        f"{len(work.squatted)}",
    }


def check_queues(endpoint: str, work: Workload, queues: dict[str, str], f: Findings) -> None:
    _, sqs = standin.clients(endpoint)
    residue = {q: stage.queue_depth(sqs, queues[q]) for q in ("stage1", "stage2")}
    f.expect(not any(residue.values()), f"messages left on the queues: {residue}")
    entries = stage.dead_letter_entries(sqs, queues["stage1-dlq"])
    stray = stage.dead_letter_entries(sqs, queues["stage2-dlq"])
    unreasoned = sum(1 for _, reason in entries + stray if not reason)
    dead = dict(entries)
    wrong = {b: r or "(no reason)" for b, r in dead.items() if work.poison.get(b) != r}
    lost = [b for b in work.poison if b not in dead]
    f.expect(not unreasoned, f"{unreasoned} DLQ messages without a reason")
    f.expect(not wrong, f"unexpected DLQ messages or reasons: {list(wrong.items())[:3]}")
    f.expect(not lost, f"poison messages missing from the DLQ: {lost[:3]}")
    f.expect(len(entries) == len(dead), f"{len(entries) - len(dead)} second DLQ copies")
    f.expect(not stray, f"stage 2 DLQ holds {len(stray)} messages")
    f.figures |= {
        "left on queues": sum(residue.values()),
        "DLQ (poison sent / found)": f"{len(work.poison)} / {len(entries)}",
        "DLQ entries without a reason": unreasoned,
        "DLQ reasons": dict(Counter(reason for _, reason in entries)),
    }


def check_downstream(
    stage1: list[dict[str, Any]], stage2: list[dict[str, Any]], f: Findings
) -> None:
    """Stage 2's extra deliveries of a task are next-stage duplicates: stage 1 counted them?

    Observed: stage-2 messages per task id beyond one. Counted: the `chain duplicate`
    lines of stage 1 (the same events as sqsinfer_chain_duplicates_total). A possible
    duplicate may not have happened; a certain one has, and was also counted possible by
    the delivery that took the link over. So certain <= observed <= certain + possible.
    """
    extra = {t: len(ids) - 1 for t, ids in _deliveries(stage2).items() if len(ids) > 1}
    counted = [line for line in stage1 if line.get("msg") == Event.CHAIN_DUPLICATE]
    kinds = Counter(str(line.get("kind")) for line in counted)
    per_task = Counter(str(line.get("task_id")) for line in counted)
    observed = sum(extra.values())
    under = {t: (n, per_task[t]) for t, n in extra.items() if n > per_task[t]}
    certain = Counter(str(line.get("task_id")) for line in counted if line.get("kind") == "certain")
    over = {t: (extra.get(t, 0), n) for t, n in certain.items() if n > extra.get(t, 0)}
    f.expect(
        observed <= kinds["certain"] + kinds["possible"],
        f"{observed} downstream duplicates observed, only "
        f"{kinds['certain'] + kinds['possible']} counted",
    )
    f.expect(not under, f"tasks with more duplicates than counted (seen, counted): {under}")
    f.expect(kinds["certain"] <= observed, f"{kinds['certain']} certain, {observed} observed")
    f.expect(not over, f"tasks with fewer duplicates than counted certain (seen, certain): {over}")
    f.figures |= {
        "downstream duplicates (observed / counted)": f"{observed} / "
        f"{kinds['certain'] + kinds['possible']} "
        f"(certain {kinds['certain']}, possible {kinds['possible']})",
        "chain links taken over": sum(
            1 for line in stage1 if line.get("msg") == Event.CHAIN_LINK_TAKEN_OVER
        ),
    }


def check_logs(lines: dict[str, list[dict[str, Any]]], work: Workload, f: Findings) -> None:
    stage1, stage2 = _log_lines(lines, "stage1"), _log_lines(lines, "stage2")
    check_downstream(stage1, stage2, f)
    all_lines = stage1 + stage2
    restarts = [line for line in all_lines if line.get("msg") == Event.POOL_PROCESS_RESTARTED]
    lost = [line.get("why", "") for line in all_lines if line.get("msg") == Event.POOL_PROCESS_LOST]
    outcomes = Counter(
        line["outcome"] for line in all_lines if line.get("msg") == Event.TASK_FINISHED
    )
    f.figures |= {
        "duplicate deliveries sent": work.duplicates,
        "processes lost (during a task / idle)": (
            f"{sum('during a task' in w for w in lost)} / {sum('idle' in w for w in lost)}"
        ),
        "pool restarts": len(restarts),
        "capacity restored after a kill (max)": (
            f"{max(float(line.get('restore_s', 0)) for line in restarts):.2f} s"
            if restarts
            else "n/a"
        ),
        "tasks retried after a process crash": sum(
            1 for line in all_lines if line.get("reason") == "PoolCrashed" and line.get("outcome")
        ),
        "outcomes (both stages)": dict(outcomes),
        # Retried through SQS; a committed one was retried after its write (its link).
        "retry reasons": dict(
            Counter(
                line["reason"]
                for line in all_lines
                if line.get("msg") == Event.TASK_FINISHED
                and line.get("outcome") in ("retried", "committed")
                and line.get("reason")
            )
        ),
    }


def _max_bytes(sqs: Any, url: str) -> int:
    attrs = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["MaximumMessageSize"])
    return int(attrs["Attributes"].get("MaximumMessageSize", SQS_DEFAULT_MAX_MESSAGE_BYTES))


def check_sends(
    endpoint: str, sent: list[dict[str, Any]], work: Workload, queues: dict[str, str], f: Findings
) -> None:
    """Every message the workers sent (recorded by the proxy, whether it got through or
    not) is one AWS would accept, and stage 2 got the params stage 1 was given."""
    _, sqs = standin.clients(endpoint)
    names = {queue_name(url): url for url in queues.values()}
    limits = {name: _max_bytes(sqs, url) for name, url in names.items()}
    refused: list[str] = []
    per_queue: Counter[str] = Counter()
    handed: dict[str, list[Any]] = defaultdict(list)  # task id -> the params stage 2 got
    for message in sent:
        name = queue_name(message["queue"])
        per_queue[name] += 1
        why = unsendable(message["body"], message["attributes"] or None, limits.get(name, 0))
        refused += [f"{name}: {problem}" for problem in why]
        if name == queue_name(queues["stage2"]) and not why:
            doc = json_object(message["body"])
            if doc.get("task_id") in work.params:
                handed[doc["task_id"]].append(doc.get("params"))
    intact = [t for t, p in work.params.items() if handed[t] and all(h == p for h in handed[t])]
    to_stage2, to_dlq = (
        per_queue[queue_name(queues["stage2"])],
        per_queue[queue_name(queues["stage1-dlq"])],
    )
    f.expect(not refused, f"{len(refused)} sent messages AWS would refuse: {refused[:3]}")
    f.expect(to_stage2 >= len(work.valid), f"only {to_stage2} sends to stage 2 recorded")
    f.expect(
        len(intact) == len(work.params),
        f"params not handed on intact: {sorted(set(work.params) - set(intact))}",
    )
    f.figures |= {
        "messages the workers sent (stage 2 / DLQ)": f"{to_stage2} / {to_dlq}",
        "sent messages AWS would refuse": len(refused),
        "non-XML params handed on intact": f"{len(intact)} / {len(work.params)}",
    }


# -- the visibility keeper under stalled calls ----------------------------------------------

# The log lines a message's hold is read from.
_FINISHED = Event.TASK_FINISHED
_WILL_RETRY = Event.TASK_FAILED
_OVER_TIME = "task over max time, abandoned"
_RELEASING = frozenset({Event.DRAINING, Event.DRAIN_DEADLINE_PASSED})
_NOT_EXTENDED = Event.VISIBILITY_NOT_EXTENDED
_HELD_CALL = "visibility call held"
# Log times are to the millisecond, and a hold is seen to start a little after SQS's.
_SLACK_S = 0.05


def _epoch_s(ts: str) -> float:
    return datetime.datetime.fromisoformat(ts).timestamp()


@dataclass(frozen=True)
class Hold:
    """One delivery of a message to a worker, from its receive until the worker let go
    of it (asked for its delete or its hand-back)."""

    worker: str
    message_id: str
    receive_count: int
    received_s: float
    let_go_s: float
    outcome: str
    computed: bool

    def __str__(self) -> str:
        clock = time.strftime("%H:%M:%S", time.localtime(self.received_s))
        held_s = self.let_go_s - self.received_s
        return (
            f"{self.worker} receive {self.receive_count} at {clock}, held {held_s:.1f} s, "
            f"{self.outcome}{', computed' if self.computed else ''}"
        )


@dataclass
class _LetGo:
    """What a worker's log says about when it let go of messages it handed back."""

    retrying: dict[tuple[str, int], float] = field(default_factory=dict)
    over_time: dict[str, float] = field(default_factory=dict)
    drains: list[float] = field(default_factory=list)

    def note(self, line: dict[str, Any], at_s: float) -> None:
        msg, message_id = line.get("msg"), str(line.get("message_id", ""))
        if msg == _WILL_RETRY:
            self.retrying[(message_id, int(line.get("receive_count", 0)))] = at_s
        elif msg == _OVER_TIME:
            self.over_time[message_id] = at_s
        elif msg in _RELEASING:
            self.drains.append(at_s)

    def when(self, line: dict[str, Any], finished_s: float) -> float:
        """The `task finished` line follows the settle, which for a hand-back is a
        visibility call that may itself have stalled: a retried message was let go at
        its `task failed` line, a released one when the drain released it."""
        message_id, count = str(line["message_id"]), int(line.get("receive_count", 0))
        if line.get("outcome") == "retried":
            return self.retrying.get(
                (message_id, count), self.over_time.get(message_id, finished_s)
            )
        if line.get("outcome") == "released":
            return max((d for d in self.drains if d <= finished_s), default=finished_s)
        return finished_s  # deleted: the delete ends the hold, and follows all its work


def holds(worker: str, lines: list[dict[str, Any]]) -> list[Hold]:
    """Every delivery a worker's log shows finished (a SIGKILLed worker's last ones
    never are: their messages lapse, as they should)."""
    let_go = _LetGo()
    found = []
    for line in lines:
        if "ts" not in line:
            continue
        at_s = _epoch_s(str(line["ts"]))
        let_go.note(line, at_s)
        if line.get("msg") == _FINISHED and line.get("message_id"):
            found.append(
                Hold(
                    worker=worker,
                    message_id=str(line["message_id"]),
                    receive_count=int(line.get("receive_count", 0)),
                    received_s=at_s - float(line.get("seconds", 0.0)),
                    let_go_s=let_go.when(line, at_s),
                    outcome=str(line.get("outcome")),
                    computed="infer" in (line.get("phases") or {}),
                )
            )
    return found


def _by_message(all_holds: list[Hold]) -> dict[str, list[Hold]]:
    by_message: dict[str, list[Hold]] = defaultdict(list)
    for hold in all_holds:
        by_message[hold.message_id].append(hold)
    return by_message


def lapses(all_holds: list[Hold]) -> list[tuple[Hold, Hold]]:
    """(held, taken) pairs: a message received again while a worker still held it."""
    found = []
    for group in _by_message(all_holds).values():
        group.sort(key=lambda h: h.received_s)
        for i, later in enumerate(group):
            found += [(e, later) for e in group[:i] if later.received_s < e.let_go_s - _SLACK_S]
    return found


def outlived_stalls(
    calls: list[tuple[float, list[str]]], all_holds: list[Hold], visibility_timeout_s: int
) -> list[Hold]:
    """Holds still under way a whole visibility timeout after an extension of theirs
    stalled: without another extension they would have lapsed (the stalled call lands
    too late, and the extension before it was sent before the stall began)."""
    by_message = _by_message(all_holds)
    found = []
    for at_s, message_ids in calls:
        for message_id in message_ids:
            found += [
                h
                for h in by_message[message_id]
                if h.received_s <= at_s and h.let_go_s > at_s + visibility_timeout_s
            ]
    return found


def check_visibility(
    lines: dict[str, list[dict[str, Any]]],
    proxy_lines: list[dict[str, Any]],
    chaos: Chaos,
    f: Findings,
) -> None:
    """No message lapsed while a worker held it, stalled extensions and all."""
    config = chaos.config
    all_holds = [hold for name, records in lines.items() for hold in holds(name, records)]
    calls = [
        (_epoch_s(str(line["ts"])), [str(m) for m in line.get("message_ids", [])])
        for line in proxy_lines
        if line.get("msg") == _HELD_CALL
    ]
    found = lapses(all_holds)
    outlived = outlived_stalls(calls, all_holds, config.visibility_timeout_s)
    shown = "; ".join(f"{a.message_id}: {a} / then {b}" for a, b in found[:3])
    f.expect(not found, f"{len(found)} messages lapsed while held: {shown}")
    if config.visibility_delay_calls and config.slow_tasks:
        f.expect(bool(calls), "no visibility call was held: the keeper was not put to the test")
        f.expect(bool(outlived), "no held message outlived a stalled extension: nothing proved")
    long_held = [h for h in all_holds if h.let_go_s - h.received_s > config.visibility_timeout_s]
    given_up = sum(1 for r in lines.values() for line in r if line.get("msg") == _NOT_EXTENDED)
    f.figures |= {
        "held past the visibility timeout": len(long_held),
        "visibility extensions (metric)": int(chaos.extensions),
        "extension calls held (messages in them)": f"{len(calls)} "
        f"({sum(len(ids) for _, ids in calls)})",
        "held through a stalled extension past its lapse": len(outlived),
        "extensions given up by the keeper": given_up,
        "lapsed while held (then computed again)": f"{len(found)} "
        f"({sum(1 for _, b in found if b.computed)})",
    }


# -- the command ------------------------------------------------------------------------------


def queue_name(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[1]


def _visibility_faults(config: ChaosConfig) -> list[str]:
    """Slow tasks, whose messages the keeper must extend, and stalled extensions."""
    # A slow task holds its message for two visibility timeouts, reading its input.
    slow = ["--slow-read", f"{SLOW_PREFIX}={2 * config.visibility_timeout_s}"]
    if not config.visibility_delay_calls:  # (0 calls would mean no limit to the proxy)
        return slow
    return [
        *slow,
        # Only extensions (they ask for the whole timeout; hand-backs for less), each
        # message's at most once: one stalled call per message, its retry gets through.
        "--visibility-delay-s",
        str(config.visibility_delay_s),
        "--visibility-delay-rate",
        str(config.visibility_delay_rate),
        "--visibility-delay-calls",
        str(config.visibility_delay_calls),
        "--visibility-delay-min-s",
        str(config.visibility_timeout_s),
        "--visibility-delay-once",
    ]


def _start_proxy(
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
        # Answers lost only for stage 1's sends to stage 2: a duplicate there is counted.
        "--send-drop",
        str(config.send_drop),
        "--send-drop-queue",
        queue_name(queues["stage2"]),
        # Bursts on the "sent" record from just past the SDK's attempts (the worker's
        # own retries recover) to past the worker's too (the link is taken over later).
        "--marker-failures",
        str(config.marker_failures),
        "--marker-updates-only",
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


def _json_lines(path: str) -> list[dict[str, Any]]:
    return stage.LogTail(path).read()


def _proxy_counts(lines: list[dict[str, Any]]) -> dict[str, int]:
    for line in lines:
        if "injected" in line:
            return dict(line["injected"])
    return {}


def print_report(findings: Findings, events: Events, elapsed_s: float) -> None:
    print("\nchaos run")
    for text in events.log:
        print("  " + text)
    print()
    width = max(len(k) for k in findings.figures) + 2
    for key, value in findings.figures.items():
        print(f"  {key:<{width}}{value}")
    print(f"  {'elapsed':<{width}}{elapsed_s:.1f} s")
    if findings.problems:
        print("\nLOSS OR CORRUPTION FOUND:")
        for problem in findings.problems:
            print("  - " + problem)
    else:
        print("\nno work lost, none done twice where it counts, nothing overwritten")


def run(config: ChaosConfig) -> Findings:
    standin.use_fake_credentials()
    with tempfile.TemporaryDirectory() as workdir, standin.moto_server() as moto:
        print(f"preparing {config.tasks} tasks on {moto.url} ...", flush=True)
        work, queues = prepare(moto.url, config)
        add_squatters(moto.url, config, work)
        add_non_xml(moto.url, config, work)
        models = {
            # Big enough that predictions take milliseconds: kills can land inside one.
            "stage1": synthetic.train_model(
                os.path.join(workdir, "m1.ubj"), FEATURES, trees=150, depth=6, seed=3
            ),
            "stage2": synthetic.train_model(os.path.join(workdir, "m2.ubj"), 1, trees=5, seed=4),
        }
        proxy, proxy_url = _start_proxy(moto.url, config, workdir, queues)
        chaos = Chaos(config, workdir)
        started = time.monotonic()
        try:
            chaos.start_workers(queues, proxy_url, models)
            stage.wait_ready(chaos.workers)
            feed = start_feeding(moto.url, queues["stage1"], work.bodies, config.feed_depth)
            drained = run_until_drained(chaos, feed, moto.url, queues, len(work.valid))
            elapsed = time.monotonic() - started
            # A worker restarted near the end may still be importing, when a SIGTERM
            # kills it outright: the exit codes checked below are those of a drain.
            stage.wait_ready(chaos.workers)
            for worker in chaos.workers:
                chaos.count_extensions(worker)
        finally:
            codes = stage.stop_workers(chaos.workers)
            proxy.send_signal(signal.SIGTERM)
            proxy.wait(timeout=30)
        findings = Findings(
            figures={"valid tasks": len(work.valid), "worker processes": len(chaos.workers)}
        )
        findings.expect(drained, f"queues did not drain within {config.timeout_s} s")
        findings.expect(not any(codes), f"workers exited with {codes} at the end")
        findings.expect(events_ok(chaos.events, config), "not all chaos events happened")
        check_outputs(moto.url, work, models, findings)
        check_queues(moto.url, work, queues, findings)
        worker_lines = {w.name: w.log_records() for w in chaos.workers}
        check_logs(worker_lines, work, findings)
        proxy_lines = _json_lines(os.path.join(workdir, PROXY_LOG))
        check_sends(moto.url, _json_lines(os.path.join(workdir, SENDS)), work, queues, findings)
        check_visibility(worker_lines, proxy_lines, chaos, findings)
        findings.figures["faults injected"] = _proxy_counts(proxy_lines)
        print_report(findings, chaos.events, elapsed)
        if config.logs_dir:
            shutil.copytree(
                workdir, config.logs_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.ubj")
            )
            print(f"logs kept in {config.logs_dir}")
        return findings


def events_ok(events: Events, config: ChaosConfig) -> bool:
    return (
        events.child_kills >= config.child_kills
        and events.sigterm_exit == 0
        and events.sigkills == 1
    )


# The options of `python -m proving.chaos`: ChaosConfig's fields, each with what it sets.
OPTION_HELP = {
    "tasks": "valid tasks fed to stage 1",
    "workers_per_stage": "worker processes per stage",
    "seed": "seed of the inputs, the faults and the kills",
    "rows": "rows per input (a few ms of compute, so kills land mid-task)",
    "child_kills": "inference processes SIGKILLed while computing",
    "feed_depth": "messages the feeder keeps waiting on stage 1",
    "squatters": "tasks whose output another producer created first",
    "non_xml": "sets of messages with characters SQS refuses",
    "slow_tasks": "tasks whose input read is held past two visibility timeouts",
    "visibility_delay_calls": "extension calls held back",
    "s3_5xx": "S3 requests answered 500 or 503 (rate)",
    "s3_conflict": "conditional puts answered 409 (rate)",
    "sqs_errors": "SQS requests answered 500 or throttled (rate)",
    "latency_ms": "latency added to each request, up to (ms)",
    "drop": "answers cut off after the service acted (rate)",
    "send_drop": "next-stage send answers lost after SQS took the message (rate)",
    "marker_failures": "chain markers whose records meet a burst of 503s (rate)",
    "poison_rate": "bad messages among the tasks (rate)",
    "duplicate_rate": "tasks sent twice (rate)",
    "visibility_delay_s": "how long a held-back extension call waits (s)",
    "visibility_delay_rate": "extension calls held back, while any are left (rate)",
    "timeout_s": "give up after (s)",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m proving.chaos",
        description="Run a two-stage chain under faults and kills, then check that nothing "
        "was lost.",
        epilog="example:\n  python -m proving.chaos --tasks 2000\n"
        "  python -m proving.chaos --tasks 100 --s3-5xx 0.2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = ChaosConfig()
    for name, text in OPTION_HELP.items():
        default = getattr(defaults, name)
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=type(default),
            default=default,
            help=f"{text} ({default:g})",
        )
    p.add_argument("--logs-dir", default="", help="keep every worker's JSON log here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not standin.has_local_extra("python -m proving.chaos"):
        return 2
    names = ChaosConfig.__dataclass_fields__
    config = ChaosConfig(**{k: v for k, v in vars(args).items() if k in names})
    return 1 if run(config).problems else 0


if __name__ == "__main__":
    sys.exit(main())
