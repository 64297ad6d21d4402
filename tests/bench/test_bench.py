"""`sqsinfer bench`: the smoke run end to end, and the pieces that compute the report.

These tests check that the benchmark runs and reports; they never assert a speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from sqsinfer import bench
from sqsinfer.bench import probe, report, runner, workload
from sqsinfer.lab import feeder as feeding

SCENARIOS = {
    "compute-only",
    "sqsinfer",
    "http-service",
    "http-service-load-per-request",
    "naive",
    "emulator-ceiling",
}


def test_quick_run_reports_every_scenario_with_a_stable_shape(tmp_path):
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "sqsinfer", "bench", "--quick", "--out-dir", str(out)]
    argv += ["--cache-dir", str(tmp_path / "cache")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=170, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads((out / "bench-quick.json").read_text())

    assert found["schema"] == "sqsinfer-bench/1"
    assert found["regime"] == "quick"
    assert found["quick"] is True
    assert set(found["scenarios"]) == SCENARIOS
    for name, result in found["scenarios"].items():
        assert "error" not in result, (name, result.get("error"))
        assert result["tasks"] > 0, name
        assert result["tasks_per_s"] > 0, name
        assert isinstance(result["seconds_per_task"], float), name
        assert {"p50", "p95", "mean"} <= set(result["latency_s"]), name
        assert set(runner.PHASES) | {"other"} <= set(result["phases_ms"]), name
        assert result["cpu_s_per_task"] is not None, name
        assert result["peak_rss_mb"]["parent"] > 0, name
    # The key `sqsinfer plan` reads.
    assert isinstance(found["scenarios"]["sqsinfer"]["seconds_per_task"], float)
    assert found["scenarios"]["sqsinfer"]["pool_ready_s"] > 0
    assert len(found["scenarios"]["sqsinfer"]["peak_rss_mb"]["children"]) >= 2
    assert found["scenarios"]["sqsinfer"]["phases_ms"]["receive"] is not None
    assert {"efficiency", "vs_http_service", "vs_naive", "overhead_cpu_ms_per_task"} <= set(
        found["ratios"]
    )
    assert all(found["ratios"][k] is not None for k in ("efficiency", "vs_naive"))
    assert {"pool_ready_s", "handoff_2mb_ms"} <= set(found["targets"])
    methods = found["handoff"]["methods"]
    assert {"shared_memory", "pickle_array", "raw_bytes", "no_payload"} == set(methods)
    assert found["handoff"]["array_bytes"] > 2_000_000
    machine = found["machine"]
    assert machine["cpus"] >= 1 and machine["python"] and "numpy" in machine["packages"]
    assert "sqsinfer" in done.stdout and "tasks/s" in done.stdout


def test_quick_run_with_the_onnx_handler(tmp_path):
    """The same worker and compute-only runs on an ONNX model: a second model kind."""
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "sqsinfer", "bench", "--quick", "--handler", "onnx"]
    argv += ["--scenarios", "compute-only,sqsinfer", "--out-dir", str(out)]
    argv += ["--cache-dir", str(tmp_path / "cache")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=170, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads((out / "bench-quick-onnx.json").read_text())
    assert found["settings"]["handler"] == "onnx"
    assert found["workload"]["description"].startswith("ONNX MLP, hidden layers 128 x 128")
    assert set(found["scenarios"]) == {"compute-only", "sqsinfer"}
    for name, result in found["scenarios"].items():
        assert "error" not in result, (name, result.get("error"))
        assert result["tasks"] > 0 and result["phases_ms"]["infer"] > 0, name
    assert found["ratios"]["efficiency"] is not None
    assert found["pool_startup"]["median_s"] > 0
    assert "ONNX MLP" in done.stdout


def test_quick_run_under_aws_latency_sends_every_scenario_through_one_proxy(tmp_path):
    """--latency aws: the worker's and the naive loop's calls held by the proxy, its figures
    and CPU in the report, the ratios the latency targets read, the targets themselves."""
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "sqsinfer", "bench", "--quick", "--latency", "aws"]
    argv += ["--scenarios", "compute-only,sqsinfer,naive", "--tasks", "6", "--warmup", "2"]
    argv += ["--out-dir", str(out), "--cache-dir", str(tmp_path / "cache")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=170, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads((out / "bench-quick.json").read_text())
    assert found["settings"]["latency"] == "aws"
    assert found["latency"]["profile"]["name"] == "aws"
    assert found["latency"]["profile"]["operations"]["GetObject"]["p50_ms"] > 0
    added = found["latency"]["added"]
    for name in ("ReceiveMessage", "GetObject", "PutObject", "DeleteMessage"):
        assert added[name]["calls"] > 0 and added[name]["mean_added_ms"] > 0, name
    assert added["DeleteMessageBatch"]["calls"] > 0  # the worker's: batched
    scenarios = found["scenarios"]
    for name in ("sqsinfer", "naive"):
        assert "error" not in scenarios[name], scenarios[name].get("error")
        assert scenarios[name]["tasks"] > 0 and scenarios[name]["proxy_cpu_s_per_task"] >= 0
    assert scenarios["compute-only"]["proxy_cpu_s_per_task"] == 0.0  # no calls to hold
    assert all(found["ratios"][k] is not None for k in ("vs_naive", "vs_compute_only"))
    assert found["ratios"]["vs_compute_only"] == found["ratios"]["efficiency"]
    assert "latency profile aws" in done.stdout


def test_latency_targets_replace_the_loopback_ones_only_where_they_exist():
    measured = {"vs_naive": 2.5, "vs_compute_only": 0.7, "busy_share": 0.95}
    under_aws = report.targets("medium", measured, None, None, latency="aws")
    assert {k: v["met"] for k, v in under_aws.items()} == {
        "vs_naive": True,
        "vs_compute_only": False,
    }
    assert "busy_share" in report.targets("medium", measured, None, None, latency="loopback")
    assert report.targets("quick", measured, None, None, latency="aws") == report.targets(
        "quick", measured, None, None
    )


def test_quick_run_of_the_traced_worker_reports_what_tracing_costs(tmp_path):
    """The worker traced, every span exported to the bench's receiver, side by side with
    the untraced worker in one window: the difference of the worker process's CPU per
    task is reported; the micro-benchmark exported every span of every task."""
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "sqsinfer", "bench", "--quick", "--out-dir", str(out)]
    argv += ["--scenarios", "sqsinfer,sqsinfer-traced", "--cache-dir", str(tmp_path / "cache")]
    env = {k: v for k, v in os.environ.items() if k != "OTEL_SDK_DISABLED"}
    refused = subprocess.run(
        [*argv, "--side-by-side"], capture_output=True, text=True, check=False, env=env
    )
    assert refused.returncode == 2 and "--side-by-side needs --rate" in refused.stderr
    argv += ["--side-by-side", "--rate", "20"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=170, check=False, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "quick / sqsinfer + sqsinfer-traced" in done.stderr  # one group, one window
    found = json.loads((out / "bench-quick.json").read_text())
    assert found["settings"]["side_by_side"] is True
    traced = found["scenarios"]["sqsinfer-traced"]
    assert "error" not in traced and traced["tasks"] > 0
    assert found["scenarios"]["sqsinfer"]["tasks"] > 0
    assert isinstance(found["ratios"]["traced_window_slowdown"], float)
    assert traced["traces_exported"]["requests"] > 0 and traced["traces_exported"]["bytes"] > 0
    assert "traces_exported" not in found["scenarios"]["sqsinfer"]  # untraced, not exported
    assert isinstance(found["ratios"]["tracing_cpu_ms_per_task"], float)
    hooks = found["tracing_hooks"]
    assert hooks["flushed"] and hooks["exported_bytes_per_task"] > 0
    # A task, its GET, wait, compute, PUT and delete; a receive and a delete call per five.
    assert hooks["exported_spans_per_task"] == 6.4
    assert hooks["traced_cpu_ms_per_task"] > hooks["off_cpu_ms_per_task"] > 0
    assert 0 < hooks["calls_cpu_ms_per_task"] < hooks["traced_cpu_ms_per_task"]
    assert "tracing (every task" in done.stdout and "tracing alone" in done.stdout
    assert "(the calls " in done.stdout


def test_chained_run_carries_every_task_through_both_stages_and_counts_each_stages_calls(
    tmp_path,
):
    """Stage 1 alone, then stage 1 handing each output to stage 2 over a standard queue,
    then over a FIFO one: every task reaches stage 2's output, each stage's calls are
    counted where the stand-in served them, and the chain's markers are counted apart
    (stage 1's, on a standard next queue only)."""
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "sqsinfer", "bench", "--regime", "chained", "--repeat", "1"]
    argv += ["--tasks", "10", "--warmup", "4", "--processes", "1"]
    argv += ["--out-dir", str(out), "--cache-dir", str(tmp_path / "cache")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads((out / "bench-chained.json").read_text())

    assert found["regime"] == "chained"
    assert found["settings"]["next_queues"] == ["standard", "fifo"]
    assert set(found["variants"]) == {"unchained", "standard", "fifo"}
    runs = {name: v["runs"][0] for name, v in found["variants"].items()}
    for name, run in runs.items():
        assert "error" not in run, (name, run.get("error"))
    chain = runs["standard"]
    # Every task, the warm-up's included, has its output in each stage and one marker.
    assert chain["bucket_after"] == {"stage1_outputs": 14, "markers": 14, "stage2_outputs": 14}
    assert runs["unchained"]["bucket_after"] == {
        "stage1_outputs": 14,
        "markers": 0,
        "stage2_outputs": 0,
    }
    assert chain["tasks"] == 10 and chain["tasks_per_s"] > 0
    for name, figures in chain["stages"].items():
        assert figures["sqs_calls_per_task"] > 0 and figures["s3_calls_per_task"] > 0, name
        assert figures["calls_per_task"]["s3 GetObject .npy"] >= 1.0, name  # its input
        assert figures["calls_per_task"]["s3 PutObject .npy"] >= 1.0, name  # its output
        assert figures["cpu_ms_per_task"] > 0 and figures["usd_per_million_tasks"] > 0, name
    first, second = chain["stages"]["stage1"], chain["stages"]["stage2"]
    assert first["calls_per_task"]["s3 PutObject .chain"] >= 1.0  # the markers, counted
    assert first["marker_calls_per_task"] > 0 and second["marker_calls_per_task"] == 0
    assert first["calls_per_task"]["sqs SendMessageBatch standard"] > 0  # the hand-on
    assert "sqs ReceiveMessage standard" in second["calls_per_task"]
    assert runs["unchained"]["stages"]["stage1"]["marker_calls_per_task"] == 0
    assert set(runs["unchained"]["stages"]) == {"stage1"}
    assert found["chain_costs"]["standard"]["s3_calls_per_task"]["median"] > 0
    # A FIFO next queue drops a second send itself: no marker, the send to the FIFO queue.
    fifo = runs["fifo"]
    assert fifo["bucket_after"] == {"stage1_outputs": 14, "markers": 0, "stage2_outputs": 14}
    first, second = fifo["stages"]["stage1"], fifo["stages"]["stage2"]
    assert first["marker_calls_per_task"] == 0 and first["calls_per_task"]["s3 PutObject .npy"] >= 1
    assert first["calls_per_task"]["sqs SendMessageBatch fifo"] > 0
    assert "sqs ReceiveMessage fifo" in second["calls_per_task"]
    assert second["calls_per_task"]["s3 GetObject .npy"] >= 1.0
    assert "tasks/s end to end" in done.stdout and "s3 PutObject .chain" in done.stdout


def test_the_price_of_a_chained_tasks_calls():
    """AWS's prices, us-east-1: a PUT $5 and a HEAD or GET $0.40 a million; SQS $0.40
    a million chunks of 64 KiB (FIFO $0.50); a delete costs nothing."""
    from sqsinfer.bench import chained
    from sqsinfer.lab.counting import Counted, Kind

    def kind(service: str, operation: str, target: str) -> Kind:
        return Kind(1, service, operation, target)

    calls = {
        kind("s3", "PutObject", ".npy"): Counted(100, 100),
        kind("s3", "PutObject", ".chain"): Counted(200, 200),
        kind("s3", "HeadObject", ".chain"): Counted(100, 100),
        kind("s3", "DeleteObject", ".npy"): Counted(100, 100),
        kind("sqs", "SendMessageBatch", "fifo"): Counted(10, 20),
        kind("sqs", "ReceiveMessage", "standard"): Counted(10, 10),
    }
    found = chained.calls_per_task(calls, tasks=100)
    usd = found["usd_per_million_tasks_by_call"]
    assert usd["s3 PutObject .npy"] == pytest.approx(5.0)
    assert usd["s3 PutObject .chain"] == pytest.approx(10.0)
    assert usd["s3 HeadObject .chain"] == pytest.approx(0.4)
    assert usd["s3 DeleteObject .npy"] == 0
    assert usd["sqs SendMessageBatch fifo"] == pytest.approx(0.1)  # 0.2 chunks a task
    assert usd["sqs ReceiveMessage standard"] == pytest.approx(0.04)
    assert found["marker_calls_per_task"] == 3.0 and found["s3_calls_per_task"] == 5.0
    assert found["sqs_calls_per_task"] == 0.2


@pytest.mark.parametrize(
    ("handler", "asked", "error"),
    [
        ("xgboost", "", None),
        ("onnx", "", None),
        ("onnx", "compute-only,naive", "naive run(s) XGBoost itself, not --handler onnx"),
        ("xgboost", "bogus", "unknown scenario(s) bogus"),
    ],
)
def test_the_onnx_handler_runs_the_scenarios_that_use_the_workers_handler(handler, asked, error):
    from sqsinfer.bench import command

    args = argparse.Namespace(handler=handler, scenarios=asked)
    if error is not None:
        with pytest.raises(SystemExit, match=re.escape(error)):
            command._scenarios(args)
        return
    names = {s.name for s in command._scenarios(args)}
    assert names == (
        SCENARIOS if handler == "xgboost" else {"compute-only", "sqsinfer", "emulator-ceiling"}
    )


def test_the_onnx_model_is_the_mlp_it_describes(tmp_path):
    """MatMul, Add and Relu layers of the regime's widths: ONNX Runtime's predictions are
    a forward pass through its own weights."""
    import onnx
    from onnx import numpy_helper

    from sqsinfer.compute.handlers.onnx_impl import OnnxHandler

    regime = dataclasses.replace(workload.REGIMES["quick"], features=6, mlp_hidden=(5, 4))
    described, path = workload.for_handler(regime, "onnx", seed=3, cache_dir=str(tmp_path))
    assert workload.onnx_model_path(regime, 3, str(tmp_path)) == path  # cached
    assert "hidden layers 5 x 4" in described.description
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}
    assert [weights[f"W{i}"].shape for i in range(3)] == [(6, 5), (5, 4), (4, 1)]
    rows = np.random.default_rng(0).standard_normal((7, 6)).astype(np.float32)
    expected = rows
    for i in range(3):
        expected = expected @ weights[f"W{i}"] + weights[f"B{i}"]
        expected = np.maximum(expected, 0) if i < 2 else expected
    handler = OnnxHandler()
    handler.load(path, 1)
    np.testing.assert_allclose(handler.predict(rows), expected, rtol=1e-5, atol=1e-5)


