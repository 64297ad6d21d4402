"""The local stand-in for AWS: a moto server in its own process on loopback.

Used by `sqsinfer demo`, `chaos`, `soak`, the benchmarks and the tests. It runs as a
separate process because in the worker's own process it would share the GIL and halve
throughput. It needs the `local` extra (moto's S3 and SQS and the server's flask);
`has_local_extra` says so before anything starts.

moto's server is werkzeug's development server, which speaks HTTP/1.0 and closes every
connection after one answer. AWS keeps connections alive, and a client that opens a
new TCP connection per call spends a good share of its CPU on connecting (about 14 %
of the worker's own, measured). `python -m sqsinfer.lab.standin` starts moto's server
speaking HTTP/1.1 with keep-alive instead, for every command and test alike, and with
its SQS calls and object writes made atomic (`make_atomic`), as AWS's are. Its S3 sends
a bucket's event notifications (to SQS directly, through SNS, or to EventBridge's rules)
as AWS does, version ids and delete markers included (`send_events_as_aws_does`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqsinfer.lab import counting

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
    # More endpoints of the same server (same buckets and queues), each on its own port:
    # the requests counted at each tell its client's apart from the others'.
    endpoints: tuple[str, ...] = ()

    def reset(self) -> None:
        """Forget every bucket and queue (moto's reset endpoint)."""
        request = urllib.request.Request(self.url + "/moto-api/reset", method="POST")
        with urllib.request.urlopen(request, timeout=10):
            pass

    def request_counts(self) -> dict[counting.Kind, counting.Counted]:
        """Every request served so far, by port, service, operation and target."""
        with urllib.request.urlopen(self.url + counting.COUNTS_PATH, timeout=10) as answer:
            return counting.parse_counts(answer.read())


def free_port() -> int:
    """A loopback port free now, for a server about to start (moto, a worker's health).

    Chosen below the kernel's ephemeral range, not by binding port 0: a port from that
    range, once let go, can be taken as the local end of any outgoing connection (the
    tests and the stand-in open thousands) before the server binds it, and the server
    fails to start. Only another caller of this function can take one from below it."""
    low = _ephemeral_low()
    for _ in range(100 if low > _LOWEST_PORT + 1000 else 0):
        port = random.randrange(_LOWEST_PORT, low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # no room below the range, or it is crowded
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_LOWEST_PORT = 10_000  # above the ports services are commonly configured on


def _ephemeral_low() -> int:
    """The lowest port of the kernel's range for the local ends of connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def use_fake_credentials() -> None:
    """Point boto at fake credentials, unless real ones are set on purpose."""
    for key, value in FAKE_CREDENTIALS.items():
        os.environ.setdefault(key, value)


def clients(endpoint: str, region: str = REGION) -> tuple[Any, Any]:
    """Sync S3 and SQS clients for an endpoint, with the fake credentials a stand-in takes."""
    return client("s3", endpoint, region), client("sqs", endpoint, region)


def client(service: str, endpoint: str, region: str = REGION) -> Any:
    """A sync client of `service` (s3, sqs, sns, events) for an endpoint, with the fake
    credentials a stand-in takes."""
    import boto3

    return boto3.client(
        service,
        endpoint_url=endpoint,
        region_name=region,
        aws_access_key_id=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        aws_session_token=FAKE_CREDENTIALS["AWS_SESSION_TOKEN"],
    )


def has_local_extra(command: str, modules: tuple[str, ...] = LOCAL_MODULES) -> bool:
    """True when what `command` (as its user types it) needs is installed; else say which
    extra to install (on stderr) so that the command can stop before anything starts."""
    missing = [name for name in modules if not _importable(name)]
    if missing:
        print(
            f"{command} runs on a local stand-in for S3 and SQS and needs the "
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
def moto_server(port: int = 0, more_endpoints: int = 0) -> Iterator[MotoServer]:
    """Start `moto_server` on 127.0.0.1 (a free port unless given) and stop it after;
    with `more_endpoints`, it also serves on that many more ports."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    more = [free_port() for _ in range(more_endpoints)]
    argv = [sys.executable, "-m", "sqsinfer.lab.standin", "-H", "127.0.0.1", "-p", str(port)]
    for extra in more:
        argv += ["--also-port", str(extra)]
    process = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **FAKE_CREDENTIALS},
    )
    try:
        endpoints = tuple(f"http://127.0.0.1:{extra}" for extra in more)
        for endpoint in (url, *endpoints):
            wait_until_up(endpoint, process)
        yield MotoServer(url, process, endpoints)
    finally:
        end(process)


