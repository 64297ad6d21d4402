"""The exceptions that cross the boundary between the worker and a model handler.

Import-light on purpose: spawned inference processes and users' handlers import these,
and must not pull in the AWS SDK or the worker with them.
"""

from __future__ import annotations


class InputError(Exception):
    """A permanent problem with one task (its message, or its input): the message goes to
    the dead-letter queue with `reason` (one of `outcomes.REJECTION_REASONS`) and `detail`.

    Raised by the message's parsing, by the worker's S3 reads and checks, and by handlers
    and decoders in a child process. Carries only strings so it pickles back from a child
    process unchanged.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


class ModelLoadError(Exception):
    """The model cannot be loaded: start-up stops with this message."""
