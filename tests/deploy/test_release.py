"""Release artefacts: one version everywhere, and what scripts/release.py builds."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import helm_python as helm
import pytest
import yaml

import sqsinfer
from scripts import release

ROOT = Path(__file__).resolve().parents[2]
VERSION = sqsinfer.__version__


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
    assert release.main(["--out-dir", str(out), "--image", "registry.example.com/ml/sqsinfer"]) == 0
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


def test_the_image_command_is_written(built: Path) -> None:
    script = built / "docker-build.sh"
    text = script.read_text()
    tag = f"registry.example.com/ml/sqsinfer:{VERSION}"
    assert f"docker build --pull --build-arg VERSION={VERSION} -t {tag} ." in text
    assert f"docker push {tag}" in text
    subprocess.run(["sh", "-n", str(script)], check=True)  # valid shell


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
