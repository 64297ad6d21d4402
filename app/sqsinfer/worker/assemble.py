"""What the worker's start-up builds once its dependencies answered: the pipeline that
handles each message, the visibility keeper of the messages it holds, and the sampler
of its queues' depth.

Apart from the lifecycle so that `Worker.startup` reads as its plan (checks, pool,
parts, ready) and the wiring of the parts (which client each one is given, and why)
has one place.
"""

from __future__ import annotations

from collections.abc import Callable

from sqsinfer import config, lineage
from sqsinfer.aws.s3 import DataPath, Storage
from sqsinfer.aws.session import Clients
from sqsinfer.aws.sqs import BatchSender, Message, Sender, SqsQueue
from sqsinfer.messages import MessageRules, filled_uri, placeholder_values
from sqsinfer.metrics import Metrics
from sqsinfer.worker.pipeline import Pipeline
from sqsinfer.worker.pool import InferencePool
from sqsinfer.worker.preflight import Dependencies
from sqsinfer.worker.queue_depth import DEAD_LETTER, SOURCE, QueueDepth
from sqsinfer.worker.visibility import VisibilityKeeper


def message_rules(s: config.Settings, found: Dependencies) -> MessageRules:
    """The worker's message rules, the output prefixes' placeholders filled once with its
    model (the settings' checks made sure they can be)."""
    assert s.output_prefix is not None  # validated: a worker's output prefix is required
    values = placeholder_values(found.model.sha256, s.model_version)
    return MessageRules(
        allowed_input_prefixes=s.allowed_input_prefixes,
        allowed_output_prefixes=tuple(filled_uri(p, values) for p in s.allowed_output_prefixes),
        output_prefix=filled_uri(s.output_prefix, values),
        output_suffix=s.output_suffix,
        max_message_bytes=s.max_message_bytes,
        dead_letter_max_bytes=found.dlq_max_message_bytes,
        placeholders=values,
        message_shape=s.message_shape,
    )


def producer(s: config.Settings, found: Dependencies, pool: InferencePool) -> lineage.Producer:
    """What this worker's outputs say made them (each value checked: the settings' at
    load, the handler's version by the pool)."""
    return lineage.Producer(
        model_sha256=found.model.sha256,
        handler=s.handler,
        handler_version=pool.handler_version or lineage.UNKNOWN_VERSION,
        worker=s.worker_id,
        model_version=s.model_version,
        model_output=pool.model_output,
    )


def pipeline(
    s: config.Settings,
    clients: Clients,
    found: Dependencies,
    pool: InferencePool,
    metrics: Metrics,
    *,
    on_throttled: Callable[[str], None],
) -> Pipeline:
    """The steps of one message, each given the client it needs: the input's GET and the
    output's PUT through obstore (`on_throttled` told of each 503 it meets); next-stage
    sends on the client without SDK retries, so that the chain sees (and counts) every
    lost answer."""
    data = DataPath(clients.route, clients.credentials, metrics.count_call, on_throttled)
    next_stage = (
        BatchSender(clients.sqs_single_attempt, s.next_queue_url) if s.next_queue_url else None
    )
    return Pipeline(
        settings=s,
        rules=message_rules(s, found),
        storage=Storage(clients.s3, data=data),
        queue=SqsQueue(clients.sqs, s.queue_url),
        dead_letters=Sender(clients.sqs, found.dlq_url),
        next_stage=next_stage,
        pool=pool,
        metrics=metrics,
        producer=producer(s, found, pool),
        max_receive_count=found.max_receive_count,
    )


def keeper(
    s: config.Settings,
    queue: SqsQueue,
    metrics: Metrics,
    on_expired: Callable[[Message], None],
) -> VisibilityKeeper:
    return VisibilityKeeper(
        queue,
        visibility_timeout_s=s.visibility_timeout_s,
        heartbeat_s=s.heartbeat_s,
        max_task_time_s=s.max_task_time_s,
        metrics=metrics,
        on_expired=on_expired,
    )


def queue_depth(
    s: config.Settings, clients: Clients, found: Dependencies, metrics: Metrics
) -> QueueDepth | None:
    """The sampler of the queue's and the DLQ's depth, or None when queue_sample_s is 0."""
    if not s.queue_sample_s:
        return None
    queues = {SOURCE: s.queue_url, DEAD_LETTER: found.dlq_url}
    return QueueDepth(clients.sqs, queues, metrics, s.queue_sample_s)
