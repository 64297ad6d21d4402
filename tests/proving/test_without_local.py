"""The proving ground's commands without the `local` extra: those that need the stand-in
say what to install; the fault proxy, which needs none of it, runs."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

import proving
from tests.lab.test_demo import BLOCK_LOCAL


def _run_blocked(*argv: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """`python -m proving.<tool> ARGS` without the local extra."""
    module, *rest = argv
    run = f"import runpy\nsys.argv = {[module, *rest]!r}\n"
    run += f"runpy.run_module('proving.{module}', run_name='__main__', alter_sys=True)\n"
    return subprocess.run(
        [sys.executable, "-c", BLOCK_LOCAL + run],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        env=proving.module_env(),
    )


@pytest.mark.parametrize("command", ["chaos", "soak"])
def test_without_the_local_extra_the_command_says_what_to_install(command):
    done = _run_blocked(command)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"python -m proving.{command} runs on a local stand-in" in done.stderr
    assert "pip install 'sqsinfer[local]'" in done.stderr
    assert "missing: moto, flask, flask_cors" in done.stderr


def test_the_fault_proxy_needs_no_local_extra():
    code = BLOCK_LOCAL + (
        "from proving.faults import main\n"
        "sys.exit(main(['--target', 'http://127.0.0.1:9', '--port', '0']))\n"
    )
    proxy = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=proving.module_env(),
    )
    try:
        assert proxy.stdout is not None
        assert proxy.stdout.readline().startswith("fault proxy on http://127.0.0.1:")
    finally:
        proxy.send_signal(signal.SIGTERM)
        _, err = proxy.communicate(timeout=30)
    assert proxy.returncode == 0, err
    assert "Traceback" not in err


def test_the_fleet_simulator_needs_no_local_extra():
    done = _run_blocked(
        "fleetsim",
        "--tasks",
        "200",
        "--seconds-per-task",
        "5",
        "--processes",
        "2",
        "--max-replicas",
        "2",
    )
    assert done.returncode == 0, done.stderr
    assert "fleet: simulated and planned" in done.stdout
