"""The streaming text decoders accept and refuse what the decoders before them did.

`legacy_decoding` holds the decoders as they were (whole input into Python objects,
then checked). On small inputs of every kind, well-formed or not, the streaming ones
must give the same array or refuse with the same reason, with windows small enough
that every input is cut into several, rows longer than a window included.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sqsinfer.compute import formats
from sqsinfer.compute.errors import InputError
from sqsinfer.compute.formats import text as decoding
from tests.unit.legacy_decoding import LEGACY

LIMIT = 1 << 20
SAME = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
windows = st.sampled_from([48, 61, 100, 1 << 17])


def outcome(decode, data: bytes) -> np.ndarray | str:
    try:
        return decode(memoryview(data), LIMIT)
    except InputError as exc:
        return exc.reason


def assert_same(data: bytes, fmt: str, window: int) -> None:
    old = outcome(LEGACY[fmt], data)
    saved = decoding._WINDOW_BYTES
    decoding._WINDOW_BYTES = window
    try:
        new = outcome(lambda buf, limit: formats.decode(buf, fmt, limit), data)
    finally:
        decoding._WINDOW_BYTES = saved
    if isinstance(old, str):
        assert isinstance(new, str) and new == old, f"{fmt} {data[:300]!r}: was {old}, now {new!r}"
        return
    assert isinstance(new, np.ndarray), f"{fmt} {data[:300]!r}: was accepted, now {new}"
    assert new.dtype == np.float32 and new.shape == old.shape
    np.testing.assert_array_equal(new, old)


numbers = st.one_of(
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
)
cell_text = st.one_of(
    numbers.map(repr),
    numbers.map(str),
    st.sampled_from(
        ["", " ", " 1 ", "1e5", "-0", ".5", "5.", "+1", "01", "nan", "inf", "-inf", "1_0"]
    ),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),  # beyond float32: inf
    st.sampled_from(["1e40", "3.5e38", "a", "e", "x1", "é", "\u3000", '"1"', "1 2", "0x1"]),
    st.sampled_from(["\x1f1", "1\x1f", "\u30001", "\t2", "\ufeff1", "\xa01"]),
)
line_ends = st.sampled_from(
    ["\n", "\r\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]
)


def odd(draw: st.DrawFn) -> bool:
    """True for about one draw in `n`: most inputs are well formed, some are not."""
    return draw(st.sampled_from(range(8))) == 5


@st.composite
def csv_texts(draw: st.DrawFn) -> bytes:
    cols = draw(st.integers(1, 6))
    lines = []
    if draw(st.booleans()):
        lines.append(",".join(draw(st.lists(st.sampled_from(["a", "f1", "1", ""]), min_size=1))))
    for _ in range(draw(st.integers(0, 12))):
        width = draw(st.integers(1, 7)) if odd(draw) else cols
        if odd(draw):
            lines.append(draw(st.sampled_from(["", "  ", "\t", "\u3000"])))  # blank
            continue
        cell = cell_text if odd(draw) else numbers.map(repr) | st.sampled_from(["", " "])
        lines.append(",".join(draw(st.lists(cell, min_size=width, max_size=width))))
    end = draw(line_ends) if odd(draw) else draw(st.sampled_from(["\n", "\r\n"]))
    data = (end.join(lines) + draw(st.sampled_from(["", end]))).encode()
    return data + b"\xff" if odd(draw) else data  # not UTF-8


@SAME
@given(csv_texts(), windows)
def test_csv_is_read_as_before(data, window):
    assert_same(data, "csv", window)


@SAME
@given(st.integers(1, 400), st.sampled_from(["1", "", "-2.5", "1e3", "x"]), windows)
def test_csv_rows_longer_than_a_window_are_read_as_before(cols, filler, window):
    row = ",".join(["0.25"] * cols + [filler] + ["3"] * cols)
    assert_same(f"a,b\n{row}\n{row}\n1,2\n".encode(), "csv", window)
    assert_same(f"{row}\n{row}".encode(), "csv", window)


json_cells = st.one_of(
    numbers,
    st.floats(allow_nan=False, allow_infinity=False),
    st.none(),
    st.booleans(),
    st.sampled_from(["1.5", "x", "", "[1]", "1,2"]),
    st.lists(numbers, max_size=2),
)


@st.composite
def json_docs(draw: st.DrawFn) -> object:
    cols = draw(st.integers(0, 5))
    cell = json_cells if odd(draw) else numbers
    rows = [
        draw(st.lists(cell, min_size=cols, max_size=6 if odd(draw) else cols))
        for _ in range(draw(st.integers(0, 8)))
    ]
    shape = (
        "rows"
        if draw(st.booleans())
        else draw(st.sampled_from(["flat", "object", "object+", "nested", "scalar"]))
    )
    if shape == "flat":
        return rows[0] if rows else []
    if shape == "object":
        return {"rows": rows}
    if shape == "object+":
        return {"id": "x", "meta": {"rows": [[9]]}, "rows": rows, "after": [1, {"b": 2}]}
    if shape == "nested":
        return [rows]
    if shape == "scalar":
        return draw(st.one_of(numbers, st.none(), st.text(max_size=5)))
    return rows


def _serialise(draw: st.DrawFn, doc: object) -> bytes:
    indent = draw(st.sampled_from([None, None, 1, 2]))
    separators = draw(st.sampled_from([(",", ":"), (", ", ": "), (" , ", " : ")]))
    text = json.dumps(doc, indent=indent, separators=separators)
    damage = draw(st.integers(0, 20))
    if damage == 0 and text:
        cut = draw(st.integers(0, len(text) - 1))
        text = text[:cut]  # truncated
    elif damage == 1:
        text = text.replace("]", ",]", 1)  # a trailing comma
    elif damage == 2:
        text = text.replace(",", "", 1)  # a missing comma
    elif damage == 3:
        text = text + " []"  # something after the document
    return (draw(st.sampled_from(["", " ", "\n"])) + text).encode()


@SAME
@given(st.data(), windows)
def test_json_is_read_as_before(data, window):
    assert_same(_serialise(data.draw, data.draw(json_docs())), "json", window)


@SAME
@given(st.data(), windows)
def test_json_lines_are_read_as_before(data, window):
    doc = data.draw(json_docs())
    rows = doc if isinstance(doc, list) else [doc]
    end = data.draw(st.sampled_from(["\n", "\r\n", "\r"]))
    lines = [_serialise(data.draw, row).replace(b"\n", b" ") for row in rows]
    if data.draw(st.booleans()):
        lines.insert(data.draw(st.integers(0, len(lines))), b"  ")  # a blank line
    assert_same(end.encode().join(lines), "jsonl", window)


@SAME
@given(st.integers(1, 300), st.sampled_from(["1", "null", "true", '"2.5"', "[1]", ""]), windows)
def test_json_rows_longer_than_a_window_are_read_as_before(cols, odd, window):
    row = "[" + ",".join(["0.5"] * cols + ([odd] if odd else []) + ["-3"] * cols) + "]"
    assert_same(f"[{row}, {row}]".encode(), "json", window)
    assert_same(f'{{"rows": [[1], {row}]}}'.encode(), "json", window)
    assert_same(row.encode(), "json", window)  # one row given flat
    assert_same(f"{row}\n{row}\n".encode(), "jsonl", window)


@pytest.mark.parametrize(
    ("data", "fmt", "shape"),
    [
        (b"a,b\r\n1,\r\n,2\r\n\r\n", "csv", (2, 2)),  # header, CRLF, empty cells, blank line
        (b'{"rows": [[1, 2]], "id": "x"}', "json", (1, 2)),
        (b"[1, 2, 3]", "json", (1, 3)),  # one row given flat
        (b"[[1, null], [true, 2]]", "json", (2, 2)),  # null is missing, true is 1
        (b"1\n2\n3\n", "jsonl", (1, 3)),  # lines of single numbers: one row
    ],
)
def test_inputs_accepted_before_still_are(data, fmt, shape):
    assert formats.decode(memoryview(data), fmt, LIMIT).shape == shape
    assert_same(data, fmt, 1 << 17)


@pytest.mark.parametrize(
    "data",
    [
        b"0\x1e0",  # str.splitlines ends lines at \x1c-\x1e, float() refuses them in a cell
        b"0\x1e\x1e",
        b"\x1e0,0\x1e0\x1e\x1e",
        b"\x1f1,2\n3,4",  # \x1f is blank to str.strip(), not to float(): a header
        b"\x1f\n1,2",
        "\u3000\n1,2".encode(),  # a blank line of Unicode space
        "\ufeffa,b\n1,2".encode(),  # a byte-order mark makes the first line a header
        b"1,2\r\n\r\n3,4\r",
        b" 1 , 2 \n\t3,\t4",
        b"-0,1e5\n+1,.5",
    ],
)
@pytest.mark.parametrize("window", [48, 1 << 17])
def test_csv_edge_cases_are_read_as_before(data, window):
    assert_same(data, "csv", window)


@pytest.mark.parametrize("fmt", ["csv", "json", "jsonl"])
def test_a_value_longer_than_a_window_is_refused(fmt):
    long_value = b"1" * (decoding._WINDOW_BYTES + 10)
    data = {"csv": long_value, "json": b"[" + long_value + b"]", "jsonl": long_value}[fmt]
    with pytest.raises(InputError) as caught:
        formats.decode(memoryview(data), fmt, LIMIT)
    assert caught.value.reason == "undecodable_input"


@pytest.mark.parametrize("fmt", ["csv", "json", "jsonl"])
def test_the_limit_is_exact(fmt):
    rows = np.ones((64, 4), dtype=np.float32)
    text = {
        "csv": b"1,1,1,1\n" * 64,
        "json": json.dumps(rows.tolist()).encode(),
        "jsonl": b"[1,1,1,1]\n" * 64,
    }[fmt]
    assert formats.decode(memoryview(text), fmt, rows.nbytes).shape == (64, 4)
    with pytest.raises(InputError) as caught:
        formats.decode(memoryview(text), fmt, rows.nbytes - 1)
    assert caught.value.reason == "input_too_large"
