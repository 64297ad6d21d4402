"""Every format is decoded within a memory bound: at most 3 × the decoded array + 8 MiB.

The bound holds for accepted inputs and for refused ones (for those, the decoded array
is the limit it would have passed). Measured with tracemalloc, which sees Python's
allocations and numpy's array buffers: everything a decoder allocates. The input itself
is not counted; in the worker it is the shared-memory segment, sized by the object.
Inputs sit just under and just over a 32 MiB `max_decoded_bytes`, in the shapes that
cost text decoders most: many small cells, long rows, one huge row.
"""

from __future__ import annotations

import functools
import io
import tracemalloc

import numpy as np
import pytest

from sqsinfer import formats
from sqsinfer.errors import InputError

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
