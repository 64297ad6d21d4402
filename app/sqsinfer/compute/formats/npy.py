""".npy inputs: read from the header, checked claim by claim, never unpickled.

The header is the sender's word: its shape and dtype are checked before a byte of the
data is looked at, and the data is then a zero-copy view over the shared memory.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np

from sqsinfer.compute.errors import InputError

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
