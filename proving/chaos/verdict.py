"""The checks, from S3, the queues, what the proxy recorded and the workers' logs
alone: every valid task has exactly one correct output per stage, nothing was
overwritten, every link is sent, the DLQ holds exactly the bad messages with their
reasons, every send is one AWS would accept, duplicates downstream are within what was
counted, and no message lapsed while a worker held it."""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote_plus

from proving.chaos.disrupt import Chaos
from proving.chaos.workload import BUCKET, Workload, queue_name
from proving.faults import RESET_LINE, json_object
from proving.sqs_rules import unsendable
from sqsinfer.lab import stage, standin, synthetic
from sqsinfer.limits import SQS_DEFAULT_MAX_MESSAGE_BYTES
from sqsinfer.logs import Event


def json_lines(path: str) -> list[dict[str, Any]]:
    return stage.LogTail(path).read()


def resets_by_queue(lines: list[dict[str, Any]]) -> Counter[str]:
    """Sends whose connection the proxy reset after SQS took them, by queue name."""
    return Counter(
        queue_name(str(line["queue"]))
        for line in lines
        if line.get("msg") == RESET_LINE and line.get("queue")
    )


def proxy_counts(lines: list[dict[str, Any]]) -> dict[str, int]:
    for line in lines:
        if "injected" in line:
            return dict(line["injected"])
    return {}


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


def check_outputs(
    endpoint: str, work: Workload, models: dict[str, str], f: Findings, *, fifo: bool = False
) -> None:
    """Every output right and written once; every link sent. To a FIFO stage 2 a link
    leaves no marker: its stage-2 output (checked against stage 1's) shows it was sent."""
    s3, _ = standin.clients(endpoint)
    model1, model2 = synthetic.predictor(models["stage1"]), synthetic.predictor(models["stage2"])
    expected1 = {work.outputs(t)[0]: model1.predict(rows) for t, rows in work.valid.items()}
    stage1 = stage.read_objects(s3, BUCKET, "stage1/")
    squatted = {k: stage1.pop(k, None) for k in work.squatted}
    problems, decoded = stage.check_stage(stage1, expected1, "npy")
    stage2_key = dict(work.outputs(t) for t in work.valid)
    expected2 = {stage2_key[k]: model2.predict(v.reshape(-1, 1)) for k, v in decoded.items()}
    more, decoded2 = stage.check_stage(stage.read_objects(s3, BUCKET, "stage2/"), expected2, "npy")
    f.problems += problems + more
    links = _link_states(stage1)
    sent = {k for k in expected1 if links.get(k) == "sent"}
    if fifo:
        f.expect(not links, f"{len(links)} chain markers beside a FIFO next stage's links")
        sent = {k for k in expected1 if stage2_key.get(k) in decoded2}
    missing_links = [k for k in expected1 if k not in sent]
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
        "chain links (sent)": len(sent),
        "objects overwritten": len(overwritten),
        "squatted outputs (untouched / planted)": f"{len(work.squatted) - len(touched)} / "
        f"{len(work.squatted)}",
    }


def check_queues(
    endpoint: str, work: Workload, queues: dict[str, str], resets: Counter[str], f: Findings
) -> None:
    """Empty queues; the DLQ holds the bad messages, each with its reason, once each, but
    for a copy whose send was reset: it went out, and the SDK's retry sent it again."""
    _, sqs = standin.clients(endpoint)
    residue = {q: stage.queue_depth(sqs, queues[q]) for q in ("stage1", "stage2")}
    f.expect(not any(residue.values()), f"messages left on the queues: {residue}")
    entries = stage.dead_letter_entries(sqs, queues["stage1-dlq"])
    stray = stage.dead_letter_entries(sqs, queues["stage2-dlq"])
    unreasoned = sum(1 for _, reason in entries + stray if not reason)
    # A refused event's copy is S3's body of its one record: known by the key it names.
    events = [(key, r) for b, r in entries if (key := event_key(b)) is not None]
    entries = [(b, r) for b, r in entries if event_key(b) is None]
    dead = dict(entries) | dict(events)
    expected = work.poison | work.event_dead
    wrong = {b: r or "(no reason)" for b, r in dead.items() if expected.get(b) != r}
    lost = [b for b in expected if b not in dead]
    f.expect(not unreasoned, f"{unreasoned} DLQ messages without a reason")
    f.expect(not wrong, f"unexpected DLQ messages or reasons: {list(wrong.items())[:3]}")
    f.expect(not lost, f"poison messages missing from the DLQ: {lost[:3]}")
    second = len(entries) + len(events) - len(dead)
    reset = resets[queue_name(queues["stage1-dlq"])]
    f.expect(second <= reset, f"{second} second DLQ copies, only {reset} DLQ sends reset")
    f.expect(not stray, f"stage 2 DLQ holds {len(stray)} messages")
    f.figures |= {
        "left on queues": sum(residue.values()),
        "DLQ (poison sent / found)": f"{len(expected)} / {len(dead)}",
        "DLQ entries without a reason": unreasoned,
        "DLQ second copies (found / sends reset)": f"{second} / {reset}",
        "DLQ reasons": dict(Counter(dead.values())),  # each message once
    }


def event_key(body: str) -> str | None:
    """The input key an S3 event body of one record names (None: no such body)."""
    try:
        doc = json.loads(body)
        [record] = doc["Records"]
        return unquote_plus(record["s3"]["object"]["key"])
    except (ValueError, KeyError, TypeError):
        return None


