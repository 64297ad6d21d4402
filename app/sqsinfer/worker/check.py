"""`sqsinfer worker --check-settings`: what start-up would run on, and nothing contacted.

The settings are read by start-up's own code (`config.settings_from_args`: flags, then
`SQSINFER_*` variables, then defaults and what is derived from them), AWS's
configuration by the function the clients are made from (`session.resolve_target`:
region, endpoints and CA bundle from the AWS variables and profile) and OpenTelemetry's
by the worker's own tracer factory. No client is made, so no credential provider runs
(an instance's metadata service, a web identity token exchange) and no queue, bucket,
model or collector is asked anything. A setting start-up would refuse is refused here
with the same `ConfigError`, naming it.

What start-up then checks by asking (the queues and buckets exist and answer, the
credentials, the model's download and sha256, /dev/shm's room) is not checked here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from sqsinfer import config
from sqsinfer.aws.endpoints import SERVICES, AwsTarget
from sqsinfer.aws.session import resolve_target
from sqsinfer.worker import pod_cost
from sqsinfer.worker.lifecycle import worker_tracer


@dataclass(frozen=True)
class Resolved:
    settings: config.Settings
    origins: dict[str, str]  # each setting's source (`config.origins`)
    aws: AwsTarget
    traces: bool  # whether spans would be exported
    kube: pod_cost.KubeTarget | None  # the pod whose deletion cost is kept (None: off)


def resolve(settings: config.Settings, origins: dict[str, str]) -> Resolved:
    """AWS's and OpenTelemetry's part of start-up's resolution, for `settings` (already
    loaded and validated). Raises a ConfigError naming a bad variable."""
    _, target = resolve_target(settings.region, settings.endpoint_url)
    tracer = worker_tracer(settings)
    tracer.shutdown(0.0)  # nothing was recorded: nothing to send
    return Resolved(settings, origins, target, tracer.enabled, pod_cost.target(settings))


def _text(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    if isinstance(value, bool):
        return str(value).lower()
    return "" if value is None else str(value)


def _endpoint(target: AwsTarget, service: str) -> tuple[str, str]:
    """The endpoint a service's client would get, and where it comes from."""
    source = target.endpoints_from.get(service, "")
    if target.endpoint_url:
        return target.endpoint_url, source
    value = os.environ.get(source, "") if source.startswith("AWS_ENDPOINT_URL") else ""
    return value or f"AWS's own for {target.region}", source


def report(found: Resolved) -> str:
    """The resolved values as `NAME=value  # source` lines: each setting as its variable,
    then AWS's part (what the SDK clients would be given) and tracing."""
    rows = [
        (config.env_name(name), _text(getattr(found.settings, name)), source)
        for name, source in found.origins.items()
    ]
    aws = found.aws
    rows.append(("region", aws.region, aws.region_from))
    for service in SERVICES:
        url, source = _endpoint(aws, service)
        rows.append((f"endpoint.{service}", url, source))
    rows.append(("ca_bundle", aws.ca_bundle or "the system's", aws.ca_bundle_from or "default"))
    rows.append(("traces", "exported" if found.traces else "off", "OTEL_* variables"))
    kube = found.kube
    pod = kube.pod_url if kube else "off"
    rows.append(("pod_deletion_cost", pod, "KUBERNETES_SERVICE_HOST, POD_NAME" if kube else ""))
    width = max(len(f"{name}={value}") for name, value, _ in rows)
    lines = ["# sqsinfer worker: the settings start-up would run on (nothing was contacted)"]
    lines += [f"{f'{name}={value}':<{width}}  # {source}" for name, value, source in rows]
    return "\n".join(lines)
