"""Bounded waits for tests: every coroutine a test runs and every condition it polls has a deadline, so a
hang fails the test with a TimeoutError naming what it waited for instead of holding CI until its limit."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import uvloop

T = TypeVar("T")


def run_bounded(coro: Awaitable[T], timeout: float, loop: asyncio.AbstractEventLoop | None = None) -> T:
    """Run ``coro`` to its end within ``timeout`` seconds: on ``loop`` (a test rig's own event loop, kept
    between calls) or, by default, on a fresh uvloop loop, as actors run."""
    async def bounded() -> T:
        async with asyncio.timeout(timeout):
            return await coro
    if loop is None:
        return uvloop.run(bounded())
    return loop.run_until_complete(bounded())


async def until(cond: Callable[[], bool], timeout: float, what: str = "the condition",
                poll_s: float = 0.02) -> None:
    """Poll ``cond`` every ``poll_s`` seconds until it holds, for effects that have no event to await (a
    supervisor's restart count, a ZAP denial); TimeoutError naming ``what`` after ``timeout`` seconds."""
    try:
        async with asyncio.timeout(timeout):
            while not cond():
                await asyncio.sleep(poll_s)
    except TimeoutError:
        raise TimeoutError(f"waited {timeout:g} s for {what}") from None
