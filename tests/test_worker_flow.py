"""End to end against the moto server: each outcome, formats, metadata, chaining."""

from __future__ import annotations

import numpy as np
import pytest

from app import synthetic
from app.inference import XGBoostHandler
from tests.conftest import N_FEATURES, Stage, eventually, outcome_count, running


def direct_prediction(model_path: str, array: np.ndarray) -> np.ndarray:
    handler = XGBoostHandler()
    handler.load(model_path, 1)
    return handler.predict(array)


@pytest.mark.parametrize("fmt", ["npy", "json", "jsonl", "csv"])
async def test_commits_prediction_for_each_input_format(
    stage: Stage, make_settings, model_path, fmt
):
    rows = synthetic.make_rows(5, N_FEATURES, seed=3)
    uri = stage.put_input(f"a.{fmt}", synthetic.encode_input(rows, fmt))
    stage.send({"task_id": f"task-{fmt}", "input": uri})
    async with running(make_settings()) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == 1)
    outputs = stage.outputs()
    assert list(outputs) == [f"out/task-{fmt}.npy"]
    got = synthetic.decode_output(outputs[f"out/task-{fmt}.npy"], "npy")
    np.testing.assert_allclose(got, direct_prediction(model_path, rows).reshape(-1, 1), rtol=1e-6)
    head = stage.s3.head_object(Bucket=stage.bucket, Key=f"out/task-{fmt}.npy")
    assert head["Metadata"]["task-id"] == f"task-{fmt}"
    assert len(head["Metadata"]["model-sha256"]) == 64
    assert stage.counts(stage.queue_url) == (0, 0)
