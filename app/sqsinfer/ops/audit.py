"""`sqsinfer audit`: account for every task of a batch at every stage, from S3 and SQS alone.

    what was enqueued (a manifest, or the listing it came from)
        + each stage: its output prefix (listed), its dead-letter queue (read, handed back)
        ─▶ per stage: committed (by model), missing, dead-lettered (by reason), ...
        ─▶ per task: every one not committed, with why (--tasks-out FILE: all of them)

The accounting is `sqsinfer.ops.ledger`; this module is the command: its stages, its
progress bar and its report.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import IO, Any

from sqsinfer.compute import formats
from sqsinfer.messages import (
    filled_uri,
    parse_s3_uri,
    placeholder_values,
)
from sqsinfer.ops import common
from sqsinfer.ops.deadletters import DEFAULT_DEADLINE_S, Ended
from sqsinfer.ops.ledger import (
    Audit,
    AuditReport,
    Category,
    Options,
    Progress,
    StageReport,
    StageSpec,
)
from sqsinfer.ops.manifest import (
    MANIFEST_FORMATS,
    Item,
    KeyPattern,
    Validator,
    manifest_format,
    open_manifest,
)
from sqsinfer.ops.status import StatusError

EXIT_OK, EXIT_MISSING, EXIT_ACCOUNTED = common.EXIT_OK, common.EXIT_FAILED, common.EXIT_PARTIAL

EPILOG = """\
A stage is its queue (its dead-letter queue comes from the redrive policy) and its output
prefix: the worker's own settings (--queue-url, --output-prefix, --output-format,
--model-sha256, or their SQSINFER_ variables), or for a chain one --stage each, in order:
  --stage queue=URL,prefix=s3://bucket/scores/[,format=npy][,model=SHA256][,version=V][,dlq=URL]
An output prefix may name {model_sha256_12} or {model_version}: the model given fills it,
and every output must then carry that model.

examples:
  sqsinfer audit tasks.jsonl --queue-url $URL --output-prefix s3://scores/
  sqsinfer audit tasks.jsonl --stage queue=$STAGE1,prefix=s3://b/stage1/ \\
      --stage queue=$STAGE2,prefix=s3://b/stage2/ --lineage --tasks-out problems.jsonl
  sqsinfer audit tasks.jsonl --output-prefix 's3://scores/{model_sha256_12}/' \\
      --model-sha256 $SHA --json | jq .complete

