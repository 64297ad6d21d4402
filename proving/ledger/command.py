"""`python -m proving.ledger`: the options, the run from preparation to the books, the report."""

from __future__ import annotations

import argparse
import contextlib
import random
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence

from proving.chaos.verdict import Findings, json_lines, proxy_counts
from proving.ledger import books
from proving.ledger.chain import (
    Chain,
    Fire,
    LedgerConfig,
    prepare,
    run_until_drained,
    start_feeding,
    start_proxy,
)
from sqsinfer.lab import stage, standin


@contextlib.contextmanager
def stand_in(which: str) -> Iterator[str]:
    """The stand-in's URL: a moto server, or LocalStack (`make test-localstack` installs it)."""
    standin.use_fake_credentials()
    if which == "localstack":
        from proving import localstack

        with localstack.localstack_server() as server:
            yield server.url
        return
    with standin.moto_server() as moto:
        yield moto.url


def run(config: LedgerConfig) -> Findings:
    with tempfile.TemporaryDirectory() as workdir, stand_in(config.stand_in) as url:
        print(f"preparing {config.tasks} tasks, three stages, on {url} ...", flush=True)
        chain = prepare(url, config, workdir)
        proxy, proxy_url = start_proxy(url, config, workdir)
        fire = Fire(config, workdir)
        started = time.monotonic()
        try:
            fire.start_stages(chain, proxy_url)
            stage.wait_ready(fire.workers)
            feed = start_feeding(chain, config.feed_depth)
            drained = run_until_drained(fire, chain, feed)
            elapsed = time.monotonic() - started
            stage.wait_ready(fire.workers)
        finally:
            codes = stage.stop_workers(fire.workers)
            proxy.send_signal(signal.SIGTERM)
            proxy.wait(timeout=30)
        findings = Findings(figures={"tasks": config.tasks, "stand-in": config.stand_in})
        findings.expect(drained, f"the chain did not drain within {config.timeout_s} s")
        findings.expect(not any(codes), f"workers exited with {codes} at the end")
        findings.figures["chain: time (tasks/s)"] = (
            f"{elapsed:.0f} s ({config.tasks / elapsed:.1f}/s)"
        )
        findings.figures["deliveries sent (duplicates)"] = (
            f"{len(chain.bodies)} ({len(chain.bodies) - len(chain.task_ids)})"
        )
        findings.figures["kills (inference processes / workers)"] = (
            f"{fire.events.child_kills} / {fire.events.sigkills}"
        )
        findings.figures["faults injected"] = proxy_counts(json_lines(f"{workdir}/proxy.log"))
        keep_books(chain, config, findings)
        print_report(findings, fire.events.log)
        return findings


def keep_books(chain: Chain, config: LedgerConfig, findings: Findings) -> None:
    whole = books.audit(chain)
    books.check_whole(whole, chain, findings)
    expected = books.tamper(chain, config.seed)
    tampered = books.audit(chain)
    books.check_tampered(tampered, expected, chain, findings)
    after_s = random.Random(config.seed).uniform(0.2, 0.8) * tampered.elapsed_s
    killed, again = books.killed_then_again(chain, after_s)
    findings.expect(killed, "the audit ended before it could be killed half-way")
    findings.expect(
        again.code == tampered.code and again.report == tampered.report,
        "an audit killed half-way and run again reported otherwise",
    )
    same = again.report == tampered.report
    findings.figures["audit killed at, then again"] = (
        f"{after_s:.1f} s of {tampered.elapsed_s:.1f} s; the same report: {same}"
    )


def print_report(findings: Findings, events: list[str]) -> None:
    print("\nledger run")
    for text in events:
        print("  " + text)
    print()
    width = max(len(k) for k in findings.figures) + 2
    for key, value in findings.figures.items():
        print(f"  {key:<{width}}{value}")
    if findings.problems:
        print("\nTHE BOOKS DO NOT BALANCE:")
        for problem in findings.problems:
            print("  - " + problem)
    else:
        print("\nevery task committed once at every stage, and every tampering named")


OPTION_HELP = {
    "tasks": "tasks enqueued (each runs through three stages)",
    "workers_per_stage": "worker processes per stage",
    "seed": "seed of the inputs, the faults, the kills and the tampering",
    "rows": "rows per input",
    "duplicate_rate": "tasks delivered twice (rate)",
    "s3_5xx": "S3 requests answered 500 or 503 (rate)",
    "s3_conflict": "conditional puts answered 409 (rate)",
    "sqs_errors": "SQS requests answered 500 or throttled (rate)",
    "drop": "answers cut off after the service acted (rate)",
    "send_drop": "next-stage send answers lost after SQS took the message (rate)",
    "reset": "sends, puts and deletes reset (RST) after the service acted (rate)",
    "send_reset": "next-stage sends reset (RST) after SQS took the message (rate)",
    "latency_ms": "latency added to each request, up to (ms)",
    "child_kills": "inference processes SIGKILLed mid-task",
    "worker_kills": "workers SIGKILLed (no drain) and restarted",
    "feed_depth": "messages the feeder keeps waiting on stage 1",
    "timeout_s": "give up after (s)",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m proving.ledger",
        description="Run a three-stage chain under faults and kills, then audit it, tamper "
        "with it and audit it again.",
        epilog="example:\n  python -m proving.ledger --tasks 5000\n"
        "  python -m proving.ledger --tasks 500 --stand-in localstack",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = LedgerConfig()
    for name, text in OPTION_HELP.items():
        default = getattr(defaults, name)
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=type(default),
            default=default,
            help=f"{text} ({default:g})",
        )
    p.add_argument("--stand-in", choices=("moto", "localstack"), default="moto")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not standin.has_local_extra("python -m proving.ledger"):
        return 2
    names = LedgerConfig.__dataclass_fields__
    config = LedgerConfig(**{k: v for k, v in vars(args).items() if k in names})
    return 1 if run(config).problems else 0


if __name__ == "__main__":
    sys.exit(main())
