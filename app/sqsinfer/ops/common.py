"""What the operator commands share: the worker settings they borrow, numbers for people.

A command takes a worker setting through `borrow`: the setting's own flag, `SQSINFER_*`
variable, parser and default (`config.add_arguments(only=...)`), so a shell set up for a
stage needs no repeated flags and a value means to the command what it means to the
worker. The CLI reads them once parsed (`config.read_borrowed`).
"""

from __future__ import annotations

import argparse
import decimal
import functools
import math
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from sqsinfer import config, logs

# The exit codes of sqsinfer.cli, plus the partial outcome of enqueue.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_PARTIAL = 0, 1, 2, 3
EXIT_INTERRUPTED = 130

_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9}


# Where the AWS calls go: every command that makes them borrows these.
AWS_SETTINGS = ("endpoint_url", "region")


def borrow(
    parser: argparse.ArgumentParser,
    names: Sequence[str],
    notes: dict[str, str] | None = None,
) -> None:
    """Give the command the worker settings `names` (with the AWS ones): their flags, and
    their values read as the worker reads them once the command line is parsed."""
    wanted = tuple(names) + tuple(n for n in AWS_SETTINGS if n not in names)
    config.add_arguments(parser, only=wanted, notes=notes)
    parser.set_defaults(borrowed=wanted)


def add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="WARNING", help="log level on stderr (WARNING)")


def formatter() -> type[argparse.RawDescriptionHelpFormatter]:
    return argparse.RawDescriptionHelpFormatter


def run_command(main: Callable[[], Coroutine[Any, Any, int]], name: str, log_level: str) -> int:
    """Run an async command the way the worker runs; Ctrl-C ends it with 130."""
    from sqsinfer.runtime import run_async

    logs.configure(log_level, "console")
    try:
        return run_async(main())
    except KeyboardInterrupt:
        print(f"sqsinfer {name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except config.ConfigError as exc:  # AWS's configuration, read when the clients open
        print(f"sqsinfer {name}: invalid setting: {exc}", file=sys.stderr)
        return EXIT_USAGE


def quiet_on_broken_pipe(
    command: Callable[[argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """A reader that stops early (`| head -1`) ends the command quietly, not in a traceback.

    The exit status is 1, as rich's console gives for its own output and as Python's
    documentation suggests; what follows in the pipeline decides the pipeline's status.
    """

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            code = command(args)
            sys.stdout.flush()  # output still buffered would fail at exit, past this handler
        except BrokenPipeError:
            # Python flushes stdout once more at exit: point it at /dev/null so that is quiet.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return EXIT_FAILED
        return code

    return run


def usage_error(name: str, problem: str) -> int:
    print(f"sqsinfer {name}: {problem}", file=sys.stderr)
    return EXIT_USAGE


def parse_count(text: str) -> int:
    """A count as people write it: 15800000, 15_800_000, 15.8M, 250k."""
    raw = text.strip().replace("_", "").replace(",", "").lower()
    scale = _SUFFIXES.get(raw[-1:], 1)
    number = raw[:-1] if raw[-1:] in _SUFFIXES else raw
    try:
        value = decimal.Decimal(number) * scale  # exact: 15.8M is 15,800,000, not 15,799,999
    except decimal.InvalidOperation:
        raise argparse.ArgumentTypeError(f"not a count: {text!r}, e.g. 15800000 or 15.8M") from None
    if not value.is_finite() or value < 0 or value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"not a whole, non-negative count: {text!r}")
    return int(value)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def queue_name(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


def format_duration(seconds: float | None) -> str:
    """3d 04:05:06 · 04:05:06 · 05:06 · '-' for unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    total = round(seconds)
    days, rest = divmod(total, 86_400)
    hours, rest = divmod(rest, 3_600)
    minutes, secs = divmod(rest, 60)
    clock = (
        f"{hours:02d}:{minutes:02d}:{secs:02d}" if hours or days else f"{minutes:02d}:{secs:02d}"
    )
    return f"{days}d {clock}" if days else clock


def format_money(value: float) -> str:
    return f"${value:,.2f}" if value >= 0.01 or value == 0 else f"${value:.4f}"
