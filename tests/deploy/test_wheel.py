"""The wheel a user installs: a package named for itself, beside a user's own `app`.

A user's project with its own top-level `app` package (the most common name in Python
services) runs a worker with its handler `app.handlers:MyHandler`, with sqsinfer
imported from the built wheel rather than from this checkout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from sqsinfer.lab import standin, synthetic
from tests.conftest import Stage

ROOT = Path(__file__).resolve().parents[2]

USER_HANDLER = """
import numpy as np


class MyHandler:
    def load(self, model_path: str, threads: int) -> None:
        self.scale = 2.0
        self.n_features = 3  # what the worker warms each process up with

    def predict(self, array: np.ndarray) -> np.ndarray:
        return array.sum(axis=1) * self.scale
"""


def _wait_until(check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not done within {timeout_s} s"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(ROOT)],
        check=True,
        timeout=300,
    )
    (built,) = out.glob("sqsinfer-*.whl")
    return built


def test_the_wheel_installs_only_the_sqsinfer_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/", 1)[0] for name in archive.namelist()}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"sqsinfer"}


def test_the_wheel_holds_no_proving_ground_module(wheel: Path) -> None:
    """The proving ground (chaos, soak, the fault proxy, the LocalStack builder, SQS's
    rules) stays beside the package: none of its modules is shipped, under any name."""
    with zipfile.ZipFile(wheel) as archive:
        shipped = [archive.read(n) for n in archive.namelist() if n.endswith(".py")]
    proving = [p.read_bytes() for p in (ROOT / "proving").rglob("*.py") if p.stat().st_size]
    assert len(proving) >= 5, "the proving ground has its modules"
    assert not set(proving) & set(shipped)
    assert not [t for t in shipped if b"import proving" in t or b"from proving" in t]


def test_a_user_project_with_its_own_app_package_runs_its_handler(
    wheel: Path, stage: Stage, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    project = tmp_path / "project"
    (project / "app").mkdir(parents=True)
    (project / "app" / "__init__.py").write_text("")
    (project / "app" / "handlers.py").write_text(textwrap.dedent(USER_HANDLER))
    model = project / "model.bin"
    model.write_bytes(b"weights")
    env = {
        **os.environ,
        **standin.FAKE_CREDENTIALS,
        "PYTHONPATH": os.pathsep.join([str(site), str(project)]),
        "SQSINFER_QUEUE_URL": stage.queue_url,
        "SQSINFER_MODEL_PATH": str(model),
        "SQSINFER_HANDLER": "app.handlers:MyHandler",
        "SQSINFER_ALLOWED_INPUT_PREFIXES": f"s3://{stage.bucket}/in/",
        "SQSINFER_OUTPUT_PREFIX": f"s3://{stage.bucket}/out/",
        "SQSINFER_ENDPOINT_URL": stage.endpoint,
        "SQSINFER_PROCESSES": "1",
        "SQSINFER_WAIT_TIME_S": "1",
        "SQSINFER_HEALTH_HOST": "127.0.0.1",
        "SQSINFER_HEALTH_PORT": "0",
        "SQSINFER_LOG_FORMAT": "json",
    }
    where = subprocess.run(
        [sys.executable, "-c", "import sqsinfer; print(sqsinfer.__file__)"],
        env=env,
        cwd=project,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert where.stdout.startswith(str(site)), "sqsinfer must come from the wheel"

    rows = np.arange(6, dtype=np.float32).reshape(2, 3)
    uri = stage.put_input("user.npy", synthetic.encode_input(rows, "npy"))
    stage.send({"task_id": "user-1", "input": uri})
    worker = subprocess.Popen(
        [sys.executable, "-m", "sqsinfer", "worker"],
        env=env,
        cwd=project,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        _wait_until(lambda: stage.counts(stage.queue_url) == (0, 0), timeout_s=60)
    finally:
        worker.terminate()
        _, errors = worker.communicate(timeout=60)
    output = synthetic.decode_output(stage.outputs()["out/user-1.npy"], "npy")
    np.testing.assert_allclose(output[:, 0], rows.sum(axis=1) * 2.0)
    lines = [json.loads(line) for line in errors.splitlines() if line.startswith("{")]
    finished = [line for line in lines if line["msg"] == "task finished"]
    assert [line["outcome"] for line in finished] == ["committed"], errors
    assert worker.returncode == 0
