"""The Helm chart, rendered by Helm's own template engine (no helm binary, no cluster).

`helm_python` binds Helm's Go SDK, so rendering, `fail`, `values.schema.json` and lint
behave exactly as `helm install` would. Every rendered manifest is validated against the
Kubernetes JSON schemas that `kubernetes_validate` ships. The worker's settings are read
from `sqsinfer.config`, so the chart and the worker cannot drift apart unnoticed.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from sqsinfer import config
from sqsinfer.config import ENV_NAMES, ENV_PREFIX, Settings
from sqsinfer.worker.health import HealthServer
from tests.deploy import promql
from tests.deploy.chart import (
    CHART,
    KEDA_API,
    MONITORING_APIS,
    NAMESPACE,
    ROOT,
    Rendered,
    render,
)

EXAMPLES = ROOT / "helm" / "examples"
STAGES = ("stage1", "stage2")
# The chart's kubeVersion floor and the newest schemas kubernetes_validate ships.
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())
BASE_KINDS = {
    "Deployment",
    "ServiceAccount",
    "Service",
    "PodDisruptionBudget",
    "ScaledObject",
    "TriggerAuthentication",
}
SETTING_NAMES = {f.name for f in dataclasses.fields(Settings)}
MiB = 1 << 20
EXIT_MARGIN_S = 5  # what the chart adds to the worker's shutdown budget for process exit

# -- Custom resources -------------------------------------------------------------------
# ScaledObject, TriggerAuthentication (KEDA) and ServiceMonitor (Prometheus Operator) are
# not in the Kubernetes schemas, so they are checked against these minimal schemas of
# the fields the chart sets, written from the KEDA and Prometheus Operator CRDs.
_META = {"type": "object", "required": ["name", "labels"]}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_SQS_METADATA = {
    "type": "object",
    "required": ["queueURL", "queueLength", "awsRegion"],
    "properties": {
        "queueLength": {"type": "string", "pattern": "^[1-9][0-9]*$"},
        "activationQueueLength": {"type": "string", "pattern": "^[0-9]+$"},
        "scaleOnInFlight": {"enum": ["true", "false"]},
        "scaleOnDelayed": {"enum": ["true", "false"]},
    },
    "additionalProperties": {"type": "string"},  # KEDA trigger metadata is map[string]string
}
_CLOUDWATCH_METADATA = {  # the aws-cloudwatch scaler on the queue's oldest message
    "type": "object",
    "required": ["namespace", "metricName", "dimensionName", "dimensionValue", "awsRegion"],
    "properties": {
        "namespace": {"const": "AWS/SQS"},
        "metricName": {"const": "ApproximateAgeOfOldestMessage"},
        "dimensionName": {"const": "QueueName"},
        "dimensionValue": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,80}$"},
        "metricStat": {"enum": ["Maximum", "Average", "Minimum", "Sum", "SampleCount"]},
        "targetMetricValue": {"type": "string", "pattern": "^[1-9][0-9]*$"},
        "activationTargetMetricValue": {"type": "string", "pattern": "^[0-9]+$"},
    },
    "additionalProperties": {"type": "string"},
}
_TRIGGERS = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "required": ["type", "metadata"],
        "properties": {
            "type": {"enum": ["aws-sqs-queue", "aws-cloudwatch"]},
            "authenticationRef": {"type": "object", "required": ["name"]},
        },
        "oneOf": [
            {
                "properties": {
                    "type": {"const": "aws-sqs-queue"},
                    "metadata": _SQS_METADATA,
                }
            },
            {
                "properties": {
                    "type": {"const": "aws-cloudwatch"},
                    "metadata": _CLOUDWATCH_METADATA,
                }
            },
        ],
    },
}
_SCALING = {  # what a ScaledObject and a ScaledJob share
    "pollingInterval": {"type": "integer", "minimum": 1},
    "minReplicaCount": {"type": "integer", "minimum": 0},
    "maxReplicaCount": {"type": "integer", "minimum": 1},
    "triggers": _TRIGGERS,
}
_HPA_RULES = {  # autoscaling/v2 HPAScalingRules
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "stabilizationWindowSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
        "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
        "policies": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "value", "periodSeconds"],
                "additionalProperties": False,
                "properties": {
                    "type": {"enum": ["Pods", "Percent"]},
                    "value": {"type": "integer", "minimum": 1},
                    "periodSeconds": {"type": "integer", "minimum": 1, "maximum": 1800},
                },
            },
        },
    },
}
_HPA_BEHAVIOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"scaleUp": _HPA_RULES, "scaleDown": _HPA_RULES},
}
_ALERT_RULE = {
    "type": "object",
    "required": ["alert", "expr"],
    "additionalProperties": False,
    "properties": {
        "alert": {"type": "string", "pattern": "^[A-Za-z]+$"},
        "expr": {"type": "string"},
        "for": {"type": "string", "pattern": "^[0-9]+[smhdwy]$"},
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
    },
}
CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("keda.sh/v1alpha1", "ScaledObject"): {
        "type": "object",
        "required": ["metadata", "spec"],
        "properties": {
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["scaleTargetRef", "triggers", "minReplicaCount", "maxReplicaCount"],
                "additionalProperties": False,
                "properties": {
                    "scaleTargetRef": {"type": "object", "required": ["name"]},
                    "fallback": {
                        "type": "object",
                        "required": ["failureThreshold", "replicas"],
                        "additionalProperties": False,
                        "properties": {
                            "failureThreshold": {"type": "integer", "minimum": 1},
                            "replicas": {"type": "integer", "minimum": 0},
                            "behavior": {"type": "string"},
                        },
                    },
                    **_SCALING,
                    "cooldownPeriod": {"type": "integer", "minimum": 0},
                    "advanced": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "horizontalPodAutoscalerConfig": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {"behavior": _HPA_BEHAVIOR},
                            }
                        },
                    },
                },
            },
        },
    },
    ("keda.sh/v1alpha1", "ScaledJob"): {  # jobTargetRef: a batch/v1 JobSpec, checked as one
        "type": "object",
        "required": ["metadata", "spec"],
        "properties": {
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["jobTargetRef", "triggers"],
                "additionalProperties": False,
                "properties": {
                    **_SCALING,
                    "jobTargetRef": {"type": "object", "required": ["template"]},
                    "successfulJobsHistoryLimit": {"type": "integer", "minimum": 0},
                    "failedJobsHistoryLimit": {"type": "integer", "minimum": 0},
                    "rollout": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "strategy": {"enum": ["default", "gradual"]},
                            "propagationPolicy": {"enum": ["background", "foreground"]},
                        },
                    },
                    "scalingStrategy": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "strategy": {"enum": ["default", "custom", "accurate", "eager"]},
                            "multipleScalersCalculation": {"enum": ["max", "min", "avg", "sum"]},
                        },
                    },
                },
            },
        },
    },
    ("keda.sh/v1alpha1", "TriggerAuthentication"): {
        "type": "object",
        "required": ["metadata", "spec"],
        "properties": {
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["podIdentity"],
                "properties": {
                    "podIdentity": {
                        "type": "object",
                        "required": ["provider"],
                        "additionalProperties": False,
                        "properties": {
                            "provider": {"const": "aws"},
                            "identityOwner": {"enum": ["keda", "workload"]},
                            "roleArn": {"type": "string", "minLength": 1},
                        },
                        "not": {"required": ["identityOwner", "roleArn"]},  # mutually exclusive
                    }
                },
            },
        },
    },
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object",
        "required": ["metadata", "spec"],
        "properties": {
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["selector", "endpoints"],
                "properties": {
                    "selector": {
                        "type": "object",
                        "required": ["matchLabels"],
                        "properties": {"matchLabels": _STRING_MAP},
                    },
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {"type": "object", "required": ["port", "path"]},
                    },
                },
            },
        },
    },
    ("monitoring.coreos.com/v1", "PrometheusRule"): {
        "type": "object",
        "required": ["metadata", "spec"],
        "properties": {
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["groups"],
                "additionalProperties": False,
                "properties": {
                    "groups": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["name", "rules"],
                            "additionalProperties": False,
                            "properties": {
                                "name": {"type": "string", "minLength": 1},
                                "rules": {"type": "array", "items": _ALERT_RULE},
                            },
                        },
                    }
                },
            },
        },
    },
}


# -- Rendering --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    helm.disable_logging()
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def example(stage: str) -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((EXAMPLES / f"{stage}-values.yaml").read_text())
    return values


def chart_defaults() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return values


def with_values(base: dict[str, Any] | None, **paths: Any) -> dict[str, Any]:
    """A copy of `base` with dotted paths (given with `__` for dots) set."""
    values = copy.deepcopy(base or {})
    for dotted, value in paths.items():
        *parents, leaf = dotted.split("__")
        node = values
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return values


def validate_manifest(doc: dict[str, Any], kube_version: str) -> None:
    schema = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if schema is not None:
        jsonschema.validate(doc, schema)
        if doc["kind"] == "ScaledJob":  # the Jobs KEDA makes: a JobSpec, pod template and all
            job = {
                "metadata": {"name": doc["metadata"]["name"]},
                "spec": doc["spec"]["jobTargetRef"],
            }
            kubernetes_validate.validate(
                {"apiVersion": "batch/v1", "kind": "Job", **job}, kube_version, strict=True
            )
    else:
        kubernetes_validate.validate(doc, kube_version, strict=True)


def worker_settings(env: dict[str, str], model_file: Path) -> Settings:
    """The worker's own parsing and validation of a rendered environment."""
    environ = {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}
    environ[config.env_name("model_path")] = str(model_file)  # the loader checks it exists
    return Settings.load(environ)