exit status: 0 every task committed at every stage; 1 some are missing (no output and not
in a dead-letter queue), a chain link is not sent, or an output was written twice; 3 none
is missing, but some are dead-lettered, in conflict or written by another model; 2 usage.
"""

BORROWED = (
    "queue_url",
    "dlq_url",
    "output_prefix",
    "allowed_output_prefixes",
    "output_format",
    "model_sha256",
    "model_version",
)
_NOTES = {
    "queue_url": "here the stage's queue: its DLQ and what it still holds",
    "output_prefix": "here where the stage's outputs are listed",
    "model_sha256": "here the model every output must carry; fills {model_sha256_12}",
}
_SPEC_FIELDS = ("queue", "prefix", "format", "model", "version", "dlq")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "audit",
        help="account for every task of a batch: committed, missing, dead-lettered, ...",
        description="Account for every task of a batch at every stage, from S3 and SQS.",
        epilog=EPILOG,
        formatter_class=common.formatter(),
    )
    p.add_argument("manifest", nargs="?", help="what was enqueued: JSONL or CSV; - reads stdin")
    p.add_argument("--format", choices=MANIFEST_FORMATS, help="manifest format (by suffix)")
    p.add_argument(
        "--from-prefix",
        metavar="S3_GLOB",
        help="the tasks `enqueue --from-prefix` made from this listing",
    )
    p.add_argument(
        "--stage",
        action="append",
        default=[],
        metavar="SPEC",
        help="a stage of the chain, in order: queue=URL,prefix=S3_URI[,format=..][,model=..]"
        "[,version=..][,dlq=URL]",
    )
    common.borrow(p, BORROWED, notes=_NOTES)
    p.add_argument(
        "--lineage",
        action="store_true",
        help="HEAD every output: whose it is and which model wrote it (implied by a model)",
    )
    p.add_argument("--concurrency", type=common.positive_int, default=32, help="HEADs at once (32)")
    p.add_argument(
        "--dlq-hold-s",
        type=common.positive_int,
        default=30,
        help="how long each dead letter read stays hidden if this run dies, and how long "
        "(and 4 s) to wait for dead letters another reader holds (30)",
    )
    p.add_argument(
        "--dlq-deadline-s",
        type=common.positive_int,
        default=int(DEFAULT_DEADLINE_S),
        help="the longest the read of a dead-letter queue may take; the report says how "
        f"many letters it read of how many ({int(DEFAULT_DEADLINE_S)})",
    )
    p.add_argument(
        "--show", type=int, default=20, help="tasks not committed listed in the report (20)"
    )
    p.add_argument("--tasks-out", metavar="FILE", help="every task not committed, as JSONL")
    p.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    common.add_log_level(p)
    p.set_defaults(func=cmd_audit)


# -- the stages ---------------------------------------------------------------------------
class UsageError(ValueError):
    pass


def _stage(spec: dict[str, str]) -> StageSpec:
    """A stage from its fields (those of `--stage`), checked, its prefix's placeholders
    filled with the model given."""
    if not spec.get("queue"):
        raise UsageError("a stage needs its queue (--queue-url, or queue= in --stage)")
    if not spec.get("prefix"):
        raise UsageError("a stage needs its output prefix (--output-prefix, or prefix=)")
    prefix = parse_s3_uri(spec["prefix"], "prefix", prefix=True)
    model, fmt = spec.get("model", ""), spec.get("format", "npy")
    if "{model_sha256_12}" in prefix.key and not model:
        raise UsageError(f"{prefix} names {{model_sha256_12}}: give the model (--model-sha256)")
    if fmt not in formats.OUTPUT_NAMES:
        raise UsageError(f"format {fmt!r}: one of {', '.join(formats.OUTPUT_NAMES)}")
    try:
        filled = filled_uri(prefix, placeholder_values(model, spec.get("version", "")))
    except ValueError as exc:
        raise UsageError(f"{prefix}: {exc}") from None
    return StageSpec(spec["queue"], filled, "." + fmt, model, spec.get("dlq", ""))


def parse_spec(text: str, default_format: str) -> StageSpec:
    fields = {"format": default_format}
    for part in text.split(","):
        name, eq, value = part.partition("=")
        if not eq or name.strip() not in _SPEC_FIELDS:
            raise UsageError(
                f"--stage {text!r}: expected name=value with {', '.join(_SPEC_FIELDS)}"
            )
        fields[name.strip()] = value.strip()
    return _stage(fields)


def stages_from_args(args: argparse.Namespace) -> list[StageSpec]:
    if args.stage:
        return [parse_spec(text, args.output_format) for text in args.stage]
    borrowed = {
        "queue": args.queue_url,
        "prefix": str(args.output_prefix) if args.output_prefix is not None else "",
        "format": args.output_format,
        "model": args.model_sha256,
        "version": args.model_version,
        "dlq": args.dlq_url,
    }
    return [_stage(borrowed)]


def validator(args: argparse.Namespace, first: StageSpec) -> Validator:
    """The first stage's rules: a line passes when that worker would accept it (any input
    bucket; outputs under its allowed prefixes, filled with its model when given)."""
    values = (
        placeholder_values(first.model_sha256, args.model_version) if first.model_sha256 else None
    )
    allowed = args.allowed_output_prefixes
    if values is not None:
        try:
            allowed = tuple(filled_uri(p, values) for p in allowed)
        except ValueError as exc:
            raise UsageError(f"--allowed-output-prefixes: {exc}") from None
    return Validator(
        output_prefix=first.output_prefix,
        allowed_outputs=allowed,
        output_suffix=first.output_suffix,
        placeholders=values,
    )


# -- the progress bar ---------------------------------------------------------------------
class RichProgress(Progress):
    """A live line on stderr: the phase, its count, its rate."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.progress import Progress as Bar

        self.bar = Bar(
            SpinnerColumn(),
            TextColumn("{task.description:<24}"),
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
        )
        self.task: Any = None
        self.started = time.monotonic()
        self.count = 0

    def __enter__(self) -> RichProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def phase(self, name: str, total: int | None = None) -> None:
        if self.task is not None:
            self.bar.update(self.task, total=self.count)
        self.task = self.bar.add_task(name, total=total, rate="")
        self.started, self.count = time.monotonic(), 0

    def advance(self, count: int = 1) -> None:
        self.count += count
        if self.count % 1000 < count or count > 1:
            rate = self.count / max(1e-9, time.monotonic() - self.started)
            self.bar.update(self.task, completed=self.count, rate=f"{rate:,.0f}/s")


