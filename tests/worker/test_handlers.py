"""The handler contract checked before ready, and a second model kind (ONNX) end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sqsinfer.aws.sqs import DETAIL_ATTR, REASON_ATTR
from sqsinfer.compute.errors import ModelLoadError
from sqsinfer.compute.inference import file_sha256
from sqsinfer.lab import synthetic
from sqsinfer.worker.lifecycle import Worker
from tests.conftest import Stage, eventually, outcome_count, running


async def _start_error(settings) -> str:
    with pytest.raises(ModelLoadError) as caught:
        await Worker(settings).serve()
    return str(caught.value)


async def test_a_handler_returning_no_ndarray_stops_start_up(make_settings) -> None:
    error = await _start_error(make_settings(handler="tests.handlers:ListHandler"))
    assert error == (
        "handler 'tests.handlers:ListHandler' fails its warm-up: predict() returned a "
        "builtins.list, not a numpy.ndarray (convert it, e.g. with .numpy() or numpy.asarray)"
    )


async def test_a_handler_without_a_warm_up_input_stops_start_up(make_settings) -> None:
    error = await _start_error(make_settings(handler="tests.handlers:NoSampleHandler"))
    assert "NoSampleHandler gives no warm-up input: define sample_input()" in error


async def test_a_prediction_breaking_the_contract_rejects_its_task(
    stage: Stage, make_settings
) -> None:
    rows = np.ones((3, 2), dtype=np.float32) * 0  # 0 in the first cell: just predict
    uri = stage.put_input("three.npy", synthetic.encode_input(rows, "npy"))
    stage.send({"task_id": "short", "input": uri})
    async with running(make_settings(handler="tests.handlers:RowDroppingHandler")) as worker:
        await eventually(lambda: outcome_count(worker, "rejected") == 1)
    (dead,) = stage.drain_queue(stage.dlq_url)
    attrs = dead["MessageAttributes"]
    assert attrs[REASON_ATTR]["StringValue"] == "invalid_prediction"
    assert attrs[DETAIL_ATTR]["StringValue"] == "predict() returned 2 rows for 3"
    assert stage.outputs() == {}


@pytest.fixture(scope="module")
def onnx_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("onnx") / "linear.onnx"
    return synthetic.onnx_linear_model(str(path), n_features=4, n_outputs=2, seed=7)


@pytest.mark.parametrize(("fmt", "pinned"), [("npy", False), ("csv", True)])
async def test_an_onnx_model_serves_tasks_through_the_worker(
    stage: Stage, make_settings, onnx_model: str, fmt: str, pinned: bool
) -> None:
    rows = synthetic.make_rows(6, 4, seed=11)
    stage.send(
        {"task_id": "lin", "input": stage.put_input(f"x.{fmt}", synthetic.encode_input(rows, fmt))}
    )
    # Pinned, the model is loaded from the bytes whose hash was checked (`load_bytes`).
    sha = file_sha256(onnx_model) if pinned else ""
    settings = make_settings(handler="onnx", model_path=onnx_model, model_sha256=sha)
    async with running(settings) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == 1)
    got = synthetic.decode_output(stage.outputs()["out/lin.npy"], "npy")
    weights, bias = synthetic.onnx_linear_weights(4, 2, seed=7)
    assert got.shape == (6, 2)
    np.testing.assert_allclose(got, rows @ weights + bias, rtol=1e-5, atol=1e-5)


async def test_an_onnx_model_rejects_the_wrong_width(
    stage: Stage, make_settings, onnx_model: str
) -> None:
    rows = synthetic.make_rows(2, 5, seed=1)
    stage.send(
        {"task_id": "wide", "input": stage.put_input("w.npy", synthetic.encode_input(rows, "npy"))}
    )
    async with running(make_settings(handler="onnx", model_path=onnx_model)) as worker:
        await eventually(lambda: outcome_count(worker, "rejected") == 1)
    (dead,) = stage.drain_queue(stage.dlq_url)
    assert dead["MessageAttributes"][REASON_ATTR]["StringValue"] == "wrong_feature_count"


async def test_a_file_that_is_no_onnx_model_stops_start_up(make_settings, tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.onnx"
    bogus.write_bytes(b"not a protobuf")
    error = await _start_error(make_settings(handler="onnx", model_path=str(bogus)))
    assert "ONNX Runtime cannot load the model" in error


def test_a_handler_without_a_version_gives_its_distributions():
    """A handler from an installed distribution, without `version` of its own: that
    distribution's version (here a class made to come from xgboost's package)."""
    import importlib.metadata

    from sqsinfer.compute.handlers import handler_version

    made = type("Borrowed", (), {"__module__": "xgboost.borrowed"})()
    dist = importlib.metadata.packages_distributions()["xgboost"][0]
    assert handler_version(made) == importlib.metadata.version(dist)
