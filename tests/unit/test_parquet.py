"""Parquet: columns to a float32 matrix, what a message may choose, and what is refused.

The decoder and encoder run on files pyarrow writes; messages and settings are parsed by
the worker's own parser, with pyarrow present and (as `sys.modules` sees it) missing.
"""

from __future__ import annotations

import contextlib
import json
import sys

import numpy as np
import pyarrow as pa
import pytest

from sqsinfer import config
from sqsinfer.compute import formats
from sqsinfer.compute.errors import InputError
from sqsinfer.config import ConfigError, Settings
from sqsinfer.lab.synthetic import decode_output, parquet_bytes
from sqsinfer.messages import MessageRules, next_stage_body, parse_task
from tests.unit.test_fuzz import RULES

LIMIT = 1 << 20


def decode(data: bytes, columns: list[str] | None = None, limit: int = LIMIT) -> np.ndarray:
    options = formats.InputOptions(None if columns is None else tuple(columns))
    return formats.decode(memoryview(data), "parquet", limit, options)


def refusal(data: bytes, columns: list[str] | None = None, limit: int = LIMIT) -> str:
    with pytest.raises(InputError) as caught:
        decode(data, columns, limit)
    return str(caught.value)


MIXED = parquet_bytes(
    {
        "a": pa.array([1, None, 3], pa.int32()),
        "id": ["x", "y", "z"],
        "b": [1.5, 2.5, None],
        "flag": [True, None, False],
        "c": pa.array([7, 8, 9], pa.uint64()),
    }
)


def test_numeric_columns_in_file_order_others_skipped_nulls_as_nan():
    got = decode(MIXED)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(
        got, [[1, 1.5, 1, 7], [np.nan, 2.5, np.nan, 8], [3, np.nan, 0, 9]]
    )


def test_named_columns_in_the_order_named():
    np.testing.assert_array_equal(decode(MIXED, ["c", "a"]), [[7, 1], [8, np.nan], [9, 3]])


@pytest.mark.parametrize(
    ("columns", "detail"),
    [
        (["a", "id"], "column 'id' is string, not numeric"),
        (["a", "missing"], "Parquet file has no column 'missing'"),
    ],
)
def test_a_named_column_that_is_missing_or_not_numeric_is_refused_by_name(columns, detail):
    assert refusal(MIXED, columns) == f"undecodable_input: {detail}"


def test_a_file_of_several_row_groups_reads_whole():
    values = np.arange(1000 * 3, dtype=np.float64).reshape(1000, 3)
    data = parquet_bytes({f"f{i}": values[:, i] for i in range(3)}, row_group_rows=77)
    np.testing.assert_array_equal(decode(data), values.astype(np.float32))


def test_batches_cross_row_groups_of_any_size(monkeypatch):
    from sqsinfer.compute.formats import parquet as decoding_parquet

    monkeypatch.setattr(decoding_parquet, "_BATCH_ROWS", 5)
    values = np.arange(200, dtype=np.float32).reshape(100, 2)
    data = parquet_bytes({"x": values[:, 0], "y": values[:, 1]}, row_group_rows=13)
    np.testing.assert_array_equal(decode(data), values)


def test_the_size_is_refused_from_the_metadata_before_reading():
    data = parquet_bytes({"a": np.zeros(1000), "b": np.zeros(1000)})
    assert decode(data, limit=8000).shape == (1000, 2)
    assert refusal(data, limit=7999) == "input_too_large: decoded array would be 8000 B"
    assert refusal(data, ["a"], limit=3999) == "input_too_large: decoded array would be 4000 B"


@pytest.mark.parametrize(
    ("columns", "detail"),
    [
        ({"s": ["x"]}, "Parquet file has no numeric columns (it has 's' (string))"),
        ({"a": pa.array([], pa.float32())}, "Parquet file has no rows"),
        ({"a": [1.0, np.inf]}, "input contains infinity"),
        ({"a": [1.0, 1e300]}, "input contains infinity"),  # beyond float32
    ],
)
def test_files_without_usable_numbers_are_refused(columns, detail):
    assert refusal(parquet_bytes(columns)) == f"undecodable_input: {detail}"


def test_two_columns_of_one_name_are_refused_when_read():
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_arrays([pa.array([1]), pa.array([2])], ["x", "x"]), sink)
    assert refusal(sink.getvalue().to_pybytes()) == (
        "undecodable_input: Parquet file has 2 columns named 'x'"
    )


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d[: len(d) // 2],  # truncated: no footer
        lambda d: d[:-12] + b"\xff" * 8 + d[-4:],  # a footer whose length is nonsense
        lambda d: b"PAR1" + b"\x00" * (len(d) - 8) + b"PAR1",  # magic around nothing
        lambda d: b"not parquet at all",
        lambda d: b"",
    ],
)
def test_damaged_files_are_refused_with_pyarrows_reason(damage):
    detail = refusal(damage(MIXED))
    assert detail.startswith("undecodable_input: not a valid Parquet file: ")
    assert len(detail) < 400


