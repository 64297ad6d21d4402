"""What the chaos run feeds: valid tasks, poison, duplicates, squatted outputs and
messages with characters SQS refuses, prepared on the stand-in and fed to stage 1.

With `s3_events`, the valid tasks are not messages but uploads: each input lands in the
bucket when the feeding reaches it and the bucket's own notification says so (`events`).
Some keys are named as people name files; some inputs are overwritten (two events for
one output: one scores it, the other is a conflict) or deleted at once (the event still
reads the version it names); some objects make poison events."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sqsinfer import events
from sqsinfer.lab import feeder, stage, standin, synthetic

BUCKET = "sqsinfer-chaos"
FEATURES = 6
# Characters SQS refuses in a message, as the non-XML messages carry them (JSON-escaped).
NOT_XML = "\uffff\ufffe\x00\x01\x08\x1f"
SLOW_PREFIX = "in/slow-"  # the inputs of the slow tasks: their reads are held


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
    reset: float = 0.01  # sends, puts and deletes whose connection is reset after they acted
    send_drop: float = 0.02  # next-stage SendMessage answers lost after SQS took the message
    send_reset: float = 0.02  # next-stage sends whose connection is reset after SQS took them
    marker_failures: float = 0.02  # chain markers whose "sent" record meets a burst of 503s
    poison_rate: float = 0.01
    squatters: int = 5  # tasks whose output a producer created first, under another task id
    non_xml: int = 2  # sets of messages with characters SQS refuses (six kinds a set)
    duplicate_rate: float = 0.05
    child_kills: int = 3
    visibility_timeout_s: int = 8
    # Tasks fed first whose input read the proxy holds three visibility timeouts: held
    # messages the keeper must extend while their extensions stall.
    slow_tasks: int = 4
    # Extension calls held this long, past the timeout: those of the slow tasks' messages
    # (at rate 1), each delivery's first one; at most this many calls.
    visibility_delay_s: float = 12.0
    visibility_delay_rate: float = 1.0
    visibility_delay_calls: int = 4
    feed_depth: int = 100
    timeout_s: float = 1200.0
    logs_dir: str = ""  # keep the workers' and the proxy's logs here
    # Stage 1 fed by S3 event notifications (message_shape auto: the other kinds of
    # message still come as task messages), with these faults of its own:
    s3_events: bool = False
    odd_keys: float = 0.1  # keys with spaces, `+`, `=` and letters beyond ASCII (rate)
    overwrites: float = 0.02  # inputs written twice: two events for one output (rate)
    deletes: float = 0.02  # inputs deleted as soon as written (rate)
    event_poison: int = 6  # objects whose events are refused (three kinds)
    multi_records: float = 0.1  # events the relay merges into bodies of several (rate)
    # Stage 2's queues FIFO: stage 1 hands on with SQS's deduplication (no marker), each
    # task in one of `groups` groups (its `group` field), and stage 2 keeps their order.
    fifo: bool = False
    groups: int = 20


@dataclass(frozen=True)
class Upload:
    """An object the S3 feeding writes (and then writes again, or deletes)."""

    key: str
    data: bytes
    then: str = ""  # "overwrite" or "delete"


@dataclass
class Workload:
    valid: dict[str, np.ndarray] = field(default_factory=dict)
    poison: dict[str, str] = field(default_factory=dict)  # body → expected reason
    bodies: list[str] = field(default_factory=list)  # in feeding order
    duplicates: int = 0
    squatted: dict[str, bytes] = field(default_factory=dict)  # output key -> producer's bytes
    params: dict[str, dict[str, Any]] = field(default_factory=dict)  # task id -> its params
    # With s3_events: what is uploaded, in order; the refused events expected in the DLQ
    # (input key → reason, once each); each task's output keys when its id is not its key.
    uploads: list[Upload] = field(default_factory=list)
    event_dead: dict[str, str] = field(default_factory=dict)
    keys: dict[str, tuple[str, str]] = field(default_factory=dict)

    def outputs(self, task_id: str) -> tuple[str, str]:
        """A task's output keys at stage 1 and stage 2."""
        return self.keys.get(task_id, (f"stage1/{task_id}.npy", f"stage2/{task_id}.npy"))

    def add_valid(
        self,
        s3: Any,
        task_id: str,
        rows: np.ndarray,
        params: dict[str, Any] | None = None,
        group: str | None = None,
    ) -> str:
        """Upload a valid task's input; its message body (JSON, non-ASCII escaped)."""
        self.valid[task_id] = rows
        key = f"in/{task_id}.npy"
        s3.put_object(Bucket=BUCKET, Key=key, Body=synthetic.encode_input(rows, "npy"))
        doc: dict[str, Any] = {"task_id": task_id, "input": f"s3://{BUCKET}/{key}"}
        if params is not None:
            self.params[task_id] = params
            doc["params"] = params
        if group is not None:
            doc["group"] = group
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
    queues = stage.create_chain(sqs, "chaos", max_receive_count=10, fifo_stage2=config.fifo)
    rng = random.Random(config.seed)
    work = Workload()
    for i in range(config.slow_tasks):  # first: their held extensions are the first calls
        task_id = SLOW_PREFIX.removeprefix("in/") + str(i)
        rows = synthetic.make_rows(config.rows, FEATURES, seed=config.seed * 100_000 - 1 - i)
        work.bodies.append(work.add_valid(s3, task_id, rows))
    for i in range(config.tasks):
        rows = synthetic.make_rows(config.rows, FEATURES, seed=config.seed * 100_000 + i)
        if config.s3_events:  # an upload; the relay sends some of its events twice
            _add_upload(work, rng, config, i, rows)
        else:
            group = f"group-{i % config.groups}" if config.fifo else None
            body = work.add_valid(s3, f"task-{i:05d}", rows, group=group)
            work.bodies.append(body)
            if rng.random() < config.duplicate_rate:  # sent twice, side by side: taken at once
                work.bodies.append(body)
                work.duplicates += 1
        if rng.random() < config.poison_rate:
            poison, reason = _poison(s3, len(work.poison))
            work.poison[poison] = reason
            work.bodies.append(poison)
    return work, queues


