"""Child-side decoding and encoding, run here in-process on plain buffers."""

from __future__ import annotations

import io

import numpy as np
import pytest

from sqsinfer.compute import formats, inference
from sqsinfer.compute.errors import InputError
from sqsinfer.compute.handlers.xgboost_impl import XGBoostHandler
from sqsinfer.lab import synthetic

LIMIT = 1 << 20


def decode(data: bytes, fmt: str) -> np.ndarray:
    return formats.decode(memoryview(data), fmt, LIMIT)


@pytest.mark.parametrize("fmt", ["npy", "json", "jsonl", "csv"])
def test_every_format_decodes_to_the_same_rows(fmt):
    rows = synthetic.make_rows(6, 4, seed=2)
    np.testing.assert_allclose(decode(synthetic.encode_input(rows, fmt), fmt), rows, rtol=1e-6)


def test_npy_keeps_float64_and_fortran_order_and_converts_integers():
    rows = np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4))
    out = io.BytesIO()
    np.save(out, rows)
    decoded = decode(out.getvalue(), "npy")
    assert decoded.dtype == np.float64
    np.testing.assert_array_equal(decoded, rows)
    ints = io.BytesIO()
    np.save(ints, np.arange(6, dtype=np.int32).reshape(2, 3))
    assert decode(ints.getvalue(), "npy").dtype == np.float32


def test_csv_empty_cells_are_missing_values():
    decoded = decode(b"a,b\n1,\n,2\n", "csv")
    assert np.isnan(decoded[0, 1]) and np.isnan(decoded[1, 0])


@pytest.mark.parametrize(
    ("data", "fmt", "why"),
    [
        (b"", "npy", "undecodable_input"),
        (b"\x93NUMPY\x01\x00\xff\xff", "npy", "undecodable_input"),
        (b"[[1, 2], [3]]", "json", "undecodable_input"),
        (b'[["a", "b"]]', "json", "undecodable_input"),
        (b"[[1e999, 1]]", "json", "undecodable_input"),
        (b"{}", "json", "undecodable_input"),
        (b"[[[1]]]", "json", "undecodable_input"),
        (b"[1, 2]\nnot json\n", "jsonl", "undecodable_input"),
        (b"1,2\n3\n", "csv", "undecodable_input"),
        (b"\xff\xfe", "csv", "undecodable_input"),
        (b"1,inf\n", "csv", "undecodable_input"),
    ],
)
def test_bad_inputs_raise_input_errors(data, fmt, why):
    with pytest.raises(InputError) as caught:
        decode(data, fmt)
    assert caught.value.reason == why


def test_decoded_size_is_bounded():
    rows = np.zeros((1000, 200), dtype=np.float64)  # 1.6 MB
    with pytest.raises(InputError) as caught:
        decode(synthetic.encode_input(rows, "npy"), "npy")
    assert caught.value.reason == "input_too_large"


def test_outputs_are_rows_by_outputs():
    assert synthetic.decode_output(formats.encode(np.array([1.0, 2.0]), "npy"), "npy").shape == (
        2,
        1,
    )
    assert formats.encode(np.array([[1.5], [2.5]], dtype=np.float32), "json") == b"[[1.5],[2.5]]"


def test_xgboost_handler_checks_the_feature_count(model_path):
    handler = XGBoostHandler()
    handler.load(model_path, 1)
    with pytest.raises(InputError) as caught:
        handler.predict(np.zeros((2, handler.n_features + 1), dtype=np.float32))
    assert caught.value.reason == "wrong_feature_count"
    with pytest.raises(inference.ModelLoadError):
        XGBoostHandler().load(model_path.replace(".ubj", ".pkl"), 1)


# -- .npy headers that lie --------------------------------------------------------------
def npy_claiming(shape: str, values: int = 10, dtype: str = "<f4") -> bytes:
    """A real .npy file of `values` zeros whose header claims `shape` instead."""
    out = io.BytesIO()
    np.save(out, np.zeros(values, dtype=dtype))
    raw = out.getvalue()
    length = int.from_bytes(raw[8:10], "little")
    header = raw[10 : 10 + length].decode("latin1").rstrip()
    header = header.replace(f"({values},)", shape)
    header += " " * (63 - (10 + len(header)) % 64) + "\n"  # the data stays 64-byte aligned
    return raw[:8] + len(header).to_bytes(2, "little") + header.encode() + raw[10 + length :]


@pytest.mark.parametrize(
    "shape",
    [
        "(-1, 5)",
        "(-5, 2)",
        "(2, -3)",
        "(-1, -1)",
        "(-10,)",
        "(9223372036854775807, 0)",
        "(0, 99999999999999999999)",
        "(True, 10)",
        "(2, 2)",  # fewer values than the data holds
        "(0, 10)",
        "()",
    ],
)
def test_npy_headers_that_lie_about_the_shape_are_refused(shape):
    with pytest.raises(InputError) as caught:
        decode(npy_claiming(shape), "npy")
    assert caught.value.reason == "undecodable_input"


@pytest.mark.parametrize("shape", ["(99999999999, 99999999999)", "(4611686018427387904, 4)"])
def test_npy_headers_claiming_huge_shapes_are_too_large(shape):
    with pytest.raises(InputError) as caught:
        decode(npy_claiming(shape), "npy")
    assert caught.value.reason == "input_too_large"


def test_npy_shapes_that_hold_the_data_are_accepted():
    assert decode(npy_claiming("(5, 2)"), "npy").shape == (5, 2)
    assert decode(npy_claiming("(10,)"), "npy").shape == (1, 10)


def test_small_integers_are_bounded_by_their_decoded_float32_size():
    out = io.BytesIO()
    np.save(out, np.zeros((LIMIT // 2, 1), dtype=np.uint8))  # half the limit as bytes
    with pytest.raises(InputError) as caught:
        decode(out.getvalue(), "npy")  # but twice the limit as float32
    assert caught.value.reason == "input_too_large"
