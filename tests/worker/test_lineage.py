"""Every output says how it was made, outputs of another model go beside, not over, and
an output another model wrote is counted, not silently taken for this worker's."""

from __future__ import annotations

import hashlib
import logging

import xgboost

from sqsinfer import __version__, lineage
from sqsinfer.compute.inference import file_sha256
from sqsinfer.lab import synthetic
from sqsinfer.limits import S3_MAX_METADATA_BYTES
from tests.conftest import N_FEATURES, Stage, eventually, outcome_count, running, sample


def _input(stage: Stage, name: str) -> str:
    rows = synthetic.make_rows(3, N_FEATURES, seed=7)
    return stage.put_input(name, synthetic.encode_input(rows, "npy"))


async def test_a_committed_output_carries_its_whole_lineage(
    stage: Stage, make_settings, model_path
):
    stage.s3.put_bucket_versioning(
        Bucket=stage.bucket, VersioningConfiguration={"Status": "Enabled"}
    )
    uri = _input(stage, "a.npy")
    source = stage.s3.head_object(Bucket=stage.bucket, Key="in/a.npy")
    message_id = stage.send({"task_id": "a", "input": uri})
    settings = make_settings(model_version="2026-11-a", worker_id="pod-7")
    async with running(settings) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == 1)
    head = stage.s3.head_object(Bucket=stage.bucket, Key="out/a.npy")
    body = stage.outputs()["out/a.npy"]
    meta = head["Metadata"]
    assert set(meta) == set(lineage.KEYS)
    assert meta == meta | {
        "task-id": "a",
        "model-sha256": file_sha256(model_path),
        "model-version": "2026-11-a",
        "handler": "xgboost",
        "handler-version": xgboost.__version__,
        "sqsinfer-version": __version__,
        "input-etag": source["ETag"].strip('"'),
        "input-version-id": source["VersionId"],
        "output-sha256": hashlib.sha256(body).hexdigest(),
        "message-id": message_id,
        "worker": "pod-7",
    }
    assert len(meta["delivery"]) == 32
    assert lineage.metadata_bytes(meta) <= S3_MAX_METADATA_BYTES


async def test_an_unversioned_input_has_no_version_id(stage: Stage, make_settings):
    stage.send({"task_id": "b", "input": _input(stage, "b.npy")})
    async with running(make_settings()) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == 1)
    meta = stage.s3.head_object(Bucket=stage.bucket, Key="out/b.npy")["Metadata"]
    assert "input-version-id" not in meta and "model-version" not in meta
    assert meta["input-etag"] and set(meta) == set(lineage.KEYS) - {
        "input-version-id",
        "model-version",
    }


def test_the_worst_case_lineage_fits_s3s_two_kilobytes():
    """Every value at its cap, through the code that writes them: still within 2 KB."""
    cap = lineage.MAX_VALUE_BYTES
    producer = lineage.Producer(
        model_sha256="f" * cap["model-sha256"],
        handler="h" * cap["handler"],
        handler_version="v" * cap["handler-version"],
        worker="w" * cap["worker"],
        model_version="m" * cap["model-version"],
        sqsinfer_version="s" * cap["sqsinfer-version"],
    )
    written = lineage.Written(
        task_id="t" * cap["task-id"],
        message_id="i" * cap["message-id"],
        delivery="d" * cap["delivery"],
        output_sha256="o" * cap["output-sha256"],
        input_etag="e" * cap["input-etag"],
        input_version_id="r" * cap["input-version-id"],
    )
    meta = lineage.output_metadata(producer, written)
    assert set(meta) == set(lineage.KEYS)  # nothing left out at the caps
    assert lineage.metadata_bytes(meta) == lineage.worst_case_bytes() <= S3_MAX_METADATA_BYTES
    # A value from S3 beyond its cap (none is) is left out, never cut.
    longer = lineage.Written(**{**vars(written), "input_version_id": "r" * 257})
    assert "input-version-id" not in lineage.output_metadata(producer, longer)


async def test_an_output_prefix_per_model_puts_each_models_outputs_apart(
    stage: Stage, make_settings, model_path, tmp_path
):
    other_model = synthetic.train_model(str(tmp_path / "b.ubj"), N_FEATURES, trees=4, seed=9)
    uri = _input(stage, "c.npy")
    prefix = f"s3://{stage.bucket}/out/{{model_sha256_12}}/"
    for path in (model_path, other_model):
        stage.send({"task_id": "c", "input": uri})
        # An explicit output may name the model too.
        stage.send({"task_id": "d", "input": uri, "output": prefix + "named/d.json"})
        async with running(make_settings(model_path=path, output_prefix=prefix)) as worker:
            await eventually(lambda: outcome_count(worker, "committed") == 2)
            assert sample(worker.metrics, "sqsinfer_other_model_outputs_total") == 0
    first, second = (file_sha256(p)[:12] for p in (model_path, other_model))
    assert sorted(stage.outputs()) == sorted(
        f"out/{sha}/{name}" for sha in (first, second) for name in ("c.npy", "named/d.json")
    )


async def test_an_output_another_model_wrote_is_counted_and_logged_not_taken_as_its_own(
    stage: Stage, make_settings, caplog
):
    uri = _input(stage, "e.npy")
    stage.s3.put_object(
        Bucket=stage.bucket,
        Key="out/e.npy",
        Body=b"an older model's scores",
        Metadata={"task-id": "e", "model-sha256": "0" * 64},
    )
    stage.send({"task_id": "e", "input": uri})
    caplog.set_level(logging.WARNING, logger="sqsinfer.task")
    async with running(make_settings(always_head_output=True)) as worker:
        await eventually(lambda: outcome_count(worker, "duplicate") == 1)
        counted = sample(worker.metrics, "sqsinfer_other_model_outputs_total")
    assert counted == 1
    assert stage.outputs() == {"out/e.npy": b"an older model's scores"}  # never overwritten
    [record] = [r for r in caplog.records if r.msg == "output written by another model"]
    assert vars(record)["its_model"] == "0" * 64 and vars(record)["task_id"] == "e"
