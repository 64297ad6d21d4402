"""Deterministic models and inputs, generated from a seed (demo, benchmarks, tests)."""

from __future__ import annotations

import io
import itertools
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

if TYPE_CHECKING:
    from sqsinfer.compute.handlers.xgboost_impl import XGBoostHandler


def train_model(
    path: str, n_features: int, *, trees: int = 20, depth: int = 4, rows: int = 2000, seed: int = 0
) -> str:
    """Train a small regression Booster on synthetic data and save it (.ubj or .json)."""
    import xgboost

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, n_features)).astype(np.float32)
    weights = rng.standard_normal(n_features)
    y = x @ weights + 0.1 * rng.standard_normal(rows)
    booster = xgboost.train(
        {"max_depth": depth, "eta": 0.3, "nthread": 1, "seed": seed},
        xgboost.DMatrix(x, label=y),
        num_boost_round=trees,
    )
    booster.save_model(path)
    return path


def make_rows(n_rows: int, n_features: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n_rows, n_features)).astype(np.float32)


def encode_input(array: np.ndarray, fmt: str) -> bytes:
    """The bytes of an input file in one of the accepted formats."""
    if fmt == "npy":
        out = io.BytesIO()
        np.save(out, array, allow_pickle=False)
        return out.getvalue()
    if fmt == "json":
        return orjson.dumps(array, option=orjson.OPT_SERIALIZE_NUMPY)
    if fmt == "jsonl":
        return b"".join(orjson.dumps(row.tolist()) + b"\n" for row in array)
    if fmt == "csv":
        header = ",".join(f"f{i}" for i in range(array.shape[1]))
        lines = [",".join(repr(float(v)) for v in row) for row in array]
        return ("\n".join([header, *lines]) + "\n").encode()
    if fmt == "parquet":
        return parquet_bytes({f"f{i}": array[:, i] for i in range(array.shape[1])})
    raise ValueError(f"unknown format {fmt}")


def parquet_bytes(columns: dict[str, Any], *, row_group_rows: int | None = None) -> bytes:
    """A Parquet file of these columns (arrays or lists; None in a list is a null), in
    row groups of `row_group_rows` rows (default: pyarrow's)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(columns), sink, row_group_size=row_group_rows)
    return bytes(sink.getvalue().to_pybytes())


def decode_output(data: bytes, fmt: str) -> np.ndarray:
    """An output as rows × outputs (a Parquet output's columns side by side)."""
    if fmt == "json":
        return np.asarray(orjson.loads(data), dtype=np.float32)
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pq.read_table(pa.BufferReader(data))
        return np.column_stack([column.to_numpy() for column in table.columns])
    array: np.ndarray = np.load(io.BytesIO(data), allow_pickle=False)
    return array


def predictor(model_path: str) -> XGBoostHandler:
    """The model as the worker's default handler loads it, for direct predictions to check
    outputs against."""
    from sqsinfer.compute.handlers.xgboost_impl import XGBoostHandler

    handler = XGBoostHandler()
    handler.load(model_path, 1)
    return handler


def onnx_linear_model(path: str, n_features: int, n_outputs: int = 1, *, seed: int = 0) -> str:
    """Save a small ONNX model, Y = X·W + b (float32), and return the path.

    Built with the `onnx` package's helper API, as an exporter would write it: a dynamic
    rows dimension and a fixed number of features. `onnx_linear_weights` gives W and b.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weights, bias = onnx_linear_weights(n_features, n_outputs, seed)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "W"], ["XW"]),
            helper.make_node("Add", ["XW", "B"], ["Y"]),
        ],
        "linear",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["rows", n_features])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["rows", n_outputs])],
        initializer=[numpy_helper.from_array(weights, "W"), numpy_helper.from_array(bias, "B")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8  # readable by every ONNX Runtime release the extra admits
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def onnx_mlp_model(
    path: str, n_features: int, hidden: tuple[int, ...], n_outputs: int = 1, *, seed: int = 0
) -> str:
    """Save a multi-layer perceptron as ONNX (float32, random weights) and return the path.

    Layers of MatMul, Add and Relu of the `hidden` widths, then a linear output: the
    shape of an exported PyTorch MLP. Its cost per row is about the sum of the products
    of neighbouring widths (multiply-adds), which is how the bench sizes one to a regime.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    widths = [n_features, *hidden, n_outputs]
    nodes, weights, last = [], [], "X"
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        scale = np.sqrt(2.0 / fan_in)  # He initialisation: activations keep their size
        w = (rng.standard_normal((fan_in, fan_out)) * scale).astype(np.float32)
        b = (0.01 * rng.standard_normal(fan_out)).astype(np.float32)
        weights += [numpy_helper.from_array(w, f"W{i}"), numpy_helper.from_array(b, f"B{i}")]
        nodes += [
            helper.make_node("MatMul", [last, f"W{i}"], [f"M{i}"]),
            helper.make_node("Add", [f"M{i}", f"B{i}"], [f"A{i}"]),
        ]
        last = f"A{i}"
        if i < len(hidden):
            nodes.append(helper.make_node("Relu", [last], [f"R{i}"]))
            last = f"R{i}"
    nodes.append(helper.make_node("Identity", [last], ["Y"]))
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["rows", n_features])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["rows", n_outputs])],
        initializer=weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def onnx_linear_weights(
    n_features: int, n_outputs: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((n_features, n_outputs)).astype(np.float32)
    bias = rng.standard_normal(n_outputs).astype(np.float32)
    return weights, bias
