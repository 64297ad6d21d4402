"""Child-process side: load the model once, decode an input, predict, encode the output.

Nothing here runs on the worker's event loop. `init_process` is the pool initializer;
`run_task` is what each task submits. Inputs arrive through POSIX shared memory (the
parent wrote the S3 object's bytes there), so handing a large array over costs a name,
not a pickle. Nothing that came from a queue or a bucket is ever unpickled: `.npy` is
read with `allow_pickle` off and object dtypes refused.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import math
import os
import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any, Protocol, runtime_checkable

import numpy as np
import orjson

from sqsinfer.errors import InputError, ModelLoadError

# Threads of native libraries must be pinned before they are imported in the child.
_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@runtime_checkable
class Handler(Protocol):
    """What a model plugs in as. One instance per process, loaded once.

    `load` receives the model file and the thread count; `predict` takes a 2-D float
    array and returns a numeric array with one row per input row. Raise `InputError`
    from `predict` for inputs the model cannot take (e.g. the wrong number of features).
    """

    def load(self, model_path: str, threads: int) -> None: ...

    def predict(self, array: np.ndarray) -> np.ndarray: ...


class XGBoostHandler:
    """The default handler: an XGBoost Booster from `.ubj` or `.json`, `inplace_predict`."""

    def __init__(self) -> None:
        self.booster: Any = None
        self.n_features = 0

    def load(self, model_path: str, threads: int) -> None:
        import xgboost

        if not model_path.endswith((".ubj", ".json")):
            raise ModelLoadError(f"XGBoost model must be .ubj or .json, got {model_path}")
        booster = xgboost.Booster()
        booster.load_model(model_path)  # UBJSON/JSON parser only: never pickle
        booster.set_param({"nthread": threads})
        self.booster = booster
        self.n_features = booster.num_features()

    def predict(self, array: np.ndarray) -> np.ndarray:
        if array.shape[1] != self.n_features:
            raise InputError(
                "wrong_feature_count",
                f"input has {array.shape[1]} columns, model takes {self.n_features}",
            )
        # inplace_predict skips the DMatrix copy and releases the GIL.
        return np.asarray(self.booster.inplace_predict(array, validate_features=False))


def import_handler(path: str) -> Handler:
    module_name, _, attr = path.replace(":", ".").rpartition(".")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ModelLoadError(f"handler {path!r} cannot be imported: {exc}") from exc
    handler = factory()
    if not isinstance(handler, Handler):
        raise ModelLoadError(f"handler {path!r} has no load()/predict()")
    return handler


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class _ProcessState:
    handler: Handler
    max_decoded_bytes: int


_STATE: _ProcessState | None = None


def init_process(
    handler_path: str,
    model_path: str,
    threads: int,
    expected_sha256: str,
    max_decoded_bytes: int,
) -> None:
    """Pool initializer: pin threads, check the model's hash, load it once."""
    global _STATE  # noqa: PLW0603 - one model per process is the point
    for var in _THREAD_VARS:
        os.environ[var] = str(threads)
    if expected_sha256:
        actual = file_sha256(model_path)
        if actual != expected_sha256:
            raise ModelLoadError(
                f"model {model_path} has sha256 {actual}, expected {expected_sha256}"
            )
    handler = import_handler(handler_path)
    handler.load(model_path, threads)
    _STATE = _ProcessState(handler, max_decoded_bytes)


def start_process(
    handler_path: str,
    model_path: str,
    threads: int,
    expected_sha256: str,
    max_decoded_bytes: int,
) -> dict[str, Any]:
    """The first call each new process runs: load the model, then one warm-up prediction.

    Run as a task rather than as the executor's initializer so that a model that cannot
    load comes back as its own exception (pickled as plain text), telling it apart from
    a process that died while loading (an OOM kill), which is worth another try.
    """
    try:
        init_process(handler_path, model_path, threads, expected_sha256, max_decoded_bytes)
        return warm_up()
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(
            f"cannot load model {model_path} with {handler_path}: {type(exc).__name__}: {exc}"
        ) from None


def _state() -> _ProcessState:
    if _STATE is None:
        raise RuntimeError("this process was not initialised with init_process")
    return _STATE


def warm_up(n_features_hint: int = 0) -> dict[str, Any]:
    """One real prediction so that the first task pays no lazy set-up; reports the pid."""
    handler = _state().handler
    n = getattr(handler, "n_features", 0) or n_features_hint or 1
    started = time.perf_counter()
    handler.predict(np.zeros((2, n), dtype=np.float32))
    return {"pid": os.getpid(), "warmup_s": time.perf_counter() - started, "n_features": n}


# -- decoding ---------------------------------------------------------------------------


def _check_array(array: np.ndarray, max_bytes: int) -> np.ndarray:
    if array.ndim == 1 and array.size > 0 and array.dtype != object:
        array = array.reshape(1, -1)  # one row given flat
    if array.ndim != 2:
        raise InputError("undecodable_input", f"expected a 2-D array, got {array.ndim}-D")
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise InputError("undecodable_input", f"empty array of shape {array.shape}")
    if array.dtype.kind not in "fiu" or array.dtype.itemsize > 8:
        raise InputError("undecodable_input", f"unsupported dtype {array.dtype}")
    if array.nbytes > max_bytes:
        raise InputError("input_too_large", f"decoded array is {array.nbytes} bytes")
    if array.dtype.kind in "iu":
        array = array.astype(np.float32)
    if np.isinf(array).any():
        raise InputError("undecodable_input", "input contains infinity")
    return array


