"""The chaos suite, small: a two-stage chain under faults and kills loses nothing."""

from __future__ import annotations

from sqsinfer.lab import chaos


def test_a_small_chaos_run_loses_nothing(capsys):
    config = chaos.ChaosConfig(
        tasks=40,
        seed=5,
        duplicate_rate=0.1,
        poison_rate=0.1,
        send_drop=0.25,  # high enough that 40 tasks meet each targeted fault
        marker_failures=0.25,
        squatters=2,
        timeout_s=300,
    )
    findings = chaos.run(config)
    report = capsys.readouterr().out
    assert findings.problems == [], report
    figures = findings.figures
    assert figures["stage1 outputs"] == figures["stage2 outputs"] == 40
    assert figures["chain links (sent)"] == 40
    assert figures["objects overwritten"] == 0
    assert figures["left on queues"] == 0
    assert figures["DLQ entries without a reason"] == 0
    assert figures["DLQ reasons"]["output_conflict"] == 2
    assert figures["squatted outputs (untouched / planted)"] == "2 / 2"
    injected = figures["faults injected"]
    assert injected["sqs:send_dropped"] > 0, injected
    assert injected["s3:marker_503"] > 0, injected
    assert "downstream duplicates (observed / counted)" in figures
    assert "SIGTERM stage1-a: exit 0; restarted" in report
    assert "(no drain); restarted" in report
    assert report.count("SIGKILL inference process") == config.child_kills
