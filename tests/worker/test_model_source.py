"""A model fetched from S3 at start-up: pinned, bounded, verified, and reused in the pod."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from sqsinfer.compute.errors import ModelLoadError
from sqsinfer.config import ConfigError
from sqsinfer.lab import synthetic
from sqsinfer.worker.lifecycle import Worker
from sqsinfer.worker.preflight import StartupError
from tests.conftest import N_FEATURES, Stage, eventually, outcome_count, running


def _upload_model(stage: Stage, model_path: str, key: str = "models/m.ubj") -> tuple[str, str]:
    data = Path(model_path).read_bytes()
    stage.s3.put_object(Bucket=stage.bucket, Key=key, Body=data)
    return f"s3://{stage.bucket}/{key}", hashlib.sha256(data).hexdigest()


def _model_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [str(r.msg) for r in caplog.records if r.name == "sqsinfer.model"]


async def _start_fails(settings) -> BaseException:
    worker = Worker(settings)
    with pytest.raises((ModelLoadError, StartupError)) as caught:
        await worker.serve()
    return caught.value


async def test_a_pinned_model_in_s3_is_fetched_and_serves_tasks(
    stage: Stage, make_settings, model_path: str, tmp_path: Path
) -> None:
    uri, sha = _upload_model(stage, model_path)
    settings = make_settings(model_path=uri, model_sha256=sha, model_dir=str(tmp_path / "m"))
    rows = synthetic.make_rows(4, N_FEATURES, seed=3)
    stage.send(
        {"task_id": "t1", "input": stage.put_input("t1.npy", synthetic.encode_input(rows, "npy"))}
    )
    async with running(settings):
        await eventually(lambda: "out/t1.npy" in stage.outputs())
    fetched = tmp_path / "m" / f"{sha}.ubj"
    assert hashlib.sha256(fetched.read_bytes()).hexdigest() == sha
    assert os.listdir(tmp_path / "m") == [fetched.name]  # no partial download left behind
    head = stage.s3.head_object(Bucket=stage.bucket, Key="out/t1.npy")
    assert head["Metadata"]["model-sha256"] == sha


async def test_a_wrong_pin_stops_start_up_and_keeps_nothing(
    stage: Stage, make_settings, model_path: str, tmp_path: Path
) -> None:
    uri, _ = _upload_model(stage, model_path)
    settings = make_settings(model_path=uri, model_sha256="ab" * 32, model_dir=str(tmp_path))
    error = await _start_fails(settings)
    assert str(error).startswith("SQSINFER_MODEL_SHA256: model s3://")
    assert os.listdir(tmp_path) == []


async def test_a_missing_model_object_stops_start_up_naming_the_setting(
    stage: Stage, make_settings, tmp_path: Path
) -> None:
    uri = f"s3://{stage.bucket}/models/absent.ubj"
    settings = make_settings(model_path=uri, model_sha256="ab" * 32, model_dir=str(tmp_path))
    error = await _start_fails(settings)
    assert str(error).startswith("SQSINFER_MODEL_PATH: cannot fetch model " + uri)


async def test_a_model_over_the_limit_is_refused_before_it_is_read(
    stage: Stage, make_settings, model_path: str, tmp_path: Path
) -> None:
    uri, sha = _upload_model(stage, model_path)
    settings = make_settings(
        model_path=uri, model_sha256=sha, model_dir=str(tmp_path), max_model_bytes=100
    )
    error = await _start_fails(settings)
    assert str(error).startswith("SQSINFER_MAX_MODEL_BYTES: model s3://")
    assert os.listdir(tmp_path) == []


async def test_a_verified_copy_is_reused_and_a_tampered_one_fetched_anew(
    stage: Stage, make_settings, model_path: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    uri, sha = _upload_model(stage, model_path)
    settings = make_settings(model_path=uri, model_sha256=sha, model_dir=str(tmp_path))
    async with running(settings):
        pass
    async with running(settings):
        pass
    assert _model_lines(caplog) == ["model fetched", "model already fetched"]
    (tmp_path / f"{sha}.ubj").chmod(0o644)
    (tmp_path / f"{sha}.ubj").write_bytes(b"tampered")
    caplog.clear()
    async with running(settings):
        pass
    assert _model_lines(caplog) == ["model fetched"]


def test_a_model_in_s3_needs_a_pin(make_settings) -> None:
    with pytest.raises(ConfigError, match=r"^SQSINFER_MODEL_SHA256 .*required for a model"):
        make_settings(model_path="s3://models/m.ubj")


def test_a_malformed_model_uri_is_named(make_settings) -> None:
    with pytest.raises(ConfigError, match=r"^SQSINFER_MODEL_PATH "):
        make_settings(model_path="s3://UPPER/m.ubj", model_sha256="ab" * 32)


# -- a pinned model's memory at load --------------------------------------------------------
_PEAK_OF_LOADING = """
import os, sys
import xgboost  # the library's own pages are not the model's
from sqsinfer.compute import inference

def kib(key):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(key))

path, sha = sys.argv[1], sys.argv[2]
before = kib("VmHWM:")
if sha:
    inference.init_process("xgboost", path, 1, sha, 1 << 28)
