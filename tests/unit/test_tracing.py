"""Tracing's pure parts: its switches and variables, X-Ray's header, the DLQ copy's context."""

from __future__ import annotations

import json

import pytest

from sqsinfer import cli, tracing
from sqsinfer.aws.sqs import REASON_ATTR, Message, dead_letter_copy
from sqsinfer.config import ConfigError
from sqsinfer.limits import SQS_MAX_ATTRIBUTES
from sqsinfer.tracing import sdk
from tests.otlp import traceparent

PARENT = traceparent("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
TASK = traceparent("0af7651916cd43dd8448eb211c80319c", "00f067aa0ba902b7")
X_RAY = "Root=1-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8"
STATE = {"tracestate": {"DataType": "String", "StringValue": "vendor=value"}}


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
def test_an_xray_header_becomes_the_parent_span_context():
    found = sdk.xray_parent(X_RAY + ";Sampled=1")
    assert found is not None
    assert format(found.trace_id, "032x") == "5759e988bd862e3fe1be46a994272793"
    assert format(found.span_id, "016x") == "53995c3f42cd8ad8"
    assert found.trace_flags.sampled and found.is_remote
    unsampled = sdk.xray_parent(X_RAY)
    assert unsampled is not None and not unsampled.trace_flags.sampled


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
    assert sdk.xray_parent(header) is None


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
    resource = tracer._provider.resource.attributes
    assert (resource["service.name"], resource["service.instance.id"]) == ("sqsinfer", "pod-1")
    tracer.shutdown(1.0)
    traces_on.setenv("OTEL_SERVICE_NAME", "scoring")
    traces_on.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=mine,team=ml")
    tracer = tracing.from_env(service_instance="pod-1", component="worker")
    assert isinstance(tracer, sdk.SdkTracer)
    resource = tracer._provider.resource.attributes
    assert (resource["service.name"], resource["service.instance.id"]) == ("scoring", "mine")
    assert resource["team"] == "ml"
    tracer.shutdown(1.0)


def test_a_console_export_shows_each_step_as_a_span_of_its_task(traces_on, capsys):
    """Another exporter than sqsinfer's OTLP one takes the SDK's spans: a task's steps come
    to it as spans of their own, children of the task's, a step still open at the task's
    end as well (exported when it ends)."""
    traces_on.setenv("OTEL_TRACES_EXPORTER", "console")
    tracer = tracing.from_env(service_instance="pod-1", component="worker")
    message = Message("m1", "rh", "{}", 1)
    tracer.received("https://sqs.eu-west-1.amazonaws.com/123456789012/q", 0.01, [message])
    task = message.trace
    task.phase("s3_get", 0.002)
    task.compute(0.01, {"decode_s": 0.001, "infer_s": 0.005, "encode_s": 0.001, "rows": 3})
    late = task.step("delete")
    late.__enter__()
    task.finish("committed", "", 0.05, None)
    task.end()
    late.__exit__(None, None, None)
    assert tracer.shutdown(5.0)
    printed = json.loads("[" + capsys.readouterr().out.replace("}\n{", "},{") + "]")
    by_name = {span["name"]: span for span in printed}
    assert set(by_name) == {"ReceiveMessage q", "process q", "GET input", "compute", "delete"}
    own = by_name["process q"]["context"]["span_id"]
    assert {by_name[n]["parent_id"] for n in ("GET input", "compute", "delete")} == {own}
    assert [e["name"] for e in by_name["compute"]["events"]] == ["decode", "predict", "encode"]
    trace_id = by_name["process q"]["context"]["trace_id"]
    assert {by_name[n]["context"]["trace_id"] for n in ("compute", "delete")} == {trace_id}
