"""Hostile input: every message body and every input file ends as a task or a clean rejection.

Property-based (hypothesis): random bytes, deep nesting, huge numbers, wrong types,
oversized bodies, NaN and infinity, wrong shapes, empty and truncated files, text in
CSV. No other exception, no hang, and decoded arrays stay within their bound. The
number of cases run is printed in pytest's summary.
"""

from __future__ import annotations

import collections
import io
import json

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sqsinfer import formats
from sqsinfer.errors import InputError
from sqsinfer.messages import (
    MessageRejected,
    MessageRules,
    parse_prefixes,
    parse_s3_uri,
    parse_task,
)

CASES: collections.Counter[str] = collections.Counter()
MAX_DECODED = 1 << 16
RULES = MessageRules(
    allowed_input_prefixes=parse_prefixes("s3://data/in/", "in"),
    allowed_output_prefixes=parse_prefixes("s3://data/out/", "out"),
    output_prefix=parse_s3_uri("s3://data/out/", "out", prefix=True),
    max_message_bytes=4096,
)
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


def parse_or_reject(body: str | bytes) -> None:
    try:
        task = parse_task(body, RULES)
    except MessageRejected as rejected:
        assert rejected.reason and rejected.detail
        CASES["message rejected"] += 1
        return
    CASES["message accepted"] += 1
    assert any(task.input.within(p) for p in RULES.allowed_input_prefixes)
    assert any(task.output.within(p) for p in RULES.allowed_output_prefixes)
    assert ".." not in task.output.key.split("/")


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


def decode_or_reject(data: bytes, fmt: str) -> None:
    try:
        array = formats.decode(memoryview(data), fmt, MAX_DECODED)
    except InputError as rejected:
        assert rejected.reason in ("undecodable_input", "input_too_large")
        CASES["input rejected"] += 1
        return
    CASES["input decoded"] += 1
    assert array.ndim == 2 and array.shape[0] > 0 and array.shape[1] > 0
    assert array.nbytes <= MAX_DECODED * 2  # integers widen to float32 at most
    assert not np.isinf(array).any()


@FUZZ
@given(st.binary(max_size=400), st.sampled_from(["npy", "json", "jsonl", "csv"]))
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
