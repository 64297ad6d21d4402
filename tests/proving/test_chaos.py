"""The chaos suite, small: a two-stage chain under faults and kills loses nothing."""

from __future__ import annotations

import re
import time
from typing import Any

from proving.chaos import command, verdict, workload


def test_a_small_chaos_run_loses_nothing(capsys):
    config = workload.ChaosConfig(
        tasks=40,
        seed=5,
        duplicate_rate=0.1,
        poison_rate=0.1,
        send_drop=0.25,  # high enough that 40 tasks meet each targeted fault
        send_reset=0.25,
        reset=0.1,
        marker_failures=0.25,
        squatters=2,
        non_xml=1,
        slow_tasks=1,
        visibility_delay_calls=2,
        timeout_s=300,
    )
    figures, report = _lost_nothing(config, capsys)
    assert figures["DLQ reasons"]["output_conflict"] == 2
    assert figures["DLQ reasons"]["invalid_field"] == 4  # U+FFFF, U+FFFE, a control character
    assert figures["squatted outputs (untouched / planted)"] == "2 / 2"
    assert figures["sent messages AWS would refuse"] == 0
    assert figures["non-XML params handed on intact"] == "1 / 1"
    assert figures["lapsed while held (then computed again)"] == "0 (0)"
    assert figures["held through a stalled extension past its lapse"] >= 1
    injected = figures["faults injected"]
    assert injected["sqs:send_dropped"] > 0, injected
    assert injected["sqs:send_reset"] > 0, injected
    assert injected["sqs:reset"] > 0 and injected["s3:reset"] > 0, injected
    assert injected["s3:marker_503"] > 0, injected
    # The slow task's first extension; its receive's again if a drain handed it back.
    assert 1 <= injected["sqs:visibility_delayed"] <= 2, injected
    assert injected["s3:slow_read"] >= config.slow_tasks, injected
    assert "downstream duplicates (observed / counted)" in figures
    assert "SIGTERM stage1-a: exit 0; restarted" in report
    assert "(no drain); restarted" in report
    assert report.count("SIGKILL inference process") == config.child_kills


# What the runs after the first share: more duplicates, a little poison, one of each
# planted kind, and no slow task (the keeper under stalled calls is the first run's).
_SECOND_RUN: dict[str, Any] = {
    "duplicate_rate": 0.2,
    "poison_rate": 0.05,
    "squatters": 1,
    "non_xml": 1,
    "slow_tasks": 0,
    "visibility_delay_calls": 0,
    "timeout_s": 300,
}


def test_a_small_chaos_run_fed_by_s3_events_loses_nothing(capsys):
    """Stage 1 fed by its bucket's notifications: odd keys, overwritten inputs (one output,
    one conflict), inputs deleted at once (read at their version), refused events, events
    delivered twice and merged into bodies of several records, under the same fire."""
    config = workload.ChaosConfig(
        tasks=30,
        seed=6,
        s3_events=True,
        odd_keys=0.3,
        overwrites=0.1,
        deletes=0.1,
        multi_records=0.3,
        **_SECOND_RUN,
    )
    figures, _ = _lost_nothing(config, capsys)
    reasons = figures["DLQ reasons"]
    uploads, overwritten, deleted = _numbers(figures["S3 uploads (overwritten, deleted at once)"])
    assert uploads == config.tasks + config.event_poison and overwritten > 0 and deleted > 0
    assert reasons["output_conflict"] == overwritten + config.squatters  # one per output
    assert reasons["unsupported_format"] == 2  # refused events only: no task message has one
    _, twice, merged = _numbers(figures["event bodies relayed (sent twice, of several records)"])
    assert twice > 0 and merged > 0
    assert figures["events ignored (test, removals)"] >= 1 + deleted
    assert figures["lapsed while held (then computed again)"] == "0 (0)"


