"""Parquet inputs: numeric columns to a float32 matrix, bounded before anything is read.

pyarrow comes with the `parquet` extra and is imported only when a Parquet input is
decoded; the worker refuses `.parquet` messages at parse time when it is missing.

Columns: without a choice, every numeric column (integers, floating point, booleans as
0/1) in the file's order, others skipped; with `columns` (a message's `params.columns`),
exactly those, in that order, each required to exist and be numeric. Nulls become NaN.

Memory: the array's size is known from the file's metadata (rows × columns), so it is
refused before it is allocated, then filled in place. It is filled a column at a time, in
batches of `_BATCH_ROWS` rows, so a file written as one huge row group costs a batch at a
time, not the row group's decoded columns. Peak: the array, a batch and the page being
decoded (its size is the writer's choice: 1 MiB by default in pyarrow and Spark). Reading
one column at a time keeps it to one page; reading all at once would hold one per column,
and is no faster (slower for wide files).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from sqsinfer.compute.errors import InputError

_FLOAT32_BYTES = 4
# Rows of one column decoded by pyarrow at a time, whatever the row groups' size: 512 KiB
# as float64, under 2 MiB of pyarrow's memory with its buffers' growth.
_BATCH_ROWS = 1 << 16
_DETAIL_CHARS = 300  # of pyarrow's own message, and of a column name quoted back
_NAMES_LISTED = 10  # columns a "no numeric columns" detail lists


def decode_parquet(
    buf: memoryview, max_bytes: int, columns: tuple[str, ...] | None = None
) -> np.ndarray:
    """The file's numeric columns (or `columns`) as a float32 array of rows × columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with _refusing_broken_files():
        reader = pq.ParquetFile(pa.BufferReader(pa.py_buffer(buf)))
        try:
            names = _selected(reader.schema_arrow, columns)
            out = _allocate(reader.metadata.num_rows, len(names), max_bytes)
            _fill(reader, names, out)
        finally:
            reader.close(force=True)  # lets go of the shared memory now, not when collected
    return out


@contextlib.contextmanager
def _refusing_broken_files() -> Iterator[None]:
    """Anything pyarrow raises on a damaged file becomes the reason it is refused."""
    try:
        yield
    except InputError:
        raise
    except Exception as exc:  # pyarrow parses untrusted metadata and pages: anything can fly
        reason = f"{type(exc).__name__}: {str(exc).strip()}"[:_DETAIL_CHARS]
        raise InputError("undecodable_input", f"not a valid Parquet file: {reason}") from None


def _numeric(field_type: Any) -> bool:
    import pyarrow as pa

    return bool(
        pa.types.is_integer(field_type)
        or pa.types.is_floating(field_type)
        or pa.types.is_boolean(field_type)
    )


def _quoted(name: str) -> str:
    return repr(name[:_DETAIL_CHARS])


def _selected(schema: Any, columns: tuple[str, ...] | None) -> list[str]:
    """The names to read, each naming exactly one numeric column of the file."""
    if columns is None:
        names = [f.name for f in schema if _numeric(f.type)]
        if not names:
            found = ", ".join(f"{_quoted(f.name)} ({f.type})" for f in list(schema)[:_NAMES_LISTED])
            raise InputError(
                "undecodable_input", f"Parquet file has no numeric columns (it has {found})"
            )
    else:
        names = list(columns)
    for name in names:
        where = schema.get_all_field_indices(name)
        if not where:
            raise InputError("undecodable_input", f"Parquet file has no column {_quoted(name)}")
        if len(where) > 1:
            raise InputError(
                "undecodable_input", f"Parquet file has {len(where)} columns named {_quoted(name)}"
            )
        field_type = schema.field(where[0]).type
        if not _numeric(field_type):
            raise InputError(
                "undecodable_input", f"column {_quoted(name)} is {field_type}, not numeric"
            )
    return names


def _allocate(rows: int, columns: int, max_bytes: int) -> np.ndarray:
    """The output array, once the metadata's claims are checked against the limit."""
    if rows < 0:
        raise InputError("undecodable_input", f"Parquet metadata claims {rows} rows")
    if rows == 0:
        raise InputError("undecodable_input", "Parquet file has no rows")
    decoded = rows * columns * _FLOAT32_BYTES
    if decoded > max_bytes:
        raise InputError("input_too_large", f"decoded array would be {decoded} B")
    return np.empty((rows, columns), dtype=np.float32)


def _fill(reader: Any, names: list[str], out: np.ndarray) -> None:
    """Read column by column, batch by batch, into `out`, held to the rows it has."""
    rows = out.shape[0]
    for j, name in enumerate(names):
        at = 0
        for batch in reader.iter_batches(batch_size=_BATCH_ROWS, columns=[name], use_threads=False):
            stop = at + batch.num_rows
            if stop > rows:
                raise InputError(
                    "undecodable_input",
                    f"Parquet row groups hold more rows than the file's metadata ({rows})",
                )
            with np.errstate(over="ignore"):  # beyond float32's range becomes inf, refused
                out[at:stop, j] = _values(batch.column(0))
            if np.isinf(out[at:stop, j]).any():
                raise InputError("undecodable_input", "input contains infinity")
            at = stop
        if at != rows:
            raise InputError(
                "undecodable_input",
                f"Parquet row groups hold {at} rows, the file's metadata {rows}",
            )


def _values(column: Any) -> np.ndarray:
    """One column of a batch as numbers, nulls as NaN."""
    import pyarrow as pa

    if pa.types.is_boolean(column.type):
        column = column.cast(pa.float32())  # numpy has no nullable bool: it would give objects
    values: np.ndarray = column.to_numpy(zero_copy_only=False)  # nulls become NaN
    return values
