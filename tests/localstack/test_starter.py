"""The LocalStack starter: finds its venv or says how to get one; loopback only; no state left."""

from __future__ import annotations

import os

import psutil
import pytest

from proving import localstack


def test_a_missing_install_names_the_setting_and_the_make_target(tmp_path):
    with pytest.raises(localstack.LocalStackMissing) as caught:
        localstack.localstack_python({localstack.PYTHON_ENV: str(tmp_path / "bin" / "python")})
    message = str(caught.value)
    assert str(tmp_path) in message
    assert localstack.PYTHON_ENV in message
    assert "make test-localstack" in message


def test_a_python_without_localstack_is_not_taken_for_one(tmp_path):
    # The project's own interpreter runs, but it is neither 3.13 nor has LocalStack.
    with pytest.raises(localstack.LocalStackMissing):
        localstack.localstack_python({localstack.PYTHON_ENV: psutil.Process().exe()})


def _listening(process: psutil.Process) -> set[str]:
    family = {process, *process.children(recursive=True)}
    return {
        conn.laddr.ip
        for proc in family
        for conn in proc.net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    }


def test_serves_on_loopback_only_and_removes_its_state_when_stopped():
    with localstack.localstack_server() as server:
        assert server.url.startswith("http://127.0.0.1:")
        assert server.log_path.exists()
        assert _listening(psutil.Process(server.process.pid)) == {"127.0.0.1"}
        state = server.state_dir
        assert any(state.iterdir())
    assert server.process.returncode is not None
    assert not os.path.exists(state)
