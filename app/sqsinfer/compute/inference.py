"""Child-process side: load the model once, decode an input, predict, encode the output.

Nothing here runs on the worker's event loop. `init_process` is the pool initializer;
`run_task` is what a task submits alone, `run_batch` what several small tasks submit
together (their rows scored in one predict call, each task's output its own). Inputs
arrive through POSIX shared memory (the parent wrote the S3 object's bytes there), so
handing a large array over costs a name, not a pickle. Nothing that came from a queue or
a bucket is ever unpickled: `.npy` is read with `allow_pickle` off and object dtypes
refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing import connection, shared_memory
from typing import Any

import numpy as np

from sqsinfer.compute import formats
from sqsinfer.compute.errors import InputError, ModelLoadError
from sqsinfer.compute.handlers import (
    Handler,
    choose_output,
    handler_version,
    import_handler,
    output_served,
    rows_independent,
)

# Threads of native libraries must be pinned before they are imported in the child.
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


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
_ORPHANED_EXIT = 1


def init_process(
    handler_path: str,
    model_path: str,
    threads: int,
    expected_sha256: str,
    max_decoded_bytes: int,
    *,
    model_output: str = "",
) -> None:
    """Pool initializer: follow the parent, pin threads, check the model's hash, load it
    (serving `model_output`, by name, of a model of several)."""
    global _STATE  # noqa: PLW0603 - one model per process is the point
    exit_with_parent()
    for var in THREAD_VARS:
        os.environ[var] = str(threads)
    handler = import_handler(handler_path)
    choose_output(handler, model_output, handler_path)
    if expected_sha256:
        _load_pinned(handler, model_path, threads, expected_sha256)
    else:
        handler.load(model_path, threads)
    _STATE = _ProcessState(handler, max_decoded_bytes)


def exit_with_parent() -> None:
    """Exit as soon as the process that spawned this one is gone.

    When the worker alone is killed (an OOM kill picks the largest process), its
    inference processes would otherwise wait forever for work: each holds its mapped
    inputs and keeps multiprocessing's resource tracker alive, which cleans up the
    worker's shared memory only once every holder of its pipe has gone.

    multiprocessing gives every spawned process a sentinel: a pipe whose other end only
    the parent holds, so it reads as closed the moment the parent dies, however it died.
    A thread waits on it. This was chosen over Linux's PR_SET_PDEATHSIG, which fires
    when the *thread* that created the child exits (a pool restarted from a short-lived
    thread would lose its processes), needs a check for a parent already gone before it
    was set, and exists only on Linux. The one cost: a handler holding the GIL in native
    code delays the exit until it lets go.
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        return  # called in-process (a test, a benchmark): there is no parent to follow
    sentinel = parent.sentinel

    def watch() -> None:
        connection.wait([sentinel])
        os.write(2, b"sqsinfer: the worker is gone; inference process exiting\n")
        os._exit(_ORPHANED_EXIT)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _load_pinned(handler: Handler, model_path: str, threads: int, expected_sha256: str) -> None:
    """Load exactly the bytes whose hash was checked.

    The file is read once and hashed; a handler with `load_bytes` is given those very
    bytes, so a file swapped after the check is never loaded. A handler with only
    `load(path)` reads the file again after the check: a swap in between goes unseen,
    and such a handler's pin guards against a wrong file, not a racing writer.

    The bytes are read into a bytearray, which `load_bytes` may hand to a library in
    place: XGBoost parses it where it lies, so a pinned model costs its size once at
    start, not twice (read, then copied for the library).
    """
    data = read_whole(model_path)
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected_sha256:
        raise ModelLoadError(f"model {model_path} has sha256 {actual}, expected {expected_sha256}")
    load_bytes = getattr(handler, "load_bytes", None)
    if callable(load_bytes):
        load_bytes(data, threads)
    else:
        handler.load(model_path, threads)


def read_whole(path: str) -> bytearray:
    """The file's bytes, read straight into one buffer of its size (no second copy). A
    file that grows meanwhile is read to the size it had; one that shrinks, to its end."""
    with open(path, "rb", buffering=0) as fh:
        size = os.fstat(fh.fileno()).st_size
        data = bytearray(size)
        with memoryview(data) as view:
            got = 0
            while got < size:
                n = fh.readinto(view[got:])
                if not n:
                    break
                got += n
    del data[got:]
    return data


