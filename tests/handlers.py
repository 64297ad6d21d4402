"""Model handlers for tests, loaded by dotted path in spawned processes like any other.

`ScriptedHandler` lets a test script what the model does through its input: the first
cell of the first row is an instruction, the prediction is each row's sum.
  > 0   sleep that many seconds, then predict
  -1    the process kills itself (a segfault or an OOM kill, as the pool sees it)
  -2    raise `NativePanic`, a BaseException that is no Exception (as pyo3's
        PanicException is, when a Rust extension panics)
  -3    sys.exit(3), as a handler that gives up might
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

from sqsinfer.compute import formats, inference

KILL = -1.0
PANIC = -2.0
EXIT = -3.0


class NativePanic(BaseException):
    """What a Rust extension's panic raises through pyo3: not an Exception."""


class ScriptedHandler:
    def load(self, model_path: str, threads: int) -> None:
        self.model_path = model_path

    def sample_input(self) -> np.ndarray:
        return np.zeros((2, 1), dtype=np.float32)  # 0 in the first cell: just predict

    def predict(self, array: np.ndarray) -> np.ndarray:
        first = float(array[0, 0])
        if first == KILL:
            os.kill(os.getpid(), signal.SIGKILL)
        elif first == PANIC:
            raise NativePanic("called `Option::unwrap()` on a `None` value")
        elif first == EXIT:
            sys.exit(3)
        elif first > 0:
            time.sleep(first)
        return array.sum(axis=1)


class FailingLoadHandler:
    def load(self, model_path: str, threads: int) -> None:
        raise RuntimeError("this model refuses to load")

    def predict(self, array: np.ndarray) -> np.ndarray:  # pragma: no cover
        return array


def predict_bytes(data: bytes, input_format: str, output_format: str) -> bytes:
    """Run in a pool process: decode, predict and encode with the model it loaded."""
    array = formats.decode(memoryview(data), input_format, 1 << 30)
    return formats.encode(inference.loaded_handler().predict(array), output_format)


def loaded_modules() -> list[str]:
    """Run in a pool process: which modules it has imported (fork would inherit the parent's)."""
    return sorted(sys.modules)


def start_method_marker() -> bool:
    """Run in a pool process: is the parent's test-only marker module present?"""
    return "tests.parent_only_marker" in sys.modules


class LoadsOnceHandler(ScriptedHandler):
    """Loads until a file named like the model plus `.broken` appears (a model pulled away)."""

    def load(self, model_path: str, threads: int) -> None:
        if os.path.exists(model_path + ".broken"):
            raise RuntimeError("the model store is gone")
        super().load(model_path, threads)


class ListHandler(ScriptedHandler):
    """Breaks the contract: returns a list, as a framework's tensor type would."""

    def predict(self, array: np.ndarray) -> np.ndarray:
        return array.sum(axis=1).tolist()  # type: ignore[return-value]


class RowDroppingHandler(ScriptedHandler):
    """Keeps the contract at warm-up, then returns one row too few for larger inputs."""

    def predict(self, array: np.ndarray) -> np.ndarray:
        sums = array.sum(axis=1)
        return sums[:-1] if len(sums) > 2 else sums


class NoSampleHandler:
    """Neither sample_input() nor n_features: warm-up cannot make an input."""

    def load(self, model_path: str, threads: int) -> None:
        pass

    def predict(self, array: np.ndarray) -> np.ndarray:
        return array.sum(axis=1)


PREDICTIONS_FILE_ENV = "TEST_PREDICTIONS_FILE"


class RecordingHandler(ScriptedHandler):
    """A ScriptedHandler that appends a line per task's prediction to $TEST_PREDICTIONS_FILE.

    The start-up warm-up predicts zeros; it is not recorded.
    """

    def predict(self, array: np.ndarray) -> np.ndarray:
        if array.any():
            with open(os.environ[PREDICTIONS_FILE_ENV], "a") as fh:
                fh.write(f"{os.getpid()}\n")
        return super().predict(array)


class VersionedHandler(ScriptedHandler):
    version = "2.1.0-ours"


class OverlongVersionHandler(ScriptedHandler):
    version = "v" * 65  # more than output metadata takes


class RowScriptedHandler:
    """Scripted per row, and willing to be coalesced (`rows_independent`): a row whose
    first cell is `KILL` kills the process, `FAIL` raises (a handler bug on that input),
    above 0 sleeps that many seconds (the longest of them); each row predicts its sum.
    Several tasks' rows in one call: any of them acts."""

    rows_independent = True

    def load(self, model_path: str, threads: int) -> None:
        self.model_path = model_path

    def sample_input(self) -> np.ndarray:
        return np.zeros((2, 2), dtype=np.float32)

    def predict(self, array: np.ndarray) -> np.ndarray:
        first = array[:, 0]
        if (first == KILL).any():
            os.kill(os.getpid(), signal.SIGKILL)
        if (first == FAIL).any():
            raise RuntimeError("told to fail by a row")
        if first.max() > 0:
            time.sleep(float(first.max()))
        return array.sum(axis=1)


FAIL = -4.0
