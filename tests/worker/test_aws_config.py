"""AWS's own configuration, honoured alike by both S3 clients (the SDK's and obstore's)
and the SQS client: the region, endpoints, a CA bundle, proxies, FIPS and dual-stack
endpoints, the profile's addressing style.

Each worker here takes tasks end to end (the input's GET and the output's PUT through
obstore, the output's HEAD and the chain marker through the SDK's S3 client, SQS
through the SDK), so a client that did not honour a variable fails the task.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import BotoCoreError, ClientError
from obstore.exceptions import GenericError

from proving.faults import FaultProxy
from sqsinfer.aws.s3 import DataPath, Storage
from sqsinfer.aws.session import open_clients
from sqsinfer.config import ConfigError, Settings
from sqsinfer.lab import standin, synthetic
from sqsinfer.logs import Event
from sqsinfer.messages import S3Uri
from sqsinfer.ops.common import queue_name
from sqsinfer.worker.lifecycle import Worker
from tests.conftest import (
    N_FEATURES,
    Stage,
    eventually,
    make_stage,
    outcome_count,
    running,
    stage_settings,
)
from tests.network import ConnectProxy, TlsFront, make_private_ca, serving

TASKS = 2


def _settings(stage: Stage, model_path: str, **overrides: Any) -> Settings:
    """Every client at work on each task: the chain (markers, next-stage sends) and the
    output's HEAD on every delivery."""
    return stage_settings(
        stage, model_path, next_queue_url=stage.next_url, always_head_output="true", **overrides
    )


async def _takes_tasks_end_to_end(settings: Settings, stage: Stage) -> None:
    rows = synthetic.make_rows(3, N_FEATURES, seed=5)
    for i in range(TASKS):
        uri = stage.put_input(f"{i}.npy", synthetic.encode_input(rows, "npy"))
        stage.send({"task_id": f"t{i}", "input": uri})
    async with running(settings) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == TASKS, timeout_s=60)
    outputs = stage.outputs()
    assert {f"out/t{i}.npy" for i in range(TASKS)} <= set(outputs)
    assert len(stage.drain_queue(stage.next_url)) == TASKS  # handed on to the next stage
    assert stage.counts(stage.queue_url) == (0, 0)


def _aws_line(caplog: pytest.LogCaptureFixture) -> dict[str, Any]:
    """What the start-up line says of where the calls go."""
    (record,) = [r for r in caplog.records if r.getMessage() == Event.STARTING]
    found: dict[str, Any] = record.aws
    return found


# -- the region -----------------------------------------------------------------------------
async def test_a_worker_with_only_aws_region_set_works_in_that_region(
    moto, model_path, aws_env, caplog
):
    caplog.set_level(logging.INFO, logger="sqsinfer")
    aws_env.setenv("AWS_REGION", "eu-west-1")
    stage = make_stage(moto.url, "eu-west-1")
    _, us_east_1 = standin.clients(moto.url, "us-east-1")
    with pytest.raises(ClientError):  # the stand-in keeps the queue in eu-west-1 alone
        us_east_1.get_queue_url(QueueName=queue_name(stage.queue_url))
    await _takes_tasks_end_to_end(_settings(stage, model_path, region=None), stage)
    aws = _aws_line(caplog)
    assert (aws["region"], aws["region_from"]) == ("eu-west-1", "AWS_REGION")


async def test_no_region_anywhere_stops_start_up_naming_where_to_set_one(
    stage, model_path, aws_env
):
    with pytest.raises(ConfigError) as refused:
        await Worker(_settings(stage, model_path, region=None)).serve()
    assert refused.value.setting == "SQSINFER_REGION"
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        assert name in str(refused.value)


# -- endpoints ------------------------------------------------------------------------------
async def test_aws_endpoint_url_alone_serves_every_client(moto, stage, model_path, aws_env, caplog):
    caplog.set_level(logging.INFO, logger="sqsinfer")
    aws_env.setenv("AWS_ENDPOINT_URL", moto.url)
    await _takes_tasks_end_to_end(_settings(stage, model_path, endpoint_url=""), stage)
    aws = _aws_line(caplog)
    assert aws["endpoints"] == {"s3": moto.url, "sqs": moto.url}
    assert aws["endpoints_from"] == {"s3": "AWS_ENDPOINT_URL", "sqs": "AWS_ENDPOINT_URL"}