# -- Lint and validation ----------------------------------------------------------------
@pytest.mark.parametrize("stage", [None, *STAGES])
def test_chart_lints_clean(stage: str | None) -> None:
    report = helm.lint(CHART, example(stage) if stage else None, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("stage", [None, *STAGES])
def test_every_manifest_validates(chart: helm.Chart, stage: str | None, kube_version: str) -> None:
    rendered = render(chart, example(stage) if stage else None, name=stage or "stage1")
    expected = BASE_KINDS | ({"ServiceMonitor"} if stage else set())
    assert rendered.kinds() == expected
    for doc in rendered.docs:
        validate_manifest(doc, kube_version)


def test_kubernetes_validation_is_real(chart: helm.Chart) -> None:
    deployment = render(chart).one("Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["pathh"] = "/"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_manifest(deployment, KUBE_VERSIONS[0])


def test_default_values_warn_about_required_settings(chart: helm.Chart) -> None:
    notes = render(chart).notes
    for name in ("queue_url", "allowed_input_prefixes", "output_prefix"):
        assert f"worker.{name} is required" in notes
    for stage in STAGES:
        assert "WARNING" not in render(chart, example(stage), name=stage).notes


# -- The worker's settings --------------------------------------------------------------
def test_values_and_schema_cover_every_setting() -> None:
    assert set(ENV_NAMES) == {ENV_PREFIX + name.upper() for name in SETTING_NAMES}
    assert set(chart_defaults()["worker"]) == SETTING_NAMES
    schema = (CHART / "values.schema.json").read_text()
    worker_schema = yaml.safe_load(schema)["properties"]["worker"]
    assert set(worker_schema["properties"]) == SETTING_NAMES
    assert worker_schema["additionalProperties"] is False


def test_chart_defaults_equal_worker_defaults() -> None:
    """Settings the chart sets by default keep the worker's default, but two on purpose."""
    on_purpose = {"model_path": "/models/model.ubj", "log_format": "json"}
    defaults = {f.name: f.default for f in dataclasses.fields(Settings)}
    for name, value in chart_defaults()["worker"].items():
        if value in ("", None, []):
            continue
        assert value == on_purpose.get(name, defaults[name]), name


def full_worker_values(tmp_path: Path) -> dict[str, Any]:
    """Every setting set: the worker's defaults, and examples where it has none."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Settings):
        values[f.name] = list(f.default) if isinstance(f.default, tuple) else f.default
    queue = "https://sqs.eu-west-1.amazonaws.com/123456789012/q"
    values.update(
        queue_url=queue,
        dlq_url=queue + "-dlq",
        next_queue_url=queue + "-next",
        model_path=str(tmp_path / "model.ubj"),
        model_sha256="ab" * 32,
        model_version="2026-11-a",
        model_output="probabilities",
        model_dir="/tmp/models",
        allowed_input_prefixes=["s3://in-bucket/a/", "s3://in-bucket/b/"],
        output_prefix="s3://out-bucket/out/",
        allowed_output_prefixes=["s3://out-bucket/"],
        endpoint_url="http://127.0.0.1:5000",
        region="eu-west-1",
        worker_id="w-1",
        processes=3,
        max_decoded_bytes=300_000_000,
        task_time_s=20.0,
        drain_deadline_s=25.0,
    )
    return values


def test_every_setting_renders_and_the_worker_accepts_it(chart: helm.Chart, tmp_path: Path) -> None:
    worker = full_worker_values(tmp_path)
    env = render(chart, {"worker": worker}).env()
    assert {k for k in env if k.startswith(ENV_PREFIX)} == set(ENV_NAMES)
    model = tmp_path / "model.ubj"
    model.write_bytes(b"{}")
    settings = worker_settings(env, model)
    assert [str(p) for p in settings.allowed_input_prefixes] == worker["allowed_input_prefixes"]
    assert settings.max_decoded_bytes == 300_000_000  # not 3e+08
    assert settings.drain_deadline_s == 25.0
    assert settings.processes == 3


@pytest.mark.parametrize("stage", [None, *STAGES])
def test_rendered_env_is_known_to_the_worker(
    chart: helm.Chart, stage: str | None, tmp_path: Path
) -> None:
    rendered = render(chart, example(stage) if stage else None)
    env = rendered.env()
    assert {k for k in env if k.startswith(ENV_PREFIX)} <= set(ENV_NAMES)
    assert env["SQSINFER_MAX_INPUT_BYTES"].isdigit()  # never 6.7108864e+07
    if stage:  # a complete stage: the worker's own loader accepts it
        model = tmp_path / "model.ubj"
        model.write_bytes(b"{}")
        worker_settings(env, model)


def test_extra_env_is_appended(chart: helm.Chart) -> None:
    extra = [{"name": "AWS_STS_REGIONAL_ENDPOINTS", "value": "regional"}]
    env = render(chart, {"extraEnv": extra}).env()
    assert env["AWS_STS_REGIONAL_ENDPOINTS"] == "regional"


# -- Probes and the health server -------------------------------------------------------
@dataclasses.dataclass
class _Worker:
    """What the health server asks the worker; `ready` is False while the model loads."""

    live: bool = True
    ready: bool = False

    def livez(self) -> tuple[bool, str]:
        return self.live, "" if self.live else "stalled"

    def readyz(self) -> tuple[bool, str]:
        return self.ready, "" if self.ready else "starting"

    def metrics_text(self, openmetrics_format: bool = False) -> bytes:
        return b"# nothing\n"


def probe_paths(rendered: Rendered) -> dict[str, str]:
    container = rendered.container()
    kinds = ("startupProbe", "livenessProbe", "readinessProbe")
    return {kind: container[kind]["httpGet"]["path"] for kind in kinds}


def test_probes_use_the_health_port(chart: helm.Chart) -> None:
    for port in (8080, 9464):
        rendered = render(chart, {"worker": {"health_port": port}})
        container = rendered.container()
        assert rendered.env()["SQSINFER_HEALTH_PORT"] == str(port)
        assert container["ports"] == [{"name": "http", "containerPort": port, "protocol": "TCP"}]
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[kind]["httpGet"]["port"] == port
        (service_port,) = rendered.one("Service")["spec"]["ports"]
        assert service_port["port"] == port
        assert service_port["targetPort"] == "http"


async def test_probe_paths_are_served_by_the_health_server(chart: helm.Chart) -> None:
    rendered = render(chart, example("stage1"), name="stage1")
    paths = probe_paths(rendered)
    assert paths == {
        "startupProbe": "/readyz",
        "livenessProbe": "/livez",
        "readinessProbe": "/readyz",
    }
    (endpoint,) = rendered.one("ServiceMonitor")["spec"]["endpoints"]
    worker = _Worker(live=True, ready=False)  # loading the model and warming up
    server = HealthServer(worker, "127.0.0.1", 0)
    await server.start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as session:
            loading = {kind: await status(session, path) for kind, path in paths.items()}
            # While loading, the startup probe waits and the liveness probe is content.
            assert loading == {"startupProbe": 503, "livenessProbe": 200, "readinessProbe": 503}
            worker.ready = True
            for path in {*paths.values(), endpoint["path"]}:
                assert await status(session, path) == 200, path
            assert await status(session, "/nope") == 404
    finally:
        await server.stop()


async def status(session: aiohttp.ClientSession, path: str) -> int:
    async with session.get(path) as response:
        return response.status


def test_startup_probe_covers_model_load(chart: helm.Chart) -> None:
    startup = render(chart).container()["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120


# -- Shutdown ---------------------------------------------------------------------------
def pod_spec(rendered: Rendered) -> dict[str, Any]:
    spec: dict[str, Any] = rendered.one("Deployment")["spec"]["template"]["spec"]
    return spec


def shutdown_settings(env: dict[str, str], tmp_path: Path) -> Settings:
    """The worker's settings from a rendered environment, required settings filled in."""
    model = tmp_path / "model.ubj"
    model.write_bytes(b"{}")
    required = {
        "SQSINFER_QUEUE_URL": "https://sqs.eu-west-1.amazonaws.com/123456789012/q",
        "SQSINFER_ALLOWED_INPUT_PREFIXES": "s3://in-bucket/",
        "SQSINFER_OUTPUT_PREFIX": "s3://out-bucket/",
    }
    return worker_settings(required | env, model)


def least_grace(drain_s: float, wait_s: int | None = None) -> int:
    """What the worker needs from SIGTERM to exit, by its own numbers, plus the exit margin."""
    settings = Settings(drain_deadline_s=drain_s)
    if wait_s is not None:
        settings = dataclasses.replace(settings, wait_time_s=wait_s)
    return math.ceil(settings.shutdown_budget_s) + EXIT_MARGIN_S


def _times(task: float | None, drain: float | None, wait: int | None = None) -> dict[str, Any]:
    return {"task_time_s": task, "drain_deadline_s": drain, "wait_time_s": wait}


@pytest.mark.parametrize(
    ("worker", "grace"),
    [
        (_times(None, None), 90),  # the worker's 60 s tasks: drain 70 s + 10 + 5 + 5
        (_times(15, None), 45),  # drain 25 s
        (_times(30, None), 60),
        (_times(20.5, None), 51),  # drain 30.5 s: the budget rounds up
        (_times(None, 100), 120),  # an explicit drain above the derived one
        (_times(30, 0), 60),  # 0 means derived, as for the worker
        (_times(5, None), 45),  # drain 15 s, but the last long poll ends 20 + 5 s in
        (_times(5, None, wait=5), 35),  # a 5 s long poll: the drain decides
    ],
)
def test_grace_period_is_derived_as_the_worker_derives_its_shutdown(
    chart: helm.Chart, worker: dict[str, Any], grace: int, tmp_path: Path
) -> None:
    rendered = render(chart, {"worker": worker})
    assert pod_spec(rendered)["terminationGracePeriodSeconds"] == grace
    env = rendered.env()
    # 0 and unset: derived, as for the worker
    assert ("SQSINFER_DRAIN_DEADLINE_S" in env) == (worker["drain_deadline_s"] is not None)
    settings = shutdown_settings(env, tmp_path)
    assert grace == least_grace(settings.drain_deadline_s, settings.wait_time_s)
    assert f"drain {settings.drain_deadline_s:g} s within a grace period of {grace} s" in (
        rendered.notes.replace(".0 s", " s")
    )


@pytest.mark.parametrize(
    ("grace", "drain", "ok"),
    [(45, 25, True), (46, 25, True), (44, 25, False), (30, 25, False), (61, 40.5, True)],
)
def test_a_grace_period_set_too_short_fails_naming_both_values(
    chart: helm.Chart, grace: int, drain: float, ok: bool
) -> None:
    worker = {"task_time_s": 15, "drain_deadline_s": drain}
    values = {"terminationGracePeriodSeconds": grace, "worker": worker}
    if ok:
        assert pod_spec(render(chart, values))["terminationGracePeriodSeconds"] == grace
        assert grace >= least_grace(drain)
        return
    assert grace < least_grace(drain)
    pattern = rf"terminationGracePeriodSeconds \({grace}\) must be at least {least_grace(drain)}"
    with pytest.raises(helm.HelmRenderError, match=pattern) as error:
        render(chart, values)
    assert f"worker.drain_deadline_s ({drain:g})" in str(error.value)


def test_a_drain_shorter_than_the_task_time_fails(chart: helm.Chart, tmp_path: Path) -> None:
    values = {"worker": {"task_time_s": 30, "drain_deadline_s": 20}}
    with pytest.raises(helm.HelmRenderError, match=r"drain_deadline_s \(20\) must be at least"):
        render(chart, values)
    env = {"SQSINFER_TASK_TIME_S": "30", "SQSINFER_DRAIN_DEADLINE_S": "20"}
    with pytest.raises(config.ConfigError, match="DRAIN_DEADLINE_S"):  # the worker agrees
        shutdown_settings(env, tmp_path)


def test_the_chart_holds_the_workers_shutdown_numbers() -> None:
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    default_task = next(f.default for f in dataclasses.fields(Settings) if f.name == "task_time_s")
    assert f"{{{{ {default_task:.1f} }}}}" in helpers  # the worker's default task time
    assert 'addf (include "sqsinfer.taskTime" . | float64) 10.0' in helpers
    assert config._DRAIN_MARGIN_S == 10.0
    assert config.COMMIT_GRACE_S + config.FORCED_RELEASE_S == 15.0
    assert 'addf (include "sqsinfer.shutdownWait" . | float64) 15.0' in helpers
    default_wait = next(f.default for f in dataclasses.fields(Settings) if f.name == "wait_time_s")
    assert f"{{{{ {float(default_wait):.1f} }}}}" in helpers  # the worker's long-poll wait
    assert config.LAST_RECEIVE_GRACE_S == 5.0
    assert 'addf (include "sqsinfer.waitTime" . | float64) 5.0' in helpers


@pytest.mark.parametrize("stage", [None, *STAGES])
def test_rendered_grace_covers_the_workers_shutdown(
    chart: helm.Chart, stage: str | None, tmp_path: Path
) -> None:
    rendered = render(chart, example(stage) if stage else None)
    settings = shutdown_settings(rendered.env(), tmp_path)
    grace = pod_spec(rendered)["terminationGracePeriodSeconds"]
    assert grace >= settings.shutdown_budget_s + EXIT_MARGIN_S
    assert settings.drain_deadline_s >= settings.task_time_s


# -- Autoscaling ------------------------------------------------------------------------
def sqs_trigger(rendered: Rendered) -> dict[str, Any]:
    (trigger,) = rendered.one("ScaledObject")["spec"]["triggers"]
    assert trigger["type"] == "aws-sqs-queue"
    return trigger


@pytest.mark.parametrize(
    ("stage", "queue_length", "activation", "replicas"),
    [("stage1", "8", "0", (1, 20)), ("stage2", "6", "2", (0, 8))],
)
def test_scaled_object_trigger(
    chart: helm.Chart, stage: str, queue_length: str, activation: str, replicas: tuple[int, int]
) -> None:
    values = example(stage)
    rendered = render(chart, values, name=stage)
    scaled = rendered.one("ScaledObject")["spec"]
    deployment = rendered.one("Deployment")
    assert scaled["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert (scaled["minReplicaCount"], scaled["maxReplicaCount"]) == replicas
    assert "replicas" not in deployment["spec"]  # KEDA owns the replica count
    trigger = sqs_trigger(rendered)
    assert trigger["metadata"] == {
        "queueURL": values["worker"]["queue_url"],
        "queueLength": queue_length,
        "activationQueueLength": activation,
        "awsRegion": values["worker"]["region"],
        "scaleOnInFlight": "false",  # retried messages waiting out a backoff scale nothing
        "scaleOnDelayed": "false",
    }
    assert trigger["metadata"]["queueURL"] == rendered.env()["SQSINFER_QUEUE_URL"]
    auth = rendered.one("TriggerAuthentication")
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    assert auth["spec"]["podIdentity"] == {"provider": "aws", "identityOwner": "workload"}


@pytest.mark.parametrize(
    ("queue_url", "region"),
    [
        ("https://sqs.ap-southeast-2.amazonaws.com/123456789012/q", "ap-southeast-2"),
        ("https://sqs-fips.us-gov-west-1.amazonaws.com/123456789012/q", "us-gov-west-1"),
        ("https://sqs.cn-north-1.amazonaws.com.cn/123456789012/q", "cn-north-1"),
        ("https://eu-central-1.queue.amazonaws.com/123456789012/q", "eu-central-1"),
    ],
)
def test_keda_takes_the_region_from_the_queue_url_when_none_is_set(
    chart: helm.Chart, queue_url: str, region: str
) -> None:
    rendered = render(chart, {"worker": {"queue_url": queue_url}})
    assert sqs_trigger(rendered)["metadata"]["awsRegion"] == region
    # The worker resolves its own: the pod's AWS_REGION (EKS injects it), as the SDK does.
    assert "SQSINFER_REGION" not in rendered.env()


def test_keda_takes_the_workers_region_when_set(chart: helm.Chart) -> None:
    queue_url = "https://sqs.ap-southeast-2.amazonaws.com/123456789012/q"
    rendered = render(chart, {"worker": {"queue_url": queue_url, "region": "eu-west-1"}})
    assert sqs_trigger(rendered)["metadata"]["awsRegion"] == "eu-west-1"
    assert rendered.env()["SQSINFER_REGION"] == "eu-west-1"  # one value for both


def test_a_queue_url_that_names_no_region_needs_one_set(chart: helm.Chart) -> None:
    local = {"queue_url": "http://localstack:4566/000000000000/q"}
    with pytest.raises(helm.HelmRenderError, match=r"\(localstack\) names none: set worker.region"):
        render(chart, {"worker": local})
    rendered = render(chart, {"worker": local | {"region": "eu-west-1"}})
    assert sqs_trigger(rendered)["metadata"]["awsRegion"] == "eu-west-1"


@pytest.mark.parametrize(
    ("cpu", "quota"),
    [("500m", 0.5), ("1", 1.0), ("1500m", 1.5), ("2.4", 2.4), (3, 3.0), ("7800m", 7.8)],
)
def test_queue_length_matches_the_workers_process_count(
    chart: helm.Chart, monkeypatch: pytest.MonkeyPatch, cpu: str | int, quota: float
) -> None:
    """processes x prefetch, with processes as the worker derives it from the CPU quota."""
    monkeypatch.setattr(config, "_cgroup_cpu_quota", lambda: quota)
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda _: set(range(64)))
    processes = config.available_cpus()
    values = {"resources": {"limits": {"cpu": cpu}}, "worker": {"prefetch": 3}}  # memory: derived
    rendered = render(chart, values)
    assert sqs_trigger(rendered)["metadata"]["queueLength"] == str(processes * 3)
    assert rendered.env()["SQSINFER_PROCESSES"] == "0"  # the worker derives the same count
    del values["worker"]  # auto: where it starts, 2 per process
    assert sqs_trigger(render(chart, values))["metadata"]["queueLength"] == str(processes * 2)


def test_queue_length_override_and_scale_options(chart: helm.Chart) -> None:
    values = {
        "keda": {
            "queueLength": 5,
            "scaleOnInFlight": True,
            "awsRegion": "eu-north-1",
            "awsEndpoint": "http://sqs.local:4566",
        }
    }
    metadata = sqs_trigger(render(chart, values))["metadata"]
    assert metadata["queueLength"] == "5"
    assert metadata["scaleOnInFlight"] == "true"
    assert metadata["awsRegion"] == "eu-north-1"
    assert metadata["awsEndpoint"] == "http://sqs.local:4566"


def test_trigger_authentication_with_a_role(chart: helm.Chart) -> None:
    role = "arn:aws:iam::123456789012:role/keda-reader"
    auth = render(chart, {"keda": {"auth": {"roleArn": role}}}).one("TriggerAuthentication")
    assert auth["spec"]["podIdentity"] == {"provider": "aws", "roleArn": role}


def test_without_keda_the_deployment_has_replicas(chart: helm.Chart) -> None:
    rendered = render(chart, {"keda": {"enabled": False}, "replicaCount": 3})
    assert rendered.kinds() == BASE_KINDS - {"ScaledObject", "TriggerAuthentication"}
    assert rendered.one("Deployment")["spec"]["replicas"] == 3


def test_min_replicas_above_max_fails(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmRenderError, match="minReplicas"):
        render(chart, {"keda": {"minReplicas": 5, "maxReplicas": 2}})


# -- Pod hardening, volumes, identity, placement ----------------------------------------
@pytest.mark.parametrize("stage", [None, *STAGES])
def test_security_context(chart: helm.Chart, stage: str | None) -> None:
    rendered = render(chart, example(stage) if stage else None)
    pod = rendered.one("Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    container = rendered.container()["securityContext"]
    assert container["runAsNonRoot"] is True
    assert container["readOnlyRootFilesystem"] is True
    assert container["allowPrivilegeEscalation"] is False
    assert container["privileged"] is False
    assert container["capabilities"] == {"drop": ["ALL"]}
    assert container["seccompProfile"] == {"type": "RuntimeDefault"}


def volumes(rendered: Rendered) -> tuple[dict[str, Any], dict[str, str]]:
    pod = rendered.one("Deployment")["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in rendered.container()["volumeMounts"]}
    return {v["name"]: v for v in pod["volumes"]}, mounts


@pytest.mark.parametrize(
    ("values", "size"),
    [
        ({}, f"{2 * 8 * 64 + 64}Mi"),  # 2 CPUs x max_prefetch 8 (auto) x 64 MiB + headroom
        ({"worker": {"max_prefetch": 3}}, f"{2 * 3 * 64 + 64}Mi"),
        ({"worker": {"prefetch": 2}}, f"{2 * 2 * 64 + 64}Mi"),  # pinned: its own count
        (
            {"worker": {"processes": 3, "prefetch": 4, "max_input_bytes": 10 * MiB + 1}},
            f"{3 * 4 * 11 + 64}Mi",
        ),  # each input's segment is rounded up to whole MiB
        ({"shm": {"sizeLimit": "3Gi"}}, "3Gi"),
    ],
)
def test_dev_shm_is_memory_sized_for_the_handoff(
    chart: helm.Chart, values: dict[str, Any], size: str
) -> None:
    by_name, mounts = volumes(render(chart, values))
    assert mounts["/dev/shm"] == "dshm"
    assert by_name["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": size}
    assert "emptyDir" in by_name[mounts["/tmp"]]


def test_mounted_model_is_read_only(chart: helm.Chart) -> None:
    rendered = render(chart, example("stage2"), name="stage2")
    by_name, _ = volumes(rendered)
    assert by_name["model"]["persistentVolumeClaim"]["claimName"] == "fraud-models"
    (mount,) = [m for m in rendered.container()["volumeMounts"] if m["name"] == "model"]
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}


def test_cpu_limit_or_processes_is_required(chart: helm.Chart) -> None:
    values = {"resources": {"limits": {"cpu": None}}}  # null deletes the default limit
    with pytest.raises(helm.HelmRenderError, match=r"resources\.limits\.cpu"):
        render(chart, values)
    render(chart, with_values(values, worker__processes=2))


def test_service_account_carries_the_irsa_role(chart: helm.Chart) -> None:
    values = example("stage1")
    rendered = render(chart, values)
    account = rendered.one("ServiceAccount")
    annotations = account["metadata"]["annotations"]
    assert annotations["eks.amazonaws.com/role-arn"] == values["serviceAccount"]["roleArn"]
    pod = rendered.one("Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]


def test_selectors_agree(chart: helm.Chart) -> None:
    rendered = render(chart, example("stage1"))
    deployment = rendered.one("Deployment")
    selector = deployment["spec"]["selector"]["matchLabels"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    assert rendered.one("Service")["spec"]["selector"] == selector
    assert rendered.one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == selector
    assert rendered.one("ServiceMonitor")["spec"]["selector"]["matchLabels"] == selector
    spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert {c["topologyKey"] for c in spread} == {
        "topology.kubernetes.io/zone",
        "kubernetes.io/hostname",
    }
    for constraint in spread:
        assert constraint["labelSelector"]["matchLabels"] == selector


def test_two_stages_form_a_chain(chart: helm.Chart) -> None:
    one, two = (render(chart, example(s), name=s) for s in STAGES)
    env1, env2 = one.env(), two.env()
    assert env1["SQSINFER_NEXT_QUEUE_URL"] == env2["SQSINFER_QUEUE_URL"]
    assert "SQSINFER_NEXT_QUEUE_URL" not in env2  # the last stage hands nothing on
    assert env2["SQSINFER_ALLOWED_INPUT_PREFIXES"] == env1["SQSINFER_OUTPUT_PREFIX"]
    names = [{d["metadata"]["name"] for d in r.docs} for r in (one, two)]
    assert names[0].isdisjoint(names[1])  # both releases fit in one namespace
    selectors = [r.one("Deployment")["spec"]["selector"]["matchLabels"] for r in (one, two)]
    assert selectors[0] != selectors[1]


# -- Bad values fail at install ---------------------------------------------------------
BAD_VALUES = [  # (values, where the schema finds the fault)
    ({"worker": {"queue_ur": "https://sqs.us-east-1.amazonaws.com/1/q"}}, "'queue_ur'"),
    ({"worker": {"queue_url": "sqs://q"}}, "/worker/queue_url"),
    ({"worker": {"allowed_input_prefixes": ["bucket/path/"]}}, "/worker/allowed_input_prefixes"),
    ({"worker": {"output_format": "csv"}}, "/worker/output_format"),
    ({"worker": {"health_port": 0}}, "/worker/health_port"),
    ({"worker": {"prefetch": 0}}, "/worker/prefetch"),
    ({"worker": {"prefetch": "often"}}, "/worker/prefetch"),
    ({"worker": {"max_prefetch": 0}}, "/worker/max_prefetch"),
    ({"worker": {"always_head_output": "yes"}}, "/worker/always_head_output"),
    ({"worker": {"drain_deadline_s": "25s"}}, "/worker/drain_deadline_s"),
    ({"worker": {"wait_time_s": 30}}, "/worker/wait_time_s"),
    ({"worker": {"model_sha256": "not-a-hash"}}, "/worker/model_sha256"),
    ({"terminationGracePeriodSeconds": "45"}, "/terminationGracePeriodSeconds"),
    ({"podSecurityContext": {"runAsUser": 0}}, "/podSecurityContext/runAsUser"),
    ({"podSecurityContext": {"privileged": True}}, "'privileged'"),
    ({"keda": {"auth": {"identityOwner": "operator"}}}, "/keda/auth/identityOwner"),
    ({"keda": {"minReplicas": 0}}, "/keda/minReplicas"),
    ({"serviceAccount": {"roleArn": "sqsinfer-role"}}, "/serviceAccount/roleArn"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"shm": {"sizeLimit": "lots"}}, "/shm/sizeLimit"),
    ({"replicas": 3}, "'replicas'"),  # unknown top-level key
    ({"terminationGracePeriodSeconds": 0}, "/terminationGracePeriodSeconds"),
    ({"worker": {"drain_deadline_s": -1}}, "/worker/drain_deadline_s"),
    ({"commonLabels": {"app.kubernetes.io/name": "x"}}, "invalid propertyName 'app.kubernetes"),
    ({"commonAnnotations": {"a": 1}}, "/commonAnnotations/a"),
    ({"initContainers": [{"image": "busybox"}]}, "/initContainers/0"),  # no name
    ({"extraContainers": [{"name": "worker", "image": "x"}]}, "/extraContainers/0/name"),
    ({"keda": {"scaleDownStabilizationSeconds": 60}}, "'scaleDownStabilizationSeconds'"),  # 0.1
    ({"keda": {"fallback": {"replicas": 2}}}, "/keda/fallback"),  # no failureThreshold
    ({"keda": {"fallback": {"failureThreshold": 3, "replicas": 2, "behavior": "x"}}}, "behavior"),
    ({"keda": {"pausedReplicas": -1}}, "/keda/pausedReplicas"),
    (
        {"keda": {"behavior": {"scaleUp": {"policies": [{"type": "Cores", "value": 1}]}}}},
        "/keda/behavior/scaleUp/policies/0",
    ),
    ({"keda": {"behavior": {"scaleSideways": {}}}}, "'scaleSideways'"),
    ({"podDisruptionBudget": {"unhealthyPodEvictionPolicy": "Never"}}, "unhealthyPodEviction"),
    ({"networkPolicy": {"enabled": True, "egress": []}}, "'egress'"),
    ({"prometheusRule": {"selector": "job=x"}}, "/prometheusRule/selector"),  # unquoted value
    ({"prometheusRule": {"stallFor": "15 minutes"}}, "/prometheusRule/stallFor"),
    ({"prometheusRule": {"rejectedRatio": 5}}, "/prometheusRule/rejectedRatio"),
]


@pytest.mark.parametrize(
    ("values", "where"),
    BAD_VALUES,
    ids=[yaml.safe_dump(v, width=200).strip() for v, _ in BAD_VALUES],
)
def test_bad_values_fail_schema_validation(
    chart: helm.Chart, values: dict[str, Any], where: str
) -> None:
    with pytest.raises(helm.HelmValuesError, match=re.escape(where)):
        chart.validate_schema(values)
    with pytest.raises(helm.HelmValuesError, match=re.escape(where)):
        render(chart, values)


@pytest.mark.parametrize("stage", [None, *STAGES])
def test_good_values_pass_schema_validation(chart: helm.Chart, stage: str | None) -> None:
    chart.validate_schema(example(stage) if stage else {})
    chart.validate_schema({"worker": {"allowed_input_prefixes": "s3://a-b/x/,s3://c-d/"}})


# -- Extension points -------------------------------------------------------------------
EVERYTHING_ON: dict[str, Any] = {
    "commonLabels": {"team": "ml", "cost-center": "inference"},
    "commonAnnotations": {"example.com/owner": "ml-platform"},
    "initContainers": [
        {
            "name": "fetch-model",
            "image": "registry.example.com/tools/s5cmd:2.2",
            "args": ["cp", "s3://models/stage1.ubj", "/models/model.ubj"],
            "volumeMounts": [{"name": "models", "mountPath": "/models"}],
        }
    ],
    "extraContainers": [{"name": "log-shipper", "image": "registry.example.com/fluent-bit:3.1"}],
    "extraVolumes": [{"name": "models", "emptyDir": {}}],
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}},
    "networkPolicy": {
        "enabled": True,
        "metricsFrom": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
        ],
        "allowPodIdentityAgent": True,
        "extraEgress": [{"to": [{"ipBlock": {"cidr": "10.0.0.0/16"}}], "ports": [{"port": 4566}]}],
    },
    "keda": {
        "paused": True,
        "pausedReplicas": 2,
        "fallback": {"failureThreshold": 3, "replicas": 2, "behavior": "currentReplicasIfHigher"},
    },
    "serviceAccount": {"roleArn": "arn:aws:iam::123456789012:role/stage1"},
}
ALL_KINDS = BASE_KINDS | {"ServiceMonitor", "PrometheusRule", "NetworkPolicy"}


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_knob_on_renders_valid_manifests(chart: helm.Chart, kube_version: str) -> None:
    chart.validate_schema(with_values(example("stage1"), **flatten(EVERYTHING_ON)))
    rendered = render(chart, with_values(example("stage1"), **flatten(EVERYTHING_ON)))
    assert rendered.kinds() == ALL_KINDS
    for doc in rendered.docs:
        validate_manifest(doc, kube_version)


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} as {"a__b": 1}, for with_values (lists and empty maps stay whole)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value and key not in ("commonLabels", "commonAnnotations"):
            out |= flatten(value, f"{prefix}{key}__")
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_common_labels_and_annotations_reach_every_object(chart: helm.Chart) -> None:
    rendered = render(chart, with_values(example("stage1"), **flatten(EVERYTHING_ON)))
    for doc in rendered.docs:
        meta = doc["metadata"]
        assert {"team": "ml", "cost-center": "inference"}.items() <= meta["labels"].items()
        assert meta["annotations"]["example.com/owner"] == "ml-platform", doc["kind"]
    deployment = rendered.one("Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["team"] == "ml"
    assert "team" not in deployment["spec"]["selector"]["matchLabels"]  # selectors never change
    # objects with annotations of their own keep them
    account = rendered.one("ServiceAccount")["metadata"]["annotations"]
    assert account["eks.amazonaws.com/role-arn"] == "arn:aws:iam::123456789012:role/stage1"
    scaled = rendered.one("ScaledObject")["metadata"]["annotations"]
    assert scaled["autoscaling.keda.sh/paused"] == "true"


def test_no_annotations_without_values(chart: helm.Chart) -> None:
    for doc in render(chart, with_values(None, serviceAccount__roleArn="")).docs:
        assert "annotations" not in doc["metadata"], doc["kind"]


def test_init_and_extra_containers(chart: helm.Chart) -> None:
    rendered = render(chart, with_values(example("stage1"), **flatten(EVERYTHING_ON)))
    pod = pod_spec(rendered)
    assert [c["name"] for c in pod["initContainers"]] == ["fetch-model"]
    assert [c["name"] for c in pod["containers"]] == ["worker", "log-shipper"]
    assert "initContainers" not in pod_spec(render(chart))
    assert [c["name"] for c in pod_spec(render(chart))["containers"]] == ["worker"]


def test_capability_checks_stop_an_install_without_the_crds(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(KEDA_API)) as error:
        render(chart, api_versions=())
    message = str(error.value)
    assert "keda.enabled is set" in message and "install KEDA" in message
    assert f"--api-versions {KEDA_API}" in message
    assert render(chart, {"keda": {"enabled": False}}, api_versions=()).docs
    for knob, api in zip(("serviceMonitor", "prometheusRule"), MONITORING_APIS, strict=True):
        values = {knob: {"enabled": True}}
        with pytest.raises(helm.HelmRenderError, match=f"{knob}.enabled is set.*{api}"):
            render(chart, values, api_versions=(KEDA_API,))
        assert render(chart, values, api_versions=(KEDA_API, api)).docs


def test_network_policy_allows_dns_https_and_the_health_port(chart: helm.Chart) -> None:
    assert "NetworkPolicy" not in render(chart).kinds()  # opt-in
    rendered = render(chart, {"networkPolicy": {"enabled": True}, "worker": {"health_port": 9464}})
    policy = rendered.one("NetworkPolicy")["spec"]
    assert (
        policy["podSelector"]["matchLabels"]
        == (rendered.one("Deployment")["spec"]["selector"]["matchLabels"])
    )
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    assert policy["ingress"] == [{"ports": [{"port": 9464, "protocol": "TCP"}]}]
    egress = [(p["port"], p["protocol"]) for rule in policy["egress"] for p in rule["ports"]]
    assert egress == [(53, "UDP"), (53, "TCP"), (443, "TCP")]
    assert all("to" not in rule for rule in policy["egress"])  # AWS endpoints move: any address


def test_network_policy_knobs(chart: helm.Chart) -> None:
    knobs = EVERYTHING_ON["networkPolicy"]
    policy = render(chart, {"networkPolicy": knobs}).one("NetworkPolicy")["spec"]
    assert policy["ingress"][0]["from"] == knobs["metricsFrom"]
    agent, extra = policy["egress"][2:]
    assert agent == {
        "to": [{"ipBlock": {"cidr": "169.254.170.23/32"}}],
        "ports": [{"port": 80, "protocol": "TCP"}],
    }
    assert extra == knobs["extraEgress"][0]


def test_keda_pause_fallback_and_scaling_policies(chart: helm.Chart) -> None:
    scaled = render(chart).one("ScaledObject")
    assert "annotations" not in scaled["metadata"] and "fallback" not in scaled["spec"]
    behavior = scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior == chart_defaults()["keda"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0

    slow = {"policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}]}
    values = with_values(
        None,
        keda__paused=True,
        keda__pausedReplicas=0,
        keda__fallback={"failureThreshold": 4, "replicas": 3},
        keda__behavior={"scaleDown": slow},
    )
    scaled = render(chart, values).one("ScaledObject")
    assert scaled["metadata"]["annotations"] == {
        "autoscaling.keda.sh/paused": "true",
        "autoscaling.keda.sh/paused-replicas": "0",
    }
    assert scaled["spec"]["fallback"] == {"failureThreshold": 4, "replicas": 3}
    rules = scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    # Helm merges maps and replaces lists: the policies are the new ones, the window stays
    assert rules == {**chart_defaults()["keda"]["behavior"]["scaleDown"], **slow}
    validate_manifest(scaled, KUBE_VERSIONS[0])


def test_pdb_lets_drains_evict_unready_pods(chart: helm.Chart) -> None:
    pdb = render(chart).one("PodDisruptionBudget")["spec"]
    assert pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    values = {"podDisruptionBudget": {"unhealthyPodEvictionPolicy": "IfHealthyBudget"}}
    pdb = render(chart, values).one("PodDisruptionBudget")["spec"]
    assert pdb["unhealthyPodEvictionPolicy"] == "IfHealthyBudget"


def test_examples_pin_the_image_by_digest(chart: helm.Chart) -> None:
    for stage in STAGES:
        image = example(stage)["image"]
        rendered = render(chart, example(stage), name=stage).container()["image"]
        assert rendered == f"{image['repository']}@{image['digest']}"
    assert render(chart).container()["image"] == "sqsinfer:" + chart.metadata["appVersion"]


def test_chart_metadata_points_home() -> None:
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    repo = "https://github.com/sqsinfer/sqsinfer"
    assert meta["home"] == repo and meta["sources"] == [repo]
    prefix = "https://raw.githubusercontent.com/sqsinfer/sqsinfer/main/"
    assert meta["icon"].startswith(prefix)
    assert (ROOT / meta["icon"].removeprefix(prefix)).is_file()  # the icon is in the repository
    report = helm.lint(CHART, strict=True)
    assert [m for m in report["messages"] if "icon" in m["error"]] == []


# -- Alerts -----------------------------------------------------------------------------
ALERTS = {
    "SqsinferRejectedRatio",
    "SqsinferProcessesCrashLooping",
    "SqsinferAwsErrors",
    "SqsinferStalled",
    "SqsinferBacklogNotDraining",
    "SqsinferDeadLetters",
    "SqsinferMessagesTooOld",
}


def alert_rules(rendered: Rendered) -> dict[str, dict[str, Any]]:
    (group,) = rendered.one("PrometheusRule")["spec"]["groups"]
    return {rule["alert"]: rule for rule in group["rules"]}


def test_prometheus_rule_alerts_ask_for_series_that_exist(chart: helm.Chart) -> None:
    rendered = render(chart, with_values(example("stage1"), prometheusRule__enabled=True))
    rules = alert_rules(rendered)
    assert set(rules) == ALERTS
    # only what a worker exposes today (or KEDA): no alert waits on metrics still to come
    series = {**promql.EXTERNAL, **promql.exposed_metrics()}
    job = rendered.one("Service")["metadata"]["name"]
    for name, rule in rules.items():
        assert promql.unknown(rule["expr"], series) == [], name
        for selector in promql.selectors(rule["expr"]):
            if selector.name.startswith("sqsinfer_"):  # this stage's series only
                assert {"job", "namespace"} <= selector.labels, name
        assert f'job="{job}"' in rule["expr"] and f'namespace="{NAMESPACE}"' in rule["expr"]
        # every alert says which stage; the backlog alert's result has no labels of its own
        assert rule["labels"].items() >= {"severity": "warning"}.items()
        assert rule["labels"].keys() <= {"severity", "namespace", "job"}
        assert rule["annotations"]["summary"] and rule["annotations"]["runbook_url"]
    backlog = rules["SqsinferBacklogNotDraining"]
    assert 'scaledObject="stage1-sqsinfer"' in backlog["expr"]
    assert backlog["labels"] == {"severity": "warning", "namespace": NAMESPACE, "job": job}
    # the ServiceMonitor's job is the Service's name, which the alerts select
    assert (
        rendered.one("ServiceMonitor")["spec"]["selector"]["matchLabels"]
        == (rendered.one("Service")["spec"]["selector"])
    )


def test_prometheus_rule_thresholds_and_selector(chart: helm.Chart) -> None:
    values = {
        "prometheusRule": {
            "enabled": True,
            "selector": 'service="scoring",cluster="eu"',
            "alertLabels": {"severity": "page", "team": "ml"},
            "rejectedRatio": 0.05,
            "processRestarts": 7,
            "awsErrorsPerSecond": 0.5,
            "stallFor": "20m",
            "backlogFor": "1h",
        },
        "keda": {"enabled": False},
    }
    rules = alert_rules(render(chart, values))
    assert set(rules) == ALERTS - {"SqsinferBacklogNotDraining"}  # needs KEDA's metrics
    assert rules["SqsinferRejectedRatio"]["expr"].endswith("> 0.05")
    assert rules["SqsinferProcessesCrashLooping"]["expr"].endswith("> 7")
    assert rules["SqsinferAwsErrors"]["expr"].endswith("> 0.5")
    assert "[20m]" in rules["SqsinferStalled"]["expr"]
    for rule in rules.values():
        assert 'service="scoring",cluster="eu"' in rule["expr"] and "job=" not in rule["expr"]
        assert rule["labels"] == {"severity": "page", "team": "ml"}
        promql.parse(rule["expr"])


def test_notes_warn_when_the_network_policy_blocks_the_endpoint(chart: helm.Chart) -> None:
    values = {"networkPolicy": {"enabled": True}, "worker": {"endpoint_url": "http://s:4566"}}
    assert "add the port of\nworker.endpoint_url (http://s:4566)" in render(chart, values).notes
    assert "networkPolicy" not in render(chart, {"networkPolicy": {"enabled": True}}).notes


def test_the_update_strategy_is_a_value(chart: helm.Chart) -> None:
    """Rolling by default (old and new pods side by side, docs/upgrading.md); Recreate
    for upgrades that must be drained, without the rolling parameters Kubernetes refuses
    beside it (Helm merges the default's in)."""
    rolling = render(chart).one("Deployment")["spec"]["strategy"]
    assert rolling == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0},
    }
    assert rolling == chart_defaults()["strategy"]
    recreate = render(chart, {"strategy": {"type": "Recreate"}}).one("Deployment")
    assert recreate["spec"]["strategy"] == {"type": "Recreate"}
    validate_manifest(recreate, KUBE_VERSIONS[0])
    values = {"strategy": {"rollingUpdate": {"maxSurge": 2, "maxUnavailable": "50%"}}}
    spec = render(chart, values).one("Deployment")["spec"]["strategy"]
    assert spec["rollingUpdate"] == {"maxSurge": 2, "maxUnavailable": "50%"}
    with pytest.raises(helm.HelmRenderError, match="cannot both be 0"):
        render(chart, {"strategy": {"rollingUpdate": {"maxSurge": 0, "maxUnavailable": "0%"}}})
    for bad, where in (
        ({"type": "BlueGreen"}, "/strategy/type"),
        ({"rollingUpdate": {"maxSurge": "lots"}}, "/strategy/rollingUpdate/maxSurge"),
        ({"canary": {}}, "'canary'"),
    ):
        with pytest.raises(helm.HelmValuesError, match=re.escape(where)):
            chart.validate_schema({"strategy": bad})
