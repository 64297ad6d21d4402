"""A pod's life through the container engine: its cold start, a SIGKILL of its container
and the new one after it, and its stop with the chart's grace period.

Each test plays a release of its own (its own queue, its own volumes), rendered by the
chart as for a cluster and played as test_pods.py plays the stages.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from sqsinfer.lab import stage, synthetic
from tests.deploy.chart import render
from tests.image import engine, workload
from tests.image.conftest import REPORT

pytestmark = pytest.mark.timeout(600)
COLD_STARTS = 3
SEGMENT_PREFIX = "sqsinfer-"
# A task slow enough to be caught computing (about three seconds on a quiet core): 300,000
# rows through 1,200 trees of depth 8. It must outlast the time the engine takes to deliver
# the stop (seconds on a loaded host), or the first task ends and the second starts before
# SIGTERM arrives, and the pod releases one message instead of two.
SLOW_ROWS, SLOW_TREES = 300_000, 1200


def release(
    image: str,
    chart: helm.Chart,
    chain: workload.Chain,
    name: str,
    model_folder: Path | None = None,
    **worker: Any,
) -> dict[str, Any]:
    """The Deployment of a release with a queue of its own, reading the chain's inputs and
    writing under <name>/. Its model: the chain's stage-1 model, fetched from S3 with its
    pin, or the chart's model volume (a hostPath of `model_folder`) when given."""
    queue = stage.create_queue(chain.sqs, f"lane-{name}")
    settings = {
        "queue_url": queue.url,
        "model_path": chain.uri("models/stage1.ubj"),
        "model_sha256": chain.model1_sha256,
        "allowed_input_prefixes": [chain.uri("in/")],
        "output_prefix": chain.uri(f"{name}/"),
        **worker,
    }
    values = workload.release_values(image, chain.endpoint, **settings)
    if model_folder is not None:
        volume = {"hostPath": {"path": str(model_folder), "type": "Directory"}}
        values["model"] = {"volume": volume}
    deployment: dict[str, Any] = render(chart, values, name=name).one("Deployment")
    return deployment


def queue_of(deployment: dict[str, Any]) -> str:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return str(next(e["value"] for e in container["env"] if e["name"] == "SQSINFER_QUEUE_URL"))


def send_tasks(chain: workload.Chain, queue_url: str, tasks: dict[str, str]) -> None:
    for task_id, uri in tasks.items():
        body = json.dumps({"task_id": task_id, "input": uri})
        chain.sqs.send_message(QueueUrl=queue_url, MessageBody=body)


def log_time(record: dict[str, Any]) -> float:
    stamp = datetime.datetime.fromisoformat(record["ts"].replace("Z", "+00:00"))
    return stamp.timestamp()


def first(records: list[dict[str, Any]], msg: str) -> dict[str, Any]:
    return next(r for r in records if r.get("msg") == msg)


def test_cold_start_to_ready(
    image: str, chart: helm.Chart, chain: workload.Chain, tmp_path: Path
) -> None:
    """Container start (the engine's own record) to the first 200 from /readyz, polled every
    20 ms from the host, for a model fetched from S3: recorded, not asserted."""
    deployment = release(image, chart, chain, "cold")
    runs = []
    for run in range(COLD_STARTS):
        with engine.released(deployment, tmp_path / f"run{run}") as played:
            engine.wait_for(lambda p=played: p.pod.get("/readyz")[0] == 200, "ready", every_s=0.02)
            ready_at = time.time()
            started = played.pod.started_at_s()
            records = played.pod.log_records()
            pool = first(records, "pool ready")
            runs.append(
                {
                    "ready_s": round(ready_at - started, 3),
                    "pool_ready_s": round(log_time(pool) - started, 3),
                    "pool_startup_s": pool["startup_s"],
                    "model": first(records, "model fetched")["bytes"],
                }
            )
            engine.wait_ready(played)  # and the kubelet's probes agree
            kubelet = played.kubelet
            by_probes = kubelet.started_wall_s + (kubelet.seconds_to("readinessProbe") or 0)
            runs[-1]["ready_by_the_probes_s"] = round(by_probes - started, 3)
            runs[-1]["worker_starting_s"] = round(log_time(first(records, "starting")) - started, 3)
    ready = [r["ready_s"] for r in runs]
    REPORT["cold start, container start to /readyz 200"] = {
        "median_s": statistics.median(ready),
        "range_s": [min(ready), max(ready)],
        "runs": runs,
    }


