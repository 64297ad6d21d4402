"""Every format is decoded within a memory bound: at most 3 × the decoded array + 8 MiB.

The bound holds for accepted inputs and for refused ones (for those, the decoded array
is the limit it would have passed). Measured with tracemalloc, which sees Python's
allocations and numpy's array buffers: everything a decoder allocates, but for what
pyarrow allocates from its own memory pool, which a pool of separate accounts measures
for Parquet. The input itself is not counted; in the worker it is the shared-memory
segment, sized by the object. Inputs sit just under and just over a 32 MiB
`max_decoded_bytes`, in the shapes that cost text decoders most: many small cells, long
rows, one huge row; and for Parquet those that cost a reader of whole row groups most:
one column in one row group, many columns over many row groups, nulls.
"""

from __future__ import annotations

import functools
import io
import tracemalloc
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from sqsinfer.compute import formats
from sqsinfer.compute.errors import InputError
from sqsinfer.lab.synthetic import parquet_bytes

MiB = 1 << 20
LIMIT = 32 * MiB
SLACK = 8 * MiB
CELL_BYTES = 4  # every format decodes to float32


def _text(fmt: str, rows: int, cols: int, cell: bytes) -> bytes:
    row = b",".join([cell] * cols)
    if fmt == "csv":
        return b",".join([b"f"] * cols) + b"\n" + (row + b"\n") * rows  # with a header row
    if fmt == "jsonl":
        return (b"[" + row + b"]\n") * rows
    if rows == 1:
        return b"[" + row + b"]"  # one row given flat
    return b'{"rows": [' + b",".join([b"[" + row + b"]"] * rows) + b"]}"


@functools.cache
def make_input(fmt: str, shape: str, over: bool) -> tuple[bytes, int]:
    """The input's bytes and the size of the array it decodes to (over the limit: +1 row)."""
    rows, cols = {
        "small cells": (LIMIT // (16 * CELL_BYTES), 16),
        "long rows": (LIMIT // (65_536 * CELL_BYTES), 65_536),
        "one huge row": (1, LIMIT // CELL_BYTES),
    }[shape]
    if over:
        rows, cols = (rows, cols + 1) if rows == 1 else (rows + 1, cols)
    decoded = rows * cols * CELL_BYTES
    if fmt == "npy":
        out = io.BytesIO()
        np.save(out, np.ones((rows, cols), dtype=np.float32))
        return out.getvalue(), decoded
    return _text(fmt, rows, cols, b"1"), decoded


def peak_bytes(data: bytes, fmt: str, limit: int) -> tuple[int, np.ndarray | InputError]:
    view = memoryview(data)
    tracemalloc.start()
    try:
        result: np.ndarray | InputError = formats.decode(view, fmt, limit)
    except InputError as exc:
        result = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, result


@pytest.mark.parametrize("over", [False, True], ids=["under", "over"])
@pytest.mark.parametrize("shape", ["small cells", "long rows", "one huge row"])
@pytest.mark.parametrize("fmt", ["csv", "json", "jsonl", "npy"])
def test_decoding_stays_within_three_arrays(fmt, shape, over):
    data, decoded = make_input(fmt, shape, over)
    peak, result = peak_bytes(data, fmt, LIMIT)
    if over:
        assert isinstance(result, InputError) and result.reason == "input_too_large"
        decoded = LIMIT
    else:
        assert isinstance(result, np.ndarray) and result.nbytes == decoded
    assert peak <= 3 * decoded + SLACK, f"{peak / MiB:.1f} MiB for a {decoded / MiB:.1f} MiB array"


@pytest.mark.parametrize("fmt", ["csv", "json", "jsonl"])
def test_long_numbers_are_bounded_by_the_array_not_the_text(fmt):
    """Text five times its array: the decoder must not hold a copy of it."""
    cols = 64
    rows = 4 * MiB // (cols * CELL_BYTES)
    data = _text(fmt, rows, cols, b"-0.12345678901234567")
    peak, result = peak_bytes(data, fmt, LIMIT)
    assert isinstance(result, np.ndarray) and result.shape == (rows, cols)
    assert peak <= 3 * result.nbytes + SLACK, f"{peak / MiB:.1f} MiB for {len(data) / MiB:.0f} MiB"


# -- Parquet ------------------------------------------------------------------------------
# Every pool stays referenced: memory allocated from one is freed through it, even later.
_ARROW_POOLS: list[Any] = []


def parquet_peak_bytes(data: bytes, limit: int) -> tuple[int, np.ndarray | InputError]:
    """tracemalloc's peak plus the peak of pyarrow's pool (each counts what the other
    does not; their sum bounds the peak from above)."""
    pool = pa.proxy_memory_pool(pa.default_memory_pool())
    _ARROW_POOLS.append(pool)
    previous = pa.default_memory_pool()
    pa.set_memory_pool(pool)
    try:
        peak, result = peak_bytes(data, "parquet", limit)
    finally:
        pa.set_memory_pool(previous)
    return peak + pool.max_memory(), result


@functools.cache
def make_parquet(shape: str, over: bool) -> tuple[bytes, int]:
    """The file's bytes and the size of the array it decodes to (over the limit: +1 row)."""
    cols, row_group_rows, nulls = {
        "one column, one row group": (1, 0, False),
        "256 columns, many row groups": (256, 1000, False),
        "16 columns of nulls and integers": (16, 0, True),
    }[shape]
    rows = LIMIT // (cols * CELL_BYTES) + over
    if nulls:  # integers with a null in every seventh row: read as float64 with NaN
        column: Any = pa.array(np.arange(rows), mask=np.arange(rows) % 7 == 0)
    else:
        column = np.ones(rows)  # float64: every value pyarrow decodes is twice its float32
    data = parquet_bytes(
        {f"c{i}": column for i in range(cols)}, row_group_rows=row_group_rows or rows
    )
    return data, rows * cols * CELL_BYTES


@pytest.mark.parametrize("over", [False, True], ids=["under", "over"])
@pytest.mark.parametrize(
    "shape",
    [
        "one column, one row group",
        "256 columns, many row groups",
        "16 columns of nulls and integers",
    ],
)
def test_parquet_is_read_into_the_array_and_refused_before_it(shape, over):
    """The array plus a batch when accepted; nothing of the array's size when refused."""
    data, decoded = make_parquet(shape, over)
    peak, result = parquet_peak_bytes(data, LIMIT)
    if over:
        assert isinstance(result, InputError) and result.reason == "input_too_large"
        assert peak <= SLACK, f"{peak / MiB:.1f} MiB spent on a refused file"
        return
    assert isinstance(result, np.ndarray) and result.nbytes == decoded
    assert peak <= decoded + SLACK, f"{peak / MiB:.1f} MiB for a {decoded / MiB:.1f} MiB array"
