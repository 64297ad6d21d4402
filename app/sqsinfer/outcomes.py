"""The one outcome every message ends in."""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    COMMITTED = "committed"  # this delivery wrote the output
    DUPLICATE = "duplicate"  # the output existed: another delivery of the task wrote it
    REJECTED = "rejected"  # a permanent problem: copied to the DLQ with a reason
    RETRIED = "retried"  # a transient problem: handed back to the queue with a delay
    RELEASED = "released"  # shutdown reached it before its work started: visible at once
