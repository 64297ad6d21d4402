"""`sqsinfer demo`: a two-stage chain on a local moto server, checked end to end.

Stage 1 scores feature files with one model; stage 2 takes each stage-1 output and
calibrates it with a second model. A few inputs and messages are bad on purpose. Both
workers run as real `sqsinfer worker` processes; the demo shows each stage's progress
while they run, then checks, from S3 and the queues alone, that every valid task has
exactly one correct output per stage and every bad one sits in the dead-letter queue
with its reason. With `--keep` the stand-in stays up afterwards, for `sqsinfer status`,
`redrive` and a worker of one's own to look at.
"""

from __future__ import annotations

import argparse
import collections
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from sqsinfer.lab import feeder, stage, standin, synthetic

BUCKET = "sqsinfer-demo"
STAGE1_FEATURES = 12
FORMATS = ("npy", "npy", "json", "jsonl", "csv")
OUTCOMES = ("committed", "duplicate", "rejected", "retried", "released")
FINAL = ("committed", "duplicate", "rejected")  # outcomes that end a message
_PLAIN_EVERY_S = 3.0
_RATE_WINDOW_S = 5.0


@dataclass
class Plan:
    """What was enqueued, and what the demo expects to find afterwards."""

    valid: dict[str, np.ndarray] = field(default_factory=dict)  # task id → input rows
    bad: dict[str, str] = field(default_factory=dict)  # message body → expected reason
    queues: dict[str, str] = field(default_factory=dict)
    models: dict[str, str] = field(default_factory=dict)  # stage → model file

    def expected(self) -> dict[str, int]:
        """Messages each stage must bring to an end."""
        return {"stage1": len(self.valid) + len(self.bad), "stage2": len(self.valid)}


def _bad_inputs(s3: Any) -> dict[str, str]:
    """Messages that must end in the DLQ, each with the reason it must carry."""
    narrow = synthetic.encode_input(synthetic.make_rows(3, 5, seed=9), "npy")
    stage.put_objects(
        s3,
        BUCKET,
        {
            "in/bad-garbage.npy": b"\x93NUMPY not really",
            "in/bad-narrow.npy": narrow,
            "in/bad-text.csv": b"a,b\n1,x\n",
            "secret/model-weights.npy": narrow,
        },
    )

    def task(task_id: str, key: str) -> str:
        return orjson.dumps({"task_id": task_id, "input": f"s3://{BUCKET}/{key}"}).decode()

    return {
        '{"task_id": "broken-json", "input": ': "malformed_json",
        orjson.dumps({"input": f"s3://{BUCKET}/in/t.npy"}).decode(): "missing_field",
        task("t-outside", "secret/model-weights.npy"): "input_not_allowed",
        task("t-garbage", "in/bad-garbage.npy"): "undecodable_input",
        task("t-narrow", "in/bad-narrow.npy"): "wrong_feature_count",
        task("t-text", "in/bad-text.csv"): "undecodable_input",
        task("t-missing", "in/nowhere.npy"): "input_not_found",
    }


def prepare(endpoint: str, tasks: int, rows: int) -> Plan:
    s3, sqs = standin.clients(endpoint)
    stage.create_bucket(s3, BUCKET)
    plan = Plan(queues=stage.create_chain(sqs, "demo"))
    made = {
        f"task-{i:05d}": (
            synthetic.make_rows(rows, STAGE1_FEATURES, seed=1000 + i),
            FORMATS[i % len(FORMATS)],
        )
        for i in range(tasks)
    }
    stage.put_objects(
        s3,
        BUCKET,
        {f"in/{t}.{fmt}": synthetic.encode_input(rows_, fmt) for t, (rows_, fmt) in made.items()},
    )
    plan.valid = {task_id: array for task_id, (array, _) in made.items()}
    plan.bad = _bad_inputs(s3)
    bodies = [
        orjson.dumps({"task_id": t, "input": f"s3://{BUCKET}/in/{t}.{fmt}"}).decode()
        for t, (_, fmt) in made.items()
    ] + list(plan.bad)
    # A few hundred messages: moto's queue stays quick at that depth, so all at once.
    feeder.Feeder(sqs, plan.queues["stage1"], feeder.listed(bodies), len(bodies)).top_up(
        len(bodies)
    )
    return plan


def _settings(plan: Plan, endpoint: str, processes: int) -> dict[str, dict[str, str]]:
    common = stage.SHORT_DRAIN | {
        "SQSINFER_PROCESSES": str(processes),
        "SQSINFER_WAIT_TIME_S": "2",
        "SQSINFER_RETRY_BASE_S": "1",
    }
    chain = stage.chain_settings(endpoint, plan.queues, plan.models, BUCKET)
    return {
        "stage1": common | chain["stage1"],
        "stage2": common | chain["stage2"] | {"SQSINFER_OUTPUT_FORMAT": "json"},
    }


def _train(workdir: str) -> dict[str, str]:
    return {
        "stage1": synthetic.train_model(
            os.path.join(workdir, "stage1.ubj"), STAGE1_FEATURES, seed=11
        ),
        "stage2": synthetic.train_model(os.path.join(workdir, "stage2.json"), 1, trees=8, seed=12),
    }


