"""Rendering the Helm chart with Helm's own template engine (no helm binary, no cluster).

`helm_python` binds Helm's Go SDK, so rendering, `fail` and `values.schema.json` behave
exactly as `helm install` would. Shared by the chart's tests and the image lane, which
runs the rendered Deployments under a container engine.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml
from helm_python import _native

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "sqsinfer"
NAMESPACE = "inference"
# The custom resources a cluster with KEDA and the Prometheus Operator serves; the chart
# checks for them (.Capabilities.APIVersions) before it renders their objects.
KEDA_API = "keda.sh/v1alpha1/ScaledObject"
KEDA_JOB_API = "keda.sh/v1alpha1/ScaledJob"  # keda.mode job
MONITORING_APIS = (
    "monitoring.coreos.com/v1/ServiceMonitor",
    "monitoring.coreos.com/v1/PrometheusRule",
)
CLUSTER_APIS = (KEDA_API, KEDA_JOB_API, *MONITORING_APIS)


@dataclasses.dataclass
class Rendered:
    docs: list[dict[str, Any]]
    notes: str

    def kinds(self) -> set[str]:
        return {d["kind"] for d in self.docs}

    def one(self, kind: str) -> dict[str, Any]:
        (doc,) = [d for d in self.docs if d["kind"] == kind]
        return doc

    def container(self) -> dict[str, Any]:
        (container,) = self.one("Deployment")["spec"]["template"]["spec"]["containers"]
        return container

    def env(self) -> dict[str, str]:
        return {e["name"]: e["value"] for e in self.container()["env"] if "value" in e}


def render(
    chart: helm.Chart,
    values: dict[str, Any] | None = None,
    name: str = "stage1",
    api_versions: tuple[str, ...] = CLUSTER_APIS,
) -> Rendered:
    """Render as `helm template --api-versions ...` does, for a cluster serving `api_versions`.

    `Chart.render` does not take API versions (helm-python-sdk 0.2), but the engine it calls
    does: its options are the same JSON object with `api_versions` added.
    """
    options = {"name": name, "namespace": NAMESPACE, "api_versions": list(api_versions)}
    raw = _native.call_string(
        "helm_render",
        chart._raw(),
        None if values is None else json.dumps(values),
        json.dumps(options),
    )
    out: dict[str, str] = json.loads(raw)
    docs = [
        doc
        for path, text in sorted(out.items())
        if path.endswith((".yaml", ".yml"))
        for doc in yaml.safe_load_all(text)
        if doc
    ]
    notes = "".join(text for path, text in out.items() if path.endswith("NOTES.txt"))
    return Rendered(docs, notes)