def test_a_sigkill_then_a_new_container_leaves_no_segment_behind(
    image: str, chart: helm.Chart, chain: workload.Chain, tmp_path: Path
) -> None:
    """The whole container killed at once, as an OOM kill of a container does (the kernel
    kills its cgroup with memory.oom.group, as Kubernetes 1.28+ sets it): the killed
    worker's segments stay in the pod's /dev/shm until the next container sweeps them."""
    deployment = release(image, chart, chain, "restart")
    with engine.released(deployment, tmp_path) as played:
        pod = played.pod
        engine.wait_ready(played)
        tasks = {t: uri for t, uri in chain.inputs.items() if t.endswith("-npy")}
        send_tasks(chain, queue_of(deployment), tasks)
        committed = 'sqsinfer_tasks_total{outcome="committed"}'
        engine.wait_for(lambda: pod.metric(committed) == len(tasks), "the tasks")
        shm = pod.volumes["dshm"]
        left = {n for n in os.listdir(shm) if n.startswith(SEGMENT_PREFIX)}
        assert left  # segments kept for the next inputs while the worker lives
        killed = pod.pid()
        os.kill(killed, signal.SIGKILL)  # PID 1: the kernel kills the rest of the container
        engine.wait_for(
            lambda: pod.restarts() == 1 and pod.running() and pod.pid() not in (0, killed),
            "the engine to start a new container (restartPolicy Always)",
        )
        played.new_kubelet()
        engine.wait_ready(played)
        after = sorted(os.listdir(shm))
        assert [n for n in after if n.startswith(SEGMENT_PREFIX)] == [], after
        records = pod.log_records()
        swept = first(records, "swept what dead workers left")
        assert swept["segments"] == len(left)
        assert first(records, "model already fetched")  # the pod's /tmp outlived the kill
        REPORT["SIGKILL, then a new container"] = {
            "segments left by the killed worker": len(left),
            "swept by the new one": swept["segments"],
            "in /dev/shm once it is ready": after,
        }


def slow_model(folder: Path) -> Path:
    folder.mkdir(mode=0o755)
    path = folder / "slow.ubj"
    synthetic.train_model(str(path), workload.FEATURES, trees=SLOW_TREES, depth=8, seed=5)
    path.chmod(0o644)
    return path


