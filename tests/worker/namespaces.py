"""A worker process with a /dev/shm of the test's choosing, and in a pid namespace of its
own when asked: what a container of a pod sees.

multiprocessing's shared memory always lives in /dev/shm, so a worker is given a small
one by running it in a mount namespace of its own (`unshare --mount`) where the test's
tmpfs is bound over /dev/shm; the test sees the same files at the tmpfs's own path.
`unshare --pid --fork --mount-proc` adds a pid namespace (the worker is pid 1 there,
as in a container) whose /proc shows only its own processes. Both need root.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

MIB = 1 << 20
_POLL_S = 0.05
_WAIT_S = 90.0

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="mounts a tmpfs and makes namespaces: needs root and util-linux's unshare",
)


@contextlib.contextmanager
def small_tmpfs(path: Path, size_mib: int) -> Iterator[Path]:
    """A tmpfs of `size_mib` MiB mounted at `path`, unmounted afterwards."""
    path.mkdir()
    options = f"size={size_mib}m,mode=1777"
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=False)


def on_dev_shm(directory: Path, *, own_pids: bool = False) -> list[str]:
    """The command prefix that runs what follows with `directory` as its /dev/shm."""
    unshare = ["unshare", "--mount"]
    if own_pids:
        unshare += ["--pid", "--fork", "--mount-proc"]
    script = 'mount --bind "$0" /dev/shm && exec "$@"'
    return [*unshare, "sh", "-c", script, str(directory)]


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = _WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"waited {timeout_s:g} s for {what}"
        time.sleep(_POLL_S)


class WorkerProcess:
    """`sqsinfer worker` under `prefix`, its JSON log lines written to `log_path`."""

    def __init__(self, prefix: list[str], env: dict[str, str], log_path: Path) -> None:
        self.env = env
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                [*prefix, sys.executable, "-m", "sqsinfer", "worker"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
                text=True,
            )

    @property
    def exited(self) -> bool:
        return self.process.poll() is not None

    def lines(self) -> list[dict[str, Any]]:
        text = self.log_path.read_text()
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    def logged(self, message: str) -> list[dict[str, Any]]:
        return [line for line in self.lines() if line.get("msg") == message]

    def ready(self) -> bool:
        port = self.env["SQSINFER_HEALTH_PORT"]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1):
                return True
        except OSError:
            return False

    def wait_ready(self) -> None:
        wait_for(lambda: self.exited or self.ready(), "the worker to be ready")
        assert not self.exited, self.log_path.read_text()

    def worker_pid(self) -> int:
        """The worker's pid as this test sees it (below `unshare --fork`, its child)."""
        top = psutil.Process(self.process.pid)
        for proc in [top, *top.children()]:
            if proc.cmdline()[:3] == [sys.executable, "-m", "sqsinfer"]:
                return proc.pid
        raise AssertionError("no worker process found")

    def stop(self) -> int:
        """SIGTERM, then the exit code (killed after a while, a failure of its own)."""
        if not self.exited:
            os.kill(self.worker_pid(), signal.SIGTERM)
        try:
            return self.process.wait(timeout=_WAIT_S)
        finally:
            self.kill()

    def kill(self) -> None:
        with contextlib.suppress(psutil.Error, AssertionError):
            if not self.exited:
                os.kill(self.worker_pid(), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self.process.wait(timeout=_WAIT_S)


@contextlib.contextmanager
def worker(prefix: list[str], env: dict[str, str], log_path: Path) -> Iterator[WorkerProcess]:
    started = WorkerProcess(prefix, env, log_path)
    try:
        yield started
    finally:
        started.kill()
