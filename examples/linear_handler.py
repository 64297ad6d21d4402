"""A complete model handler: a linear model whose weights live in an `.npz` file.

Run it with:

    SQSINFER_HANDLER=examples.linear_handler:LinearHandler \
    SQSINFER_MODEL_PATH=/models/linear.npz sqsinfer worker ...

The worker imports this module in each spawned inference process, never in its own
process, and calls `load` once per process: so the module imports only what it needs
at the top, and the model (here, two arrays) is read in `load`, not at import time.
"""

from __future__ import annotations

import numpy as np

from sqsinfer import InputError, ModelLoadError


class LinearHandler:
    """predictions = features · weights + bias, one row out per row in."""

    def __init__(self) -> None:
        self.weights = np.zeros((0, 0), dtype=np.float32)
        self.bias = np.zeros(0, dtype=np.float32)

    def load(self, model_path: str, threads: int) -> None:
        # `threads` is what this process may use (SQSINFER_THREADS_PER_PROCESS): pass it
        # to your library's own setting; numpy's BLAS is already pinned to it.
        try:
            with np.load(model_path, allow_pickle=False) as arrays:  # never unpickle
                self.weights = np.asarray(arrays["weights"], dtype=np.float32)
                self.bias = np.asarray(arrays["bias"], dtype=np.float32)
        except (OSError, KeyError, ValueError) as exc:
            raise ModelLoadError(f"{model_path} is no linear model: {exc}") from None

    @property
    def n_features(self) -> int:
        return int(self.weights.shape[0])

    def sample_input(self) -> np.ndarray:
        """What the warm-up predicts on before the worker reports ready."""
        return np.zeros((2, self.n_features), dtype=np.float32)

    def predict(self, array: np.ndarray) -> np.ndarray:
        if array.shape[1] != self.n_features:
            # A permanent problem with this input: the message goes to the DLQ with it.
            raise InputError(
                "wrong_feature_count",
                f"input has {array.shape[1]} columns, model takes {self.n_features}",
            )
        return array.astype(np.float32, copy=False) @ self.weights + self.bias


def save_linear_model(path: str, weights: np.ndarray, bias: np.ndarray) -> str:
    """Write a model this handler loads (used by the tests and to try it out)."""
    np.savez(path, weights=weights.astype(np.float32), bias=bias.astype(np.float32))
    return path