@pytest.mark.parametrize("service", ["s3", "sqs"])
async def test_each_service_takes_its_own_endpoint_variable(
    moto, stage, model_path, aws_env, service
):
    """One service's calls through a proxy that counts them, the other's straight to the
    stand-in; AWS_ENDPOINT_URL (no server there) is for neither."""
    other = {"s3": "sqs", "sqs": "s3"}[service]
    counting = FaultProxy(moto.url)
    await counting.start()
    try:
        aws_env.setenv(f"AWS_ENDPOINT_URL_{service.upper()}", counting.url)
        aws_env.setenv(f"AWS_ENDPOINT_URL_{other.upper()}", moto.url)
        aws_env.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{standin.free_port()}")
        await _takes_tasks_end_to_end(_settings(stage, model_path, endpoint_url=""), stage)
    finally:
        await counting.stop()
    s3_calls = {"GetObject", "PutObject", "HeadObject"}
    sqs_calls = {"ReceiveMessage", "SendMessageBatch", "DeleteMessageBatch"}
    mine, theirs = (s3_calls, sqs_calls) if service == "s3" else (sqs_calls, s3_calls)
    assert mine <= set(counting.seen)
    assert not theirs & set(counting.seen)


async def test_the_workers_endpoint_setting_wins_over_aws_endpoint_variables(
    stage, model_path, aws_env
):
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_SQS", "AWS_ENDPOINT_URL"):
        aws_env.setenv(name, f"http://127.0.0.1:{standin.free_port()}")  # nothing there
    await _takes_tasks_end_to_end(_settings(stage, model_path), stage)


async def test_an_endpoint_variable_that_is_no_url_stops_start_up(stage, model_path, aws_env):
    aws_env.setenv("AWS_ENDPOINT_URL_S3", "localhost:4566")
    with pytest.raises(ConfigError) as refused:
        await Worker(_settings(stage, model_path, endpoint_url="")).serve()
    assert refused.value.setting == "AWS_ENDPOINT_URL_S3"


# -- TLS and proxies ------------------------------------------------------------------------
def _behind_tls(moto: Any, aws_env: pytest.MonkeyPatch, tmp_path: Path, host: str) -> TlsFront:
    """The stand-in behind TLS with a certificate for `host` from a private CA, which
    AWS_CA_BUNDLE names."""
    ca = make_private_ca(tmp_path, (host,))
    aws_env.setenv("AWS_CA_BUNDLE", str(ca.bundle))
    return TlsFront(int(moto.url.rsplit(":", 1)[1]), ca)


async def _through_proxy(
    stage: Stage,
    model_path: str,
    aws_env: pytest.MonkeyPatch,
    front: TlsFront,
    proxy: ConnectProxy,
    *,
    endpoint: str = "",
    no_proxy: str = "",
) -> None:
    """Tasks end to end with HTTPS_PROXY naming `proxy` (and NO_PROXY `no_proxy`), the
    endpoint `endpoint` or else the TLS front's address."""
    async with serving(front, proxy):
        aws_env.setenv("HTTPS_PROXY", proxy.url)
        if no_proxy:
            aws_env.setenv("NO_PROXY", no_proxy)
        settings = _settings(
            stage, model_path, endpoint_url=endpoint or f"https://127.0.0.1:{front.port}"
        )
        await _takes_tasks_end_to_end(settings, stage)


async def test_a_private_ca_in_aws_ca_bundle_is_trusted_by_every_client(
    moto, stage, model_path, aws_env, tmp_path
):
    front = _behind_tls(moto, aws_env, tmp_path, "127.0.0.1")
    async with serving(front):
        endpoint = f"https://127.0.0.1:{front.port}"
        await _takes_tasks_end_to_end(_settings(stage, model_path, endpoint_url=endpoint), stage)
    assert front.connections > 0


@pytest.mark.parametrize("content", [None, b"not a certificate\n"], ids=["missing", "not-pem"])
async def test_a_ca_bundle_that_cannot_be_used_stops_start_up(
    stage, model_path, aws_env, tmp_path, content
):
    bundle = tmp_path / "bundle.pem"
    if content is not None:
        bundle.write_bytes(content)
    aws_env.setenv("AWS_CA_BUNDLE", str(bundle))
    with pytest.raises(ConfigError) as refused:
        await Worker(_settings(stage, model_path)).serve()
    assert refused.value.setting == "AWS_CA_BUNDLE"
    assert str(bundle) in str(refused.value)


