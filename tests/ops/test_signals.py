"""Signals people use: the JSON log line of each outcome, every metric after a run, and a
Grafana dashboard that asks only for metrics and labels the worker exposes."""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import re
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sqsinfer import __version__
from sqsinfer.lab import synthetic
from sqsinfer.logs import JsonFormatter
from sqsinfer.metrics import Metrics, Phase
from sqsinfer.outcomes import Outcome
from tests.conftest import N_FEATURES, Stage, eventually, running
from tests.deploy import promql

DASHBOARD = (
    pathlib.Path(__file__).parents[2] / "helm" / "sqsinfer" / "dashboards" / "sqsinfer-grafana.json"
)


class Captured(logging.Handler):
    """The worker's log lines exactly as the JSON formatter writes them."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def docs(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.lines]


@pytest.fixture
def captured():
    handler = Captured()
    logger = logging.getLogger("sqsinfer")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def _three_outcomes(stage: Stage) -> None:
    """A committed task, a duplicate (its output exists) and a rejected message."""
    rows = synthetic.make_rows(4, N_FEATURES, seed=5)
    uri = stage.put_input("s.npy", synthetic.encode_input(rows, "npy"))
    stage.s3.put_object(
        Bucket=stage.bucket, Key="out/dup.npy", Body=b"earlier", Metadata={"task-id": "dup"}
    )
    stage.s3.put_object(Bucket=stage.bucket, Key="out/dup.npy.chain", Body=b"{}")  # linked
    stage.send({"task_id": "fresh", "input": uri})
    stage.send({"task_id": "dup", "input": uri})
    stage.send("{not json")


async def test_log_line_schema(stage: Stage, make_settings, captured: Captured):
    _three_outcomes(stage)
    async with running(make_settings(next_queue_url=stage.next_url)) as worker:
        await eventually(lambda: sum(worker.metrics.outcomes.values()) == 3)
        seen = len(captured.lines)
        await asyncio.sleep(2.2)  # two idle long polls (wait 1 s): nothing per poll at INFO
        idle = captured.lines[seen:]
    assert idle == []
    docs = captured.docs()
    for doc in docs:
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", doc["ts"])
        assert doc["level"] in ("debug", "info", "warning", "error")
        assert doc["logger"].startswith("sqsinfer")
        assert isinstance(doc["msg"], str)
    finished = {d["outcome"]: d for d in docs if d["msg"] == "task finished"}
    assert set(finished) == {"committed", "duplicate", "rejected"}
    for outcome, doc in finished.items():
        assert outcome in set(Outcome)
        assert isinstance(doc["message_id"], str) and doc["message_id"]
        assert doc["receive_count"] == 1
        assert isinstance(doc["seconds"], float) and doc["seconds"] >= 0
        assert isinstance(doc["phases"], dict)
        assert all(p in set(Phase) and isinstance(s, float) for p, s in doc["phases"].items())
    assert finished["committed"]["task_id"] == "fresh"
    assert {"s3_get", "wait_process", "decode", "infer", "commit", "chain"} <= set(
        finished["committed"]["phases"]
    )
    assert finished["duplicate"]["task_id"] == "dup"
    assert finished["rejected"]["task_id"] is None  # the body never parsed
    assert finished["rejected"]["reason"] == "malformed_json"
    lifecycle = [d["msg"] for d in docs if d["msg"] != "task finished"]
    for msg in ("ready", "draining", "stopped"):
        assert msg in lifecycle
    assert "in_flight_limit" in next(d for d in docs if d["msg"] == "ready")
    assert "releasing" in next(d for d in docs if d["msg"] == "draining")


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


async def test_every_metric_is_exposed_after_a_run(stage: Stage, make_settings):
    _three_outcomes(stage)
    async with running(make_settings(next_queue_url=stage.next_url)) as worker:
        await eventually(lambda: sum(worker.metrics.outcomes.values()) == 3)
        url = f"http://127.0.0.1:{worker.health.port}/metrics"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            assert response.status == 200
            text = await response.text()
    scraped = _families(text)
    declared = _families(Metrics().render().decode())
    for name, family in declared.items():
        assert name in scraped, f"{name} missing from /metrics"
        assert scraped[name].type == family.type

    def value(name: str, **labels: str) -> float:
        for family in scraped.values():
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
        raise AssertionError(f"no sample {name} {labels}")

    for outcome in ("committed", "duplicate", "rejected"):
        assert value("sqsinfer_tasks_total", outcome=outcome) == 1
        assert value("sqsinfer_task_seconds_count", outcome=outcome) == 1
    assert value("sqsinfer_tasks_total", outcome="retried") == 0  # shown before it happens
    assert value("sqsinfer_rejections_total", reason="malformed_json") == 1
    for phase in Phase:
        assert value("sqsinfer_phase_seconds_count", phase=phase) >= 1, phase
    # 4 rows each: the duplicate's first delivery computes too (its conditional put finds
    # the output; a HEAD first is for redeliveries).
    assert value("sqsinfer_rows_total") == 8
    assert value("sqsinfer_process_busy_seconds_total") > 0
    assert value("sqsinfer_in_flight") == 0
    assert value("sqsinfer_processes_ready") == 1
    for counter in (
        "pool_rebuilds",
        "visibility_extensions",
        "chain_duplicates",
        "other_model_outputs",
    ):
        assert value(f"sqsinfer_{counter}_total") == 0
    # What a platform team reads: the process, each child, what runs, utilisation, errors.
    assert value("process_resident_memory_bytes") > 10e6
    assert value("process_open_fds") > 0
    assert value("python_info") == 1
    assert value("sqsinfer_child_rss_bytes", slot="0") > 10e6
    assert (
        value("sqsinfer_info", version=__version__, model_sha256=worker.pool.config.model_sha256)
        == 1
    )
    assert value("sqsinfer_in_flight_limit") == worker.limit.value  # auto: where it went
    assert value("sqsinfer_aws_requests_total", operation="ReceiveMessage") >= 1
    assert value("sqsinfer_aws_requests_total", operation="PutObject") >= 1
    assert value("sqsinfer_aws_errors_total", operation="PutObject") == 0
    assert value("sqsinfer_rejections_total", reason="output_conflict") == 0  # shown at 0
    assert "_created" not in text


# -- the dashboard --------------------------------------------------------------------
def _panel_exprs(doc: dict[str, Any]) -> list[str]:
    exprs = []
    for panel in doc["panels"]:
        exprs += [t["expr"] for t in panel.get("targets", [])]
        for inner in panel.get("panels", []):
            exprs += [t["expr"] for t in inner.get("targets", [])]
    return exprs


def _dashboard_exprs(doc: dict[str, Any]) -> list[str]:
    variables = [v["definition"] for v in doc["templating"]["list"] if "definition" in v]
    return _panel_exprs(doc) + variables


def _query(expr: str) -> str:
    """A variable's label_values(selector, label) query reduced to its selector."""
    found = re.fullmatch(r"label_values\((.*), *[a-z_]+\)", expr)
    return found.group(1) if found else expr