# -- while it runs ----------------------------------------------------------------------------


class Progress:
    """Each stage's messages ended so far (committed, rejected) and its rate over the last
    few seconds: a live view on a terminal (rich), a plain line every few seconds otherwise
    (a log, CI)."""

    def __init__(self, expected: dict[str, int]) -> None:
        from rich.console import Console

        self.expected = expected
        self.started = time.monotonic()
        self.history: collections.deque[tuple[float, dict[str, int]]] = collections.deque()
        self.live: Any = None
        self.printed_at = 0.0
        if Console().is_terminal:
            self.live = self._bars()

    def _bars(self) -> Any:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        bars = Progress(
            TextColumn("  {task.description:<7}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("{task.fields[counts]}"),
        )
        for name, total in self.expected.items():
            bars.add_task(name, total=total, counts="")
        bars.start()
        return bars

    def _rates(self, ended: dict[str, int]) -> dict[str, str]:
        now = time.monotonic()
        self.history.append((now, ended))
        while now - self.history[0][0] > _RATE_WINDOW_S:
            self.history.popleft()
        then, before = self.history[0]
        if now - then < 1.0:
            return dict.fromkeys(ended, "…")
        return {k: f"{(ended[k] - before[k]) / (now - then):.1f}/s" for k in ended}

    def update(self, outcomes: dict[str, dict[str, float]]) -> None:
        ended = {k: int(sum(c.get(o, 0) for o in FINAL)) for k, c in outcomes.items()}
        rates = self._rates(ended)
        parts = []
        for index, (name, counts) in enumerate(outcomes.items()):
            text = (
                f"{int(counts.get('committed', 0))} committed, "
                f"{int(counts.get('rejected', 0))} rejected, {rates[name]}"
            )
            if self.live is not None:
                self.live.update(self.live.task_ids[index], completed=ended[name], counts=text)
            parts.append(f"{name} {ended[name]}/{self.expected[name]} ({text})")
        if self.live is None and time.monotonic() - self.printed_at >= _PLAIN_EVERY_S:
            self.printed_at = time.monotonic()
            elapsed = time.monotonic() - self.started
            print(f"  {elapsed:4.0f} s  " + "  ".join(parts), flush=True)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


def wait_for_drain(
    sqs: Any,
    plan: Plan,
    workers: list[stage.WorkerProcess],
    timeout_s: float,
    progress: Progress,
) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for worker in workers:
            if worker.process.poll() is not None:
                raise RuntimeError(f"{worker.name} worker exited early; see {worker.log_path}")
        outcomes = {w.name: w.outcomes() for w in workers}
        progress.update(outcomes)
        if sum(outcomes["stage1"].values()) >= plan.expected()["stage1"] and all(
            stage.queue_depth(sqs, plan.queues[q]) == 0 for q in ("stage1", "stage2")
        ):
            return True
        time.sleep(0.5)
    return False


# -- the check --------------------------------------------------------------------------------


def check(endpoint: str, plan: Plan) -> tuple[list[str], dict[str, Any]]:
    s3, sqs = standin.clients(endpoint)
    model1 = synthetic.predictor(plan.models["stage1"])
    model2 = synthetic.predictor(plan.models["stage2"])
    expected1 = {f"stage1/{t}.npy": model1.predict(rows) for t, rows in plan.valid.items()}
    stage1 = stage.read_objects(s3, BUCKET, "stage1/")
    problems, decoded1 = stage.check_stage(stage1, expected1, "npy")
    markers = sum(1 for k in stage1 if k.endswith(".chain"))
    if markers != len(plan.valid):
        problems.append(f"{markers} chain markers for {len(plan.valid)} tasks")
    expected2 = {
        f"stage2/{k[len('stage1/') : -len('.npy')]}.json": model2.predict(v.reshape(-1, 1))
        for k, v in decoded1.items()
    }
    more, _ = stage.check_stage(stage.read_objects(s3, BUCKET, "stage2/"), expected2, "json")
    problems += more
    dead = stage.dead_letters(sqs, plan.queues["stage1-dlq"])
    if dead != plan.bad:
        problems.append(f"DLQ holds {dead}, expected {plan.bad}")
    if stage.dead_letters(sqs, plan.queues["stage2-dlq"]):
        problems.append("stage 2 DLQ is not empty")
    facts = {"outputs": [len(decoded1), len(expected2)], "dead_letters": dead}
    return problems, facts


def print_summary(
    plan: Plan, outcomes: dict[str, dict[str, float]], elapsed_s: float, problems: list[str]
) -> None:
    print()
    print(f"{'stage':<8}" + "".join(f"{n:>11}" for n in OUTCOMES))
    for name, counts in outcomes.items():
        print(f"{name:<8}" + "".join(f"{int(counts.get(n, 0)):>11}" for n in OUTCOMES))
    tasks = len(plan.valid)
    print(
        f"\n{tasks} valid tasks, {len(plan.bad)} bad messages, two stages: "
        f"{elapsed_s:.1f} s, {2 * tasks / elapsed_s:.1f} task-stages/s"
    )
    reasons = sorted(set(plan.bad.values()))
    print("dead-letter reasons expected and found: " + ", ".join(reasons))
    if problems:
        print("\nCHECK FAILED:")
        for problem in problems:
            print("  - " + problem)
    else:
        print(
            "\ncheck passed: every valid task has exactly one correct output per stage, "
            "one chain link each, and every bad message is in the DLQ with its reason"
        )


# -- what next --------------------------------------------------------------------------------


def own_command() -> str:
    """How to call `sqsinfer` from here: the bare name if PATH finds this installation's,
    else its path (after `make demo`: .venv/bin/sqsinfer)."""
    mine = os.path.join(os.path.dirname(sys.executable), "sqsinfer")
    if not os.path.exists(mine) or shutil.which("sqsinfer") == mine:
        return "sqsinfer"
    relative = os.path.relpath(mine)
    return relative if not relative.startswith("..") else mine


def next_step_lines(endpoint: str, plan: Plan) -> list[str]:
    """The environment and commands that point the operator tools and a worker at the
    stand-in the demo leaves running."""
    cmd, q = own_command(), plan.queues
    creds = " ".join(f"{k}={v}" for k, v in standin.FAKE_CREDENTIALS.items())
    return [
        "The stand-in stays up with the demo's queues, dead-letter queues and outputs until "
        "Ctrl-C. In another shell:",
        "",
        f"  export SQSINFER_ENDPOINT_URL={endpoint} SQSINFER_REGION={standin.REGION}",
        f"  export {creds}",
        f"  export STAGE1={q['stage1']} STAGE2={q['stage2']}",
        "",
        f"  {cmd} status --queue-url $STAGE1 --queue-url $STAGE2   # depths, DLQs under them",
        f"  {cmd} redrive --queue-url $STAGE1 --dry-run            # dead letters by reason",
        f"  {cmd} worker --queue-url $STAGE1 --next-queue-url $STAGE2 \\",
        f"      --model-path {shlex.quote(plan.models['stage1'])} \\",
        f"      --allowed-input-prefixes s3://{BUCKET}/in/ --output-prefix s3://{BUCKET}/stage1/",
        "",
        f"Outputs are under s3://{BUCKET}/stage1/ and s3://{BUCKET}/stage2/.",
    ]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _keep_until_interrupted(endpoint: str, plan: Plan) -> None:
    # Ctrl-C or SIGTERM: either unwinds through the stand-in's and the workdir's clean-up
    # (SIGINT too is set, since a shell that starts a job in the background ignores it).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    print("\n" + "\n".join(next_step_lines(endpoint, plan)), flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\nstand-in stopped", flush=True)


def _suggest_keep() -> None:
    print(
        f"\nnext: `{own_command()} demo --keep` runs it again, then leaves the stand-in up\n"
        "with the environment to point `sqsinfer status`, `redrive` and a worker at its\n"
        "queues, dead letters and outputs (from make: make demo DEMO_ARGS=--keep)."
    )


# -- the command ------------------------------------------------------------------------------


def _run(args: argparse.Namespace, moto: standin.MotoServer, workdir: str) -> int:
    print(f"moto server on {moto.url}; preparing {args.tasks} tasks ...", flush=True)
    plan = prepare(moto.url, args.tasks, args.rows)
    plan.models = _train(workdir)
    workers = [
        stage.start_worker(name, settings, workdir)
        for name, settings in _settings(plan, moto.url, args.processes).items()
    ]
    try:
        stage.wait_ready(workers)
        print("both workers ready; each stage's messages as they end:", flush=True)
        progress = Progress(plan.expected())
        started = time.monotonic()
        try:
            sqs = standin.clients(moto.url)[1]
            drained = wait_for_drain(sqs, plan, workers, args.timeout_s, progress)
            elapsed = time.monotonic() - started
            outcomes = {w.name: w.outcomes() for w in workers}
            progress.update(outcomes)
        finally:
            progress.close()
    finally:
        codes = stage.stop_workers(workers)
    problems, _ = check(moto.url, plan)
    if not drained:
        problems.insert(0, f"queues did not drain within {args.timeout_s} s")
    exits = zip(workers, codes, strict=True)
    problems += [f"{w.name} worker exited with {code}" for w, code in exits if code]
    print_summary(plan, outcomes, elapsed, problems)
    if problems:
        for worker in workers:
            print(f"\n--- last lines of {worker.name} log ---\n{worker.tail_text(15)}")
    if args.keep:
        _keep_until_interrupted(moto.url, plan)
    elif not problems:
        _suggest_keep()
    return 1 if problems else 0


def main(args: argparse.Namespace) -> int:
    if not standin.has_local_extra("sqsinfer demo"):
        return 2
    standin.use_fake_credentials()
    with tempfile.TemporaryDirectory() as workdir, standin.moto_server() as moto:
        return _run(args, moto, workdir)
