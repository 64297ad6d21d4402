"""Release artefacts: one version everywhere, and what scripts/release.py builds."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import helm_python as helm
import pytest
import yaml
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator

import sqsinfer
from scripts import release

ROOT = Path(__file__).resolve().parents[2]
VERSION = sqsinfer.__version__
IMAGE = "registry.example.com/ml/sqsinfer"
BASE = "python:3.11-slim-bookworm@sha256:" + "0123456789abcdef" * 4
ARGS = ["--image", IMAGE, "--base-image", BASE]


def test_one_version_everywhere() -> None:
    assert release.version() == VERSION
    chart = yaml.safe_load((ROOT / "helm" / "sqsinfer" / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == VERSION
    assert release.version_problems() == []


def _copy_of_the_version_sources(tmp_path: Path) -> Path:
    for path in (
        "app/sqsinfer/__init__.py",
        "helm/sqsinfer/Chart.yaml",
        "Dockerfile",
        "pyproject.toml",
        "CHANGELOG.md",
    ):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, tmp_path / path)
    return tmp_path


def test_a_version_said_differently_anywhere_is_found(tmp_path: Path) -> None:
    root = _copy_of_the_version_sources(tmp_path)
    init = root / "app" / "sqsinfer" / "__init__.py"
    init.write_text(init.read_text().replace(f'"{VERSION}"', '"9.8.7"'))
    problems = release.version_problems(root)
    assert release.version(root) == "9.8.7"
    assert problems == [
        f"helm/sqsinfer/Chart.yaml version is {VERSION}, not 9.8.7",
        f"helm/sqsinfer/Chart.yaml appVersion is {VERSION}, not 9.8.7",
        f"Dockerfile ARG VERSION is {VERSION}, not 9.8.7",
        "CHANGELOG.md has no '## 9.8.7' entry",
    ]


def test_the_changelog_says_what_is_stable() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    stable = text[text.index("## What is stable") : text.index(f"## {VERSION}")]
    for interface in ("task message", "output-key scheme", "Metric names", "Settings"):
        assert interface in stable, interface
    assert "### Upgrading from" in text[text.index(f"## {VERSION}") :]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    assert release.main(["--out-dir", str(out), *ARGS]) == 0
    return out


def test_the_wheel_holds_the_package_only(built: Path) -> None:
    (wheel,) = built.glob("*.whl")
    assert wheel.name == f"sqsinfer-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert {n.split("/", 1)[0] for n in names} == {"sqsinfer", f"sqsinfer-{VERSION}.dist-info"}
    assert "sqsinfer/worker/lifecycle.py" in names
    assert not [n for n in names if n.startswith(("app/", "tests/", "proving/"))]


def test_the_sdist_builds_the_same_package(built: Path) -> None:
    (sdist,) = built.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
    assert f"sqsinfer-{VERSION}/app/sqsinfer/worker/lifecycle.py" in names
    assert release.sdist_problems(sdist, VERSION) == []


def test_the_chart_package_installs_as_built(built: Path) -> None:
    (archive,) = built.glob("*.tgz")
    assert archive.name == f"sqsinfer-{VERSION}.tgz"
    with helm.Chart.load_archive(archive.read_bytes()) as chart:
        assert chart.metadata["appVersion"] == VERSION
        out = chart.render({"keda": {"enabled": False}}, name="stage1", namespace="x")
    (deployment,) = [text for path, text in out.items() if path.endswith("deployment.yaml")]
    image = yaml.safe_load(deployment)["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == f"sqsinfer:{VERSION}"
    with tarfile.open(archive) as packed:
        assert "sqsinfer/README.md" in packed.getnames()
        assert "sqsinfer/dashboards/sqsinfer-grafana.json" in packed.getnames()


def test_the_image_command_is_written(built: Path) -> None:
    script = built / "docker-build.sh"
    text = script.read_text()
    tag = f"{IMAGE}:{VERSION}"
    build = f"docker build --build-arg VERSION={VERSION} --build-arg PYTHON_IMAGE={BASE} -t {tag} ."
    assert build in text
    assert f"docker push {tag}" in text
    subprocess.run(["sh", "-n", str(script)], check=True)  # valid shell
    # the build argument it sets is the Dockerfile's base image
    assert re.search(r"^FROM \$\{PYTHON_IMAGE\}", (ROOT / "Dockerfile").read_text(), re.M)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "the image repository is required: --image REGISTRY/PATH (make release IMAGE=...)"),
        (["--image", "sqsinfer"], "Docker Hub's library namespace"),
        (["--image", "ml/sqsinfer"], "Docker Hub's library namespace"),
        (["--image", f"{IMAGE}:1.0"], "the repository only"),
        (["--image", IMAGE], "--base-image (make release BASE_IMAGE=...) must pin"),
        (["--image", IMAGE, "--base-image", "python:3.11-slim"], "by digest"),
        (["--image", IMAGE, "--base-image", "python@sha256:abc"], "NAME@sha256:<64 hex digits>"),
        ([*ARGS, "--chart-repo", "https://charts.example.com"], "must be oci://"),
    ],
)
def test_a_missing_or_bad_argument_is_a_usage_error(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        release.main(["--out-dir", str(tmp_path / "dist"), *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and message in err
    assert not (tmp_path / "dist").exists()  # nothing built


def test_registries_that_name_their_host() -> None:
    for image in (IMAGE, "localhost:5000/sqsinfer", "localhost/sqsinfer", "docker.io/me/s"):
        assert release.image_repository(image) == image
    assert release.chart_repository("", IMAGE) == "oci://registry.example.com/ml/charts"
    assert release.chart_repository("oci://r.example.com/c/", IMAGE) == "oci://r.example.com/c"


def test_the_chart_push_command_is_written(built: Path) -> None:
    script = built / "helm-push.sh"
    push = f"helm push sqsinfer-{VERSION}.tgz oci://registry.example.com/ml/charts"
    assert push in script.read_text().splitlines()
    subprocess.run(["sh", "-n", str(script)], check=True)


def test_a_chart_whose_versions_disagree_is_found(tmp_path: Path) -> None:
    chart = tmp_path / "chart"
    shutil.copytree(ROOT / "helm" / "sqsinfer", chart)
    meta = chart / "Chart.yaml"
    meta.write_text(meta.read_text().replace(f'appVersion: "{VERSION}"', 'appVersion: "9.9.9"'))
    original, release.CHART = release.CHART, chart
    try:
        _, problems = release.package_chart(tmp_path, VERSION)
    finally:
        release.CHART = original
    assert f"sqsinfer-{VERSION}.tgz: version {VERSION}, appVersion 9.9.9" in problems


def test_the_sbom_is_valid_cyclonedx_of_the_image_environment(built: Path) -> None:
    text = (built / "sbom.cdx.json").read_text()
    errors = JsonStrictValidator(SchemaVersion.V1_6).validate_str(text)
    assert errors is None, errors
    doc = json.loads(text)
    assert doc["bomFormat"] == "CycloneDX" and doc["specVersion"] == "1.6"
    root = doc["metadata"]["component"]
    assert (root["name"], root["version"]) == ("sqsinfer", VERSION)
    names = {c["name"].lower().replace("_", "-") for c in doc["components"]}
    # every runtime requirement of the wheel is there (uvloop: on Linux, as in the image)
    (wheel,) = built.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        meta = Parser().parsestr(archive.read(f"sqsinfer-{VERSION}.dist-info/METADATA").decode())
    required = {
        re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower()
        for r in meta.get_all("Requires-Dist") or []
        if "extra ==" not in r
    }
    assert required and required <= names, required - names
    assert not names & {"moto", "psutil", "pytest", "sqsinfer"}  # tooling; the root itself
    for component in doc["components"]:
        assert component["version"] and component["purl"].startswith("pkg:pypi/")


def test_checksums_cover_every_artefact(built: Path) -> None:
    sums = (built / "SHA256SUMS").read_text().splitlines()
    listed = {line.split("  ", 1)[1]: line.split("  ", 1)[0] for line in sums}
    artefacts = {p.name for p in built.iterdir() if not p.name.startswith(".")} - {"SHA256SUMS"}
    assert set(listed) == artefacts
    assert {
        "sbom.cdx.json",
        "docker-build.sh",
        "helm-push.sh",
        f"sqsinfer-{VERSION}.tgz",
    } <= artefacts
    for name, digest in listed.items():
        assert hashlib.sha256((built / name).read_bytes()).hexdigest() == digest
    subprocess.run(["sha256sum", "--check", "--quiet", "SHA256SUMS"], cwd=built, check=True)


def test_wheel_checks_find_a_stray_top_level_and_tooling_dependencies(tmp_path: Path) -> None:
    wheel = tmp_path / f"sqsinfer-{VERSION}-py3-none-any.whl"
    info = f"sqsinfer-{VERSION}.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("app/sqsinfer/__init__.py", "")
        archive.writestr("sqsinfer/__init__.py", "")
        archive.writestr(f"{info}/entry_points.txt", "[console_scripts]\n")
        archive.writestr(
            f"{info}/METADATA",
            f"Metadata-Version: 2.4\nName: sqsinfer\nVersion: {VERSION}\n"
            'Requires-Dist: psutil>=5.9\nRequires-Dist: moto>=5; extra == "local"\n',
        )
    assert release.wheel_problems(wheel, VERSION) == [
        f"{wheel.name}: unexpected top-level 'app'",
        f"{wheel.name}: no sqsinfer command",
        f"{wheel.name}: psutil>=5.9 is a runtime dependency",
    ]
