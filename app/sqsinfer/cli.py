"""The `sqsinfer` command (also `python -m sqsinfer`)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from sqsinfer import __version__, config, logs

# Only what every command needs is imported here. Started as the `sqsinfer` script, the
# worker's spawned processes run that script again (as __mp_main__), and so import this
# module: each command's own modules (the AWS SDK, obstore, aiohttp) load when it runs.
from sqsinfer.logs import Event

log = logging.getLogger("sqsinfer")

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

WORKER_EPILOG = """\
Every flag can also be given as an environment variable: --queue-url is SQSINFER_QUEUE_URL.

examples:
  sqsinfer worker --queue-url https://sqs.eu-west-1.amazonaws.com/123456789012/score \\
      --model-path /models/model.ubj --allowed-input-prefixes s3://features/ \\
      --output-prefix s3://scores/
  SQSINFER_ENDPOINT_URL=http://127.0.0.1:5000 sqsinfer worker ...   (a local stand-in)
"""

DEMO_EPILOG = """\
Runs a two-stage chain end to end on a local moto server, with no AWS account:
  sqsinfer demo                 # a few hundred tasks, a few of them deliberately bad
  sqsinfer demo --tasks 1000 --processes 2
  sqsinfer demo --keep          # then leave the stand-in up to explore, until Ctrl-C
Exits non-zero if any valid task lacks its outputs or any bad one is missing from the DLQ.
"""


def cmd_worker(args: argparse.Namespace) -> int:
    if args.check_settings:
        return _check_settings(args)
    from sqsinfer.runtime import EarlySignals, run_async

    early = EarlySignals.install()  # before the imports below, which take seconds

    from sqsinfer.compute.errors import ModelLoadError
    from sqsinfer.worker.lifecycle import StartupError, run_worker

    try:
        settings = config.settings_from_args(args)
    except config.ConfigError as exc:
        return _invalid_setting(exc)
    logs.configure(settings.log_level, settings.log_format)

    async def main() -> int:
        await run_worker(settings, early=early)
        return EXIT_OK

    try:
        return run_async(main())
    except config.ConfigError as exc:  # AWS's configuration, read when the clients open
        log.error(Event.CANNOT_START, extra={"error": str(exc), "setting": exc.setting})
        return _invalid_setting(exc)
    except (ModelLoadError, StartupError) as exc:
        log.error(Event.CANNOT_START, extra={"error": str(exc)})
        print(f"sqsinfer worker: cannot start: {exc}", file=sys.stderr)
        return EXIT_FAILED


def _check_settings(args: argparse.Namespace) -> int:
    """`worker --check-settings`: start-up's resolution of every setting, then the values."""
    from sqsinfer.worker import check

    try:
        settings = config.settings_from_args(args)
        found = check.resolve(settings, config.origins(settings, config.overrides_of(args)))
    except config.ConfigError as exc:  # the same errors as start-up's, and the same words
        return _invalid_setting(exc)
    print(check.report(found))
    return EXIT_OK


def _invalid_setting(exc: config.ConfigError) -> int:
    print(f"sqsinfer worker: invalid setting: {exc}", file=sys.stderr)
    return EXIT_USAGE


def cmd_demo(args: argparse.Namespace) -> int:
    from sqsinfer.lab import demo

    logs.configure(args.log_level, "console")
    return demo.main(args)


def _add_worker(sub: Any) -> None:
    p = sub.add_parser(
        "worker",
        help="consume a queue: infer each task and commit its output",
        epilog=WORKER_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    config.add_arguments(p)
    p.add_argument(
        "--check-settings",
        action="store_true",
        help="resolve every setting as start-up does (flags, SQSINFER_* and AWS's variables), "
        "print the values and exit: 0, or 2 naming a bad one; contacts nothing",
    )
    p.set_defaults(func=cmd_worker)


def _add_demo(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run a two-stage chain on a local moto server and check every output",
        epilog=DEMO_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tasks", type=int, default=300, help="valid tasks to enqueue (300)")
    p.add_argument("--processes", type=int, default=1, help="processes per stage worker (1)")
    p.add_argument("--rows", type=int, default=200, help="rows per input file (200)")
    p.add_argument("--timeout-s", type=float, default=100.0, help="give up after (100 s)")
    p.add_argument("--log-level", default="WARNING", help="log level of the demo (WARNING)")
    p.add_argument(
        "--keep",
        action="store_true",
        help="after the check, keep the stand-in running and print how to reach it",
    )
    p.set_defaults(func=cmd_demo)


def _add_bench(sub: Any) -> None:
    from sqsinfer.bench import add_parser

    add_parser(sub)


def _add_operator_commands(sub: Any) -> None:
    from sqsinfer.ops import (
        add_audit,
        add_diff,
        add_enqueue,
        add_plan,
        add_redrive,
        add_status,
    )

    for add in (add_enqueue, add_status, add_redrive, add_plan, add_audit, add_diff):
        add(sub)


COMMANDS: list[Callable[[Any], None]] = [
    _add_worker,
    _add_demo,
    _add_bench,
    _add_operator_commands,
]


# How `sqsinfer --help` groups the commands, by what they are for.
GROUPS: dict[str, tuple[str, ...]] = {
    "run": ("worker",),
    "operate": ("enqueue", "status", "redrive", "plan", "audit", "diff"),
    "try and measure": ("demo", "bench"),
}


def _grouped_help(sub: Any) -> str:
    # argparse keeps one pseudo-action per sub-command, carrying its help line.
    helps = {action.dest: action.help or "" for action in sub._choices_actions}
    width = max(map(len, helps)) + 2
    grouped = {name for names in GROUPS.values() for name in names}
    sections = [*GROUPS.items(), ("other", tuple(sorted(set(helps) - grouped)))]
    lines: list[str] = []
    for group, names in sections:
        known = [name for name in names if name in helps]
        if known:
            lines += [f"{group}:", *(f"  {name:<{width}}{helps[name]}" for name in known), ""]
    return "\n".join(lines) + "Run `sqsinfer COMMAND --help` for a command's options."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sqsinfer",
        usage="sqsinfer [-h] [--version] COMMAND ...",
        description="Batch ML inference: SQS in, S3 out, a spawn pool between.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"sqsinfer {__version__}")
    # prog: each command's usage line names the command alone (`usage: sqsinfer worker
    # [-h] ...`), not the top-level usage before it.
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help=argparse.SUPPRESS, prog="sqsinfer"
    )
    for add in COMMANDS:
        add(sub)
    parser.epilog = _grouped_help(sub)
    return parser


def warn_unknown_variables(command: str) -> None:
    """A `SQSINFER_*` variable that is no setting would silently leave the default in
    place (a typo): say so, with the closest setting's name."""
    for name, closest in config.unknown_variables():
        hint = f"; did you mean {closest}?" if closest else ""
        print(
            f"sqsinfer {command}: warning: {name} is not a setting, ignored{hint}", file=sys.stderr
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "worker" or getattr(args, "borrowed", ()):
        warn_unknown_variables(args.command)
    if getattr(args, "borrowed", ()):
        try:
            config.read_borrowed(args)
        except config.ConfigError as exc:
            print(f"sqsinfer {args.command}: invalid setting: {exc}", file=sys.stderr)
            return EXIT_USAGE
    code: int = args.func(args)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
