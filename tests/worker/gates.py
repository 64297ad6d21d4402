"""Test handlers steered through files next to the model: a spawned process shares
nothing else with the test that runs it.

`GatedHandler.predict` waits until `<model>.go` exists, then fails when the file says
"fail" (a transient error: the message is retried) and otherwise predicts each row's sum.
An all-zero input (the pool's warm-up) passes at once.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import time

import numpy as np

_POLL_S = 0.02


class GatedHandler:
    def load(self, model_path: str, threads: int) -> None:
        self.gate = pathlib.Path(model_path + ".go")

    def sample_input(self) -> np.ndarray:
        return np.zeros((2, 1), dtype=np.float32)  # all zeros: passes at once

    def predict(self, array: np.ndarray) -> np.ndarray:
        if not array.any():
            return array.sum(axis=1)
        while not self.gate.exists():
            time.sleep(_POLL_S)
        if self.gate.read_text().strip() == "fail":
            raise RuntimeError(f"told to fail by {os.fspath(self.gate)}")
        return array.sum(axis=1)


SWAP_PATH_VAR = "SQSINFER_TEST_SWAP_PATH"


class SwappingHandler:
    """A model file swapped right after any check of it: each load first replaces the
    file named by `$SQSINFER_TEST_SWAP_PATH` with other bytes, then records the sha256
    of what it was given to load."""

    loaded_sha256 = ""

    def load(self, model_path: str, threads: int) -> None:
        _swap()
        self._record(pathlib.Path(model_path).read_bytes())

    def load_bytes(self, data: bytearray, threads: int) -> None:
        _swap()
        self._record(data)

    def _record(self, data: bytes | bytearray) -> None:
        SwappingHandler.loaded_sha256 = hashlib.sha256(data).hexdigest()

    def sample_input(self) -> np.ndarray:
        return np.zeros((2, 1), dtype=np.float32)

    def predict(self, array: np.ndarray) -> np.ndarray:
        return array.sum(axis=1)


def _swap() -> None:
    pathlib.Path(os.environ[SWAP_PATH_VAR]).write_bytes(b"bytes nobody pinned")


def loaded_sha256() -> str:
    """Run in a pool process: the sha256 of the model bytes its handler loaded."""
    return SwappingHandler.loaded_sha256