def test_stopping_a_pod_drains_releases_and_exits_0_within_its_grace(
    image: str, chart: helm.Chart, chain: workload.Chain, tmp_path: Path
) -> None:
    """One process, three messages held: one computing, two not started. `podman pod stop`
    with the chart's terminationGracePeriodSeconds sends SIGTERM to PID 1, tini."""
    model = slow_model(tmp_path / "model")
    rows = synthetic.make_rows(SLOW_ROWS, workload.FEATURES, seed=6)
    chain.s3.put_object(
        Bucket=workload.BUCKET, Key="in/slow.npy", Body=synthetic.encode_input(rows, "npy")
    )
    deployment = release(
        image,
        chart,
        chain,
        "drain",
        model_folder=model.parent,
        model_path=f"/models/{model.name}",
        model_sha256="",
        processes=1,
        prefetch=3,
    )
    queue = queue_of(deployment)
    with engine.released(deployment, tmp_path / "pod") as played:
        pod = played.pod
        engine.wait_ready(played)
        processes = {pid: engine.start_ticks(pid) for pid in engine.tree(pod.pid())}
        tasks = {f"slow-{i}": chain.uri("in/slow.npy") for i in range(3)}
        send_tasks(chain, queue, tasks)
        computing = 'sqsinfer_phase_seconds_count{phase="wait_process"}'
        engine.wait_for(
            lambda: stage.queue_depth(chain.sqs, queue) == 3 and pod.metric(computing) >= 1,
            "one task computing, two held",
            every_s=0.02,
        )
        assert visible(chain, queue) == 0
        assert inspect_stop_signal(pod) == "15"  # SIGTERM, to PID 1
        assert engine.cmdline(pod.pid()).startswith("tini --")
        sigterm_at = time.time()
        stopper = subprocess.Popen(
            [engine.PODMAN, "pod", "stop", "--time", str(pod.grace_s), pod.name],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # Watched from the stop on, not waited for: should the pod release another number,
        # the log lines below say what it did, where a wait would only time out.
        visible_at = first_time(lambda: visible(chain, queue) == 2, until=stopper, every_s=0.01)
        assert stopper.wait(timeout=pod.grace_s + 30) == 0
        assert pod.exit_code() == 0  # a SIGKILL at the end of the grace period would be 137
        exited_at = pod.finished_at_s()
        records = pod.log_records()
        survivors = [p for p, ticks in processes.items() if engine.alive(p, ticks)]
    assert survivors == []  # no inference process outlives the container
    lifecycle = [r["msg"] for r in records if r.get("logger") == "sqsinfer.worker"]
    assert lifecycle[-3:] == ["signal received", "draining", "stopped"]
    signal_line = first(records, "signal received")
    assert signal_line["signal"] == "SIGTERM"
    draining = first(records, "draining")
    assert (draining["in_flight"], draining["releasing"]) == (3, 2)
    assert first(records, "stopped")["outcomes"] == {"committed": 1, "released": 2}
    finished = [r for r in records if r.get("msg") == "task finished"]
    released = [log_time(r) for r in finished if r["outcome"] == "released"]
    committed = [log_time(r) for r in finished if r["outcome"] == "committed"]
    assert len(released) == 2 and len(committed) == 1
    assert visible(chain, queue) == 2  # handed back at once, not after the visibility timeout
    assert visible_at is not None  # and seen so while the pod was stopping
    assert stage.list_keys(chain.s3, workload.BUCKET, "drain/")  # the started one committed

    def since(t: float) -> float:
        return round(t - sigterm_at, 3)

    REPORT["drain through the engine, seconds after SIGTERM"] = {
        "grace period": pod.grace_s,
        "signal received": since(log_time(signal_line)),
        "draining": since(log_time(draining)),
        "released (2)": [since(t) for t in released],
        "visible again (2)": since(visible_at),
        "committed (1, the started task)": since(committed[0]),
        "stopped": since(log_time(first(records, "stopped"))),
        "container exited, code 0": since(exited_at),
    }


def first_time(
    condition: Any, until: subprocess.Popen[bytes], every_s: float, after_s: float = 5.0
) -> float | None:
    """When `condition()` first held, watched until `until` exits (and `after_s` more)."""
    ended: float | None = None
    while ended is None or time.monotonic() < ended + after_s:
        if condition():
            return time.time()
        if ended is None and until.poll() is not None:
            ended = time.monotonic()
        time.sleep(every_s)
    return None


def visible(chain: workload.Chain, queue_url: str) -> int:
    attrs = chain.sqs.get_queue_attributes(
        QueueUrl=queue_url, AttributeNames=["ApproximateNumberOfMessages"]
    )
    return int(attrs["Attributes"]["ApproximateNumberOfMessages"])


def inspect_stop_signal(pod: engine.Pod) -> str:
    return engine.inspect(pod.container, "{{.Config.StopSignal}}")
