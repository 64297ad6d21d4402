"""The exceptions that cross the boundary between the worker and a model handler.

Import-light on purpose: spawned inference processes and users' handlers import these,
and must not pull in the AWS SDK or the worker with them.
"""

from __future__ import annotations


class InputError(Exception):
    """A permanent problem with one task's input: the message is rejected with `reason`.

    Carries only strings so it pickles back from a child process unchanged.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


class ModelLoadError(Exception):
    """The model cannot be loaded: start-up stops with this message."""
