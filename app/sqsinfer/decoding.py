"""Decoders: the bytes of an input object (in shared memory) to a 2-D numeric array.

Each takes the object's bytes and the largest decoded array allowed, and returns a
float array with one row per example, or raises `InputError`. Nothing here ever
unpickles: `.npy` is read from its header with object dtypes refused.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
import orjson

from sqsinfer.errors import InputError

_FLOAT32_BYTES = 4


def _check_array(array: np.ndarray, max_bytes: int) -> np.ndarray:
    if array.ndim == 1 and array.size > 0 and array.dtype != object:
        array = array.reshape(1, -1)  # one row given flat
    if array.ndim != 2:
        raise InputError("undecodable_input", f"expected a 2-D array, got {array.ndim}-D")
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise InputError("undecodable_input", f"empty array of shape {array.shape}")
    if array.dtype.kind not in "fiu" or array.dtype.itemsize > 8:
        raise InputError("undecodable_input", f"unsupported dtype {array.dtype}")
    # Integers become float32: the bound holds for that size.
    decoded = array.size * _FLOAT32_BYTES if array.dtype.kind in "iu" else array.nbytes
    if decoded > max_bytes:
        raise InputError("input_too_large", f"decoded array is {decoded} bytes")
    if array.dtype.kind in "iu":
        array = array.astype(np.float32)
    if np.isinf(array).any():
        raise InputError("undecodable_input", "input contains infinity")
    return array


def decode_npy(buf: memoryview, max_bytes: int) -> np.ndarray:
    head = io.BytesIO(bytes(buf[: min(len(buf), 1 << 16)]))
    try:
        version = np.lib.format.read_magic(head)
        reader = {
            (1, 0): np.lib.format.read_array_header_1_0,
            (2, 0): np.lib.format.read_array_header_2_0,
        }[version]
        shape, fortran, dtype = reader(head, max_header_size=10_000)
    except Exception as exc:  # numpy parses the header with ast/tokenize: anything can fly
        raise InputError("undecodable_input", f"not a valid .npy file: {exc}") from None
    count = _npy_count(shape, dtype, max_bytes)
    offset = head.tell()
    if len(buf) - offset != count * dtype.itemsize:
        raise InputError(
            "undecodable_input",
            f".npy data is {len(buf) - offset} bytes, its header says {count * dtype.itemsize}",
        )
    # Zero-copy view over the shared memory: the caller drops it before closing.
    flat = np.frombuffer(buf, dtype=dtype, count=count, offset=offset)
    array = flat.reshape(shape, order="F" if fortran else "C")
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return _check_array(array, max_bytes)


def _npy_count(shape: Any, dtype: np.dtype[Any], max_bytes: int) -> int:
    """The number of values a .npy header announces, once every claim in it is checked.

    The header is the sender's word: a negative dimension makes numpy infer one from the
    data (another shape than the one sent), zero or huge ones overflow its size checks.
    """
    if dtype.hasobject:
        raise InputError("undecodable_input", "object arrays are refused (they need pickle)")
    if dtype.kind not in "fiu" or dtype.itemsize > 8:
        raise InputError("undecodable_input", f"unsupported dtype {dtype}")
    if not isinstance(shape, tuple) or any(type(d) is not int or d < 0 for d in shape):
        raise InputError("undecodable_input", f".npy header has an impossible shape {shape!r}")
    if len(shape) not in (1, 2):
        raise InputError("undecodable_input", f"expected a 2-D array, got {len(shape)}-D")
    if 0 in shape:
        raise InputError("undecodable_input", f"empty array of shape {shape}")
    count = math.prod(shape)
    decoded = count * (_FLOAT32_BYTES if dtype.kind in "iu" else dtype.itemsize)
    if decoded > max_bytes:
        raise InputError("input_too_large", f"decoded array would be {decoded} B")
    return count


def _rows_to_array(rows: Any, max_bytes: int) -> np.ndarray:
    if not isinstance(rows, list) or not rows:
        raise InputError("undecodable_input", "expected a non-empty JSON array of rows")
    try:
        array = np.asarray(rows, dtype=np.float64)
    except (ValueError, TypeError, OverflowError) as exc:
        raise InputError("undecodable_input", f"rows are not numeric arrays: {exc}") from None
    with np.errstate(over="ignore"):  # beyond float32's range becomes inf, refused below
        narrowed = array.astype(np.float32, copy=False)
    return _check_array(narrowed, max_bytes)


def decode_json(buf: memoryview, max_bytes: int) -> np.ndarray:
    try:
        rows = orjson.loads(bytes(buf))
    except orjson.JSONDecodeError as exc:
        raise InputError("undecodable_input", f"invalid JSON: {exc}") from None
    if isinstance(rows, dict) and "rows" in rows:
        rows = rows["rows"]
    return _rows_to_array(rows, max_bytes)


def decode_jsonl(buf: memoryview, max_bytes: int) -> np.ndarray:
    try:
        rows = [orjson.loads(line) for line in bytes(buf).splitlines() if line.strip()]
    except orjson.JSONDecodeError as exc:
        raise InputError("undecodable_input", f"invalid JSON line: {exc}") from None
    return _rows_to_array(rows, max_bytes)


def decode_csv(buf: memoryview, max_bytes: int) -> np.ndarray:
    try:
        text = bytes(buf).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError("undecodable_input", f"CSV is not UTF-8: {exc}") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if lines and not _is_numeric_row(lines[0]):
        lines = lines[1:]  # a header row
    rows = []
    for number, line in enumerate(lines, start=1):
        try:
            rows.append([float(cell) if cell.strip() else math.nan for cell in line.split(",")])
        except ValueError:
            raise InputError("undecodable_input", f"CSV data row {number} is not numeric") from None
    if len({len(r) for r in rows}) > 1:
        raise InputError("undecodable_input", "CSV rows have different numbers of columns")
    return _rows_to_array(rows, max_bytes)


def _is_numeric_row(line: str) -> bool:
    try:
        [float(cell) for cell in line.split(",") if cell.strip()]
    except ValueError:
        return False
    return True