def start_process(
    handler_path: str,
    model_path: str,
    threads: int,
    expected_sha256: str,
    max_decoded_bytes: int,
    *,
    model_output: str = "",
) -> dict[str, Any]:
    """The first call each new process runs: load the model, then one warm-up prediction.

    Run as a task rather than as the executor's initializer so that a model that cannot
    load comes back as its own exception (pickled as plain text), telling it apart from
    a process that died while loading (an OOM kill), which is worth another try.
    """
    try:
        init_process(
            handler_path,
            model_path,
            threads,
            expected_sha256,
            max_decoded_bytes,
            model_output=model_output,
        )
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(
            f"cannot load model {model_path} with {handler_path}: {type(exc).__name__}: {exc}"
        ) from None
    try:
        return warm_up()
    except ModelLoadError as exc:
        raise ModelLoadError(f"handler {handler_path!r} fails its warm-up: {exc}") from None
    except Exception as exc:
        raise ModelLoadError(
            f"handler {handler_path!r} fails its warm-up prediction: {type(exc).__name__}: {exc}"
        ) from None


def loaded_handler() -> Handler:
    """The handler this process loaded (for checks run inside a pool process)."""
    return _state().handler


def _state() -> _ProcessState:
    if _STATE is None:
        raise RuntimeError("this process was not initialised with init_process")
    return _STATE


def warm_up() -> dict[str, Any]:
    """One real prediction, checked against the handler contract, before the pool is ready.

    A handler that returns something other than a numeric array with one row per input
    row stops start-up here with a message that says what it returned, instead of
    failing every task later.
    """
    handler = _state().handler
    sample = warm_up_input(handler)
    started = time.perf_counter()
    try:
        checked_predictions(handler.predict(sample), sample.shape[0])
    except InputError as exc:
        raise ModelLoadError(f"warm-up prediction refused its own input: {exc}") from None
    warmup_s = time.perf_counter() - started
    return {
        "pid": os.getpid(),
        "warmup_s": warmup_s,
        "handler_version": handler_version(handler),
        "model_output": output_served(handler),
        # What the worker needs to coalesce small tasks: whether the handler allows it,
        # and the columns of its input (the inputs that cannot be small are told by size).
        "rows_independent": rows_independent(handler),
        "n_features": int(sample.shape[1]),
    }


def warm_up_input(handler: Handler) -> np.ndarray:
    """The handler's `sample_input()`, or zeros of its `n_features` columns."""
    sample_input = getattr(handler, "sample_input", None)
    if callable(sample_input):
        sample = np.asarray(sample_input())
        if sample.ndim != 2 or sample.shape[0] == 0 or sample.dtype.kind not in "fiu":
            raise ModelLoadError(
                f"sample_input() must return a non-empty 2-D numeric array, got {sample.dtype} "
                f"of shape {sample.shape}"
            )
        return sample
    n_features = getattr(handler, "n_features", None)
    if isinstance(n_features, int) and n_features > 0:
        return np.zeros((2, n_features), dtype=np.float32)
    raise ModelLoadError(
        f"{type(handler).__name__} gives no warm-up input: define sample_input() or a "
        "positive n_features after load()"
    )


def checked_predictions(predictions: object, n_rows: int) -> np.ndarray:
    """The handler contract: a numeric numpy array, rows or rows × outputs, one row per row."""
    if not isinstance(predictions, np.ndarray):
        raise ModelLoadError(
            f"predict() returned a {type(predictions).__module__}.{type(predictions).__name__}, "
            "not a numpy.ndarray (convert it, e.g. with .numpy() or numpy.asarray)"
        )
    if predictions.dtype.kind not in "fiub" or predictions.ndim not in (1, 2):
        raise ModelLoadError(
            f"predict() returned a {predictions.ndim}-D {predictions.dtype} array: expected "
            "a numeric array of rows or rows × outputs"
        )
    if predictions.shape[0] != n_rows:
        raise ModelLoadError(f"predict() returned {predictions.shape[0]} rows for {n_rows}")
    return predictions


