"""Traces: one per task, from `sqsinfer enqueue` through every stage and into the DLQ.

Real workers on the moto server export over OTLP/HTTP to a receiver the test starts
(`tests.otlp`), which decodes what arrives with opentelemetry-proto.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections import Counter
from typing import Any

import numpy as np
import pytest

from sqsinfer import cli
from sqsinfer.bench.otlp import OtlpReceiver
from sqsinfer.lab import standin, synthetic
from sqsinfer.lab.stage import SHORT_DRAIN, stage_settings, worker_env
from sqsinfer.tracing.api import FLUSH_S
from tests import handlers
from tests.conftest import Stage, eventually, outcome_count, running
from tests.otlp import (
    SilentCollector,
    Span,
    flushes_ended,
    otlp,
    parse_traceparent,
    received,
    traceparent,
)

__all__ = ["otlp"]  # the fixture

SCRIPTED = "tests.handlers:ScriptedHandler"
TOLERANCE_S = 1e-5  # a span is the phase's own measurement, rounded to the microsecond
ERROR = 2  # STATUS_CODE_ERROR


def _input(stage: Stage, name: str, seconds: float = 0.0) -> str:
    """An input of 3 rows; the scripted handler sleeps `seconds` on it (a row's sum is its
    prediction, so the first of the output is 0: the next stage computes it at once).
    -1.5 is none of the handler's scripted failures."""
    rows = np.full((3, 4), 0.5, dtype=np.float32)
    rows[0, 0] = seconds or -1.5
    return stage.put_input(name, synthetic.encode_input(rows, "npy"))


def _finished(caplog: pytest.LogCaptureFixture) -> dict[str, logging.LogRecord]:
    """Each message's `task finished` line, by message id."""
    return {
        r.message_id: r  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "sqsinfer.task" and r.getMessage() == "task finished"
    }


def _by_name(spans: list[Span]) -> dict[str, list[Span]]:
    found: dict[str, list[Span]] = {}
    for span in spans:
        found.setdefault(span.name, []).append(span)
    return found


def _children(spans: list[Span], parent: Span) -> dict[str, Span]:
    """A task span's steps (the next stage's task, a child too, aside)."""
    return {
        s.name: s
        for s in spans
        if s.parent_id == parent.span_id and not s.name.startswith("process ")
    }


def _next_stage(stage: Stage, make_settings: Any) -> Any:
    """The settings of the second stage: the first stage's outputs are its inputs."""
    return make_settings(
        handler=SCRIPTED,
        worker_id="two",
        queue_url=stage.next_url,
        allowed_input_prefixes=f"s3://{stage.bucket}/out/",
        output_prefix=f"s3://{stage.bucket}/out2/",
    )


async def _enqueue(stage: Stage, tmp_path: Any, tasks: list[dict[str, Any]]) -> None:
    manifest = tmp_path / "tasks.jsonl"
    manifest.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    args = [
        *("enqueue", str(manifest), "--queue-url", stage.queue_url),
        *("--endpoint-url", stage.endpoint, "--region", standin.REGION, "--quiet"),
        *("--allowed-input-prefixes", f"s3://{stage.bucket}/in/"),
        *("--output-prefix", f"s3://{stage.bucket}/out/"),
    ]
    assert await asyncio.to_thread(cli.main, args) == 0


def _check_phases(spans: list[Span], task: Span, line: logging.LogRecord) -> None:
    """The task's spans are its own measurements: the task's `seconds`, each phase's."""
    assert abs(task.seconds - line.seconds) < TOLERANCE_S  # type: ignore[attr-defined]
    phases: dict[str, float] = line.phases  # type: ignore[attr-defined]
    children = _children(spans, task)
    named = {
        "GET input": "s3_get",
        "wait for a process": "wait_process",
        "PUT output": "commit",
        "chain link": "chain",
    }
    for name, phase in named.items():
        if phase in phases:
            assert abs(children[name].seconds - phases[phase]) < TOLERANCE_S, name
    compute = children["compute"]
    spent = sum(phases[p] for p in ("handoff", "decode", "infer", "encode"))
    assert abs(compute.seconds - spent) < 4 * TOLERANCE_S
    assert [name for name, _, _ in compute.events] == ["decode", "predict", "encode"]
    child_phases = ("decode", "infer", "encode")
    for (_, at, attributes), phase in zip(compute.events, child_phases, strict=True):
        assert compute.start_ns <= at <= compute.end_ns
        assert abs(attributes["sqsinfer.duration_s"] - phases[phase]) < TOLERANCE_S
    for child in children.values():  # within the task, in the task's trace
        assert child.trace_id == task.trace_id
        assert task.start_ns <= child.start_ns <= child.end_ns <= task.end_ns + 1000


