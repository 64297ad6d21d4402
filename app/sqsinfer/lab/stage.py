"""A stage on the local stand-in: its bucket, its queue with a dead-letter queue and a
redrive policy, and the `sqsinfer worker` processes that serve it.

The demo, chaos, the soak, the benchmarks and the tests all set up their stages here:
a worker runs as a real process (`python -m sqsinfer worker`) with JSON logs in a file,
its health server on loopback, and the settings a stage gives it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from sqsinfer.aws.sqs import DEPTH_ATTRIBUTES, REASON_ATTR
from sqsinfer.lab import standin, synthetic
from sqsinfer.limits import SQS_FIFO_SUFFIX

if TYPE_CHECKING:  # imported where used: the CLI builds this wing's parsers everywhere
    import psutil

MAX_RECEIVE_COUNT = 3
# A local task takes well under a second: a short drain keeps every stop quick (the
# worker insists on drain_deadline_s >= task_time_s).
SHORT_DRAIN = {"SQSINFER_TASK_TIME_S": "5", "SQSINFER_DRAIN_DEADLINE_S": "10"}
_DEPTH_ATTRIBUTES = list(DEPTH_ATTRIBUTES.values())


# -- queues and buckets ---------------------------------------------------------------------


@dataclass(frozen=True)
class QueuePair:
    url: str
    dlq_url: str


def create_queue(
    sqs: Any,
    name: str,
    *,
    max_receive_count: int = MAX_RECEIVE_COUNT,
    attributes: Mapping[str, str] | None = None,
    fifo: bool = False,
) -> QueuePair:
    """A queue `name` and its dead-letter queue `name-dlq`, tied by a redrive policy;
    with `fifo`, both FIFO queues (`name.fifo`, `name-dlq.fifo`: a FIFO queue's DLQ must be
    one too)."""
    suffix, kind = (SQS_FIFO_SUFFIX, {"FifoQueue": "true"}) if fifo else ("", {})
    dlq = sqs.create_queue(QueueName=f"{name}-dlq{suffix}", Attributes=kind)["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]
    policy = {"deadLetterTargetArn": arn["QueueArn"], "maxReceiveCount": str(max_receive_count)}
    url = sqs.create_queue(
        QueueName=name + suffix,
        Attributes={"RedrivePolicy": json.dumps(policy), **kind, **(attributes or {})},
    )["QueueUrl"]
    return QueuePair(url, dlq)


def create_chain(
    sqs: Any, prefix: str, max_receive_count: int = MAX_RECEIVE_COUNT, *, fifo_stage2: bool = False
) -> dict[str, str]:
    """Two stages' queues: `stage1`, `stage1-dlq`, `stage2`, `stage2-dlq` → URL; stage 2's
    FIFO queues with `fifo_stage2`."""
    urls = {}
    for name in ("stage1", "stage2"):
        fifo = fifo_stage2 and name == "stage2"
        pair = create_queue(sqs, f"{prefix}-{name}", max_receive_count=max_receive_count, fifo=fifo)
        urls[name], urls[f"{name}-dlq"] = pair.url, pair.dlq_url
    return urls


def create_bucket(s3: Any, name: str, *, versioned: bool = False) -> str:
    region = s3.meta.region_name
    # S3 takes a bucket outside us-east-1 only with its region named.
    where = {} if region == "us-east-1" else {"LocationConstraint": region}
    s3.create_bucket(Bucket=name, **({"CreateBucketConfiguration": where} if where else {}))
    if versioned:  # an overwrite would then show as a second version
        s3.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    return name


# -- a bucket's event notifications ----------------------------------------------------------


def queue_arn(sqs: Any, url: str) -> str:
    return str(
        sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"][
            "QueueArn"
        ]
    )


def notify_queue(endpoint: str, bucket: str, queue_url: str, *, prefix: str) -> None:
    """The bucket sends an event for each object created under `prefix` to the queue (S3
    sends an s3:TestEvent first)."""
    s3, sqs = standin.clients(endpoint)
    configuration = {
        "QueueConfigurations": [{"QueueArn": queue_arn(sqs, queue_url), **_created_under(prefix)}]
    }
    s3.put_bucket_notification_configuration(Bucket=bucket, NotificationConfiguration=configuration)


def notify_through_sns(
    endpoint: str, bucket: str, subscriptions: Sequence[tuple[str, bool]], *, prefix: str
) -> str:
    """The bucket's events for objects created under `prefix` go to a new SNS topic, which
    delivers them to each subscribed queue URL, raw (the S3 body itself) where its flag is
    True. One queue may be subscribed twice."""
    s3, sqs = standin.clients(endpoint)
    sns = standin.client("sns", endpoint)
    topic = str(sns.create_topic(Name=f"{bucket}-events")["TopicArn"])
    for url, raw in subscriptions:
        sns.subscribe(
            TopicArn=topic,
            Protocol="sqs",
            Endpoint=queue_arn(sqs, url),
            Attributes={"RawMessageDelivery": "true" if raw else "false"},
        )
    configuration = {"TopicConfigurations": [{"TopicArn": topic, **_created_under(prefix)}]}
    s3.put_bucket_notification_configuration(Bucket=bucket, NotificationConfiguration=configuration)
    return topic


def notify_through_eventbridge(endpoint: str, bucket: str, queue_url: str, *, prefix: str) -> None:
    """The bucket sends its events to EventBridge; a rule on the default bus hands those
    of objects under `prefix`, created or deleted, to the queue."""
    s3, sqs = standin.clients(endpoint)
    events = standin.client("events", endpoint)
    pattern = {
        "source": ["aws.s3"],
        "detail-type": ["Object Created", "Object Deleted"],
        "detail": {"bucket": {"name": [bucket]}, "object": {"key": [{"prefix": prefix}]}},
    }
    rule = f"{bucket}-objects"
    events.put_rule(Name=rule, EventPattern=json.dumps(pattern))
    events.put_targets(Rule=rule, Targets=[{"Id": "queue", "Arn": queue_arn(sqs, queue_url)}])
    s3.put_bucket_notification_configuration(
        Bucket=bucket, NotificationConfiguration={"EventBridgeConfiguration": {}}
    )


def _created_under(prefix: str) -> dict[str, Any]:
    return {
        "Events": ["s3:ObjectCreated:*"],
        "Filter": {"Key": {"FilterRules": [{"Name": "prefix", "Value": prefix}]}},
    }


def put_objects(s3: Any, bucket: str, objects: Mapping[str, bytes], threads: int = 8) -> list[str]:
    """Upload key → bytes in parallel; the s3:// URIs, in the mapping's order."""

    def put(item: tuple[str, bytes]) -> str:
        s3.put_object(Bucket=bucket, Key=item[0], Body=item[1])
        return f"s3://{bucket}/{item[0]}"

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(put, objects.items()))