def _progress(args: argparse.Namespace) -> contextlib.AbstractContextManager[Progress]:
    if args.quiet or args.json or not sys.stderr.isatty():
        return contextlib.nullcontext(Progress())
    return RichProgress()


# -- the report ---------------------------------------------------------------------------
_COLUMNS = (
    (Category.COMMITTED, "committed"),
    (Category.MISSING, "missing"),
    (Category.DEAD_LETTERED, "dead-lettered"),
    (Category.OUTPUT_CONFLICT, "conflict"),
    (Category.OTHER_MODEL, "other model"),
    (Category.LINK_PENDING, "link pending"),
    (Category.NOT_REACHED, "not reached"),
    (Category.WRITTEN_TWICE, "written twice"),
)


def exit_code(report: AuditReport) -> int:
    if report.unaccounted:
        return EXIT_MISSING
    return EXIT_OK if report.complete else EXIT_ACCOUNTED


def report_table(report: AuditReport) -> Any:
    """A row per category, a column per stage (a chain is a few stages, never many)."""
    from rich.table import Table

    table = Table(title="audit", title_justify="left")
    table.add_column("tasks")
    for stage in report.stages:
        table.add_column(stage.name, justify="right", overflow="fold")
    for category, title in _COLUMNS:
        table.add_row(title, *(f"{stage.categories[category]:,}" for stage in report.stages))
    return table


def report_lines(report: AuditReport) -> Iterator[str]:
    for stage in report.stages:
        if stage.models:
            models = ", ".join(f"{m[:12] or '(none)'} {n:,}" for m, n in stage.models.items())
            yield f"{stage.name}: outputs by model: {models}"
        if stage.dead_letters:
            reasons = ", ".join(f"{r} {n:,}" for r, n in sorted(stage.dead_letter_reasons.items()))
            yield f"{stage.name}: dead letters {stage.dead_letters:,} ({reasons})"
        yield from _dead_letter_lines(stage)
        waiting = sum(stage.queue.values())
        if waiting:
            yield f"{stage.name}: {waiting:,} messages still on the queue: work in progress"
        if not stage.versions_listed:
            yield f"{stage.name}: the bucket is not versioned: written-twice is not checked"
    for finding in report.findings:
        reason = f" ({finding.reason})" if finding.reason else ""
        yield f"  {finding.stage} {finding.category}{reason}: {finding.task_id} {finding.output}"
    if report.problems > len(report.findings):
        yield f"  ... and {report.problems - len(report.findings):,} more (--tasks-out FILE)"
    yield _summary(report)


# Why a pass over a dead-letter queue ended before it read every letter, and what to do.
_PART_READ = {
    Ended.LAPPED: "the holds lapsed before the pass ended (raise --dlq-hold-s)",
    Ended.DEADLINE: "--dlq-deadline-s passed",
}


def _dead_letter_lines(stage: StageReport) -> Iterator[str]:
    """How much of the stage's dead-letter queue was read, and what may follow from it."""
    if not stage.dead_letters_ended:
        return  # no dead-letter queue of its own (or one an earlier stage told of)
    read, held = stage.dead_letters_read, stage.dead_letters_in_queue
    why = _PART_READ.get(Ended(stage.dead_letters_ended))
    if why is not None:
        yield (
            f"{stage.name}: dead-letter queue read in part: {read:,} letters of about {held:,}: "
            f"{why}; missing tasks may be among the rest"
        )
    elif held or read:
        yield f"{stage.name}: dead-letter queue read whole: {read:,} letters of about {held:,}"
    if stage.dead_letters_unread:
        yield (
            f"{stage.name}: {stage.dead_letters_unread:,} dead letters held by another "
            "reader could not be read: missing tasks may be among them"
        )
    if stage.dead_letters_at_limit:
        yield (
            f"{stage.name}: {stage.dead_letters_at_limit:,} dead letters have been received "
            "as often as their queue's own redrive policy allows: the next receive, by "
            "anyone, moves each on"
        )


