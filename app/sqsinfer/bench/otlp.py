"""A local OTLP/HTTP trace receiver: where the bench's traced worker sends its spans.

It answers every `POST /v1/traces` with an empty success, as a collector would, and
counts what arrived; with `keep`, it also keeps each request's protobuf body (unzipped)
for whoever decodes it with opentelemetry-proto (`count_spans`, the tests). Loopback
only, a thread of its own: its CPU is the bench process's, never the worker's.
"""

from __future__ import annotations

import gzip
import http.server
import os
import threading
from typing import Any

TRACES_PATH = "/v1/traces"
# Taken from the bench's environment into a traced run's (else every task is sampled).
SAMPLER_VARIABLES = ("OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG")


class OtlpReceiver:
    def __init__(self, keep: bool = False) -> None:
        self.keep = keep
        self.requests = 0
        self.received_bytes = 0
        self.bodies: list[bytes] = []
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="otlp-receiver", daemon=True
        )

    @property
    def url(self) -> str:
        """The endpoint (OTEL_EXPORTER_OTLP_ENDPOINT): the exporter adds /v1/traces."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def exporter_env(self) -> dict[str, str]:
        """The variables that point a worker's traces here, every span sampled."""
        return {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.url,
            "OTEL_TRACES_SAMPLER": "always_on",
        }

    def traced_env(self) -> dict[str, str]:
        """A traced run's variables: its spans here, every task sampled, unless the bench's
        own environment names a sampler (what a ratio saves is measured so)."""
        chosen = {k: v for k, v in os.environ.items() if k in SAMPLER_VARIABLES and v}
        return self.exporter_env() | (chosen if "OTEL_TRACES_SAMPLER" in chosen else {})

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def took(self, body: bytes) -> None:
        with self._lock:
            self.requests += 1
            self.received_bytes += len(body)
            if self.keep:
                self.bodies.append(body)

    def kept(self) -> list[bytes]:
        with self._lock:
            return list(self.bodies)


def _handler(receiver: OtlpReceiver) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the exporter's session expects

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path != TRACES_PATH:
                self._answer(404)
                return
            if self.headers.get("Content-Encoding", "") == "gzip":
                body = gzip.decompress(body)
            receiver.took(body)
            self._answer(200)  # an empty ExportTraceServiceResponse: everything accepted

        def _answer(self, status: int) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass  # a line per export would drown the bench's own

    return Handler


def count_spans(body: bytes) -> int:
    """The spans in an ExportTraceServiceRequest, decoded with opentelemetry-proto (the
    otel extra's, as the exporter's own: only a traced run has anything to count)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    request = ExportTraceServiceRequest.FromString(body)
    return sum(len(scoped.spans) for each in request.resource_spans for scoped in each.scope_spans)
