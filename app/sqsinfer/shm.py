"""What a worker keeps in /dev/shm, named so that its owner can be told, and the sweep
at start-up of what dead workers left there.

A worker's input segments are named `sqsinfer-<pid>-<start>-<random>`: the creating
process's pid and its start time (clock ticks after boot, base 36), so that a pid
reused by another process does not pass for the owner. That matters in a container: a
restarted worker is often given the same pid (1, or 7 under an init) as the one killed.

A SIGKILL of the whole worker, resource tracker included, leaves its segments behind,
and in Kubernetes `/dev/shm` is a memory-backed emptyDir that outlives container
restarts in the pod, so repeated kills would fill it. `sweep()` at start-up removes the
segments whose owner is no longer running. It touches only names of this form, only
files of this user, and never those of a running process (another worker sharing the
directory included).

multiprocessing's own semaphores (`sem.mp-*`) carry nothing that says whose they are,
so they are not swept: the pool removes their names as soon as its process has opened
them (pool.py), and leaves none behind to sweep.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import secrets
from dataclasses import dataclass

from sqsinfer import procfs

log = logging.getLogger("sqsinfer.shm")

SHM_DIR = "/dev/shm"
PREFIX = "sqsinfer-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-([0-9a-z]+)-[0-9a-f]+")
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def _base36(number: int) -> str:
    text = ""
    while True:
        number, digit = divmod(number, 36)
        text = _DIGITS[digit] + text
        if not number:
            return text


@functools.cache
def _owner_tag(pid: int) -> str:
    return f"{PREFIX}{pid}-{_base36(procfs.start_ticks(pid))}"


def new_name() -> str:
    """A fresh segment name that says this process made it."""
    return f"{_owner_tag(os.getpid())}-{secrets.token_hex(4)}"


def exists(name: str) -> bool:
    """Whether a segment still has its name (True where /dev/shm cannot be looked at)."""
    if not os.path.isdir(SHM_DIR):
        return True
    return os.path.exists(os.path.join(SHM_DIR, name))


@dataclass(frozen=True)
class Swept:
    segments: int = 0
    bytes: int = 0


def sweep(directory: str = SHM_DIR) -> Swept:
    """Remove the segments of workers that are no longer running; one log line if any."""
    if not os.path.isdir(directory):
        return Swept()
    segments = size = 0
    for name in sorted(os.listdir(directory)):
        found = _NAME.fullmatch(name)
        if found is None or procfs.alive(int(found[1]), int(found[2], 36)):
            continue
        removed = _remove(os.path.join(directory, name))
        if removed is not None:
            segments, size = segments + 1, size + removed
    swept = Swept(segments, size)
    if segments:
        log.info(
            "swept what dead workers left",
            extra={"directory": directory, "segments": segments, "bytes": size},
        )
    return swept


def _remove(path: str) -> int | None:
    """Unlink one file of this user; its size, or None when it was not removed."""
    try:
        info = os.stat(path)
        if info.st_uid != os.getuid():
            return None
        os.unlink(path)
    except FileNotFoundError:  # another worker starting alongside swept it first
        return None
    except PermissionError as exc:
        log.warning("cannot sweep", extra={"path": path, "error": str(exc)})
        return None
    return info.st_size
