"""The image itself: what is in it and what is not, its size and layers, and that the
worker and its inference processes start on the image's bytecode without compiling any.

The file system is looked at from the host, through `podman image mount`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import helm_python as helm
import pytest

from sqsinfer.lab import stage
from tests.deploy.chart import render
from tests.image import engine, workload
from tests.image.conftest import REPORT

pytestmark = pytest.mark.timeout(600)
VENV = "opt/venv"
SITE = f"{VENV}/lib/python3.11/site-packages"
MB = 1e6
# File names of CUDA's and NVIDIA's libraries, and of compilers and their back ends.
CUDA = re.compile(
    r"lib(cuda|cudart|cublas|cublasLt|cudnn|cufft|curand|cusparse|cusolver|nvrtc|nccl|nvjitlink)\b.*\.so"
)
COMPILERS = re.compile(r"(gcc|g\+\+|cc|c\+\+|clang|clang\+\+|cc1|cc1plus|tcc)(-[0-9.]+)?")
# What the image keeps though the worker never imports it: the operator commands' output.
KEPT_FOR_THE_CLI = ("rich", "pygments", "markdown_it", "mdurl")


@pytest.fixture(scope="module")
def root(image: str) -> Iterator[Path]:
    """The image's root file system, mounted read-only on the host."""
    path = Path(engine.podman("image", "mount", image).strip())
    try:
        yield path
    finally:
        engine.podman("image", "unmount", image, check=False)


def files(root: Path) -> Iterator[Path]:
    for folder, _, names in os.walk(root):
        for name in names:
            yield Path(folder, name)


def size_mb(path: Path) -> float:
    return sum(p.lstat().st_size for p in files(path)) / MB if path.is_dir() else 0.0


def test_no_cuda_library_and_no_compiler(root: Path) -> None:
    everything = [p.relative_to(root) for p in files(root)]
    assert [str(p) for p in everything if CUDA.match(p.name)] == []
    assert [str(p) for p in everything if "nvidia" in p.parts] == []
    binaries = [p for p in everything if p.parts[0] in ("bin", "sbin", "usr")]
    compilers = [str(p) for p in binaries if "bin" in p.parts[-2] and COMPILERS.fullmatch(p.name)]
    assert compilers == []
    assert [str(p) for p in everything if p.name in ("cc1", "cc1plus", "collect2")] == []
    packages = (root / "var/lib/dpkg/status").read_text()
    installed = re.findall(r"^Package: (\S+)\nStatus: install ok installed", packages, re.M)
    compiler_packages = r"(gcc|g\+\+|cpp|clang|tcc)(-[0-9.]+)?|binutils(-.*)?|clang-.*"
    assert [p for p in installed if re.fullmatch(compiler_packages, p)] == []  # not gcc-12-base
    assert "tini" in installed
    REPORT["image: dpkg packages"] = len(installed)


def test_no_installer_in_the_runtime_environment(root: Path, image: str) -> None:
    """pip and setuptools leave the environment; rich stays, for the operator commands
    (status, redrive, enqueue, plan), which run from the image too."""
    site = root / SITE
    found = {p.name.split("-")[0].lower() for p in site.glob("*.dist-info")}
    assert {"pip", "setuptools"}.isdisjoint(found)
    assert not [p.name for p in (root / VENV / "bin").iterdir() if p.name.startswith("pip")]
    probe = (
        "import importlib.util as u; print([m for m in ('pip', 'setuptools') if u.find_spec(m)])"
    )
    assert run(image, "--entrypoint", "python", image, "-c", probe).stdout.strip() == "[]"
    assert all((site / name).is_dir() for name in KEPT_FOR_THE_CLI)
    kept = {name: round(size_mb(site / name), 2) for name in KEPT_FOR_THE_CLI}
    REPORT["image: kept for the operator commands, MB"] = kept


def test_the_operator_commands_run_from_the_image(image: str) -> None:
    args = ["--tasks", "1000", "--seconds-per-task", "1", "--processes", "2", "--pods-max", "1"]
    done = run(image, image, "plan", *args)
    assert done.returncode == 0, done.stderr
    assert "pod sizing" in done.stdout and "3098 MiB" in done.stdout


def test_the_size_of_the_image_and_of_each_layer_is_reported(root: Path, image: str) -> None:
    size = int(engine.podman("image", "inspect", image, "--format", "{{.Size}}").strip())
    history = json.loads(engine.podman("history", "--format", "json", image))
    layers = [
        {"MB": round(h["size"] / MB, 1), "step": " ".join(h["CreatedBy"].split())[:90]}
        for h in reversed(history)
        if h["size"] > 0
    ]
    assert sum(layer["MB"] for layer in layers) == pytest.approx(size / MB, abs=1)
    site = root / SITE
    packages = sorted(
        ((round(size_mb(p), 1), p.name) for p in site.iterdir() if p.is_dir()), reverse=True
    )
    REPORT["image: size MB"] = round(size / MB, 1)
    REPORT["image: layers"] = layers
    REPORT["image: largest packages, MB"] = {name: mb for mb, name in packages[:10]}


