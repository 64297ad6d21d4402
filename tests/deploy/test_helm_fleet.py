"""The chart at fleet scale: job mode (a KEDA ScaledJob), the disruption budget, the
oldest-message trigger and the dashboard's ConfigMap.

Rendered by Helm's own engine and validated as `test_helm_chart` does; a ScaledJob's
`jobTargetRef` is validated as the batch/v1 Job KEDA makes of it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from sqsinfer.config import ENV_PREFIX
from tests.deploy.chart import KEDA_API, KEDA_JOB_API, MONITORING_APIS, Rendered, render
from tests.deploy.test_helm_chart import (
    BASE_KINDS,
    EVERYTHING_ON,
    KUBE_VERSIONS,
    STAGES,
    example,
    flatten,
    shutdown_settings,
    validate_manifest,
    with_values,
)

JOB_KINDS = BASE_KINDS - {"Deployment", "ScaledObject", "PodDisruptionBudget"} | {"ScaledJob"}
IDLE_ENV = ENV_PREFIX + "EXIT_WHEN_IDLE_S"
JOB_MODE = {"keda": {"mode": "job"}}
DO_NOT_DISRUPT = {
    "karpenter.sh/do-not-disrupt": "true",
    "cluster-autoscaler.kubernetes.io/safe-to-evict": "false",
}
CHART = Path(__file__).resolve().parents[2] / "helm" / "sqsinfer"
DASHBOARD = CHART / "dashboards" / "sqsinfer-grafana.json"


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    helm.disable_logging()
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def job_mode(values: dict[str, Any] | None = None) -> dict[str, Any]:
    return with_values(values, keda__mode="job")


def job_spec(rendered: Rendered) -> dict[str, Any]:
    spec: dict[str, Any] = rendered.one("ScaledJob")["spec"]
    return spec


def job_env(rendered: Rendered) -> dict[str, str]:
    (container,) = job_spec(rendered)["jobTargetRef"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


# -- Job mode ---------------------------------------------------------------------------
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("stage", [None, *STAGES])
def test_job_mode_renders_a_scaled_job_in_place_of_the_deployment(
    chart: helm.Chart, stage: str | None, kube_version: str
) -> None:
    rendered = render(chart, job_mode(example(stage) if stage else None), name=stage or "stage1")
    assert rendered.kinds() == JOB_KINDS | ({"ServiceMonitor"} if stage else set())
    for doc in rendered.docs:
        validate_manifest(doc, kube_version)


def test_job_mode_lints_clean() -> None:
    everything = job_mode(with_values(example("stage1"), keda__oldestMessageAge__enabled=True))
    report = helm.lint(CHART, everything, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_knob_on_in_job_mode_renders_valid_manifests(
    chart: helm.Chart, kube_version: str
) -> None:
    knobs = flatten(EVERYTHING_ON) | {
        "keda__mode": "job",
        "keda__pausedReplicas": None,  # the ScaledObject's alone
        "keda__fallback": {},
        "keda__oldestMessageAge__enabled": True,
        "grafanaDashboard__enabled": True,
        "worker__exit_when_idle_s": 120,
        "worker__max_tasks": 1000,
    }
    rendered = render(chart, with_values(example("stage1"), **knobs))
    kinds = {"ServiceMonitor", "PrometheusRule", "NetworkPolicy", "ConfigMap"}
    assert rendered.kinds() == JOB_KINDS | kinds
    for doc in rendered.docs:
        validate_manifest(doc, kube_version)


def test_the_jobs_pod_is_the_deployments_pod(chart: helm.Chart) -> None:
    """One pod template for both: a Job's differs only where a Job's pod must."""
    values = example("stage1")
    deployment = render(chart, values).one("Deployment")["spec"]["template"]
    job = copy.deepcopy(job_spec(render(chart, job_mode(values)))["jobTargetRef"]["template"])
    assert job["spec"].pop("restartPolicy") == "Never"  # the Job decides on a failed pod
    assert job["metadata"].pop("annotations") == DO_NOT_DISRUPT  # it ends by itself
    (container,) = job["spec"]["containers"]
    assert container["env"].pop() == {"name": IDLE_ENV, "value": "60"}
    for constraint in deployment["spec"]["topologySpreadConstraints"]:
        # a Job's pods have no pod-template-hash: the spread counts all of the stage's
        assert constraint.pop("matchLabelKeys") == ["pod-template-hash"]
    assert job == deployment


def test_the_scaled_job_follows_kedas_long_running_guidance(chart: helm.Chart) -> None:
    values = example("stage1")
    spec = job_spec(render(chart, job_mode(values)))
    target = spec["jobTargetRef"]
    assert (target["parallelism"], target["completions"]) == (1, 1)  # a Job is one worker
    assert target["backoffLimit"] == 2
    assert "activeDeadlineSeconds" not in target  # the worker ends its Job when idle
    # an eviction or a preemption is not the worker's failure
    assert target["podFailurePolicy"]["rules"] == [
        {
            "action": "Ignore",
            "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
        },
    ]
    assert spec["rollout"] == {"strategy": "gradual"}  # an upgrade leaves running Jobs be
    assert spec["scalingStrategy"] == {"strategy": "default"}
    assert (spec["successfulJobsHistoryLimit"], spec["failedJobsHistoryLimit"]) == (5, 10)
    assert spec["minReplicaCount"] == 0
    assert spec["maxReplicaCount"] == values["keda"]["maxReplicas"]
    # the same triggers as the ScaledObject's: a Job takes what a Deployment's pod would
    scaled = render(chart, values).one("ScaledObject")["spec"]
    assert spec["triggers"] == scaled["triggers"]
    assert spec["pollingInterval"] == scaled["pollingInterval"]


def test_the_scaled_jobs_knobs(chart: helm.Chart) -> None:
    knobs = {
        "scalingStrategy": "eager",
        "rollout": "default",
        "successfulJobsHistoryLimit": 0,
        "failedJobsHistoryLimit": 3,
        "backoffLimit": 0,
        "activeDeadlineSeconds": 7200,
    }
    rendered = render(chart, job_mode({"keda": {"job": knobs, "paused": True}}))
    spec = job_spec(rendered)
    assert spec["scalingStrategy"] == {"strategy": "eager"}
    assert spec["rollout"] == {"strategy": "default"}
    assert (spec["successfulJobsHistoryLimit"], spec["failedJobsHistoryLimit"]) == (0, 3)
    assert spec["jobTargetRef"]["backoffLimit"] == 0
    assert spec["jobTargetRef"]["activeDeadlineSeconds"] == 7200
    annotations = rendered.one("ScaledJob")["metadata"]["annotations"]
    assert annotations == {"autoscaling.keda.sh/paused": "true"}
    for doc in rendered.docs:
        validate_manifest(doc, KUBE_VERSIONS[0])
    with pytest.raises(helm.HelmValuesError, match="/keda/job/rollout"):
        chart.validate_schema(job_mode({"keda": {"job": {"rollout": "rolling"}}}))


def test_a_jobs_worker_exits_when_its_queue_stays_empty(chart: helm.Chart, tmp_path: Path) -> None:
    env = job_env(render(chart, job_mode()))
    assert env[IDLE_ENV] == "60"
    assert shutdown_settings(env, tmp_path).exit_when_idle_s == 60  # the worker reads it
    rendered = render(chart, job_mode({"worker": {"exit_when_idle_s": 300}}))
    (container,) = job_spec(rendered)["jobTargetRef"]["template"]["spec"]["containers"]
    assert [e["value"] for e in container["env"] if e["name"] == IDLE_ENV] == ["300"]  # once
    assert IDLE_ENV not in render(chart).env()  # a Deployment's worker runs until stopped


def test_a_job_may_be_bounded_by_tasks(chart: helm.Chart, tmp_path: Path) -> None:
    env = job_env(render(chart, job_mode({"worker": {"max_tasks": 500}})))
    assert shutdown_settings(env, tmp_path).max_tasks == 500


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"keda": {"enabled": False}}, "keda.mode job needs keda.enabled"),
        ({"keda": {"scaleOnInFlight": True}}, "keda.scaleOnInFlight must be false"),
        ({"worker": {"pod_deletion_cost": True}}, "worker.pod_deletion_cost must be off"),
        # the default grace (90 s) + task_time_s (60 s)
        ({"keda": {"job": {"activeDeadlineSeconds": 149}}}, r"\(149\) must be at least 150"),
        (
            {"keda": {"job": {"activeDeadlineSeconds": 69}}, "worker": {"task_time_s": 20}},
            r"\(69\) must be at least 70",  # grace: drain 30 + 15 + 5 = 50, + 20
        ),
    ],
)
def test_job_mode_refuses_values_that_defeat_it(
    chart: helm.Chart, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        render(chart, job_mode(values))


def test_an_active_deadline_of_one_task_after_the_grace_is_accepted(chart: helm.Chart) -> None:
    values = job_mode({"keda": {"job": {"activeDeadlineSeconds": 150}}})
    assert job_spec(render(chart, values))["jobTargetRef"]["activeDeadlineSeconds"] == 150


def test_job_mode_needs_kedas_scaled_job(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmRenderError, match=f"--api-versions {KEDA_JOB_API}"):
        render(chart, job_mode(), api_versions=(KEDA_API, *MONITORING_APIS))
    assert render(chart, job_mode(), api_versions=(KEDA_JOB_API,)).one("ScaledJob")


# -- The disruption budget --------------------------------------------------------------
def test_the_pdb_lets_a_share_of_the_pods_go_at_once(chart: helm.Chart) -> None:
    """A percentage: a node rotation of 641 pods moves 65 at a time (rounded up), not 1."""
    pdb = render(chart).one("PodDisruptionBudget")["spec"]
    assert pdb["maxUnavailable"] == "10%" and "minAvailable" not in pdb
    for knob, value in (("maxUnavailable", 25), ("maxUnavailable", "5%"), ("minAvailable", "90%")):
        pdb = render(chart, {"podDisruptionBudget": {knob: value}}).one("PodDisruptionBudget")
        assert pdb["spec"][knob] == value
        validate_manifest(pdb, KUBE_VERSIONS[0])


def test_job_mode_has_no_pdb(chart: helm.Chart) -> None:
    """Jobs have no scale: a PDB could hold only an integer minAvailable of them, and an
    evicted Job's pod drains like any other and KEDA starts another Job."""
    assert "PodDisruptionBudget" not in render(chart, job_mode()).kinds()


