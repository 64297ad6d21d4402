"""A second stand-in for AWS: LocalStack's S3 and SQS (and the SNS and EventBridge that
carry S3's event notifications) in host mode on loopback, no Docker.

moto is lenient where AWS is strict: it takes U+FFFF in a message, object keys over
1,024 bytes, and a conditional put with an ETag (which it treats as an overwrite).
LocalStack's own SQS and S3 refuse these as AWS does, so the worker's flow and the
semantics it relies on are run against both.

LocalStack runs as `python -m localstack.runtime.main` from its own virtual environment
on Python 3.13 (its pinned dependencies must not meet the worker's): `make
test-localstack` builds it with `python -m proving.localstack install`. Its state
lives in a temporary directory that is removed when it stops.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sqsinfer.lab.standin import FAKE_CREDENTIALS, free_port

LOCALSTACK_VERSION = "2026.3.0"
REQUIREMENTS = (
    # base-runtime is what S3 and SQS need; `runtime` would add moto-ext, the AWS CLI and
    # a JVM bridge for services not used here (minutes more to install).
    f"localstack-core[base-runtime]=={LOCALSTACK_VERSION}",
    # cbor2 6 dropped `cbor2._decoder`, which LocalStack's protocol parser imports; the
    # failed import surfaces as "No component plugins found" at start-up.
    "cbor2<6",
    # pyOpenSSL 25 dropped X509.add_extensions, used for LocalStack's self-signed
    # certificate at start-up; 24.x in turn needs cryptography below 45.
    "pyopenssl<25",
    "cryptography<45",
    # Twisted's TLS support (LocalStack's gateway server) imports it, undeclared.
    "service-identity",
    # EventBridge's provider (S3 → EventBridge → SQS, for the S3 event tests) imports
    # moto's events backend, a crontab parser and jsonpath: `runtime` has them, among
    # much else.
    "moto-ext>=5.1.22",
    "crontab>=0.22.6",
    "jsonpath-ng==1.7.0",
)
PYTHON_VERSION = (3, 13)
PYTHON_ENV = "SQSINFER_LOCALSTACK_PYTHON"
BASE_PYTHON_ENV = "SQSINFER_LOCALSTACK_BASE_PYTHON"
DEFAULT_VENV = ".venv-localstack"
MAKE_TARGET = "make test-localstack"
# S3 and SQS for the worker; SNS and EventBridge carry S3's event notifications.
SERVICES = ("s3", "sqs", "sns", "events")
_START_TIMEOUT_S = 90.0
_STOP_TIMEOUT_S = 20.0
_LOG_TAIL_CHARS = 3000


class LocalStackMissing(RuntimeError):
    """LocalStack (or the Python it needs) is not installed where it was looked for."""


@dataclass
class LocalStackServer:
    url: str
    process: subprocess.Popen[bytes]
    state_dir: Path

    @property
    def log_path(self) -> Path:
        return self.state_dir / "localstack.log"


def _python_is(python: str, version: tuple[int, int], module: str = "") -> bool:
    """True when `python` runs, is `version`, and can import `module` (if given)."""
    check = f"import sys; assert sys.version_info[:2] == {version!r}"
    if module:
        check += f"; import {module}"
    try:
        done = subprocess.run([python, "-c", check], capture_output=True, timeout=60, check=False)
    except OSError:
        return False
    return done.returncode == 0


def localstack_python(environ: Mapping[str, str] = os.environ) -> str:
    """LocalStack's own Python: `SQSINFER_LOCALSTACK_PYTHON`, else `.venv-localstack/bin`."""
    # Absolute (symlinks kept: a venv's Python finds its venv through its own path), as
    # LocalStack runs with its state directory as the working directory.
    python = os.path.abspath(environ.get(PYTHON_ENV) or os.path.join(DEFAULT_VENV, "bin", "python"))
    if not _python_is(python, PYTHON_VERSION, "localstack.runtime.main"):
        raise LocalStackMissing(
            f"LocalStack is not installed at {python} (set {PYTHON_ENV} to its venv's Python); "
            f"`{MAKE_TARGET}` installs it into {DEFAULT_VENV}/ and runs its tests"
        )
    return python


def _pyenv_roots(environ: Mapping[str, str]) -> list[str]:
    roots = [environ.get("PYENV_ROOT", ""), str(Path.home() / ".pyenv")]
    pyenv = shutil.which("pyenv")
    if pyenv:
        found = subprocess.run([pyenv, "root"], capture_output=True, text=True, check=False)
        roots.append(found.stdout.strip())
    return [root for root in dict.fromkeys(roots) if root]


def _patch(version_dir: str) -> int:
    """3 for `.../versions/3.13.3`; -1 for a build such as `3.13.0t` (tried last)."""
    tail = os.path.basename(version_dir).split(".")[2]
    return int(tail) if tail.isdigit() else -1