def test_small_run_puts_coalesced_tasks_beside_tasks_scored_alone(tmp_path):
    """Each row count: the pool with coalescing on and off, then the worker with it on
    (sqsinfer) and off (sqsinfer-alone); the ratios taken within the run, the target."""
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "sqsinfer", "bench", "--regime", "small", "--quick"]
    # 60 tasks with 8 in flight: at least 52 computed inside the window, 50 ms of the
    # processes' CPU or more, well above the 10 ms a clock tick counts. (10 tasks gave a
    # tick or none; at auto's 32 for small messages all could be computed before it.)
    argv += ["--tasks", "60", "--warmup", "4", "--max-window-s", "10", "--processes", "1"]
    argv += ["--prefetch", "8"]
    argv += ["--out-dir", str(out), "--cache-dir", str(tmp_path / "cache")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads((out / "bench-small.json").read_text())

    assert found["regime"] == "small"
    assert set(found["rows"]) == {"10", "100"}
    for rows, at in found["rows"].items():
        pool = at["pool"]
        assert pool["coalesced"]["tasks_per_s"]["median"] > 0, rows
        assert pool["alone"]["tasks_per_s"]["median"] > 0, rows
        # Eight tasks in flight for one process: while it computes, the others wait and
        # go to it together; alone, one task a call.
        assert pool["coalesced"]["tasks_per_call"]["median"] > 1, rows
        assert pool["alone"]["tasks_per_call"]["median"] == 1, rows
        workers = at["workers"]
        for name in ("sqsinfer", "sqsinfer-alone"):
            assert "error" not in workers[name], (rows, name, workers[name].get("error"))
            assert workers[name]["tasks"] > 0, (rows, name)
            assert workers[name]["processes_cpu_ms_per_task"] > 0, (rows, name)
        assert workers["sqsinfer-alone"]["tasks_per_predict_call"] == 1, rows
        assert at["ratios"]["pool_tasks_per_s"]["median"] > 0, rows
        assert at["ratios"]["worker_tasks_per_s"]["median"] > 0, rows
    target = found["targets"]["pool_ratio_at_100_rows"]
    assert target["target"] == ">= 4.0" and target["measured"] > 0
    assert found["paired_runs"] == 1 and len(found["runs"]) == 1
    assert "coalesced ÷ alone" in done.stdout


def test_regime_names_on_the_command_line_match_the_workloads():
    assert set(bench.REGIME_NAMES) == set(workload.REGIMES)


def test_a_large_model_is_built_by_repeating_trained_trees(tmp_path):
    import xgboost

    small = dataclasses.replace(
        workload.REGIMES["quick"], name="t", trees=12, trained_trees=3, depth=3
    )
    path = workload.model_path(small, seed=1, cache_dir=str(tmp_path))
    assert workload.model_path(small, seed=1, cache_dir=str(tmp_path)) == path  # cached
    booster = xgboost.Booster()
    booster.load_model(path)
    assert booster.num_boosted_rounds() == 12
    rows = np.random.default_rng(0).standard_normal((5, small.features)).astype(np.float32)
    assert booster.inplace_predict(rows).shape == (5,)


def test_inputs_are_deterministic_from_the_seed():
    regime = dataclasses.replace(workload.REGIMES["quick"], rows=3, distinct_inputs=2)
    assert workload.input_bytes(regime, 5) == workload.input_bytes(regime, 5)
    assert workload.input_bytes(regime, 5) != workload.input_bytes(regime, 6)


def test_the_feeder_never_lets_more_than_a_hundred_messages_wait():
    sent: list[int] = []

    class Sqs:
        def send_message_batch(self, QueueUrl: str, Entries: list[dict[str, str]]) -> dict:
            sent.append(len(Entries))
            return {"Successful": Entries}

    feeder = feeding.Feeder(Sqs(), "q", feeding.cycling("t", ["s3://b/in/0.npy"]))
    backlog = feeding.Backlog(feeder, depth=500, in_flight=4)
    backlog.top_up(0)
    assert feeder.sent <= feeding.MAX_VISIBLE
    before = feeder.sent
    backlog.top_up(30)  # 30 finished: room for 30 more, in whole batches
    assert feeder.sent == before + 30
    assert json.loads(feeder.body(7))["task_id"] == "t-000007"


def test_a_feeder_at_a_rate_sends_no_more_than_the_rate_allows(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(feeding.time, "monotonic", lambda: clock[0])

    class Sqs:
        def send_message_batch(self, QueueUrl: str, Entries: list[dict[str, str]]) -> dict:
            return {"Successful": Entries}

    feeder = feeding.Feeder(Sqs(), "q", feeding.cycling("t", ["s3://b/in/0.npy"]))
    backlog = feeding.Backlog(feeder, depth=90, in_flight=10, per_s=20.0)
    backlog.top_up(0)
    assert feeder.sent == 10  # one batch at the start, though the backlog has room for 90
    clock[0] += 0.4
    backlog.top_up(10)
    assert feeder.sent == 10  # 8 more due: not a whole batch yet
    clock[0] += 1.6
    backlog.top_up(10)
    assert feeder.sent == 50  # 40 due in 2 s, plus the first batch
    clock[0] += 100
    backlog.top_up(10)
    assert feeder.sent - 10 == 100  # the backlog's own bound still holds: 100 unfinished


def test_phase_means_and_the_unaccounted_rest():
    records = [
        {"seconds": 0.010, "phases": {"receive": 0.5, "s3_get": 0.002, "infer": 0.006}},
        {"seconds": 0.020, "phases": {"receive": 0.5, "s3_get": 0.004, "infer": 0.012}},
    ]
    means = runner.phase_means_ms(records)
    assert means["s3_get"] == pytest.approx(3.0)
    assert means["infer"] == pytest.approx(9.0)
    assert means["other"] == pytest.approx(3.0)  # receive happens before `seconds` starts
    assert means["delete"] is None


def test_percentiles_and_prometheus_samples():
    assert probe.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert probe.percentile([], 0.5) is None
    text = '# HELP x\nsqsinfer_phase_seconds_sum{phase="receive"} 1.5\nup 1\n'
    assert probe.prometheus_samples(text) == {
        'sqsinfer_phase_seconds_sum{phase="receive"}': 1.5,
        "up": 1.0,
    }


def test_tree_probe_sees_a_child_process_cpu():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        tree = probe.TreeProbe(os.getpid())
        assert child.pid in tree.cpu()
        tree.record_peaks()
        assert tree.peak_rss_mb()["parent"] > 0
    finally:
        child.kill()
        child.wait()


def test_ratios_and_targets_from_scenario_results():
    scenarios = {
        "compute-only": {"tasks_per_s": 40.0, "cpu_s_per_task": 0.050},
        "sqsinfer": {
            "tasks_per_s": 38.0,
            "cpu_s_per_task": 0.051,
            "cpu_s_per_task_outside_spawned": 0.001,
        },
        "http-service": {"tasks_per_s": 10.0},
        "naive": {"tasks_per_s": 32.0},
    }
    found = report.ratios(scenarios)
    assert found["efficiency"] == pytest.approx(0.95)
    assert found["vs_http_service"] == pytest.approx(3.8)
    assert found["vs_naive"] == pytest.approx(1.188)
    assert found["tree_minus_compute_only_cpu_ms_per_task"] == pytest.approx(1.0)
    assert found["vs_emulator_ceiling"] is None
    handoff = {"methods": {"shared_memory": {"cpu_ms_per_task": {"child": 0.2}}}}
    report.with_overhead(found, handoff)
    assert found["overhead_cpu_ms_per_task"] == pytest.approx(1.2)  # process 1.0 + child 0.2
    checks = report.targets("medium", found, None, {"processes": 2, "median_s": 0.5})
    assert checks["vs_http_service"]["met"] is True
    assert checks["vs_naive"]["met"] is False  # 1.19 < 1.25
    assert checks["worker_process_cpu_ms_per_task"]["met"] is True  # 1.0 <= 5
    assert checks["busy_share"]["met"] is None  # not measured here
    assert checks["pool_ready_s"]["met"] is True
    assert "tracing_cpu_share" not in checks  # its scenario did not run


def test_tracing_cost_is_the_traced_workers_process_cpu_beyond_the_untraced_one():
    """What tracing costs, and its share of a task's CPU (the untraced worker's whole tree
    per task, pool included): the target is at most 1 %."""
    ours = {"tasks_per_s": 38.0, "cpu_s_per_task": 0.025, "cpu_s_per_task_outside_spawned": 0.0012}
    traced = {"tasks_per_s": 37.0, "cpu_s_per_task_outside_spawned": 0.0014}
    found = report.ratios({"sqsinfer": ours, "sqsinfer-traced": traced})
    assert found["tracing_cpu_ms_per_task"] == pytest.approx(0.2)
    assert found["tracing_cpu_share"] == pytest.approx(0.008)  # 0.2 of 25 ms
    checks = report.targets("medium", found, None, None)
    assert checks["tracing_cpu_share"] == {"target": "<= 0.01", "measured": 0.008, "met": True}
    found = report.ratios({"sqsinfer": ours | {"cpu_s_per_task": 0.015}, "sqsinfer-traced": traced})
    assert report.targets("medium", found, None, None)["tracing_cpu_share"]["met"] is False


def test_tracing_cost_adjusted_for_a_slower_window_scales_the_untraced_worker_by_the_pools():
    """The pool did the same compute 20 % slower in the traced window: the untraced
    worker's 4 ms would have been 4.8 there, so tracing cost 5.0 - 4.8 = 0.2 ms."""
    scenarios = {
        "sqsinfer": {"cpu_s_per_task": 0.029, "cpu_s_per_task_outside_spawned": 0.004},
        "sqsinfer-traced": {"cpu_s_per_task": 0.035, "cpu_s_per_task_outside_spawned": 0.005},
    }
    found = report.ratios(scenarios)
    assert found["tracing_cpu_ms_per_task"] == pytest.approx(1.0)
    assert found["traced_window_slowdown"] == pytest.approx(1.2)
    assert found["tracing_cpu_ms_per_task_adjusted"] == pytest.approx(0.2)
    assert report.ratios({"sqsinfer": scenarios["sqsinfer"]})["traced_window_slowdown"] is None


def test_ratios_are_taken_within_each_run_then_their_median():
    def run(compute: float, ours: float) -> dict[str, dict[str, float]]:
        return {"compute-only": {"tasks_per_s": compute}, "sqsinfer": {"tasks_per_s": ours}}

    runs = [run(10.0, 9.0), run(20.0, 19.0), run(5.0, 1.0)]
    by_name = {n: [r[n] for r in runs] for n in ("compute-only", "sqsinfer")}
    regime = workload.REGIMES["quick"]
    built = report.build(regime, by_name, {"settings": {"processes": 2}})
    assert built["ratios"]["efficiency"] == pytest.approx(0.9)  # median of 0.9, 0.95, 0.2
    assert built["ratio_ranges"]["efficiency"] == [0.2, 0.95]
    assert built["paired_runs"] == 3
    assert len(built["ratios_per_run"]) == 3
    assert built["scenarios"]["sqsinfer"]["runs_tasks_per_s"] == [9.0, 19.0, 1.0]
    assert built["scenarios"]["sqsinfer"]["tasks_per_s"] == 9.0  # the median run


def test_busy_share_is_compute_time_over_what_the_processes_could_give():
    records = [{"phases": {"decode": 0.1, "infer": 0.3, "encode": 0.1}}] * 6
    assert runner.busy_share(records, window_s=2.0, processes=2) == pytest.approx(0.75)
    assert runner.busy_share([], window_s=2.0, processes=2) is None
