"""One sizing formula for /dev/shm, /tmp and memory: the chart's, `sqsinfer plan`'s and the
docs' are `sqsinfer.sizing`'s.

The chart is rendered with Helm's own engine; what it renders is compared with the
formula fed by the worker's own reading of the rendered environment (`Settings.load`),
so a default the chart assumes for an unset setting is the worker's too.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from sqsinfer import config, sizing
from sqsinfer.config import Settings
from tests.deploy.chart import CHART, ROOT, Rendered, render

MiB = sizing.MIB
PIN = "ab" * 32
S3_MODEL = {"model_path": "s3://model-bucket/fraud/v3.ubj", "model_sha256": PIN}
REQUIRED = {
    "queue_url": "https://sqs.eu-west-1.amazonaws.com/123456789012/q",
    "allowed_input_prefixes": ["s3://in-bucket/"],
    "output_prefix": "s3://out-bucket/",
}


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    helm.disable_logging()
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def worker_reading(rendered: Rendered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The worker's own settings from the rendered environment, with the CPUs the
    container's limit gives it (what it reads from its cgroup)."""
    cpu = rendered.container()["resources"]["limits"]["cpu"]
    quota = int(cpu[:-1]) / 1000 if str(cpu).endswith("m") else float(cpu)
    monkeypatch.setattr(config, "_cgroup_cpu_quota", lambda: quota)
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda _: set(range(64)))
    env = {k: v for k, v in rendered.env().items() if k.startswith(config.ENV_PREFIX)}
    if not env["SQSINFER_MODEL_PATH"].startswith("s3://"):
        model = tmp_path / "model.ubj"
        model.write_bytes(b"{}")
        env["SQSINFER_MODEL_PATH"] = str(model)  # the loader checks the file exists
    return Settings.load(env)


def formula(settings: Settings, values: dict[str, Any]) -> sizing.PodSizing:
    per = settings.prefetch if isinstance(settings.prefetch, int) else settings.max_prefetch
    in_tmp = sizing.model_in_tmp(settings.model_path, values["worker"].get("model_dir", ""))
    return sizing.size(
        sizing.PodSettings(
            processes=settings.processes,
            in_flight_per_process=per,
            max_input_bytes=settings.max_input_bytes,
            max_decoded_bytes=settings.max_decoded_bytes,
            fetched_model_bytes=settings.max_model_bytes if in_tmp else 0,
            model_resident_mib=values.get("model", {}).get(
                "residentMiB", sizing.MODEL_RESIDENT_MIB
            ),
            shm_headroom_mib=values.get("shm", {}).get("headroomMiB", sizing.SHM_HEADROOM_MIB),
        )
    )


