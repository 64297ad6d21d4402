"""`sqsinfer demo` as a newcomer meets it: progress while it runs, a next step after, and
a clear word on what to install when the local stand-in is missing."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

# Run first in a child: moto and flask cannot be imported, as in an install without the
# `local` extra. A meta-path finder is consulted before the real ones.
BLOCK_LOCAL = """
import sys
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("moto", "flask", "flask_cors"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Absent())
"""


def _run_blocked(*argv: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    code = BLOCK_LOCAL + f"from sqsinfer.cli import main\nsys.exit(main({list(argv)!r}))\n"
    argv_ = [sys.executable, "-c", code]
    return subprocess.run(argv_, capture_output=True, text=True, timeout=timeout_s, check=False)


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_without_the_local_extra_the_command_says_what_to_install(command):
    done = _run_blocked(command)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"sqsinfer {command} runs on a local stand-in" in done.stderr
    assert "pip install 'sqsinfer[local]'" in done.stderr
    assert "missing: moto, flask, flask_cors" in done.stderr


def _read_until(stream, marker: str, timeout_s: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if marker in line:
            return lines
    raise AssertionError("no " + repr(marker) + " in:\n" + "\n".join(lines))


def _exports(lines: list[str]) -> dict[str, str]:
    found = {}
    for line in lines:
        if line.strip().startswith("export "):
            found |= dict(pair.split("=", 1) for pair in line.split()[1:])
    return found


def test_demo_shows_progress_passes_and_keeps_the_stand_in_for_the_next_step():
    demo = subprocess.Popen(
        [sys.executable, "-m", "sqsinfer", "demo", "--tasks", "20", "--keep"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert demo.stdout is not None
        lines = _read_until(demo.stdout, "Outputs are under", timeout_s=150)
        text = "\n".join(lines)
        # Not a terminal: plain progress lines, per stage, with counts and a rate.
        assert re.search(r"stage1 \d+/27 \(\d+ committed, \d+ rejected, ", text), text
        assert re.search(r"stage2 \d+/20 \(\d+ committed, 0 rejected, ", text), text
        assert "check passed" in text
        env = _exports(lines)
        assert set(env) >= {"SQSINFER_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "STAGE1", "STAGE2"}

        # The next step works: the operator tools reach the stand-in that was left up.
        queues_ = ["--queue-url", env["STAGE1"], "--queue-url", env["STAGE2"]]
        status = subprocess.run(
            [sys.executable, "-m", "sqsinfer", "status", "--json", "--interval-s", "0", *queues_],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert status.returncode == 0, status.stderr
        queues = {q["name"]: q for q in json.loads(status.stdout)["queues"]}
        dlq = queues["demo-stage1-dlq"]
        assert dlq["visible"] + dlq["in_flight"] == 7  # the seven bad messages, kept
        assert queues["demo-stage1"]["visible"] == 0
    finally:
        demo.send_signal(signal.SIGINT)
        rest, _ = demo.communicate(timeout=60)
    assert demo.returncode == 0, rest
    assert "stand-in stopped" in rest
    assert "Traceback" not in rest
