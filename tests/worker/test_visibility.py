"""The visibility keeper against stalled calls: held messages never lapse, and an
extension under way never undoes a message's hand-back."""

from __future__ import annotations

import asyncio
import contextvars
import time

import numpy as np
from aiohttp import web

from proving.faults import FaultPlan, FaultProxy, Operation
from sqsinfer.lab import synthetic
from sqsinfer.worker.visibility import expected_extensions, extension_every_ticks
from tests.conftest import Stage, eventually, outcome_count, running, sample
from tests.worker.test_lifecycle import Poacher

DELAYED = "sqs:visibility_delayed"
EXTENDED = "sqsinfer_visibility_extensions_total"


def _input(stage: Stage, name: str, first_cell: float = 0.0) -> str:
    rows = np.ones((2, 3), dtype=np.float32)
    rows[0, 0] = first_cell
    return stage.put_input(name, synthetic.encode_input(rows, "npy"))


def _stall_first_visibility_call(stage: Stage, seconds: float) -> FaultProxy:
    plan = FaultPlan(
        visibility_delay_s=seconds, visibility_delay_rate=1.0, visibility_delay_calls=1
    )
    return FaultProxy(stage.endpoint, plan)


async def test_one_stalled_extension_call_lets_no_held_message_lapse(stage: Stage, make_settings):
    # An 8 s stall of the first ChangeMessageVisibilityBatch against a 6 s visibility: a
    # keeper that waits for it lets the message lapse while it is being computed.
    proxy = _stall_first_visibility_call(stage, 8.0)
    await proxy.start()
    stage.send({"task_id": "slow", "input": _input(stage, "slow.npy", first_cell=10)})
    settings = make_settings(
        handler="tests.handlers:ScriptedHandler",
        endpoint_url=proxy.url,
        visibility_timeout_s=6,
        heartbeat_s=2,
    )
    try:
        async with running(settings) as worker, Poacher(stage) as poacher:
            await eventually(lambda: outcome_count(worker, "committed") == 1, timeout_s=40)
    finally:
        await proxy.stop()
    assert proxy.counts[DELAYED] == 1  # the stall happened
    assert poacher.got == []  # and nobody else was handed the message meanwhile
    assert worker.metrics.outcomes == {"committed": 1}
    assert stage.counts(stage.queue_url) == (0, 0)


async def test_an_extension_under_way_cannot_undo_a_retry_delay(
    stage: Stage, make_settings, tmp_path
):
    # The first extension is held back 1.5 s by the proxy; while it is held, the task
    # fails (a transient error) and its message is handed back with a 6.4-8 s retry delay.
    # Sent first and landing second, the extension would hide it for a whole 40 s timeout.
    # The margins are wide so that a loaded machine's pauses cannot blur the two.
    model = tmp_path / "model.bin"
    model.write_bytes(b"any")
    gate = tmp_path / "model.bin.go"
    proxy = _stall_first_visibility_call(stage, 1.5)
    await proxy.start()
    stage.send({"task_id": "gated", "input": _input(stage, "gated.npy")})
    settings = make_settings(
        handler="tests.worker.gates:GatedHandler",
        model_path=str(model),
        endpoint_url=proxy.url,
        visibility_timeout_s=40,
        heartbeat_s=13,
        retry_base_s=8,
    )
    try:
        async with running(settings) as worker:
            await eventually(lambda: proxy.counts[DELAYED] == 1, timeout_s=30)
            held_back_at = time.monotonic()
            gate.write_text("fail")
            await eventually(lambda: outcome_count(worker, "retried") == 1, timeout_s=10)
        # Whatever order the two calls were sent in, both have landed by now.
        # Visible again within 35 s of the hold: the retry delay, not the 40 s timeout.
        assert time.monotonic() - held_back_at < 20.0
        await eventually(lambda: stage.counts(stage.queue_url) == (1, 0), timeout_s=15)
    finally:
        await proxy.stop()
    assert worker.metrics.outcomes == {"retried": 1}


_HELD = contextvars.ContextVar("held", default=False)


class _TellsWhenHeldCallLands(FaultProxy):
    """The fault proxy, noting when a visibility call it held back has reached the
    stand-in and been answered there (whoever still waits for its answer)."""

    landed = False

    async def _hold(self, op: Operation) -> None:
        before = self.counts[DELAYED]
        await super()._hold(op)
        _HELD.set(self.counts[DELAYED] > before)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        response = await super()._handle(request)
        if _HELD.get():
            self.landed = True
        return response


