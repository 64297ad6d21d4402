"""The re-scoring walkthrough of docs/operating.md, run on the stand-in as it is printed:
model A scores a batch, model B the same inputs into its own prefix, `audit` for B, then
`diff` A against B."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sqsinfer.lab import stage, standin, synthetic
from tests.conftest import N_FEATURES

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- walkthrough:"
TASKS = 12


def walkthrough_lines() -> list[str]:
    """The lines of the fenced block after the walkthrough marker, as printed."""
    text = (ROOT / "docs" / "operating.md").read_text()
    after = text[text.index(MARKER) :]
    block = after[after.index("```sh\n") + len("```sh\n") :]
    return block[: block.index("```")].splitlines()


_DRAINED = """\
import sys, time, boto3
sqs = boto3.client("sqs", endpoint_url=sys.argv[1], region_name="us-east-1")
names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    attrs = sqs.get_queue_attributes(QueueUrl=sys.argv[2], AttributeNames=names)["Attributes"]
    if sum(int(v) for v in attrs.values()) == 0:
        sys.exit(0)
    time.sleep(0.5)
sys.exit("the queue did not drain")
"""


def script(lines: list[str], python: str) -> str:
    """The walkthrough as a bash script: each documented line as it is, a worker left in
    the background until the queue is empty, then stopped (SIGTERM: as Ctrl-C stops it)."""
    out = ["set -euo pipefail"]
    for line in lines:
        if line.startswith("sqsinfer worker"):
            out += [
                f"{line} 2>>worker.log &",
                "worker=$!",
                f'{python} drained.py "$SQSINFER_ENDPOINT_URL" "$SQSINFER_QUEUE_URL"',
                'kill -TERM "$worker"',
                'wait "$worker"',
            ]
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def _prepare(endpoint: str, workdir: Path) -> dict[str, str]:
    s3, sqs = standin.clients(endpoint)
    for bucket in ("features", "scores"):
        stage.create_bucket(s3, bucket)
    queue = stage.create_queue(sqs, "score").url
    inputs = {
        f"user-{i}.npy": synthetic.encode_input(synthetic.make_rows(4, N_FEATURES, seed=i), "npy")
        for i in range(TASKS)
    }
    stage.put_objects(s3, "features", inputs)
    with open(workdir / "tasks.jsonl", "w") as fh:
        for key in inputs:
            doc = {"task_id": key.removesuffix(".npy"), "input": f"s3://features/{key}"}
            fh.write(json.dumps(doc) + "\n")
    for name, seed in (("model-a.ubj", 1), ("model-b.ubj", 2)):
        synthetic.train_model(str(workdir / name), N_FEATURES, trees=4, seed=seed)
    (workdir / "drained.py").write_text(_DRAINED)
    bin_dir = os.path.dirname(sys.executable)
    return {
        **os.environ,
        **standin.FAKE_CREDENTIALS,
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "SQSINFER_ENDPOINT_URL": endpoint,
        # The stage's settings, as the walkthrough's first block exports them.
        "SQSINFER_QUEUE_URL": queue,
        "SQSINFER_ALLOWED_INPUT_PREFIXES": "s3://features/",
        "SQSINFER_OUTPUT_PREFIX": "s3://scores/{model_sha256_12}/",
        # A worker for a test: one process, quick polls and drains, health on loopback.
        "SQSINFER_PROCESSES": "1",
        "SQSINFER_WAIT_TIME_S": "1",
        "SQSINFER_HEALTH_HOST": "127.0.0.1",
        "SQSINFER_HEALTH_PORT": "0",
        **stage.SHORT_DRAIN,
    }


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _output(s3: Any, prefix: str, task: str) -> np.ndarray:
    body = s3.get_object(Bucket="scores", Key=f"{prefix}/{task}.npy")["Body"].read()
    return np.load(io.BytesIO(body), allow_pickle=False).astype(np.float64)


def test_the_rescoring_walkthrough_runs_as_printed(tmp_path):
    lines = walkthrough_lines()
    assert any(line.startswith("sqsinfer diff ") for line in lines)
    with standin.moto_server() as moto:
        env = _prepare(moto.url, tmp_path)
        done = subprocess.run(
            ["bash", "-c", script(lines, sys.executable)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        worker_log = (
            (tmp_path / "worker.log").read_text() if (tmp_path / "worker.log").exists() else ""
        )
        assert done.returncode == 0, done.stdout + done.stderr + worker_log[-3000:]
        s3 = standin.clients(moto.url)[0]
        keys = stage.list_keys(s3, "scores", "")
        sha = {m: _sha256(tmp_path / f"model-{m}.ubj")[:12] for m in "ab"}
        direct = max(
            float(np.abs(_output(s3, sha["a"], task) - _output(s3, sha["b"], task)).max())
            for task in (f"user-{i}" for i in range(TASKS))
        )
    prefixes = {key.split("/", 1)[0] for key in keys}
    assert len(prefixes) == 2 and len(keys) == 2 * TASKS  # B's beside A's, none lost
    assert "every task committed once at every stage by the model asked" in done.stdout
    # The diff ran as printed, on A's prefix and B's: every task's two outputs read and
    # compared, the largest change the one numpy finds in the same outputs.
    diff = done.stdout[re.search(r"^diff\s*$", done.stdout, re.M).start() :]
    rows = dict(re.findall(r"^  (\S(?:.*?\S)?) {2,}(\S.*?)\s*$", diff, re.M))
    assert (rows["A"], rows["B"]) == (f"s3://scores/{sha['a']}/", f"s3://scores/{sha['b']}/")
    assert (rows["tasks"], rows["compared"]) == (f"{TASKS} (manifest)", str(TASKS))
    assert all(rows[name] == "0" for name in ("only in A", "only in B", "unreadable"))
    largest = float(rows["max |a-b|"].split()[-1])
    assert largest == pytest.approx(direct, rel=1e-3)
