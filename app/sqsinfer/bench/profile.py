"""`--profile`: where the worker's CPU goes, sampled by py-spy during the window.

py-spy attaches to the running worker (and its children) from outside, so the worker
runs unmodified; sampling costs some CPU of its own, so a profiled run's figures are
marked as such. The summary groups samples by the package of the innermost frame
("self" time) and lists the frames that are on the stack most often ("inclusive").
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import sys
from typing import Any

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")
_STOP_TIMEOUT_S = 30.0


def py_spy() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.path.exists(beside) else shutil.which("py-spy")


def start(pid: int, out_path: str, duration_s: float) -> subprocess.Popen[bytes] | None:
    """Sample `pid` and its children until stopped; None when py-spy is not installed."""
    exe = py_spy()
    if exe is None:
        return None
    argv = [exe, "record", "--pid", str(pid), "--subprocesses", "--nonblocking"]
    argv += ["--rate", "200", "--format", "raw", "--duration", str(int(duration_s) + 5)]
    argv += ["--output", out_path]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """py-spy writes its file when interrupted."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _frame_parts(frame: str) -> tuple[str, str]:
    """(function, package) of one py-spy frame such as `send (aiohttp/client.py:12)`."""
    match = _FRAME.match(frame)
    if not match:
        return frame, frame.split(" ", 1)[0]
    path = match["file"]
    package = path.split("/", 1)[0] if "/" in path else path.removesuffix(".py")
    return match["func"], package


_PROCESS = re.compile(r'^process (?P<pid>\d+):"(?:[^"\\]|\\.)*";?')


def _innermost_process(stack: str) -> tuple[int, str]:
    """Strip the `process PID:"cmdline";` prefixes (parent, then child) from a stack."""
    pid = 0
    while match := _PROCESS.match(stack):
        pid, stack = int(match["pid"]), stack[match.end() :]
    return pid, stack


def _shares(counter: collections.Counter[str], top: int) -> dict[str, float]:
    total = sum(counter.values()) or 1
    return {k: round(v / total, 3) for k, v in counter.most_common(top)}


def summarize(path: str, root_pid: int, top: int = 12) -> dict[str, Any]:
    """Shares of samples by package (innermost frame), for the worker's own process and
    for the whole tree, and the frames of the worker's process most often on the stack."""
    tree: collections.Counter[str] = collections.Counter()
    parent: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    with open(path) as fh:
        for line in fh:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            pid, stack = _innermost_process(stack)
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            n = int(count)
            package = _frame_parts(frames[-1])[1]
            tree[package] += n
            if pid in (0, root_pid):
                parent[package] += n
                for frame in dict.fromkeys(re.sub(r":\d+\)$", ")", f) for f in frames):
                    inclusive[frame] += n
    samples = sum(tree.values())
    if not samples:
        return {"samples": 0}
    in_parent = sum(parent.values())
    return {
        "samples": samples,
        "parent_share": round(in_parent / samples, 3),
        "parent_self_by_package": _shares(parent, top),
        "tree_self_by_package": _shares(tree, top),
        "parent_top_inclusive": [
            [k, round(v / (in_parent or 1), 3)] for k, v in inclusive.most_common(top * 2)
        ],
    }