def test_a_small_chaos_run_with_a_fifo_stage_2_loses_nothing(capsys):
    """Stage 2's queues FIFO: stage 1 links with SQS's deduplication (no marker) under lost
    and reset send answers, and stage 2 consumes its groups in order, under the same fire."""
    config = workload.ChaosConfig(
        tasks=30,
        seed=7,
        fifo=True,
        groups=5,
        send_drop=0.25,
        send_reset=0.25,
        **_SECOND_RUN,
    )
    figures, _ = _lost_nothing(config, capsys)
    injected = figures["faults injected"]
    assert injected.get("sqs:send_dropped", 0) + injected.get("sqs:send_reset", 0) > 0, injected
    assert figures["downstream duplicates (observed / counted)"].startswith("0 / 0")


def test_a_fifo_send_after_stage_2_deleted_the_first_is_moto_s_gap_alone():
    """moto deduplicates only against messages still in the queue: a link sent again
    once stage 2 may have deleted the first is a second message there, never on AWS."""
    # Stage 2 took the first message at 00:00:08 and finished it at 00:00:10.
    stage2 = [_stage2_finished("a", "m1") | {"ts": "2026-01-01T00:00:10+00:00", "seconds": 2}]
    sends = [
        {"queue": "http://x/1/s2.fifo", "body": '{"task_id": "a"}', "at": at}
        # The first send; a resend 2 s before stage 2 took the message; one after it ended.
        for at in (1767225600.0, 1767225606.0, 1767225615.0)
    ]
    assert verdict.moto_dedup_gaps(sends, stage2, "s2.fifo") == {"a": 1}
    stage2.append(_stage2_finished("a", "m2") | {"ts": "2026-01-01T00:00:20+00:00", "seconds": 1})
    findings = verdict.Findings()
    verdict.check_downstream(
        [], stage2, findings, verdict.moto_dedup_gaps(sends, stage2, "s2.fifo")
    )
    assert findings.problems == []
    verdict.check_downstream([], stage2, findings)
    assert findings.problems  # without the gap, the second message is an uncounted duplicate


def _lost_nothing(config: workload.ChaosConfig, capsys: Any) -> tuple[dict[str, Any], str]:
    """Run chaos: no problem found, every valid task's outputs at both stages, each link
    sent, nothing overwritten or left behind. Its figures and its report."""
    findings = command.run(config)
    report = capsys.readouterr().out
    assert findings.problems == [], report
    figures = findings.figures
    valid = config.tasks + config.slow_tasks + config.non_xml
    assert figures["stage1 outputs"] == figures["stage2 outputs"] == valid
    assert figures["chain links (sent)"] == valid
    assert figures["objects overwritten"] == 0
    assert figures["left on queues"] == 0
    assert figures["DLQ entries without a reason"] == 0
    return figures, report


def _numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


def test_a_message_of_several_records_is_one_hold():
    lines = [
        _finished(10.0, 10.0, "committed", record=1, phases={"infer": 0.01}),
        _finished(10.0, 10.0, "ignored", record=2, phases={}),
    ]
    (hold,) = verdict.holds("a", lines)
    assert hold.computed and hold.outcome == "ignored"
    assert verdict.lapses(verdict.holds("a", lines)) == []


# -- reading holds and lapses from the logs ---------------------------------------------------

_T0 = 1_800_000_000.0


def _line(msg: str, at_s: float, **fields: Any) -> dict[str, Any]:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(_T0 + at_s))
    millis = round((_T0 + at_s) % 1 * 1000)
    return {"ts": f"{stamp}.{millis:03d}Z", "msg": msg, **fields}


def _finished(
    at_s: float, held_s: float, outcome: str, count: int = 1, **more: Any
) -> dict[str, Any]:
    return _line(
        "task finished",
        at_s,
        message_id="m",
        receive_count=count,
        outcome=outcome,
        seconds=held_s,
        phases=more.pop("phases", {"infer": 0.01}),
        **more,
    )


