"""The ledger run, small: a three-stage chain under faults and kills, accounted for by
`sqsinfer audit`, which then names exactly what was done to it."""

from __future__ import annotations

from proving.ledger import command
from proving.ledger.chain import LedgerConfig


def test_a_small_ledger_run_balances_and_names_every_tampering(capsys):
    config = LedgerConfig(
        tasks=24,
        seed=3,
        duplicate_rate=0.2,
        send_drop=0.1,  # high enough that 24 tasks meet each fault
        drop=0.03,
        reset=0.03,
        send_reset=0.1,
        s3_conflict=0.1,  # of about 100 conditional puts, at 0.02 none met a 409 in one run of 8
        child_kills=1,
        worker_kills=1,
        visibility_timeout_s=6,
        feed_depth=40,
        timeout_s=300,
    )
    findings = command.run(config)
    report = capsys.readouterr().out
    assert findings.problems == [], report
    figures = findings.figures
    assert figures["audit: tasks, stages"] == "24, 3"
    assert figures["audit: missing / written twice"] == "0 / 0"
    assert figures["tampered: named / done"] == "6 / 6"
    assert figures["audit killed at, then again"].endswith("the same report: True")
    assert figures["kills (inference processes / workers)"] == "1 / 1"
    injected = figures["faults injected"]
    assert injected["s3:409"] > 0, injected
    # Next-stage sends whose answer was lost or reset; puts, sends and deletes reset.
    assert injected.get("sqs:send_dropped", 0) + injected.get("sqs:send_reset", 0) > 0, injected
    assert injected.get("s3:reset", 0) + injected.get("sqs:reset", 0) > 0, injected
