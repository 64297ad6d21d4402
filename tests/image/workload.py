"""What the pods of the image lane work on: a two-stage chain on the stand-in, its models,
inputs of every format, bad messages with the reason each must carry, and the chart values
that make a release of each stage point at it all."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import socket
from pathlib import Path
from typing import Any

import numpy as np

from sqsinfer.lab import stage, standin, synthetic

BUCKET = "image-lane"
FEATURES = 8
ROWS = 20
FORMATS = ("npy", "json", "jsonl", "csv", "parquet")
TASKS_PER_FORMAT = 2
# A local task takes well under a second; a short drain keeps every stop quick (the chart
# derives a grace period of ceil(10 + 15) + 5 = 30 s from it).
SHORT_DRAIN = {"task_time_s": 5, "drain_deadline_s": 10}


@dataclasses.dataclass
class Chain:
    endpoint: str
    s3: Any
    sqs: Any
    queues: dict[str, str]  # stage1, stage1-dlq, stage2, stage2-dlq → URL
    model1: Path  # in the bucket at models/stage1.ubj too, pinned by model1_sha256
    model1_sha256: str
    model_dir: Path  # a folder with stage2.json, mounted by stage 2 as its model volume
    tasks: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # id → rows
    inputs: dict[str, str] = dataclasses.field(default_factory=dict)  # id → s3:// input
    bad: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # queue → bodies
    reasons: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)

    def uri(self, key: str) -> str:
        return f"s3://{BUCKET}/{key}"

    def send(self, queue: str, body: str) -> None:
        self.sqs.send_message(QueueUrl=self.queues[queue], MessageBody=body)


def make_chain(endpoint: str, workdir: Path) -> Chain:
    """Bucket, queues, both models and every input, on the stand-in at `endpoint`."""
    s3, sqs = standin.clients(endpoint)
    stage.create_bucket(s3, BUCKET)
    queues = stage.create_chain(sqs, "lane")
    model1 = Path(synthetic.train_model(str(workdir / "stage1.ubj"), FEATURES, seed=11))
    model_dir = workdir / "stage2-model"
    model_dir.mkdir(mode=0o755)
    synthetic.train_model(str(model_dir / "stage2.json"), 1, trees=8, seed=12)
    (model_dir / "stage2.json").chmod(0o644)
    data = model1.read_bytes()
    s3.put_object(Bucket=BUCKET, Key="models/stage1.ubj", Body=data)
    chain = Chain(endpoint, s3, sqs, queues, model1, hashlib.sha256(data).hexdigest(), model_dir)
    objects = {}
    for i in range(len(FORMATS) * TASKS_PER_FORMAT):
        fmt = FORMATS[i % len(FORMATS)]
        task_id = f"task-{i:02d}-{fmt}"
        chain.tasks[task_id] = synthetic.make_rows(ROWS, FEATURES, seed=100 + i)
        objects[f"in/{task_id}.{fmt}"] = synthetic.encode_input(chain.tasks[task_id], fmt)
        chain.inputs[task_id] = chain.uri(f"in/{task_id}.{fmt}")
    stage.put_objects(s3, BUCKET, objects)
    _bad_messages(chain)
    return chain


def _bad_messages(chain: Chain) -> None:
    narrow = synthetic.encode_input(synthetic.make_rows(3, FEATURES - 3, seed=9), "npy")
    header = repr({"descr": "|O", "fortran_order": False, "shape": (2, 2)}).encode()
    header += b" " * (63 - len(header) % 64) + b"\n"
    pickled = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + b"\x80\x04x."
    stage.put_objects(
        chain.s3,
        BUCKET,
        {
            "in/bad-garbage.npy": b"\x93NUMPY not really",
            "in/bad-pickled.npy": pickled,  # an object array: refused, never unpickled
            "in/bad-narrow.npy": narrow,
            "in/bad-garbage.parquet": b"PAR1 not really PAR1",
            "private/weights.npy": narrow,
        },
    )

    def task(task_id: str, key: str) -> str:
        return json.dumps({"task_id": task_id, "input": chain.uri(key)})

    chain.reasons = {
        "stage1": {
            '{"task_id": "broken-json", "input": ': "malformed_json",
            task("bad-outside", "private/weights.npy"): "input_not_allowed",
            task("bad-missing", "in/nowhere.npy"): "input_not_found",
            task("bad-garbage", "in/bad-garbage.npy"): "undecodable_input",
            task("bad-pickled", "in/bad-pickled.npy"): "undecodable_input",
            task("bad-narrow", "in/bad-narrow.npy"): "wrong_feature_count",
            task("bad-parquet", "in/bad-garbage.parquet"): "undecodable_input",
        },
        # stage 2 reads stage 1's outputs only
        "stage2": {task("bad-raw-input", "in/task-00-npy.npy"): "input_not_allowed"},
    }


def expected_outputs(chain: Chain) -> tuple[dict[str, np.ndarray], Any]:
    """Stage 1's outputs as its model predicts them, and stage 2's model to check the rest."""
    model1 = synthetic.predictor(str(chain.model1))
    model2 = synthetic.predictor(str(chain.model_dir / "stage2.json"))
    return {f"stage1/{t}.npy": model1.predict(rows) for t, rows in chain.tasks.items()}, model2


def check_chain(chain: Chain) -> list[str]:
    """Every task committed and chained once, correctly; every bad message in its DLQ with
    its reason. The problems found (none when all is well)."""
    expected1, model2 = expected_outputs(chain)
    stage1 = stage.read_objects(chain.s3, BUCKET, "stage1/")
    problems, decoded1 = stage.check_stage(stage1, expected1, "npy")
    markers = sorted(k for k in stage1 if k.endswith(".chain"))
    if len(markers) != len(chain.tasks):
        problems.append(f"{len(markers)} chain markers for {len(chain.tasks)} tasks")
    expected2 = {
        f"stage2/{k.removeprefix('stage1/').removesuffix('.npy')}.json": model2.predict(
            v.reshape(-1, 1)
        )
        for k, v in decoded1.items()
    }
    more, _ = stage.check_stage(stage.read_objects(chain.s3, BUCKET, "stage2/"), expected2, "json")
    problems += more
    for name, reasons in chain.reasons.items():
        found = sorted(stage.dead_letter_entries(chain.sqs, chain.queues[f"{name}-dlq"]))
        if found != sorted(reasons.items()):
            problems.append(f"{name} DLQ holds {found}, expected {sorted(reasons.items())}")
    return problems


def settled(chain: Chain) -> bool:
    """Both queues empty, stage 2's outputs all there, both DLQs as full as they will be."""
    outputs = [k for k in stage.list_keys(chain.s3, BUCKET, "stage2/") if k.endswith(".json")]
    depths = {name: stage.queue_depth(chain.sqs, url) for name, url in chain.queues.items()}
    return (
        len(outputs) == len(chain.tasks)
        and depths["stage1"] == depths["stage2"] == 0
        and depths["stage1-dlq"] == len(chain.reasons["stage1"])
        and depths["stage2-dlq"] == len(chain.reasons["stage2"])
    )


