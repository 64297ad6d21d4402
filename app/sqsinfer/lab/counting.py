"""The stand-in's own count of the requests it served, as AWS would bill them.

Every request the stand-in answers is counted by the port it came in on (one endpoint
per client to tell apart: each stage of a chain has its own), its service, its operation
and its target: for S3 the extension of the object's key (`.npy`, `.chain`), for SQS
whether the queue is `fifo` or `standard`. Counting at the server sees every request a
client sent, the SDK's retries and the data path's included, which a client's own
counters may not. An SQS request is also counted in 64 KiB chunks of its payload, the
unit SQS bills (the larger of the request's body and the answer's).

`GET /_sqsinfer/requests` answers the counts so far (never reset: a reader takes the
difference of two readings). No bucket can be named `_sqsinfer`, so no S3 path is taken.
"""

from __future__ import annotations

import json
import math
import re
import threading
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

COUNTS_PATH = "/_sqsinfer/requests"
SQS_CHUNK_BYTES = 64 * 1024
_SCOPE = re.compile(r"Credential=[^/,]+/\d{8}/[^/]+/([a-z0-9-]+)/aws4_request")
_S3_BUCKET_OPERATIONS = {
    "GET": "ListObjects",
    "HEAD": "HeadBucket",
    "PUT": "PutBucket",
    "DELETE": "DeleteBucket",
}
_S3_OBJECT_OPERATIONS = {"GET": "GetObject", "HEAD": "HeadObject", "DELETE": "DeleteObject"}


@dataclass(frozen=True)
class Kind:
    """What one request was: where it came in, its service, operation and target."""

    port: int
    service: str  # "s3", "sqs", or "other"
    operation: str
    target: str  # S3: the key's extension ("" for a bucket); SQS: "fifo" or "standard"


class RequestCounter:
    """Requests and billed chunks by `Kind`, safe to update from every server thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[Kind, list[int]] = {}

    def count(self, environ: Mapping[str, Any], body: bytes, answer_bytes: int) -> None:
        kind = classify(environ, body)
        if kind is None:
            return
        chunks = 1
        if kind.service == "sqs":
            chunks = max(1, math.ceil(max(len(body), answer_bytes) / SQS_CHUNK_BYTES))
        with self._lock:
            counted = self._counts.setdefault(kind, [0, 0])
            counted[0] += 1
            counted[1] += chunks

    def to_json(self) -> bytes:
        with self._lock:
            rows = [
                [k.port, k.service, k.operation, k.target, n, chunks]
                for k, (n, chunks) in self._counts.items()
            ]
        return json.dumps(rows).encode()


@dataclass(frozen=True)
class Counted:
    requests: int
    chunks: int


def parse_counts(text: bytes | str) -> dict[Kind, Counted]:
    """The server's answer at COUNTS_PATH, read back."""
    return {
        Kind(int(port), service, operation, target): Counted(int(n), int(chunks))
        for port, service, operation, target, n, chunks in json.loads(text)
    }


def difference(before: dict[Kind, Counted], after: dict[Kind, Counted]) -> dict[Kind, Counted]:
    """What was served between two readings (kinds not seen in between left out)."""
    found = {}
    for kind, now in after.items():
        then = before.get(kind, Counted(0, 0))
        if now.requests > then.requests:
            found[kind] = Counted(now.requests - then.requests, now.chunks - then.chunks)
    return found


def classify(environ: Mapping[str, Any], body: bytes) -> Kind | None:
    """The kind of one request, None for the stand-in's own API (reset, counts)."""
    path = str(environ.get("PATH_INFO", ""))
    if path.startswith(("/moto-api", "/_sqsinfer")):
        return None
    port = int(environ.get("SERVER_PORT") or 0)
    target_header = str(environ.get("HTTP_X_AMZ_TARGET", ""))
    service = _service(environ, target_header)
    if service == "sqs":
        return Kind(port, "sqs", *_sqs(environ, target_header, body))
    if service == "s3":
        return Kind(port, "s3", *_s3(environ, path))
    return Kind(port, service or "other", str(environ.get("REQUEST_METHOD", "")), "")


def _service(environ: Mapping[str, Any], target_header: str) -> str:
    if target_header.startswith("AmazonSQS."):
        return "sqs"
    signed = str(environ.get("HTTP_AUTHORIZATION", "")) or urllib.parse.unquote(
        str(environ.get("QUERY_STRING", ""))
    )
    found = _SCOPE.search(signed.replace("X-Amz-Credential=", "Credential="))
    return found.group(1) if found else ""


def _sqs(environ: Mapping[str, Any], target_header: str, body: bytes) -> tuple[str, str]:
    """The operation and the queue's type, from the JSON protocol or the query protocol."""
    fields: dict[str, Any] = {}
    if target_header:
        operation = target_header.split(".", 1)[1]
        try:
            doc = json.loads(body or b"{}")
            fields = doc if isinstance(doc, dict) else {}
        except ValueError:
            pass
    else:
        query = str(environ.get("QUERY_STRING", "")) + "&" + body.decode("utf-8", "replace")
        fields = {k: v[0] for k, v in urllib.parse.parse_qs(query).items()}
        operation = str(fields.get("Action", "?"))
    queue = str(fields.get("QueueUrl") or fields.get("QueueName") or "")
    if not queue:
        return operation, ""
    return operation, "fifo" if queue.endswith(".fifo") else "standard"


def _s3(environ: Mapping[str, Any], path: str) -> tuple[str, str]:
    """The operation (path-style addressing, as on loopback) and the key's extension."""
    method = str(environ.get("REQUEST_METHOD", ""))
    query = urllib.parse.parse_qs(str(environ.get("QUERY_STRING", "")), keep_blank_values=True)
    _, _, key = path.lstrip("/").partition("/")
    if not key:
        if method == "POST":
            return ("DeleteObjects" if "delete" in query else "PostBucket"), ""
        return _S3_BUCKET_OPERATIONS.get(method, method), ""
    name = key.rsplit("/", 1)[-1]
    extension = "." + name.rsplit(".", 1)[1] if "." in name else ""
    if method == "PUT":
        if "partNumber" in query:
            return "UploadPart", extension
        copied = "HTTP_X_AMZ_COPY_SOURCE" in environ
        return ("CopyObject" if copied else "PutObject"), extension
    if method == "POST":
        multipart = "CreateMultipartUpload" if "uploads" in query else "CompleteMultipartUpload"
        return multipart, extension
    return _S3_OBJECT_OPERATIONS.get(method, method), extension