def _summary(report: AuditReport) -> str:
    stages = len(report.stages)
    head = f"{report.tasks:,} tasks, {stages} stage{'s' if stages > 1 else ''}"
    if report.bad_lines:
        head += f" ({report.bad_lines:,} bad lines not counted)"
    if report.complete:
        checked = "by the model asked" if any(s.model_sha256 for s in report.stages) else ""
        return f"{head}: every task committed once at every stage {checked}".rstrip()
    return (
        f"{head}: {report.tasks_not_done:,} not done; {report.unaccounted:,} unaccounted for "
        "(missing, link pending, written twice)"
    )


# -- the command --------------------------------------------------------------------------
@dataclass
class _Run:
    """What one run reads and writes, opened before it starts."""

    stages: list[StageSpec]
    check: Validator
    pattern: KeyPattern | None = None
    manifest: IO[bytes] | None = None
    tasks_out: IO[bytes] | None = None

    def close(self) -> None:
        for handle in (self.manifest, self.tasks_out):
            if handle is not None:
                handle.close()


@common.quiet_on_broken_pipe
def cmd_audit(args: argparse.Namespace) -> int:
    if bool(args.manifest) == bool(args.from_prefix):
        return common.usage_error(
            "audit", "give a manifest (a file, or - for stdin) or --from-prefix"
        )
    try:
        stages = stages_from_args(args)
        run = _Run(stages, validator(args, stages[0]))
        run.pattern = KeyPattern.parse(args.from_prefix) if args.from_prefix else None
    except ValueError as exc:  # UsageError too
        return common.usage_error("audit", str(exc))
    try:
        run.manifest = open_manifest(args.manifest) if args.manifest else None
        run.tasks_out = open(args.tasks_out, "wb") if args.tasks_out else None  # noqa: SIM115
    except OSError as exc:
        run.close()
        return common.usage_error("audit", str(exc))
    try:
        return common.run_command(lambda: _main(args, run), "audit", args.log_level)
    finally:
        run.close()


def _items(args: argparse.Namespace, run: _Run, s3: Any) -> AsyncIterator[Item]:
    from sqsinfer.ops.enqueue import in_thread
    from sqsinfer.ops.manifest import read_listing, read_manifest

    if run.pattern is not None:
        return read_listing(s3, run.pattern, run.check)
    assert run.manifest is not None
    name = "stdin" if args.manifest == "-" else args.manifest
    fmt = manifest_format(name, args.format)
    return in_thread(read_manifest(run.manifest, name, fmt, run.check))


async def _main(args: argparse.Namespace, run: _Run) -> int:
    from botocore.exceptions import BotoCoreError, ClientError

    from sqsinfer.aws.s3 import DataPath
    from sqsinfer.aws.session import open_clients

    options = Options(
        lineage=args.lineage,
        concurrency=args.concurrency,
        dlq_hold_s=args.dlq_hold_s,
        dlq_deadline_s=args.dlq_deadline_s,
        show=args.show,
    )
    async with open_clients(args.region, args.endpoint_url, args.concurrency) as clients:
        with _progress(args) as progress:
            audit = Audit(
                clients.s3,
                clients.sqs,
                run.stages,
                options,
                progress=progress,
                tasks_out=run.tasks_out,
                data=DataPath(clients.route, clients.credentials),
            )
            try:
                report = await audit.run(_items(args, run, clients.s3))
            except (TimeoutError, ClientError, BotoCoreError, StatusError) as exc:
                print(f"sqsinfer audit: {exc}", file=sys.stderr)
                return common.EXIT_FAILED
    _print(report, args)
    return exit_code(report)


def _print(report: AuditReport, args: argparse.Namespace) -> None:
    if args.json:
        import orjson

        print(orjson.dumps(report.as_dict() | {"exit_status": exit_code(report)}).decode())
        return
    from rich.console import Console

    Console().print(report_table(report))
    for line in report_lines(report):
        print(line)
