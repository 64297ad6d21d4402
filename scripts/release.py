"""Build and check the release artefacts of one version.

    python scripts/release.py --image REGISTRY/PATH --base-image NAME@sha256:DIGEST
        [--chart-repo oci://REGISTRY/PATH] [--out-dir dist]
    make release IMAGE=... BASE_IMAGE=... [CHART_REPO=...]

The version is `sqsinfer.__version__` (app/sqsinfer/__init__.py); pyproject reads it, and
the chart's version and appVersion, the Dockerfile's VERSION and a CHANGELOG entry must
say the same. Then, into the output folder:

- the wheel and the sdist (`uv build`), checked: the wheel holds `sqsinfer/` and its
  dist-info only, the metadata carries the version and no tooling dependency;
- the chart package (Helm's own `package`), linted as a folder and as an archive;
- `docker-build.sh`, the command that builds and pushes the image (no container engine
  is needed here: the Dockerfile is linted with hadolint instead), on the base image
  pinned by digest (`--base-image`, the build argument PYTHON_IMAGE);
- `sbom.cdx.json`, a CycloneDX SBOM of the image's Python environment: the wheel and its
  runtime dependencies installed into a fresh venv of the image's Python, as the
  image's build resolves them today, described by `cyclonedx-py environment`;
- `helm-push.sh`, the chart's push to an OCI registry (`--chart-repo`, by default the
  image registry's `charts` folder beside the image);
- `SHA256SUMS` of every artefact above (`sha256sum -c SHA256SUMS` checks them).

There is no default registry: a bare image name would go to Docker Hub's library
namespace, so the image (with its registry host) must be named. It exits 2 on a missing
or bad argument and 1 naming every problem found.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
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
# The image's Python (the Dockerfile's PYTHON_IMAGE is python:3.11-...).
IMAGE_PYTHON = "3.11"
SBOM = "sbom.cdx.json"
SUMS = "SHA256SUMS"
_DIGEST_REF = re.compile(r"^[a-z0-9][a-z0-9._/:-]*@sha256:[0-9a-f]{64}$")
_SEMVER = re.compile(r"^\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?$")


class UsageError(Exception):
    """A missing or bad argument; the message names the flag and the make variable."""


def image_repository(image: str) -> str:
    """The image repository to push to; it must name its registry (Docker's own rule: a
    first component with a dot or a port, or localhost), or the push goes to Docker Hub."""
    if not image:
        raise UsageError(
            "the image repository is required: --image REGISTRY/PATH "
            "(make release IMAGE=...), e.g. 123456789012.dkr.ecr.eu-west-1.amazonaws.com/sqsinfer"
        )
    first, _, rest = image.partition("/")
    if not rest or not ("." in first or ":" in first or first == "localhost"):
        raise UsageError(
            f"--image (IMAGE) {image!r} names no registry, so docker push would send it to "
            "Docker Hub's library namespace: give REGISTRY/PATH, "
            "e.g. registry.example.com/ml/sqsinfer"
        )
    if ":" in rest or "@" in rest:
        raise UsageError(f"--image (IMAGE) {image!r}: the repository only; the tag is the version")
    return image


def base_image(ref: str) -> str:
    """The base image pinned by digest (name@sha256:...): a tag can be pushed again."""
    if not _DIGEST_REF.fullmatch(ref):
        raise UsageError(
            f"--base-image (make release BASE_IMAGE=...) must pin the base image by digest, "
            f"NAME@sha256:<64 hex digits>, not {ref!r}; e.g. find it with "
            "`docker buildx imagetools inspect python:3.11-slim-bookworm`"
        )
    return ref


def chart_repository(repo: str, image: str) -> str:
    """The OCI repository `helm push` sends the chart to (default: beside the image)."""
    if not repo:
        return "oci://" + image.rsplit("/", 1)[0] + "/charts"
    if not repo.startswith("oci://") or repo.rstrip("/") == "oci:":
        raise UsageError(f"--chart-repo (CHART_REPO) must be oci://REGISTRY/PATH, not {repo!r}")
    return repo.rstrip("/")


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
        app_version = str(loaded.metadata.get("appVersion", ""))
        if loaded.version != want or app_version != want:
            problems.append(f"{archive.name}: version {loaded.version}, appVersion {app_version}")
    if not _SEMVER.fullmatch(want):  # an OCI registry takes the chart's version as its tag
        problems.append(f"chart version {want} is not SemVer 2")
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


def docker_commands(want: str, image: str, base: str) -> str:
    """The image's build and push, run where a container engine is (from the repo root)."""
    tag = shlex.quote(f"{image}:{want}")
    return "\n".join(
        [
            "#!/bin/sh",
            f"# Build and push the sqsinfer {want} image; run from the repository's root.",
            "# The base image is pinned by digest; put the digest the push prints into the",
            "# chart's image.digest.",
            "set -eu",
            f"docker build --build-arg VERSION={shlex.quote(want)} "
            f"--build-arg PYTHON_IMAGE={shlex.quote(base)} -t {tag} .",
            f"docker push {tag}",
            "",
        ]
    )


