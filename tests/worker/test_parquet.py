"""Parquet inputs and outputs through the real worker, against the moto server."""

from __future__ import annotations

import json
import sys

import numpy as np
import pyarrow as pa

from sqsinfer.aws.sqs import DETAIL_ATTR, REASON_ATTR
from sqsinfer.lab import synthetic
from tests.conftest import N_FEATURES, Stage, eventually, outcome_count, running


def _columns(matrix: np.ndarray, prefix: str = "f") -> dict[str, np.ndarray]:
    return {f"{prefix}{i}": matrix[:, i] for i in range(matrix.shape[1])}


def _dead_letters(stage: Stage) -> dict[str, tuple[str, str]]:
    """Each rejected task id with its reason and detail."""
    found = {}
    for message in stage.drain_queue(stage.dlq_url):
        attrs = message["MessageAttributes"]
        found[json.loads(message["Body"])["task_id"]] = (
            attrs[REASON_ATTR]["StringValue"],
            attrs[DETAIL_ATTR]["StringValue"],
        )
    return found


async def test_parquet_inputs_with_skipped_columns_nulls_row_groups_and_a_column_choice(
    stage: Stage, make_settings, model_path: str
) -> None:
    features = synthetic.make_rows(23, N_FEATURES, seed=4)
    features[[1, 7, 20], 2] = np.nan  # nulls in the file
    columns: dict[str, object] = _columns(features)
    columns["f2"] = [None if np.isnan(v) else float(v) for v in features[:, 2]]
    columns = {"id": [f"row-{i}" for i in range(23)], **columns}  # text: skipped
    mixed = synthetic.parquet_bytes(columns, row_group_rows=5)
    wide = synthetic.make_rows(9, N_FEATURES + 2, seed=5)
    order = ["g9", "g0", "g5", "g1", "g2", "g3", "g4", "g6"]  # 8 of 10, in the model's order
    b = stage.bucket
    stage.send(
        {
            "task_id": "mixed",
            "input": stage.put_input("mixed.parquet", mixed),
            "output": f"s3://{b}/out/mixed.parquet",
        }
    )
    chosen = synthetic.parquet_bytes(_columns(wide, "g"))
    stage.send(
        {
            "task_id": "chosen",
            "input": stage.put_input("chosen.parquet", chosen),
            "params": {"columns": order},
        }
    )
    async with running(make_settings()) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == 2)
    outputs = stage.outputs()
    model = synthetic.predictor(model_path)
    got = synthetic.decode_output(outputs["out/mixed.parquet"], "parquet")
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, model.predict(features).reshape(-1, 1), rtol=1e-6)
    head = stage.s3.head_object(Bucket=b, Key="out/mixed.parquet")
    assert head["ContentType"] == "application/vnd.apache.parquet"
    picked = wide[:, [int(name[1:]) for name in order]]
    np.testing.assert_allclose(
        synthetic.decode_output(outputs["out/chosen.npy"], "npy"),
        model.predict(picked).reshape(-1, 1),
        rtol=1e-6,
    )


