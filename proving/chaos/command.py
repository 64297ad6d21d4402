"""`python -m proving.chaos`: the options, the run from preparation to verdict, the report."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence

from proving.chaos import events as s3_events
from proving.chaos.disrupt import (
    PROXY_LOG,
    SENDS,
    Chaos,
    Events,
    Feeding,
    run_until_drained,
    start_proxy,
)
from proving.chaos.verdict import (
    Findings,
    check_events,
    check_logs,
    check_outputs,
    check_queues,
    check_sends,
    check_visibility,
    json_lines,
    proxy_counts,
    resets_by_queue,
)
from proving.chaos.workload import (
    FEATURES,
    ChaosConfig,
    add_event_poison,
    add_non_xml,
    add_squatters,
    prepare,
    queue_name,
    start_feeding,
)
from sqsinfer.lab import stage, standin, synthetic


def print_report(findings: Findings, events: Events, elapsed_s: float) -> None:
    print("\nchaos run")
    for text in events.log:
        print("  " + text)
    print()
    width = max(len(k) for k in findings.figures) + 2
    for key, value in findings.figures.items():
        print(f"  {key:<{width}}{value}")
    print(f"  {'elapsed':<{width}}{elapsed_s:.1f} s")
    if findings.problems:
        print("\nLOSS OR CORRUPTION FOUND:")
        for problem in findings.problems:
            print("  - " + problem)
    else:
        print("\nno work lost, none done twice where it counts, nothing overwritten")


def run(config: ChaosConfig) -> Findings:
    standin.use_fake_credentials()
    with tempfile.TemporaryDirectory() as workdir, standin.moto_server() as moto:
        print(f"preparing {config.tasks} tasks on {moto.url} ...", flush=True)
        work, queues = prepare(moto.url, config)
        add_squatters(moto.url, config, work)
        add_non_xml(moto.url, config, work)
        add_event_poison(config, work)
        models = {
            # Big enough that predictions take milliseconds: kills can land inside one.
            "stage1": synthetic.train_model(
                os.path.join(workdir, "m1.ubj"), FEATURES, trees=150, depth=6, seed=3
            ),
            "stage2": synthetic.train_model(os.path.join(workdir, "m2.ubj"), 1, trees=5, seed=4),
        }
        proxy, proxy_url = start_proxy(moto.url, config, workdir, queues)
        chaos = Chaos(config, workdir)
        tally = s3_events.Tally()
        started = time.monotonic()
        try:
            chaos.start_workers(queues, proxy_url, models)
            stage.wait_ready(chaos.workers)
            feeds: list[Feeding] = [
                start_feeding(moto.url, queues["stage1"], work.bodies, config.feed_depth)
            ]
            if config.s3_events:
                feeds += s3_events.start(moto.url, work, config, queues, tally)
            drained = run_until_drained(chaos, feeds, moto.url, queues, len(work.valid))
            elapsed = time.monotonic() - started
            # A worker restarted near the end may still be importing, when a SIGTERM
            # kills it outright: the exit codes checked below are those of a drain.
            stage.wait_ready(chaos.workers)
            for worker in chaos.workers:
                chaos.count_extensions(worker)
        finally:
            codes = stage.stop_workers(chaos.workers)
            proxy.send_signal(signal.SIGTERM)
            proxy.wait(timeout=30)
        findings = Findings(
            figures={"valid tasks": len(work.valid), "worker processes": len(chaos.workers)}
        )
        findings.expect(drained, f"queues did not drain within {config.timeout_s} s")
        findings.expect(not any(codes), f"workers exited with {codes} at the end")
        findings.expect(events_ok(chaos.events, config), "not all chaos events happened")
        proxy_lines = json_lines(os.path.join(workdir, PROXY_LOG))
        check_outputs(moto.url, work, models, findings, fifo=config.fifo)
        check_queues(moto.url, work, queues, resets_by_queue(proxy_lines), findings)
        worker_lines = {w.name: w.log_records() for w in chaos.workers}
        sends = json_lines(os.path.join(workdir, SENDS))
        fifo_sends = (sends, queue_name(queues["stage2"])) if config.fifo else None
        check_logs(worker_lines, work, findings, fifo_sends)
        check_sends(moto.url, sends, work, queues, findings)
        check_visibility(worker_lines, proxy_lines, chaos, findings)
        findings.figures["faults injected"] = proxy_counts(proxy_lines)
        if config.s3_events:
            findings.figures |= tally.figures()
            check_events(worker_lines, tally, findings)
        print_report(findings, chaos.events, elapsed)
        if config.logs_dir:
            shutil.copytree(
                workdir, config.logs_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.ubj")
            )
            print(f"logs kept in {config.logs_dir}")
        return findings


def events_ok(events: Events, config: ChaosConfig) -> bool:
    return (
        events.child_kills >= config.child_kills
        and events.sigterm_exit == 0
        and events.sigkills == 1
    )


# The options of `python -m proving.chaos`: ChaosConfig's fields, each with what it sets.
OPTION_HELP = {
    "tasks": "valid tasks fed to stage 1",
    "workers_per_stage": "worker processes per stage",
    "seed": "seed of the inputs, the faults and the kills",
    "rows": "rows per input (a few ms of compute, so kills land mid-task)",
    "child_kills": "inference processes SIGKILLed while computing",
    "feed_depth": "messages the feeder keeps waiting on stage 1",
    "squatters": "tasks whose output another producer created first",
    "non_xml": "sets of messages with characters SQS refuses",
    "slow_tasks": "tasks whose input read is held for three visibility timeouts",
    "visibility_delay_calls": "extension calls of the slow tasks held back, at most",
    "s3_5xx": "S3 requests answered 500 or 503 (rate)",
    "s3_conflict": "conditional puts answered 409 (rate)",
    "sqs_errors": "SQS requests answered 500 or throttled (rate)",
    "latency_ms": "latency added to each request, up to (ms)",
    "drop": "answers cut off after the service acted (rate)",
    "reset": "sends, puts and deletes reset (RST) after the service acted (rate)",
    "send_drop": "next-stage send answers lost after SQS took the message (rate)",
    "send_reset": "next-stage sends reset (RST) after SQS took the message (rate)",
    "marker_failures": "chain markers whose records meet a burst of 503s (rate)",
    "poison_rate": "bad messages among the tasks (rate)",
    "duplicate_rate": "tasks sent twice (rate)",
    "visibility_delay_s": "how long a held-back extension call waits (s)",
    "visibility_delay_rate": "extension calls held back, while any are left (rate)",
    "timeout_s": "give up after (s)",
    "s3_events": "feed stage 1 from its bucket's S3 event notifications, with their faults",
    "odd_keys": "with --s3-events: keys with spaces, +, = and letters beyond ASCII (rate)",
    "overwrites": "with --s3-events: inputs written twice, two events for one output (rate)",
    "deletes": "with --s3-events: inputs deleted as soon as written (rate)",
    "event_poison": "with --s3-events: objects whose events are refused",
    "multi_records": "with --s3-events: events merged into bodies of several records (rate)",
    "fifo": "stage 2's queues FIFO: links deduplicated by SQS, stage 2 keeps each group's order",
    "groups": "with --fifo: the message groups the tasks are spread over",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m proving.chaos",
        description="Run a two-stage chain under faults and kills, then check that nothing "
        "was lost.",
        epilog="example:\n  python -m proving.chaos --tasks 2000\n"
        "  python -m proving.chaos --tasks 100 --s3-5xx 0.2\n"
        "  python -m proving.chaos --tasks 2000 --s3-events",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = ChaosConfig()
    for name, text in OPTION_HELP.items():
        default = getattr(defaults, name)
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", help=text)
            continue
        p.add_argument(flag, type=type(default), default=default, help=f"{text} ({default:g})")
    p.add_argument("--logs-dir", default="", help="keep every worker's JSON log here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not standin.has_local_extra("python -m proving.chaos"):
        return 2
    names = ChaosConfig.__dataclass_fields__
    config = ChaosConfig(**{k: v for k, v in vars(args).items() if k in names})
    return 1 if run(config).problems else 0


if __name__ == "__main__":
    sys.exit(main())
