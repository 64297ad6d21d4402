"""Download the wheels an offline image build installs from (`--build-arg WHEELHOUSE=...`).

    python scripts/wheelhouse.py [--extras parquet] [--python-version 3.11] [wheelhouse]

Air-gapped and regulated builds, and hosts whose builds cannot reach the package index,
install the project's dependencies from a folder of wheels in the build context (`pip
install --no-index --find-links`). This fills that folder, on a machine that can reach
the index, with binary wheels for the image's interpreter (CPython 3.11 on glibc, the
architecture of this machine unless told): the runtime dependencies, those of the extras
asked for, and the build backend (`[build-system] requires`), which pip needs to build
the project itself from its source inside the image.

The folder is reused while the requirements it was made for are unchanged (they are
written to `.requirements` in it); otherwise it is emptied and filled again.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from scripts.check_floors import direct_requirements  # noqa: E402  (after the path)

STAMP = ".requirements"
# The oldest glibc a manylinux wheel may ask for; the newest is the image's (bookworm: 2.36).
_OLDEST_GLIBC_MINOR = 17


def requirements(extras: list[str], root: Path = ROOT) -> list[str]:
    """The build backend, the runtime dependencies and those of `extras`, as pip reads them."""
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    runtime = direct_requirements(pyproject["project"], extras)
    build = [Requirement(text) for text in pyproject["build-system"]["requires"]]
    return sorted({str(req) for req in [*build, *runtime]})


def platforms(machine: str, glibc: tuple[int, int]) -> list[str]:
    """Every manylinux tag a wheel for this glibc and architecture may carry, newest first."""
    major, newest = glibc
    minors = range(newest, _OLDEST_GLIBC_MINOR - 1, -1)
    tags = [f"manylinux_{major}_{minor}_{machine}" for minor in minors]
    return [*tags, f"manylinux2014_{machine}", f"manylinux2010_{machine}", f"manylinux1_{machine}"]


def download_command(
    out: Path, reqs: list[str], python_version: str, machine: str, glibc: tuple[int, int]
) -> list[str]:
    cpython = "cp" + python_version.replace(".", "")
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(out)]
    command += ["--only-binary=:all:", "--python-version", python_version]
    command += ["--implementation", "cp", "--abi", cpython, "--abi", "abi3", "--abi", "none"]
    for tag in platforms(machine, glibc):
        command += ["--platform", tag]
    return [*command, *reqs]


def fill(
    out: Path, reqs: list[str], python_version: str, machine: str, glibc: tuple[int, int]
) -> bool:
    """Download into `out` unless it holds these requirements already; True when it did."""
    stamp = out / STAMP
    wanted = "\n".join([f"# python {python_version} {machine} glibc {glibc[0]}.{glibc[1]}", *reqs])
    if stamp.is_file() and stamp.read_text() == wanted and any(out.glob("*.whl")):
        return False
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    subprocess.run(download_command(out, reqs, python_version, machine, glibc), check=True)
    stamp.write_text(wanted)
    return True


def parse_glibc(text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    return int(major), int(minor)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("out", nargs="?", default="wheelhouse", help="(wheelhouse)")
    parser.add_argument("--extras", default="", help="comma-separated extras, e.g. parquet")
    parser.add_argument("--python-version", default="3.11", help="the image's Python (3.11)")
    parser.add_argument("--machine", default=platform.machine(), help="(this machine's)")
    parser.add_argument("--glibc", default="2.36", type=parse_glibc, help="the image's (2.36)")
    args = parser.parse_args(argv)
    extras = [e.strip() for e in args.extras.split(",") if e.strip()]
    reqs = requirements(extras)
    out = Path(args.out)
    done = fill(out, reqs, args.python_version, args.machine, args.glibc)
    wheels = sorted(out.glob("*.whl"))
    size_mb = sum(w.stat().st_size for w in wheels) / 1e6
    state = "downloaded" if done else "already there"
    print(f"wheelhouse {out}: {len(wheels)} wheels, {size_mb:.0f} MB ({state})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