def _decode_npy(buf: memoryview, max_bytes: int) -> np.ndarray:
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
    if dtype.hasobject:
        raise InputError("undecodable_input", "object arrays are refused (they need pickle)")
    count = math.prod(shape)
    if count * dtype.itemsize > max_bytes:
        raise InputError("input_too_large", f"decoded array would be {count * dtype.itemsize} B")
    offset = head.tell()
    if len(buf) - offset < count * dtype.itemsize:
        raise InputError("undecodable_input", ".npy data is shorter than its header says")
    # Zero-copy view over the shared memory: the caller drops it before closing.
    flat = np.frombuffer(buf, dtype=dtype, count=count, offset=offset)
    array = flat.reshape(shape, order="F" if fortran else "C")
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return _check_array(array, max_bytes)


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


def _decode_json(buf: memoryview, max_bytes: int) -> np.ndarray:
    try:
        rows = orjson.loads(bytes(buf))
    except orjson.JSONDecodeError as exc:
        raise InputError("undecodable_input", f"invalid JSON: {exc}") from None
    if isinstance(rows, dict) and "rows" in rows:
        rows = rows["rows"]
    return _rows_to_array(rows, max_bytes)


def _decode_jsonl(buf: memoryview, max_bytes: int) -> np.ndarray:
    try:
        rows = [orjson.loads(line) for line in bytes(buf).splitlines() if line.strip()]
    except orjson.JSONDecodeError as exc:
        raise InputError("undecodable_input", f"invalid JSON line: {exc}") from None
    return _rows_to_array(rows, max_bytes)


def _decode_csv(buf: memoryview, max_bytes: int) -> np.ndarray:
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


DECODERS = {"npy": _decode_npy, "json": _decode_json, "jsonl": _decode_jsonl, "csv": _decode_csv}


def decode(buf: memoryview, input_format: str, max_bytes: int) -> np.ndarray:
    return DECODERS[input_format](buf, max_bytes)


def encode(predictions: np.ndarray, output_format: str) -> bytes:
    """Outputs are always rows × outputs (2-D), so a stage's output is the next one's input."""
    if predictions.ndim == 1:
        predictions = predictions.reshape(-1, 1)
    predictions = np.ascontiguousarray(predictions)
    if output_format == "json":
        return orjson.dumps(predictions, option=orjson.OPT_SERIALIZE_NUMPY)
    out = io.BytesIO()
    np.save(out, predictions, allow_pickle=False)
    return out.getvalue()


def _checked_predictions(predictions: np.ndarray, n_rows: int) -> np.ndarray:
    if predictions.dtype.kind not in "fiub" or predictions.ndim not in (1, 2):
        raise TypeError(f"handler returned {predictions.dtype} array of {predictions.ndim}-D")
    if predictions.shape[0] != n_rows:
        raise TypeError(f"handler returned {predictions.shape[0]} rows for {n_rows}")
    return predictions


def _compute(buf: memoryview, input_format: str, output_format: str) -> dict[str, Any]:
    state = _state()
    t0 = time.perf_counter()
    array = decode(buf, input_format, state.max_decoded_bytes)
    t1 = time.perf_counter()
    predictions = _checked_predictions(state.handler.predict(array), array.shape[0])
    t2 = time.perf_counter()
    rows = int(array.shape[0])
    del array
    body = encode(predictions, output_format)
    return {
        "body": body,
        "rows": rows,
        "decode_s": t1 - t0,
        "infer_s": t2 - t1,
        "encode_s": time.perf_counter() - t2,
    }


def run_task(shm_name: str, size: int, input_format: str, output_format: str) -> dict[str, Any]:
    """Decode the input in shared memory, predict, encode. Returns the encoded output.

    The input array is a zero-copy view of the shared memory, so every reference to
    it (including those held by a traceback's frames) must be gone before the memory
    is closed: errors are therefore re-raised as fresh exceptions after the cleanup.
    """
    shm = shared_memory.SharedMemory(name=shm_name)
    whole = shm.buf
    assert whole is not None
    buf = whole[:size]
    failure: Exception | None = None
    try:
        result = _compute(buf, input_format, output_format)
    except InputError as exc:
        failure = InputError(exc.reason, exc.detail)
    except Exception as exc:  # a handler bug: report it without its frames
        failure = RuntimeError(f"{type(exc).__name__}: {exc}")
    try:
        buf.release()
        whole.release()
        shm.close()
    except BufferError:
        pass  # the handler kept a view; the mapping goes when it does, the parent unlinks
    if failure is not None:
        raise failure
    return result


def predict_bytes(data: bytes, input_format: str, output_format: str) -> bytes:
    """Decode, predict and encode in this process (for checks and benchmarks)."""
    state = _state()
    array = decode(memoryview(data), input_format, state.max_decoded_bytes)
    return encode(state.handler.predict(array), output_format)