def run(image: str, *args: str, remove: bool = True) -> subprocess.CompletedProcess[str]:
    """`podman run` of the image as the pods run it: read-only root, UID 10001."""
    command = [engine.PODMAN, "run", *(["--rm"] if remove else []), "--network", "host"]
    command += ["--read-only", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


# -- bytecode ------------------------------------------------------------------------------
USED = re.compile(r"^# (/\S+\.pyc) matches (/\S+\.py)$")
COMPILED = re.compile(r"^# code object from (/\S+\.py)$")


def imports(lines: list[str]) -> tuple[list[str], list[str]]:
    """What `python -v` says of each module it imported: (sources whose cached bytecode was
    used, sources compiled because none was usable)."""
    used = [m.group(2) for line in lines if (m := USED.match(line))]
    compiled = [m.group(1) for line in lines if (m := COMPILED.match(line))]
    return used, compiled


@contextlib.contextmanager
def verbose_worker(image: str, env: dict[str, str]) -> Iterator[str]:
    """The worker in the image, every process of it with PYTHONVERBOSE: its container."""
    name = f"verbose-{os.getpid()}"
    options = ["--tmpfs", "/tmp", "--shm-size", "256m", "-e", "PYTHONVERBOSE=1"]
    for key, value in env.items():
        options += ["-e", f"{key}={value}"]
    done = run(image, "-d", "--name", name, *options, image, "worker", remove=False)
    assert done.returncode == 0, done.stderr
    try:
        yield name
    finally:
        engine.podman("rm", "--force", name, check=False)


def test_no_process_compiles_bytecode_at_start(
    image: str, chart: helm.Chart, chain: workload.Chain, root: Path
) -> None:
    """The worker, its two inference processes and their work on every input format: each
    module they import comes from a .pyc the image holds (`python -v` says "matches"),
    none from compiling its source. With a read-only root nothing could be written back,
    so a missing .pyc would cost every process start its compilation again."""
    queue = stage.create_queue(chain.sqs, "lane-verbose").url
    values = workload.release_values(
        image,
        chain.endpoint,
        queue_url=queue,
        model_path=chain.uri("models/stage1.ubj"),
        model_sha256=chain.model1_sha256,
        allowed_input_prefixes=[chain.uri("in/")],
        output_prefix=chain.uri("verbose/"),
        processes=2,
    )
    rendered = render(chart, values, name="verbose")
    env = {e["name"]: e["value"] for e in rendered.container()["env"]}
    port = int(env["SQSINFER_HEALTH_PORT"])
    per_format = {t: u for t, u in chain.inputs.items() if t.startswith("task-0")}
    with verbose_worker(image, env) as container:
        for task_id, uri in per_format.items():
            body = json.dumps({"task_id": task_id, "input": uri})
            chain.sqs.send_message(QueueUrl=queue, MessageBody=body)
        committed = 'sqsinfer_tasks_total{outcome="committed"}'
        engine.wait_for(lambda: engine.metric(port, committed) == len(per_format), "formats")
        engine.podman("stop", "--time", "30", container)
        lines = engine.podman("logs", container).splitlines()
    used, compiled = imports(lines)
    assert compiled == []
    inference = [p for p in used if "/xgboost/" in p or "/pyarrow/" in p]
    assert inference  # the inference processes' own imports are among them
    assert len(used) > 500
    never = [p for p in used if any(f"/{name}/" in p for name in KEPT_FOR_THE_CLI)]
    assert never == []  # the worker does not import the operator commands' rich
    REPORT["bytecode: modules imported from .pyc, compiled"] = [len(used), len(compiled)]
    REPORT["bytecode: packages no process imported, MB"] = unused_packages(root, used)


def unused_packages(root: Path, used: list[str]) -> dict[str, float]:
    """Top-level packages in the environment none of the processes imported, with sizes."""
    site = f"/{SITE}/"
    imported = {p[len(site) :].split("/")[0] for p in used if p.startswith(site)}
    found = {
        path.name: round(size_mb(path), 1)
        for path in (root / SITE).iterdir()
        if path.is_dir() and "." not in path.name and path.name not in {*imported, "__pycache__"}
    }
    return dict(sorted(found.items(), key=lambda kv: -kv[1]))


def test_the_bytecode_check_sees_a_compiled_module(image: str) -> None:
    """The check can fail: a module without bytecode, imported in the image, is seen."""
    script = "import pathlib, sys; pathlib.Path('/tmp/fresh.py').write_text('X = 1'); "
    script += "sys.path.insert(0, '/tmp'); import fresh"
    done = run(
        image,
        "--tmpfs",
        "/tmp",
        "-e",
        "PYTHONVERBOSE=1",
        "--entrypoint",
        "python",
        image,
        "-c",
        script,
    )
    assert done.returncode == 0, done.stderr
    _, compiled = imports(done.stderr.splitlines())
    assert compiled == ["/tmp/fresh.py"]
