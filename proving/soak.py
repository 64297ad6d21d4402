"""`python -m proving.soak`: steady load through the real worker for a long while, with inference
processes SIGKILLed now and then; fails when memory, descriptors, shared memory or speed
drift between the first and the last fifth of the run, or when a task is lost.

The worker is a real `python -m sqsinfer worker` on the local stand-in, fed at a steady
rate below its capacity (so a slowdown shows as latency, and as throughput once the
worker can no longer keep up). Every `kill_every_s` the youngest inference process is
SIGKILLed: the oldest one lives through the whole run, so a leak inside a long-lived
process still accumulates, and every kill exercises the parent's restart path, where a
leaked pipe, segment or thread would pile up.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from sqsinfer.lab import feeder, stage, standin, synthetic
from sqsinfer.logs import Event

if TYPE_CHECKING:  # imported where used: the CLI builds this wing's parsers everywhere
    import psutil

BUCKET = "sqsinfer-soak"
FEATURES = 12
_MIB = 2**20
_SHM = "/dev/shm"
_SHM_LOOK_S = 5.0
_TICK_S = 0.5
_DRAIN_TIMEOUT_S = 180.0


@dataclass
class SoakConfig:
    seconds: float = 1800.0
    rate_per_s: float = 5.0
    processes: int = 2
    # Pinned: the worker sizes its input segments (two descriptors each) and its connections
    # to the messages in flight, and the auto limit would let a backlog (a loaded machine
    # falling below the feed rate part-way) grow them from one or two to sixteen, which
    # the /dev/shm and fds bounds would read as drift. One per process: at most +1 and +4.
    prefetch: int = 1
    kill_every_s: float = 30.0
    sample_s: float = 0.0  # 0: a thirtieth of the run, between 1 and 10 s
    rows: int = 1000  # rows per input: about a millisecond of prediction
    inputs: int = 16  # distinct input files, cycled through
    report: str = "soak-report.json"
    handler: str = ""  # another handler (module:Class) to soak instead of the XGBoost one

    def sample_every_s(self) -> float:
        return self.sample_s or min(10.0, max(1.0, self.seconds / 30))


# -- bounds -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bound:
    """A metric fails when its last-fifth value passes every limit given against its
    first-fifth value: `relative` as a fraction (negative: a fall), `absolute` in the
    metric's unit. Two limits for memory and latency: small figures move by large
    fractions, large ones by large amounts, and only a change beyond both is drift."""

    key: str
    label: str
    unit: str = ""
    relative: float | None = None
    absolute: float | None = None

    def text(self) -> str:
        parts = []
        if self.relative is not None:
            parts.append(f"{self.relative:+.0%}")
        if self.absolute is not None:
            parts.append(f"{self.absolute:+g} {self.unit}".rstrip())
        return " and ".join(parts)

    def passed(self, first: float, last: float) -> bool:
        if self.relative is not None and self.relative < 0:
            return last >= first * (1 + self.relative)
        beyond = []
        if self.relative is not None:
            beyond.append(last > first * (1 + self.relative))
        if self.absolute is not None:
            beyond.append(last > first + self.absolute)
        return not all(beyond)


BOUNDS = (
    Bound("parent_rss_mib", "parent RSS", "MiB", relative=0.25, absolute=50),
    Bound("children_rss_mib", "children RSS", "MiB", relative=0.25, absolute=50),
    Bound("fds", "open fds of the tree", absolute=10),
    Bound("shm_entries", "/dev/shm entries", absolute=4),
    Bound("tasks_per_s", "tasks/s", relative=-0.20),
    Bound("p95_ms", "p95 latency", "ms", relative=0.50, absolute=25),
)


# -- measuring --------------------------------------------------------------------------------


@dataclass
class Sample:
    at_s: float
    parent_rss_mib: float
    children_rss_mib: float
    fds: int
    shm_entries: int
    tasks: int  # committed in this interval
    interval_s: float
    p95_ms: float | None
    backlog: int  # sent, not yet finished
    kills: int
    latencies_s: list[float] = field(default_factory=list, repr=False)

    @property
    def tasks_per_s(self) -> float:
        return self.tasks / self.interval_s if self.interval_s > 0 else 0.0

    def row(self) -> dict[str, Any]:
        found = asdict(self)
        del found["latencies_s"]
        return found | {"tasks_per_s": round(self.tasks_per_s, 3)}


def _mapped_shm(pid: int) -> set[str]:
    """The /dev/shm entries a process has mapped or open (segments, semaphores)."""
    found = set()
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as fh:
        for line in fh:
            if f" {_SHM}/" in line:
                found.add(line.split(f"{_SHM}/", 1)[1].split()[0])
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(_SHM + "/"):
                    found.add(target[len(_SHM) + 1 :].split()[0])
    return found


class ShmCounter:
    """The /dev/shm entries that are the worker's, on a machine that other programs share.

    Whenever new names appear (`watch`, called every tick), every process's mappings and
    descriptors are read to see who holds them. An entry counts as the worker's while one
    of its processes holds it, and afterwards for as long as it is there: a segment or
    semaphore its processes held and nobody removed is what a leak leaves. Entries that
    only other programs held never count. (An entry of the worker's made and dropped
    between two looks, half a second apart, would go unseen.)"""

    def __init__(self) -> None:
        self.known = set(self._listing())  # there before the run, or looked at long enough
        self.ours: set[str] = set()
        self.fresh: dict[str, float] = {}  # new names still being looked at → first seen

    @staticmethod
    def _listing() -> list[str]:
        try:
            return os.listdir(_SHM)
        except OSError:
            return []

    def watch(self, tree: Iterable[int]) -> None:
        now = time.monotonic()
        for name in set(self._listing()) - self.known - set(self.fresh):
            self.fresh[name] = now
        if not self.fresh:
            return
        # A name is looked at for a few seconds: a semaphore is made by one process and
        # mapped by another (the spawned child) a moment later.
        for pid in tree:
            self.ours |= _mapped_shm(pid) & set(self.fresh)
        for name, seen in list(self.fresh.items()):
            if name in self.ours or now - seen > _SHM_LOOK_S:
                self.known.add(name)
                del self.fresh[name]

    def count(self, tree: Iterable[int]) -> int:
        pids = list(tree)
        self.watch(pids)
        held = set().union(*(_mapped_shm(pid) for pid in pids))
        return len(set(self._listing()) & (held | self.ours))


def _tree(pid: int) -> list[psutil.Process]:
    import psutil  # the [local] extra

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _resources(pid: int, shm: ShmCounter) -> tuple[float, float, int, int]:
    """The tree's parent RSS and children's RSS (MiB), open fds, /dev/shm entries."""
    import psutil  # the [local] extra

    parent_rss, children_rss, fds = 0, 0, 0
    tree = _tree(pid)
    for proc in tree:
        with contextlib.suppress(psutil.Error):
            rss = proc.memory_info().rss
            fds += proc.num_fds()
            if proc.pid == pid:
                parent_rss = rss
            else:
                children_rss += rss
    entries = shm.count(p.pid for p in tree)
    return round(parent_rss / _MIB, 1), round(children_rss / _MIB, 1), fds, entries


def p95(values: Sequence[float]) -> float | None:
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=20, method="inclusive")[18]


# -- judging ----------------------------------------------------------------------------------


def fifths(samples: Sequence[Sample]) -> dict[str, tuple[float, float]]:
    """Each bounded metric in the first and in the last fifth of the samples: the median
    for resources, the rate over the whole fifth for tasks/s, the p95 of all its tasks."""
    size = max(1, len(samples) // 5)
    found = {}
    for key in ("parent_rss_mib", "children_rss_mib", "fds", "shm_entries"):
        first = statistics.median(float(getattr(s, key)) for s in samples[:size])
        last = statistics.median(float(getattr(s, key)) for s in samples[-size:])
        found[key] = (first, last)

    def rate(part: Sequence[Sample]) -> float:
        return sum(s.tasks for s in part) / max(1e-9, sum(s.interval_s for s in part))

    def latency(part: Sequence[Sample]) -> float:
        return 1000 * (p95([v for s in part for v in s.latencies_s]) or 0.0)

    found["tasks_per_s"] = (rate(samples[:size]), rate(samples[-size:]))
    found["p95_ms"] = (latency(samples[:size]), latency(samples[-size:]))
    return found


def judge(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    """One verdict per bound; an empty run fails every one."""
    if len(samples) < 2:
        return [{"metric": b.label, "bound": b.text(), "ok": False} for b in BOUNDS]
    values = fifths(samples)
    verdicts = []
    for bound in BOUNDS:
        first, last = values[bound.key]
        verdicts.append(
            {
                "metric": f"{bound.label} ({bound.unit})" if bound.unit else bound.label,
                "key": bound.key,
                "first": round(first, 3),
                "last": round(last, 3),
                "bound": bound.text(),
                "ok": bound.passed(first, last),
            }
        )
    return verdicts


# -- the run ----------------------------------------------------------------------------------


class Soak:
    def __init__(self, config: SoakConfig, endpoint: str, workdir: str) -> None:
        self.config = config
        self.endpoint = endpoint
        self.workdir = workdir
        self.s3, self.sqs = standin.clients(endpoint)
        self.samples: list[Sample] = []
        self.outcomes: Counter[str] = Counter()
        self.kills = 0
        self.pending: list[float] = []  # latencies of committed tasks since the last sample
        self.tail: stage.LogTail | None = None  # the worker's log, once it runs
        self.shm = ShmCounter()

    def prepare(self) -> tuple[stage.QueuePair, list[str]]:
        stage.create_bucket(self.s3, BUCKET)
        queue = stage.create_queue(self.sqs, "soak", max_receive_count=10)
        inputs = {
            f"in/{i}.npy": synthetic.encode_input(
                synthetic.make_rows(self.config.rows, FEATURES, seed=i), "npy"
            )
            for i in range(self.config.inputs)
        }
        return queue, stage.put_objects(self.s3, BUCKET, inputs)

    def start_worker(self, queue: stage.QueuePair) -> stage.WorkerProcess:
        model = synthetic.train_model(
            os.path.join(self.workdir, "model.ubj"), FEATURES, trees=50, depth=6, seed=7
        )
        settings = stage.SHORT_DRAIN | stage.stage_settings(
            self.endpoint,
            queue.url,
            model,
            reads=f"s3://{BUCKET}/in/",
            writes=f"s3://{BUCKET}/out/",
        )
        settings |= {
            "SQSINFER_PROCESSES": str(self.config.processes),
            "SQSINFER_PREFETCH": str(self.config.prefetch),
            "SQSINFER_WAIT_TIME_S": "2",
            "SQSINFER_RETRY_BASE_S": "1",
            "SQSINFER_LOG_LEVEL": "INFO",
        }
        if self.config.handler:
            settings["SQSINFER_HANDLER"] = self.config.handler
        worker = stage.start_worker("soak", settings, self.workdir)
        self.tail = stage.LogTail(worker.log_path)
        stage.wait_ready([worker])
        return worker

    def kill_youngest(self, worker: stage.WorkerProcess) -> None:
        import psutil  # the [local] extra

        children = worker.pool_children()
        with contextlib.suppress(psutil.Error):
            if children:
                max(children, key=lambda c: c.create_time()).kill()
                self.kills += 1

    def read_log(self) -> None:
        for record in self.tail.read() if self.tail else []:
            if record.get("msg") == Event.TASK_FINISHED:
                self.outcomes[str(record.get("outcome"))] += 1
                if record.get("outcome") == "committed":
                    self.pending.append(float(record.get("seconds", 0.0)))

    def sample(self, worker: stage.WorkerProcess, sent: int, at_s: float) -> None:
        interval = at_s - (self.samples[-1].at_s if self.samples else 0.0)
        latencies, self.pending = self.pending, []
        parent_rss, children_rss, fds, entries = _resources(worker.process.pid, self.shm)
        sample = Sample(
            at_s=round(at_s, 2),
            parent_rss_mib=parent_rss,
            children_rss_mib=children_rss,
            fds=fds,
            shm_entries=entries,
            tasks=len(latencies),
            interval_s=round(interval, 3),
            p95_ms=None if not latencies else round(1000 * (p95(latencies) or 0.0), 2),
            backlog=sent - sum(self.outcomes[o] for o in ("committed", "duplicate", "rejected")),
            kills=self.kills,
            latencies_s=latencies,
        )
        self.samples.append(sample)
        print(_sample_line(sample), flush=True)

    def run_load(self, worker: stage.WorkerProcess, feed: feeder.FeedThread) -> None:
        started = time.monotonic()
        next_sample = next_kill = 0.0
        every = self.config.sample_every_s()
        while (elapsed := time.monotonic() - started) < self.config.seconds:
            time.sleep(_TICK_S)
            if worker.process.poll() is not None or feed.error is not None:
                raise RuntimeError(f"worker or feeder stopped: {feed.error}\n{worker.tail_text()}")
            self.read_log()
            self.shm.watch(p.pid for p in _tree(worker.process.pid))
            if elapsed >= next_kill + self.config.kill_every_s:
                next_kill = elapsed
                self.kill_youngest(worker)
            if elapsed >= next_sample + every:
                next_sample = elapsed
                self.sample(worker, feed.feeder.sent, elapsed)
        feed.stop()


def _sample_line(s: Sample) -> str:
    p95_text = "-" if s.p95_ms is None else f"{s.p95_ms:.0f} ms"
    return (
        f"  {s.at_s:6.0f} s  parent {s.parent_rss_mib:6.1f} MiB  children "
        f"{s.children_rss_mib:6.1f} MiB  fds {s.fds:3d}  shm {s.shm_entries:2d}  "
        f"{s.tasks_per_s:5.1f} tasks/s  p95 {p95_text}  backlog {s.backlog}  kills {s.kills}"
    )


def _drain(soak: Soak, queue: stage.QueuePair, sent: int) -> dict[str, Any]:
    """Wait until every task sent has its output and the queue is empty (deletes are
    batched, so a moment after the last output), or the time is up; what is missing."""
    expected = {f"out/soak-{seq:06d}.npy" for seq in range(sent)}
    deadline = time.monotonic() + _DRAIN_TIMEOUT_S
    while True:
        found = set(stage.list_keys(soak.s3, BUCKET, "out/"))
        left = stage.queue_depth(soak.sqs, queue.url)
        if (expected <= found and not left) or time.monotonic() > deadline:
            break
        time.sleep(2.0)
    missing = sorted(expected - found)
    return {
        "sent": sent,
        "outputs": len(expected & found),
        "lost": len(missing),
        "lost_examples": missing[:5],
        "left_on_queue": left,
        "dead_letters": len(stage.dead_letters(soak.sqs, queue.dlq_url)),
    }


def run(config: SoakConfig) -> dict[str, Any]:
    """The whole soak; the report (its `passed` says the verdict)."""
    standin.use_fake_credentials()
    with tempfile.TemporaryDirectory() as workdir, standin.moto_server() as moto:
        soak = Soak(config, moto.url, workdir)
        queue, uris = soak.prepare()
        worker = soak.start_worker(queue)
        print(_headline(config), flush=True)
        pace = feeder.at_rate(config.rate_per_s)
        feed = feeder.FeedThread(
            feeder.Feeder(soak.sqs, queue.url, feeder.cycling("soak", uris)), pace
        )
        try:
            feed.start()
            soak.run_load(worker, feed)
            tasks = _drain(soak, queue, feed.feeder.sent)
        finally:
            feed.stop()
            exit_code = stage.stop_workers([worker])[0]
        soak.read_log()
    verdicts = judge(soak.samples)
    tasks |= {"outcomes": dict(soak.outcomes), "worker_exit": exit_code}
    passed = all(v["ok"] for v in verdicts) and _tasks_ok(tasks)
    return {
        "config": asdict(config),
        "bounds": verdicts,
        "tasks": tasks,
        "kills": soak.kills,
        "samples": [s.row() for s in soak.samples],
        "passed": passed,
    }


def _tasks_ok(tasks: dict[str, Any]) -> bool:
    return bool(
        tasks["lost"] == 0
        and tasks["left_on_queue"] == 0
        and tasks["dead_letters"] == 0
        and tasks["worker_exit"] == 0
    )


def _headline(config: SoakConfig) -> str:
    return (
        f"soak: {config.seconds:g} s at {config.rate_per_s:g} tasks/s through one worker of "
        f"{config.processes} processes (prefetch {config.prefetch}); the youngest SIGKILLed "
        f"every {config.kill_every_s:g} s; a sample every {config.sample_every_s():g} s"
    )


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="first fifth against last fifth")
    for name in ("metric", "first", "last", "bound", "verdict"):
        table.add_column(name, justify="left" if name in ("metric", "bound") else "right")
    for v in report["bounds"]:
        table.add_row(
            v["metric"],
            f"{v.get('first', float('nan')):.2f}",
            f"{v.get('last', float('nan')):.2f}",
            v["bound"],
            "ok" if v["ok"] else "DRIFT",
        )
    console = Console()
    console.print(table)
    t = report["tasks"]
    console.print(
        f"tasks: {t['sent']} sent, {t['outputs']} with their output, {t['lost']} lost, "
        f"{t['left_on_queue']} left on the queue, {t['dead_letters']} in the DLQ; "
        f"{report['kills']} inference processes killed; outcomes {t['outcomes']}; "
        f"worker exit {t['worker_exit']}",
        highlight=False,
    )


def build_parser() -> argparse.ArgumentParser:
    bounds = "; ".join(f"{b.label} {b.text()}" for b in BOUNDS)
    p = argparse.ArgumentParser(
        prog="python -m proving.soak",
        description="Steady load through a real worker with process kills; fails on drift or loss.",
        epilog=textwrap.fill(
            "Fails (exit 1) when, between the first and the last fifth of the run, a figure "
            f"passes its bound ({bounds}; a figure must pass both limits where two are "
            "given), or when any task lacks its output.",
            88,
        )
        + "\n\nexamples:\n  python -m proving.soak --minutes 30\n"
        "  python -m proving.soak --seconds 30 --rate 4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--minutes", type=float, default=30.0, help="how long (30)")
    p.add_argument("--seconds", type=float, default=0.0, help="how long, instead of --minutes")
    p.add_argument("--rate", type=float, default=5.0, help="tasks a second, below capacity (5)")
    p.add_argument("--processes", type=int, default=2, help="worker processes (2)")
    p.add_argument("--kill-every-s", type=float, default=30.0, help="SIGKILL interval (30)")
    p.add_argument("--sample-s", type=float, default=0.0, help="sample interval (0: auto)")
    p.add_argument("--report", default="soak-report.json", help="the JSON report's path")
    p.add_argument("--handler", default="", help="soak this handler (module:Class) instead")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not standin.has_local_extra("python -m proving.soak"):
        return 2
    config = SoakConfig(
        seconds=args.seconds or 60 * args.minutes,
        rate_per_s=args.rate,
        processes=args.processes,
        kill_every_s=args.kill_every_s,
        sample_s=args.sample_s,
        report=args.report,
        handler=args.handler,
    )
    report = run(config)
    with open(config.report, "wb") as fh:
        fh.write(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print_report(report)
    print(f"report written to {config.report}")
    print(verdict_line(report))
    return 0 if report["passed"] else 1


def verdict_line(report: dict[str, Any]) -> str:
    if report["passed"]:
        return "soak passed: no drift beyond the bounds, every task has its output"
    why = [f"{v['metric']} drifted" for v in report["bounds"] if not v["ok"]]
    if not _tasks_ok(report["tasks"]):
        why.append("tasks lost, left over or dead-lettered, or the worker did not exit 0")
    return "SOAK FAILED: " + "; ".join(why)


if __name__ == "__main__":
    sys.exit(main())