# -- The oldest-message trigger ---------------------------------------------------------
@pytest.mark.parametrize("mode", ["deployment", "job"])
def test_the_oldest_message_trigger_is_optional(chart: helm.Chart, mode: str) -> None:
    values = with_values(example("stage1"), keda__mode=mode)
    kind = "ScaledJob" if mode == "job" else "ScaledObject"
    assert [t["type"] for t in render(chart, values).one(kind)["spec"]["triggers"]] == [
        "aws-sqs-queue"
    ]
    values = with_values(values, keda__oldestMessageAge={"enabled": True, "targetAgeS": 900})
    rendered = render(chart, values)
    depth, age = rendered.one(kind)["spec"]["triggers"]
    queue_url = values["worker"]["queue_url"]
    assert age == {
        "type": "aws-cloudwatch",
        "authenticationRef": depth["authenticationRef"],
        "metadata": {
            "namespace": "AWS/SQS",
            "metricName": "ApproximateAgeOfOldestMessage",
            "dimensionName": "QueueName",
            "dimensionValue": queue_url.rsplit("/", 1)[1],
            "metricStat": "Maximum",
            "metricStatPeriod": "60",
            "metricCollectionTime": "300",
            "metricEndTimeOffset": "60",
            "targetMetricValue": "900",
            "activationTargetMetricValue": "0",
            "minMetricValue": "0",
            "awsRegion": depth["metadata"]["awsRegion"],
        },
    }
    for doc in rendered.docs:
        validate_manifest(doc, KUBE_VERSIONS[-1])


