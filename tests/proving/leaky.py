"""A handler that leaks, for proving that the soak's bounds catch a leak: every
prediction keeps 4 MiB of memory and one open file in the inference process."""

from __future__ import annotations

import os
from typing import IO, Any

import numpy as np

KEPT: list[Any] = []
LEAK_BYTES = 4 * 2**20


class LeakingHandler:
    def load(self, model_path: str, threads: int) -> None:
        self.model_path = model_path

    def sample_input(self) -> np.ndarray:
        return np.zeros((2, 1), dtype=np.float32)

    def predict(self, array: np.ndarray) -> np.ndarray:
        handle: IO[bytes] = open(os.devnull, "rb")  # noqa: SIM115 - kept open on purpose
        KEPT.append((os.urandom(LEAK_BYTES), handle))  # random: every page is touched
        return array.sum(axis=1)