def test_dashboard_uses_only_exposed_metrics_and_labels():
    doc = json.loads(DASHBOARD.read_text())
    exprs = _dashboard_exprs(doc)
    assert len(exprs) >= 20
    problems = {expr: promql.unknown(_query(expr)) for expr in exprs}
    assert {e: p for e, p in problems.items() if p} == {}
    used = {s.name for expr in exprs for s in promql.selectors(_query(expr))}
    # every metric family of the worker has a panel (the client library's standard process
    # and platform series are there to be queried, not each charted)
    names = {n for n in promql.exposed_metrics() if not n.startswith(("process_", "python_"))}
    families = {re.sub(r"_(total|bucket|count|sum|created)$", "", n) for n in names}
    assert families <= {re.sub(r"_(total|bucket|count|sum)$", "", n) for n in used}
    # resources and KEDA's view of the queue, next to the worker's own figures
    assert {"container_cpu_usage_seconds_total", "container_memory_working_set_bytes"} <= used
    assert "keda_scaler_metrics_value" in used


def test_dashboard_links_slow_tasks_to_their_traces():
    """A panel of the task-duration histogram asks for its exemplars (each a trace id)."""
    doc = json.loads(DASHBOARD.read_text())
    with_exemplars = [
        target["expr"]
        for panel in doc["panels"]
        for target in panel.get("targets", [])
        if target.get("exemplar")
    ]
    assert any("sqsinfer_task_seconds_bucket" in expr for expr in with_exemplars)


def test_dashboard_filters_by_namespace_and_job():
    doc = json.loads(DASHBOARD.read_text())
    for expr in _panel_exprs(doc):
        for selector in promql.selectors(expr):
            if selector.name == "keda_scaler_metrics_value":
                # found by its ScaledObject, named like the job (the chart's full name)
                assert 'scaledObject=~"$job"' in expr
            else:
                assert "namespace" in selector.labels, expr


def test_the_promql_check_finds_what_is_wrong():
    assert promql.unknown('sum(rate(sqsinfer_taks_total{job="x"}[5m]))')
    assert promql.unknown("sum by (phase) (rate(sqsinfer_tasks_total[5m]))")  # no phase label
    assert promql.unknown('rate(sqsinfer_tasks_total{reason="x"}[5m])')
    assert promql.unknown("sum by (le) (rate(sqsinfer_rows_total[$__rate_interval]))") == []
    with pytest.raises(ValueError):
        promql.parse("sum(rate(sqsinfer_rows_total[5m])")


def test_dashboard_is_importable():
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] == "sqsinfer" and doc["schemaVersion"] >= 36
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    variables = [v["name"] for v in doc["templating"]["list"]]
    assert variables == ["datasource", "namespace", "job", "instance"]
    for panel in doc["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"
