"""The text decoders as they were before they streamed, kept as the reference.

They built every value as a Python object before checking the size, which is why they
were replaced; what they accepted and refused still defines the formats, so the
streaming decoders are compared with them on small inputs (tests/unit/test_text_formats.py).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson

from sqsinfer.compute.errors import InputError

# Unchanged: the array checks (for the float32 arrays text makes) and the header test.
from sqsinfer.compute.formats.npy import _check_array
from sqsinfer.compute.formats.text import _numeric


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
    if lines and not _numeric(lines[0]):
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


LEGACY = {"json": decode_json, "jsonl": decode_jsonl, "csv": decode_csv}