def _add_upload(
    work: Workload, rng: random.Random, config: ChaosConfig, i: int, rows: np.ndarray
) -> None:
    """A valid task as an upload under in/: its task id and outputs follow from its key."""
    odd = rng.random() < config.odd_keys
    stem = f"t {i:05d} +=ü" if odd else f"task-{i:05d}"
    task_id = events.task_id_for(stem)
    work.valid[task_id] = rows
    if odd:  # stage 1 keeps the key's characters; stage 2 names outputs by the task id
        work.keys[task_id] = (f"stage1/{stem}.npy", f"stage2/{task_id}.npy")
    key, then = f"in/{stem}.npy", ""
    if rng.random() < config.overwrites:
        then = "overwrite"
        work.event_dead[key] = "output_conflict"  # the event that comes second to its output
    elif rng.random() < config.deletes:
        then = "delete"
    work.uploads.append(Upload(key, synthetic.encode_input(rows, "npy"), then))


def add_event_poison(config: ChaosConfig, work: Workload) -> None:
    """Objects under in/ whose events must be refused, each with its reason."""
    uploads = []
    for i in range(config.event_poison if config.s3_events else 0):
        key, data, reason = [
            (f"in/event-poison-{i}.txt", b"text", "unsupported_format"),
            (f"in/event-poison-{i}%.npy", b"x", "invalid_field"),  # `%`: in no key of a task
            (f"in/event-poison-{i}.npy", b"\x93NUMPY broken", "undecodable_input"),
        ][i % 3]
        work.event_dead[key] = reason
        uploads.append(Upload(key, data))
    for i, upload in enumerate(uploads):
        work.uploads.insert((i + 1) * len(work.uploads) // (len(uploads) + 1), upload)


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


def queue_name(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[1]
