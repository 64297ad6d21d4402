"""Hostile input: every message body and every input file ends as a task or a clean rejection.

Property-based (hypothesis): random bytes, deep nesting, huge numbers, wrong types,
oversized bodies, NaN and infinity, wrong shapes, empty and truncated files, text in
CSV, control characters in derived keys, characters SQS refuses in every field and in
params, keys near S3's 1,024-byte limit, .npy headers with negative or overflowing
dimensions. No other exception, no hang, decoded arrays stay within their bound, an
accepted message yields only keys S3 takes and messages SQS takes, and a rejected one a
DLQ copy SQS takes, with its reason. The number of cases run is printed in pytest's
summary.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
from typing import Any
from urllib.parse import quote, quote_plus

import numpy as np
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proving.sqs_rules import sendable_text, unsendable
from sqsinfer.aws.sqs import REASON_ATTR, Message, dead_letter_copy
from sqsinfer.compute import formats
from sqsinfer.compute.errors import InputError
from sqsinfer.events import Ignored, parse_body
from sqsinfer.lab.synthetic import parquet_bytes
from sqsinfer.limits import S3_MAX_KEY_BYTES
from sqsinfer.messages import (
    OUTPUT_MARKER_RESERVE_BYTES,
    MessageRules,
    Task,
    next_stage_body,
    parse_prefixes,
    parse_s3_uri,
    parse_task,
)
from tests.unit.test_inference import npy_claiming

CASES: collections.Counter[str] = collections.Counter()
MAX_DECODED = 1 << 16
RULES = MessageRules(
    allowed_input_prefixes=parse_prefixes("s3://data/in/", "in"),
    allowed_output_prefixes=parse_prefixes("s3://data/out/", "out"),
    output_prefix=parse_s3_uri("s3://data/out/", "out", prefix=True),
    max_message_bytes=4096,
)
SUFFIXES = (".npy", ".csv", ".json", ".jsonl", ".parquet", ".txt", "")
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=30,
)
uris = st.one_of(
    st.text(max_size=60),
    st.builds(lambda k: f"s3://data/in/{k}", st.text(max_size=40)),
    st.sampled_from(
        [
            "s3://data/in/a.npy",
            "s3://data/in/../x.npy",
            "s3://data@x/in/a.npy",
            "s3://DATA/in/a.npy",
            "s3://data/in//a.npy",
            "s3://data/in/a.npy#x",
        ]
    ),
)


def parse_or_reject(body: str | bytes, rules: MessageRules = RULES) -> None:
    """Accepted, and everything the worker would then send is sendable; or rejected with a
    reason, in a DLQ copy SQS takes."""
    try:
        task = parse_task(body, rules)
    except InputError as rejected:
        check_rejected(body, rejected)
        CASES["message rejected"] += 1
        return
    CASES["message accepted"] += 1
    check_task(task, rules)


def check_rejected(body: str | bytes, rejected: InputError) -> None:
    """A rejection has a reason and a detail, and its DLQ copy is one SQS takes."""
    assert rejected.reason and rejected.detail
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    copy = dead_letter_copy(Message("id", "rh", text or "-", 1), *rejected.args, "https://q")
    assert unsendable(copy.body, copy.attributes, 262_144) == []
    assert copy.attributes[REASON_ATTR]["StringValue"] == rejected.reason


def check_task(task: Task, rules: MessageRules) -> None:
    """What an accepted task may ask for: keys S3 takes, messages SQS takes."""
    assert any(task.input.within(p) for p in rules.allowed_input_prefixes)
    assert any(task.output.within(p) for p in rules.allowed_output_prefixes)
    assert ".." not in task.output.key.split("/")
    for key in (task.input.key, task.output.key):
        assert sendable_text(key) and not any(ord(c) < 0x20 or c == "\x7f" for c in key)
    assert len(task.output.key.encode()) + OUTPUT_MARKER_RESERVE_BYTES <= S3_MAX_KEY_BYTES
    assert task.task_id.isascii() and task.task_id.isprintable()  # it goes in S3 metadata
    forwarded = next_stage_body(task).decode()
    assert unsendable(forwarded, None, 262_144) == []
    # Handed on unchanged, but for the columns this stage's input was read with.
    assert orjson.loads(forwarded)["params"] == {
        k: v for k, v in task.params.items() if k != "columns"
    }
    columns = task.input_options.columns
    assert columns is None or (
        task.input_format == "parquet"
        and columns == tuple(task.params["columns"])
        and all(type(c) is str and c for c in columns)
        and len(set(columns)) == len(columns)
    )


@FUZZ
@given(st.binary(max_size=600))
def test_random_bytes_as_a_message(body):
    parse_or_reject(body)


@FUZZ
@given(json_values)
def test_any_json_value_as_a_message(doc):
    parse_or_reject(json.dumps(doc))


@FUZZ
@given(
    task_id=st.one_of(
        st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._/=:@+-]{0,30}", fullmatch=True),
        st.text(max_size=80),
        st.integers(),
        json_values,
    ),
    input=uris,
    output=st.one_of(st.none(), uris),
    params=st.one_of(st.dictionaries(st.text(max_size=5), json_values, max_size=3), json_values),
)
def test_messages_with_fields_of_every_type(task_id, input, output, params):
    parse_or_reject(
        json.dumps({"task_id": task_id, "input": input, "output": output, "params": params})
    )


def test_pathological_bodies():
    for body in [
        "[" * 100_000,
        '{"a":' * 50_000,
        "1" * 5000,
        '{"task_id": 1e999}',
        '{"task_id": NaN}',
        "\x00" * 10,
        json.dumps({"task_id": "t", "pad": "x" * 10_000}),
    ]:
        parse_or_reject(body)


# -- S3 event notifications: every shape, any key, any record ------------------------------

EVENT_RULES = dataclasses.replace(RULES, message_shape="auto")
# Keys a producer writes: spaces, `+`, `=`, unicode, folders, under the allowed prefix.
good_keys = st.builds(
    lambda k, ext: f"in/{k}{ext}",
    st.from_regex(r"[A-Za-z0-9 +=éü_.-]{1,12}(/[A-Za-z0-9 +=é_-]{1,12}){0,3}", fullmatch=True),
    st.sampled_from(SUFFIXES[:5]),
)
keys = st.one_of(
    good_keys,
    good_keys,
    st.text(max_size=60),
    st.builds(lambda k, ext: f"in/{k}{ext}", st.text(max_size=40), st.sampled_from(SUFFIXES)),
    st.builds(lambda k: "in/" + "x" * k + ".csv", st.integers(990, 1030)),  # near the limits
)
encoded_keys = st.one_of(keys.map(quote_plus), keys.map(lambda k: quote(k, safe="/")), keys)
versions = st.one_of(st.none(), st.none(), st.just("null"), st.text(max_size=12), st.integers())
event_names = st.sampled_from(
    ["ObjectCreated:Put"] * 3
    + ["s3:ObjectCreated:Copy", "ObjectRemoved:Delete", "ObjectTagging:Put", ""]
)


@st.composite
def s3_records(draw: st.DrawFn) -> Any:
    record: dict[str, Any] = {
        "eventName": draw(event_names),
        "s3": {
            "bucket": {"name": draw(st.sampled_from(["data"] * 6 + ["other", "DATA", "a/b", ""]))},
            "object": {"key": draw(encoded_keys), "versionId": draw(versions)},
        },
    }
    if draw(st.booleans()):
        record["eventSource"] = draw(st.sampled_from(["aws:s3", "aws:sqs"]))
    return draw(st.one_of(st.just(record), json_values))


@st.composite
def event_bodies(draw: st.DrawFn) -> str:
    records = {"Records": draw(st.lists(s3_records(), max_size=4))}
    eventbridge = {
        "source": draw(st.sampled_from(["aws.s3", "aws.ec2"])),
        "detail-type": draw(st.sampled_from(["Object Created", "Object Deleted", 3])),
        "detail": {
            "bucket": {"name": "data"},
            "object": {"key": draw(keys), "version-id": draw(versions)},
        },
    }
    test = {"Service": "Amazon S3", "Event": "s3:TestEvent"}
    inner = draw(st.sampled_from([records, records, eventbridge, test, draw(json_values)]))
    if draw(st.booleans()):  # wrapped by SNS, raw delivery off
        inner = {"Type": "Notification", "Message": json.dumps(inner)}
    return json.dumps(inner)


def parse_event_or_reject(body: str, rules: MessageRules = EVENT_RULES) -> None:
    """Each record a task, an ignored event or a rejection whose copy SQS takes; or the
    whole body rejected with a reason."""
    try:
        found = parse_body(body, rules)
    except InputError as rejected:
        check_rejected(body, rejected)
        CASES["event body rejected"] += 1
        return
    for record in found.records:
        if isinstance(record.item, Task):
            check_task(record.item, rules)
            assert record.item.from_event or found.shape == "sqsinfer"
            CASES["event record accepted"] += 1
        elif isinstance(record.item, Ignored):
            CASES["event record ignored"] += 1
        else:
            check_rejected(record.alone() if record.raw is not None else body, record.item)
            CASES["event record rejected"] += 1


@FUZZ
@given(event_bodies())
def test_s3_event_notifications_of_every_shape(body):
    parse_event_or_reject(body)


@FUZZ
@given(st.one_of(json_values.map(json.dumps), st.text(max_size=200)))
def test_anything_as_an_event(body):
    parse_event_or_reject(body)


def decode_or_reject(
    data: bytes, fmt: str, options: formats.InputOptions = formats.NO_OPTIONS
) -> None:
    try:
        array = formats.decode(memoryview(data), fmt, MAX_DECODED, options)
    except InputError as rejected:
        assert rejected.reason in ("undecodable_input", "input_too_large")
        CASES["input rejected"] += 1
        return
    CASES["input decoded"] += 1
    assert array.ndim == 2 and array.shape[0] > 0 and array.shape[1] > 0
    assert array.nbytes <= MAX_DECODED  # integers are bounded by their float32 size
    assert not np.isinf(array).any()


@FUZZ
@given(st.binary(max_size=400), st.sampled_from(["npy", "json", "jsonl", "csv", "parquet"]))
def test_random_bytes_as_an_input_file(data, fmt):
    decode_or_reject(data, fmt)


def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array, allow_pickle=False)
    return out.getvalue()


@FUZZ
@given(st.data())
def test_corrupted_and_truncated_npy_files(data):
    rows = data.draw(st.integers(0, 6))
    cols = data.draw(st.integers(0, 6))
    dtype = data.draw(st.sampled_from(["<f4", ">f8", "<i2", "|u1", "<c8", "|b1", "<U3"]))
    raw = bytearray(_npy(np.zeros((rows, cols), dtype=dtype)))
    for _ in range(data.draw(st.integers(0, 3))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    decode_or_reject(bytes(raw[:cut]), "npy")


@FUZZ
@given(
    st.lists(
        st.lists(st.one_of(st.floats(), st.integers(), st.text(max_size=3), st.none()), max_size=5),
        max_size=6,
    )
)
def test_rows_of_anything_as_json_and_csv(rows):
    decode_or_reject(json.dumps(rows).encode(), "json")
    decode_or_reject("\n".join(json.dumps(r) for r in rows).encode(), "jsonl")
    csv = "\n".join(",".join(str(v) for v in r) for r in rows)
    decode_or_reject(csv.encode(), "csv")


parquet_columns = st.dictionaries(
    st.sampled_from(["a", "b", "c", "id", ""]),
    st.tuples(
        st.sampled_from(["int8", "int64", "uint32", "float32", "float64", "bool", "string"]),
        st.booleans(),  # with nulls
    ),
    min_size=1,
    max_size=4,
)


def _parquet_file(columns: dict[str, tuple[str, bool]], rows: int, seed: int) -> bytes:
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    made = {}
    for name, (kind, nulls) in columns.items():
        values = pa.array(rng.integers(0, 100, rows)).cast(kind)
        mask = rng.random(rows) < 0.3 if nulls else None
        made[name] = pa.array(values.to_pylist(), type=values.type, mask=mask)
    return parquet_bytes(made, row_group_rows=max(1, rows // 3))


@FUZZ
@given(
    columns=parquet_columns,
    rows=st.integers(0, 40),
    named=st.one_of(st.none(), st.lists(st.sampled_from(["a", "b", "c", "id", "x"]), max_size=3)),
    data=st.data(),
)
def test_parquet_files_of_any_columns_damaged_or_not(columns, rows, named, data):
    raw = bytearray(_parquet_file(columns, rows, seed=rows))
    for _ in range(data.draw(st.integers(0, 3))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.sampled_from([len(raw), data.draw(st.integers(0, len(raw)))]))
    chosen = tuple(dict.fromkeys(named)) if named else None
    decode_or_reject(bytes(raw[:cut]), "parquet", formats.InputOptions(chosen))


@FUZZ
@given(
    columns=st.one_of(
        json_values, st.lists(st.one_of(st.text(max_size=5), json_values), max_size=4)
    ),
    suffix=st.sampled_from([".parquet", ".csv", ".npy"]),
)
def test_any_columns_in_params(columns, suffix):
    parse_or_reject(
        json.dumps(
            {"task_id": "t", "input": f"s3://data/in/x{suffix}", "params": {"columns": columns}}
        )
    )


def test_a_json_array_cut_short_is_refused_however_long_its_last_row():
    """The outer array's `]` must close its `[`: a document cut after a row's `]` is
    not whole, also when that row is longer than a decoding window."""
    row = ",".join(["1"] * 70_000)  # 140 KB: read in pieces
    for doc in (f"[[{row}],[{row}]", f"[[{row}]", "[[1,2],[3,4]"):
        try:
            array = formats.decode(memoryview(doc.encode()), "json", 1 << 30)
        except InputError as rejected:
            assert rejected.reason == "undecodable_input"
        else:
            raise AssertionError(f"a truncated document was read as {array.shape}")


def test_decoded_arrays_are_bounded_before_they_are_built():
    huge_header = _npy(np.zeros((1, 1), np.float32)).replace(b"(1, 1)", b"(99999999, 999)")
    with_data = huge_header + b"\x00" * 64
    try:
        formats.decode(memoryview(with_data), "npy", MAX_DECODED)
    except InputError as rejected:
        assert rejected.reason == "input_too_large"
    else:
        raise AssertionError("a 400 GB shape was accepted")


@FUZZ
@given(
    task_id=st.from_regex(
        r"[A-Za-z0-9][A-Za-z0-9_=:@+-]{0,20}(/[A-Za-z0-9_-]{1,8}){0,3}", fullmatch=True
    ),
    key=st.from_regex(
        r"[a-z0-9_-]{1,10}(/[a-z0-9_-]{1,10}){0,3}\.(npy|csv|json|jsonl)", fullmatch=True
    ),
)
def test_well_formed_messages_are_always_accepted(task_id, key):
    task = parse_task(json.dumps({"task_id": task_id, "input": f"s3://data/in/{key}"}), RULES)
    CASES["message accepted"] += 1
    assert task.output.key == f"out/{task_id}.npy"


# -- what SQS and S3 refuse: characters, derived keys, lengths ------------------------
NOT_XML = st.sampled_from(["\uffff", "\ufffe", "\x00", "\x0b", "\x1f", "\x7f", "\n"])
# Strings that mix ordinary text with what SQS refuses, and with what it takes at the edges.
awkward_text = st.lists(
    st.one_of(st.text(max_size=8), NOT_XML, st.sampled_from(["\ud7ff", "\ue000", "\ufffd"])),
    max_size=6,
).map("".join)
valid_task_id = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._=:@+-]{0,20}", fullmatch=True)
LONG_RULES = MessageRules(
    allowed_input_prefixes=RULES.allowed_input_prefixes,
    allowed_output_prefixes=parse_prefixes("s3://data/", "out"),
    output_prefix=parse_s3_uri("s3://data/" + "p" * 500, "out", prefix=True),
    max_message_bytes=16_384,
)


@FUZZ
@given(
    task_id=st.one_of(
        awkward_text,
        st.builds(lambda a, b: a + b, valid_task_id, awkward_text),
        st.builds(lambda a, b: a + b, valid_task_id, NOT_XML),
    ),
    key=awkward_text,
    params=st.dictionaries(awkward_text, st.one_of(awkward_text, json_values), max_size=3),
    field=st.sampled_from(["input", "output", "none"]),
)
def test_characters_sqs_or_s3_refuse_in_every_field(task_id, key, params, field):
    doc = {"task_id": task_id, "input": "s3://data/in/a.npy", "params": params}
    if field != "none":
        doc[field] = f"s3://data/{'in' if field == 'input' else 'out'}/{key}.npy"
    parse_or_reject(json.dumps(doc))  # escapes: as a producer's SDK would send them
    parse_or_reject(json.dumps(doc, ensure_ascii=False))


@FUZZ
@given(
    task_id=st.integers(1, 512).map(lambda n: "t" * n),
    tail=st.sampled_from(["", "/a", "\n", "\u00e9", "/\u20ac"]),
    output_bytes=st.integers(990, 1040),
    char=st.sampled_from(["k", "\u00e9", "\u20ac", "\U0001f600"]),
)
def test_keys_near_the_1024_byte_limit(task_id, tail, output_bytes, char):
    parse_or_reject(json.dumps({"task_id": task_id + tail, "input": "s3://data/in/a.npy"}))
    parse_or_reject(
        json.dumps({"task_id": task_id + tail, "input": "s3://data/in/a.npy"}), LONG_RULES
    )
    name = char * ((output_bytes - len("out/.npy")) // len(char.encode()))
    output = f"s3://data/out/{name}.npy"
    parse_or_reject(json.dumps({"task_id": "t", "input": "s3://data/in/a.npy", "output": output}))


dimension = st.one_of(
    st.integers(-3, 12),
    st.integers(-(2**70), 2**70),
    st.sampled_from([2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64, -(2**63)]),
)


@FUZZ
@given(shape=st.lists(dimension, max_size=4).map(tuple), values=st.integers(0, 24))
def test_npy_headers_with_any_dimensions(shape, values):
    text = repr(shape)
    data = npy_claiming(text, values=values) if values else npy_claiming(text, values=1)[:-4]
    try:
        array = formats.decode(memoryview(data), "npy", MAX_DECODED)
    except InputError as rejected:
        assert rejected.reason in ("undecodable_input", "input_too_large")
        CASES["input rejected"] += 1
        return
    CASES["input decoded"] += 1
    # Accepted only when the header told the truth: the shape sent is the shape decoded.
    assert array.shape in (shape, (1, *shape))
    assert array.size == values
