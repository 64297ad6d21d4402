"""The scenarios other than sqsinfer itself, each run as its own process tree.

    python -m sqsinfer.bench.child NAME CONFIG.json

Every scenario writes the lines the worker writes: `{"msg": "ready", ...}` once its
processes are loaded, then `{"msg": "task finished", "seconds": .., "phases": {..}}`
per task (JSON, on stderr). It runs until SIGTERM. `seconds` runs from the moment the
receive returned to the moment the delete was confirmed, as the worker measures it.

- compute-only: decode + predict + encode the inputs in N spawned processes (the
  worker's own child code), no queue, no S3: the limit.
- naive: N spawned processes, each a synchronous boto3 loop: receive one message, GET,
  predict, PUT, delete it; no pre-fetch.
(http-service and the emulator ceiling are asyncio programs: see `sqsinfer.bench.services`.)
"""

from __future__ import annotations

import io
import signal
import sys
import threading
import time
from typing import Any

import numpy as np
import orjson

from sqsinfer.bench.protocol import SPAWN, emit, pin_threads, regime_of, task_finished

_READY_TIMEOUT_S = 300.0


def compute_loop(cfg: dict[str, Any], index: int, ready: Any, start: Any, stop: Any) -> None:
    """One process: the worker's child code (decode → predict → encode) on in-memory inputs."""
    from sqsinfer.bench import workload
    from sqsinfer.compute import inference

    pin_threads(cfg["threads"])
    inference.init_process(
        cfg["handler"], cfg["model_path"], cfg["threads"], "", cfg["max_decoded_bytes"]
    )
    inference.warm_up()
    inputs = workload.input_bytes(regime_of(cfg), cfg["seed"])
    ready.release()
    start.wait()
    k = index
    while not stop.is_set():
        data = inputs[k % len(inputs)]
        k += cfg["processes"]
        began = time.perf_counter()
        result = inference._compute(memoryview(data), "npy", "npy")  # the child's own step
        task_finished(
            time.perf_counter() - began,
            {p: result[f"{p}_s"] for p in ("decode", "infer", "encode")},
        )


# -- naive -------------------------------------------------------------------------------


class NaiveLoop:
    """What a hand-rolled consumer looks like: one message at a time, all synchronous."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        import boto3
        import xgboost

        kw = {"endpoint_url": cfg["endpoint"], "region_name": cfg["region"]}
        self.s3, self.sqs = boto3.client("s3", **kw), boto3.client("sqs", **kw)
        self.queue_url = cfg["queue_url"]
        self.bucket = cfg["bucket"]
        self.booster = xgboost.Booster()
        self.booster.load_model(cfg["model_path"])
        self.booster.set_param({"nthread": cfg["threads"]})
        self.booster.inplace_predict(np.zeros((2, regime_of(cfg).features), dtype=np.float32))

    def once(self) -> None:
        began = time.perf_counter()
        got = self.sqs.receive_message(
            QueueUrl=self.queue_url, MaxNumberOfMessages=1, WaitTimeSeconds=1
        ).get("Messages", [])
        received = time.perf_counter()
        if got:
            self.handle(got[0], {"receive": received - began})

    def handle(self, message: dict[str, Any], phases: dict[str, float]) -> None:
        from sqsinfer.messages import parse_s3_uri

        t0 = time.perf_counter()
        doc = orjson.loads(message["Body"])
        source = parse_s3_uri(doc["input"])
        data = self.s3.get_object(Bucket=source.bucket, Key=source.key)["Body"].read()
        t1 = time.perf_counter()
        array = np.load(io.BytesIO(data), allow_pickle=False)
        t2 = time.perf_counter()
        predictions = self.booster.inplace_predict(array, validate_features=False)
        t3 = time.perf_counter()
        out = io.BytesIO()
        np.save(out, np.asarray(predictions).reshape(len(array), -1), allow_pickle=False)
        key = f"out/{doc['task_id']}.npy"
        self.s3.put_object(Bucket=self.bucket, Key=key, Body=out.getvalue())
        t4 = time.perf_counter()
        self.sqs.delete_message(QueueUrl=self.queue_url, ReceiptHandle=message["ReceiptHandle"])
        t5 = time.perf_counter()
        phases |= {"s3_get": t1 - t0, "decode": t2 - t1, "infer": t3 - t2}
        task_finished(t5 - t0, phases | {"commit": t4 - t3, "delete": t5 - t4})


def naive_loop(cfg: dict[str, Any], index: int, ready: Any, start: Any, stop: Any) -> None:
    pin_threads(cfg["threads"])
    loop = NaiveLoop(cfg)
    ready.release()
    start.wait()
    while not stop.is_set():
        loop.once()


# -- the root of a multi-process scenario ---------------------------------------------------


def run_processes(cfg: dict[str, Any], target: Any) -> int:
    """Start N spawned processes, say "ready" when all are loaded, stop them on SIGTERM."""
    started = time.perf_counter()
    ready, start, stop = SPAWN.Semaphore(0), SPAWN.Event(), SPAWN.Event()
    # The handler only sets a flag: setting `stop` from inside a signal handler could
    # deadlock on the lock `stop.wait` holds at that moment.
    asked = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: asked.set())
    procs = [
        SPAWN.Process(target=target, args=(cfg, i, ready, start, stop), daemon=True)
        for i in range(cfg["processes"])
    ]
    for proc in procs:
        proc.start()
    for _ in procs:
        if not ready.acquire(timeout=_READY_TIMEOUT_S):
            emit({"msg": "start failed", "error": "a process did not get ready"})
            return 1
    emit({"msg": "ready", "startup_s": round(time.perf_counter() - started, 3)})
    start.set()
    while not asked.is_set() and all(p.is_alive() for p in procs):
        time.sleep(0.1)
    stop.set()
    for proc in procs:
        proc.join(timeout=30)
    return 0


def main(argv: list[str]) -> int:
    name, config_path = argv
    with open(config_path, "rb") as fh:
        cfg = orjson.loads(fh.read())
    pin_threads(cfg["threads"])
    if name == "compute-only":
        return run_processes(cfg, compute_loop)
    if name == "naive":
        return run_processes(cfg, naive_loop)
    from sqsinfer.bench import services

    return services.main(name, cfg)


if __name__ == "__main__":
    threading.current_thread().name = "bench-child"
    sys.exit(main(sys.argv[1:]))
