"""Lineage: what every output's S3 user metadata says about how it was made.

Each output carries these `x-amz-meta-*` keys (stable: docs/formats.md lists them):

    task-id            the task it belongs to (an existing output is handed on only to it)
    model-sha256       the sha256 of the model's file
    model-version      SQSINFER_MODEL_VERSION, when it is set
    handler            the handler setting: a short name (xgboost) or package.module:Class
    handler-version    what the handler reports (its library's version by default)
    model-output       the model output served, by name (a handler of several: onnx)
    sqsinfer-version   the worker's version
    input-etag         the ETag of the input object the worker read
    input-version-id   that object's version id (absent when its bucket is not versioned)
    input-uri-sha256   the sha256 of the input's URI (an S3 event's output only: the
                       output key is derived from the input's, and this tells which)
    output-sha256      the sha256 of the output's own bytes
    message-id         the SQS message whose delivery wrote it
    worker             SQSINFER_WORKER_ID
    delivery           that delivery's id (tells a lost answer to its own put from another's)

S3 holds user metadata to 2 KB: the UTF-8 bytes of every key and value, summed. Each value
has a cap here, and the caps together fit (a test holds them to it): the values the
settings give are checked at start, the task id by the message rules, and a value from
S3 or SQS beyond its cap (which neither produces) is left out rather than cut.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqsinfer import __version__

TASK_ID = "task-id"
MODEL_SHA256 = "model-sha256"
MODEL_VERSION = "model-version"
HANDLER = "handler"
HANDLER_VERSION = "handler-version"
MODEL_OUTPUT = "model-output"
SQSINFER_VERSION = "sqsinfer-version"
INPUT_ETAG = "input-etag"
INPUT_VERSION_ID = "input-version-id"
INPUT_URI_SHA256 = "input-uri-sha256"
OUTPUT_SHA256 = "output-sha256"
MESSAGE_ID = "message-id"
WORKER = "worker"
DELIVERY = "delivery"

MAX_WORKER_ID_BYTES = 128
MAX_HANDLER_NAME_BYTES = 128
MAX_HANDLER_VERSION_BYTES = 64
MAX_MODEL_OUTPUT_BYTES = 128
# The most bytes each value may take. Task ids are held to 512 characters of ASCII by the
# message rules; SQS message ids are at most 100 characters; S3's ETags are 34 (48 for a
# multipart upload) and its version ids 32.
MAX_VALUE_BYTES: dict[str, int] = {
    TASK_ID: 512,
    MODEL_SHA256: 64,
    MODEL_VERSION: 64,
    HANDLER: MAX_HANDLER_NAME_BYTES,
    HANDLER_VERSION: MAX_HANDLER_VERSION_BYTES,
    MODEL_OUTPUT: MAX_MODEL_OUTPUT_BYTES,
    SQSINFER_VERSION: 32,
    INPUT_ETAG: 128,
    INPUT_VERSION_ID: 256,
    INPUT_URI_SHA256: 64,
    OUTPUT_SHA256: 64,
    MESSAGE_ID: 100,
    WORKER: MAX_WORKER_ID_BYTES,
    DELIVERY: 32,
}
KEYS: tuple[str, ...] = tuple(MAX_VALUE_BYTES)
UNKNOWN_VERSION = "unknown"


def metadata_bytes(metadata: dict[str, str]) -> int:
    """User metadata's size as S3 measures it against its 2 KB limit."""
    return sum(len(k.encode()) + len(v.encode()) for k, v in metadata.items())


def worst_case_bytes() -> int:
    """The most the metadata of one output can take, every value at its cap."""
    return sum(len(key) + cap for key, cap in MAX_VALUE_BYTES.items())


def _fits(key: str, value: str) -> bool:
    return bool(value) and value.isascii() and len(value) <= MAX_VALUE_BYTES[key]


def value_problem(key: str, value: str) -> str:
    """'' when `value` can be written under `key`, else why not."""
    if _fits(key, value) and value.isprintable():
        return ""
    return f"{key} {value[:80]!r} is not 1-{MAX_VALUE_BYTES[key]} printable ASCII characters"


@dataclass(frozen=True)
class Producer:
    """What made every output of one worker: fixed for its life."""

    model_sha256: str
    handler: str
    handler_version: str
    worker: str
    model_version: str = ""
    model_output: str = ""  # the output a handler of several serves ("": it has one)
    sqsinfer_version: str = __version__


@dataclass(frozen=True)
class Written:
    """What is particular to one output: its task, the delivery, its input and its bytes."""

    task_id: str
    message_id: str
    delivery: str
    output_sha256: str
    input_etag: str = ""
    input_version_id: str = ""
    input_uri_sha256: str = ""  # an S3 event's output only


def output_metadata(producer: Producer, written: Written) -> dict[str, str]:
    """Every lineage key of one output. A value S3 or SQS gave beyond its cap is left out."""
    metadata = {
        TASK_ID: written.task_id,
        MODEL_SHA256: producer.model_sha256,
        MODEL_VERSION: producer.model_version,
        HANDLER: producer.handler,
        HANDLER_VERSION: producer.handler_version,
        MODEL_OUTPUT: producer.model_output,
        SQSINFER_VERSION: producer.sqsinfer_version,
        INPUT_ETAG: written.input_etag,
        INPUT_VERSION_ID: written.input_version_id,
        INPUT_URI_SHA256: written.input_uri_sha256,
        OUTPUT_SHA256: written.output_sha256,
        MESSAGE_ID: written.message_id,
        WORKER: producer.worker,
        DELIVERY: written.delivery,
    }
    return {key: value for key, value in metadata.items() if _fits(key, value)}