def check_events(lines: dict[str, list[dict[str, Any]]], tally: Any, f: Findings) -> None:
    """The events that name no new object were read and ignored: the test event, and one
    removal per input deleted (at least: a worker killed outright reads some again)."""
    ignored = sum(
        1
        for line in _log_lines(lines, "stage1")
        if line.get("msg") == Event.TASK_FINISHED and line.get("outcome") == "ignored"
    )
    f.expect(ignored >= 1 + tally.deletes, f"{ignored} events ignored, {tally.deletes} deleted")
    f.figures["events ignored (test, removals)"] = ignored


# A send recorded by the proxy reaches moto a little later (its latency, a loaded host).
_PROXY_SLACK_S = 1.0


def moto_dedup_gaps(
    sends: list[dict[str, Any]], stage2: list[dict[str, Any]], stage2_queue: str
) -> Counter[str]:
    """Task id → its links sent to a FIFO stage 2, after its first, once stage 2 had
    started on its first message (less a slack). AWS drops a send within 5 minutes of
    the first with its deduplication id; moto drops it only while that first message is
    still in the queue, so each of these may be a second message on moto alone, after
    the first was deleted. (The worker counts what AWS would let through: the sends
    outside its window.)"""
    started: dict[str, float] = {}
    for line in stage2:
        task_id = line.get("task_id")
        if line.get("msg") == Event.TASK_FINISHED and task_id:
            at = _epoch_s(line["ts"]) - float(line.get("seconds", 0.0))
            started[task_id] = min(at, started.get(task_id, at))
    times: dict[str, list[float]] = defaultdict(list)
    for sent in sends:
        if queue_name(sent["queue"]) == stage2_queue:
            times[str(json_object(sent["body"]).get("task_id"))].append(sent.get("at", 0.0))
    gaps: Counter[str] = Counter()
    for task_id, ats in times.items():
        later = sorted(ats)[1:]  # the first made the message the others may repeat
        if task_id in started:
            gaps[task_id] = sum(1 for at in later if at > started[task_id] - _PROXY_SLACK_S)
    return +gaps


def check_downstream(
    stage1: list[dict[str, Any]],
    stage2: list[dict[str, Any]],
    f: Findings,
    moto_gaps: Counter[str] | None = None,
) -> None:
    """Stage 2's extra deliveries of a task are next-stage duplicates: stage 1 counted them?

    Observed: stage-2 messages per task id beyond one. Counted: the `chain duplicate`
    lines of stage 1 (the same events as sqsinfer_chain_duplicates_total). A possible
    duplicate may not have happened; a certain one has, and was also counted possible by
    the delivery that took the link over. So certain <= observed <= certain + possible.
    To a FIFO stage 2, the extras moto alone lets through (`moto_dedup_gaps`) are not
    counted by the worker and are taken off what is observed.
    """
    gaps = moto_gaps or Counter()
    seen = {t: len(ids) - 1 - gaps[t] for t, ids in _deliveries(stage2).items()}
    extra = {t: n for t, n in seen.items() if n > 0}
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
        "FIFO resends after stage 2 took the first (AWS drops them, moto may not)": sum(
            gaps.values()
        ),
        "downstream duplicates (observed / counted)": f"{observed} / "
        f"{kinds['certain'] + kinds['possible']} "
        f"(certain {kinds['certain']}, possible {kinds['possible']})",
        "chain links taken over": sum(
            1 for line in stage1 if line.get("msg") == Event.CHAIN_LINK_TAKEN_OVER
        ),
    }


def check_logs(
    lines: dict[str, list[dict[str, Any]]],
    work: Workload,
    f: Findings,
    fifo_sends: tuple[list[dict[str, Any]], str] | None = None,
) -> None:
    """`fifo_sends`: with a FIFO stage 2, the sends the proxy recorded and its queue's name."""
    stage1, stage2 = _log_lines(lines, "stage1"), _log_lines(lines, "stage2")
    gaps = moto_dedup_gaps(fifo_sends[0], stage2, fifo_sends[1]) if fifo_sends else None
    check_downstream(stage1, stage2, f, gaps)
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
_OVER_TIME = Event.TASK_OVER_MAX_TIME
_RELEASING = frozenset(
    {
        Event.DRAINING,
        Event.DRAIN_DEADLINE_PASSED,
        Event.LAST_RECEIVE_RELEASED,
        Event.RECEIVING_PAUSED,
    }
)
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
    never are: their messages lapse, as they should). A message of several records
    finishes a line per record: its last line is its delivery's end."""
    let_go = _LetGo()
    found: dict[tuple[str, int], Hold] = {}
    for line in lines:
        if "ts" not in line:
            continue
        at_s = _epoch_s(str(line["ts"]))
        let_go.note(line, at_s)
        if line.get("msg") == _FINISHED and line.get("message_id"):
            hold = Hold(
                worker=worker,
                message_id=str(line["message_id"]),
                receive_count=int(line.get("receive_count", 0)),
                received_s=at_s - float(line.get("seconds", 0.0)),
                let_go_s=let_go.when(line, at_s),
                outcome=str(line.get("outcome")),
                computed="infer" in (line.get("phases") or {}),
            )
            delivery = (hold.message_id, hold.receive_count)
            earlier = found.get(delivery)
            if earlier is not None and earlier.computed:
                hold = dataclasses.replace(hold, computed=True)
            found[delivery] = hold
    return list(found.values())


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
