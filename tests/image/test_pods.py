"""Two chained stages, each the chart's own Deployment played by podman, against a stand-in
on the host's loopback: ready through their own probes, a run of real tasks of every
format and a few bad messages, a read-only root, UID 10001, and the chart's volumes.

Everything is checked from outside the containers: through the health port, the queues
and buckets, /proc on the host, and the engine.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from sqsinfer import sizing
from tests.deploy.chart import render
from tests.image import engine, workload
from tests.image.conftest import REPORT

pytestmark = pytest.mark.timeout(600)
STAGES = ("stage1", "stage2")
UID = 10001


@pytest.fixture(scope="module")
def stages(
    image: str, chart: helm.Chart, chain: workload.Chain, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, engine.Release]]:
    """Both stages' releases rendered as `helm install` would (KEDA on) and played."""
    with contextlib.ExitStack() as stack:
        releases = {}
        for name in STAGES:
            rendered = render(chart, workload.stage_values(image, chain, name), name=name)
            assert rendered.kinds() >= {"Deployment", "ScaledObject", "TriggerAuthentication"}
            workdir = tmp_path_factory.mktemp(name)
            releases[name] = stack.enter_context(
                engine.released(rendered.one("Deployment"), workdir)
            )
        yield releases


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths at which two manifests differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(a.keys() | b.keys())
        return [d for k in keys for d in differences(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


def test_only_what_a_local_engine_cannot_do_is_changed(stages: dict[str, engine.Release]) -> None:
    for name, release in stages.items():
        played = yaml.safe_load(release.manifest.read_text())
        pod = ".spec.template.spec"
        assert differences(release.deployment, played) == [
            f"{pod}.containers[0].ports",
            f"{pod}.volumes[0].emptyDir",
            f"{pod}.volumes[0].hostPath",
            f"{pod}.volumes[1].emptyDir",
            f"{pod}.volumes[1].hostPath",
        ], name
        REPORT[f"{name}: changed for podman"] = list(release.pod.changes)


def test_the_pods_become_ready_through_their_own_probes(stages: dict[str, engine.Release]) -> None:
    for name, release in stages.items():
        engine.wait_ready(release)
        kubelet = release.kubelet
        liveness = kubelet.probes["livenessProbe"]
        engine.wait_for(
            lambda k=kubelet: k.seconds_to("livenessProbe") is not None,
            f"{name}'s first liveness probe",
            timeout_s=2 * liveness.period_s + liveness.timeout_s,
        )
        assert kubelet.failed == ""
        probes = {
            kind: [probe.path, probe.port, probe.period_s, probe.failure_threshold]
            for kind, probe in kubelet.probes.items()
        }
        assert probes["startupProbe"][:2] == ["/readyz", release.pod.health_port()]
        REPORT[f"{name}: probes"] = {
            "probes (path, port, period s, failure threshold)": probes,
            "startup passed at s": kubelet.seconds_to("startupProbe"),
            "ready at s": kubelet.seconds_to("readinessProbe"),
        }


def test_a_two_stage_run_commits_and_chains_every_task(
    stages: dict[str, engine.Release], chain: workload.Chain
) -> None:
    for release in stages.values():
        engine.wait_ready(release)
    for task_id, uri in chain.inputs.items():
        chain.send("stage1", f'{{"task_id": "{task_id}", "input": "{uri}"}}')
    for name, reasons in chain.reasons.items():
        for body in reasons:
            chain.send(name, body)
    engine.wait_for(lambda: workload.settled(chain), "both stages to finish", timeout_s=300)
    assert workload.check_chain(chain) == []
    one, two = stages["stage1"].pod, stages["stage2"].pod
    assert one.metric('sqsinfer_tasks_total{outcome="committed"}') == len(chain.tasks)
    assert one.metric('sqsinfer_tasks_total{outcome="rejected"}') == len(chain.reasons["stage1"])
    assert two.metric('sqsinfer_tasks_total{outcome="committed"}') == len(chain.tasks)
    for name, release in stages.items():
        assert release.pod.restarts() == 0, name  # within the chart's memory limit, no OOM kill
        assert release.kubelet.failed == "", name
        REPORT[f"{name}: memory"] = memory_report(release)


def memory_report(release: engine.Release) -> dict[str, Any]:
    """Peak resident memory of each process (VmHWM), MiB, beside the chart's limit."""
    peaks: dict[str, list[int]] = {}
    for pid in engine.tree(release.pod.pid()):
        status = Path(f"/proc/{pid}/status").read_text()
        hwm = next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmHWM"))
        peaks.setdefault(role(engine.cmdline(pid)), []).append(round(hwm / 1024))
    limit = release.pod.spec["resources"]["limits"]["memory"]
    return {"peak RSS MiB": peaks, "limit": limit}


def role(cmdline: str) -> str:
    for marker, name in (
        ("tini", "tini"),
        ("spawn_main", "inference"),
        ("resource_tracker", "resource tracker"),
        ("sqsinfer worker", "worker"),
    ):
        if marker in cmdline:
            return name
    return cmdline.split(maxsplit=1)[0]


def test_the_root_is_read_only_and_every_process_runs_as_10001(
    stages: dict[str, engine.Release],
) -> None:
    for name, release in stages.items():
        engine.wait_ready(release)
        init = release.pod.pid()
        assert engine.cmdline(init).startswith("tini -- sqsinfer worker"), name  # PID 1
        processes = engine.tree(init)
        assert len(processes) >= 4, processes  # tini, the worker, 2 inference processes
        for pid in processes:
            assert engine.uids(pid) == (UID,) * 4, engine.cmdline(pid)
        mounts = Path(f"/proc/{init}/mountinfo").read_text().splitlines()
        (root,) = [line.split() for line in mounts if line.split()[4] == "/"]
        assert "ro" in root[5].split(","), root
        inside = release.pod.exec("touch", "/written-by-the-test")
        assert inside.returncode != 0
        assert "Read-only file system" in inside.stderr
        assert release.pod.exec("id", "-u").stdout.strip() == str(UID)
        with pytest.raises(OSError) as refused:
            Path(f"/proc/{init}/root/written-from-outside").write_text("x")
        assert refused.value.errno == errno.EROFS


def test_tmp_and_dev_shm_are_the_charts_volumes_at_the_charts_sizes(
    stages: dict[str, engine.Release], chain: workload.Chain
) -> None:
    for name, release in stages.items():
        engine.wait_ready(release)
        init = release.pod.pid()
        volumes = {
            v["name"]: v["emptyDir"]
            for v in release.deployment["spec"]["template"]["spec"]["volumes"]
            if "emptyDir" in v
        }
        assert volumes["dshm"]["medium"] == "Memory"
        sizes = {}
        for path, volume in (("/dev/shm", "dshm"), ("/tmp", "tmp")):
            seen = f"/proc/{init}/root{path}"
            stat = os.statvfs(seen)
            assert stat.f_blocks * stat.f_frsize == sizing.parse_quantity(
                volumes[volume]["sizeLimit"]
            )
            assert (
                os.stat(seen).st_dev == os.stat(release.pod.volumes[volume]).st_dev
            )  # the pod's own
            sizes[path] = volumes[volume]["sizeLimit"]
        REPORT[f"{name}: volumes"] = sizes
    # Stage 1's model came from S3, pinned, into the chart's /tmp (sized for max_model_bytes).
    fetched = stages["stage1"].pod.volumes["tmp"] / "sqsinfer-model" / f"{chain.model1_sha256}.ubj"
    assert fetched.read_bytes() == chain.model1.read_bytes()