# -- The Grafana dashboard --------------------------------------------------------------
def test_the_dashboard_ships_in_the_chart_for_grafanas_sidecar(chart: helm.Chart) -> None:
    assert "ConfigMap" not in render(chart).kinds()  # opt-in
    rendered = render(chart, {"grafanaDashboard": {"enabled": True}})
    config_map = rendered.one("ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "inference"
    (text,) = config_map["data"].values()
    assert json.loads(text) == json.loads(DASHBOARD.read_text())  # the chart's one copy
    validate_manifest(config_map, KUBE_VERSIONS[0])
    own = {
        "enabled": True,
        "labels": {"dashboards": "ml", "grafana_dashboard": None},  # null drops a default
        "annotations": {"grafana_folder": "Inference"},
        "namespace": "monitoring",
    }
    meta = render(chart, {"grafanaDashboard": own}).one("ConfigMap")["metadata"]
    assert meta["labels"]["dashboards"] == "ml" and "grafana_dashboard" not in meta["labels"]
    assert meta["annotations"] == {"grafana_folder": "Inference"}
    assert meta["namespace"] == "monitoring"


# -- Node autoscalers -------------------------------------------------------------------
def pod_annotations(rendered: Rendered) -> dict[str, str]:
    if "ScaledJob" in rendered.kinds():
        template = job_spec(rendered)["jobTargetRef"]["template"]
    else:
        template = rendered.one("Deployment")["spec"]["template"]
    annotations: dict[str, str] = template["metadata"].get("annotations", {})
    return annotations


@pytest.mark.parametrize(
    ("values", "protected"),
    [
        ({}, False),  # a Deployment's pods never end: their nodes could never go
        (JOB_MODE, True),  # a Job's pod ends once its queue is empty
        ({"nodeAutoscaler": {"doNotDisrupt": True}}, True),
        (with_values(JOB_MODE, nodeAutoscaler__doNotDisrupt=False), False),
    ],
)
def test_node_autoscalers_leave_a_jobs_pod_be(
    chart: helm.Chart, values: dict[str, Any], protected: bool
) -> None:
    values = with_values(values, podAnnotations={"example.com/team": "ml"})
    annotations = pod_annotations(render(chart, values))
    assert annotations == {"example.com/team": "ml", **(DO_NOT_DISRUPT if protected else {})}


def test_pod_annotations_win_over_the_node_autoscaler_ones(chart: helm.Chart) -> None:
    values = with_values(JOB_MODE, podAnnotations={"karpenter.sh/do-not-disrupt": "false"})
    assert pod_annotations(render(chart, values))["karpenter.sh/do-not-disrupt"] == "false"
