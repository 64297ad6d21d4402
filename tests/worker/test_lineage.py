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


async def test_each_output_carries_its_lineage_under_its_models_own_prefix(
    stage: Stage, make_settings, model_path
):
    unversioned = _input(stage, "b.npy")  # written before the bucket kept versions
    stage.s3.put_bucket_versioning(
        Bucket=stage.bucket, VersioningConfiguration={"Status": "Enabled"}
    )
    versioned = _input(stage, "a.npy")
    source = stage.s3.head_object(Bucket=stage.bucket, Key="in/a.npy")
    message_id = stage.send({"task_id": "a", "input": versioned})
    stage.send({"task_id": "b", "input": unversioned})
    # An explicit output may name the model too.
    named = f"s3://{stage.bucket}/out/{{model_sha256_12}}/named/c.json"
    stage.send({"task_id": "c", "input": versioned, "output": named})
    settings = make_settings(
        model_version="2026-11-a",
        worker_id="pod-7",
        output_prefix=f"s3://{stage.bucket}/out/{{model_sha256_12}}/",
    )
    async with running(settings) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == 3)
    sha = file_sha256(model_path)
    outputs = stage.outputs()
    assert sorted(outputs) == [
        f"out/{sha[:12]}/{name}" for name in ("a.npy", "b.npy", "named/c.json")
    ]
    meta = stage.s3.head_object(Bucket=stage.bucket, Key=f"out/{sha[:12]}/a.npy")["Metadata"]
    # input-uri-sha256: an S3 event's only; model-output: a model of several outputs' only.
    assert set(meta) == set(lineage.KEYS) - {"input-uri-sha256", "model-output"}
    assert meta == meta | {
        "task-id": "a",
        "model-sha256": sha,
        "model-version": "2026-11-a",
        "handler": "xgboost",
        "handler-version": xgboost.__version__,
        "sqsinfer-version": __version__,
        "input-etag": source["ETag"].strip('"'),
        "input-version-id": source["VersionId"],
        "output-sha256": hashlib.sha256(outputs[f"out/{sha[:12]}/a.npy"]).hexdigest(),
        "message-id": message_id,
        "worker": "pod-7",
    }
    assert len(meta["delivery"]) == 32
    assert lineage.metadata_bytes(meta) <= S3_MAX_METADATA_BYTES
    # An input from before versioning has no version id: the key is left out.
    meta = stage.s3.head_object(Bucket=stage.bucket, Key=f"out/{sha[:12]}/b.npy")["Metadata"]
    assert set(meta) == set(lineage.KEYS) - {"input-version-id", "input-uri-sha256", "model-output"}
    assert meta["input-etag"]


def test_the_worst_case_lineage_fits_s3s_two_kilobytes():
    """Every value at its cap, through the code that writes them: still within 2 KB."""
    cap = lineage.MAX_VALUE_BYTES
    producer = lineage.Producer(
        model_sha256="f" * cap["model-sha256"],
        handler="h" * cap["handler"],
        handler_version="v" * cap["handler-version"],
        worker="w" * cap["worker"],
        model_version="m" * cap["model-version"],
        model_output="o" * cap["model-output"],
        sqsinfer_version="s" * cap["sqsinfer-version"],
    )
    written = lineage.Written(
        task_id="t" * cap["task-id"],
        message_id="i" * cap["message-id"],
        delivery="d" * cap["delivery"],
        output_sha256="o" * cap["output-sha256"],
        input_etag="e" * cap["input-etag"],
        input_version_id="r" * cap["input-version-id"],
        input_uri_sha256="u" * cap["input-uri-sha256"],  # an S3 event's output
    )
    meta = lineage.output_metadata(producer, written)
    assert set(meta) == set(lineage.KEYS)  # nothing left out at the caps
    assert lineage.metadata_bytes(meta) == lineage.worst_case_bytes() <= S3_MAX_METADATA_BYTES
    # A value from S3 beyond its cap (none is) is left out, never cut.
    longer = lineage.Written(**{**vars(written), "input_version_id": "r" * 257})
    assert "input-version-id" not in lineage.output_metadata(producer, longer)


async def test_another_models_worker_writes_beside_and_counts_what_it_finds_of_others(
    stage: Stage, make_settings, tmp_path, caplog
):
    """Under a per-model prefix a new model's outputs go beside the old ones'. An output
    of this task another model wrote where this worker writes is left as it is, and
    counted and logged: never silently taken for this worker's own."""
    model = synthetic.train_model(str(tmp_path / "b.ubj"), N_FEATURES, trees=4, seed=9)
    sha12 = file_sha256(model)[:12]
    uri = _input(stage, "c.npy")
    stage.s3.put_object(Bucket=stage.bucket, Key="out/older/c.npy", Body=b"model A's")
    stage.s3.put_object(
        Bucket=stage.bucket,
        Key=f"out/{sha12}/e.npy",
        Body=b"an older model's scores",
        Metadata={"task-id": "e", "model-sha256": "0" * 64},
    )
    stage.send({"task_id": "c", "input": uri})
    stage.send({"task_id": "e", "input": uri})
    caplog.set_level(logging.WARNING, logger="sqsinfer.task")
    prefix = f"s3://{stage.bucket}/out/{{model_sha256_12}}/"
    settings = make_settings(model_path=model, output_prefix=prefix, always_head_output=True)
    async with running(settings) as worker:
        await eventually(lambda: outcome_count(worker, "duplicate") == 1)
        await eventually(lambda: outcome_count(worker, "committed") == 1)
        counted = sample(worker.metrics, "sqsinfer_other_model_outputs_total")
    assert counted == 1
    outputs = stage.outputs()
    assert outputs[f"out/{sha12}/e.npy"] == b"an older model's scores"  # never overwritten
    assert sorted(outputs) == sorted(
        ["out/older/c.npy", f"out/{sha12}/c.npy", f"out/{sha12}/e.npy"]
    )
    [record] = [r for r in caplog.records if r.msg == "output written by another model"]
    assert vars(record)["its_model"] == "0" * 64 and vars(record)["task_id"] == "e"
