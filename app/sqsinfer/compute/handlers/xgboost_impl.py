"""The default handler: an XGBoost Booster from `.ubj` or `.json`, `inplace_predict`."""

from __future__ import annotations

from typing import Any

import numpy as np

from sqsinfer.compute.errors import InputError, ModelLoadError


class XGBoostHandler:
    # Each row's prediction is the sum over the trees of the leaf its own features reach:
    # the same bits whatever other rows share the call (checked by the tests, in one
    # thread and in several), so small tasks may be scored together.
    rows_independent = True

    def __init__(self) -> None:
        self.booster: Any = None
        self.n_features = 0

    @property
    def version(self) -> str:
        """XGBoost's own version: what decides the predictions, for output metadata."""
        import xgboost

        return str(xgboost.__version__)

    def load(self, model_path: str, threads: int) -> None:
        import xgboost

        if not model_path.endswith((".ubj", ".json")):
            raise ModelLoadError(f"XGBoost model must be .ubj or .json, got {model_path}")
        self._use(xgboost.Booster(), model_path, threads)

    def load_bytes(self, data: bytes | bytearray, threads: int) -> None:
        """The model from the pinned file's bytes (their sha256 was checked). XGBoost
        tells UBJSON from JSON by itself and refuses anything else. It reads a bytearray
        in place; other bytes are copied into one first."""
        import xgboost

        buffer = data if isinstance(data, bytearray) else bytearray(data)
        self._use(xgboost.Booster(), buffer, threads)

    def _use(self, booster: Any, model: str | bytearray, threads: int) -> None:
        booster.load_model(model)  # UBJSON/JSON parser only: never pickle
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
