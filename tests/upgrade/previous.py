"""The previous release, installed in a venv of its own from its git commit.

`previous-release` names the version and commit. The commit's tree (`git archive`) is
built into a wheel (`pip wheel --no-deps`, as an index would build it) and installed with
its own dependencies into `.venv-previous/<version>-<commit>/` at the repository's root,
kept for the next run. A clone without that commit (a shallow clone) cannot test an
upgrade: that is a failure that says how to fetch it, never a skip.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RELEASE_FILE = Path(__file__).with_name("previous-release")
VENVS = ROOT / ".venv-previous"
_DONE = ".complete"  # written last: a venv without it was cut short and is built again


@dataclass(frozen=True)
class Release:
    version: str  # e.g. v0.2.0
    commit: str  # the full sha

    @property
    def venv(self) -> Path:
        return VENVS / f"{self.version}-{self.commit[:12]}"

    @property
    def command(self) -> list[str]:
        """The release's own `sqsinfer` command."""
        return [str(self.venv / "bin" / "sqsinfer")]


def named() -> Release:
    """The release `previous-release` names (comments and blank lines aside)."""
    lines = [
        line.split()
        for line in RELEASE_FILE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    if len(lines) != 1 or len(lines[0]) != 2 or len(lines[0][1]) != 40:
        raise ValueError(f"{RELEASE_FILE}: want one line 'vX.Y.Z <40-hex commit>'")
    version, commit = lines[0]
    return Release(version, commit)


def _git(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, check=False)


def _require_commit(release: Release) -> None:
    if _git("cat-file", "-e", f"{release.commit}^{{commit}}").returncode != 0:
        pytest.fail(
            f"the previous release {release.version} (commit {release.commit}) is not in "
            f"this clone's history, so the upgrade cannot be tested: fetch it "
            f"(`git fetch --unshallow` or `git fetch origin {release.commit}`)",
            pytrace=False,
        )


def _run(args: list[str], what: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")


def _installer(python: Path) -> list[str]:
    """uv (the dev extras' own, beside this interpreter) when there is one, else pip."""
    uv = shutil.which("uv", path=str(Path(sys.executable).parent))
    if uv:
        return [uv, "pip", "install", "--quiet", "--python", str(python)]
    return [str(python), "-m", "pip", "install", "--quiet"]


def _wheel(release: Release, work: Path) -> Path:
    """The release's wheel, built from its commit's tree."""
    archive = work / "src.tar"
    proc = _git("archive", "--format=tar", "-o", str(archive), release.commit)
    if proc.returncode != 0:
        raise RuntimeError(f"git archive {release.commit}: {proc.stderr.decode()}")
    source = work / "src"
    with tarfile.open(archive) as tar:
        tar.extractall(source, filter="data")
    wheels = work / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels)]
    _run([*build, str(source)], f"pip wheel of {release.version}")
    (wheel,) = wheels.glob("sqsinfer-*.whl")
    return wheel


def _install(release: Release, wheel: Path) -> None:
    venv = release.venv
    shutil.rmtree(venv, ignore_errors=True)  # one cut short
    _run([sys.executable, "-m", "venv", str(venv)], "python -m venv")
    python = venv / "bin" / "python"
    _run([*_installer(python), str(wheel)], f"install of {wheel.name}")
    # The release's own code, not this tree's: its module lives in its venv.
    found = subprocess.run(
        [str(python), "-c", "import sqsinfer; print(sqsinfer.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=wheel.parent,
    ).stdout.strip()
    if not found.startswith(str(venv)):
        raise RuntimeError(f"{release.version}'s venv imports sqsinfer from {found}")
    (venv / _DONE).write_text(f"{release.version} {release.commit}\n")


def ensure(release: Release) -> Release:
    """The release's venv, built unless a finished one is there (one builder at a time)."""
    if (release.venv / _DONE).is_file():
        return release
    _require_commit(release)
    VENVS.mkdir(exist_ok=True)
    with open(VENVS / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (release.venv / _DONE).is_file():
            with tempfile.TemporaryDirectory(prefix="sqsinfer-previous-") as tmp:
                _install(release, _wheel(release, Path(tmp)))
    return release