def test_the_input_buffer_is_released_after_success_and_refusal():
    """The worker closes its shared memory after decoding: nothing may still hold it."""
    for data, limit in ((MIXED, LIMIT), (MIXED[:-20], LIMIT), (MIXED, 4)):
        held = bytearray(data)
        view = memoryview(held)
        with contextlib.suppress(InputError):
            formats.decode(view, "parquet", limit)
        view.release()  # BufferError if pyarrow still held an export of it
        held.append(0)


# -- outputs -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("predictions", "names"),
    [
        (np.array([0.5, 1.5], np.float32), ["prediction"]),
        (
            np.arange(6, dtype=np.float64).reshape(2, 3),
            ["prediction_0", "prediction_1", "prediction_2"],
        ),
        (np.array([[1], [2]], np.int64), ["prediction"]),
        (np.array([True, False]), ["prediction"]),
    ],
)
def test_outputs_are_a_column_per_output_in_the_predictions_dtype(predictions, names):
    import pyarrow.parquet as pq

    data = formats.encode(predictions, "parquet")
    table = pq.read_table(pa.BufferReader(data))
    assert table.column_names == names
    assert {str(t) for t in table.schema.types} == {str(pa.from_numpy_dtype(predictions.dtype))}
    rows = predictions.reshape(len(predictions), -1)
    np.testing.assert_array_equal(decode_output(data, "parquet"), rows)
    # ...and the next stage reads it as its input.
    np.testing.assert_array_equal(decode(data), rows.astype(np.float32))


# -- messages and settings ---------------------------------------------------------------
def task(**fields):
    doc = {"task_id": "t", "input": "s3://data/in/x.parquet", **fields}
    return parse_task(json.dumps(doc), RULES)


def rejection(**fields) -> tuple[str, str]:
    with pytest.raises(InputError) as caught:
        task(**fields)
    return caught.value.reason, caught.value.detail


def test_params_columns_become_the_tasks_input_options():
    assert task().input_options == formats.InputOptions()
    assert task(params={"columns": ["b", "a"]}).input_options.columns == ("b", "a")
    assert task(params={"columns": None, "other": 1}).input_options.columns is None


@pytest.mark.parametrize(
    ("params", "detail"),
    [
        ({"columns": "a"}, "params.columns must be a non-empty list of column names"),
        ({"columns": []}, "params.columns must be a non-empty list of column names"),
        ({"columns": ["a", 1]}, "params.columns must hold only non-empty strings"),
        ({"columns": ["a", ""]}, "params.columns must hold only non-empty strings"),
        ({"columns": ["a", ["b"]]}, "params.columns must hold only non-empty strings"),
        ({"columns": ["a", "a"]}, "params.columns names a column more than once"),
    ],
)
def test_malformed_columns_are_refused_at_parse_time(params, detail):
    assert rejection(params=params) == ("invalid_field", detail)


def test_columns_are_refused_for_formats_without_named_columns():
    assert rejection(input="s3://data/in/x.csv", params={"columns": ["a"]}) == (
        "invalid_field",
        "params.columns selects columns of .parquet inputs, not .csv",
    )


def test_columns_stay_with_their_stage():
    """The next stage reads this stage's output, whose columns are the predictions."""
    chosen = task(params={"columns": ["a"], "run": 7})
    assert json.loads(next_stage_body(chosen))["params"] == {"run": 7}


@pytest.fixture
def without_pyarrow(monkeypatch):
    """pyarrow as an environment without the extra sees it: not importable."""
    monkeypatch.setitem(sys.modules, "pyarrow", None)


HINT = ".parquet needs pyarrow, which is not installed: pip install 'sqsinfer[parquet]'"


@pytest.mark.usefixtures("without_pyarrow")
def test_without_pyarrow_parquet_messages_are_refused_with_the_extra_to_install():
    assert rejection() == ("unsupported_format", f"input s3://data/in/x.parquet: {HINT}")
    assert rejection(input="s3://data/in/x.npy", output="s3://data/out/y.parquet") == (
        "unsupported_format",
        f"output s3://data/out/y.parquet: {HINT}",
    )
    # A tool checking messages for a worker elsewhere does not judge that worker's packages.
    elsewhere = MessageRules(**{**RULES.__dict__, "require_installed_formats": False})
    assert parse_task(json.dumps({"task_id": "t", "input": "s3://data/in/x.parquet"}), elsewhere)


def _settings(output_format: str) -> Settings:
    return Settings.load(
        environ={},
        overrides={
            "queue_url": "http://localhost/q",
            "model_path": config.__file__,  # any existing file
            "allowed_input_prefixes": "s3://data/in/",
            "output_prefix": "s3://data/out/",
            "output_format": output_format,
        },
    )


def test_parquet_is_an_output_format_for_derived_keys():
    assert _settings("parquet").output_suffix == ".parquet"


@pytest.mark.usefixtures("without_pyarrow")
def test_without_pyarrow_a_parquet_output_format_stops_start_up():
    with pytest.raises(ConfigError) as caught:
        _settings("parquet")
    assert "SQSINFER_OUTPUT_FORMAT" in str(caught.value)
    assert "pip install 'sqsinfer[parquet]'" in str(caught.value)
    assert _settings("npy").output_suffix == ".npy"
