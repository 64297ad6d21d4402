"""The Helm chart, rendered by Helm's own template engine (no helm binary, no cluster).

`helm_python` binds Helm's Go SDK, so rendering, `fail`, `values.schema.json` and lint
behave exactly as `helm install` would. Every rendered manifest is validated against the
Kubernetes JSON schemas that `kubernetes_validate` ships. The worker's settings are read
from `sqsinfer.config`, so the chart and the worker cannot drift apart unnoticed.
"""

from __future__ import annotations

import copy
import dataclasses
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
from sqsinfer.health import HealthServer

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "sqsinfer"
EXAMPLES = ROOT / "helm" / "examples"
STAGES = ("stage1", "stage2")
NAMESPACE = "inference"
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
                    "pollingInterval": {"type": "integer", "minimum": 1},
                    "cooldownPeriod": {"type": "integer", "minimum": 0},
                    "minReplicaCount": {"type": "integer", "minimum": 0},
                    "maxReplicaCount": {"type": "integer", "minimum": 1},
                    "advanced": {"type": "object"},
                    "triggers": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["type", "metadata"],
                            "properties": {
                                "type": {"type": "string"},
                                "metadata": _SQS_METADATA,
                                "authenticationRef": {"type": "object", "required": ["name"]},
                            },
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
}


# -- Rendering --------------------------------------------------------------------------
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


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    helm.disable_logging()
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(
    chart: helm.Chart, values: dict[str, Any] | None = None, name: str = "stage1"
) -> Rendered:
    out = chart.render(values, name=name, namespace=NAMESPACE)
    docs = [
        doc
        for path, text in sorted(out.items())
        if path.endswith((".yaml", ".yml"))
        for doc in yaml.safe_load_all(text)
        if doc
    ]
    notes = "".join(text for path, text in out.items() if path.endswith("NOTES.txt"))
    return Rendered(docs, notes)


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
    """Settings the chart sets by default keep the worker's default, but three on purpose."""
    # The chart states the drain (the worker derives it) so that its grace check has a number.
    on_purpose = {"model_path": "/models/model.ubj", "log_format": "json", "drain_deadline_s": 70}
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
        model_dir="/tmp/models",
        allowed_input_prefixes=["s3://in-bucket/a/", "s3://in-bucket/b/"],
        output_prefix="s3://out-bucket/out/",
        allowed_output_prefixes=["s3://out-bucket/"],
        endpoint_url="http://127.0.0.1:5000",
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

    def metrics_text(self) -> bytes:
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
@pytest.mark.parametrize(
    ("grace", "drain", "ok"),
    [
        (45, 25, True),
        (30, 25, True),
        (29, 25, False),
        (25, 25, False),
        (20, 25, False),
        (60, 40, True),
        (45, 40.5, False),
        (46, 40.5, True),
    ],
)
def test_grace_period_must_exceed_drain_deadline(
    chart: helm.Chart, grace: int, drain: float, ok: bool
) -> None:
    values = {"terminationGracePeriodSeconds": grace, "worker": {"drain_deadline_s": drain}}
    if ok:
        spec = render(chart, values).one("Deployment")["spec"]["template"]["spec"]
        assert spec["terminationGracePeriodSeconds"] == grace
        return
    with pytest.raises(helm.HelmRenderError, match="terminationGracePeriodSeconds"):
        render(chart, values)


@pytest.mark.parametrize("stage", [None, *STAGES])
def test_rendered_grace_exceeds_rendered_drain(chart: helm.Chart, stage: str | None) -> None:
    rendered = render(chart, example(stage) if stage else None)
    spec = rendered.one("Deployment")["spec"]["template"]["spec"]
    drain = float(rendered.env()["SQSINFER_DRAIN_DEADLINE_S"])
    assert spec["terminationGracePeriodSeconds"] >= drain + 5


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
        "scaleOnInFlight": "true",
        "scaleOnDelayed": "false",
    }
    assert trigger["metadata"]["queueURL"] == rendered.env()["SQSINFER_QUEUE_URL"]
    auth = rendered.one("TriggerAuthentication")
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    assert auth["spec"]["podIdentity"] == {"provider": "aws", "identityOwner": "workload"}


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
    values = {"resources": {"limits": {"cpu": cpu, "memory": "8Gi"}}, "worker": {"prefetch": 3}}
    rendered = render(chart, values)
    assert sqs_trigger(rendered)["metadata"]["queueLength"] == str(processes * 3)
    assert rendered.env()["SQSINFER_PROCESSES"] == "0"  # the worker derives the same count


def test_queue_length_override_and_scale_options(chart: helm.Chart) -> None:
    values = {
        "keda": {
            "queueLength": 5,
            "scaleOnInFlight": False,
            "awsRegion": "eu-north-1",
            "awsEndpoint": "http://sqs.local:4566",
        }
    }
    metadata = sqs_trigger(render(chart, values))["metadata"]
    assert metadata["queueLength"] == "5"
    assert metadata["scaleOnInFlight"] == "false"
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
        ({}, f"{2 * 2 * 64 + 64}Mi"),  # 2 CPUs x prefetch 2 x 64 MiB + headroom
        (
            {"worker": {"processes": 3, "prefetch": 4, "max_input_bytes": 10 * MiB + 1}},
            f"{3 * 4 * 10 * MiB // MiB + 1 + 64}Mi",
        ),  # rounded up to whole MiB
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
