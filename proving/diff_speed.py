"""`python -m proving.diff_speed`: how fast `sqsinfer diff` runs, and in how much memory.

Writes the outputs of `--tasks` tasks under two prefixes of a local moto server (npy, the
worker's encoder, `--rows` × 1 float32 each; B changed a little), then runs the real
command (`python -m sqsinfer diff ... --json`) `--repeat` times from a manifest and from
the listings, at the full batch and at a tenth of it. For each, median and range: the
command's own tasks/s (its report's `tasks_per_s`: start-up excluded), its wall time, its
CPU per task and its peak RSS (its own `VmHWM`, read as it ends: `ru_maxrss` would also
count the parent's RSS at the fork). A peak RSS that does not grow from a tenth of the
batch to all of it is the bounded memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from sqsinfer.compute import formats
from sqsinfer.lab import stage, standin

BUCKET = "sqsinfer-diff-speed"
_KIB = 1024
# `sqsinfer diff`, as its script runs it, then its own peak RSS on stderr.
_MEASURED = """import sys
from sqsinfer import cli
code = cli.main(sys.argv[1:])
with open("/proc/self/status") as fh:
    print(next(line for line in fh if line.startswith("VmHWM:")), file=sys.stderr)
sys.exit(code)
"""


@dataclass(frozen=True)
class Run:
    tasks_per_s: float
    wall_s: float
    cpu_ms_per_task: float  # the diff process's own CPU, start-up included
    peak_rss_mib: float


def write_outputs(s3: object, tasks: int, rows: int, seed: int = 1) -> None:
    """Task i's output under a/ and b/, B off by up to 1e-4."""
    rng = np.random.default_rng(seed)
    objects: dict[str, bytes] = {}
    for i in range(tasks):
        a = rng.random((rows, 1), dtype=np.float32)
        b = a + rng.uniform(0, 1e-4, a.shape).astype(np.float32)
        objects[f"a/task-{i:07d}.npy"] = formats.encode(a, "npy")
        objects[f"b/task-{i:07d}.npy"] = formats.encode(b, "npy")
    stage.put_objects(s3, BUCKET, objects, threads=16)


def write_manifest(path: Path, tasks: int) -> None:
    with path.open("wb") as fh:
        for i in range(tasks):
            doc = {"task_id": f"task-{i:07d}", "input": f"s3://{BUCKET}/in/task-{i:07d}.npy"}
            fh.write(orjson.dumps(doc) + b"\n")


def run_once(endpoint: str, source: Sequence[str], concurrency: int) -> Run:
    """One `sqsinfer diff` process: its report's rate, its wall time, its peak RSS."""
    argv = [sys.executable, "-c", _MEASURED, "diff", f"s3://{BUCKET}/a/", f"s3://{BUCKET}/b/"]
    argv += [*source, "--json", "--endpoint-url", endpoint, "--concurrency", str(concurrency)]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.monotonic()
        process = subprocess.Popen(argv, stdout=out, stderr=err)
        _, status, usage = os.wait4(process.pid, 0)
        wall_s = time.monotonic() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        doc, errors = orjson.loads(out.read()), err.read().decode()
    if not doc["ok"]:
        raise RuntimeError(f"diff found problems: {errors}")
    peak_kib = int(errors.rsplit("VmHWM:", 1)[1].split()[0])
    cpu_ms = 1000 * (usage.ru_utime + usage.ru_stime) / max(1, doc["tasks"])
    return Run(doc["tasks_per_s"], wall_s, cpu_ms, peak_kib / _KIB)


def _spread(values: Sequence[float], unit: str, digits: int) -> str:
    median = statistics.median(values)
    return f"{median:.{digits}f} {unit} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def measure(args: argparse.Namespace, endpoint: str, workdir: Path) -> list[str]:
    lines = []
    for tasks in sorted({max(1, args.tasks // 10), args.tasks}):
        manifest = workdir / f"tasks-{tasks}.jsonl"
        write_manifest(manifest, tasks)
        sources = {"manifest": ["--manifest", str(manifest)]}
        if tasks == args.tasks:  # the listing is of every output written
            sources["listing"] = ["--listing"]
        for name, source in sources.items():
            runs = [run_once(endpoint, source, args.concurrency) for _ in range(args.repeat)]
            lines.append(
                f"{tasks:>8,} tasks, {name:<8}  "
                f"{_spread([r.tasks_per_s for r in runs], 'tasks/s', 0)}  "
                f"wall {_spread([r.wall_s for r in runs], 's', 1)}  "
                f"CPU {_spread([r.cpu_ms_per_task for r in runs], 'ms/task', 2)}  "
                f"peak RSS {_spread([r.peak_rss_mib for r in runs], 'MiB', 0)}"
            )
            print(lines[-1], flush=True)
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proving.diff_speed", description=__doc__)
    parser.add_argument("--tasks", type=int, default=10_000, help="tasks in the batch (10000)")
    parser.add_argument("--rows", type=int, default=200, help="rows per output (200)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each case (3)")
    parser.add_argument("--concurrency", type=int, default=16, help="diff's --concurrency (16)")
    args = parser.parse_args(argv)
    if not standin.has_local_extra("python -m proving.diff_speed"):
        return 2
    standin.use_fake_credentials()
    with standin.moto_server() as server, tempfile.TemporaryDirectory() as workdir:
        s3, _ = standin.clients(server.url)
        stage.create_bucket(s3, BUCKET)
        started = time.monotonic()
        write_outputs(s3, args.tasks, args.rows)
        print(f"wrote {2 * args.tasks:,} outputs in {time.monotonic() - started:.0f} s", flush=True)
        measure(args, server.url, Path(workdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
