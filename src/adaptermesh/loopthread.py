"""An asyncio event loop on a thread of its own, for the grpc.aio servers (xDS, ext_proc) that
synchronous code starts and stops: the agent's datapath side, the demo and the tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import grpc

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str) -> None:
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, main: Callable[[], Coroutine[Any, Any, T]], timeout: float = 10.0) -> T:
        """Start the loop and run ``main()`` on it; on failure the loop is stopped again."""
        if self._thread is not None:
            raise RuntimeError(f"{self.name} already started")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name=self.name, daemon=True)
        thread.start()
        self.loop, self._thread = loop, thread
        try:
            return asyncio.run_coroutine_threadsafe(main(), loop).result(timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self, server: grpc.aio.Server | None = None, grace: float = 0.5) -> None:
        """Stop ``server`` (if any, within ``grace``) on the loop, then the loop itself."""
        loop, thread = self.loop, self._thread
        if loop is None or thread is None:
            return
        if server is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(server.stop(grace), loop).result(grace + 10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        self.loop = self._thread = None
