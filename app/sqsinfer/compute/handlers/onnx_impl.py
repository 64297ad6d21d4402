"""An ONNX model through ONNX Runtime's CPU provider (`pip install 'sqsinfer[onnx]'`).

Teams export PyTorch, scikit-learn and TensorFlow models to ONNX; one handler serves
them all. The model's first input must take a float32 matrix (rows × features, the
rows dimension dynamic). The output served (rows, or rows × outputs) is the one the model
output setting names; by default the model's only output, or, of several, its only
floating-point tensor: a converted classifier's probabilities beside its integer label
(onnxmltools' `convert_xgboost` puts `label` first and `probabilities` second, and the
label is not what a score is). Anything else is ambiguous, and the model is refused at
start-up with its outputs named, never served by position.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sqsinfer.compute.errors import InputError, ModelLoadError
from sqsinfer.compute.handlers import MODEL_OUTPUT_SETTING

# Numeric tensors a prediction may be; the floating-point ones are a model's scores.
_FLOATS = frozenset({"tensor(float)", "tensor(double)", "tensor(float16)"})
_NUMERIC = _FLOATS | {f"tensor({t})" for t in ("int8", "int16", "int32", "int64", "uint8", "bool")}


class OnnxHandler:
    def __init__(self) -> None:
        self.session: Any = None
        self.input_name = ""
        self.output_name = ""
        self.chosen = ""  # the model output setting's name ("": the default rule)
        self.n_features = 0

    def choose_output(self, name: str) -> None:
        """Serve the output of this name (checked against the model when it loads)."""
        self.chosen = name

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
        self.output_name = served_output(session.get_outputs(), self.chosen)
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


def served_output(outputs: list[Any], chosen: str) -> str:
    """The name of the output to serve: `chosen`, the only one, or the only float tensor."""
    listed = ", ".join(f"{o.name} ({o.type})" for o in outputs)
    if chosen:
        found = [o for o in outputs if o.name == chosen]
        if not found:
            raise ModelLoadError(
                f"{MODEL_OUTPUT_SETTING}={chosen!r}, but the model's outputs are: {listed}"
            )
        if found[0].type not in _NUMERIC:
            raise ModelLoadError(
                f"ONNX output {chosen!r} is {found[0].type}, not a numeric tensor (a "
                "classifier's ZipMap output: convert it with zipmap=False)"
            )
        return chosen
    if len(outputs) == 1:
        return str(outputs[0].name)
    floats = [o for o in outputs if o.type in _FLOATS]
    if len(floats) == 1:
        return str(floats[0].name)
    raise ModelLoadError(
        f"the model has several outputs ({listed}) and no one float tensor among them to "
        f"serve by default: name the one to serve with {MODEL_OUTPUT_SETTING}"
    )
