"""The chart renders exactly the values the worker accepts.

A grid of worker values, around the rules that tie settings together, is rendered by
Helm's own engine; the environment each one gives the pod (or, where the chart refuses,
would give it) is checked by `sqsinfer worker --check-settings`, the worker's own
resolution. The chart renders a case iff the worker accepts it, and where both refuse,
the chart's message names the setting the worker names.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from sqsinfer import cli
from sqsinfer.config import ENV_PREFIX
from tests.deploy.chart import CHART, render

QUEUE = "https://sqs.eu-west-1.amazonaws.com/123456789012/score"
BASE: dict[str, Any] = {
    "queue_url": QUEUE,
    "allowed_input_prefixes": ["s3://in-bucket/in/"],
    "output_prefix": "s3://out-bucket/out/",
    "region": "eu-west-1",
    "processes": 1,
}
SHA = "ab" * 32

# Each case: the worker values changed from BASE, and whether both accept them.
OK, REFUSED = True, False
GRID: list[tuple[dict[str, Any], bool]] = [
    ({}, OK),
    # task_time_s and max_task_time_s: derived when empty, else at least the task time
    ({"task_time_s": 1200}, OK),
    ({"task_time_s": 1200, "max_task_time_s": 900}, REFUSED),
    ({"task_time_s": 1200, "max_task_time_s": 1200}, OK),
    ({"task_time_s": 1200, "max_task_time_s": 0}, OK),
    ({"task_time_s": 20000}, OK),
    ({"task_time_s": 43200}, OK),
    ({"task_time_s": 50000}, REFUSED),
    ({"max_task_time_s": 30}, REFUSED),
    ({"max_task_time_s": 60}, OK),
    ({"max_task_time_s": 50000}, REFUSED),
    ({"task_time_s": 30, "drain_deadline_s": 20}, REFUSED),
    ({"task_time_s": 30, "drain_deadline_s": 30}, OK),
    # a chained stage's settle fits under the task time limit
    ({"next_queue_url": QUEUE + "-next", "task_time_s": 600, "chain_settle_s": 1200}, REFUSED),
    ({"next_queue_url": QUEUE + "-next", "task_time_s": 600, "chain_settle_s": 1199}, OK),
    ({"next_queue_url": QUEUE + "-next", "task_time_s": 600, "max_task_time_s": 620}, REFUSED),
    ({"task_time_s": 600, "max_task_time_s": 620}, OK),  # not chained: no settle is waited
    # the heartbeat's margin, the retry schedule, the stall against the long poll
    ({"heartbeat_s": 21}, REFUSED),
    ({"heartbeat_s": 20}, OK),
    ({"visibility_timeout_s": 30}, REFUSED),
    ({"visibility_timeout_s": 30, "heartbeat_s": 10}, OK),
    ({"retry_base_s": 1000}, REFUSED),
    ({"retry_base_s": 1000, "retry_max_s": 1000}, OK),
    ({"stall_s": 20}, REFUSED),
    ({"stall_s": 5, "wait_time_s": 4}, OK),
    # models and prefixes
    ({"model_path": "s3://models/m.ubj"}, REFUSED),
    ({"model_path": "s3://models/m.ubj", "model_sha256": SHA}, OK),
    ({"output_prefix": "s3://out-bucket/out/{model_version}/"}, REFUSED),
    ({"output_prefix": "s3://out-bucket/out/{model_version}/", "model_version": "v1"}, OK),
    ({"allowed_output_prefixes": ["s3://other-bucket/"]}, REFUSED),
    ({"allowed_output_prefixes": ["s3://out-bucket/ou"]}, REFUSED),  # ou/ holds no out/
    ({"allowed_output_prefixes": ["s3://out-bucket/out", "s3://other-bucket/"]}, OK),
    ({"message_shape": "s3-event", "allowed_input_prefixes": ["s3://out-bucket/"]}, REFUSED),
    ({"message_shape": "auto", "allowed_input_prefixes": ["s3://out-bucket/out/in/"]}, REFUSED),
    ({"message_shape": "s3-event"}, OK),
    # a job's worker
    ({"exit_when_idle_s": 60, "max_tasks": 100}, OK),
]


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    helm.disable_logging()
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def _env_value(value: Any) -> str:
    """A value as the chart writes it (sqsinfer.envValue): lists joined, numbers as JSON."""
    if isinstance(value, list):
        return ",".join(value)
    return value if isinstance(value, str) else json.dumps(value)


def _worker_env(worker: dict[str, Any]) -> dict[str, str]:
    """The pod's SQSINFER_* variables for these values over the chart's defaults, by the
    chart's rule: one a key that is set (not "", null or [])."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["worker"]
    merged = defaults | worker
    return {
        ENV_PREFIX + key.upper(): _env_value(v)
        for key, v in merged.items()
        if v not in ("", None, [])
    }


def _same(rendered: dict[str, str], expected: dict[str, str]) -> bool:
    """Equal, numbers compared as numbers (Go writes 20, Python 20.0)."""

    def number_or_text(text: str) -> Any:
        try:
            return float(text)
        except ValueError:
            return text

    def norm(env: dict[str, str]) -> dict[str, Any]:
        return {k: number_or_text(v) for k, v in env.items()}

    return norm(rendered) == norm(expected)


def _check_settings(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    """`sqsinfer worker --check-settings` in this environment: its exit code and stderr."""
    with monkeypatch.context() as m:
        for name in [n for n in os.environ if n.startswith(ENV_PREFIX)]:
            m.delenv(name)
        for name, value in env.items():
            m.setenv(name, value)
        capsys.readouterr()
        code = cli.main(["worker", "--check-settings"])
        return code, capsys.readouterr().err


def _case_id(case: tuple[dict[str, Any], bool]) -> str:
    changes, accepted = case
    shown = ",".join(f"{k}={v}" for k, v in changes.items()) or "defaults"
    return f"{shown}:{'ok' if accepted else 'refused'}"


@pytest.mark.parametrize("case", GRID, ids=_case_id)
def test_the_chart_renders_what_the_worker_accepts(
    chart: helm.Chart,
    case: tuple[dict[str, Any], bool],
    tmp_path: Path,
    aws_env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    changes, accepted = case
    model = tmp_path / "model.ubj"
    model.write_bytes(b"{}")
    worker = BASE | {"model_path": str(model)} | changes
    expected = _worker_env(worker)
    try:
        env = render(chart, {"worker": worker}).env()
    except (helm.HelmRenderError, helm.HelmValuesError) as exc:
        refused = str(exc)
    else:
        refused = ""
        assert _same({k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}, expected)
    code, stderr = _check_settings(expected, aws_env, capsys)
    assert (not refused, code == 0) == (accepted, accepted), stderr or refused
    if refused:
        assert code == 2
        named = stderr.split("invalid setting: ", 1)[1].split()[0]
        assert named.startswith(ENV_PREFIX), stderr
        key = named.removeprefix(ENV_PREFIX).lower()
        assert f"worker.{key}" in refused or f"/worker/{key}" in refused, (refused, stderr)