def rendered_sizes(rendered: Rendered) -> dict[str, int]:
    """What the chart renders, in bytes: the two volumes, the memory request and limit."""
    pod = rendered.one("Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v["emptyDir"]["sizeLimit"] for v in pod["volumes"]}
    resources = rendered.container()["resources"]
    return {
        "shm": sizing.parse_quantity(volumes["dshm"]),
        "tmp": sizing.parse_quantity(volumes["tmp"]),
        "limit": sizing.parse_quantity(resources["limits"]["memory"]),
        "request": sizing.parse_quantity(resources["requests"]["memory"]),
    }


VALUE_SETS: list[dict[str, Any]] = [
    {},  # the defaults: 2 CPUs, prefetch auto up to 8, 64 MiB inputs, the worker's 256 MiB
    {"worker": {"prefetch": 3}},  # pinned: its own count, not max_prefetch
    {"worker": {"processes": 3, "prefetch": 4, "max_input_bytes": 10 * MiB + 1}},
    {"worker": {**S3_MODEL}},  # the worker's 4 GiB max_model_bytes lands in /tmp
    {"worker": {**S3_MODEL, "max_model_bytes": 300 * MiB + 5, "model_dir": "/tmp/m"}},
    {"worker": {**S3_MODEL, "model_dir": "/models-cache"}},  # another volume: not /tmp
    {
        "resources": {"limits": {"cpu": "1500m"}},
        "worker": {"max_decoded_bytes": 32 * MiB, "max_prefetch": 2},
        "model": {"residentMiB": 500},
    },
    {"shm": {"headroomMiB": 1}, "worker": {"max_input_bytes": 1, "max_prefetch": 1}},
]


@pytest.mark.parametrize("values", VALUE_SETS, ids=[json.dumps(v) for v in VALUE_SETS])
def test_the_chart_sizes_the_pod_by_the_formula(
    chart: helm.Chart, values: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = {**values, "worker": {**REQUIRED, **values.get("worker", {})}}
    rendered = render(chart, values)
    pod = formula(worker_reading(rendered, tmp_path, monkeypatch), values)
    assert rendered_sizes(rendered) == {
        "shm": pod.shm_mib * MiB,
        "tmp": pod.tmp_mib * MiB,
        "limit": pod.memory_mib * MiB,
        "request": pod.memory_mib * MiB,  # Guaranteed: the request is the limit
    }


def test_the_defaults_by_hand(chart: helm.Chart) -> None:
    """2 processes × 8 in flight × 64 MiB + 64; 130 + 1088 + 2 × (100 + 64 + 3 × 256 + 8)."""
    assert rendered_sizes(render(chart)) == {
        "shm": 1088 * MiB,
        "tmp": 64 * MiB,
        "limit": 3098 * MiB,
        "request": 3098 * MiB,
    }
    s3 = rendered_sizes(render(chart, {"worker": S3_MODEL}))
    assert s3["tmp"] == (64 + 4096) * MiB  # the model may be as large as the worker allows


def test_explicit_sizes_at_or_above_the_formula_are_kept(chart: helm.Chart) -> None:
    values = {
        "shm": {"sizeLimit": "1088Mi"},
        "tmp": {"sizeLimit": "1Gi"},
        "resources": {"limits": {"cpu": "2", "memory": "3098Mi"}, "requests": {"memory": "3Gi"}},
    }
    rendered = render(chart, values)
    assert rendered_sizes(rendered) == {
        "shm": 1088 * MiB,
        "tmp": 1024 * MiB,
        "limit": 3098 * MiB,
        "request": 3072 * MiB,  # a request set is the user's
    }
    for memory in ("3.1Gi", "3300M", 3_300_000_000, "4Gi"):  # 3175, 3148, 3148, 4096 MiB
        render(chart, {"resources": {"limits": {"memory": memory}}})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"resources": {"limits": {"memory": "3097Mi"}}},
            re.escape(
                "resources.limits.memory (3097Mi) is below the 3098Mi the pod needs: main process "
                "130 + /dev/shm 1088 + 2 processes x (100 baseline + 64 model (model.residentMiB) "
                "+ 776 to decode: 3 x 256 (worker.max_decoded_bytes) + 8) MiB"
            ),
        ),
        ({"resources": {"limits": {"memory": "3Gi"}}}, r"memory \(3Gi\) is below the 3098Mi"),
        (
            {"resources": {"limits": {"memory": 3_000_000_000}}},
            r"memory \(3000000000\) is below the 3098Mi",
        ),
        (
            {"shm": {"sizeLimit": "1087Mi"}},
            re.escape(
                "shm.sizeLimit (1087Mi) is below the 1088Mi /dev/shm needs: 16 in-flight inputs "
                "(2 processes x worker.max_prefetch 8) x 64 MiB (worker.max_input_bytes) + 64 MiB"
            ),
        ),
        (
            {"shm": {"sizeLimit": "320Mi"}, "worker": {"prefetch": 3}},
            r"shm.sizeLimit \(320Mi\) is below the 448Mi .* worker.prefetch 3\)",
        ),
        (
            {"worker": S3_MODEL, "tmp": {"sizeLimit": "64Mi"}},
            r"tmp.sizeLimit \(64Mi\) is below the 4160Mi /tmp needs: 64 MiB of scratch \+ 4096 "
            r"MiB for the model fetched from S3 into /tmp \(worker.max_model_bytes",
        ),
    ],
    ids=["memory", "memory-gi", "memory-bytes", "shm", "shm-pinned", "tmp"],
)
def test_sizes_below_the_formula_stop_the_render(
    chart: helm.Chart, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        render(chart, values)


def test_a_stage_that_cannot_fit_its_memory_says_what_to_lower(chart: helm.Chart) -> None:
    """The example stage 1 without its max_decoded_bytes: 4 processes do not fit 4Gi."""
    values = {"worker": {"processes": 4, "prefetch": 2}, "resources": {"limits": {"memory": "4Gi"}}}
    with pytest.raises(helm.HelmRenderError) as error:
        render(chart, values)
    text = str(error.value)
    assert "below the 4466Mi the pod needs" in text
    assert "lower worker.max_decoded_bytes, worker.max_input_bytes, worker.prefetch" in text


# -- the other users of the formula --------------------------------------------------------
def test_plan_prints_the_pod_sizing_of_the_formula() -> None:
    args = ["--tasks", "1000", "--seconds-per-task", "1", "--processes", "3", "--pods-max", "2"]
    args += ["--max-prefetch", "4", "--max-input-bytes", str(10 * MiB)]
    args += ["--model-path", "s3://models/m.ubj", "--max-model-bytes", str(300 * MiB)]
    command = [sys.executable, "-m", "sqsinfer", "plan", *args]
    env = {"PATH": "/usr/bin:/bin", "COLUMNS": "200"}
    doc = json.loads(
        subprocess.run(
            [*command, "--json"], capture_output=True, env=env, text=True, check=True
        ).stdout
    )
    pod = sizing.size(sizing.PodSettings(3, 4, 10 * MiB, 256 * MiB, fetched_model_bytes=300 * MiB))
    assert doc["sizing"]["memory_mib"] == pod.memory_mib == 130 + 184 + 3 * (100 + 64 + 776)
    assert (doc["sizing"]["shm_mib"], doc["sizing"]["tmp_mib"]) == (184, 364)
    text = subprocess.run(command, capture_output=True, env=env, text=True, check=True).stdout
    for line in pod.explain().values():
        assert line in " ".join(text.split()), line
    # a pinned prefetch (here from the worker's own variable) sizes by its own count
    pinned = {**env, "SQSINFER_PREFETCH": "3"}
    done = subprocess.run(
        [*command, "--json"], capture_output=True, env=pinned, text=True, check=True
    )
    assert json.loads(done.stdout)["sizing"]["shm_mib"] == 3 * 3 * 10 + 64


def test_the_docs_give_the_formula_and_its_defaults() -> None:
    docs = " ".join((ROOT / "docs" / "deployment.md").read_text().split())
    defaults = sizing.size(sizing.PodSettings(2, 8, 64 * MiB, 256 * MiB))
    for line in defaults.explain().values():
        assert line in docs, line
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    constants = {
        "main process": sizing.MAIN_PROCESS_MIB,
        "baseline": sizing.PROCESS_BASELINE_MIB,
        "scratch": sizing.TMP_SCRATCH_MIB,
    }
    for name, value in constants.items():  # the chart's comment states them too
        assert re.search(rf"{value} MiB {name}|{value} MiB {name.split()[0]}", helpers), name


@pytest.mark.parametrize(
    ("text", "size"),
    [("64Mi", 64 * MiB), ("1.5Gi", 3 * 2**29), ("2G", 2 * 10**9), (1024, 1024), ("1500m", 2)],
)
def test_quantities(text: str | int, size: int) -> None:
    assert sizing.parse_quantity(text) == size


def test_a_quantity_that_is_none_is_refused() -> None:
    with pytest.raises(ValueError, match="not a quantity of bytes: 'lots'"):
        sizing.parse_quantity("lots")