async def test_an_extension_given_up_on_cannot_undo_a_release(
    stage: Stage, make_settings, tmp_path
):
    # The keeper's first extension is held 6 s by the proxy, and given up on after 2 s
    # (half the time left); its retry extends the message. Then the worker stops, and
    # the drain deadline releases the message (visibility 0). The given-up call still
    # lands, later: landing after the release, it would hide the message for 12 s more.
    model = tmp_path / "model.bin"
    model.write_bytes(b"any")
    plan = FaultPlan(visibility_delay_s=6.0, visibility_delay_rate=1.0, visibility_delay_calls=1)
    proxy = _TellsWhenHeldCallLands(stage.endpoint, plan)
    await proxy.start()
    stage.send({"task_id": "gated", "input": _input(stage, "gated.npy")})
    settings = make_settings(
        handler="tests.worker.gates:GatedHandler",  # computes until the test ends
        model_path=str(model),
        endpoint_url=proxy.url,
        visibility_timeout_s=12,
        heartbeat_s=4,
        task_time_s=0.5,
        drain_deadline_s=0.5,
    )
    try:
        async with running(settings) as worker:
            # Extended by the retry: the held call was given up on, and is still held.
            await eventually(lambda: sample(worker.metrics, EXTENDED) >= 1, timeout_s=30)
            assert proxy.counts[DELAYED] == 1 and not proxy.landed
        assert worker.metrics.outcomes == {"released": 1}
        await eventually(lambda: proxy.landed, timeout_s=15)
        # No consumer is left: the released message stays visible, the late call landed
        # before the release did.
        await eventually(lambda: stage.counts(stage.queue_url) == (1, 0), timeout_s=6)
    finally:
        await proxy.stop()


async def test_a_hand_back_whose_hold_lapsed_while_it_waited_is_not_sent(
    stage: Stage, make_settings, tmp_path, caplog
):
    # The keeper's first extension is held 25 s by the proxy (its retry extends the
    # message). Then the task fails: its retry's hand-back must wait for the held call, and
    # the keeper extends a settled message no more, so the 10 s hold lapses meanwhile and
    # another consumer (the test) receives the message. Sent once the held call lands, the
    # hand-back's old receipt would make the new holder's message visible after the retry
    # delay (1 s); it is not sent.
    model = tmp_path / "model.bin"
    model.write_bytes(b"any")
    gate = tmp_path / "model.bin.go"
    proxy = _TellsWhenHeldCallLands(
        stage.endpoint,
        FaultPlan(visibility_delay_s=25.0, visibility_delay_rate=1.0, visibility_delay_calls=1),
    )
    await proxy.start()
    stage.send({"task_id": "gated", "input": _input(stage, "gated.npy")})
    settings = make_settings(
        handler="tests.worker.gates:GatedHandler",
        model_path=str(model),
        endpoint_url=proxy.url,
        visibility_timeout_s=10,
        heartbeat_s=3,
        retry_base_s=1,
    )
    taken: list[dict] = []

    def take() -> bool:
        got = stage.sqs.receive_message(
            QueueUrl=stage.queue_url, VisibilityTimeout=60, WaitTimeSeconds=1
        )
        taken.extend(got.get("Messages", []))
        return bool(taken)

    try:
        async with running(settings) as worker:
            await eventually(lambda: sample(worker.metrics, EXTENDED) >= 1, timeout_s=30)
            assert proxy.counts[DELAYED] == 1 and not proxy.landed
            proxy.plan.refusing = {"ReceiveMessage": 1.0}  # the worker takes nothing more
            gate.write_text("fail")
            await eventually(take, timeout_s=20)  # the lapse: the test holds it now
            assert not proxy.landed
            await eventually(lambda: outcome_count(worker, "retried") == 1, timeout_s=30)
            assert proxy.landed  # the hand-back waited for the held call
            await asyncio.sleep(3)  # past the retry delay a hand-back would have set
            # Still the test's: in flight, not made visible by the old receipt.
            assert stage.counts(stage.queue_url) == (0, 1)
    finally:
        await proxy.stop()
    assert "hand-back not sent: its hold lapsed while it waited" in caplog.text


async def test_extensions_keep_the_settings_cadence_whatever_the_ticks_timing(
    stage: Stage, make_settings
):
    # Visibility three heartbeats: an extension at a tick holds the message 6 s from its
    # call, which comes after the tick, so the next tick (4 s left) finds it not due and
    # the one after it does: every other tick, by `extension_every_ticks`. Judged by when
    # a late-running tick happened to run instead, it was due at every tick.
    stage.send({"task_id": "held", "input": _input(stage, "held.npy", first_cell=8.8)})
    settings = make_settings(
        handler="tests.handlers:ScriptedHandler", visibility_timeout_s=6, heartbeat_s=2
    )
    async with running(settings) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == 1, timeout_s=40)
    assert extension_every_ticks(6, 2) == 2
    # Held about 9 s: extended at an age in (2, 4], then 4 s later, (6, 8]; no third.
    assert expected_extensions(8.9, 6, 2) == 2
    assert sample(worker.metrics, EXTENDED) == 2
