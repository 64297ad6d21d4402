"""`sqsinfer demo`: a two-stage chain on a local moto server, checked end to end.

Stage 1 scores feature files with one model; stage 2 takes each stage-1 output and
calibrates it with a second model. A few inputs and messages are bad on purpose. Both
workers run as real `sqsinfer worker` processes; the demo then checks, from S3 and the
queues alone, that every valid task has exactly one correct output per stage and every
bad one sits in the dead-letter queue with its reason.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sqsinfer.handlers.xgboost_impl import XGBoostHandler
from sqsinfer.lab import standin, synthetic
from sqsinfer.queue import REASON_ATTR

BUCKET = "sqsinfer-demo"
STAGE1_FEATURES = 12
FORMATS = ("npy", "npy", "json", "jsonl", "csv")
MAX_RECEIVE_COUNT = 3


@dataclass
class Plan:
    """What was enqueued, and what the demo expects to find afterwards."""

    valid: dict[str, np.ndarray] = field(default_factory=dict)  # task id → input rows
    bad: dict[str, str] = field(default_factory=dict)  # message body → expected reason
    queues: dict[str, str] = field(default_factory=dict)


def clients(endpoint: str) -> tuple[Any, Any]:
    import boto3

    kw = {"endpoint_url": endpoint, "region_name": "us-east-1"}
    return boto3.client("s3", **kw), boto3.client("sqs", **kw)


def create_queues(
    sqs: Any, prefix: str = "demo", max_receive_count: int = MAX_RECEIVE_COUNT
) -> dict[str, str]:
    """Two stages of queues, each with a dead-letter queue and a redrive policy."""
    urls = {}
    for stage in ("stage1", "stage2"):
        dlq = sqs.create_queue(QueueName=f"{prefix}-{stage}-dlq")["QueueUrl"]
        arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])
        policy = {
            "deadLetterTargetArn": arn["Attributes"]["QueueArn"],
            "maxReceiveCount": str(max_receive_count),
        }
        urls[stage] = sqs.create_queue(
            QueueName=f"{prefix}-{stage}", Attributes={"RedrivePolicy": json.dumps(policy)}
        )["QueueUrl"]
        urls[f"{stage}-dlq"] = dlq
    return urls


def _bad_inputs(s3: Any) -> dict[str, str]:
    """Messages that must end in the DLQ, each with the reason it must carry."""
    put = s3.put_object
    put(Bucket=BUCKET, Key="in/bad-garbage.npy", Body=b"\x93NUMPY not really")
    narrow = synthetic.encode_input(synthetic.make_rows(3, 5, seed=9), "npy")
    put(Bucket=BUCKET, Key="in/bad-narrow.npy", Body=narrow)
    put(Bucket=BUCKET, Key="in/bad-text.csv", Body=b"a,b\n1,x\n")
    put(Bucket=BUCKET, Key="secret/model-weights.npy", Body=narrow)
    return {
        '{"task_id": "broken-json", "input": ': "malformed_json",
        json.dumps({"input": f"s3://{BUCKET}/in/t.npy"}): "missing_field",
        json.dumps(
            {"task_id": "t-outside", "input": f"s3://{BUCKET}/secret/model-weights.npy"}
        ): "input_not_allowed",
        json.dumps(
            {"task_id": "t-garbage", "input": f"s3://{BUCKET}/in/bad-garbage.npy"}
        ): "undecodable_input",
        json.dumps(
            {"task_id": "t-narrow", "input": f"s3://{BUCKET}/in/bad-narrow.npy"}
        ): "wrong_feature_count",
        json.dumps(
            {"task_id": "t-text", "input": f"s3://{BUCKET}/in/bad-text.csv"}
        ): "undecodable_input",
        json.dumps(
            {"task_id": "t-missing", "input": f"s3://{BUCKET}/in/nowhere.npy"}
        ): "input_not_found",
    }


def _upload_valid(s3: Any, tasks: int, rows: int) -> dict[str, tuple[np.ndarray, str]]:
    made = {}
    for i in range(tasks):
        fmt = FORMATS[i % len(FORMATS)]
        made[f"task-{i:05d}"] = (synthetic.make_rows(rows, STAGE1_FEATURES, seed=1000 + i), fmt)

    def put(item: tuple[str, tuple[np.ndarray, str]]) -> None:
        task_id, (array, fmt) = item
        body = synthetic.encode_input(array, fmt)
        s3.put_object(Bucket=BUCKET, Key=f"in/{task_id}.{fmt}", Body=body)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, made.items()))
    return made


def _enqueue(sqs: Any, url: str, bodies: list[str]) -> None:
    for start in range(0, len(bodies), 10):
        entries = [
            {"Id": str(i), "MessageBody": body} for i, body in enumerate(bodies[start : start + 10])
        ]
        response = sqs.send_message_batch(QueueUrl=url, Entries=entries)
        if response.get("Failed"):
            raise RuntimeError(f"enqueue failed: {response['Failed']}")


def prepare(endpoint: str, tasks: int, rows: int) -> Plan:
    s3, sqs = clients(endpoint)
    s3.create_bucket(Bucket=BUCKET)
    plan = Plan(queues=create_queues(sqs))
    made = _upload_valid(s3, tasks, rows)
    plan.valid = {task_id: array for task_id, (array, _) in made.items()}
    plan.bad = _bad_inputs(s3)
    bodies = [
        json.dumps({"task_id": task_id, "input": f"s3://{BUCKET}/in/{task_id}.{fmt}"})
        for task_id, (_, fmt) in made.items()
    ]
    _enqueue(sqs, plan.queues["stage1"], bodies + list(plan.bad))
    return plan


@dataclass
class StageProcess:
    name: str
    process: subprocess.Popen[bytes]
    health_port: int
    log_path: str
    env: dict[str, str] = field(default_factory=dict)

    def restart(self) -> None:
        """Start the same worker again (same settings, same log file)."""
        self.process = _spawn_worker(self.env, self.log_path)

    def metrics(self) -> dict[str, float]:
        url = f"http://127.0.0.1:{self.health_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        found = {}
        for line in text.splitlines():
            if line.startswith("sqsinfer_tasks_total{"):
                outcome = line.split('"')[1]
                found[outcome] = float(line.rsplit(" ", 1)[1])
        return found

    def ready(self) -> bool:
        try:
            url = f"http://127.0.0.1:{self.health_port}/readyz"
            with urllib.request.urlopen(url, timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False


def start_stage(name: str, env: dict[str, str], workdir: str) -> StageProcess:
    port = standin.free_port()
    log_path = os.path.join(workdir, f"{name}.log")
    full_env = {
        **os.environ,
        **standin.FAKE_CREDENTIALS,
        **env,
        "SQSINFER_HEALTH_PORT": str(port),
        "SQSINFER_HEALTH_HOST": "127.0.0.1",
        "SQSINFER_LOG_FORMAT": "json",
        "SQSINFER_WORKER_ID": f"demo-{name}",
    }
    return StageProcess(name, _spawn_worker(full_env, log_path), port, log_path, full_env)


def _spawn_worker(env: dict[str, str], log_path: str) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "sqsinfer", "worker"], env=env, stderr=log_file, stdout=log_file
        )


def _stage_env(
    plan: Plan, endpoint: str, workdir: str, processes: int
) -> dict[str, dict[str, str]]:
    model1 = synthetic.train_model(os.path.join(workdir, "stage1.ubj"), STAGE1_FEATURES, seed=11)
    model2 = synthetic.train_model(os.path.join(workdir, "stage2.json"), 1, trees=8, seed=12)
    common = {
        "SQSINFER_ENDPOINT_URL": endpoint,
        "SQSINFER_PROCESSES": str(processes),
        "SQSINFER_WAIT_TIME_S": "2",
        "SQSINFER_RETRY_BASE_S": "1",
        "SQSINFER_TASK_TIME_S": "10",
        "SQSINFER_DRAIN_DEADLINE_S": "10",
    }
    return {
        "stage1": common
        | {
            "SQSINFER_QUEUE_URL": plan.queues["stage1"],
            "SQSINFER_NEXT_QUEUE_URL": plan.queues["stage2"],
            "SQSINFER_MODEL_PATH": model1,
            "SQSINFER_ALLOWED_INPUT_PREFIXES": f"s3://{BUCKET}/in/",
            "SQSINFER_OUTPUT_PREFIX": f"s3://{BUCKET}/stage1/",
        },
        "stage2": common
        | {
            "SQSINFER_QUEUE_URL": plan.queues["stage2"],
            "SQSINFER_MODEL_PATH": model2,
            "SQSINFER_ALLOWED_INPUT_PREFIXES": f"s3://{BUCKET}/stage1/",
            "SQSINFER_OUTPUT_PREFIX": f"s3://{BUCKET}/stage2/",
            "SQSINFER_OUTPUT_FORMAT": "json",
        },
    }


def wait_ready(stages: list[StageProcess], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    for stage in stages:
        while not stage.ready():
            if stage.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{stage.name} worker did not start; see {stage.log_path}")
            time.sleep(0.1)


def queue_depth(sqs: Any, url: str) -> int:
    attrs = sqs.get_queue_attributes(
        QueueUrl=url,
        AttributeNames=[
            "ApproximateNumberOfMessages",
            "ApproximateNumberOfMessagesNotVisible",
            "ApproximateNumberOfMessagesDelayed",
        ],
    )["Attributes"]
    return sum(int(v) for v in attrs.values())


def wait_for_drain(sqs: Any, plan: Plan, stages: list[StageProcess], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for stage in stages:
            if stage.process.poll() is not None:
                raise RuntimeError(f"{stage.name} worker exited early; see {stage.log_path}")
        expected = len(plan.valid) + len(plan.bad)
        done1 = sum(stages[0].metrics().values())
        if done1 >= expected and all(
            queue_depth(sqs, plan.queues[q]) == 0 for q in ("stage1", "stage2")
        ):
            return True
        time.sleep(0.5)
    return False


def stop_stages(stages: list[StageProcess]) -> list[int]:
    for stage in stages:
        stage.process.send_signal(signal.SIGTERM)
    return [stage.process.wait(timeout=60) for stage in stages]


def predictor(model_path: str) -> XGBoostHandler:
    handler = XGBoostHandler()
    handler.load(model_path, 1)
    return handler


def read_objects(s3: Any, prefix: str, bucket: str = BUCKET) -> dict[str, bytes]:
    found = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            found[item["Key"]] = b""
    with ThreadPoolExecutor(8) as pool:
        bodies = pool.map(lambda k: s3.get_object(Bucket=bucket, Key=k)["Body"].read(), found)
        return dict(zip(found, bodies, strict=True))


def check_stage(
    objects: dict[str, bytes], expected: dict[str, np.ndarray], fmt: str
) -> tuple[list[str], dict[str, np.ndarray]]:
    """Compare outputs with expected predictions; return problems and the decoded outputs."""
    problems, decoded = [], {}
    outputs = {k: v for k, v in objects.items() if not k.endswith(".chain")}
    missing = sorted(set(expected) - set(outputs))
    extra = sorted(set(outputs) - set(expected))
    problems += [f"missing output {k}" for k in missing[:5]] + [
        f"unexpected {k}" for k in extra[:5]
    ]
    for key, want in expected.items():
        if key in outputs:
            decoded[key] = synthetic.decode_output(outputs[key], fmt)
            if not np.allclose(decoded[key], want.reshape(decoded[key].shape), rtol=1e-5):
                problems.append(f"wrong prediction in {key}")
    return problems, decoded


def check(endpoint: str, plan: Plan, workdir: str) -> tuple[list[str], dict[str, Any]]:
    s3, sqs = clients(endpoint)
    model1 = predictor(os.path.join(workdir, "stage1.ubj"))
    model2 = predictor(os.path.join(workdir, "stage2.json"))
    expected1 = {f"stage1/{t}.npy": model1.predict(rows) for t, rows in plan.valid.items()}
    stage1 = read_objects(s3, "stage1/")
    problems, decoded1 = check_stage(stage1, expected1, "npy")
    markers = sum(1 for k in stage1 if k.endswith(".chain"))
    if markers != len(plan.valid):
        problems.append(f"{markers} chain markers for {len(plan.valid)} tasks")
    expected2 = {
        f"stage2/{k[len('stage1/') : -len('.npy')]}.json": model2.predict(v.reshape(-1, 1))
        for k, v in decoded1.items()
    }
    more, _ = check_stage(read_objects(s3, "stage2/"), expected2, "json")
    problems += more
    dead = dead_letters(sqs, plan.queues["stage1-dlq"])
    if dead != plan.bad:
        problems.append(f"DLQ holds {dead}, expected {plan.bad}")
    if dead_letters(sqs, plan.queues["stage2-dlq"]):
        problems.append("stage 2 DLQ is not empty")
    facts = {"outputs": [len(decoded1), len(expected2)], "dead_letters": dead}
    return problems, facts


def dead_letters(sqs: Any, url: str) -> dict[str, str]:
    return {body: reason or "(no reason)" for body, reason in dead_letter_entries(sqs, url)}


def dead_letter_entries(sqs: Any, url: str) -> list[tuple[str, str]]:
    """Every message on a DLQ as (body, reason), one per copy; '' when it has no reason."""
    found: list[tuple[str, str]] = []
    while True:
        got = sqs.receive_message(
            QueueUrl=url, MaxNumberOfMessages=10, MessageAttributeNames=["All"], WaitTimeSeconds=0
        ).get("Messages", [])
        if not got:
            return found
        for message in got:
            reason = message.get("MessageAttributes", {}).get(REASON_ATTR, {})
            found.append((message["Body"], str(reason.get("StringValue", ""))))


def print_summary(
    plan: Plan, outcomes: dict[str, dict[str, float]], elapsed_s: float, problems: list[str]
) -> None:
    names = ("committed", "duplicate", "rejected", "retried", "released")
    print()
    print(f"{'stage':<8}" + "".join(f"{n:>11}" for n in names))
    for stage, counts in outcomes.items():
        print(f"{stage:<8}" + "".join(f"{int(counts.get(n, 0)):>11}" for n in names))
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


def main(args: argparse.Namespace) -> int:
    standin.use_fake_credentials()
    with tempfile.TemporaryDirectory() as workdir, standin.moto_server() as moto:
        print(f"moto server on {moto.url}; preparing {args.tasks} tasks ...", flush=True)
        plan = prepare(moto.url, args.tasks, args.rows)
        envs = _stage_env(plan, moto.url, workdir, args.processes)
        stages = [start_stage(name, env, workdir) for name, env in envs.items()]
        try:
            wait_ready(stages)
            started = time.monotonic()
            drained = wait_for_drain(clients(moto.url)[1], plan, stages, args.timeout_s)
            elapsed = time.monotonic() - started
            outcomes = {s.name: s.metrics() for s in stages}
        finally:
            codes = stop_stages(stages)
        problems, _ = check(moto.url, plan, workdir)
        if not drained:
            problems.insert(0, f"queues did not drain within {args.timeout_s} s")
        exits = zip(stages, codes, strict=True)
        problems += [f"{s.name} worker exited with {code}" for s, code in exits if code]
        print_summary(plan, outcomes, elapsed, problems)
        if problems:
            for stage in stages:
                print(f"\n--- last lines of {stage.name} log ---")
                with open(stage.log_path) as fh:
                    print("".join(fh.readlines()[-15:]))
        return 1 if problems else 0
