"""Waiting helpers shared by the test folders."""

from __future__ import annotations

import asyncio
import time


async def wait_for(pred, timeout: float = 5.0, interval: float = 0.02) -> bool:  # type: ignore[no-untyped-def]
    """Poll ``pred`` (a function or a coroutine function) every ``interval`` seconds until it is
    true; False on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await pred() if asyncio.iscoroutinefunction(pred) else pred():
            return True
        await asyncio.sleep(interval)
    return False


def wait_until(cond, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    """Blocking: poll ``cond`` until it is true; its last value on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()
