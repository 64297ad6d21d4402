"""`sqsinfer worker --check-settings`: start-up's resolution of every setting, nothing
contacted, the values printed, exit 0; or exit 2 naming the bad one, in start-up's words."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sqsinfer import cli
from tests.conftest import AWS_VARIABLES


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A loopback port that accepts connections and keeps them, to count them after."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        sock.setblocking(False)
        yield sock


def _connections(sock: socket.socket) -> int:
    count = 0
    while True:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1


def _clean_env(tmp_path: Path, model_path: str, **extra: str) -> dict[str, str]:
    """A worker's environment with nothing of AWS's or OpenTelemetry's but `extra`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in AWS_VARIABLES and not k.startswith(("AWS_", "OTEL_", "SQSINFER_"))
    }
    return env | {
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-credentials"),
        "SQSINFER_QUEUE_URL": "https://sqs.eu-west-1.amazonaws.com/123456789012/score",
        "SQSINFER_MODEL_PATH": model_path,
        "SQSINFER_ALLOWED_INPUT_PREFIXES": "s3://in-bucket/in/",
        "SQSINFER_OUTPUT_PREFIX": "s3://out-bucket/out/",
        "SQSINFER_HEALTH_HOST": "127.0.0.1",
        "SQSINFER_HEALTH_PORT": "0",
        **extra,
    }


def _worker(env: dict[str, str], *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sqsinfer", "worker", *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _lines(stdout: str) -> dict[str, tuple[str, str]]:
    """NAME -> (value, source) of the printed `NAME=value  # source` lines."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("#"):
            continue
        assignment, _, source = line.partition("  # ")
        name, _, value = assignment.rstrip().partition("=")
        out[name] = (value, source)
    return out


def test_prints_what_start_up_would_run_on_and_contacts_nothing(
    tmp_path: Path, model_path: str, listener: socket.socket
) -> None:
    """Every place a start-up could call is this listener: the endpoint, the tracing
    collector and both credential services (no credentials are set, so a client made
    would look there). The check connects to none."""
    here = f"http://127.0.0.1:{listener.getsockname()[1]}"
    env = _clean_env(
        tmp_path,
        model_path,
        AWS_REGION="eu-west-1",
        AWS_ENDPOINT_URL_SQS=here,
        AWS_EC2_METADATA_SERVICE_ENDPOINT=here,
        AWS_CONTAINER_CREDENTIALS_FULL_URI=here + "/credentials",
        OTEL_EXPORTER_OTLP_ENDPOINT=here,
        SQSINFER_TASK_TIME_S="1200",
    )
    result = _worker(env, "--check-settings", "--processes", "2")
    assert result.returncode == 0, result.stderr
    lines = _lines(result.stdout)
    assert lines["SQSINFER_TASK_TIME_S"] == ("1200.0", "SQSINFER_TASK_TIME_S")
    assert lines["SQSINFER_PROCESSES"] == ("2", "--processes")
    assert lines["SQSINFER_MAX_TASK_TIME_S"] == ("3600.0", "derived")  # 3 x task_time_s
    assert lines["SQSINFER_DRAIN_DEADLINE_S"] == ("1210.0", "derived")
    assert lines["SQSINFER_ALLOWED_OUTPUT_PREFIXES"] == ("s3://out-bucket/out/", "derived")
    assert lines["SQSINFER_WAIT_TIME_S"] == ("20", "default")
    assert lines["region"] == ("eu-west-1", "AWS_REGION")
    assert lines["endpoint.sqs"] == (here, "AWS_ENDPOINT_URL_SQS")
    assert lines["endpoint.s3"] == ("AWS's own for eu-west-1", "AWS's own, or the AWS profile's")
    assert lines["traces"][0] == "exported"
    assert _connections(listener) == 0


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"SQSINFER_HEARTBEAT_S": "90"}, "SQSINFER_HEARTBEAT_S"),
        ({"AWS_REGION": "eu west 1"}, "AWS_REGION"),  # read when start-up opens its clients
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),  # when it makes a tracer
    ],
)
def test_a_bad_setting_exits_2_naming_it_as_start_up_does(
    tmp_path: Path, model_path: str, extra: dict[str, str], named: str
) -> None:
    env = _clean_env(tmp_path, model_path, AWS_DEFAULT_REGION="eu-west-1", **extra)
    checked, started = _worker(env, "--check-settings"), _worker(env)
    assert (checked.returncode, started.returncode) == (2, 2), started.stderr
    assert f"invalid setting: {named}" in checked.stderr
    assert checked.stderr in started.stderr  # start-up's own words, from its own code
    assert checked.stdout == ""


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"AWS_CA_BUNDLE": "/nonexistent/ca.pem"}, "AWS_CA_BUNDLE"),
        ({"AWS_ENDPOINT_URL_S3": "not a url"}, "AWS_ENDPOINT_URL_S3"),
        ({"AWS_REGION": ""}, "SQSINFER_REGION"),  # none at all: the worker's own setting
        ({"SQSINFER_MODEL_PATH": "/nonexistent/model.ubj"}, "SQSINFER_MODEL_PATH"),
        ({"SQSINFER_MAX_TASK_TIME_S": "30"}, "SQSINFER_MAX_TASK_TIME_S"),
        (
            {
                "SQSINFER_POD_DELETION_COST": "true",
                "KUBERNETES_SERVICE_HOST": "10.96.0.1",
                "SQSINFER_KUBE_TOKEN_DIR": "/nonexistent",
            },
            "SQSINFER_KUBE_TOKEN_DIR",
        ),
        ({"SQSINFER_POD_DELETION_COST": "true"}, "KUBERNETES_SERVICE_HOST"),  # not in a pod
    ],
)
def test_each_kind_of_bad_variable_is_named(
    aws_env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    model_path: str,
    extra: dict[str, str],
    named: str,
) -> None:
    base = {
        "SQSINFER_QUEUE_URL": "https://sqs.eu-west-1.amazonaws.com/123456789012/score",
        "SQSINFER_MODEL_PATH": model_path,
        "SQSINFER_ALLOWED_INPUT_PREFIXES": "s3://in-bucket/in/",
        "SQSINFER_OUTPUT_PREFIX": "s3://out-bucket/out/",
        "AWS_REGION": "eu-west-1",
    }
    for name, value in (base | extra).items():
        aws_env.setenv(name, value)
    assert cli.main(["worker", "--check-settings"]) == 2
    assert f"sqsinfer worker: invalid setting: {named}" in capsys.readouterr().err
