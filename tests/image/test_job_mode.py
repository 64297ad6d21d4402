"""Job mode through the container engine: a Job as KEDA starts it from the chart's
ScaledJob works its queue empty and its pod exits 0 by itself, nothing asking it to stop.

The Job is the ScaledJob's `jobTargetRef` as rendered; podman plays no Job, so its pod
template is played as a Pod (`engine.job_pod`), `restartPolicy: Never` and all, and the
Job controller's verdict is read from the container's exit: 0 and no restart is a Job
that completed.
"""

from __future__ import annotations

import json
from pathlib import Path

import helm_python as helm
import pytest

from sqsinfer.lab import stage
from tests.deploy.chart import render
from tests.image import engine, workload
from tests.image.conftest import REPORT
from tests.image.test_lifecycle import first, log_time

pytestmark = pytest.mark.timeout(600)
IDLE_S = 3  # exit_when_idle_s: short, so the test waits little for the exit


def test_a_jobs_pod_exits_0_once_its_queue_is_empty(
    image: str, chart: helm.Chart, chain: workload.Chain, tmp_path: Path
) -> None:
    queue = stage.create_queue(chain.sqs, "lane-job")
    values = workload.release_values(
        image,
        chain.endpoint,
        queue_url=queue.url,
        model_path=chain.uri("models/stage1.ubj"),
        model_sha256=chain.model1_sha256,
        allowed_input_prefixes=[chain.uri("in/")],
        output_prefix=chain.uri("job/"),
        exit_when_idle_s=IDLE_S,
    )
    values["keda"] = {"mode": "job"}
    rendered = render(chart, values, name="job")
    assert "Deployment" not in rendered.kinds()
    pod_manifest = engine.job_pod(rendered.one("ScaledJob"), "job-sqsinfer-x7k2p")
    assert pod_manifest["spec"]["restartPolicy"] == "Never"
    for task_id, uri in chain.inputs.items():  # every input format, as stage 1 gets them
        chain.sqs.send_message(
            QueueUrl=queue.url, MessageBody=json.dumps({"task_id": task_id, "input": uri})
        )
    with engine.released(pod_manifest, tmp_path / "pod") as played:
        pod = played.pod
        started_at = pod.started_at_s()
        engine.wait_for(lambda: not pod.running(), "the Job's worker to exit", timeout_s=300)
        exit_code, restarts = pod.exit_code(), pod.restarts()
        exited_at = pod.finished_at_s()
        records = pod.log_records()
    assert (exit_code, restarts) == (0, 0)  # the Job completed: no failure, no retry
    outputs = stage.list_keys(chain.s3, workload.BUCKET, "job/")
    assert sorted(outputs) == sorted(f"job/{task_id}.npy" for task_id in chain.tasks)
    assert stage.queue_depth(chain.sqs, queue.url) == 0  # visible, in flight and delayed
    finished = [r for r in records if r.get("msg") == "task finished"]
    assert {r["outcome"] for r in finished} == {"committed"}
    assert len(finished) == len(chain.tasks)
    last_task_at = max(log_time(r) for r in finished)
    done = first(records, "work done, stopping")  # it waited out the idle time, then left
    assert done["reason"] == "idle" and done["idle_s"] >= IDLE_S
    assert done["taken"] == len(chain.tasks)
    assert exited_at > log_time(done) > last_task_at

    def since(t: float) -> float:
        return round(t - started_at, 3)

    REPORT["job mode: a Job's pod, seconds after its container started"] = {
        "tasks": len(finished),
        "exit_when_idle_s": IDLE_S,
        "ready": since(log_time(first(records, "ready"))),
        "last task committed": since(last_task_at),
        "work done, stopping (idle)": since(log_time(done)),
        "container exited, code 0": since(exited_at),
    }
