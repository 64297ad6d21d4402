"""Process state from /proc: telling a live process from a dead one.

`kill(pid, 0)` succeeds for a zombie (a process that exited and is not yet reaped)
and for whatever process has since been given a dead one's pid. /proc says what state
a process is in and when it started, so neither passes for alive here. Where there is
no /proc (not Linux), `kill(pid, 0)` is all there is.
"""

from __future__ import annotations

import os

_PROC = "/proc"
_DEAD_STATES = frozenset({"Z", "X", "x"})  # zombie, dead
# Indices in /proc/<pid>/stat after the command name: field 3 (state) is the first.
_STATE, _START_TIME = 0, 19


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces or ")".
    return raw[raw.rindex(b")") + 2 :].decode().split()


def start_ticks(pid: int) -> int:
    """When the process started, in clock ticks after boot (0 when unknown)."""
    fields = _stat(pid) if os.path.isdir(_PROC) else None
    return int(fields[_START_TIME]) if fields else 0


def alive(pid: int, started: int = 0) -> bool:
    """Whether the process runs (not a zombie) and, if `started` is given, is the one
    that started then rather than a later process with the same pid."""
    if not os.path.isdir(_PROC):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # someone else's process: alive, and not ours to judge
            return True
        return True
    fields = _stat(pid)
    if fields is None or fields[_STATE] in _DEAD_STATES:
        return False
    return not started or int(fields[_START_TIME]) == started


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes(pid: int) -> int | None:
    """The process's resident memory, or None when it is gone (or there is no /proc)."""
    try:
        with open(f"{_PROC}/{pid}/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE_BYTES
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None