async def test_one_trace_per_task_from_enqueue_through_two_stages_and_the_dlq(
    stage: Stage, make_settings, otlp: OtlpReceiver, tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="sqsinfer.task")
    b = stage.bucket
    good = {f"job/{i}": _input(stage, f"{i}.npy") for i in range(3)}
    tasks = [{"task_id": t, "input": uri} for t, uri in good.items()]
    tasks.append({"task_id": "lost", "input": f"s3://{b}/in/missing.npy"})  # input_not_found
    await _enqueue(stage, tmp_path, tasks)
    # The command set up its own logging, in place of the capture's: put the capture back.
    logging.getLogger().addHandler(caplog.handler)

    first = make_settings(handler=SCRIPTED, next_queue_url=stage.next_url, worker_id="one")
    second = _next_stage(stage, make_settings)
    async with running(first) as one, running(second) as two:
        await eventually(
            lambda: (
                outcome_count(one, "committed") == 3
                and outcome_count(one, "rejected") == 1
                and outcome_count(two, "committed") == 3
            )
        )
    # The workers flushed their spans when they stopped: nothing is waited for here.
    spans = received(otlp)
    names = _by_name(spans)
    queue, next_queue = (url.rsplit("/", 1)[1] for url in (stage.queue_url, stage.next_url))

    # enqueue: a trace per task, its `create` span the root of it
    created = {s.attributes["sqsinfer.task_id"]: s for s in names[f"create {queue}"]}
    assert set(created) == {*good, "lost"}
    assert len({s.trace_id for s in created.values()}) == 4
    assert all(s.parent_id == "" for s in created.values())
    (send,) = names[f"SendMessageBatch {queue}"]
    assert {span for _, span in send.links} == {s.span_id for s in created.values()}
    assert {s.resource["sqsinfer.component"] for s in spans} == {"enqueue", "worker"}
    assert {s.resource["service.name"] for s in spans} == {"sqsinfer-test"}

    # each stage's task span is a child of the task's span in the stage before
    stage1 = {s.attributes["messaging.message.id"]: s for s in names[f"process {queue}"]}
    stage2 = {s.attributes["messaging.message.id"]: s for s in names[f"process {next_queue}"]}
    assert len(stage1) == 4 and len(stage2) == 3
    lines = _finished(caplog)
    for message_id, task in {**stage1, **stage2}.items():
        task_id = lines[message_id].task_id  # type: ignore[attr-defined]
        assert task.attributes["sqsinfer.task_id"] == task_id
        assert task.trace_id == created[task_id].trace_id  # one trace across the stages
        assert task.attributes["messaging.system"] == "aws_sqs"
        assert task.attributes["messaging.operation.type"] == "process"
        assert task.attributes["sqsinfer.outcome"] == lines[message_id].outcome  # type: ignore[attr-defined]
    by_task = {s.attributes["sqsinfer.task_id"]: s for s in stage1.values()}
    for task in stage1.values():
        assert task.parent_id == created[task.attributes["sqsinfer.task_id"]].span_id
    for task in stage2.values():
        assert task.parent_id == by_task[task.attributes["sqsinfer.task_id"]].span_id

    # the spans are the task's own timings
    for message_id, task in {**stage1, **stage2}.items():
        if task.attributes["sqsinfer.outcome"] == "committed":
            _check_phases(spans, task, lines[message_id])
            assert "delete" in _children(spans, task)

    # the rejected task: its reason, its DLQ copy in its trace
    lost = by_task["lost"]
    assert (lost.attributes["sqsinfer.reason"], lost.status_code) == ("input_not_found", ERROR)
    (dead,) = stage.drain_queue(stage.dlq_url)
    trace_id, parent = parse_traceparent(dead["MessageAttributes"]["traceparent"]["StringValue"])
    assert (trace_id, parent) == (lost.trace_id, lost.span_id)
    assert f"SendMessage {stage.dlq_url.rsplit('/', 1)[1]}" in _children(spans, lost)

    # the batched calls: spans of their own, linked to the tasks they served
    process_ids = {s.span_id for s in [*stage1.values(), *stage2.values()]}
    for name in (f"ReceiveMessage {queue}", f"DeleteMessageBatch {queue}"):
        linked = {span for s in names[name] for _, span in s.links}
        assert linked == {s.span_id for s in stage1.values()}, name
    linked = {span for s in names[f"SendMessageBatch {next_queue}"] for _, span in s.links}
    assert linked == {by_task[t].span_id for t in good}
    assert all(s.trace_id not in {t.trace_id for t in created.values()} for s in names[send.name])
    assert {span for s in names[f"DeleteMessageBatch {next_queue}"] for _, span in s.links} == {
        s.span_id for s in stage2.values()
    }
    assert process_ids  # every span was ended: an open one is never exported
    assert all(s.end_ns >= s.start_ns > 0 for s in spans)


