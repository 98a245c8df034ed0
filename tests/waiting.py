"""The one wait helper for tests: poll a condition until it holds or a deadline passes.

A test waits for a state with these, never with a fixed ``time.sleep``/``asyncio.sleep``.
``wait_until`` returns the predicate's first truthy value, so a test can wait for a value
and use it.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["async_wait_until", "wait_until"]


def wait_until(
    predicate: Callable[[], T], timeout: float = 5.0, interval: float = 0.01, what: str = ""
) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


async def async_wait_until(
    predicate: Callable[[], T | Awaitable[T]],
    timeout: float = 5.0,
    interval: float = 0.01,
    what: str = "",
) -> T:
    """As :func:`wait_until`, on the event loop; ``predicate`` may be a coroutine function."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        await asyncio.sleep(interval)
