"""An ONNX model through ONNX Runtime's CPU provider (`pip install 'sqsinfer[onnx]'`).

Teams export PyTorch, scikit-learn and TensorFlow models to ONNX; one handler serves
them all. The model's first input must take a float32 matrix (rows × features, the
rows dimension dynamic); its first output is the prediction, rows or rows × outputs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sqsinfer.compute.errors import InputError, ModelLoadError


class OnnxHandler:
    def __init__(self) -> None:
        self.session: Any = None
        self.input_name = ""
        self.output_name = ""
        self.n_features = 0

    @property
    def version(self) -> str:
        """ONNX Runtime's version: what decides the predictions, for output metadata."""
        import onnxruntime

        return str(onnxruntime.__version__)

    def load(self, model_path: str, threads: int) -> None:
        self._open(model_path, threads)

    def load_bytes(self, data: bytes | bytearray, threads: int) -> None:
        # ONNX Runtime takes bytes only. The buffer is the handler's: emptied once
        # copied, it does not sit beside the copy while the session is built.
        model = bytes(data)
        if isinstance(data, bytearray):
            data.clear()
        self._open(model, threads)

    def _open(self, model: str | bytes, threads: int) -> None:
        try:
            import onnxruntime
        except ImportError:
            raise ModelLoadError(
                "the onnx handler needs ONNX Runtime: pip install 'sqsinfer[onnx]'"
            ) from None
        options = onnxruntime.SessionOptions()
        # One process per core is the worker's parallelism: threads within a process are
        # the operator's choice (threads_per_process), and never a pool per operator.
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
        try:
            session = onnxruntime.InferenceSession(
                model, sess_options=options, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # ONNX Runtime raises its own exception types
            raise ModelLoadError(f"ONNX Runtime cannot load the model: {exc}") from None
        first = session.get_inputs()[0]
        if len(first.shape) != 2 or not isinstance(first.shape[1], int):
            raise ModelLoadError(
                f"ONNX input {first.name!r} has shape {first.shape}: expected "
                "(rows, features) with a fixed number of features"
            )
        if first.type != "tensor(float)":
            raise ModelLoadError(f"ONNX input {first.name!r} is {first.type}, not tensor(float)")
        self.session = session
        self.input_name = first.name
        self.output_name = session.get_outputs()[0].name
        self.n_features = int(first.shape[1])

    def predict(self, array: np.ndarray) -> np.ndarray:
        if array.shape[1] != self.n_features:
            raise InputError(
                "wrong_feature_count",
                f"input has {array.shape[1]} columns, model takes {self.n_features}",
            )
        feed = {self.input_name: np.ascontiguousarray(array, dtype=np.float32)}
        (out,) = self.session.run([self.output_name], feed)
        return np.asarray(out)
