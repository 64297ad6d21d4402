"""Settings: from `SQSINFER_*` environment variables and matching flags, validated at start.

Every setting is one dataclass field. Its environment name is `SQSINFER_` + the field
name in upper case and its flag is `--` + the name with dashes, so the Helm chart,
the README and the command line cannot drift apart: `ENV_NAMES` is the list they use.
A bad value stops start-up with a `ConfigError` that names the setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import re
import socket
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from sqsinfer import events
from sqsinfer.compute import formats, handlers
from sqsinfer.limits import (
    SQS_DEDUPLICATION_WINDOW_S,
    SQS_DEFAULT_MAX_MESSAGE_BYTES,
    SQS_MAX_VISIBILITY_S,
    SQS_MAX_WAIT_S,
)
from sqsinfer.lineage import (
    MAX_HANDLER_NAME_BYTES,
    MAX_MODEL_OUTPUT_BYTES,
    MAX_WORKER_ID_BYTES,
    MODEL_OUTPUT,
    value_problem,
)
from sqsinfer.messages import (
    S3Uri,
    check_placeholders,
    fill_placeholders,
    parse_prefixes,
    parse_s3_uri,
)

ENV_PREFIX = "SQSINFER_"
# After the drain deadline, a commit already under way may take this long to land, and
# then tasks still running are cancelled and their messages released within this long.
COMMIT_GRACE_S = 10.0
FORCED_RELEASE_S = 5.0
# The long poll pending at SIGTERM is let end (its messages are then released): within
# wait_time_s, and this long for its answer to arrive.
LAST_RECEIVE_GRACE_S = 5.0
_MODEL_DIR = "sqsinfer-model"
_DRAIN_MARGIN_S = 10.0  # the derived drain: a task started just before SIGTERM, and its commit
# The derived max_task_time_s: a task three times its p99 is stuck, not slow; short tasks
# keep 15 minutes (a stuck task costs a slot that long, a false abandon a whole retry).
MAX_TASK_TIME_FACTOR = 3.0
MAX_TASK_TIME_FLOOR_S = 900.0


class ConfigError(Exception):
    """A setting is missing or invalid; the message names it by its environment name."""

    def __init__(self, name: str, problem: str) -> None:
        self.setting = env_name(name)
        super().__init__(f"{self.setting} (--{name.replace('_', '-')}): {problem}")


class ExternalConfigError(ConfigError):
    """A variable of another library's configuration that the worker reads (AWS's,
    OpenTelemetry's) is invalid, or names what the worker cannot honour; names it."""

    def __init__(self, variable: str, problem: str) -> None:
        self.setting = variable
        Exception.__init__(self, f"{variable}: {problem}")


class AwsConfigError(ExternalConfigError):
    """A variable of AWS's own configuration (or the AWS config file) that the SDK reads
    for the worker is invalid, or names what the worker cannot honour; names it."""


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


AUTO = "auto"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def parse_prefetch(text: str) -> int | str:
    """`auto`, or a number of messages per process (at least 1)."""
    if text.lower() == AUTO:
        return AUTO
    value = int(text)
    if value < 1:
        raise ValueError("must be auto or at least 1")
    return value


def _output_format(text: str) -> str:
    if text not in formats.OUTPUT_NAMES:
        raise ValueError("must be one of " + ", ".join(formats.OUTPUT_NAMES))
    return text


def _message_shape(text: str) -> str:
    if text not in events.MESSAGE_SHAPES:
        raise ValueError("must be one of " + ", ".join(events.MESSAGE_SHAPES))
    return text


def _flag(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError("expected true or false")


def _opt(default: Any, help: str, parse: Callable[[str], Any] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "parse": parse})


def _prefixes(name: str) -> Callable[[str], tuple[S3Uri, ...]]:
    return lambda text: parse_prefixes(text, env_name(name))