def helm_push_command(chart_archive: Path, repo: str) -> str:
    return f"helm push {shlex.quote(chart_archive.name)} {shlex.quote(repo)}"


def helm_commands(chart_archive: Path, repo: str) -> str:
    return "\n".join(
        [
            "#!/bin/sh",
            "# Push the chart to its OCI registry; run from this folder, after `helm registry",
            "# login` (for ECR: aws ecr get-login-password | helm registry login --username",
            "# AWS --password-stdin REGISTRY).",
            "set -eu",
            helm_push_command(chart_archive, repo),
            "",
        ]
    )


def image_environment(wheel: Path, work: Path) -> Path:
    """The wheel and its runtime dependencies in a fresh venv of the image's Python, as
    the image's `pip install` resolves them; the venv's interpreter."""
    venv = work / "image-venv"
    subprocess.run(
        [_tool("uv"), "venv", "--quiet", "--python", IMAGE_PYTHON, str(venv)],
        check=True,
        timeout=300,
    )
    python = venv / "bin" / "python"
    subprocess.run(
        [_tool("uv"), "pip", "install", "--quiet", "--python", str(python), str(wheel)],
        check=True,
        timeout=900,
    )
    return python


def write_sbom(python: Path, path: Path, want: str, root: Path = ROOT) -> None:
    """A CycloneDX 1.6 SBOM (JSON) of what is installed for `python`, sqsinfer the root.

    The root component comes from pyproject.toml, whose version is dynamic (read from
    `sqsinfer.__version__`): the release's version is written in.
    """
    subprocess.run(
        [
            _tool("cyclonedx-py"),
            "environment",
            "--pyproject",
            str(root / "pyproject.toml"),
            "--mc-type",
            "application",
            "--spec-version",
            "1.6",
            "--output-format",
            "JSON",
            "--output-reproducible",
            "--output-file",
            str(path),
            str(python),
        ],
        check=True,
        timeout=300,
    )
    doc = json.loads(path.read_text())
    root_component = doc["metadata"]["component"]
    root_component["version"] = want
    root_component["purl"] = f"pkg:pypi/{PACKAGE}@{want}"
    path.write_text(json.dumps(doc, indent=2) + "\n")


def write_checksums(out: Path) -> Path:
    """SHA256SUMS of every file in `out`, in `sha256sum`'s format."""
    lines = [
        f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}"
        for path in sorted(out.iterdir())
        if path.is_file() and path.name != SUMS and not path.name.startswith(".")
    ]
    sums = out / SUMS
    sums.write_text("\n".join(lines) + "\n")
    return sums


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=ROOT / "dist")
    parser.add_argument("--image", default="", help="image repository, with its registry")
    parser.add_argument("--base-image", default="", help="base image as NAME@sha256:DIGEST")
    parser.add_argument("--chart-repo", default="", help="oci://REGISTRY/PATH for the chart")
    args = parser.parse_args(argv)
    try:
        args.image = image_repository(args.image)
        args.base_image = base_image(args.base_image)
        args.chart_repo = chart_repository(args.chart_repo, args.image)
    except UsageError as exc:
        parser.error(str(exc))  # exits 2 with the usage line
    return args


def build(out: Path, args: argparse.Namespace, want: str) -> tuple[list[Path], list[str]]:
    """Every artefact into `out` (emptied first), and the problems found on the way."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    wheel, sdist = build_python(out)
    problems = wheel_problems(wheel, want) + sdist_problems(sdist, want)
    chart_archive, chart_problems = package_chart(out, want)
    problems += chart_problems + hadolint_problems()
    docker = out / "docker-build.sh"
    docker.write_text(docker_commands(want, args.image, args.base_image))
    helm_push = out / "helm-push.sh"
    helm_push.write_text(helm_commands(chart_archive, args.chart_repo))
    for script in (docker, helm_push):
        script.chmod(0o755)
    with tempfile.TemporaryDirectory(prefix="sqsinfer-release-") as work:
        write_sbom(image_environment(wheel, Path(work)), out / SBOM, want)
    return [wheel, sdist, chart_archive, out / SBOM, docker, helm_push], problems


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    helm.disable_logging()  # lint logs the chart's `fail` calls it ignores, as INFO lines
    want = version()
    artefacts, problems = build(args.out_dir, args, want)
    problems = version_problems() + problems
    sums = write_checksums(args.out_dir)
    for line in problems:
        print(f"release: {line}", file=sys.stderr)
    print(f"sqsinfer {want}: {', '.join(p.name for p in [*artefacts, sums])}")
    print(f"  in {args.out_dir}; the image: sh docker-build.sh; the chart:")
    print(f"  {helm_push_command(artefacts[2], args.chart_repo)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