async def test_https_proxy_carries_every_call(moto, stage, model_path, aws_env, tmp_path):
    """The endpoint's name resolves nowhere: only a client that goes through the proxy
    (which tunnels it to the stand-in behind TLS) reaches it. (The stand-in reads a
    bucket from a dotted host name's first label, unless it starts with "localstack".)"""
    host = "localstack.sqsinfer.invalid"
    front = _behind_tls(moto, aws_env, tmp_path, host)
    proxy = ConnectProxy(to=lambda target: ("127.0.0.1", front.port))
    await _through_proxy(stage, model_path, aws_env, front, proxy, endpoint=f"https://{host}")
    assert set(proxy.targets) == {f"{host}:443"}


async def test_no_proxy_takes_every_client_past_the_proxy(
    moto, stage, model_path, aws_env, tmp_path
):
    front = _behind_tls(moto, aws_env, tmp_path, "127.0.0.1")
    refusing = ConnectProxy(to=lambda target: None)
    await _through_proxy(
        stage, model_path, aws_env, front, refusing, no_proxy="localhost,127.0.0.1"
    )
    assert refusing.targets == []


async def test_obstore_reads_no_proxy_as_the_sdk_does(moto, stage, model_path, aws_env, tmp_path):
    """A CIDR block in NO_PROXY: urllib's rules (the SDK's) do not know it, obstore's own
    would; both S3 clients take the SDK's reading, so every connection is a tunnel."""
    front = _behind_tls(moto, aws_env, tmp_path, "127.0.0.1")
    proxy = ConnectProxy(to=lambda target: ("127.0.0.1", front.port))
    await _through_proxy(stage, model_path, aws_env, front, proxy, no_proxy="127.0.0.0/8")
    assert proxy.targets
    assert front.connections == len(proxy.targets)  # none came straight to the endpoint


# -- AWS's own endpoints ----------------------------------------------------------------------
BUCKET = "sqsinfer-routes"
PATH_STYLE_PROFILE = "[default]\ns3 =\n    addressing_style = path\n"


@pytest.mark.parametrize(
    ("variable", "value", "host"),
    [
        pytest.param(
            "AWS_USE_FIPS_ENDPOINT",
            "true",
            f"{BUCKET}.s3-fips.us-east-2.amazonaws.com",
            id="fips",
        ),
        pytest.param(
            "AWS_USE_DUALSTACK_ENDPOINT",
            "true",
            f"{BUCKET}.s3.dualstack.us-east-2.amazonaws.com",
            id="dualstack",
        ),
        pytest.param(
            "AWS_CONFIG_FILE", PATH_STYLE_PROFILE, "s3.us-east-2.amazonaws.com", id="path-style"
        ),
    ],
)
async def test_both_s3_clients_go_to_the_sdks_own_endpoint(
    aws_env, tmp_path, variable, value, host
):
    """No endpoint set: where AWS's configuration sends a bucket's calls (a FIPS host, a
    dual-stack host, path-style addressing from the profile), both S3 clients go. Seen at
    a proxy that refuses every tunnel: nothing leaves the machine."""
    if variable == "AWS_CONFIG_FILE":
        (tmp_path / "config").write_text(value)
        value = str(tmp_path / "config")
    aws_env.setenv(variable, value)
    refusing = ConnectProxy(to=lambda target: None)
    uri = S3Uri(BUCKET, "in/a.npy")
    async with serving(refusing):
        aws_env.setenv("HTTPS_PROXY", refusing.url)
        sdk, data_path = await _tunnels_asked_for(refusing, uri)
    assert sdk == data_path == {f"{host}:443"}


async def _tunnels_asked_for(proxy: ConnectProxy, uri: S3Uri) -> tuple[set[str], set[str]]:
    """The tunnels asked of `proxy` for one HEAD through the SDK, then one GET through
    obstore (each refused)."""
    async with open_clients("us-east-2") as clients:
        storage = Storage(clients.s3, data=DataPath(clients.route, clients.credentials))
        with pytest.raises((BotoCoreError, ClientError)):
            await storage.head(uri)
        sdk, proxy.targets[:] = set(proxy.targets), []
        with pytest.raises(GenericError):
            await storage.get_shared(uri, 1 << 20)
        return sdk, set(proxy.targets)