def queue_depth(sqs: Any, url: str) -> int:
    """Visible, in flight and delayed messages."""
    attrs = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=_DEPTH_ATTRIBUTES)
    return sum(int(v) for v in attrs["Attributes"].values())


# -- reading back what a stage left ---------------------------------------------------------


def read_objects(s3: Any, bucket: str, prefix: str) -> dict[str, bytes]:
    keys = list_keys(s3, bucket, prefix)
    with ThreadPoolExecutor(8) as pool:
        bodies = pool.map(lambda k: s3.get_object(Bucket=bucket, Key=k)["Body"].read(), keys)
        return dict(zip(keys, bodies, strict=True))


def list_keys(s3: Any, bucket: str, prefix: str) -> list[str]:
    keys = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [item["Key"] for item in page.get("Contents", [])]
    return keys


def dead_letters(sqs: Any, url: str) -> dict[str, str]:
    """Body → rejection reason of every message in a dead-letter queue. They stay there:
    received, not deleted, so they are visible again after the visibility timeout."""
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


# -- a worker process -----------------------------------------------------------------------


def stage_settings(
    endpoint: str,
    queue_url: str,
    model_path: str,
    *,
    reads: str,
    writes: str,
    next_queue_url: str = "",
) -> dict[str, str]:
    """The settings that make a worker serve a stage: reads under `reads`, writes under
    `writes` (both s3:// prefixes), hands on to `next_queue_url` if given."""
    settings = {
        "SQSINFER_ENDPOINT_URL": endpoint,
        # The stand-in's region, whatever AWS_REGION the shell has (its resources are there).
        "SQSINFER_REGION": standin.REGION,
        "SQSINFER_QUEUE_URL": queue_url,
        "SQSINFER_MODEL_PATH": model_path,
        "SQSINFER_ALLOWED_INPUT_PREFIXES": reads,
        "SQSINFER_OUTPUT_PREFIX": writes,
    }
    if next_queue_url:
        settings["SQSINFER_NEXT_QUEUE_URL"] = next_queue_url
    return settings


