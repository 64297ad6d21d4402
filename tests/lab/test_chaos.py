"""The chaos suite, small: a two-stage chain under faults and kills loses nothing."""

from __future__ import annotations

from sqsinfer.lab import chaos


def test_a_small_chaos_run_loses_nothing(capsys):
    config = chaos.ChaosConfig(tasks=40, seed=5, duplicate_rate=0.1, poison_rate=0.1, timeout_s=300)
    findings = chaos.run(config)
    report = capsys.readouterr().out
    assert findings.problems == [], report
    figures = findings.figures
    assert figures["stage1 outputs"] == figures["stage2 outputs"] == 40
    assert figures["chain links"] == 40
    assert figures["objects overwritten"] == 0
    assert figures["left on queues"] == 0
    assert figures["downstream duplicate messages"] == 0
    assert sum(figures["faults injected"].values()) > 0
    assert "SIGTERM stage1-a: exit 0; restarted" in report
    assert "(no drain); restarted" in report
    assert report.count("SIGKILL inference process") == config.child_kills
