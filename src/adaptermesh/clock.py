"""The one clock abstraction: every control-plane and agent loop reads time through a
:class:`Clock` it is handed, so tests drive it with :class:`FakeClock` instead of sleeping.

``time()`` is wall-clock seconds since the epoch (timestamps and TTLs, which survive
restarts); ``monotonic()`` is for intervals and staleness; ``sleep()`` waits on the clock's
own time (a fake one advances instead of waiting).
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

__all__ = ["Clock", "FakeClock", "SystemClock", "sleep_or_stop"]


class Clock(Protocol):
    def time(self) -> float:
        """Wall-clock seconds since the epoch: timestamps and TTLs (they survive restarts)."""
        ...

    def monotonic(self) -> float:
        """Seconds for intervals and staleness."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class FakeClock:
    """A clock that moves only when told to; ``sleep`` advances it and yields once."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._t = start
        self._mono = 1000.0

    def time(self) -> float:
        return self._t

    def monotonic(self) -> float:
        return self._mono

    def step(self, seconds: float) -> None:
        self._t += seconds
        self._mono += seconds

    async def sleep(self, seconds: float) -> None:
        self.step(seconds)
        await asyncio.sleep(0)


async def sleep_or_stop(clock: Clock, seconds: float, stop: asyncio.Event) -> None:
    """Wait ``seconds`` on ``clock`` or until ``stop`` is set, whichever comes first; the
    loser is cancelled (also when the caller is), so a stopped loop leaves nothing behind."""
    sleeper = asyncio.ensure_future(clock.sleep(seconds))
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({sleeper, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeper.cancel()
        stopper.cancel()