else:  # the least a load from bytes can cost: one buffer, filled in place, parsed where it is
    buffer = bytearray(os.path.getsize(path))
    with open(path, "rb", buffering=0) as fh:
        fh.readinto(buffer)
    xgboost.Booster().load_model(buffer)
print(kib("VmHWM:") - before)
"""


def _large_model(model_path: str, target: Path, copies: int) -> Path:
    """A Booster many times the size of the small one, by repeating its trees."""
    import xgboost

    booster = xgboost.Booster()
    booster.load_model(model_path)
    doc = json.loads(booster.save_raw("json"))
    model = doc["learner"]["gradient_booster"]["model"]
    trees = [
        dict(tree, id=i) for i, tree in enumerate(t for _ in range(copies) for t in model["trees"])
    ]
    model["trees"] = trees
    model["tree_info"] = model["tree_info"] * copies
    model["gbtree_model_param"]["num_trees"] = str(len(trees))
    model["iteration_indptr"] = list(range(len(trees) + 1))
    big = xgboost.Booster()
    big.load_model(bytearray(json.dumps(doc).encode()))
    big.save_model(str(target))
    return target


def _peak_kib(path: Path, sha: str) -> int:
    found = subprocess.run(
        [sys.executable, "-c", _PEAK_OF_LOADING, str(path), sha],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return int(found.stdout.strip())


def test_a_pinned_model_is_in_memory_once_while_it_loads(model_path: str, tmp_path: Path) -> None:
    """Reading the bytes to hash them must not cost a second copy for the library: the
    peak of a pinned load is that of the library parsing one buffer of the file's bytes.
    (Not a load by path: XGBoost 3 reads the whole file into memory, 2.1 streams it.)"""
    big = _large_model(model_path, tmp_path / "big.ubj", copies=2000)
    size_kib = big.stat().st_size // 1024
    assert size_kib > 20 * 1024  # large enough to tell a copy from the noise
    sha = hashlib.sha256(big.read_bytes()).hexdigest()
    from_buffer, pinned = _peak_kib(big, ""), _peak_kib(big, sha)
    assert pinned < from_buffer + size_kib // 2, (pinned, from_buffer, size_kib)


# -- no process can start: the worker steps aside ----------------------------------------------
async def _readyz(worker) -> tuple[int, str]:
    url = f"http://127.0.0.1:{worker.health.port}/readyz"
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        return response.status, await response.text()


def _replace(path: Path, data: bytes) -> None:
    """Swap the file's content as a writer would: a new file renamed over it."""
    partial = path.with_suffix(".partial")
    partial.write_bytes(data)
    os.replace(partial, path)


async def test_a_worker_whose_processes_cannot_restart_stops_receiving_and_steps_aside(
    stage: Stage, make_settings, model_path: str, tmp_path: Path
) -> None:
    """The fetched model is replaced and both processes killed: every restart is refused
    (the pin), so the worker stops receiving, hands back what waits for a process, and
    fails /readyz at once; when the model is back, it serves again."""
    uri, sha = _upload_model(stage, model_path)
    settings = make_settings(
        handler="tests.handlers:ScriptedHandler",
        model_path=uri,
        model_sha256=sha,
        model_dir=str(tmp_path / "m"),
        processes=2,
        prefetch=3,
        retry_base_s=60,  # the two tasks lost with their processes stay away
    )
    slow = synthetic.encode_input(np.full((2, 3), 4.0, dtype=np.float32), "npy")
    for i in range(5):
        stage.send({"task_id": f"s{i}", "input": stage.put_input(f"s{i}.npy", slow)})
    fetched = tmp_path / "m" / f"{sha}.ubj"  # where start-up fetches it to
    good = await asyncio.to_thread(Path(model_path).read_bytes)
    async with running(settings) as worker:
        await eventually(lambda: len(worker.held) == 5 and all(s.busy for s in worker.pool.slots))
        assert await _readyz(worker) == (200, "ok\n")
        _replace(fetched, b"not the pinned model")
        for slot in worker.pool.slots:
            os.kill(slot.pid, signal.SIGKILL)
        await eventually(lambda: not worker.readyz()[0], timeout_s=30)
        status, text = await _readyz(worker)
        assert status == 503 and text.startswith("no inference process can start: ")
        # Two were lost with their processes (retried, delayed); three were waiting for
        # one and are handed back, visible to healthy pods, and not received again.
        await eventually(lambda: stage.counts(stage.queue_url) == (3, 2), timeout_s=15)
        # A message's task ends (and leaves `held`) just after its hand-back has landed.
        await eventually(lambda: not worker.held, timeout_s=15)
        assert worker.metrics.outcomes == {"retried": 2, "released": 3}
        for _ in range(3 * settings.wait_time_s * 5):  # longer than a long poll, 0.2 s apart
            assert await asyncio.to_thread(stage.counts, stage.queue_url) == (3, 2)
            await asyncio.sleep(0.2)
        _replace(fetched, good)  # the model is back: a restart succeeds
        await eventually(lambda: worker.readyz()[0], timeout_s=60)
        assert await _readyz(worker) == (200, "ok\n")
        await eventually(lambda: outcome_count(worker, "committed") == 3, timeout_s=60)