def _s3_record(stage: Stage, key: str, name: str = "ObjectCreated:Put") -> dict[str, Any]:
    return {
        "eventVersion": "2.1",
        "eventSource": "aws:s3",
        "eventName": name,
        "s3": {"bucket": {"name": stage.bucket}, "object": {"key": key}},
    }


async def test_an_s3_event_of_several_records_has_a_span_per_record_each_in_its_trace(
    stage: Stage, make_settings, otlp: OtlpReceiver
):
    """A message of several S3 event records: each record a span of its own within the
    message's, its steps, its next-stage task and its DLQ copy in it; an ignored event
    (a removal, S3's test event) named on its span."""
    _input(stage, "m.npy")
    records = [
        _s3_record(stage, "in/m.npy"),
        _s3_record(stage, "in/gone.npy", "ObjectRemoved:Delete"),
        _s3_record(stage, "secret/x.npy"),  # outside the input prefixes: rejected
    ]
    stage.send({"Records": records})
    test_event = stage.send({"Service": "Amazon S3", "Event": "s3:TestEvent", "Bucket": "b"})
    first = make_settings(
        handler=SCRIPTED, message_shape="s3-event", next_queue_url=stage.next_url, worker_id="one"
    )
    second = _next_stage(stage, make_settings)
    async with running(first) as one, running(second) as two:
        await eventually(
            lambda: (
                one.metrics.outcomes == {"committed": 1, "ignored": 2, "rejected": 1}
                and outcome_count(two, "committed") == 1
                and stage.counts(stage.queue_url) == (0, 0)
            )
        )
    spans = received(otlp)
    queue = stage.queue_url.rsplit("/", 1)[1]
    tasks = {s.attributes["messaging.message.id"]: s for s in spans if s.name == f"process {queue}"}
    ignored = tasks.pop(test_event)
    assert ignored.attributes["sqsinfer.outcome"] == "ignored"
    assert ignored.attributes["sqsinfer.event"] == "s3:TestEvent"
    assert ignored.status_code != ERROR
    (message,) = tasks.values()
    assert message.attributes["sqsinfer.shape"] == "s3"
    assert message.attributes["sqsinfer.records"] == 3
    assert message.attributes["sqsinfer.outcomes"] == ["committed", "ignored", "rejected"]
    assert message.status_code == ERROR
    found = sorted(
        (s for s in spans if s.name == "record" and s.parent_id == message.span_id),
        key=lambda s: s.attributes["sqsinfer.record"],
    )
    assert [s.attributes["sqsinfer.outcome"] for s in found] == ["committed", "ignored", "rejected"]
    scored, removal, refused = found
    assert all(message.contains(s) and s.trace_id == message.trace_id for s in found)
    assert scored.end_ns <= removal.start_ns and removal.end_ns <= refused.start_ns  # in turn
    assert scored.attributes["sqsinfer.task_id"] == "m"
    steps = _children(spans, scored)
    assert {"GET input", "compute", "PUT output", "chain link"} <= set(steps)
    assert all(scored.contains(s) for s in steps.values())
    assert removal.attributes["sqsinfer.event"] == "ObjectRemoved:Delete"
    assert (refused.attributes["sqsinfer.reason"], refused.status_code) == (
        "input_not_allowed",
        ERROR,
    )
    # The next stage's task is the committed record's child; the DLQ copy the refused one's.
    next_queue = stage.next_url.rsplit("/", 1)[1]
    (next_task,) = [s for s in spans if s.name == f"process {next_queue}"]
    assert (next_task.trace_id, next_task.parent_id) == (message.trace_id, scored.span_id)
    (dead,) = stage.drain_queue(stage.dlq_url)
    value = dead["MessageAttributes"]["traceparent"]["StringValue"]
    assert parse_traceparent(value) == (message.trace_id, refused.span_id)
    assert f"SendMessage {stage.dlq_url.rsplit('/', 1)[1]}" in _children(spans, refused)