def _compute(
    buf: memoryview,
    input_format: str,
    output_format: str,
    options: formats.InputOptions = formats.NO_OPTIONS,
) -> dict[str, Any]:
    state = _state()
    t0 = time.perf_counter()
    array = formats.decode(buf, input_format, state.max_decoded_bytes, options)
    t1 = time.perf_counter()
    predictions = _predicted(array)
    infer_s = time.perf_counter() - t1
    rows = int(array.shape[0])
    del array  # the input's memory goes before the output's is made
    return _encoded(predictions, output_format, rows, t1 - t0, infer_s)


def _predicted(array: np.ndarray) -> np.ndarray:
    try:
        return checked_predictions(_state().handler.predict(array), array.shape[0])
    except ModelLoadError as exc:  # the same input would break the contract every time
        raise InputError("invalid_prediction", str(exc)) from None


def _encoded(
    predictions: np.ndarray, output_format: str, rows: int, decode_s: float, infer_s: float
) -> dict[str, Any]:
    t2 = time.perf_counter()
    body = formats.encode(predictions, output_format)
    return {
        "body": body,
        "sha256": hashlib.sha256(body).hexdigest(),  # the output's lineage, off the event loop
        "rows": rows,
        "decode_s": decode_s,
        "infer_s": infer_s,
        "encode_s": time.perf_counter() - t2,
    }


def _handed_back(exc: BaseException) -> BaseException:
    """A task's failure as the worker is given it: a fresh exception, without the frames
    (and the arrays they hold) of the original.

    A handler's sys.exit() or a stray KeyboardInterrupt, raised again in the worker, would
    stop its event loop and every message it holds: here it is one failed task. What is
    no Exception besides (a native extension's panic) goes back as it is: retried.
    """
    if isinstance(exc, InputError):
        return InputError(exc.reason, exc.detail)
    if isinstance(exc, (Exception, SystemExit, KeyboardInterrupt)):
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc.with_traceback(None)


def run_task(
    shm_name: str,
    size: int,
    input_format: str,
    output_format: str,
    options: formats.InputOptions = formats.NO_OPTIONS,
) -> dict[str, Any]:
    """Decode the input in shared memory, predict, encode. Returns the encoded output.

    `options` are the message's reading choices, parsed into plain strings by the parent.

    The input array is a zero-copy view of the shared memory, so every reference to
    it (including those held by a traceback's frames) must be gone before the memory
    is closed: errors are therefore re-raised as fresh exceptions after the cleanup.
    """
    failure: BaseException | None = None
    with _mapped(shm_name, size) as buf:
        try:
            result = _compute(buf, input_format, output_format, options)
        except BaseException as exc:  # every failure is this task's
            failure = _handed_back(exc)
    if failure is not None:
        raise failure
    return result


@contextlib.contextmanager
def _mapped(shm_name: str, size: int) -> Iterator[memoryview]:
    """The first `size` bytes of a shared memory segment, unmapped on exit once nothing
    refers to them any more (a handler that kept a view keeps the mapping: it goes when
    the view does, and the parent unlinks the segment)."""
    shm = shared_memory.SharedMemory(name=shm_name)
    whole = shm.buf
    assert whole is not None
    buf = whole[:size]
    try:
        yield buf
    finally:
        try:
            buf.release()
            whole.release()
            shm.close()
        except BufferError:
            pass


# -- several small tasks in one call --------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One task's work for an inference process: where its input lies in shared memory
    and how to read it and write its output. Plain strings: it pickles small."""

    shm_name: str
    size: int
    input_format: str
    output_format: str
    options: formats.InputOptions = formats.NO_OPTIONS

    def args(self) -> tuple[str, int, str, str, formats.InputOptions]:
        """`run_task`'s arguments."""
        return (self.shm_name, self.size, self.input_format, self.output_format, self.options)


@dataclass
class Batch:
    """What `run_batch` hands back: each job's result or failure, in the jobs' order, and
    how many tasks each predict call it made scored (1: a task alone)."""

    outcomes: list[dict[str, Any] | BaseException]
    predict_calls: list[int] = field(default_factory=list)


