"""The image lane: the image built here and the chart's own pods under podman.

`make test-image` builds the base and the image, then runs these tests with the image's
name in SQSINFER_TEST_IMAGE and SQSINFER_IMAGE_REQUIRED set. Without them (a plain
`pytest tests`) every test here is skipped, saying why; with them, a missing engine or
image fails. They run as root: each pod gets tmpfs volumes mounted for it (engine.py).

What the lane measures (sizes, start-up, the drain's timeline) is written to
build/image/report.json and printed at the end; nothing here asserts a duration.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from sqsinfer.lab import standin
from tests.deploy.chart import CHART, ROOT
from tests.image import engine, workload

IMAGE_ENV = "SQSINFER_TEST_IMAGE"
REQUIRED_ENV = "SQSINFER_IMAGE_REQUIRED"
REPORT_PATH = ROOT / "build" / "image" / "report.json"
REPORT: dict[str, Any] = {}


def _problem(name: str) -> str:
    if not name:
        return f"{IMAGE_ENV} names no image: `make test-image` builds one and runs these tests"
    if shutil.which(engine.PODMAN) is None:
        return "podman is not installed (make test-image installs it)"
    if os.geteuid() != 0:
        return "the image lane mounts a tmpfs per pod volume: run it as root"
    if subprocess.run([engine.PODMAN, "image", "exists", name], check=False).returncode:
        return f"podman has no image {name} (make test-image builds it)"
    return ""


@pytest.fixture(scope="session")
def image() -> str:
    name = os.environ.get(IMAGE_ENV, "")
    problem = _problem(name)
    if problem:
        if os.environ.get(REQUIRED_ENV):
            pytest.fail(problem)
        pytest.skip(problem)
    return name


@pytest.fixture(scope="session")
def chart() -> Iterator[helm.Chart]:
    helm.disable_logging()
    with helm.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def chain(
    image: str, moto: standin.MotoServer, tmp_path_factory: pytest.TempPathFactory
) -> workload.Chain:
    """The stand-in's bucket, queues, models and inputs every pod here works on."""
    return workload.make_chain(moto.url, tmp_path_factory.mktemp("chain"))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not REPORT:
        return
    REPORT_PATH.parent.mkdir(parents=True, exist_ok=True)
    REPORT_PATH.write_text(json.dumps(REPORT, indent=2) + "\n")
    terminalreporter.section("image lane: measured")
    for key, value in REPORT.items():
        terminalreporter.write_line(f"{key}: {json.dumps(value)}")
    terminalreporter.write_line(f"(also in {Path(REPORT_PATH).relative_to(ROOT)})")
