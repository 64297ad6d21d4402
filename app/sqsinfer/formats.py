"""Input and output formats: one row per format, the only place that knows them.

A format is named by its key's suffix. Inputs are decoded into a 2-D numeric array in
the child process; outputs are always rows × outputs (a 1-D prediction becomes one
column), so one stage's output is the next stage's input.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import orjson

from sqsinfer import decoding

Decoder = Callable[[memoryview, int], np.ndarray]
Encoder = Callable[[np.ndarray], bytes]


def _encode_npy(predictions: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, predictions, allow_pickle=False)
    return out.getvalue()


def _encode_json(predictions: np.ndarray) -> bytes:
    return orjson.dumps(predictions, option=orjson.OPT_SERIALIZE_NUMPY)


@dataclass(frozen=True)
class Format:
    name: str
    suffix: str
    content_type: str
    decode: Decoder
    encode: Encoder | None = None  # None: accepted as an input only

    @property
    def is_output(self) -> bool:
        return self.encode is not None


FORMATS: tuple[Format, ...] = (
    Format("npy", ".npy", "application/x-npy", decoding.decode_npy, _encode_npy),
    Format("json", ".json", "application/json", decoding.decode_json, _encode_json),
    Format("jsonl", ".jsonl", "application/x-ndjson", decoding.decode_jsonl),
    Format("csv", ".csv", "text/csv", decoding.decode_csv),
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


def decode(buf: memoryview, name: str, max_bytes: int) -> np.ndarray:
    return _BY_NAME[name].decode(buf, max_bytes)


def encode(predictions: np.ndarray, name: str) -> bytes:
    """Predictions as rows × outputs in the named output format."""
    encoder = _BY_NAME[name].encode
    if encoder is None:
        raise ValueError(f"{name} is not an output format")
    if predictions.ndim == 1:
        predictions = predictions.reshape(-1, 1)
    return encoder(np.ascontiguousarray(predictions))
