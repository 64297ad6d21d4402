"""The chart's part of the pod deletion cost: off by default; on, a Role that grants patch
on pods and nothing else, the pod's name and namespace, a bound token of its own, and
optionally the admission policy that narrows the grant to the annotation of the caller's
own pod. Every manifest validated against Kubernetes' schemas."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from tests.deploy.chart import CHART, NAMESPACE, Rendered, render
from tests.deploy.test_helm_chart import example, validate_manifest

ON = {"worker": {"pod_deletion_cost": True}}
TOKEN_DIR = "/var/run/secrets/sqsinfer/kube-api"
NEWEST = kubernetes_validate.utils.latest_version()


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    helm.disable_logging()
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def _values(*more: dict[str, Any]) -> dict[str, Any]:
    values = example("stage1")
    for extra in more:
        for key, value in extra.items():
            values[key] = {**values.get(key, {}), **value}
    return values


def _pod(rendered: Rendered) -> dict[str, Any]:
    spec: dict[str, Any] = rendered.one("Deployment")["spec"]["template"]["spec"]
    return spec


def test_off_by_default(chart: helm.Chart) -> None:
    rendered = render(chart, example("stage1"))
    assert not {"Role", "RoleBinding", "ValidatingAdmissionPolicy"} & rendered.kinds()
    assert "POD_NAME" not in {e["name"] for e in rendered.container()["env"]}
    assert "kube-api" not in {v["name"] for v in _pod(rendered)["volumes"]}


def test_on_the_pod_patches_itself_with_a_token_of_its_own(chart: helm.Chart) -> None:
    rendered = render(chart, _values(ON))
    role, binding = rendered.one("Role"), rendered.one("RoleBinding")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    pod = _pod(rendered)
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": NAMESPACE}
    ]
    assert pod["automountServiceAccountToken"] is False  # the token is this volume's alone
    env = {e["name"]: e for e in rendered.container()["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["SQSINFER_POD_DELETION_COST"]["value"] == "true"
    assert env["SQSINFER_KUBE_TOKEN_DIR"]["value"] == TOKEN_DIR
    (volume,) = [v for v in pod["volumes"] if v["name"] == "kube-api"]
    sources = volume["projected"]["sources"]
    assert sources[0]["serviceAccountToken"] == {"path": "token", "expirationSeconds": 3600}
    assert sources[1]["configMap"]["name"] == "kube-root-ca.crt"
    mounts = {m["name"]: m for m in rendered.container()["volumeMounts"]}
    assert mounts["kube-api"] == {"name": "kube-api", "mountPath": TOKEN_DIR, "readOnly": True}
    for doc in rendered.docs:
        validate_manifest(doc, NEWEST)


def test_a_token_dir_of_ones_own_is_where_the_volume_goes(chart: helm.Chart) -> None:
    rendered = render(
        chart, _values({"worker": {"pod_deletion_cost": True, "kube_token_dir": "/k"}})
    )
    mounts = {m["name"]: m for m in rendered.container()["volumeMounts"]}
    assert mounts["kube-api"]["mountPath"] == "/k"
    env = {e["name"]: e.get("value") for e in rendered.container()["env"]}
    assert env["SQSINFER_KUBE_TOKEN_DIR"] == "/k"  # once, from worker.kube_token_dir
    names = [e["name"] for e in rendered.container()["env"]]
    assert names.count("SQSINFER_KUBE_TOKEN_DIR") == 1


def test_the_admission_policy_narrows_the_grant(chart: helm.Chart) -> None:
    rendered = render(chart, _values(ON, {"podDeletionCost": {"admissionPolicy": True}}))
    policy = rendered.one("ValidatingAdmissionPolicy")
    binding = rendered.one("ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    account = _pod(rendered)["serviceAccountName"]
    (condition,) = policy["spec"]["matchConditions"]
    assert f"system:serviceaccount:{NAMESPACE}:{account}" in condition["expression"]
    rules = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rules == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["pods"]}
    ]
    assert len(policy["spec"]["validations"]) == 3
    for doc in rendered.docs:
        validate_manifest(doc, NEWEST)


def test_off_no_policy_even_when_asked(chart: helm.Chart) -> None:
    rendered = render(chart, _values({"podDeletionCost": {"admissionPolicy": True}}))
    assert "ValidatingAdmissionPolicy" not in rendered.kinds()