# -- chart values -------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def release_values(image: str, endpoint: str, **worker: Any) -> dict[str, Any]:
    """Values of one release on this machine: the image just built, the stand-in's endpoint,
    its fake credentials (what IRSA would inject), the health server on loopback (the pod
    shares the host's network) on a port of its own, and a short drain."""
    repository, _, tag = image.rpartition(":")
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "extraEnv": [{"name": k, "value": v} for k, v in standin.FAKE_CREDENTIALS.items()],
        "worker": {
            "endpoint_url": endpoint,
            "region": standin.REGION,  # the stand-in's queue URLs name none, for KEDA's
            "health_host": "127.0.0.1",
            "health_port": free_port(),
            **SHORT_DRAIN,
            **worker,
        },
    }


def stage_values(image: str, chain: Chain, name: str) -> dict[str, Any]:
    """Stage 1 fetches its model from S3 (pinned) into the chart's /tmp; stage 2 mounts its
    own from a volume, read-only, and writes JSON."""
    if name == "stage1":
        values = release_values(
            image,
            chain.endpoint,
            queue_url=chain.queues["stage1"],
            next_queue_url=chain.queues["stage2"],
            model_path=chain.uri("models/stage1.ubj"),
            model_sha256=chain.model1_sha256,
            allowed_input_prefixes=[chain.uri("in/")],
            output_prefix=chain.uri("stage1/"),
        )
        return values
    values = release_values(
        image,
        chain.endpoint,
        queue_url=chain.queues["stage2"],
        model_path="/models/stage2.json",
        allowed_input_prefixes=[chain.uri("stage1/")],
        output_prefix=chain.uri("stage2/"),
        output_format="json",
    )
    values["model"] = {"volume": {"hostPath": {"path": str(chain.model_dir), "type": "Directory"}}}
    return values
