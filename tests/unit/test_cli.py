"""The `sqsinfer` command line itself: its version, each command's usage line, and the
warning of a `SQSINFER_*` variable that is no setting."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sqsinfer import __version__, cli, config

COMMANDS = ("worker", "enqueue", "status", "redrive", "plan", "demo", "bench")


def test_version():
    done = subprocess.run(
        [sys.executable, "-m", "sqsinfer", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout) == (0, f"sqsinfer {__version__}\n")


@pytest.mark.parametrize("command", COMMANDS)
def test_each_commands_usage_line_names_the_command_alone(command, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    usage = capsys.readouterr().out.splitlines()[0]
    assert usage.startswith(f"usage: sqsinfer {command} [-h]"), usage


def test_the_worker_warns_of_a_misspelt_setting():
    """Run as its own process: the worker command installs signal handlers."""
    env = {k: v for k, v in os.environ.items() if k not in config.ENV_NAMES}
    env["SQSINFER_QUEUE_ULR"] = "https://sqs.eu-west-1.amazonaws.com/123456789012/q"
    done = subprocess.run(
        [sys.executable, "-m", "sqsinfer", "worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == cli.EXIT_USAGE  # no queue: the misspelt one is not it
    err = done.stderr.splitlines()
    assert err[0] == (
        "sqsinfer worker: warning: SQSINFER_QUEUE_ULR is not a setting, ignored; "
        "did you mean SQSINFER_QUEUE_URL?"
    )
    assert err[1].startswith("sqsinfer worker: invalid setting: SQSINFER_QUEUE_URL")


def test_unknown_variables_and_their_closest_settings():
    environ = {
        "SQSINFER_QUEUE_URL": "set",
        "SQSINFER_MAX_INPUT_BYTE": "1",
        "SQSINFER_VISIBILITY_TIMEOUT": "60",
        "SQSINFER_UNRELATED": "x",
        "AWS_REGION": "eu-west-1",
    }
    assert config.unknown_variables(environ) == [
        ("SQSINFER_MAX_INPUT_BYTE", "SQSINFER_MAX_INPUT_BYTES"),
        ("SQSINFER_UNRELATED", ""),
        ("SQSINFER_VISIBILITY_TIMEOUT", "SQSINFER_VISIBILITY_TIMEOUT_S"),
    ]
