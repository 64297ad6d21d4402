"""`python -m proving.ledger.measure`: how fast `sqsinfer audit` goes and how much memory it
takes, at 100 k and 1 M manifest lines, on the moto stand-in (median of 3, with range).

Each size gets a stand-in of its own, filled before it serves: a stage's queue and its
dead-letter queue (holding a few dead letters), and a bucket holding every task's output
(with its lineage's `task-id` and `model-sha256`), written straight into moto's backend in
its own process rather than by a million PUTs. moto lists a bucket by sorting every key
it holds for each page of 1,000 (a million keys: a thousand sorts of a million); S3 does
not, so this stand-in lists from a sorted index of the keys, built once (nothing is
written while it is measured). Then `sqsinfer audit` runs in its own process, as an
operator runs it, and its peak RSS is what the kernel says of that process (`wait4`).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqsinfer.lab import standin

BUCKET = "sqsinfer-audit-measure"
PREFIX = "scores/"
MODEL = "ab" * 32
DEAD_LETTERS = 10  # tasks whose output is missing and whose message is in the DLQ


def task_id(i: int) -> str:
    return f"shard-{i % 97:02d}/task-{i:08d}"


# -- the stand-in, filled ------------------------------------------------------------------
def _sorted_listing() -> None:
    """moto's list_objects_v2 from a sorted index of the bucket's keys, built on first use."""
    from moto.s3.models import S3Backend
    from moto.utilities.utils import md5_hash

    original = S3Backend.list_objects_v2
    index: dict[str, list[str]] = {}

    def list_objects_v2(  # noqa: PLR0917 - moto's own signature
        self: Any,
        bucket: Any,
        prefix: str | None,
        delimiter: str | None,
        continuation_token: str | None,
        start_after: str | None,
        max_keys: int,
    ) -> Any:
        if delimiter:
            return original(
                self, bucket, prefix, delimiter, continuation_token, start_after, max_keys
            )
        names = index.get(bucket.name)
        if names is None or len(names) != len(bucket.keys):
            names = index[bucket.name] = sorted(bucket.keys.keys())
        prefix = prefix or ""
        after = (
            self._pagination_tokens.get(continuation_token) if continuation_token else start_after
        )
        at = bisect.bisect_right(names, after) if after else bisect.bisect_left(names, prefix)
        page = [n for n in names[at : at + max_keys + 1] if n.startswith(prefix)]
        truncated = len(page) > max_keys
        page = page[:max_keys]
        token = None
        if truncated:
            token = md5_hash(page[-1].encode()).hexdigest()
            self._pagination_tokens[token] = page[-1]
        return [bucket.keys[n] for n in page], truncated, token

    S3Backend.list_objects_v2 = list_objects_v2  # type: ignore[method-assign]


def serve(port: int, tasks: int, queue_name: str) -> None:
    """The filled stand-in on loopback, until terminated."""
    import signal

    from moto.backends import get_backend
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import run_simple

    os.environ.setdefault("MOTO_PORT", str(port))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    standin.make_atomic()
    _sorted_listing()
    s3 = get_backend("s3")["123456789012"]["global"]
    s3.create_bucket(BUCKET, standin.REGION)
    for i in range(DEAD_LETTERS, tasks):
        key = s3.put_object(BUCKET, f"{PREFIX}{task_id(i)}.npy", b"scores")
        key.set_metadata({"task-id": task_id(i), "model-sha256": MODEL})
    app = DomainDispatcherApplication(create_backend_app)
    print("filled", flush=True)
    run_simple("127.0.0.1", port, app, threaded=True, request_handler=standin._keep_alive_handler())


def _queues(endpoint: str, queue_name: str) -> str:
    """The stage's queue and DLQ, a few dead letters in it: the queue's URL."""
    from sqsinfer.aws.sqs import Message, dead_letter_copy
    from sqsinfer.lab import stage

    _, sqs = standin.clients(endpoint)
    pair = stage.create_queue(sqs, queue_name)
    for i in range(DEAD_LETTERS):
        body = json.dumps({"task_id": task_id(i), "input": f"s3://{BUCKET}/in/{i}.npy"})
        copy = dead_letter_copy(Message(str(i), "-", body, 1), "input_not_found", "-", pair.url)
        sqs.send_message(
            QueueUrl=pair.dlq_url, MessageBody=copy.body, MessageAttributes=copy.attributes
        )
    return pair.url


# -- the measurement -----------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    seconds: float
    cpu_s: float  # the audit process's own, user and system
    peak_rss_bytes: int
    code: int


def audit_once(endpoint: str, queue_url: str, manifest: str, lineage: bool) -> Run:
    argv = [sys.executable, "-m", "sqsinfer", "audit", manifest, "--json", "--quiet"]
    argv += ["--endpoint-url", endpoint, "--queue-url", queue_url, "--output-prefix"]
    argv += [f"s3://{BUCKET}/{PREFIX}", "--dlq-hold-s", "5"]
    if lineage:
        argv += ["--model-sha256", MODEL]
    env = {**os.environ, **standin.FAKE_CREDENTIALS}
    with tempfile.TemporaryFile() as out:
        started = time.monotonic()
        process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        # Reaped here, not by Popen: wait4 tells this process's own peak RSS.
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.monotonic() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read().decode(errors="replace")
    try:
        report = json.loads(text.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        raise RuntimeError(f"the audit failed: {text[-1000:]}") from None
    if report.get("tasks") is None:
        raise RuntimeError(f"the audit failed: {text[-1000:]}")
    cpu_s = usage.ru_utime + usage.ru_stime
    return Run(seconds, cpu_s, usage.ru_maxrss * 1024, process.returncode)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m proving.ledger.measure", description=__doc__)
    p.add_argument("--lines", type=int, action="append", help="manifest lines (100000, 1000000)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--lineage", action="store_true", help="check each output's model (a HEAD each)")
    p.add_argument("--serve", nargs=3, metavar=("PORT", "TASKS", "QUEUE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(int(args.serve[0]), int(args.serve[1]), args.serve[2])
        return 0
    for lines in args.lines or [100_000, 1_000_000]:
        print(json.dumps(measure(lines, args.runs, args.lineage)), flush=True)
    return 0


def measure(lines: int, runs: int, lineage: bool) -> dict[str, Any]:
    port = standin.free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "proving.ledger.measure", "--serve", str(port), str(lines), "audit"],
        env={**os.environ, **standin.FAKE_CREDENTIALS},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert server.stdout is not None
        server.stdout.readline()  # filled
        standin.wait_until_up(url, server)
        queue_url = _queues(url, "audit")
        with tempfile.TemporaryDirectory() as workdir:
            manifest = os.path.join(workdir, "tasks.jsonl")
            with open(manifest, "w") as fh:
                for i in range(lines):
                    fh.write(
                        json.dumps({"task_id": task_id(i), "input": f"s3://features/{i}.npy"})
                        + "\n"
                    )
            done = []
            for _ in range(runs):
                done.append(audit_once(url, queue_url, manifest, lineage))
                print(f"run {len(done)}: {done[-1]}", file=sys.stderr, flush=True)
    finally:
        server.kill()  # a million objects take long to free, and nothing is kept
        server.wait()
    rates = [lines / run.seconds for run in done]
    rss = [run.peak_rss_bytes / 2**20 for run in done]
    return {
        "lines": lines,
        "lineage": lineage,
        "codes": [run.code for run in done],
        "tasks_per_s": [round(r) for r in rates],
        "tasks_per_s_median": round(statistics.median(rates)),
        "peak_rss_mib": [round(r, 1) for r in rss],
        "peak_rss_mib_median": round(statistics.median(rss), 1),
        "seconds": [round(run.seconds, 1) for run in done],
        "cpu_us_per_task": [round(1e6 * run.cpu_s / lines, 1) for run in done],
    }


if __name__ == "__main__":
    sys.exit(main())
