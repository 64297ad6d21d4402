"""`sqsinfer demo`: a two-stage chain on a local moto server, checked end to end.

Stage 1 scores feature files with one model; stage 2 takes each stage-1 output and
calibrates it with a second model. A few inputs and messages are bad on purpose. Both
workers run as real `sqsinfer worker` processes; the demo then checks, from S3 and the
queues alone, that every valid task has exactly one correct output per stage and every
bad one sits in the dead-letter queue with its reason.
"""

from __future__ import annotations

import argparse
import os
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


def wait_for_drain(
    sqs: Any,
    plan: Plan,
    workers: list[stage.WorkerProcess],
    timeout_s: float,
) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for worker in workers:
            if worker.process.poll() is not None:
                raise RuntimeError(f"{worker.name} worker exited early; see {worker.log_path}")
        outcomes = {w.name: w.outcomes() for w in workers}
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
        started = time.monotonic()
        sqs = standin.clients(moto.url)[1]
        drained = wait_for_drain(sqs, plan, workers, args.timeout_s)
        elapsed = time.monotonic() - started
        outcomes = {w.name: w.outcomes() for w in workers}
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
    return 1 if problems else 0


def main(args: argparse.Namespace) -> int:
    standin.use_fake_credentials()
    with tempfile.TemporaryDirectory() as workdir, standin.moto_server() as moto:
        return _run(args, moto, workdir)
