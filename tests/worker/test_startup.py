"""Start-up against missing or failing dependencies: wait for what may pass, stop on what won't."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from proving.faults import FaultPlan, FaultProxy
from sqsinfer.lab import standin
from sqsinfer.worker.lifecycle import Worker
from sqsinfer.worker.preflight import StartupError
from tests.conftest import Stage, eventually, outcome_count, sample


async def _status(url: str) -> int:
    try:
        async with aiohttp.ClientSession() as http, http.get(url) as response:
            return response.status
    except aiohttp.ClientError:
        return 0


async def test_an_endpoint_down_at_start_is_waited_for(stage: Stage, make_settings):
    port = standin.free_port()
    worker = Worker(make_settings(endpoint_url=f"http://127.0.0.1:{port}"))
    serving = asyncio.create_task(worker.serve())
    proxy = FaultProxy(stage.endpoint, FaultPlan(), port=port)
    try:
        await eventually(lambda: worker.health.port != 0)
        base = f"http://127.0.0.1:{worker.health.port}"
        await asyncio.sleep(1.5)  # a few refused connections
        assert not serving.done()
        assert await _status(base + "/readyz") == 503
        assert await _status(base + "/livez") == 200

        # Calls that got no answer at all are counted as failed calls, by operation.
        def calls(name: str) -> float:
            return sample(worker.metrics, name, operation="GetQueueAttributes")

        await eventually(lambda: calls("sqsinfer_aws_errors_total") >= 1)
        assert calls("sqsinfer_aws_requests_total") >= calls("sqsinfer_aws_errors_total")
        await proxy.start()  # the endpoint comes back
        await eventually(lambda: worker.ready, timeout_s=60)
        assert await _status(base + "/readyz") == 200
        stage.send({"task_id": "late", "input": f"s3://{stage.bucket}/in/none.npy"})
        await eventually(lambda: outcome_count(worker, "rejected") == 1)
    finally:
        worker.stop()
        await asyncio.wait_for(serving, 60)
        await proxy.stop()


async def test_shutdown_while_waiting_for_an_endpoint_exits_cleanly(make_settings):
    worker = Worker(make_settings(endpoint_url=f"http://127.0.0.1:{standin.free_port()}"))
    serving = asyncio.create_task(worker.serve())
    await asyncio.sleep(1.0)
    worker.stop()
    await asyncio.wait_for(serving, 30)  # no exception: a normal stop
    assert not worker.ready


async def test_a_missing_output_bucket_stops_start_up(make_settings):
    settings = make_settings(
        output_prefix="s3://no-such-bucket-here/out/",
        allowed_output_prefixes="s3://no-such-bucket-here/",
    )
    with pytest.raises(StartupError, match="SQSINFER_OUTPUT_PREFIX: cannot find bucket"):
        await Worker(settings).serve()


async def test_a_missing_next_queue_stops_start_up(stage: Stage, make_settings):
    missing = stage.queue_url.rsplit("/", 1)[0] + "/missing-queue"
    with pytest.raises(StartupError, match="SQSINFER_NEXT_QUEUE_URL: cannot read queue"):
        await Worker(make_settings(next_queue_url=missing)).serve()


async def test_a_queue_without_dead_letter_queue_is_refused(stage: Stage, make_settings):
    bare = stage.sqs.create_queue(QueueName=stage.bucket + "-bare")["QueueUrl"]
    with pytest.raises(StartupError, match="SQSINFER_DLQ_URL: not set"):
        await Worker(make_settings(queue_url=bare)).serve()
    # Named explicitly, a DLQ makes the same queue acceptable.
    worker = Worker(make_settings(queue_url=bare, dlq_url=stage.dlq_url))
    serving = asyncio.create_task(worker.serve())
    await eventually(lambda: worker.ready)
    worker.stop()
    await serving


async def test_refused_credentials_stop_start_up(stage: Stage, make_settings):
    proxy = FaultProxy(stage.endpoint, FaultPlan(refuse_credentials=True))
    await proxy.start()
    try:
        with pytest.raises(StartupError, match="AWS credentials or policy refused"):
            await Worker(make_settings(endpoint_url=proxy.url)).serve()
    finally:
        await proxy.stop()
