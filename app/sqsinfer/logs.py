"""Logging: one JSON object per line for machines, a readable line for a terminal.

Messages are stable strings ("task finished", "draining"); the facts travel as fields
(`extra=`), so a log query never has to parse prose.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

# Attributes every LogRecord has; anything else was passed through `extra=` and is a field.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "taskName",
}


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
