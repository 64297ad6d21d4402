"""The chart's README is generated from the values' comments and kept current."""

from __future__ import annotations

import json
from pathlib import Path

from scripts import chart_readme

CHART = Path(__file__).resolve().parents[2] / "helm" / "sqsinfer"

SAMPLE = """\
# A section comment, for readers of the file only.
# -- The image.
image:
  # -- Where it comes from,
  # over two lines.
  repository: sqsinfer
  pullPolicy: IfNotPresent

probes:
  # -- Startup budget.
  startup:
    periodSeconds: 5
    failureThreshold: 60
  liveness:
    periodSeconds: 10
# @default -- derived from the drain
# -- Seconds from SIGTERM to SIGKILL.
grace: null
args:
  - worker
"""
SCHEMA = {"properties": {"grace": {"type": ["integer", "null"]}, "image": {"type": "object"}}}


def test_the_chart_readme_is_current() -> None:
    assert (CHART / "README.md").read_text() == chart_readme.generate(), (
        "helm/sqsinfer/README.md is stale: make chart-readme"
    )
    assert chart_readme.main(["--check"]) == 0


def test_every_value_is_described() -> None:
    assert chart_readme.undocumented((CHART / "values.yaml").read_text()) == []


def test_every_knob_of_the_schema_is_in_the_readme() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    readme = (CHART / "README.md").read_text()
    for key in schema["properties"]:
        if key != "global":
            assert f"| `{key}" in readme, key


def test_rows_follow_the_helm_docs_convention() -> None:
    rows = {row.key: row for row in chart_readme.rows(SAMPLE, SCHEMA)}
    assert list(rows) == ["image", "image.repository", "probes.startup", "grace"]
    assert rows["image.repository"].description == "Where it comes from, over two lines."
    assert rows["image.repository"].default == '"sqsinfer"'
    assert rows["image"].type == "object"
    assert rows["probes.startup"].default == '{"periodSeconds": 5, "failureThreshold": 60}'
    assert rows["grace"].type == "integer or null"
    assert rows["grace"].default == "derived from the drain"
    assert "section comment" not in " ".join(r.description for r in rows.values())


def test_undocumented_values_are_named() -> None:
    missing = chart_readme.undocumented(SAMPLE)
    assert missing == ["probes.liveness.periodSeconds", "args"]


def test_a_stale_readme_is_found(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(chart_readme, "CHART", tmp_path)
    for name in ("values.yaml", "values.schema.json", "Chart.yaml"):
        (tmp_path / name).write_text((CHART / name).read_text())
    (tmp_path / "README.md").write_text("# old\n")
    assert chart_readme.main(["--check"]) == 1
    assert chart_readme.main([]) == 0
    assert chart_readme.main(["--check"]) == 0
