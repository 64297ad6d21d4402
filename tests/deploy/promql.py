"""PromQL read by Prometheus's own grammar (promql-parser), for the dashboard and the alerts.

Both must ask only for series that exist, with labels those series carry: the worker's own
metrics (taken from a live `Metrics` registry, never from a list written here), the
labels Prometheus adds to every target, and the few series of other exporters the chart's
users have next to the worker (cAdvisor through the kubelet, KEDA's operator).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import promql_parser
from prometheus_client.parser import text_string_to_metric_families

from sqsinfer.metrics import Metrics

# Added by Prometheus to every scraped series (job, instance), by the Prometheus Operator's
# ServiceMonitor (namespace, pod, container, service, endpoint), and a histogram's own `le`.
TARGET_LABELS = frozenset(
    {"job", "instance", "namespace", "pod", "container", "service", "endpoint", "le"}
)
# Series of other exporters, with the labels used from them.
EXTERNAL: dict[str, frozenset[str]] = {
    # cAdvisor (kubelet /metrics/cadvisor): per container of every pod.
    "container_cpu_usage_seconds_total": frozenset({"namespace", "pod", "container"}),
    "container_memory_working_set_bytes": frozenset({"namespace", "pod", "container"}),
    # KEDA's operator: the value of each ScaledObject's trigger (the queue depth here).
    "keda_scaler_metrics_value": frozenset(
        {"scaledObject", "scaler", "metric", "type", "exported_namespace", "triggerIndex"}
    ),
}
# Grafana's variables, replaced by values of the right kind before parsing.
_GRAFANA_RANGES = re.compile(r"\$__(rate_interval|interval|range)\b")


@dataclass(frozen=True)
class Selector:
    name: str
    labels: frozenset[str]  # label names of its matchers


def exposed_metrics() -> dict[str, frozenset[str]]:
    """Every series name a worker can expose today, with its label names."""
    metrics = Metrics()
    metrics.child_rss.pids = lambda: {0: os.getpid()}  # a sample, as with a pool running
    metrics.outcome("committed", 1.0)
    metrics.rejections.labels("malformed_json").inc()
    metrics.aws_errors.labels("ReceiveMessage").inc()
    metrics.queue_depth("dead_letter", {"visible": 1, "in_flight": 0, "delayed": 0})
    metrics.pod_deletion_cost.labels("pod-0").set(0)  # as once pod_deletion_cost has set it
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return {name: frozenset(found) for name, found in labels.items()}


def known_series() -> dict[str, frozenset[str]]:
    """What an expression may ask for: exposed by the worker, or another exporter's."""
    return {**EXTERNAL, **exposed_metrics()}


def parse(expr: str) -> Any:
    """The expression's syntax tree; Grafana's range variables become 5m first."""
    return promql_parser.parse(_GRAFANA_RANGES.sub("5m", expr))


def _children(node: Any) -> list[Any]:
    out: list[Any] = []
    for attr in ("lhs", "rhs", "expr", "param", "vector_selector"):
        child = getattr(node, attr, None)
        if child is not None and not isinstance(child, (str, int, float)):
            out.append(child)
    out += list(getattr(node, "args", None) or [])
    return out


def nodes(tree: Any) -> list[Any]:
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        found.append(node)
        todo += _children(node)
    return found


def selectors(expr: str) -> list[Selector]:
    """Every series selector of an expression."""
    out = []
    for node in nodes(parse(expr)):
        if isinstance(node, promql_parser.VectorSelector):
            names = frozenset(m.name for m in node.matchers.matchers)
            out.append(Selector(node.name or "", names - {"__name__"}))
    return out


def grouping_labels(expr: str) -> set[str]:
    """Labels of `by (...)`, `without (...)`, `on (...)` and `ignoring (...)`."""
    labels: set[str] = set()
    for node in nodes(parse(expr)):
        modifier = getattr(node, "modifier", None)
        for attr in ("labels", "matching"):
            value = getattr(modifier, attr, None)
            value = getattr(value, "labels", value)
            if isinstance(value, list):
                labels.update(value)
    return labels


def unknown(expr: str, series: dict[str, frozenset[str]] | None = None) -> list[str]:
    """What an expression asks for that does not exist: series, or labels they lack."""
    series = known_series() if series is None else series
    problems = []
    found = selectors(expr)
    if not found:
        problems.append("no series selector")
    allowed = set(TARGET_LABELS)
    for sel in found:
        if sel.name not in series:
            problems.append(f"unknown series {sel.name}")
            continue
        allowed |= series[sel.name]
        if not sel.labels <= TARGET_LABELS | series[sel.name]:
            problems.append(f"{sel.name} has no label {sorted(sel.labels - series[sel.name])}")
    if not grouping_labels(expr) <= allowed:
        problems.append(f"grouping by absent labels {sorted(grouping_labels(expr) - allowed)}")
    return problems
