"""Rules every log line and rejection reason of the package keeps, checked on its source.

Log messages are members of one enum (`logs.Event`) and the facts travel as fields, so a
query on `msg` finds every line of its kind and every message has one home; rejection
reasons come from one registry, so dashboards, alerts and redrive filters can name them
all.
"""

from __future__ import annotations

import ast
import io
import json
import logging
from pathlib import Path

from sqsinfer.logs import ENVELOPE, Event, JsonFormatter
from sqsinfer.outcomes import REJECTION_REASONS

PACKAGE = Path(__file__).resolve().parents[2] / "app" / "sqsinfer"
# The tooling that prints for a person at a terminal keeps its own habits.
TOOLING = ("lab", "bench")
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}


def _sources() -> list[Path]:
    return [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] not in TOOLING
    ]


def _calls(path: Path) -> list[ast.Call]:
    return [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)]


def _is_log_call(call: ast.Call) -> bool:
    func = call.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr in LEVELS
        and isinstance(func.value, ast.Name)
        and func.value.id in ("log", "logger")
    )


def _event(node: ast.expr | None) -> str | None:
    """The member name when `node` is `Event.NAME`."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.attr if node.value.id == "Event" else None
    return None


def test_every_log_message_is_an_event_with_the_facts_as_fields() -> None:
    found, used = [], set()
    for path in _sources():
        for call in filter(_is_log_call, _calls(path)):
            name = _event(call.args[0] if call.args else None)
            if name is None or name not in Event.__members__ or len(call.args) > 1:
                found.append(f"{path.relative_to(PACKAGE)}:{call.lineno}")
            used.add(name)
    assert found == []
    # Each event is logged somewhere (the bench's own lines are tooling's, left out here).
    assert set(Event.__members__) - used == {"PY_SPY_MISSING"}


def test_every_rejection_reason_comes_from_the_registry() -> None:
    used = set()
    for path in _sources():
        for call in _calls(path):
            name = getattr(call.func, "id", getattr(call.func, "attr", ""))
            if name == "InputError" and call.args:
                first = call.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    used.add(first.value)
    assert used, "the scan found no reasons at all"
    assert used - set(REJECTION_REASONS) == set()


def test_fields_never_replace_the_envelope() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("sqsinfer.test-envelope")
    logger.addHandler(handler)
    try:
        logger.warning("constant", extra={"level": "forged", "logger": "x", "ts": 0, "n": 1})
    finally:
        logger.removeHandler(handler)
    doc = json.loads(stream.getvalue())
    assert (doc["level"], doc["logger"], doc["msg"]) == ("warning", logger.name, "constant")
    assert doc["level_"] == "forged" and doc["logger_"] == "x" and doc["ts_"] == 0
    assert doc["n"] == 1
    assert list(doc)[: len(ENVELOPE)] == list(ENVELOPE)
