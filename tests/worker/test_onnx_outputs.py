"""Which output of an ONNX model the worker serves: models converted the standard way.

onnxmltools' `convert_xgboost` gives a classifier two outputs, the int64 `label` first and
the float `probabilities` second; a regressor one, `variable`. The worker serves the
probabilities of a classifier (its one float output), a named output when the model
output setting names one, and refuses at start-up what it cannot choose by itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sqsinfer import config, lineage
from sqsinfer.compute.errors import ModelLoadError
from sqsinfer.compute.handlers import MODEL_OUTPUT_SETTING
from sqsinfer.lab import synthetic
from sqsinfer.worker.lifecycle import Worker
from tests.conftest import Stage, eventually, outcome_count, running

N_FEATURES = 4


def _booster(objective: str, seed: int) -> Any:
    import xgboost

    rows = synthetic.make_rows(400, N_FEATURES, seed=seed)
    labels = (rows[:, 0] + rows[:, 1] > 0).astype(np.float32)
    target = labels if objective == "binary:logistic" else rows @ np.arange(1.0, 5.0)
    data = xgboost.DMatrix(rows, label=target)
    params = {"objective": objective, "max_depth": 3, "nthread": 1, "seed": seed}
    return xgboost.train(params, data, num_boost_round=20)


def _converted(booster: Any, path: Path) -> str:
    from onnxmltools import convert_xgboost
    from onnxmltools.convert.common.data_types import FloatTensorType

    model = convert_xgboost(booster, initial_types=[("input", FloatTensorType([None, N_FEATURES]))])
    path.write_bytes(model.SerializeToString())
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, str]]:
    """A classifier and a regressor, each as XGBoost's booster and converted to ONNX."""
    folder = tmp_path_factory.mktemp("converted")
    found = {}
    for name, objective in (("classifier", "binary:logistic"), ("regressor", "reg:squarederror")):
        booster = _booster(objective, seed=len(name))
        found[name] = (booster, _converted(booster, folder / f"{name}.onnx"))
    return found


async def _scored(stage: Stage, settings: config.Settings, rows: np.ndarray) -> tuple[Any, dict]:
    """One task of `rows` through a worker: its output and the output's metadata."""
    uri = stage.put_input("t.npy", synthetic.encode_input(rows, "npy"))
    stage.send({"task_id": "t", "input": uri})
    async with running(settings) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == 1)
    got = synthetic.decode_output(stage.outputs()["out/t.npy"], "npy")
    meta = stage.s3.head_object(Bucket=stage.bucket, Key="out/t.npy")["Metadata"]
    return got, meta


async def test_a_converted_classifier_serves_its_probabilities_not_its_labels(
    stage: Stage, make_settings, models
) -> None:
    booster, path = models["classifier"]
    rows = synthetic.make_rows(50, N_FEATURES, seed=3)
    got, meta = await _scored(stage, make_settings(handler="onnx", model_path=path), rows)
    expected = booster.inplace_predict(rows)  # P(class 1), XGBoost's own
    assert got.shape == (50, 2) and got.dtype == np.float32
    np.testing.assert_allclose(got[:, 1], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, rtol=1e-5)
    assert meta[lineage.MODEL_OUTPUT] == "probabilities"


async def test_a_converted_regressor_serves_its_one_output(
    stage: Stage, make_settings, models
) -> None:
    booster, path = models["regressor"]
    rows = synthetic.make_rows(50, N_FEATURES, seed=4)
    got, meta = await _scored(stage, make_settings(handler="onnx", model_path=path), rows)
    np.testing.assert_allclose(got.ravel(), booster.inplace_predict(rows), rtol=1e-5, atol=1e-4)
    assert meta[lineage.MODEL_OUTPUT] == "variable"


async def test_the_setting_serves_the_output_it_names(stage: Stage, make_settings, models) -> None:
    booster, path = models["classifier"]
    rows = synthetic.make_rows(50, N_FEATURES, seed=5)
    settings = make_settings(handler="onnx", model_path=path, model_output="label")
    got, meta = await _scored(stage, settings, rows)
    labels = (booster.inplace_predict(rows) > 0.5).astype(np.int64)
    np.testing.assert_array_equal(got.ravel(), labels)
    assert meta[lineage.MODEL_OUTPUT] == "label"


def _two_float_outputs(path: Path) -> str:
    """A model whose two outputs are both float tensors: no default can choose."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["X"], ["a"]), helper.make_node("Neg", ["X"], ["b"])],
        "two",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["rows", N_FEATURES])],
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["rows", N_FEATURES]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, ["rows", N_FEATURES]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return str(path)


async def _start_error(settings: config.Settings) -> str:
    with pytest.raises(ModelLoadError) as caught:
        await Worker(settings).serve()
    return str(caught.value)


async def test_what_cannot_be_chosen_stops_start_up_naming_the_outputs(
    make_settings, models, tmp_path: Path
) -> None:
    ambiguous = _two_float_outputs(tmp_path / "two.onnx")
    error = await _start_error(make_settings(handler="onnx", model_path=ambiguous))
    assert "a (tensor(float)), b (tensor(float))" in error and MODEL_OUTPUT_SETTING in error
    _, classifier = models["classifier"]
    settings = make_settings(handler="onnx", model_path=classifier, model_output="scores")
    error = await _start_error(settings)
    assert "'scores'" in error and "label (tensor(int64)), probabilities (tensor(float))" in error
    # XGBoost's handler serves the booster's one prediction: the setting has no meaning there.
    error = await _start_error(make_settings(model_output="probabilities"))
    assert f"{MODEL_OUTPUT_SETTING}='probabilities'" in error and "cannot choose" in error


def test_the_compute_side_names_the_setting_as_the_settings_do() -> None:
    assert config.env_name("model_output") == MODEL_OUTPUT_SETTING
