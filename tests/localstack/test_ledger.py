"""Lineage and the audit on LocalStack: a worker's outputs under its model's prefix carry
their lineage, and `sqsinfer audit` lists, reads the dead-letter queue and hands it back
there as it does on moto."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from sqsinfer import cli, lineage
from sqsinfer.aws.sqs import Message, dead_letter_copy
from sqsinfer.compute.inference import file_sha256
from sqsinfer.lab import synthetic
from tests.conftest import N_FEATURES, Stage, eventually, outcome_count, running


async def test_lineage_and_the_audit_on_localstack(
    stage: Stage, make_settings, model_path, tmp_path: Path, capsys
):
    stage.s3.put_bucket_versioning(
        Bucket=stage.bucket, VersioningConfiguration={"Status": "Enabled"}
    )
    lines = []
    for i in range(4):
        rows = synthetic.make_rows(3, N_FEATURES, seed=i)
        uri = stage.put_input(f"t{i}.npy", synthetic.encode_input(rows, "npy"))
        lines.append(json.dumps({"task_id": f"t{i}", "input": uri}))
    for line in lines[:3]:
        stage.send(line)
    prefix = f"s3://{stage.bucket}/out/{{model_sha256_12}}/"
    async with running(make_settings(output_prefix=prefix)) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == 3)
    sha = file_sha256(model_path)
    meta = stage.s3.head_object(Bucket=stage.bucket, Key=f"out/{sha[:12]}/t0.npy")["Metadata"]
    assert (
        set(meta) == set(lineage.KEYS) - {"model-version", "input-uri-sha256", "model-output"}
        and meta["model-sha256"] == sha
    )
    # t3 never ran: its message is in the DLQ, as a worker rejecting it would leave it.
    copy = dead_letter_copy(
        Message("m3", "-", lines[3], 1), "input_not_found", "-", stage.queue_url
    )
    stage.sqs.send_message(
        QueueUrl=stage.dlq_url, MessageBody=copy.body, MessageAttributes=copy.attributes
    )
    manifest = tmp_path / "tasks.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    argv = ["audit", str(manifest), "--endpoint-url", stage.endpoint, "--queue-url"]
    argv += [stage.queue_url, "--output-prefix", prefix, "--model-sha256", sha, "--json"]
    argv += ["--dlq-hold-s", "5"]
    assert await asyncio.to_thread(cli.main, argv) == 3  # a command runs its own loop
    report = json.loads(capsys.readouterr().out)
    (found,) = report["stages"]
    assert (found["committed"], found["dead_lettered"], found["versions_listed"]) == (3, 1, True)
    assert found["by_model"] == {sha: 3}
    assert stage.counts(stage.dlq_url) == (1, 0)  # read, and handed back
