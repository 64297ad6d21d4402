"""Build and check the release artefacts of one version.

    python scripts/release.py [--out-dir dist] [--image registry.example.com/ml/sqsinfer]

The version is `sqsinfer.__version__` (app/sqsinfer/__init__.py); pyproject reads it, and
the chart's version and appVersion, the Dockerfile's VERSION and a CHANGELOG entry must
say the same. Then, into the output folder:

- the wheel and the sdist (`uv build`), checked: the wheel holds `sqsinfer/` and its
  dist-info only, the metadata carries the version and no tooling dependency;
- the chart package (Helm's own `package`), linted as a folder and as an archive;
- `docker-build.sh`, the command that builds and pushes the image (no container engine
  is needed here: the Dockerfile is linted with hadolint instead).

It exits 1 naming every problem found.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import helm_python as helm
import yaml  # type: ignore[import-untyped]  # no stubs in the dev environment

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "sqsinfer"
PACKAGE = "sqsinfer"
# Dependencies only the tooling extras may bring (see pyproject's [local] extra).
TOOLING_ONLY = ("psutil", "moto", "boto3")


def version(root: Path = ROOT) -> str:
    """`__version__` of the package, read without importing it."""
    tree = ast.parse((root / "app" / PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            if isinstance(value, str):
                return value
    raise SystemExit("release: no __version__ in app/sqsinfer/__init__.py")


def version_problems(root: Path = ROOT) -> list[str]:
    """Every place that states the version and does not state `version(root)`."""
    want = version(root)
    problems = []
    chart = yaml.safe_load((root / "helm" / "sqsinfer" / "Chart.yaml").read_text())
    for key in ("version", "appVersion"):
        if str(chart[key]) != want:
            problems.append(f"helm/sqsinfer/Chart.yaml {key} is {chart[key]}, not {want}")
    docker_arg = re.search(r"^ARG VERSION=(\S+)$", (root / "Dockerfile").read_text(), re.M)
    if docker_arg is None or docker_arg.group(1) != want:
        found = docker_arg.group(1) if docker_arg else "missing"
        problems.append(f"Dockerfile ARG VERSION is {found}, not {want}")
    pyproject = (root / "pyproject.toml").read_text()
    if 'dynamic = ["version"]' not in pyproject:
        problems.append("pyproject.toml must read the version from sqsinfer.__version__")
    changelog = root / "CHANGELOG.md"
    heading = re.compile(rf"^## {re.escape(want)}\b", re.M)
    if not changelog.is_file() or not heading.search(changelog.read_text()):
        problems.append(f"CHANGELOG.md has no '## {want}' entry")
    return problems


def _tool(name: str) -> str:
    """A tool installed next to this interpreter (the dev extras), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise SystemExit(f"release: {name} not found: install the dev extras")
    return found


def build_python(out: Path, root: Path = ROOT) -> tuple[Path, Path]:
    """The wheel and the sdist, built in isolation as an index would build them."""
    subprocess.run(
        [_tool("uv"), "build", "--quiet", "--out-dir", str(out), str(root)],
        check=True,
        timeout=600,
    )
    (wheel,) = out.glob(f"{PACKAGE}-*.whl")
    (sdist,) = out.glob(f"{PACKAGE}-*.tar.gz")
    return wheel, sdist


def _metadata_problems(text: str, want: str, where: str) -> list[str]:
    meta = Parser().parsestr(text)
    problems = []
    if meta["Name"] != PACKAGE or meta["Version"] != want:
        problems.append(f"{where}: metadata says {meta['Name']} {meta['Version']}")
    for requirement in meta.get_all("Requires-Dist") or []:
        name = re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower()
        if name in TOOLING_ONLY and "extra ==" not in requirement:
            problems.append(f"{where}: {requirement} is a runtime dependency")
    return problems


