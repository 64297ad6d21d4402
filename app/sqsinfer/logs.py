"""Logging: one JSON object per line for machines, a readable line for a terminal.

Messages are stable strings ("task finished", "draining"); the facts travel as fields
(`extra=`), so a log query never has to parse prose.
"""

from __future__ import annotations

import logging
import sys
import time
from enum import StrEnum
from typing import Any

import orjson

# Attributes every LogRecord has; anything else was passed through `extra=` and is a field.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "taskName",
}


class Event(StrEnum):
    """Every message the package logs, each once: the `msg` of its JSON line.

    Stable: log queries, alerts and the proving ground's checks match on them, so one is
    renamed only with a note in the CHANGELOG. The facts of each event travel as fields.
    """

    # the lifecycle
    STOPPED_BEFORE_READY = "stopped before ready"
    SIGNAL_RECEIVED = "signal received"
    STARTING = "starting"
    POOL_READY = "pool ready"
    READY = "ready"
    RECEIVE_FAILED = "receive failed"
    IN_FLIGHT_LIMIT_CHANGED = "in-flight limit changed"
    DRAINING = "draining"
    STOPPED = "stopped"
    DRAIN_DEADLINE_PASSED = "drain deadline passed, releasing"
    LAST_RECEIVE_RELEASED = "released what the last receive brought"
    LAST_RECEIVE_ABANDONED = "last receive abandoned"
    RECEIVING_PAUSED = "no inference process can start: receiving paused, releasing"
    RECEIVING_RESUMED = "an inference process is back: receiving again"
    WORK_DONE = "work done, stopping"  # max_tasks taken, or idle for exit_when_idle_s
    # one message's outcome and its steps
    TASK_FAILED = "task failed, will retry"
    DELETE_FAILED = "delete failed"
    DELETE_NOT_CONFIRMED = "delete not confirmed"
    MESSAGE_REJECTED = "message rejected"
    DLQ_COPY_FAILED = "could not copy to the DLQ"
    RETRY_DELAY_NOT_SET = "could not set retry delay"
    HAND_BACK_FAILED = "could not hand back message"
    HAND_BACK_SKIPPED = "hand-back not sent: its hold lapsed while it waited"
    TASK_FINISHED = "task finished"
    OUTPUT_OF_ANOTHER_MODEL = "output written by another model"
    EVENT_IGNORED = "event ignored"
    GROUP_HANDED_BACK = "handed back unstarted: the one before it in its group went back"
    # the link to the next stage
    CHAIN_LINK_TAKEN_OVER = "chain link taken over"
    NEXT_STAGE_SEND_FAILED = "next stage send failed"
    CHAIN_MARKER_WRITE_FAILED = "chain marker write failed"
    CHAIN_DUPLICATE = "chain duplicate"
    # the visibility keeper
    VISIBILITY_TICK_FAILED = "visibility tick failed"
    TASK_OVER_MAX_TIME = "task over max time, abandoned"
    VISIBILITY_NOT_EXTENDED = "visibility not extended"
    VISIBILITY_EXTENSION_REFUSED = "visibility extension refused"
    # the inference processes
    POOL_PROCESS_DIED_WHILE_LOADING = "pool process died while loading"
    POOL_PROCESS_READY = "pool process ready"
    POOL_PROCESS_LOST = "pool process lost"
    POOL_PROCESS_RESTART_FAILED = "pool process restart failed"
    POOL_PROCESS_RESTARTED = "pool process restarted"
    # start-up checks
    DLQ_SIZE_ASSUMED = "cannot read the queue's MaximumMessageSize; assuming SQS's default"
    BUCKET_NOT_LISTABLE = "cannot list bucket (403), continuing"
    DEPENDENCY_NOT_ANSWERING = "dependency not answering, retrying"
    # the model file
    MODEL_ALREADY_FETCHED = "model already fetched"
    MODEL_DOWNLOAD_BROKE_OFF = "model download broke off, again"
    MODEL_FETCHED = "model fetched"
    # the health server
    HEALTH_SERVER_LISTENING = "health server listening"
    # SQS
    QUEUE_DEPTH_UNKNOWN = "cannot read the depth of a queue"
    QUEUE_DEPTH_KNOWN = "the depth of a queue is read again"
    POD_COST_NOT_SET = "cannot set the pod's deletion cost"
    POD_COST_SET_AGAIN = "the pod's deletion cost is set again"
    BATCH_ENTRY_FAILED = "batch entry failed"
    EXTENSION_CALL_FAILED = "extension call failed"
    VISIBILITY_EXTENSION_ENTRY_FAILED = "visibility extension entry failed"
    # S3
    CONDITIONAL_PUT_RETRIED = "conditional put again"
    GET_BODY_BROKE_OFF = "GET body broke off, again"
    CONDITIONAL_PUT_CONFLICT = "conditional put conflict"
    DATA_PATH_ROUTED = "data path reaches bucket"
    S3_SLOW_DOWN = "S3 asks to slow down: the data path waits"
    # /dev/shm
    SWEPT = "swept what dead workers left"
    CANNOT_SWEEP = "cannot sweep"
    KEPT_SEGMENT_LOST = "kept segment lost its name, replaced"
    WAITING_FOR_SHM = "input waits for room in /dev/shm"
    CANNOT_LOCK_SEGMENTS = "cannot lock the owner file of this worker's segments"
    # the command
    CANNOT_START = "cannot start"
    # traces
    TRACING_UNAVAILABLE = "OTEL_ variables set, but the otel extra is not installed: no traces"
    TRACES_NOT_FLUSHED = "traces not all exported before the exit"
    # sqsinfer enqueue
    OUTPUT_CHECK_FAILED = "cannot check the output, sending the task"
    # sqsinfer redrive
    NO_TARGET_FOR_MESSAGE = "no target for message"
    NOT_SENT = "not sent"
    MESSAGES_NOT_RELEASED = "messages not released, visible again when their hold lapses"
    MOVE_TASK_NOT_READ = "cannot read the message move task, reading again"
    MOVE_TASK_NOT_CANCELLED = "message move task not cancelled"
    # sqsinfer audit
    AUDIT_LISTING_AGAIN = "listing again through the SDK"
    # sqsinfer bench
    PY_SPY_MISSING = "--profile: py-spy is not installed (pip install py-spy)"


# Every JSON line starts with these; a field of the same name never replaces one of them.
ENVELOPE = ("ts", "level", "logger", "msg")


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The facts passed with `extra=`; one named like an envelope key gets a trailing `_`."""
    return {
        (k + "_" if k in ENVELOPE else k): v for k, v in vars(record).items() if k not in _STANDARD
    }


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        doc.update(record_fields(record))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(doc, default=str, option=orjson.OPT_NON_STR_KEYS).decode()


class ConsoleFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = record_fields(record)
        if fields:
            line += "  " + " ".join(f"{k}={v}" for k, v in fields.items())
        return line


def configure(level: str = "INFO", fmt: str = "auto") -> None:
    handler = logging.StreamHandler(sys.stderr)
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    handler.setFormatter(JsonFormatter() if use_json else ConsoleFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The AWS SDK logs every request at DEBUG and retries at INFO: noise at our level.
    for name in ("botocore", "aiobotocore", "aioboto3", "urllib3", "aiohttp.access"):
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
