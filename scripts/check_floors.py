"""Check that an environment holds the declared floor of every direct dependency.

`make test-floors` installs the project with uv's `--resolution lowest-direct` into a
separate virtual environment and runs this with that environment's interpreter, before the
tests. A runtime floor the resolver could not honour (another dependency pins something
higher, or no release matches it exactly) would make the floors test prove nothing about
the declared number, so each runtime dependency must be installed at exactly its floor.
The extras' floors (test and lint tools, the local stand-in) are reported, not enforced:
their transitive dependencies' newest releases move them as time passes.

    .venv-floors/bin/python scripts/check_floors.py --extras dev
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def direct_requirements(project: Mapping[str, Any], extras: Iterable[str]) -> list[Requirement]:
    """The runtime dependencies plus those of `extras`, following `name[extra]` references."""
    name = canonicalize_name(project["name"])
    optional: Mapping[str, list[str]] = project.get("optional-dependencies", {})
    texts = list(project.get("dependencies", []))
    todo, done = list(extras), set()
    out: list[Requirement] = []
    while texts or todo:
        if not texts:
            extra = todo.pop()
            if extra not in done:
                done.add(extra)
                texts = list(optional[extra])
            continue
        req = Requirement(texts.pop(0))
        if canonicalize_name(req.name) == name:
            todo += sorted(req.extras)
        elif req.marker is None or req.marker.evaluate():
            out.append(req)
    return out


def floor(req: Requirement) -> Version | None:
    """The version after `>=`, if the requirement has one."""
    lows = [Version(s.version) for s in req.specifier if s.operator == ">="]
    return max(lows) if lows else None


def problems(reqs: Iterable[Requirement], installed: Mapping[str, str]) -> list[str]:
    """One line per direct dependency whose installed version is not its floor."""
    out = []
    for req in reqs:
        low = floor(req)
        have = installed.get(canonicalize_name(req.name))
        if low is None:
            out.append(f"{req.name}: no >= floor declared ({req})")
        elif have is None:
            out.append(f"{req.name}: not installed (floor {low})")
        elif Version(have) != low:
            out.append(f"{req.name}: floor {low} declared, {have} installed")
    return out


def installed_versions() -> dict[str, str]:
    return {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extras", default="", help="comma-separated extras installed too")
    parser.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml")
    args = parser.parse_args(argv)
    project = tomllib.loads(args.pyproject.read_text())["project"]
    installed = installed_versions()
    runtime = direct_requirements(project, [])
    extras = [e for e in args.extras.split(",") if e]
    in_extras = [r for r in direct_requirements(project, extras) if r not in runtime]
    for line in problems(in_extras, installed):
        print(f"check_floors: note (extra): {line}")
    found = problems(runtime, installed)
    for line in found:
        print(f"check_floors: {line}: raise the floor or fix the pin", file=sys.stderr)
    if not found:
        print(f"check_floors: all {len(runtime)} runtime dependencies installed at their floors")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