def test_a_message_received_again_while_held_is_a_lapse():
    a = verdict.holds("a", [_finished(10.0, 10.0, "committed")])
    b = verdict.holds("b", [_finished(12.0, 3.0, "duplicate", count=2)])  # received at 9 s
    found = verdict.lapses(a + b)
    assert [(held.worker, taken.worker) for held, taken in found] == [("a", "b")]
    assert found[0][0].received_s == _T0 and found[0][0].let_go_s == _T0 + 10.0


def test_a_message_received_again_after_it_was_let_go_is_no_lapse():
    a = verdict.holds("a", [_finished(10.0, 10.0, "committed")])
    b = verdict.holds("b", [_finished(13.0, 2.0, "duplicate", count=2)])  # received at 11 s
    assert verdict.lapses(a + b) == []


def test_a_hand_back_ends_the_hold_when_asked_for_not_when_its_call_returns():
    # The retry delay's visibility call stalled for 12 s: the message lapsed meanwhile and
    # another worker took it, after the first had given it up.
    retried = [
        _line("task failed, will retry", 1.0, message_id="m", receive_count=1),
        _finished(13.0, 13.0, "retried"),
    ]
    taken = verdict.holds("b", [_finished(10.0, 1.0, "committed", count=2)])  # at 9 s
    assert verdict.lapses(verdict.holds("a", retried) + taken) == []
    # Without the `task failed` line, the same two deliveries overlap.
    assert len(verdict.lapses(verdict.holds("a", retried[1:]) + taken)) == 1


def test_a_released_message_was_let_go_when_the_drain_began():
    lines = [_line("draining", 2.0), _finished(2.5, 2.5, "released", phases={})]
    (hold,) = verdict.holds("a", lines)
    assert hold.let_go_s == _T0 + 2.0 and not hold.computed


def test_a_hold_outlives_a_stalled_extension_when_it_lasts_past_the_lapse():
    holds = verdict.holds("a", [_finished(20.0, 20.0, "committed")])
    assert verdict.outlived_stalls([(_T0 + 5.0, ["m"])], holds, 8) == holds
    assert verdict.outlived_stalls([(_T0 + 13.0, ["m"])], holds, 8) == []  # let go before
    assert verdict.outlived_stalls([(_T0 + 5.0, ["other"])], holds, 8) == []


def _stage2_finished(task_id: str, message_id: str) -> dict[str, Any]:
    return {"msg": "task finished", "task_id": task_id, "message_id": message_id}


def _counted(task_id: str, kind: str) -> dict[str, Any]:
    return {"msg": "chain duplicate", "task_id": task_id, "kind": kind}


def _downstream_problems(stage1: list[dict[str, Any]], stage2: list[dict[str, Any]]) -> list[str]:
    findings = verdict.Findings()
    verdict.check_downstream(stage1, stage2, findings)
    return findings.problems


def test_the_downstream_check_holds_each_task_between_its_certain_and_its_possible():
    twice = [_stage2_finished("a", "m1"), _stage2_finished("a", "m2"), _stage2_finished("b", "m3")]
    # A possible duplicate that happened, one that did not, and a certain one seen: all hold.
    assert _downstream_problems([_counted("a", "possible"), _counted("b", "possible")], twice) == []
    assert _downstream_problems([_counted("a", "certain"), _counted("a", "possible")], twice) == []
    # Seen but never counted.
    [problem, per_task] = _downstream_problems([], twice)
    assert "1 downstream duplicates observed, only 0 counted" in problem
    assert "{'a': (1, 0)}" in per_task
    # Counted certain for one task, seen on another: the totals agree, the tasks do not.
    wrong_task = [_counted("b", "certain"), _counted("a", "possible")]
    assert _downstream_problems(wrong_task, twice) == [
        "tasks with fewer duplicates than counted certain (seen, certain): {'b': (0, 1)}"
    ]
