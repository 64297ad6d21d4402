"""The data path: each task's GET into shared memory and its conditional PUT, through
obstore, with the SDK path's semantics (412 a duplicate, 404 `input_not_found`, the size
refused before anything is read, a broken body retried, a 409 retried, metadata kept,
every call counted), against the stand-in and the fault proxy in front of it."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest

from proving.faults import FaultPlan
from sqsinfer import shm
from sqsinfer.aws.s3 import DataPath, Storage
from sqsinfer.aws.session import SDK_RETRIES, open_clients
from sqsinfer.compute.errors import InputError
from sqsinfer.messages import S3Uri
from sqsinfer.metrics import Metrics
from tests.conftest import Stage, fault_proxy, sample

INPUT = bytes(range(256)) * 12_000  # 3 MB: more than one chunk
META = {"task-id": "t1", "delivery": "d1"}
CONTENT_TYPE = "application/x-npy"


async def _storage(endpoint: str, metrics: Metrics) -> AsyncIterator[Storage]:
    async with open_clients("us-east-1", endpoint) as clients:
        data = DataPath(clients.route, clients.credentials, metrics.count_call)
        yield Storage(clients.s3, data=data)


def _calls(metrics: Metrics, operation: str) -> tuple[float, float]:
    made = sample(metrics, "sqsinfer_aws_requests_total", operation=operation)
    return made, sample(metrics, "sqsinfer_aws_errors_total", operation=operation)


def _segments() -> set[str]:
    """This process's segments: the tests running beside it make and remove their own."""
    mine = shm.new_name().rsplit("-", 1)[0] + "-"
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(mine)}


async def test_get_and_conditional_put_keep_the_sdk_semantics(stage: Stage):
    metrics = Metrics()
    uri = S3Uri(stage.bucket, "in/a.bin")
    stage.s3.put_object(Bucket=stage.bucket, Key=uri.key, Body=INPUT)
    out = S3Uri(stage.bucket, "out/a.npy")
    async for storage in _storage(stage.endpoint, metrics):
        with await storage.get_shared(uri, len(INPUT)) as shared:
            assert shared.size == len(INPUT)
            assert bytes(shared._view[: shared.size]) == INPUT
        assert await storage.commit(out, b"first", META, CONTENT_TYPE)
        assert await storage.commit(out, b"second", META | {"delivery": "d2"}, CONTENT_TYPE) is None
        found = await storage.head(out)  # the SDK's HEAD reads what obstore wrote
        assert found is not None and found.metadata == META
        before = _segments()
        with pytest.raises(InputError) as caught:
            await storage.get_shared(uri, len(INPUT) - 1)
        assert caught.value.reason == "input_too_large"
        assert _segments() == before  # refused before a segment was made
        with pytest.raises(InputError) as caught:
            await storage.get_shared(S3Uri(stage.bucket, "in/none.bin"), 1 << 20)
        assert caught.value.reason == "input_not_found"
    head = stage.s3.head_object(Bucket=stage.bucket, Key=out.key)
    assert head["Metadata"] == META and head["ContentType"] == CONTENT_TYPE
    assert stage.s3.get_object(Bucket=stage.bucket, Key=out.key)["Body"].read() == b"first"
    assert _calls(metrics, "GetObject") == (3, 1)  # the 404 is an error answer
    assert _calls(metrics, "PutObject") == (2, 0)  # a 412 is the answer asked for


async def test_a_body_that_breaks_off_and_a_409_are_tried_again(stage: Stage):
    uri = S3Uri(stage.bucket, "in/b.bin")
    stage.s3.put_object(Bucket=stage.bucket, Key=uri.key, Body=INPUT)
    plan = FaultPlan(
        drop=1.0,
        drop_operations=frozenset({"GetObject"}),
        s3_conflict=1.0,
        limits={"s3:dropped": 1, "s3:409": 2},
    )
    async with fault_proxy(stage, plan) as proxy:
        async for storage in _storage(proxy.url, Metrics()):
            with await storage.get_shared(uri, 1 << 30) as shared:
                assert bytes(shared._view[: shared.size]) == INPUT
            out = S3Uri(stage.bucket, "out/b.npy")
            assert await storage.commit(out, b"result", META, CONTENT_TYPE)
    assert proxy.counts["s3:dropped"] == 1  # the body broke off once
    assert proxy.counts["s3:409"] == 2  # S3's conflict, not an existing object
    assert stage.s3.get_object(Bucket=stage.bucket, Key="out/b.npy")["Body"].read() == b"result"


async def test_server_errors_are_retried_as_often_as_the_sdk_does(stage: Stage):
    plan = FaultPlan(failing={"PutObject": 1.0}, limits={"s3:PutObject_500": SDK_RETRIES})
    async with fault_proxy(stage, plan) as proxy:
        async for storage in _storage(proxy.url, Metrics()):
            assert await storage.commit(S3Uri(stage.bucket, "out/c.npy"), b"x", META, "a/b")
        assert proxy.counts["s3:PutObject_500"] == SDK_RETRIES
        proxy.plan.limits = {}  # now more failures in a row than the retries
        async for storage in _storage(proxy.url, Metrics()):
            with pytest.raises(Exception, match="500"):
                await storage.commit(S3Uri(stage.bucket, "out/d.npy"), b"x", META, "a/b")


async def test_a_put_whose_connection_was_reset_is_tried_again_and_finds_its_own_write(
    stage: Stage,
):
    """object_store does not retry a conditional PUT that failed in flight; this path does,
    and the retry's 412 tells the caller the object is there (its own, by the metadata)."""
    plan = FaultPlan(reset=1.0, reset_operations=frozenset({"PutObject"}), limits={"s3:reset": 1})
    out = S3Uri(stage.bucket, "out/r.npy")
    async with fault_proxy(stage, plan) as proxy:
        async for storage in _storage(proxy.url, Metrics()):
            assert await storage.commit(out, b"result", META, CONTENT_TYPE) is None
            found = await storage.head(out)
    assert proxy.counts == {"s3:reset": 1}
    assert proxy.seen["PutObject"] == 2
    assert found is not None and found.metadata == META
    assert stage.s3.get_object(Bucket=stage.bucket, Key=out.key)["Body"].read() == b"result"