@dataclass(eq=False)
class _Decoded:
    index: int
    array: np.ndarray
    decode_s: float


def run_batch(jobs: Sequence[Job], max_rows: int) -> Batch:
    """Several tasks in one call: each input decoded on its own, the rows of those of at
    most `max_rows` rows scored by one predict call (per dtype and column count: each
    task's rows reach the handler as they would alone), each output encoded on its own.

    A task's failure is its own, as in `run_task`: an input that cannot be decoded, or
    one the handler refuses alone. When the shared call fails or breaks the contract,
    each of its tasks is predicted again alone, so that whatever failed is told by its
    own task and the others are scored as they would have been. Only a handler that
    says its rows are independent (`rows_independent`) has rows of several tasks in one
    call; for another, every task is predicted alone (still one call to the process).

    A shared call's time is apportioned by rows: each task's `infer_s` is its share, so
    the tasks' times add up to what the process spent.
    """
    batch = Batch([RuntimeError("not scored")] * len(jobs))
    with contextlib.ExitStack() as stack:
        # The arrays, views of the segments, live in `_score_batch` alone: gone once it
        # returns, before the segments are unmapped.
        _score_batch(jobs, max_rows, stack, batch)
    return batch


def _score_batch(
    jobs: Sequence[Job], max_rows: int, stack: contextlib.ExitStack, batch: Batch
) -> None:
    state = _state()
    together = rows_independent(state.handler)
    groups: dict[tuple[str, int], list[_Decoded]] = {}
    for index, job in enumerate(jobs):
        try:
            buf = stack.enter_context(_mapped(job.shm_name, job.size))
            t0 = time.perf_counter()
            array = formats.decode(buf, job.input_format, state.max_decoded_bytes, job.options)
            decoded = _Decoded(index, array, time.perf_counter() - t0)
        except BaseException as exc:  # this task's failure alone
            batch.outcomes[index] = _handed_back(exc)
            continue
        if together and array.shape[0] <= max_rows:
            groups.setdefault((array.dtype.str, array.shape[1]), []).append(decoded)
        else:
            _score_alone(decoded, job, batch)
        del array, decoded
    for members in groups.values():
        _score_group(members, jobs, batch)


def _score_alone(decoded: _Decoded, job: Job, batch: Batch) -> None:
    try:
        t0 = time.perf_counter()
        predictions = _predicted(decoded.array)
        infer_s = time.perf_counter() - t0
        rows = int(decoded.array.shape[0])
        batch.outcomes[decoded.index] = _encoded(
            predictions, job.output_format, rows, decoded.decode_s, infer_s
        )
        batch.predict_calls.append(1)
    except BaseException as exc:  # this task's failure alone
        batch.outcomes[decoded.index] = _handed_back(exc)


def _score_group(members: list[_Decoded], jobs: Sequence[Job], batch: Batch) -> None:
    """The members' rows in one predict call, split back per task; alone, on a failure."""
    if len(members) == 1:
        _score_alone(members[0], jobs[members[0].index], batch)
        return
    t0 = time.perf_counter()
    predictions = _shared_call(members)
    if predictions is None:  # told apart task by task (outside the handler's exception)
        for member in members:
            _score_alone(member, jobs[member.index], batch)
        return
    infer_s = time.perf_counter() - t0
    total = sum(m.array.shape[0] for m in members)
    start = 0
    for member in members:
        rows = int(member.array.shape[0])
        share = infer_s * rows / total
        job = jobs[member.index]
        try:
            batch.outcomes[member.index] = _encoded(
                predictions[start : start + rows], job.output_format, rows, member.decode_s, share
            )
        except BaseException as exc:  # this task's failure alone
            batch.outcomes[member.index] = _handed_back(exc)
        start += rows
    batch.predict_calls.append(len(members))


def _shared_call(members: list[_Decoded]) -> np.ndarray | None:
    """The members' rows predicted together; None when that fails in any way."""
    try:
        rows = np.concatenate([m.array for m in members])
        return checked_predictions(_state().handler.predict(rows), rows.shape[0])
    except BaseException:  # each task is then predicted alone
        return None
