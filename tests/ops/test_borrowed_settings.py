"""The operator commands take worker settings through the worker's own declaration.

A shell set up for a stage (every `SQSINFER_*` variable in a form the settings page
documents, `SQSINFER_PREFETCH=auto` among them) runs every operator command, and each
command reads a borrowed setting as the worker does.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from sqsinfer import cli, config
from sqsinfer.compute import formats
from sqsinfer.config import Settings
from tests.conftest import Stage

# Each setting in the forms docs/settings.md gives it (its default's form, and the others
# its help names). A setting added without its forms here fails the first test.
FORMS: dict[str, tuple[str, ...]] = {
    "queue_url": ("{queue}",),
    "dlq_url": ("", "{dlq}"),
    "next_queue_url": ("", "{next}"),
    "model_path": ("{model}", "s3://{bucket}/models/model.ubj"),
    "model_sha256": ("", "0" * 64),
    "model_version": ("", "2026-11-a"),
    "model_dir": ("", "{tmp}/model"),
    "max_model_bytes": ("4294967296",),
    "handler": ("xgboost", "onnx", "tests.handlers:ScriptedHandler"),
    "model_output": ("", "probabilities"),
    "allowed_input_prefixes": ("s3://{bucket}/in/", "s3://{bucket}/in/,s3://{bucket}/more/"),
    # Placeholders (doubled braces: these are format strings) filled from the model.
    "output_prefix": (
        "s3://{bucket}/out/",
        "s3://{bucket}/out/{{model_version}}/",
        "s3://{bucket}/out/{{model_sha256_12}}/",
    ),
    "allowed_output_prefixes": ("", "s3://{bucket}/out/,s3://{bucket}/other/"),
    "output_format": ("npy", "json", "parquet"),
    "message_shape": ("sqsinfer", "s3-event", "auto"),
    "processes": ("0", "2"),
    "threads_per_process": ("1", "2"),
    "prefetch": ("auto", "AUTO", "3"),
    "max_prefetch": ("8",),
    "coalesce": ("true", "false"),
    "coalesce_max_rows": ("1000", "100"),
    "visibility_timeout_s": ("60", "300"),
    "heartbeat_s": ("20.0", "20"),
    "wait_time_s": ("20", "0"),
    "task_time_s": ("60.0",),
    "drain_deadline_s": ("0.0", "90"),
    "max_task_time_s": ("0.0", "900"),
    "exit_when_idle_s": ("0.0", "60"),
    "max_tasks": ("0", "1000"),
    "always_head_output": ("false", "true", "1", "no"),
    "chain_settle_s": ("30.0",),
    "chain_dedup_window_s": ("240.0", "0"),
    "max_message_bytes": ("262144",),
    "max_input_bytes": ("67108864",),
    "max_decoded_bytes": ("268435456",),
    "retry_base_s": ("5.0",),
    "retry_max_s": ("900.0",),
    "endpoint_url": ("{endpoint}",),
    "region": ("", "us-east-1"),
    "health_host": ("0.0.0.0", "127.0.0.1"),
    "health_port": ("8080", "0"),
    "stall_s": ("120.0",),
    "queue_sample_s": ("60.0", "0"),
    "pod_deletion_cost": ("false", "true"),
    "pod_deletion_cost_idle_s": ("10.0", "30"),
    "kube_token_dir": ("/var/run/secrets/kubernetes.io/serviceaccount", "{tmp}/kube-api"),
    "log_level": ("INFO", "debug"),
    "log_format": ("auto", "json", "console"),
    "worker_id": ("", "pod-7"),
}
COMMANDS = ("plan", "enqueue", "status", "redrive", "audit", "diff")


def _shell(stage: Stage, model_path: str, tmp_path: Path, form: int) -> dict[str, str]:
    """Every setting in its `form`-th documented form (its last when it has fewer)."""
    names = {
        "queue": stage.queue_url,
        "dlq": stage.dlq_url,
        "next": stage.next_url,
        "model": model_path,
        "bucket": stage.bucket,
        "tmp": str(tmp_path),
        "endpoint": stage.endpoint,
    }
    return {
        config.env_name(name): forms[min(form, len(forms) - 1)].format(**names)
        for name, forms in FORMS.items()
    }


def test_every_setting_has_its_documented_forms() -> None:
    assert set(FORMS) == {f.name for f in fields(Settings)}


@pytest.mark.parametrize("form", [0, 1, 2])
def test_every_form_is_one_the_worker_reads(stage, model_path, tmp_path, form) -> None:
    shell = _shell(stage, model_path, tmp_path, form)
    remote = shell["SQSINFER_MODEL_PATH"].startswith("s3://")
    if remote and not shell["SQSINFER_MODEL_SHA256"]:
        shell["SQSINFER_MODEL_SHA256"] = "0" * 64  # a remote model needs its pin
    if shell["SQSINFER_OUTPUT_FORMAT"] == "parquet":
        pytest.importorskip("pyarrow")
    Settings.load(shell)  # raises ConfigError naming a form the worker refuses


@pytest.fixture(params=[0, 1, 2])
def form(request, stage, model_path, tmp_path, monkeypatch) -> int:
    """A stage's shell, its settings in one of their documented forms."""
    for name, value in _shell(stage, model_path, tmp_path, request.param).items():
        monkeypatch.setenv(name, value)
    return int(request.param)


