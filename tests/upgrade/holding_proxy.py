"""A proxy in front of the stand-in that holds every SQS send until it is killed.

    python -m tests.upgrade.holding_proxy TARGET PORT RECORD_PATH

A worker pointed at it writes its chain intents (S3 goes through untouched) and then
waits on sends that never arrive; SIGKILLed together, worker and proxy are a pod that died
between its intent and its send, with nothing left in flight to land later. Each message
asked of SQS is recorded (one JSON line in RECORD_PATH) before it is held.
"""

from __future__ import annotations

import asyncio
import sys

from proving.faults import SEND_OPERATIONS, FaultPlan, FaultProxy

HOLD_S = 24 * 3600.0  # longer than any test: the proxy dies first


async def serve(target: str, port: int, record_path: str) -> None:
    plan = FaultPlan(delays_s=dict.fromkeys(SEND_OPERATIONS, HOLD_S))
    proxy = FaultProxy(target, plan, port=port, record_path=record_path)
    await proxy.start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
