"""The spans an OTLP/HTTP receiver got, decoded with opentelemetry-proto (the exporter's own);
a collector that never answers."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from sqsinfer.bench.otlp import OtlpReceiver
from sqsinfer.tracing.api import FLUSH_THREAD


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)
    status_code: int = 0  # 2: error

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    def contains(self, other: Span) -> bool:
        return self.start_ns <= other.start_ns and other.end_ns <= self.end_ns


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


def decode(body: bytes) -> Iterator[Span]:
    request = ExportTraceServiceRequest.FromString(body)
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                yield Span(
                    name=s.name,
                    trace_id=s.trace_id.hex(),
                    span_id=s.span_id.hex(),
                    parent_id=s.parent_span_id.hex(),
                    kind=s.kind,
                    start_ns=s.start_time_unix_nano,
                    end_ns=s.end_time_unix_nano,
                    attributes=_attributes(s.attributes),
                    resource=resource,
                    links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                    events=[
                        (e.name, e.time_unix_nano, _attributes(e.attributes)) for e in s.events
                    ],
                    status_code=s.status.code,
                )


def received(receiver: OtlpReceiver) -> list[Span]:
    return [span for body in receiver.kept() for span in decode(body)]


def traceparent(trace_id: str, span_id: str) -> dict[str, dict[str, str]]:
    """A W3C `traceparent` message attribute of a sampled span."""
    return {"traceparent": {"DataType": "String", "StringValue": f"00-{trace_id}-{span_id}-01"}}


def parse_traceparent(value: str) -> tuple[str, str]:
    """(trace id, parent span id) of a `traceparent` value."""
    version, trace_id, span_id, _flags = value.split("-")
    assert version == "00"
    return trace_id, span_id


@pytest.fixture
def otlp(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    """A receiver on loopback, and tracing on (every span sampled) for what the test starts."""
    with OtlpReceiver(keep=True) as receiver:
        monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
        for name, value in receiver.exporter_env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "sqsinfer-test")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s
        yield receiver


class SilentCollector:
    """A collector that is there and stuck: it accepts every connection, reads what comes
    and never answers. `asked_at`: when each connection sent its first bytes, a request
    (`time.time()`; the exporter waits for an answer before it sends again)."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        self.asked_at: list[float] = []
        threading.Thread(target=self._accept, name="silent-collector", daemon=True).start()

    @property
    def url(self) -> str:
        host, port = self._server.getsockname()[:2]
        return f"http://{host}:{port}"

    @property
    def requests(self) -> int:
        with self._lock:
            return len(self.asked_at)

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:  # closed
                return
            with self._lock:
                self._held.append(connection)
            threading.Thread(target=self._read, args=(connection,), daemon=True).start()

    def _read(self, connection: socket.socket) -> None:
        try:
            if connection.recv(65536):
                with self._lock:
                    self.asked_at.append(time.time())
            while connection.recv(65536):
                pass
        except OSError:
            pass

    def __enter__(self) -> SilentCollector:
        return self

    def __exit__(self, *exc: object) -> None:
        """Answer at last (an empty success), so that an export still waiting ends now."""
        self._server.close()
        with self._lock:
            for connection in self._held:
                with contextlib.suppress(OSError):
                    connection.sendall(ANSWER)
                connection.close()


ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n"


def flushes_ended(timeout_s: float = 30.0) -> bool:
    """Whether every export left behind at an exit (a tracer's flush thread) has ended."""
    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if thread.name == FLUSH_THREAD:
            thread.join(max(0.0, deadline - time.monotonic()))
    return not any(t.name == FLUSH_THREAD for t in threading.enumerate())
