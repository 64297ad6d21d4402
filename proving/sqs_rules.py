"""What real SQS refuses and the moto stand-in lets through, checked on what was sent.

moto accepts any character in a message and counts only the body against a queue's
MaximumMessageSize; AWS (and LocalStack) refuse characters outside the XML 1.0 range
and count attribute names, types and values too. The tests and the chaos run apply
these rules to every message a worker sent, so a worker that would fail on AWS fails
here. Written apart from the worker's own size and character code on purpose: an
independent reading of the rules, not the same code checking itself.
"""

from __future__ import annotations

import re
from typing import Any

from sqsinfer.limits import SQS_MAX_ATTRIBUTES

# XML 1.0: #x9 | #xA | #xD | [#x20-#xD7FF] | [#xE000-#xFFFD] | [#x10000-#x10FFFF]
_XML_TEXT = re.compile("[\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]*")


def sendable_text(text: str) -> bool:
    return _XML_TEXT.fullmatch(text) is not None


def attribute_bytes(name: str, value: dict[str, Any]) -> int:
    data = value.get("StringValue")
    size = len(data.encode()) if data is not None else len(value.get("BinaryValue", b""))
    return len(name.encode()) + len(value["DataType"].encode()) + size


def message_bytes(body: str, attributes: dict[str, Any] | None) -> int:
    """A message's size as SQS counts it: the body plus every attribute's name, type, value."""
    return len(body.encode()) + sum(attribute_bytes(k, v) for k, v in (attributes or {}).items())


def unsendable(body: str, attributes: dict[str, Any] | None, max_bytes: int) -> list[str]:
    """Why AWS would refuse this message (empty when it would accept it)."""
    problems = []
    if not body:
        problems.append("empty body")
    if not sendable_text(body):
        problems.append("body has characters outside the XML range")
    for name, value in (attributes or {}).items():
        if not sendable_text(name) or not sendable_text(value.get("StringValue", "")):
            problems.append(f"attribute {name} has characters outside the XML range")
    if len(attributes or {}) > SQS_MAX_ATTRIBUTES:
        problems.append(f"{len(attributes or {})} attributes")
    size = message_bytes(body, attributes)
    if size > max_bytes:
        problems.append(f"{size} bytes, more than {max_bytes}")
    return problems
