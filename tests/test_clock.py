"""``sleep_or_stop``: the wait every control-plane loop runs between its steps."""

from __future__ import annotations

import asyncio

import pytest

from adaptermesh.clock import SystemClock, sleep_or_stop


async def test_stop_ends_a_long_sleep_at_once_and_leaves_no_task() -> None:
    stop = asyncio.Event()
    before = asyncio.all_tasks()
    waiter = asyncio.ensure_future(sleep_or_stop(SystemClock(), 3600.0, stop))
    await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(waiter, 1.0)
    await asyncio.sleep(0)  # let the cancelled sleeper finish cancelling
    assert asyncio.all_tasks() - before == set()


async def test_the_sleep_ends_the_wait_when_no_stop_comes() -> None:
    await asyncio.wait_for(sleep_or_stop(SystemClock(), 0.01, asyncio.Event()), 1.0)


async def test_cancelling_the_caller_cancels_both_waits() -> None:
    before = asyncio.all_tasks()
    waiter = asyncio.ensure_future(sleep_or_stop(SystemClock(), 3600.0, asyncio.Event()))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await asyncio.sleep(0)
    assert asyncio.all_tasks() - before == set()