async def test_parquet_inputs_refused_each_with_its_reason(stage: Stage, make_settings) -> None:
    features = synthetic.make_rows(4, N_FEATURES, seed=6)
    with_text = synthetic.parquet_bytes({"name": ["a", "b", "c", "d"], **_columns(features)})
    too_wide = synthetic.parquet_bytes(_columns(synthetic.make_rows(4, N_FEATURES + 1, seed=6)))
    names = [f"f{i}" for i in range(N_FEATURES)]
    cases = {
        "text-named": (with_text, {"columns": [*names[:-1], "name"]}),
        "missing-named": (with_text, {"columns": [*names[:-1], "nope"]}),
        "corrupt": (with_text[: len(with_text) // 2] + with_text[-8:], {}),  # half gone
        "too-wide": (too_wide, {}),
    }
    for task_id, (data, params) in cases.items():
        uri = stage.put_input(f"{task_id}.parquet", data)
        stage.send({"task_id": task_id, "input": uri, "params": params})
    csv = stage.put_input("x.csv", synthetic.encode_input(features, "csv"))
    stage.send({"task_id": "csv-named", "input": csv, "params": {"columns": names}})
    async with running(make_settings()) as worker:
        await eventually(lambda: outcome_count(worker, "rejected") == 5)
        # The same file, unnamed, is fine: the text column is skipped.
        uri = stage.put_input("text.parquet", with_text)
        stage.send({"task_id": "text-skipped", "input": uri})
        await eventually(lambda: outcome_count(worker, "committed") == 1)
    dead = _dead_letters(stage)
    assert dead["text-named"] == ("undecodable_input", "column 'name' is string, not numeric")
    assert dead["missing-named"] == ("undecodable_input", "Parquet file has no column 'nope'")
    assert dead["corrupt"][0] == "undecodable_input"
    assert dead["corrupt"][1].startswith("not a valid Parquet file: ")
    assert dead["too-wide"][0] == "wrong_feature_count"
    assert dead["csv-named"] == (
        "invalid_field",
        "params.columns selects columns of .parquet inputs, not .csv",
    )
    assert list(stage.outputs()) == ["out/text-skipped.npy"]


async def test_derived_parquet_outputs_hold_a_column_per_output(
    stage: Stage, make_settings, tmp_path
) -> None:
    model = synthetic.onnx_linear_model(str(tmp_path / "lin.onnx"), 3, n_outputs=2, seed=2)
    rows = synthetic.make_rows(5, 3, seed=8)
    stage.send(
        {"task_id": "two", "input": stage.put_input("two.npy", synthetic.encode_input(rows, "npy"))}
    )
    settings = make_settings(handler="onnx", model_path=model, output_format="parquet")
    async with running(settings) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == 1)
    import pyarrow.parquet as pq

    table = pq.read_table(pa.BufferReader(stage.outputs()["out/two.parquet"]))
    assert table.column_names == ["prediction_0", "prediction_1"]
    assert set(table.schema.types) == {pa.float32()}
    weights, bias = synthetic.onnx_linear_weights(3, 2, seed=2)
    np.testing.assert_allclose(
        synthetic.decode_output(stage.outputs()["out/two.parquet"], "parquet"),
        rows @ weights + bias,
        rtol=1e-5,
        atol=1e-5,
    )


async def test_a_parquet_output_is_the_next_stages_parquet_input(
    stage: Stage, make_settings, model_path: str, tmp_path
) -> None:
    """Stage 1 (XGBoost) reads chosen columns and writes Parquet; stage 2 (an ONNX model of
    one feature) reads it. The column choice stays with stage 1, or stage 2 would refuse."""
    features = synthetic.make_rows(11, N_FEATURES + 1, seed=9)
    names = [f"f{i}" for i in range(1, N_FEATURES + 1)]  # all but f0
    uri = stage.put_input("job.parquet", synthetic.parquet_bytes(_columns(features)))
    stage.send({"task_id": "job", "input": uri, "params": {"columns": names, "run": 3}})
    first = make_settings(output_format="parquet", next_queue_url=stage.next_url)
    second_model = synthetic.onnx_linear_model(str(tmp_path / "one.onnx"), 1, seed=4)
    second = make_settings(
        queue_url=stage.next_url,
        handler="onnx",
        model_path=second_model,
        allowed_input_prefixes=f"s3://{stage.bucket}/out/",
        output_prefix=f"s3://{stage.bucket}/final/",
    )
    async with running(first) as one, running(second) as two:
        await eventually(lambda: outcome_count(two, "committed") == 1)
    assert outcome_count(one, "committed") == 1
    scores = synthetic.predictor(model_path).predict(features[:, 1:]).reshape(-1, 1)
    np.testing.assert_allclose(
        synthetic.decode_output(stage.outputs()["out/job.parquet"], "parquet"), scores, rtol=1e-6
    )
    weights, bias = synthetic.onnx_linear_weights(1, 1, seed=4)
    np.testing.assert_allclose(
        synthetic.decode_output(stage.outputs("final/")["final/job.npy"], "npy"),
        scores @ weights + bias,
        rtol=1e-5,
        atol=1e-5,
    )
    assert stage.drain_queue(stage.dlq_url) == []
    assert stage.drain_queue(stage.next_dlq_url) == []


async def test_without_pyarrow_parquet_messages_go_to_the_dlq_naming_the_extra(
    stage: Stage, make_settings, monkeypatch
) -> None:
    features = synthetic.make_rows(3, N_FEATURES, seed=1)
    parquet_input = stage.put_input("a.parquet", synthetic.encode_input(features, "parquet"))
    npy_input = stage.put_input("a.npy", synthetic.encode_input(features, "npy"))
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as without the extra
    stage.send({"task_id": "in", "input": parquet_input})
    stage.send(
        {"task_id": "out", "input": npy_input, "output": f"s3://{stage.bucket}/out/o.parquet"}
    )
    async with running(make_settings()) as worker:
        await eventually(lambda: outcome_count(worker, "rejected") == 2)
    hint = ".parquet needs pyarrow, which is not installed: pip install 'sqsinfer[parquet]'"
    assert _dead_letters(stage) == {
        "in": ("unsupported_format", f"input {parquet_input}: {hint}"),
        "out": ("unsupported_format", f"output s3://{stage.bucket}/out/o.parquet: {hint}"),
    }
