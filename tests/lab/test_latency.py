"""The latency proxy: seeded draws that follow each operation's profile, and a proxy that
holds each call for its draw, whatever the stand-in takes on top (a long poll's wait)."""

from __future__ import annotations

import random
import time

import pytest

from proving.faults import FaultPlan, FaultProxy
from sqsinfer import bench
from sqsinfer.aws.session import open_clients
from sqsinfer.lab import latency
from sqsinfer.lab.latency import AWS, Latency, LatencyProxy, Profile, Spread, classify
from tests.conftest import Stage

DRAWS = 20_000
# What the worker calls, by the name the proxy gives it (the method and path it sees).
CALLS = {
    "GetObject": ("GET", "/bucket/in/a.npy", {}),
    "PutObject": ("PUT", "/bucket/out/a.npy", {"If-None-Match": "*"}),
    "HeadObject": ("HEAD", "/bucket/out/a.npy", {}),
    **{
        name: ("POST", "/", {"X-Amz-Target": f"AmazonSQS.{name}"})
        for name in (
            "ReceiveMessage",
            "SendMessageBatch",
            "DeleteMessageBatch",
            "ChangeMessageVisibilityBatch",
        )
    },
}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


@pytest.mark.parametrize("name", sorted(CALLS))
def test_the_aws_profile_draws_each_operations_quantiles_and_stalls(name):
    op = classify(*CALLS[name][:2], "", CALLS[name][2])
    assert op.name == name
    spread = AWS.spread(op)
    assert spread is AWS.operations[name]  # its own, not the service's default
    rng = random.Random(11)
    drawn = [spread.draw_ms(rng) for _ in range(DRAWS)]
    body = [ms for ms in drawn if ms < spread.spike_ms]
    assert _quantile(body, 0.5) == pytest.approx(spread.p50_ms, rel=0.04)
    assert _quantile(body, 0.99) == pytest.approx(spread.p99_ms, rel=0.08)
    stalls = len(drawn) - len(body)
    expected = spread.spike_rate * DRAWS  # 20 at 0.1 %: a binomial's spread around it
    assert expected / 3 <= stalls <= expected * 2.5
    assert min(drawn) > 0


def test_draws_are_the_seeds_own():
    op = classify("GET", "/bucket/in/a.npy", "", {})

    def draws(seed: int) -> list[float]:
        made = Latency(AWS, seed)
        return [made.before_ms(op) for _ in range(200)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)


def test_a_profile_adds_its_transfer_and_a_new_connections_set_up_once():
    profile = Profile(
        "fixed",
        operations={"GetObject": Spread(40.0, 40.0)},  # p50 = p99: always 40 ms
        s3_mb_per_s=10.0,
        connect_ms=30.0,
    )
    made = Latency(profile, 0)
    get = classify("GET", "/bucket/in/a.npy", "", {})
    assert made.before_ms(get, ("127.0.0.1", 5000)) == pytest.approx(70.0)  # a new one
    assert made.before_ms(get, ("127.0.0.1", 5000)) == pytest.approx(40.0)  # kept alive
    assert made.after_ms(get, 1_000_000) == pytest.approx(100.0)  # 1 MB at 10 MB/s
    receive = classify("POST", "/", "", {"X-Amz-Target": "AmazonSQS.ReceiveMessage"})
    assert made.before_ms(receive, None) == 0.0  # not in the profile: SQS adds nothing
    assert made.after_ms(receive, 1_000_000) == 0.0  # SQS bodies: no transfer modelled
    summary = made.summary()
    assert summary["GetObject"] == {"calls": 2, "mean_added_ms": 105.0, "max_added_ms": 100.0}


def test_loopback_adds_nothing_and_the_bench_offers_every_profile():
    made = Latency(latency.LOOPBACK, 0)
    for method, path, headers in CALLS.values():
        op = classify(method, path, "", headers)
        assert made.before_ms(op, ("127.0.0.1", 1), 1 << 20) == 0.0
        assert made.after_ms(op, 1 << 20) == 0.0
    assert tuple(latency.PROFILES) == bench.LATENCY_PROFILES
    with pytest.raises(ValueError, match="unknown latency profile 'lan'"):
        latency.profile_named("lan")


def test_the_fault_proxy_takes_a_profile_or_an_even_spread_never_both():
    assert FaultPlan().latency_model() is None
    named = FaultPlan(latency="aws", seed=2).latency_model()
    assert named is not None and named.profile is AWS
    even = FaultPlan(latency_ms=10).latency_model()
    assert even is not None
    rng = random.Random(0)
    drawn = [even.profile.s3_other.draw_ms(rng) for _ in range(2000)]
    assert 0 <= min(drawn) < 1 and 9 < max(drawn) <= 10
    with pytest.raises(ValueError, match="not both"):
        FaultPlan(latency="aws", latency_ms=10).latency_model()


async def test_an_empty_long_poll_waits_its_time_but_adds_only_its_draw(stage: Stage):
    """A receive that found nothing waits the whole long poll at the stand-in; the proxy
    holds it for its draw alone, and its figures say so."""
    profile = Profile("fixed", operations={"ReceiveMessage": Spread(50.0, 50.0)})
    proxy = LatencyProxy(stage.endpoint, latency=Latency(profile, 0))
    await proxy.start()
    try:
        async with open_clients("us-east-1", proxy.url) as clients:
            began = time.monotonic()
            got = await clients.sqs.receive_message(QueueUrl=stage.queue_url, WaitTimeSeconds=1)
            waited_s = time.monotonic() - began
    finally:
        await proxy.stop()
    assert not got.get("Messages")
    assert waited_s >= 1.05  # the long poll, and the draw before it
    assert proxy.latency is not None
    assert proxy.latency.summary()["ReceiveMessage"] == {
        "calls": 1,
        "mean_added_ms": 50.0,
        "max_added_ms": 50.0,
    }


async def test_the_fault_proxy_holds_calls_as_the_profile_says(stage: Stage):
    uri = stage.put_input("held.npy", b"x" * 1000)
    proxy = FaultProxy(stage.endpoint, FaultPlan(latency="aws", seed=1))
    await proxy.start()
    try:
        async with open_clients("us-east-1", proxy.url) as clients:
            key = uri.removeprefix(f"s3://{stage.bucket}/")
            for _ in range(3):
                await clients.s3.head_object(Bucket=stage.bucket, Key=key)
    finally:
        await proxy.stop()
    assert proxy.latency is not None
    held = proxy.latency.summary()["HeadObject"]
    assert held["calls"] == 3 and held["mean_added_ms"] > 0