@pytest.mark.parametrize("command", COMMANDS)
def test_each_operator_command_runs_in_a_stage_shell(stage, tmp_path, capsys, form, command):
    manifest = tmp_path / "tasks.jsonl"
    manifest.write_text(json.dumps({"task_id": "a", "input": f"s3://{stage.bucket}/in/a.npy"}))
    output_format = os.environ["SQSINFER_OUTPUT_FORMAT"]
    if command == "diff":  # the output of task a under two prefixes, in the stage's format
        body = formats.encode(np.ones((2, 1), dtype=np.float32), output_format)
        for prefix in ("out/", "out-b/"):
            stage.s3.put_object(Bucket=stage.bucket, Key=f"{prefix}a.{output_format}", Body=body)
    argv = {
        # processes 0 is "the container's CPUs", which a plan made elsewhere cannot know.
        "plan": ["plan", "--tasks", "1000", "--seconds-per-task", "2", "--pods-max", "10", "--json"]
        + (["--processes", "4"] if form == 0 else []),
        "enqueue": ["enqueue", str(manifest), "--dry-run", "--json", "--quiet"],
        "status": ["status", "--interval-s", "0", "--json"],
        "redrive": ["redrive", "--dry-run", "--json"],
        "audit": ["audit", str(manifest), "--json", "--dlq-hold-s", "2"],
        "diff": ["diff", f"s3://{stage.bucket}/out/", f"s3://{stage.bucket}/out-b/", "--json"],
    }[command]
    if command == "diff":
        argv += ["--manifest", str(manifest)]
    # The audit finds the one task missing (nothing ran): exit 1, as the stage's audit.
    assert cli.main(argv) == (1 if command == "audit" else 0), capsys.readouterr().err
    text = capsys.readouterr().out
    indented = command in ("plan", "diff")
    out = json.loads(text if indented else text.splitlines()[-1])
    if command == "plan":  # the stage's processes, and prefetch as the worker reads it
        assert out["input"]["processes"] == (4 if form == 0 else 2)
        expected = 3 if FORMS["prefetch"][min(form, 2)] == "3" else 2  # auto starts at 2
        assert out["input"]["prefetch"] == expected
    if command == "diff":  # the derived key's suffix is the stage's output format
        assert (out["compared"], out["identical"]) == (1, 1)
    if command == "enqueue":  # checked with the stage's rules: its allow-list, its suffix
        assert (out["sent"], out["bad"], out["dry_run"]) == (1, 0, True)
    if command == "audit":  # the stage's queue and output prefix, filled from its model
        (found,) = out["stages"]
        assert (out["tasks"], found["missing"], found["queue_url"]) == (1, 1, stage.queue_url)
        assert "{" not in found["output_prefix"]


def test_a_plan_for_the_containers_cpus_asks_for_the_processes(monkeypatch, capsys) -> None:
    monkeypatch.setenv("SQSINFER_PROCESSES", "0")
    assert cli.main(["plan", "--tasks", "10", "--seconds-per-task", "1"]) == 2
    assert "give --processes (or set SQSINFER_PROCESSES)" in capsys.readouterr().err


def test_a_borrowed_setting_in_a_bad_form_is_named(monkeypatch, capsys) -> None:
    monkeypatch.setenv("SQSINFER_PREFETCH", "none")
    assert cli.main(["plan", "--tasks", "10", "--seconds-per-task", "1", "--processes", "2"]) == 2
    err = capsys.readouterr().err
    assert "SQSINFER_PREFETCH (--prefetch)" in err and "invalid value 'none'" in err
    monkeypatch.setenv("SQSINFER_PREFETCH", "0")
    assert cli.main(["plan", "--tasks", "10", "--seconds-per-task", "1", "--processes", "2"]) == 2
    assert "must be auto or at least 1" in capsys.readouterr().err
