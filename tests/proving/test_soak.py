"""`python -m proving.soak`, short: the real worker under steady load and process kills loses
nothing and holds its resources; a worker that leaks fails it."""

from __future__ import annotations

import json
import subprocess
import sys

import proving
from proving import soak

RESOURCES = ("parent_rss_mib", "children_rss_mib", "fds", "shm_entries")


def _verdicts(report: dict) -> dict[str, bool]:
    return {v["key"]: v["ok"] for v in report["bounds"]}


def test_a_short_soak_loses_nothing_and_holds_its_resources(tmp_path):
    path = tmp_path / "soak.json"
    argv = [sys.executable, "-m", "proving.soak", "--seconds", "20", "--kill-every-s", "5"]
    argv += ["--sample-s", "1", "--report", str(path)]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=170, check=False, env=proving.module_env()
    )
    said = done.stdout[-4000:] + done.stderr[-4000:]
    assert path.exists(), said
    report = json.loads(path.read_text())
    assert done.returncode == (0 if report["passed"] else 1), said
    tasks = report["tasks"]
    assert tasks["sent"] > 0 and tasks["outputs"] == tasks["sent"], said
    assert (tasks["lost"], tasks["left_on_queue"], tasks["dead_letters"]) == (0, 0, 0), said
    assert tasks["worker_exit"] == 0, said
    assert report["kills"] >= 3, said
    assert len(report["samples"]) >= 10, said
    verdicts = _verdicts(report)
    # Speed and latency are judged too, but a test does not assert timings.
    assert all(verdicts[key] for key in RESOURCES), said
    assert "first fifth against last fifth" in done.stdout
    assert f"report written to {path}" in done.stdout


def test_a_leaking_worker_fails_the_soak():
    config = soak.SoakConfig(
        seconds=15, kill_every_s=4, sample_s=1, handler="tests.proving.leaky:LeakingHandler"
    )
    report = soak.run(config)
    verdicts = _verdicts(report)
    assert not report["passed"]
    assert not verdicts["children_rss_mib"], report["bounds"]
    assert not verdicts["fds"], report["bounds"]
    assert verdicts["parent_rss_mib"] and verdicts["shm_entries"]
    assert report["tasks"]["lost"] == 0
    assert soak.verdict_line(report).startswith("SOAK FAILED: children RSS (MiB) drifted")


def test_a_bound_with_two_limits_fails_only_beyond_both():
    rss = soak.Bound("rss", "RSS", "MiB", relative=0.25, absolute=50)
    assert rss.passed(100, 140)  # +40 %, but +40 MiB
    assert rss.passed(400, 440)  # +40 MiB, but +10 %
    assert not rss.passed(100, 160)
    assert rss.text() == "+25% and +50 MiB"
    fall = soak.Bound("rate", "tasks/s", relative=-0.20)
    assert fall.passed(5.0, 4.1)
    assert not fall.passed(5.0, 3.9)
    assert soak.judge([])[0]["ok"] is False  # no samples: nothing was shown to hold