def end(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM a helper process, and kill it if it has not gone 10 s later."""
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# Headers that describe one connection or one framing, answered afresh by the server.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length"})
_IDLE_CONNECTION_S = 300.0  # an idle kept-alive connection's thread ends after this
WsgiAnswer = tuple[str, list[tuple[str, str]], bytes]


def _keep_alive_handler(counter: counting.RequestCounter | None = None) -> type[Any]:
    """moto's request handler, answering HTTP/1.1 with keep-alive, counting each request
    it serves in `counter` (and answering the counts at `counting.COUNTS_PATH`).

    Werkzeug's development server closes every connection after one answer, on purpose:
    after each request it reads whatever else came in, which would swallow the next
    request of a kept-alive connection. This handler reads each request body whole
    before the app runs, answers with an exact Content-Length, and leaves the
    connection open (unless the client asks to close it), so nothing is left unread
    between requests.
    """
    from werkzeug.serving import WSGIRequestHandler

    counted = counter or counting.RequestCounter()
    base: type[WSGIRequestHandler] = WSGIRequestHandler  # what older moto serves through
    try:  # moto's own handler keeps S3 metadata names with underscores as sent
        from moto.moto_server.werkzeug_app import MotoRequestHandler

        base = MotoRequestHandler
    except ImportError:
        pass

    class KeepAliveHandler(base):  # type: ignore[valid-type,misc]
        protocol_version = "HTTP/1.1"
        timeout = _IDLE_CONNECTION_S
        # Headers and body go out in separate writes: without TCP_NODELAY the body waits
        # for the client's delayed ACK of the headers (40 ms) on a kept-alive connection.
        disable_nagle_algorithm = True

        def run_wsgi(self) -> None:
            if self.headers.get("Expect", "").lower().strip(" \t") == "100-continue":
                self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            environ = self.make_environ()
            body = _request_body(self.rfile, environ)
            environ["wsgi.input"] = io.BytesIO(body)
            environ["CONTENT_LENGTH"] = str(len(body))
            environ.pop("HTTP_TRANSFER_ENCODING", None)
            environ.pop("wsgi.input_terminated", None)
            if environ.get("PATH_INFO") == counting.COUNTS_PATH:
                counts = counted.to_json()
                _write_answer(self, ("200 OK", [("Content-Type", "application/json")], counts))
                return
            try:
                answer = _call_app(self.server.app, environ)
            except Exception:  # the app failed: say so, and start afresh on a new connection
                self.close_connection = True
                answer = ("500 INTERNAL SERVER ERROR", [], b"internal error")
            counted.count(environ, body, len(answer[2]))
            _write_answer(self, answer)

    return KeepAliveHandler


def _request_body(rfile: Any, environ: dict[str, Any]) -> bytes:
    """The whole body of the request, read off the connection before the app runs."""
    from werkzeug.serving import DechunkedInput

    if "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower():
        return bytes(DechunkedInput(rfile).readall())
    length = int(environ.get("CONTENT_LENGTH") or 0)
    return bytes(rfile.read(length)) if length > 0 else b""


def _call_app(app: Any, environ: dict[str, Any]) -> WsgiAnswer:
    """Run the WSGI app; its status, headers and whole body."""
    started: list[Any] = []
    chunks: list[bytes] = []

    def start_response(status: str, headers: Any, exc_info: Any = None) -> Any:
        started[:] = [status, list(headers)]
        return chunks.append

    result = app(environ, start_response)
    try:
        chunks.extend(result)
    finally:
        close = getattr(result, "close", None)
        if close is not None:
            close()
    return started[0], started[1], b"".join(chunks)


def _write_answer(handler: Any, answer: WsgiAnswer) -> None:
    status, headers, body = answer
    code_text, _, reason = status.partition(" ")
    code = int(code_text)
    handler.send_response(code, reason)
    bodiless = handler.command == "HEAD" or code in (204, 304) or 100 <= code < 200
    for name, value in headers:
        lower = name.lower()
        # A HEAD answer keeps the length of the object it describes.
        if lower not in _HOP_BY_HOP or (bodiless and lower == "content-length"):
            handler.send_header(name, value)
    if not bodiless:
        handler.send_header("Content-Length", str(len(body)))
    if handler.close_connection:
        handler.send_header("Connection", "close")
    handler.end_headers()
    if not bodiless:
        handler.wfile.write(body)
    handler.wfile.flush()


def serve(argv: list[str]) -> None:
    """moto's server on `-H HOST -p PORT` (and every `--also-port`), answering HTTP/1.1,
    keeping connections open and counting the requests it serves."""
    import argparse
    import signal
    import threading

    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server, run_simple

    parser = argparse.ArgumentParser(prog="python -m sqsinfer.lab.standin")
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, default=5000)
    parser.add_argument("--also-port", type=int, action="append", default=[])
    args = parser.parse_args(argv)
    os.environ.setdefault("MOTO_PORT", str(args.port))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    make_atomic()
    send_events_as_aws_does()
    app = DomainDispatcherApplication(create_backend_app)
    handler = _keep_alive_handler(counting.RequestCounter())
    for port in args.also_port:  # the same app: one set of buckets and queues behind all
        server = make_server(args.host, port, app, threaded=True, request_handler=handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
    run_simple(args.host, args.port, app, threaded=True, request_handler=handler)


def make_atomic() -> None:
    """Make moto's SQS calls and S3 conditional writes atomic, as AWS's are.

    moto serves each request in its own thread and changes its state with no lock. Two
    receives at once can hand one message to both; two deletes at once can bring a
    deleted message back (each rebuilds the queue's list from what it read); a send
    during a delete can vanish; two conditional PUTs (If-None-Match, If-Match) can both
    pass their check and both write. AWS does none of these, and a test or a chaos run
    would blame the worker for each. So SQS calls run one at a time (a long poll lets go
    while it waits) and so do S3 object writes; reads stay concurrent.
    """
    import inspect
    import threading

    from moto.s3.responses import S3Response
    from moto.sqs.models import Queue, SQSBackend

    # Reentrant: a backend call may make another. A receive holds it once when it waits.
    sqs_lock, s3_writes = threading.RLock(), threading.Lock()

    def under(lock: Any, method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            with lock:
                return method(*args, **kwargs)

        return call

    def wait_unlocked(wait: Any) -> Any:
        def call(self: Any, timeout: int) -> None:
            sqs_lock.release()
            try:
                wait(self, timeout)
            finally:
                sqs_lock.acquire()

        return call

    for name, method in list(vars(SQSBackend).items()):
        if inspect.isfunction(method) and not name.startswith("_"):
            setattr(SQSBackend, name, under(sqs_lock, method))
    Queue.wait_for_messages = wait_unlocked(Queue.wait_for_messages)  # type: ignore[method-assign]
    # A PUT (its If-None-Match and If-Match checks) and a multipart upload's completion.
    for name in ("put_object", "_key_response_post"):
        setattr(S3Response, name, under(s3_writes, getattr(S3Response, name)))


def send_events_as_aws_does() -> None:
    """Make moto's S3 event notifications what AWS sends: each record names the object's
    version id in a versioned bucket (moto leaves it out; its EventBridge events have it),
    and a delete that leaves a delete marker sends `ObjectRemoved:DeleteMarkerCreated`
    (moto sends nothing).

    A notification goes out from within the S3 call, under the lock on object writes, to
    SQS's backend (under its lock) directly or through SNS or EventBridge: SQS's calls
    never wait for an S3 write, so the two locks are always taken in that one order.
    """
    import types

    from moto.s3 import notifications
    from moto.s3.models import S3Backend

    made = notifications._get_s3_event

    def with_version(event_name: str, bucket: Any, key: Any, notification_id: str) -> Any:
        body = made(event_name, bucket, key, notification_id)
        version = getattr(key, "version_id", None)
        if version not in (None, "null"):
            for record in body["Records"]:
                record["s3"]["object"]["versionId"] = version
        return body

    set_marker = S3Backend._set_delete_marker

    def marker_with_event(self: Any, bucket_name: str, key_name: str) -> Any:
        marker = set_marker(self, bucket_name, key_name)
        # What the event describes: the marker (no content: no ETag, no size).
        named = types.SimpleNamespace(name=key_name, etag="", size=0, version_id=marker.version_id)
        removed = notifications.S3NotificationEvent.OBJECT_REMOVED_DELETE_MARKER_CREATED_EVENT
        notifications.send_event(self.account_id, removed, self.get_bucket(bucket_name), named)
        return marker

    notifications._get_s3_event = with_version
    S3Backend._set_delete_marker = marker_with_event  # type: ignore[method-assign]


if __name__ == "__main__":
    serve(sys.argv[1:])