def _uri(name: str) -> Callable[[str], S3Uri | None]:
    return lambda text: parse_s3_uri(text, env_name(name), prefix=True) if text else None


@dataclass(frozen=True)
class Settings:
    queue_url: str = _opt("", "SQS queue this stage consumes (required)")
    dlq_url: str = _opt(
        "", "dead-letter queue for rejected messages; default: the queue's redrive target"
    )
    next_queue_url: str = _opt("", "queue of the next stage; each output is handed on there")
    model_path: str = _opt("", "model file, or s3://bucket/key fetched once at start-up (required)")
    model_sha256: str = _opt(
        "", "refuse to start unless the model has this sha256 (required for an s3:// model)"
    )
    model_version: str = _opt(
        "",
        "a name for the model (a registry version, a date): in each output's metadata, and "
        "what {model_version} in an output prefix stands for",
    )
    model_dir: str = _opt(
        "", "where an s3:// model is fetched to; default: sqsinfer-model in the temp dir"
    )
    max_model_bytes: int = _opt(4 * 2**30, "largest model fetched from S3", int)
    handler: str = _opt(
        handlers.DEFAULT, "model handler: a short name (xgboost) or package.module:Class"
    )
    model_output: str = _opt(
        "",
        "the model output served, by name, for a model of several (onnx); default: its one "
        "output, or a classifier's probabilities (its one float output beside an integer label)",
    )
    allowed_input_prefixes: tuple[S3Uri, ...] = _opt(
        (), "comma-separated s3:// prefixes inputs may be read from (required)", None
    )
    output_prefix: S3Uri | None = _opt(
        None,
        "s3:// prefix for outputs of messages without an output (required); may name "
        "{model_sha256_12} or {model_version}, filled once at start",
        None,
    )
    allowed_output_prefixes: tuple[S3Uri, ...] = _opt(
        (), "comma-separated s3:// prefixes outputs may be written under; default: output prefix"
    )
    output_format: str = _opt(
        "npy", "format of derived output keys: npy, json or parquet", _output_format
    )
    message_shape: str = _opt(
        events.SQSINFER,
        "what a message is: sqsinfer (a task message), s3-event (an S3 event notification: "
        "S3's own, wrapped by SNS, or EventBridge's) or auto (either, told apart by shape)",
        _message_shape,
    )
    processes: int = _opt(0, "inference processes; 0 = the CPUs this container may use", int)
    threads_per_process: int = _opt(1, "threads each process gives the model", int)
    prefetch: int | str = _opt(
        AUTO,
        "in-flight messages per process: auto (sized from the measured I/O and compute times "
        "per task, at most max_prefetch inputs of the largest size, up to 32 messages when "
        "they measure smaller) or a number that pins it",
        parse_prefetch,
    )
    max_prefetch: int = _opt(
        8,
        "in-flight inputs of max_input_bytes per process that /dev/shm is sized for when "
        "prefetch is auto (auto holds more messages, up to 32, while they measure smaller)",
        int,
    )
    coalesce: bool = _opt(
        True,
        "score the rows of small tasks waiting for a process in one predict call, each "
        "task's output split back and committed on its own; only for a handler that allows "
        "it (rows_independent: the built-in xgboost handler does)",
        _flag,
    )
    coalesce_max_rows: int = _opt(
        1000,
        "a task of at most this many rows is small (coalesced); one of more is scored alone",
        int,
    )
    visibility_timeout_s: int = _opt(
        60, "visibility a received message gets, renewed by the heartbeat", int
    )
    heartbeat_s: float = _opt(20.0, "how often in-flight messages are extended", float)
    wait_time_s: int = _opt(
        SQS_MAX_WAIT_S, f"long-poll wait of each receive (0-{SQS_MAX_WAIT_S})", int
    )
    task_time_s: float = _opt(
        60.0,
        "the longest a task normally takes (its p99, fetch to commit); shutdown waits for it",
        float,
    )
    drain_deadline_s: float = _opt(
        0.0,
        "on SIGTERM, how long started tasks may finish; 0 = task_time_s + 10 s",
        float,
    )
    max_task_time_s: float = _opt(
        0.0,
        "a task running longer is abandoned and retried; 0 = 3 x task_time_s, at least "
        "900 s and at most SQS's visibility cap (43200 s)",
        float,
    )
    exit_when_idle_s: float = _opt(
        0.0,
        "exit (status 0) once nothing was received and nothing was in flight for this long; "
        "0 = never (a job's worker ends when its queue is empty)",
        float,
    )
    max_tasks: int = _opt(
        0,
        "stop receiving after this many messages, finish them and exit (status 0); one "
        "handed back unstarted does not count; 0 = no limit",
        int,
    )
    always_head_output: bool = _opt(
        False,
        "look for the output (HEAD) before computing on every delivery, not only on "
        "redeliveries; the conditional put decides duplicates either way",
        _flag,
    )
    chain_settle_s: float = _opt(
        30.0,
        "a delivery that finds another's output or chain intent without a sent link waits "
        "this long, then takes the link over; with task_time_s, below max_task_time_s",
        float,
    )
    chain_dedup_window_s: float = _opt(
        240.0,
        "on a FIFO next stage: a link sent within this long of its output's write counts on "
        "SQS's deduplication (300 s; the rest is the send's margin); later ones count as "
        "possible duplicates",
        float,
    )
    max_message_bytes: int = _opt(
        SQS_DEFAULT_MAX_MESSAGE_BYTES, "largest message body accepted", int
    )
    max_input_bytes: int = _opt(64 * 2**20, "largest input object read from S3", int)
    max_decoded_bytes: int = _opt(256 * 2**20, "largest decoded input array", int)
    retry_base_s: float = _opt(5.0, "visibility delay of a first transient failure", float)
    retry_max_s: float = _opt(900.0, "longest visibility delay of a retried message", float)
    endpoint_url: str = _opt(
        "",
        "endpoint of S3 and SQS (a local stand-in such as a moto server); default: "
        "AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL_SQS, AWS_ENDPOINT_URL, the AWS profile's, "
        "else AWS's own",
    )
    region: str = _opt(
        "",
        "AWS region; default: AWS_REGION, then AWS_DEFAULT_REGION, then the AWS profile's; "
        "one is required",
    )
    health_host: str = _opt("0.0.0.0", "address of the health and metrics server")
    health_port: int = _opt(8080, "port of /livez /readyz /metrics; 0 picks a free one", int)
    stall_s: float = _opt(
        120.0, "/livez fails when the worker made no progress for this long", float
    )
    queue_sample_s: float = _opt(
        60.0,
        "how often the depth of the queue and its dead-letter queue is read for /metrics "
        "(GetQueueAttributes, one call a queue); 0 = never",
        float,
    )
    pod_deletion_cost: bool = _opt(
        False,
        "keep this pod's controller.kubernetes.io/pod-deletion-cost current through the "
        "Kubernetes API (high while it holds messages, low when idle), so that a scale-in "
        "removes idle pods first; needs POD_NAME and POD_NAMESPACE (the downward API) and a "
        "token that may patch the pod",
        _flag,
    )
    pod_deletion_cost_idle_s: float = _opt(
        10.0,
        "with pod_deletion_cost: how long the worker holds nothing before its pod's cost is "
        "set low (turning busy sets it high at once), so at most two patches a pod this long",
        float,
    )
    kube_token_dir: str = _opt(
        "/var/run/secrets/kubernetes.io/serviceaccount",
        "where the Kubernetes API's token and ca.crt are read (pod_deletion_cost): a "
        "service account token's volume",
    )
    log_level: str = _opt("INFO", "DEBUG, INFO, WARNING or ERROR")
    log_format: str = _opt("auto", "json, console, or auto (console on a terminal)")
    worker_id: str = _opt("", "name in output metadata and logs; default: the host name")

    # -- derived values -------------------------------------------------------------
    @property
    def output_suffix(self) -> str:
        return "." + self.output_format

    @property
    def shutdown_budget_s(self) -> float:
        """The longest a worker takes from SIGTERM to exit: the pod's grace must exceed it.

        The drain and the end of the pending long poll run side by side; whichever ends
        later starts the commit grace and the forced release.
        """
        last_receive_s = self.wait_time_s + LAST_RECEIVE_GRACE_S
        return max(self.drain_deadline_s, last_receive_s) + COMMIT_GRACE_S + FORCED_RELEASE_S

    # -- construction ---------------------------------------------------------------
    @classmethod
    def load(
        cls,
        environ: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | None = None,
        *,
        require_queue: bool = True,
    ) -> Settings:
        """Settings from the environment, then flags (`overrides`), then validated."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(env_name(f.name))
            if overrides is not None and overrides.get(f.name) is not None:
                raw = overrides[f.name]
            if raw is not None:
                values[f.name] = _convert(f, raw)
        return cls(**values).validated(require_queue=require_queue)

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes).validated()

    def validated(self, *, require_queue: bool = True) -> Settings:
        """Fill defaults that depend on the machine and check every rule."""
        s = self
        if s.processes == 0:
            s = dataclasses.replace(s, processes=available_cpus())
        if not s.allowed_output_prefixes and s.output_prefix is not None:
            s = dataclasses.replace(s, allowed_output_prefixes=(s.output_prefix,))
        if s.drain_deadline_s == 0:
            s = dataclasses.replace(s, drain_deadline_s=drain_s(s.task_time_s, 0))
        if s.max_task_time_s == 0:
            s = dataclasses.replace(s, max_task_time_s=derived_max_task_time_s(s.task_time_s))
        if not s.model_dir:
            s = dataclasses.replace(s, model_dir=os.path.join(tempfile.gettempdir(), _MODEL_DIR))
        if not s.worker_id:
            s = dataclasses.replace(s, worker_id=socket.gethostname())
        for check in _CHECKS:
            check(s, require_queue)
        return s


def drain_s(task_time_s: float, drain_deadline_s: float) -> float:
    """How long started tasks may finish on SIGTERM: the setting, or (0) task_time_s and
    their commit."""
    return drain_deadline_s or task_time_s + _DRAIN_MARGIN_S


def derived_max_task_time_s(task_time_s: float) -> float:
    """max_task_time_s when unset: a stage of long tasks needs no second setting."""
    wanted = max(MAX_TASK_TIME_FLOOR_S, MAX_TASK_TIME_FACTOR * task_time_s)
    return min(float(SQS_MAX_VISIBILITY_S), wanted)


def _convert(f: dataclasses.Field[Any], raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    parse = f.metadata.get("parse")
    if f.name.startswith("allowed_"):
        parse = _prefixes(f.name)
    elif f.name == "output_prefix":
        parse = _uri(f.name)
    if parse is None:
        return raw.strip()
    try:
        return parse(raw.strip())
    except ValueError as exc:
        raise ConfigError(f.name, f"invalid value {raw!r}: {exc}") from None


def _require(ok: bool, name: str, problem: str) -> None:
    if not ok:
        raise ConfigError(name, problem)


def _check_required(s: Settings, require_queue: bool) -> None:
    if require_queue:
        _require(bool(s.queue_url), "queue_url", "is required")
    _check_model(s)
    _require(bool(s.allowed_input_prefixes), "allowed_input_prefixes", "list at least one")
    _require(s.output_prefix is not None, "output_prefix", "is required")
    for name in ("queue_url", "dlq_url", "next_queue_url", "endpoint_url"):
        value = getattr(s, name)
        _require(
            not value or value.startswith(("http://", "https://")),
            name,
            f"must be an http(s) URL, got {value!r}",
        )


def _check_model(s: Settings) -> None:
    _require(bool(s.model_path), "model_path", "is required")
    if not s.model_path.startswith("s3://"):
        _require(os.path.isfile(s.model_path), "model_path", f"no such file: {s.model_path}")
        return
    try:
        parse_s3_uri(s.model_path, "model")
    except ValueError as exc:
        raise ConfigError("model_path", str(exc)) from None
    _require(
        bool(s.model_sha256),
        "model_sha256",
        f"is required for a model fetched from S3 ({s.model_path}): set the sha256 it must have",
    )


def _check_outputs(s: Settings, _: bool) -> None:
    _require(
        s.output_format in formats.OUTPUT_NAMES,
        "output_format",
        "must be one of " + ", ".join(formats.OUTPUT_NAMES),
    )
    _require(
        s.message_shape in events.MESSAGE_SHAPES,
        "message_shape",
        "must be one of " + ", ".join(events.MESSAGE_SHAPES),
    )
    if s.message_shape != events.SQSINFER:
        _check_no_event_loop(s)
    missing = formats.named(s.output_format).missing
    _require(not missing, "output_format", f"is {s.output_format}, but {missing}")
    if s.output_prefix is not None:
        _require(
            any(s.output_prefix.within(p) for p in s.allowed_output_prefixes),
            "allowed_output_prefixes",
            f"must include the output prefix {s.output_prefix}",
        )
    _require(
        not s.model_sha256 or re.fullmatch(r"[0-9a-f]{64}", s.model_sha256) is not None,
        "model_sha256",
        "must be 64 lower-case hex digits",
    )
    _require(
        s.handler in handlers.REGISTRY
        or re.fullmatch(r"[A-Za-z_][\w.]*[:.][A-Za-z_]\w*", s.handler) is not None,
        "handler",
        f"must be one of {', '.join(handlers.REGISTRY)} or a path such as package.module:Class",
    )


def _check_no_event_loop(s: Settings) -> None:
    """A stage fed by S3 events must not write where it reads: each output (and chain
    marker) would be a new object under an input prefix, its event scored again, forever."""
    for out in s.allowed_output_prefixes:
        for inp in s.allowed_input_prefixes:
            overlap = out.bucket == inp.bucket and (
                out.key.startswith(inp.key) or inp.key.startswith(out.key)
            )
            _require(
                not overlap,
                "allowed_input_prefixes",
                f"{inp} overlaps the output prefix {out}: with message_shape "
                f"{s.message_shape}, each output would be an S3 event under an input prefix, "
                "scored again; keep outputs outside the input prefixes",
            )


def _check_numbers(s: Settings, _: bool) -> None:
    _require(s.processes >= 1, "processes", "must be at least 1")
    _require(s.threads_per_process >= 1, "threads_per_process", "must be at least 1")
    _require(
        s.prefetch == AUTO or (isinstance(s.prefetch, int) and s.prefetch >= 1),
        "prefetch",
        "must be auto or at least 1",
    )
    _require(s.max_prefetch >= 1, "max_prefetch", "must be at least 1")
    _require(s.coalesce_max_rows >= 1, "coalesce_max_rows", "must be at least 1")
    _require(
        1 <= s.visibility_timeout_s <= SQS_MAX_VISIBILITY_S,
        "visibility_timeout_s",
        f"must be 1-{SQS_MAX_VISIBILITY_S}",
    )
    # The keeper extends what would lapse before the tick after next, so an extension
    # starts at least one heartbeat before the lapse: a heartbeat is its margin.
    _require(
        0 < s.heartbeat_s <= s.visibility_timeout_s / 3,
        "heartbeat_s",
        f"must be above 0 and at most a third of the visibility timeout "
        f"({s.visibility_timeout_s} s), so that each extension has a heartbeat of margin",
    )
    _require(0 <= s.wait_time_s <= SQS_MAX_WAIT_S, "wait_time_s", f"must be 0-{SQS_MAX_WAIT_S}")
    _check_task_times(s)
    _check_chain_settle(s)
    _require(0 < s.retry_base_s <= s.retry_max_s, "retry_base_s", "must be in (0, retry_max_s]")
    _require(
        s.retry_max_s <= SQS_MAX_VISIBILITY_S, "retry_max_s", f"at most {SQS_MAX_VISIBILITY_S}"
    )
    for name in ("max_message_bytes", "max_input_bytes", "max_decoded_bytes", "max_model_bytes"):
        _require(getattr(s, name) > 0, name, "must be above 0")
    _require(0 <= s.health_port <= 65535, "health_port", "must be 0-65535")
    _require(s.stall_s > s.wait_time_s, "stall_s", "must be longer than the receive wait")
    _require(s.queue_sample_s >= 0, "queue_sample_s", "must be 0 (never) or more")
    _require(s.exit_when_idle_s >= 0, "exit_when_idle_s", "must be 0 (never) or more")
    _require(s.max_tasks >= 0, "max_tasks", "must be 0 (no limit) or more")
    _require(s.pod_deletion_cost_idle_s > 0, "pod_deletion_cost_idle_s", "must be above 0")


def _check_task_times(s: Settings) -> None:
    _require(s.task_time_s > 0, "task_time_s", "must be above 0")
    _require(
        s.drain_deadline_s >= s.task_time_s,
        "drain_deadline_s",
        f"must be at least task_time_s ({s.task_time_s:g} s), or every shutdown throws away "
        "the tasks started just before it; 0 derives it",
    )
    _require(
        s.task_time_s <= SQS_MAX_VISIBILITY_S,
        "task_time_s",
        f"must be at most SQS's visibility cap ({SQS_MAX_VISIBILITY_S} s): a message is "
        "held no longer",
    )
    _require(
        s.task_time_s <= s.max_task_time_s <= SQS_MAX_VISIBILITY_S,
        "max_task_time_s",
        f"must be between {env_name('task_time_s')} ({s.task_time_s:g} s) and SQS's "
        f"visibility cap ({SQS_MAX_VISIBILITY_S} s), or every task of normal length is "
        "abandoned and retried; 0 derives it",
    )


# Model versions become part of output keys and of their metadata.
_MODEL_VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+\-]{0,63}")
_WORKER_ID_RE = re.compile(rf"[\x21-\x7e][\x20-\x7e]{{0,{MAX_WORKER_ID_BYTES - 1}}}")


def _check_lineage(s: Settings, _: bool) -> None:
    """What goes into every output's metadata fits there, and every placeholder an output
    prefix names will be filled."""
    _require(
        not s.model_version or _MODEL_VERSION_RE.fullmatch(s.model_version) is not None,
        "model_version",
        "must be 1-64 characters of A-Z a-z 0-9 . _ - +, starting with a letter or digit",
    )
    _require(
        _WORKER_ID_RE.fullmatch(s.worker_id) is not None,
        "worker_id",
        f"must be 1-{MAX_WORKER_ID_BYTES} printable ASCII characters (it is written in "
        "every output's metadata)",
    )
    _require(
        len(s.handler.encode()) <= MAX_HANDLER_NAME_BYTES,
        "handler",
        f"is longer than {MAX_HANDLER_NAME_BYTES} bytes (it is written in every output's metadata)",
    )
    _require(
        not s.model_output or not value_problem(MODEL_OUTPUT, s.model_output),
        "model_output",
        f"must be 1-{MAX_MODEL_OUTPUT_BYTES} printable ASCII characters (it is written in "
        "every output's metadata)",
    )
    for prefix in (s.output_prefix, *s.allowed_output_prefixes):
        name = "output_prefix" if prefix is s.output_prefix else "allowed_output_prefixes"
        if prefix is not None:
            _check_filled(prefix, name, s.model_version)


def _check_filled(prefix: S3Uri, name: str, model_version: str) -> None:
    """A prefix's placeholders are known and can be filled, and what they fill it with
    (a sha256's 12 digits, the model version) keeps it a valid prefix."""
    values = {"model_sha256_12": "0" * 12, "model_version": model_version}
    try:
        check_placeholders(prefix.key)
    except ValueError as exc:
        raise ConfigError(name, str(exc)) from None
    if "{model_version}" in prefix.key and not model_version:
        raise ConfigError(
            name, f"names {{model_version}}, but {env_name('model_version')} is not set"
        )
    try:
        filled = fill_placeholders(prefix.key, values)
        parse_s3_uri(f"s3://{prefix.bucket}/{filled}", env_name(name), prefix=True)
    except ValueError as exc:
        raise ConfigError(name, f"once its placeholders are filled: {exc}") from None


def _check_chain_settle(s: Settings) -> None:
    _require(s.chain_settle_s > 0, "chain_settle_s", "must be above 0")
    _require(
        0 <= s.chain_dedup_window_s < SQS_DEDUPLICATION_WINDOW_S,
        "chain_dedup_window_s",
        f"must be at least 0 and below SQS's deduplication window ({SQS_DEDUPLICATION_WINDOW_S} s)",
    )
    if not s.next_queue_url:
        return  # nothing is chained: the settle is never waited
    # A delivery may compute for task_time_s and then wait out a whole settle, holding
    # its message; past max_task_time_s the keeper abandons it first (a receive spent,
    # and on a queue that keeps failing to settle, the DLQ) instead of taking over.
    _require(
        s.task_time_s + s.chain_settle_s < s.max_task_time_s,
        "chain_settle_s",
        f"is {s.chain_settle_s:g} s: with {env_name('task_time_s')} "
        f"({s.task_time_s:g} s) it must stay below {env_name('max_task_time_s')} "
        f"({s.max_task_time_s:g} s), or a delivery waiting for another's chain link is "
        "abandoned and retried before it may take the link over",
    )


def _check_logging(s: Settings, _: bool) -> None:
    _require(
        logging.getLevelName(s.log_level.upper()) in (10, 20, 30, 40),
        "log_level",
        "must be DEBUG, INFO, WARNING or ERROR",
    )
    _require(s.log_format in ("auto", "json", "console"), "log_format", "json, console or auto")


_CHECKS = (_check_required, _check_outputs, _check_numbers, _check_lineage, _check_logging)

ENV_NAMES: tuple[str, ...] = tuple(env_name(f.name) for f in fields(Settings))


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """`SQSINFER_*` variables that are no setting, each with the closest setting's name
    ("" when none is close): a misspelt one would otherwise run on the default, unseen."""
    environ = os.environ if environ is None else environ
    found = sorted(n for n in environ if n.startswith(ENV_PREFIX) and n not in ENV_NAMES)
    # Compared without the prefix they all share, which would make any name look close.
    tails = [n.removeprefix(ENV_PREFIX) for n in ENV_NAMES]
    out = []
    for name in found:
        close = difflib.get_close_matches(name.removeprefix(ENV_PREFIX), tails, n=1)
        out.append((name, ENV_PREFIX + close[0] if close else ""))
    return out


def available_cpus() -> int:
    """CPUs this process may really use: affinity and the cgroup quota, not the host count."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, int(quota + 0.5)))  # 1.5 CPUs of quota: 2 processes
    return max(1, cpus)


def _cgroup_cpu_quota() -> float | None:
    try:  # cgroup v2
        with open("/sys/fs/cgroup/cpu.max") as fh:
            quota, period = fh.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as fh:
            q = int(fh.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as fh:
            p = int(fh.read())
        return None if q <= 0 else q / p
    except (OSError, ValueError):
        return None


def _fields(only: Iterable[str] | None) -> list[dataclasses.Field[Any]]:
    every = {f.name: f for f in fields(Settings)}
    if only is None:
        return list(every.values())
    unknown = [name for name in only if name not in every]
    if unknown:
        raise ValueError(f"no such setting: {', '.join(unknown)}")
    return [every[name] for name in only]


def add_arguments(
    parser: argparse.ArgumentParser,
    only: Iterable[str] | None = None,
    notes: Mapping[str, str] | None = None,
) -> None:
    """One flag per setting (or per setting named in `only`, for a tool that borrows some
    of the worker's): an unset flag falls back to the environment, then the default.
    `notes` adds a tool's own word to a setting's help (what the tool does with it)."""
    for f in _fields(only):
        note = (notes or {}).get(f.name, "")
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            default=None,
            metavar=f.name.upper(),
            help=f"{f.metadata['help']}{'; ' + note if note else ''} [{env_name(f.name)}]",
        )


def borrowed(
    args: argparse.Namespace, only: Iterable[str], environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The settings a tool borrowed with `add_arguments(parser, only)`, as the worker would
    read them: each from its flag, else its `SQSINFER_*` variable, else its default, and
    parsed by the setting's own parser (a bad value raises a ConfigError naming it).

    Only the borrowed settings are read, and only each one's own form is checked: the
    rules that tie a worker's settings together (a model is required, ...) are the
    worker's, not the tool's.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in _fields(only):
        raw = getattr(args, f.name, None)
        if raw is None:
            raw = environ.get(env_name(f.name))
        values[f.name] = f.default if raw is None else _convert(f, raw)
    return values


def settings_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None, **kw: Any
) -> Settings:
    return Settings.load(environ, overrides_of(args), **kw)


def origins(
    s: Settings, overrides: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Where each of the settings `load` made came from: its flag, its variable, the
    default, or `derived` (a default `validated` filled from other settings or the machine)."""
    environ = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for f in fields(Settings):
        if overrides.get(f.name) is not None:
            out[f.name] = "--" + f.name.replace("_", "-")
        elif env_name(f.name) in environ:
            out[f.name] = env_name(f.name)
        else:
            out[f.name] = "default" if getattr(s, f.name) == f.default else "derived"
    return out


def overrides_of(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags (None: not given)."""
    return {f.name: getattr(args, f.name, None) for f in fields(Settings)}


def read_borrowed(args: argparse.Namespace) -> None:
    """For a command whose parser borrowed settings (`args.borrowed`, their names): replace
    each one's flag text with the setting's value, as `borrowed` reads it."""
    for name, value in borrowed(args, getattr(args, "borrowed", ())).items():
        setattr(args, name, value)


def describe(s: Settings) -> dict[str, Any]:
    """Settings as plain values, for the start-up log line."""
    out: dict[str, Any] = {}
    for f in fields(Settings):
        value = getattr(s, f.name)
        if isinstance(value, tuple):
            value = [str(v) for v in value]
        elif isinstance(value, S3Uri):
            value = str(value)
        out[f.name] = value
    return out


def _default_text(f: dataclasses.Field[Any]) -> str:
    value = f.default
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value in ("", None, (), 0) and "required" in f.metadata["help"]:
        return "(required)"
    if value in ("", None, ()):
        return "-"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 2**20:
        return f"{value} ({value / 2**20:g} MiB)"
    return f"`{value}`"


def reference_markdown() -> str:
    """The settings reference page (docs/settings.md), generated so it cannot drift."""
    lines = [
        "# Settings",
        "",
        "Generated from `sqsinfer.config.Settings` by `make docs-settings`; a test fails",
        "when this page and the code disagree. Every setting is an environment variable and",
        "a flag of `sqsinfer worker` (flags win). A bad value stops start-up with a message",
        "that names the setting.",
        "",
        "| environment variable | flag | default | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"].replace("|", "\\|")
        lines.append(f"| `{env_name(f.name)}` | `{flag}` | {_default_text(f)} | {help_text} |")
    return "\n".join(lines) + "\n"