def python_candidates(environ: Mapping[str, str] = os.environ) -> list[str]:
    """Where a Python 3.13 may be: the setting, PATH, then pyenv's versions (newest first)."""
    name = "python{}.{}".format(*PYTHON_VERSION)
    found = [environ.get(BASE_PYTHON_ENV, ""), shutil.which(name) or ""]
    for root in _pyenv_roots(environ):
        versions = glob.glob(os.path.join(root, "versions", "{}.{}.*".format(*PYTHON_VERSION)))
        found += [os.path.join(v, "bin", name) for v in sorted(versions, key=_patch, reverse=True)]
    return [path for path in dict.fromkeys(found) if path]


def find_base_python(environ: Mapping[str, str] = os.environ) -> str:
    """A Python 3.13 with venv, or LocalStackMissing naming every place looked at."""
    candidates = python_candidates(environ)
    for python in candidates:
        if _python_is(python, PYTHON_VERSION, "venv, ensurepip"):
            return python
    raise LocalStackMissing(
        "LocalStack needs Python {}.{}, found none (looked at: {}). Install it (`pyenv install "
        "3.13`, or `apt-get install python3.13-venv` where Debian has it) or set {}".format(
            *PYTHON_VERSION, ", ".join(candidates) or "PATH and pyenv", BASE_PYTHON_ENV
        )
    )


def install(venv: Path, base_python: str) -> str:
    """Create (or update) LocalStack's venv with the pinned requirements; its Python."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([base_python, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, *REQUIREMENTS], check=True)
    return localstack_python({PYTHON_ENV: str(python)})


def server_environment(port: int, state_dir: Path) -> dict[str, str]:
    """LocalStack's settings: its SERVICES only, on loopback, nothing reaching outside."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.pop("VIRTUAL_ENV", None)
    host = f"127.0.0.1:{port}"
    env |= FAKE_CREDENTIALS | {
        "SERVICES": ",".join(SERVICES),
        "EAGER_SERVICE_LOADING": "1",  # ready means its services are up, not merely importable
        "OVERRIDE_IN_DOCKER": "0",  # host mode: no container, no Docker socket
        "GATEWAY_LISTEN": host,
        # Its default server (Twisted) binds every address whatever GATEWAY_LISTEN says;
        # Hypercorn binds the one given.
        "GATEWAY_SERVER": "hypercorn",
        "LOCALSTACK_HOST": host,  # the host in the queue URLs it returns
        "SQS_ENDPOINT_STRATEGY": "off",  # queue URLs like http://127.0.0.1:PORT/ACCOUNT/NAME
        "FILESYSTEM_ROOT": str(state_dir),  # all its files under the temp dir
        "DNS_ADDRESS": "0",  # no DNS server (it would bind port 53 on every address)
        "SKIP_SSL_CERT_DOWNLOAD": "1",
        "DISABLE_EVENTS": "1",  # no usage reporting
    }
    return env


def _log_tail(server: LocalStackServer) -> str:
    try:
        return server.log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
    except OSError:
        return "(no log)"


def _services_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/_localstack/health", timeout=2) as response:
            health = json.load(response)
    except (urllib.error.URLError, OSError, ValueError):
        return False
    states = health.get("services", {})
    return all(states.get(name) in ("available", "running") for name in SERVICES)


def wait_until_ready(server: LocalStackServer, timeout_s: float = _START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"LocalStack exited with code {server.process.returncode}:\n{_log_tail(server)}"
            )
        if _services_ready(server.url):
            return
        time.sleep(0.2)
    raise RuntimeError(
        f"LocalStack did not answer at {server.url} within {timeout_s} s:\n{_log_tail(server)}"
    )


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()  # LocalStack shuts its services down on SIGTERM
    try:
        process.wait(timeout=_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def localstack_server(port: int = 0, python: str | None = None) -> Iterator[LocalStackServer]:
    """Start LocalStack (its SERVICES) on 127.0.0.1 (a free port unless given); stop it after."""
    python = python or localstack_python()
    port = port or free_port()
    state_dir = Path(tempfile.mkdtemp(prefix="sqsinfer-localstack-"))
    try:
        with open(state_dir / "localstack.log", "wb") as log:
            process = subprocess.Popen(
                [python, "-m", "localstack.runtime.main"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=server_environment(port, state_dir),
                cwd=state_dir,
            )
        server = LocalStackServer(f"http://127.0.0.1:{port}", process, state_dir)
        try:
            wait_until_ready(server)
            yield server
        finally:
            _stop(process)
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m proving.localstack",
        description="Install LocalStack into its own venv, or serve its services on loopback.",
    )
    verbs = parser.add_subparsers(dest="verb", required=True)
    setup = verbs.add_parser("install", help="create or update LocalStack's venv")
    setup.add_argument("venv", nargs="?", default=DEFAULT_VENV)
    serve = verbs.add_parser("serve", help="run LocalStack until interrupted")
    serve.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        if args.verb == "install":
            print(install(Path(args.venv), find_base_python()))
            return 0
        for sig in (signal.SIGINT, signal.SIGTERM):  # either way: stop it and remove its state
            signal.signal(sig, _interrupt)
        with localstack_server(args.port) as server:
            served = ", ".join(SERVICES)
            print(f"LocalStack {LOCALSTACK_VERSION} ({served}) at {server.url}", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                server.process.wait()
    except LocalStackMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
