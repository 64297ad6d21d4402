"""Input and output formats: one row per format, the only place that knows them.

A format is named by its key's suffix. Inputs are decoded into a 2-D numeric array in
the child process; outputs are always rows × outputs (a 1-D prediction becomes one
column), so one stage's output is the next stage's input. A format that needs a package
beyond the core's (Parquet: pyarrow) names it and its extra, so the worker can refuse it
at parse time, and at start-up as its output format, when the package is missing.
"""

from __future__ import annotations

import importlib.util
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from sqsinfer.compute.formats import npy, parquet, text


@dataclass(frozen=True)
class InputOptions:
    """What a message chose about reading its input (its `params`), checked at parse time.

    Only plain strings travel in it: it is pickled to the inference process.
    """

    columns: tuple[str, ...] | None = None  # Parquet: these columns, in this order


NO_OPTIONS = InputOptions()

Decoder = Callable[[memoryview, int, InputOptions], np.ndarray]
Encoder = Callable[[np.ndarray], bytes]


def _without_options(decoder: Callable[[memoryview, int], np.ndarray]) -> Decoder:
    """A decoder that has no options (parsing refuses options such a format cannot take)."""

    def decode(buf: memoryview, max_bytes: int, _: InputOptions) -> np.ndarray:
        return decoder(buf, max_bytes)

    return decode


def _decode_parquet(buf: memoryview, max_bytes: int, options: InputOptions) -> np.ndarray:
    return parquet.decode_parquet(buf, max_bytes, options.columns)


def _encode_npy(predictions: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, predictions, allow_pickle=False)
    return out.getvalue()


def _encode_json(predictions: np.ndarray) -> bytes:
    return orjson.dumps(predictions, option=orjson.OPT_SERIALIZE_NUMPY)


def _encode_parquet(predictions: np.ndarray) -> bytes:
    """One column per output, in the predictions' dtype: `prediction`, or `prediction_0..k`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    width = predictions.shape[1]
    names = ["prediction"] if width == 1 else [f"prediction_{i}" for i in range(width)]
    table = pa.table([pa.array(predictions[:, i]) for i in range(width)], names=names)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return bytes(sink.getvalue().to_pybytes())


@dataclass(frozen=True)
class Format:
    name: str
    suffix: str
    content_type: str
    decode: Decoder
    encode: Encoder | None = None  # None: accepted as an input only
    selects_columns: bool = False  # accepts params.columns
    requires: str = ""  # a module beyond the core's it needs...
    extra: str = ""  # ...and the extra of sqsinfer that installs it

    @property
    def is_output(self) -> bool:
        return self.encode is not None

    @property
    def missing(self) -> str:
        """Why this format cannot be read or written here; empty when it can."""
        if not self.requires or importlib.util.find_spec(self.requires) is not None:
            return ""
        return (
            f"{self.suffix} needs {self.requires}, which is not installed: "
            f"pip install 'sqsinfer[{self.extra}]'"
        )


FORMATS: tuple[Format, ...] = (
    Format("npy", ".npy", "application/x-npy", _without_options(npy.decode_npy), _encode_npy),
    Format("json", ".json", "application/json", _without_options(text.decode_json), _encode_json),
    Format("jsonl", ".jsonl", "application/x-ndjson", _without_options(text.decode_jsonl)),
    Format("csv", ".csv", "text/csv", _without_options(text.decode_csv)),
    Format(
        "parquet",
        ".parquet",
        "application/vnd.apache.parquet",
        _decode_parquet,
        _encode_parquet,
        selects_columns=True,
        requires="pyarrow",
        extra="parquet",
    ),
)
_BY_NAME = {f.name: f for f in FORMATS}
_BY_SUFFIX = {f.suffix: f for f in FORMATS}

INPUT_SUFFIXES: tuple[str, ...] = tuple(f.suffix for f in FORMATS)
OUTPUT_SUFFIXES: tuple[str, ...] = tuple(f.suffix for f in FORMATS if f.is_output)
OUTPUT_NAMES: tuple[str, ...] = tuple(f.name for f in FORMATS if f.is_output)


def named(name: str) -> Format:
    return _BY_NAME[name]


def for_input(suffix: str) -> Format | None:
    """The format of an input key with this suffix, or None when it is not accepted."""
    return _BY_SUFFIX.get(suffix)


def for_output(suffix: str) -> Format | None:
    found = _BY_SUFFIX.get(suffix)
    return found if found is not None and found.is_output else None


def input_options(params: dict[str, Any], fmt: Format) -> InputOptions:
    """The reading options a message's `params` choose; ValueError says what is wrong.

    `params.columns`: a non-empty list of distinct column names, for formats that select
    columns. Everything else in `params` is the producer's own and is not looked at.
    """
    columns = params.get("columns")
    if columns is None:
        return NO_OPTIONS
    if not fmt.selects_columns:
        raise ValueError(f"params.columns selects columns of .parquet inputs, not {fmt.suffix}")
    if not isinstance(columns, list) or not columns:
        raise ValueError("params.columns must be a non-empty list of column names")
    if not all(type(name) is str and name for name in columns):
        raise ValueError("params.columns must hold only non-empty strings")
    if len(set(columns)) != len(columns):
        raise ValueError("params.columns names a column more than once")
    return InputOptions(tuple(columns))


def decode(
    buf: memoryview, name: str, max_bytes: int, options: InputOptions = NO_OPTIONS
) -> np.ndarray:
    return _BY_NAME[name].decode(buf, max_bytes, options)


def encode(predictions: np.ndarray, name: str) -> bytes:
    """Predictions as rows × outputs in the named output format."""
    encoder = _BY_NAME[name].encode
    if encoder is None:
        raise ValueError(f"{name} is not an output format")
    if predictions.ndim == 1:
        predictions = predictions.reshape(-1, 1)
    return encoder(np.ascontiguousarray(predictions))
