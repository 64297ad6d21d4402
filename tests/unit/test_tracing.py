"""Tracing's parts without a worker: its switches and variables, X-Ray's header, the DLQ
copy's context, a task's spans through the SDK, a shutdown a collector cannot hold up."""

from __future__ import annotations

import json
import time

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider, sampling
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext

from sqsinfer import cli, tracing
from sqsinfer.aws.sqs import REASON_ATTR, Message, dead_letter_copy
from sqsinfer.bench.otlp import count_spans
from sqsinfer.config import ConfigError
from sqsinfer.limits import SQS_MAX_ATTRIBUTES
from sqsinfer.tracing import sdk
from sqsinfer.tracing.api import FLUSH_S
from sqsinfer.worker.pipeline import compute_events, end_trace
from tests.otlp import SilentCollector, flushes_ended, traceparent

PARENT = traceparent("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
TASK = traceparent("0af7651916cd43dd8448eb211c80319c", "00f067aa0ba902b7")
X_RAY = "Root=1-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8"
STATE = {"tracestate": {"DataType": "String", "StringValue": "vendor=value"}}
NOT = {  # a producer's context, not sampled
    "traceparent": {
        "DataType": "String",
        "StringValue": "00-1af7651916cd43dd8448eb211c80319c-c7ad6b7169203331-00",
    }
}


def _string(value: str) -> dict[str, str]:
    return {"DataType": "String", "StringValue": value}


# -- the DLQ copy: within ten attributes, what gives way ------------------------------
def test_a_full_copy_keeps_traceparent_over_the_producers_attributes_and_drops_tracestate():
    own = {f"producer.{i}": _string(str(i)) for i in range(9)}
    message = Message("id-1", "rh", "{}", 1, own | PARENT | STATE)
    copy = dead_letter_copy(message, "malformed_json", "bad", "https://q/stage", trace=TASK)
    attrs = copy.attributes
    assert len(attrs) == SQS_MAX_ATTRIBUTES
    assert attrs["traceparent"] == TASK["traceparent"]  # the task's, not the producer's
    assert "tracestate" not in attrs  # last in line
    assert len([a for a in attrs if a.startswith("producer.")]) == 5  # 10 - 4 own - traceparent
    assert attrs[REASON_ATTR]["StringValue"] == "malformed_json"


def test_a_copy_with_room_keeps_the_tracestate_too():
    message = Message("id-1", "rh", "{}", 1, {"a": _string("1")} | PARENT | STATE)
    attrs = dead_letter_copy(message, "malformed_json", "bad", "https://q/stage").attributes
    assert attrs["traceparent"] == PARENT["traceparent"]  # traces off: the producer's own
    assert attrs["tracestate"] == STATE["tracestate"]
    assert attrs["a"] == _string("1")


def test_a_copy_whose_body_was_cut_still_carries_the_traceparent():
    message = Message("id-1", "rh", "x" * 5000, 1, PARENT)
    copy = dead_letter_copy(message, "message_too_large", "big", "https://q/s", 2048, trace=TASK)
    assert "sqsinfer.body_truncated" in copy.attributes
    assert copy.attributes["traceparent"] == TASK["traceparent"]


# -- X-Ray's header ---------------------------------------------------------------------
def _parent(header: str, attributes: dict | None = None) -> SpanContext:
    """The parent span context a message with this `AWSTraceHeader` gets."""
    message = Message("id-1", "rh", "{}", 1, attributes or {}, trace_header=header)
    return trace.get_current_span(sdk.parent_context(message)).get_span_context()


def test_an_xray_header_becomes_the_parent_span_context():
    found = _parent(X_RAY + ";Sampled=1")
    assert format(found.trace_id, "032x") == "5759e988bd862e3fe1be46a994272793"
    assert format(found.span_id, "016x") == "53995c3f42cd8ad8"
    assert found.trace_flags.sampled and found.is_remote
    unsampled = _parent(X_RAY)
    assert unsampled.is_valid and not unsampled.trace_flags.sampled


def test_a_traceparent_comes_before_an_xray_header():
    found = _parent(X_RAY + ";Sampled=1", PARENT)
    assert format(found.span_id, "016x") == "b7ad6b7169203331"


@pytest.mark.parametrize(
    "header",
    [
        "",
        "Root=1-5759e988-bd862e3fe1be46a994272793",  # no parent
        "Root=2-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8",
        "Root=1-5759e98-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8",
        "Root=1-5759e988-bd862e3fe1be46a99427279z;Parent=53995c3f42cd8ad8",
        "Root=1-00000000-000000000000000000000000;Parent=53995c3f42cd8ad8",
        "Parent=53995c3f42cd8ad8;Root",
    ],
)
def test_what_is_not_an_xray_header_parents_nothing(header):
    assert not _parent(header).is_valid


# -- the switches and the variables -----------------------------------------------------
@pytest.mark.parametrize(
    ("environ", "by"),
    [
        ({}, ""),
        ({"OTEL_SDK_DISABLED": "true"}, "OTEL_SDK_DISABLED"),
        ({"OTEL_SDK_DISABLED": " TRUE "}, "OTEL_SDK_DISABLED"),
        ({"OTEL_SDK_DISABLED": "false"}, ""),
        ({"OTEL_TRACES_EXPORTER": "none"}, "OTEL_TRACES_EXPORTER"),
        ({"OTEL_TRACES_EXPORTER": "console,otlp"}, ""),
    ],
)
def test_what_switches_tracing_off(environ, by):
    assert tracing.disabled_by(environ) == by


@pytest.fixture
def traces_on(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    return monkeypatch


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("OTEL_TRACES_EXPORTER", "zipkin"),
        ("OTEL_TRACES_SAMPLER", "sometimes"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc"),  # its exporter is not installed
    ],
)
def test_a_bad_variable_stops_start_up_naming_it(traces_on, name, value):
    traces_on.setenv(name, value)
    with pytest.raises(ConfigError) as raised:
        tracing.from_env()
    assert raised.value.setting == name
    assert str(raised.value).startswith(f"{name}: ")


@pytest.mark.parametrize("ratio", ["2", "-0.1", "half"])
def test_a_sampling_ratio_outside_0_to_1_is_refused(traces_on, ratio):
    traces_on.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    traces_on.setenv("OTEL_TRACES_SAMPLER_ARG", ratio)
    with pytest.raises(ConfigError, match="OTEL_TRACES_SAMPLER_ARG"):
        tracing.from_env()


def test_the_worker_command_refuses_a_bad_exporter(traces_on, tmp_path, capsys):
    traces_on.setenv("OTEL_TRACES_EXPORTER", "jaeger")
    (tmp_path / "model.ubj").write_bytes(b"not read: the variable stops it first")
    args = [
        *("worker", "--queue-url", "https://sqs.eu-west-1.amazonaws.com/123456789012/q"),
        *("--model-path", str(tmp_path / "model.ubj"), "--output-prefix", "s3://bucket/out/"),
        *("--allowed-input-prefixes", "s3://bucket/in/"),
    ]
    assert cli.main(args) == 2
    assert "invalid setting: OTEL_TRACES_EXPORTER: 'jaeger'" in capsys.readouterr().err


def test_the_service_is_named_sqsinfer_unless_the_variables_name_it(traces_on):
    tracer = tracing.from_env(service_instance="pod-1", component="worker")
    assert isinstance(tracer, sdk.SdkTracer)
    resource = tracer.provider.resource.attributes
    assert (resource["service.name"], resource["service.instance.id"]) == ("sqsinfer", "pod-1")
    tracer.shutdown()
    traces_on.setenv("OTEL_SERVICE_NAME", "scoring")
    traces_on.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=mine,team=ml")
    tracer = tracing.from_env(service_instance="pod-1", component="worker")
    assert isinstance(tracer, sdk.SdkTracer)
    resource = tracer.provider.resource.attributes
    assert (resource["service.name"], resource["service.instance.id"]) == ("scoring", "mine")
    assert resource["team"] == "ml"
    tracer.shutdown()


def test_without_a_sampler_named_a_tenth_of_new_traces_and_what_the_producer_sampled(traces_on):
    traces_on.setenv("OTEL_TRACES_EXPORTER", "console")  # its spans printed, not sent nowhere
    tracer = tracing.from_env(service_instance="pod-1", component="worker")
    assert isinstance(tracer, sdk.SdkTracer)
    assert isinstance(tracer.provider.sampler, sampling.ParentBasedTraceIdRatio)
    assert "TraceIdRatioBased{0.1}" in tracer.provider.sampler.get_description()
    queue = "https://sqs.eu-west-1.amazonaws.com/123456789012/q"
    sampled, unsampled = Message("m1", "rh", "{}", 1, PARENT), Message("m2", "rh", "{}", 1, NOT)
    tracer.received(queue, 0.01, [sampled, unsampled])
    assert sampled.trace.recording and not unsampled.trace.recording
    # Not sampled, its context still goes on: the next stage leaves it unsampled too.
    (value,) = [v["StringValue"] for v in unsampled.trace.outgoing().values()]
    assert value.startswith("00-1af7651916cd43dd8448eb211c80319c-") and value.endswith("-00")
    tracer.shutdown()


def test_a_console_export_shows_each_step_as_a_span_of_its_task(traces_on, capsys):
    """Another exporter than OTLP takes the same spans: a task's steps are spans of their
    own, children of the task's, a step that ends after the task too."""
    traces_on.setenv("OTEL_TRACES_EXPORTER", "console")
    traces_on.setenv("OTEL_TRACES_SAMPLER", "always_on")
    tracer = tracing.from_env(service_instance="pod-1", component="worker")
    message = Message("m1", "rh", "{}", 1)
    tracer.received("https://sqs.eu-west-1.amazonaws.com/123456789012/q", 0.01, [message])
    task = message.trace
    task.step("GET input", 0.002)
    child = {"decode_s": 0.001, "infer_s": 0.005, "encode_s": 0.001, "rows": 3}
    task.step("compute", 0.01, attributes={"sqsinfer.rows": 3}, events=compute_events(0.01, child))
    end_trace(task, "committed", "", 0.05, None)
    task.step("delete", 0.001)
    assert tracer.shutdown(5.0)
    printed = json.loads("[" + capsys.readouterr().out.replace("}\n{", "},{") + "]")
    by_name = {span["name"]: span for span in printed}
    assert set(by_name) == {"ReceiveMessage q", "process q", "GET input", "compute", "delete"}
    own = by_name["process q"]["context"]["span_id"]
    assert {by_name[n]["parent_id"] for n in ("GET input", "compute", "delete")} == {own}
    assert [e["name"] for e in by_name["compute"]["events"]] == ["decode", "predict", "encode"]
    trace_id = by_name["process q"]["context"]["trace_id"]
    assert {by_name[n]["context"]["trace_id"] for n in ("compute", "delete")} == {trace_id}
    assert by_name["process q"]["attributes"]["sqsinfer.outcome"] == "committed"


# -- export: what a collector that is down or slow may cost at the exit -------------------
def test_a_collector_that_never_answers_holds_up_the_exit_by_one_second_at_most(traces_on):
    """The collector accepts the connection and never answers: the shutdown gives up
    after `FLUSH_S` (at most 1 s), however long the exporter itself would wait."""
    assert FLUSH_S <= 1.0
    with SilentCollector() as collector:
        traces_on.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
        traces_on.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "30")  # the exporter's own: 30 s
        traces_on.setenv("OTEL_TRACES_SAMPLER", "always_on")
        tracer = tracing.from_env(service_instance="pod-1", component="enqueue")
        tracer.produce("https://sqs.eu-west-1.amazonaws.com/123456789012/q", "t-1").end()
        started = time.monotonic()
        assert tracer.shutdown() is False  # it gave up: the export is still waiting
        took_s = time.monotonic() - started
        deadline = time.monotonic() + 30
        while not collector.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert collector.requests == 1  # the span's request reached it, never answered
    assert took_s < FLUSH_S + 1.0  # not the exporter's 30 s
    assert flushes_ended()  # answered at last, the export left behind ended


def test_the_bench_counts_the_spans_of_a_request(traces_on):
    """What the tracing micro-benchmark checks its export by: every span, none dropped."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    for name in ("a", "b", "c"):
        provider.get_tracer("test").start_span(name).end()
    spans = exporter.get_finished_spans()
    assert count_spans(encode_spans(spans).SerializeToString()) == 3
    assert count_spans(encode_spans(spans[:1]).SerializeToString()) == 1
    assert count_spans(b"") == 0
