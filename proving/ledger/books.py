"""The books: `sqsinfer audit` of the chain (as an operator runs it, in its own process),
an audit killed half-way and run again, and the tampering it must then name."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from proving.chaos.verdict import Findings
from proving.ledger.chain import BUCKET, STAGES, Chain
from sqsinfer.aws.sqs import Message, dead_letter_copy
from sqsinfer.lab import standin

# A finding as the checks compare them: task, stage, category, reason.
Named = tuple[str, str, str, str]
_HOLD_S = "5"  # a killed audit's dead letters come back this soon


@dataclass(frozen=True)
class Audited:
    code: int
    report: dict[str, Any]
    elapsed_s: float

    @property
    def named(self) -> set[Named]:
        return {
            (f["task_id"], f["stage"], f["category"], f.get("reason", ""))
            for f in self.report.get("findings", [])
        }


def argv(chain: Chain) -> list[str]:
    """The audit of the whole chain, every output's model checked (so every lineage read)."""
    command = [sys.executable, "-m", "sqsinfer", "audit", chain.manifest, "--json", "--quiet"]
    command += ["--endpoint-url", chain.endpoint, "--dlq-hold-s", _HOLD_S, "--show", "100"]
    for name in STAGES:
        spec = f"queue={chain.queues[name]},prefix={chain.prefix(name)},model={chain.sha256(name)}"
        command += ["--stage", spec]
    return command


def _env() -> dict[str, str]:
    return {**os.environ, **standin.FAKE_CREDENTIALS}


def audit(chain: Chain) -> Audited:
    started = time.monotonic()
    done = subprocess.run(argv(chain), env=_env(), capture_output=True, check=False)
    elapsed_s = time.monotonic() - started
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        report = {"error": done.stderr.decode(errors="replace")[-2000:]}
    return Audited(done.returncode, report, elapsed_s)


def killed_then_again(chain: Chain, after_s: float) -> tuple[bool, Audited]:
    """An audit SIGKILLed `after_s` into its run (if still running), then a whole one."""
    process = subprocess.Popen(
        argv(chain), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + after_s
    while process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    killed = process.poll() is None
    process.send_signal(signal.SIGKILL)
    process.wait()
    return killed, audit(chain)


def check_whole(audited: Audited, chain: Chain, f: Findings) -> None:
    """Every task committed once at every stage, by that stage's model."""
    report, tasks = audited.report, len(chain.task_ids)
    f.expect(audited.code == 0, f"the audit exited {audited.code}: {str(report)[:400]}")
    f.expect(report.get("complete") is True, "the audit did not find the batch complete")
    for name, found in zip(STAGES, report.get("stages", []), strict=False):
        models = {chain.sha256(name): tasks}
        f.expect(found["committed"] == tasks, f"{name}: {found['committed']} of {tasks} committed")
        f.expect(found["by_model"] == models, f"{name}: outputs by model {found['by_model']}")
        for category in ("missing", "written_twice", "output_conflict", "link_pending"):
            f.expect(found[category] == 0, f"{name}: {found[category]} {category}")
    f.figures["audit: tasks, stages"] = f"{report.get('tasks')}, {len(report.get('stages', []))}"
    f.figures["audit: missing / written twice"] = (
        f"{sum(s['missing'] for s in report.get('stages', []))} / "
        f"{sum(s['written_twice'] for s in report.get('stages', []))}"
    )
    f.figures["audit: time (tasks x stages / s)"] = (
        f"{audited.elapsed_s:.1f} s ({tasks * len(STAGES) / audited.elapsed_s:,.0f}/s)"
    )


def tamper(chain: Chain, seed: int) -> set[Named]:
    """Delete 3 outputs (one a stage), squat 1, dead-letter 2; what the audit must name."""
    s3, sqs = standin.clients(chain.endpoint)
    a, b, c, d, e, g = random.Random(seed).sample(chain.task_ids, 6)
    name = {stage: chain.queues[stage].rstrip("/").rsplit("/", 1)[1] for stage in STAGES}

    def key(stage: str, task_id: str) -> str:
        return f"{stage}/{task_id}.npy"

    for stage, task_id in (("stage1", a), ("stage2", b), ("stage3", c)):
        s3.delete_object(Bucket=BUCKET, Key=key(stage, task_id))
    squatter = f"squatter-of-{d}"
    s3.put_object(
        Bucket=BUCKET, Key=key("stage2", d), Body=b"not its", Metadata={"task-id": squatter}
    )
    for stage, task_id, reason in (
        ("stage1", e, "undecodable_input"),
        ("stage3", g, "wrong_feature_count"),
    ):
        s3.delete_object(Bucket=BUCKET, Key=key(stage, task_id))
        _dead_letter(sqs, chain, stage, task_id, reason)
    return {
        (a, name["stage1"], "missing", ""),
        (b, name["stage2"], "missing", ""),
        (c, name["stage3"], "missing", ""),
        (d, name["stage2"], "output_conflict", f"task {squatter!r}"),
        (e, name["stage1"], "dead_lettered", "undecodable_input"),
        (g, name["stage3"], "dead_lettered", "wrong_feature_count"),
    }


def _dead_letter(sqs: Any, chain: Chain, stage: str, task_id: str, reason: str) -> None:
    """The copy a worker of `stage` sends when it rejects the task's message."""
    n = STAGES.index(stage)
    source = (
        f"s3://{BUCKET}/in/{task_id}.npy"
        if n == 0
        else f"{chain.prefix(STAGES[n - 1])}{task_id}.npy"
    )
    body = json.dumps({"task_id": task_id, "input": source})
    copy = dead_letter_copy(
        Message(f"tampered-{task_id}", "-", body, 1),
        reason,
        "put there by the test",
        chain.queues[stage],
    )
    sqs.send_message(
        QueueUrl=chain.queues[f"{stage}-dlq"],
        MessageBody=copy.body,
        MessageAttributes=copy.attributes,
    )


def check_tampered(audited: Audited, expected: set[Named], chain: Chain, f: Findings) -> None:
    named = audited.named
    f.expect(audited.code == 1, f"the audit of the tampered chain exited {audited.code}")
    f.expect(named == expected, f"named {sorted(named - expected)}, not {sorted(expected - named)}")
    f.expect(audited.report.get("problems") == len(expected), "more findings than the tampering")
    _, sqs = standin.clients(chain.endpoint)
    kept = [
        stage for stage in ("stage1", "stage3") if _visible(sqs, chain.queues[f"{stage}-dlq"]) != 1
    ]
    f.expect(not kept, f"dead letters not handed back in {kept}")
    f.figures["tampered: named / done"] = f"{len(named & expected)} / {len(expected)}"


def _visible(sqs: Any, url: str) -> int:
    attrs = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages"])
    return int(attrs["Attributes"]["ApproximateNumberOfMessages"])
