"""Measuring from the outside: a process tree's CPU and peak memory.

A scenario runs as its own process tree (the root and every descendant). Its CPU is
read from the kernel's accounting (psutil), never from inside, so the figure includes
everything the tree did: the event loop, the SDK, the children, the resource tracker.
The moto server is the bench's own child, never the scenario's, so it stays out.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

_MB = 1024 * 1024


def cpu_seconds(proc: psutil.Process) -> float:
    """User + system CPU of a process, and of its children it has already reaped."""
    t = proc.cpu_times()
    return float(t.user + t.system + t.children_user + t.children_system)


def precise_cpu_seconds(pid: int) -> float:
    """CPU of every thread of a process in nanoseconds (Linux schedstat), else psutil's
    clock-tick figure. For per-task costs far below a tick (10 ms)."""
    try:
        total_ns = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                total_ns += int(fh.read().split()[0])
        return total_ns / 1e9
    except (OSError, ValueError, IndexError):
        return cpu_seconds(psutil.Process(pid))


def peak_rss_bytes(proc: psutil.Process) -> int:
    """The process's peak resident set (Linux VmHWM), else its current RSS."""
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{proc.pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return int(proc.memory_info().rss)


def _role(proc: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        cmdline = " ".join(proc.cmdline())
        if "resource_tracker" in cmdline:
            return "resource-tracker"
        if "multiprocessing" in cmdline or "spawn_main" in cmdline:
            return "spawned"
    return "child"


@dataclass
class TreeProbe:
    """One process and its descendants, as they are now (children come and go)."""

    root_pid: int
    peaks: dict[int, tuple[str, int]] = field(default_factory=dict)
    roles: dict[int, str] = field(default_factory=dict)

    def processes(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.root_pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def cpu(self) -> dict[int, float]:
        """CPU seconds so far, per live process of the tree."""
        found: dict[int, float] = {}
        for proc in self.processes():
            with contextlib.suppress(psutil.Error):
                found[proc.pid] = cpu_seconds(proc)
                if proc.pid not in self.roles:
                    self.roles[proc.pid] = "parent" if proc.pid == self.root_pid else _role(proc)
        return found

    def only(self, cpu: dict[int, float], *, spawned: bool) -> dict[int, float]:
        """The entries of spawned processes (the pool's, or a baseline's), or of the rest."""
        return {p: v for p, v in cpu.items() if (self.roles.get(p) == "spawned") == spawned}

    def record_peaks(self) -> None:
        """Remember each live process's peak RSS (call before the tree is stopped)."""
        for proc in self.processes():
            with contextlib.suppress(psutil.Error):
                role = "parent" if proc.pid == self.root_pid else _role(proc)
                self.peaks[proc.pid] = (role, peak_rss_bytes(proc))

    def peak_rss_mb(self) -> dict[str, Any]:
        parent = [b for pid, (_, b) in self.peaks.items() if pid == self.root_pid]
        children = [
            {"pid": pid, "role": role, "mb": round(b / _MB, 1)}
            for pid, (role, b) in sorted(self.peaks.items())
            if pid != self.root_pid
        ]
        return {"parent": round(parent[0] / _MB, 1) if parent else None, "children": children}


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU spent between two snapshots; a process born in between counts from zero."""
    return sum(max(0.0, spent - before.get(pid, 0.0)) for pid, spent in after.items())


def own_cpu_seconds(pid: int) -> float:
    try:
        return cpu_seconds(psutil.Process(pid))
    except psutil.Error:
        return 0.0


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0-1) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def mean(values: Iterable[float]) -> float | None:
    items = list(values)
    return sum(items) / len(items) if items else None


def prometheus_samples(text: str) -> dict[str, float]:
    """`name{labels}` → value for every sample line of a Prometheus text exposition."""
    found = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                found[name] = float(value)
    return found