def wheel_problems(wheel: Path, want: str) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        tops = {name.split("/", 1)[0] for name in names}
        allowed = {PACKAGE, f"{PACKAGE}-{want}.dist-info"}
        problems = [f"{wheel.name}: unexpected top-level {t!r}" for t in sorted(tops - allowed)]
        if f"{PACKAGE}/__init__.py" not in names:
            problems.append(f"{wheel.name}: no {PACKAGE}/__init__.py")
        metadata = archive.read(f"{PACKAGE}-{want}.dist-info/METADATA").decode()
        entry_points = archive.read(f"{PACKAGE}-{want}.dist-info/entry_points.txt").decode()
    if "sqsinfer = sqsinfer.cli:main" not in entry_points:
        problems.append(f"{wheel.name}: no sqsinfer command")
    return problems + _metadata_problems(metadata, want, wheel.name)


def sdist_problems(sdist: Path, want: str) -> list[str]:
    base = f"{PACKAGE}-{want}"
    with tarfile.open(sdist) as archive:
        names = set(archive.getnames())
        pkg_info = archive.extractfile(f"{base}/PKG-INFO")
        text = pkg_info.read().decode() if pkg_info else ""
    problems = [
        f"{sdist.name}: no {path}"
        for path in ("pyproject.toml", "README.md", f"app/{PACKAGE}/__init__.py")
        if f"{base}/{path}" not in names
    ]
    return problems + _metadata_problems(text, want, sdist.name)


def _lint_problems(target: Path, what: str) -> list[str]:
    report = helm.lint(target, strict=True)
    found = [str(e) for e in report["errors"]]
    found += [m["error"] for m in report["messages"] if m["severity"] >= 2]
    return [f"{what}: {line}" for line in found]


def package_chart(out: Path, want: str) -> tuple[Path, list[str]]:
    """`helm package` of the chart, linted before and after."""
    problems = _lint_problems(CHART, "chart")
    archive = Path(helm.package(CHART, destination=out))
    problems += _lint_problems(archive, archive.name)
    with helm.Chart.load_archive(archive.read_bytes()) as loaded:
        if loaded.version != want:
            problems.append(f"{archive.name}: chart version {loaded.version}")
    return archive, problems


def hadolint_problems(root: Path = ROOT) -> list[str]:
    proc = subprocess.run(
        [_tool("hadolint"), "--config", str(root / ".hadolint.yaml"), str(root / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return [] if proc.returncode == 0 else [f"hadolint: {proc.stdout or proc.stderr}".strip()]


def docker_commands(want: str, image: str) -> str:
    """The image's build and push, run where a container engine is (from the repo root)."""
    tag = shlex.quote(f"{image}:{want}")
    return "\n".join(
        [
            "#!/bin/sh",
            f"# Build and push the sqsinfer {want} image; run from the repository's root.",
            "# Put the digest the push prints into the chart's image.digest.",
            "set -eu",
            f"docker build --pull --build-arg VERSION={shlex.quote(want)} -t {tag} .",
            f"docker push {tag}",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=ROOT / "dist")
    parser.add_argument("--image", default="sqsinfer", help="image repository (sqsinfer)")
    args = parser.parse_args(argv)
    helm.disable_logging()  # lint logs the chart's `fail` calls it ignores, as INFO lines
    want = version()
    problems = version_problems()
    out = args.out_dir
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    wheel, sdist = build_python(out)
    problems += wheel_problems(wheel, want) + sdist_problems(sdist, want)
    chart_archive, chart_problems = package_chart(out, want)
    problems += chart_problems + hadolint_problems()
    script = out / "docker-build.sh"
    script.write_text(docker_commands(want, args.image))
    script.chmod(0o755)
    for line in problems:
        print(f"release: {line}", file=sys.stderr)
    print(f"sqsinfer {want}: {wheel.name}, {sdist.name}, {chart_archive.name}, {script.name}")
    print(f"  in {out}; the image: sh {script}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