X_RAY = "Root=1-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8;Sampled=1"


def _scrape(port: int, accept: str) -> str:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.read().decode()


async def test_the_producer_context_is_the_parent_and_the_exemplar_of_its_duration(
    stage: Stage, make_settings, otlp: OtlpReceiver
):
    """A `traceparent` attribute, or X-Ray's header when there is none, parents the task;
    the task-duration histogram carries the trace id in the OpenMetrics exposition."""
    producer = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
    stage.sqs.send_message(
        QueueUrl=stage.queue_url,
        MessageBody=json.dumps({"task_id": "w3c", "input": _input(stage, "a.npy")}),
        MessageAttributes=traceparent(*producer),
    )
    stage.sqs.send_message(
        QueueUrl=stage.queue_url,
        MessageBody=json.dumps({"task_id": "xray", "input": _input(stage, "b.npy")}),
        MessageSystemAttributes={"AWSTraceHeader": {"DataType": "String", "StringValue": X_RAY}},
    )
    async with running(make_settings(handler=SCRIPTED)) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == 2)
        port = worker.health.port
        openmetrics = await asyncio.to_thread(_scrape, port, "application/openmetrics-text")
        classic = await asyncio.to_thread(_scrape, port, "text/plain")
        async with worker.pool.lease() as lease:  # the parent traces; its processes do not
            child_modules = await lease.run(handlers.loaded_modules)
    assert "opentelemetry" in sys.modules
    assert [m for m in child_modules if m.startswith("opentelemetry")] == []
    tasks = {
        s.attributes["sqsinfer.task_id"]: s for s in received(otlp) if s.name.startswith("process ")
    }
    assert (tasks["w3c"].trace_id, tasks["w3c"].parent_id) == producer
    assert (tasks["xray"].trace_id, tasks["xray"].parent_id) == (
        "5759e988bd862e3fe1be46a994272793",
        "53995c3f42cd8ad8",
    )
    exemplars = Counter(
        line.split('trace_id="', 1)[1].split('"', 1)[0]
        for line in openmetrics.splitlines()
        if line.startswith("sqsinfer_task_seconds_bucket{")
        and 'outcome="committed"' in line
        and "# {" in line
    )
    # A bucket shows the exemplar of its latest observation: one at least, each a task's.
    assert exemplars and set(exemplars) <= {tasks["w3c"].trace_id, tasks["xray"].trace_id}
    assert "# {" not in classic  # the Prometheus text format has no exemplars
    assert openmetrics.rstrip().endswith("# EOF")


