"""The local stand-in for AWS: a moto server in its own process on loopback.

Used by `sqsinfer demo`, `chaos`, `soak`, the benchmarks and the tests. It runs as a
separate process because in the worker's own process it would share the GIL and halve
throughput. It needs the `local` extra (moto's S3 and SQS and the server's flask);
`has_local_extra` says so before anything starts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

REGION = "us-east-1"
FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": REGION,
}
_START_TIMEOUT_S = 30.0
# What the proving-ground commands import beyond the worker's own needs: the stand-in's
# server, the sync SDK of their set-up code, and psutil for the processes they watch.
LOCAL_MODULES = ("moto", "flask", "flask_cors", "boto3", "psutil")


@dataclass
class MotoServer:
    url: str
    process: subprocess.Popen[bytes]

    def reset(self) -> None:
        """Forget every bucket and queue (moto's reset endpoint)."""
        request = urllib.request.Request(self.url + "/moto-api/reset", method="POST")
        with urllib.request.urlopen(request, timeout=10):
            pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def use_fake_credentials() -> None:
    """Point boto at fake credentials, unless real ones are set on purpose."""
    for key, value in FAKE_CREDENTIALS.items():
        os.environ.setdefault(key, value)


def clients(endpoint: str, region: str = REGION) -> tuple[Any, Any]:
    """Sync S3 and SQS clients for an endpoint, with the fake credentials a stand-in takes."""
    import boto3

    kw = {
        "endpoint_url": endpoint,
        "region_name": region,
        "aws_access_key_id": FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "aws_session_token": FAKE_CREDENTIALS["AWS_SESSION_TOKEN"],
    }
    return boto3.client("s3", **kw), boto3.client("sqs", **kw)


def has_local_extra(command: str, modules: tuple[str, ...] = LOCAL_MODULES) -> bool:
    """True when what `command` needs is installed; else say which extra to install (on
    stderr) so that the command can stop before anything starts."""
    missing = [name for name in modules if not _importable(name)]
    if missing:
        print(
            f"sqsinfer {command} runs on a local stand-in for S3 and SQS and needs the "
            f"'local' extra (missing: {', '.join(missing)}):\n"
            "  pip install 'sqsinfer[local]'      (from a checkout: pip install -e '.[local]')",
            file=sys.stderr,
        )
    return not missing


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def wait_until_up(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"moto server exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/moto-api/", timeout=1):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    raise RuntimeError(f"moto server did not answer at {url} within {_START_TIMEOUT_S} s")


@contextlib.contextmanager
def moto_server(port: int = 0) -> Iterator[MotoServer]:
    """Start `moto_server` on 127.0.0.1 (a free port unless given) and stop it after."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **FAKE_CREDENTIALS},
    )
    try:
        wait_until_up(url, process)
        yield MotoServer(url, process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
