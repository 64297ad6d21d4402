"""The one outcome every message ends in."""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    COMMITTED = "committed"  # this delivery wrote the output
    DUPLICATE = "duplicate"  # the output existed: another delivery of the task wrote it
    REJECTED = "rejected"  # a permanent problem: copied to the DLQ with a reason
    RETRIED = "retried"  # a transient problem: handed back to the queue with a delay
    RELEASED = "released"  # shutdown reached it before its work started: visible at once
    IGNORED = "ignored"  # an S3 event that names no new object (a test event, a removal)


# Why a message was rejected: the `sqsinfer.reason` attribute of its DLQ copy and the
# `reason` label of sqsinfer_rejections_total. Stable: operators alert and redrive by them.
REJECTION_REASONS: tuple[str, ...] = (
    "malformed_json",  # the body is not a JSON object
    "missing_field",  # task_id or input absent
    "invalid_field",  # a field of the wrong type, alphabet or length
    "message_too_large",  # over max_message_bytes
    "input_not_allowed",  # input outside the allowed prefixes
    "output_not_allowed",  # output outside the allowed prefixes
    "unsupported_format",  # a suffix no format reads or writes
    "input_not_found",  # no object at the input key
    "input_too_large",  # over max_input_bytes, or decoding past max_decoded_bytes
    "undecodable_input",  # the bytes are not what the suffix says
    "wrong_feature_count",  # the model takes another width
    "invalid_prediction",  # the handler broke its contract for this input
    "output_conflict",  # the output exists and belongs to another task
    "retries_exhausted",  # transient failures on the queue's last allowed receive
)