async def test_a_sampling_ratio_keeps_a_sampled_producers_trace_and_drops_the_rest(
    stage: Stage, make_settings, otlp: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
):
    """OTEL_TRACES_SAMPLER=parentbased_traceidratio, as operating.md advises at high rates:
    a task whose producer sampled it is traced whole; one whose producer did not, and one
    with no producer's context at a ratio of 0, leave no span (nor does a batch call, a
    root of its own)."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    sampled = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
    unsampled = {
        "traceparent": {
            "DataType": "String",
            "StringValue": "00-1af7651916cd43dd8448eb211c80319c-c7ad6b7169203331-00",
        }
    }
    for task_id, attributes in (("kept", traceparent(*sampled)), ("not", unsampled), ("root", {})):
        body = json.dumps({"task_id": task_id, "input": _input(stage, f"{task_id}.npy")})
        stage.sqs.send_message(
            QueueUrl=stage.queue_url, MessageBody=body, MessageAttributes=attributes
        )
    async with running(make_settings(handler=SCRIPTED)) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == 3)
    spans = received(otlp)
    assert {s.trace_id for s in spans} == {sampled[0]}
    (task,) = [s for s in spans if s.name.startswith("process ")]
    assert (task.attributes["sqsinfer.task_id"], task.parent_id) == ("kept", sampled[1])
    assert {"GET input", "compute", "PUT output", "delete"} <= set(_children(spans, task))


async def test_a_drain_ends_every_task_span_and_exports_it_before_the_exit(
    stage: Stage, make_settings, otlp: OtlpReceiver
):
    """Stopped with one task computing and others waiting: every message's span is ended
    (the computed one committed, the rest released) and exported before `serve` returns."""
    for i in range(4):
        stage.send({"task_id": f"slow/{i}", "input": _input(stage, f"{i}.npy", seconds=1.0)})
    settings = make_settings(handler=SCRIPTED, prefetch=4)
    async with running(settings) as worker:
        await eventually(lambda: any(h.step == "computing" for h in worker.held.values()))
        await eventually(lambda: len(worker.held) == 4)
    # `running` stopped the worker and waited for its drain and its exit
    spans = received(otlp)
    tasks = [s for s in spans if s.name.startswith("process ")]
    outcomes = Counter(s.attributes["sqsinfer.outcome"] for s in tasks)
    assert outcomes == Counter(worker.metrics.outcomes)
    assert outcomes["released"] >= 1 and outcomes["committed"] >= 1
    assert sum(outcomes.values()) == 4
    assert all(s.end_ns >= s.start_ns > 0 for s in spans)
    computed = [s for s in tasks if s.attributes["sqsinfer.outcome"] == "committed"]
    assert all("compute" in _children(spans, s) for s in computed)


# A worker process that stops itself (SIGTERM) once it committed one task, then says which
# opentelemetry modules it imported.
WORKER_SCRIPT = """
import json, os, signal, sys, threading, time, urllib.request
{before}
from sqsinfer import cli


def stop_after_one_task():
    url = "http://127.0.0.1:" + os.environ["SQSINFER_HEALTH_PORT"] + "/metrics"
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if 'sqsinfer_tasks_total{{outcome="committed"}} 1.0' in response.read().decode():
                    break
        except OSError:
            pass
        time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGTERM)


threading.Thread(target=stop_after_one_task, daemon=True).start()
code = cli.main(["worker"])
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
print(json.dumps({{"code": code, "opentelemetry": loaded}}))
"""
# Stands in for the extra not being installed: every opentelemetry import fails.
WITHOUT_THE_EXTRA = """
import importlib.abc


