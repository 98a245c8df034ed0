"""A worker service on its own event loop in a thread, for synchronous callers (Hypothesis
tests drive it with a blocking httpx client, one example after another)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from adaptermesh.worker.service import ServiceConfig, WorkerService, serve


@contextmanager
def threaded_service(make_engine: Callable[[], Any], **config: Any) -> Iterator[str]:
    """Yield the base URL of a service around ``make_engine()`` (built on the server's loop)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="worker-service", daemon=True)
    thread.start()

    async def start() -> tuple[Any, Any, int]:
        engine = make_engine()
        service = WorkerService(engine, ServiceConfig(**config))
        runner, port = await serve(service, "127.0.0.1", 0)
        return engine, runner, port

    engine, runner, port = asyncio.run_coroutine_threadsafe(start(), loop).result(120)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        asyncio.run_coroutine_threadsafe(engine.shutdown(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
