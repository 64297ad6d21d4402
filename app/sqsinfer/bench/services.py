"""The asyncio scenarios: the http-service design and the emulator ceiling.

- http-service: the design sqsinfer replaced. An asyncio consumer (the worker's own SQS
  code: long-poll receive, batched deletes) reads each input from S3 and POSTs its rows
  as JSON to a model service, then writes the JSON answer to S3. The service is N
  aiohttp processes, one request at a time each, with the model loaded once (or, in
  the `http-service-load-per-request` variant, loaded for every request); the consumer
  sends each request to an idle one, as a least-connections balancer would.
- emulator-ceiling: the worker's SQS and S3 calls per task (receive, GET into shared
  memory, conditional PUT of an output of the real size, batched delete; the HEAD on a
  redelivery only) with no compute at all: what the local stand-in can serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import numpy as np
import orjson
from aiohttp import web

from sqsinfer.aws.s3 import DataPath, Storage
from sqsinfer.aws.session import open_clients
from sqsinfer.aws.sqs import Message, SqsQueue
from sqsinfer.bench.protocol import SPAWN, emit, pin_threads, regime_of, task_finished
from sqsinfer.compute import formats
from sqsinfer.messages import MessageRules, parse_prefixes, parse_s3_uri, parse_task
from sqsinfer.runtime import run_async

Handle = Callable[[Message, float], Awaitable[None]]
_WAIT_TIME_S = 1
_VISIBILITY_S = 60
_MAX_BODY_BYTES = 512 * 1024 * 1024
_READY_TIMEOUT_S = 300.0


# -- the model service (one process per replica) ---------------------------------------------


class ModelService:
    def __init__(self, cfg: dict[str, Any], per_request: bool) -> None:
        self.cfg = cfg
        self.per_request = per_request
        self.booster: Any = None if per_request else self._load()

    def _load(self) -> Any:
        import xgboost

        booster = xgboost.Booster()
        booster.load_model(self.cfg["model_path"])
        booster.set_param({"nthread": self.cfg["threads"]})
        return booster

    async def predict(self, request: web.Request) -> web.Response:
        body = await request.read()
        t0 = time.perf_counter()
        array = np.asarray(orjson.loads(body), dtype=np.float32)
        t1 = time.perf_counter()
        booster = self._load() if self.per_request else self.booster
        predictions = np.asarray(booster.inplace_predict(array, validate_features=False))
        t2 = time.perf_counter()
        answer = orjson.dumps(
            predictions.reshape(len(array), -1), option=orjson.OPT_SERIALIZE_NUMPY
        )
        headers = {"X-Decode-S": f"{t1 - t0:.6f}", "X-Infer-S": f"{t2 - t1:.6f}"}
        return web.Response(body=answer, content_type="application/json", headers=headers)

    async def serve(self, port: int, ready: Any) -> None:
        if not self.per_request:
            features = regime_of(self.cfg).features
            self.booster.inplace_predict(np.zeros((2, features), dtype=np.float32))
        app = web.Application(client_max_size=_MAX_BODY_BYTES)
        app.router.add_post("/predict", self.predict)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        await asyncio.Event().wait()  # until the consumer stops this process


def serve_model(cfg: dict[str, Any], port: int, per_request: bool, ready: Any) -> None:
    """Entry point of one service replica (a spawned process)."""
    pin_threads(cfg["threads"])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    run_async(_serve(cfg, port, per_request, ready))


async def _serve(cfg: dict[str, Any], port: int, per_request: bool, ready: Any) -> int:
    await ModelService(cfg, per_request).serve(port, ready)
    return 0


# -- the consumer loop shared by both scenarios -----------------------------------------------


async def consume(queue: SqsQueue, in_flight: int, stop: asyncio.Event, handle: Handle) -> None:
    """Receive while fewer than `in_flight` messages are held; one task per message."""
    held: set[asyncio.Task[None]] = set()
    while not stop.is_set():
        capacity = in_flight - len(held)
        if capacity <= 0:
            await asyncio.wait(held, return_when=asyncio.FIRST_COMPLETED)
            continue
        began = time.perf_counter()
        messages = await queue.receive(capacity, _WAIT_TIME_S, _VISIBILITY_S)
        receive_s = time.perf_counter() - began
        for message in messages:
            task = asyncio.create_task(_guarded(handle, message, receive_s))
            held.add(task)
            task.add_done_callback(held.discard)
    if held:
        await asyncio.wait(held)
    await queue.drain()


async def _guarded(handle: Handle, message: Message, receive_s: float) -> None:
    try:
        await handle(message, receive_s)
    except Exception as exc:  # reported, and the message comes back after its visibility
        emit({"msg": "task failed", "error": f"{type(exc).__name__}: {exc}"})


def _stop_on_sigterm() -> asyncio.Event:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    return stop


# -- http-service -----------------------------------------------------------------------------


class HttpConsumer:
    def __init__(self, cfg: dict[str, Any], s3: Any, http: aiohttp.ClientSession) -> None:
        self.cfg, self.s3, self.http = cfg, s3, http
        self.queue: SqsQueue | None = None
        self.idle: asyncio.Queue[str] = asyncio.Queue()

    async def handle(self, message: Message, receive_s: float) -> None:
        assert self.queue is not None
        doc = orjson.loads(message.body)
        source = parse_s3_uri(doc["input"])
        t0 = time.perf_counter()
        response = await self.s3.get_object(Bucket=source.bucket, Key=source.key)
        async with response["Body"] as body:
            data = await body.read()
        t1 = time.perf_counter()
        payload = orjson.dumps(
            np.load(io.BytesIO(data), allow_pickle=False), option=orjson.OPT_SERIALIZE_NUMPY
        )
        t2 = time.perf_counter()
        url = await self.idle.get()
        t3 = time.perf_counter()
        try:
            async with self.http.post(url, data=payload) as answer:
                answer.raise_for_status()
                result = await answer.read()
                decode_s = float(answer.headers["X-Decode-S"])
                infer_s = float(answer.headers["X-Infer-S"])
        finally:
            self.idle.put_nowait(url)
        t4 = time.perf_counter()
        key = f"out/{doc['task_id']}.json"
        await self.s3.put_object(Bucket=self.cfg["bucket"], Key=key, Body=result)
        t5 = time.perf_counter()
        await self.queue.delete(message)
        t6 = time.perf_counter()
        handoff_s = (t2 - t1) + (t4 - t3) - decode_s - infer_s
        phases = {"receive": receive_s, "s3_get": t1 - t0, "wait_process": t3 - t2}
        phases |= {"handoff": handoff_s, "decode": decode_s, "infer": infer_s}
        task_finished(t6 - t0, phases | {"commit": t5 - t4, "delete": t6 - t5})


def _start_services(cfg: dict[str, Any], per_request: bool) -> tuple[list[Any], list[str]]:
    from sqsinfer.lab.standin import free_port

    procs, urls, events = [], [], []
    for _ in range(cfg["processes"]):
        port, ready = free_port(), SPAWN.Event()
        proc = SPAWN.Process(target=serve_model, args=(cfg, port, per_request, ready), daemon=True)
        proc.start()
        procs.append(proc)
        events.append(ready)
        urls.append(f"http://127.0.0.1:{port}/predict")
    for event in events:
        if not event.wait(_READY_TIMEOUT_S):
            raise RuntimeError("a model service did not start")
    return procs, urls


async def http_service(cfg: dict[str, Any], per_request: bool) -> int:
    started = time.perf_counter()
    stop = _stop_on_sigterm()
    procs, urls = await asyncio.to_thread(_start_services, cfg, per_request)
    try:
        emit({"msg": "ready", "startup_s": round(time.perf_counter() - started, 3)})
        in_flight = cfg["in_flight"]
        connector = aiohttp.TCPConnector(limit=len(urls) * 2)
        async with (
            open_clients(cfg["region"], cfg["endpoint"], in_flight) as clients,
            aiohttp.ClientSession(connector=connector) as http,
        ):
            consumer = HttpConsumer(cfg, clients.s3, http)
            consumer.queue = SqsQueue(clients.sqs, cfg["queue_url"])
            for url in urls:
                consumer.idle.put_nowait(url)
            await consume(consumer.queue, in_flight, stop, consumer.handle)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            await asyncio.to_thread(proc.join, 10)
    return 0


# -- emulator ceiling ---------------------------------------------------------------------------


class CallsOnly:
    """The worker's calls for one task, with an output of the real size and no compute."""

    def __init__(self, cfg: dict[str, Any], storage: Storage, queue: SqsQueue) -> None:
        bucket = cfg["bucket"]
        self.rules = MessageRules(
            allowed_input_prefixes=parse_prefixes(f"s3://{bucket}/in/", "input"),
            allowed_output_prefixes=parse_prefixes(f"s3://{bucket}/out/", "output"),
            output_prefix=parse_s3_uri(f"s3://{bucket}/out/", "output", prefix=True),
        )
        self.storage, self.queue = storage, queue
        self.max_bytes = cfg["max_input_bytes"]
        out = io.BytesIO()
        np.save(out, np.zeros((regime_of(cfg).rows, 1), dtype=np.float32), allow_pickle=False)
        self.output = out.getvalue()

    async def handle(self, message: Message, receive_s: float) -> None:
        t0 = time.perf_counter()
        task = parse_task(message.body, self.rules)
        if message.receive_count > 1:  # as the worker: a first delivery does not look
            await self.storage.head(task.output)
        t1 = time.perf_counter()
        shared = await self.storage.get_shared(task.input, self.max_bytes)
        shared.close()
        t2 = time.perf_counter()
        meta = {"task-id": task.task_id}
        await self.storage.commit(task.output, self.output, meta, formats.named("npy").content_type)
        t3 = time.perf_counter()
        await self.queue.delete(message)
        t4 = time.perf_counter()
        phases = {"receive": receive_s, "check": t1 - t0, "s3_get": t2 - t1}
        task_finished(t4 - t0, phases | {"commit": t3 - t2, "delete": t4 - t3})


async def emulator_ceiling(cfg: dict[str, Any]) -> int:
    stop = _stop_on_sigterm()
    in_flight = cfg["in_flight"]
    async with open_clients(cfg["region"], cfg["endpoint"], in_flight) as clients:
        queue = SqsQueue(clients.sqs, cfg["queue_url"])
        data = DataPath(clients.route, clients.credentials)
        calls = CallsOnly(cfg, Storage(clients.s3, data=data), queue)
        emit({"msg": "ready", "startup_s": 0.0})
        await consume(queue, in_flight, stop, calls.handle)
    return 0


def main(name: str, cfg: dict[str, Any]) -> int:
    with contextlib.suppress(KeyboardInterrupt):
        if name == "http-service":
            return run_async(http_service(cfg, per_request=False))
        if name == "http-service-load-per-request":
            return run_async(http_service(cfg, per_request=True))
        if name == "emulator-ceiling":
            return run_async(emulator_ceiling(cfg))
    raise SystemExit(f"unknown scenario {name!r}")
