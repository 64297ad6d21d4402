"""How every command runs its event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def run_async(main: Coroutine[Any, Any, int]) -> int:
    """Run on uvloop where it is installed: its loop is markedly cheaper per I/O call."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    result: int = uvloop.run(main)
    return result