def chain_settings(
    endpoint: str, queues: Mapping[str, str], models: Mapping[str, str], bucket: str
) -> dict[str, dict[str, str]]:
    """A two-stage chain in one bucket (queues as `create_chain` names them): stage 1 reads
    in/ and writes stage1/, handing each output on to stage 2, which writes stage2/."""
    layout = {
        "stage1": ("in/", "stage1/", queues["stage2"]),
        "stage2": ("stage1/", "stage2/", ""),
    }
    return {
        name: stage_settings(
            endpoint,
            queues[name],
            models[name],
            reads=f"s3://{bucket}/{reads}",
            writes=f"s3://{bucket}/{writes}",
            next_queue_url=next_url,
        )
        for name, (reads, writes, next_url) in layout.items()
    }


def worker_env(name: str, settings: Mapping[str, str], health_port: int) -> dict[str, str]:
    """A worker's whole environment: this one, the fake credentials, JSON logs, health on
    loopback, its id, then the stage's settings (which win)."""
    return {
        **os.environ,
        **standin.FAKE_CREDENTIALS,
        "SQSINFER_HEALTH_HOST": "127.0.0.1",
        "SQSINFER_HEALTH_PORT": str(health_port),
        "SQSINFER_LOG_FORMAT": "json",
        "SQSINFER_WORKER_ID": name,
        **settings,
    }


@dataclass
class WorkerProcess:
    """`python -m sqsinfer worker` in its own process, its output appended to `log_path`."""

    name: str
    env: dict[str, str]
    log_path: str
    health_port: int
    process: subprocess.Popen[bytes] = field(init=False)

    def start(self) -> None:
        """Start the worker, or start it again: same settings, same log file."""
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "sqsinfer", "worker"],
                env=self.env,
                stdout=log_file,
                stderr=log_file,
                stdin=subprocess.DEVNULL,
            )

    def ready(self) -> bool:
        try:
            url = f"http://127.0.0.1:{self.health_port}/readyz"
            with urllib.request.urlopen(url, timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def metrics_text(self) -> str:
        url = f"http://127.0.0.1:{self.health_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    def outcomes(self) -> dict[str, float]:
        """Tasks by outcome so far, from the worker's /metrics."""
        found = {}
        for line in self.metrics_text().splitlines():
            if line.startswith("sqsinfer_tasks_total{"):
                outcome = line.split('"')[1]
                found[outcome] = float(line.rsplit(" ", 1)[1])
        return found

    def counter(self, name: str) -> float:
        """The sum of a metric's samples (every label) from the worker's /metrics."""
        total = 0.0
        for line in self.metrics_text().splitlines():
            if line.startswith((name + " ", name + "{")):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def pool_children(self) -> list[psutil.Process]:
        """The worker's inference processes (spawned; not the resource tracker)."""
        import psutil  # the [local] extra

        try:
            children = psutil.Process(self.process.pid).children()
        except psutil.NoSuchProcess:
            return []
        found = []
        for child in children:
            with contextlib.suppress(psutil.Error):
                if "spawn_main" in " ".join(child.cmdline()):
                    found.append(child)
        return found

    def log_records(self) -> list[dict[str, Any]]:
        """Every JSON line the worker has logged so far."""
        return LogTail(self.log_path).read()

    def tail_text(self, lines: int = 20) -> str:
        return LogTail(self.log_path).tail_text(lines)

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (the worker drains) and wait; its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout_s)


def start_worker(name: str, settings: Mapping[str, str], workdir: str) -> WorkerProcess:
    port = standin.free_port()
    log_path = os.path.join(workdir, f"{name}.log")
    worker = WorkerProcess(name, worker_env(name, settings, port), log_path, port)
    worker.start()
    return worker


def wait_ready(workers: list[WorkerProcess], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    for worker in workers:
        while not worker.ready():
            if worker.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"{worker.name} worker did not start; its log ends:\n{worker.tail_text()}"
                )
            time.sleep(0.1)


def stop_workers(workers: list[WorkerProcess], timeout_s: float = 60.0) -> list[int]:
    """SIGTERM them all at once (each drains), then wait for each; their exit codes. One
    SIGTERM each: a second one during the drain would end the worker at once."""
    for worker in workers:
        if worker.process.poll() is None:
            worker.process.send_signal(signal.SIGTERM)
    return [worker.process.wait(timeout=timeout_s) for worker in workers]


class LogTail:
    """Reads the JSON lines a process appends to its log file, as they arrive."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        records = []
        for line in lines:
            if line.startswith(b"{"):
                with contextlib.suppress(orjson.JSONDecodeError):
                    doc = orjson.loads(line)
                    if isinstance(doc, dict):
                        records.append(doc)
        return records

    def tail_text(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError), open(self.path, "rb") as fh:
            return b"".join(fh.readlines()[-lines:]).decode(errors="replace")
        return ""