class NoOpenTelemetry(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "opentelemetry":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoOpenTelemetry())
"""


def _worker_process(stage: Stage, model_path: str, env: dict[str, str], before: str = "") -> dict:
    stage.send({"task_id": "one", "input": _input(stage, "one.npy")})
    settings = stage_settings(
        stage.endpoint,
        stage.queue_url,
        model_path,
        reads=f"s3://{stage.bucket}/in/",
        writes=f"s3://{stage.bucket}/out/",
    )
    extra = {"SQSINFER_HANDLER": SCRIPTED, "SQSINFER_PROCESSES": "1", "PYTHONPATH": ROOT}
    full = worker_env("traced", SHORT_DRAIN | settings | extra, standin.free_port()) | env
    script = WORKER_SCRIPT.format(before=textwrap.dedent(before))
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


NOWHERE = "http://127.0.0.1:9"  # asked for, but nothing could send there
MINUTE = "60000"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
    ("env", "before"),
    [
        ({"OTEL_SDK_DISABLED": "true"}, ""),
        ({"OTEL_SDK_DISABLED": "", "OTEL_TRACES_EXPORTER": "none"}, ""),
        ({"OTEL_SDK_DISABLED": "", "OTEL_EXPORTER_OTLP_ENDPOINT": NOWHERE}, WITHOUT_THE_EXTRA),
    ],
    ids=["OTEL_SDK_DISABLED", "exporter none", "extra not installed"],
)
def test_a_worker_without_tracing_imports_nothing_of_opentelemetry(stage, model_path, env, before):
    found = _worker_process(stage, model_path, env, before)
    assert found == {"code": 0, "opentelemetry": []}
    assert stage.counts(stage.queue_url) == (0, 0)  # it did its work


def test_a_traced_worker_exports_every_span_before_it_exits_on_sigterm(stage, model_path):
    with OtlpReceiver(keep=True) as receiver:
        env = receiver.exporter_env() | {"OTEL_SDK_DISABLED": "", "OTEL_BSP_SCHEDULE_DELAY": MINUTE}
        found = _worker_process(stage, model_path, env)
        spans = received(receiver)
    assert found["code"] == 0 and "opentelemetry.sdk.trace" in found["opentelemetry"]
    # Nothing was exported on the processor's schedule (a minute): all of it at the exit.
    (task,) = [s for s in spans if s.name.startswith("process ")]
    assert task.attributes["sqsinfer.outcome"] == "committed"
    assert {"GET input", "compute", "PUT output", "delete"} <= set(_children(spans, task))


GAVE_UP = "traces not all exported before the exit"


async def test_a_collector_that_never_answers_holds_up_no_exit_more_than_a_second(
    stage: Stage, make_settings, tmp_path, caplog, monkeypatch: pytest.MonkeyPatch
):
    """The collector accepts the connection and never answers: `sqsinfer enqueue` and the
    worker each give their last spans `FLUSH_S` (1 s) to reach it, then exit without them
    (the exporter itself would wait 30 s)."""
    caplog.set_level(logging.WARNING, logger="sqsinfer")
    with SilentCollector() as collector:
        monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "30")
        monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_on")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", MINUTE)  # all of it at the exit
        manifest = tmp_path / "tasks.jsonl"
        manifest.write_text(json.dumps({"task_id": "one", "input": _input(stage, "1.npy")}))
        command = [sys.executable, "-m", "sqsinfer", "enqueue", str(manifest), "--quiet"]
        command += ["--queue-url", stage.queue_url, "--endpoint-url", stage.endpoint]
        command += ["--region", standin.REGION, "--output-prefix", f"s3://{stage.bucket}/out/"]
        command += ["--allowed-input-prefixes", f"s3://{stage.bucket}/in/"]
        done = await asyncio.to_thread(
            subprocess.run, command, capture_output=True, text=True, timeout=120, check=False
        )
        enqueue_exited_at = time.time()
        assert done.returncode == 0, done.stderr
        async with running(make_settings(handler=SCRIPTED)) as worker:
            await eventually(lambda: outcome_count(worker, "committed") == 1)
        worker_exited_at = time.time()
    assert flushes_ended()  # answered at last, the worker's export left behind ended
    # One request of each, held and never answered: sent at the exit, the rest waited for.
    enqueue_asked_at, worker_asked_at = collector.asked_at
    # The command logs to the console: `<time> WARNING sqsinfer.enqueue: <msg>  timeout_s=1.0`
    (gave_up,) = [line for line in done.stderr.splitlines() if GAVE_UP in line]
    assert 0 < float(gave_up.rsplit("timeout_s=", 1)[1]) <= FLUSH_S <= 1.0
    (gave_up,) = [r for r in caplog.records if r.getMessage() == GAVE_UP]
    assert 0 < gave_up.timeout_s <= FLUSH_S  # type: ignore[attr-defined]
    # From the request to the exit: the second of waiting, and the ending of the process
    # (the command) or of the worker's serve (its pool stopped before).
    assert enqueue_exited_at - enqueue_asked_at < FLUSH_S + 3.0
    assert worker_exited_at - worker_asked_at < FLUSH_S + 3.0
