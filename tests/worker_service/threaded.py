"""A worker service on its own event loop in a thread, for synchronous callers (Hypothesis
tests drive it with a blocking httpx client, one example after another; a real Envoy sits in
front of it in the tracing tests)."""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from adaptermesh.loopthread import LoopThread
from adaptermesh.tracing import Tracing
from adaptermesh.worker.service import ServiceConfig, WorkerService, serve

LOOPBACK = "127.0.0.1"


@contextmanager
def threaded_service(
    make_engine: Callable[[], Any], tracing: Tracing | None = None, **config: Any
) -> Iterator[str]:
    """Yield the base URL of a service around ``make_engine()`` (built on the server's loop)."""
    thread = LoopThread("worker-service")

    async def start() -> tuple[Any, Any, int]:
        engine = make_engine()
        service = WorkerService(engine, ServiceConfig(**config), tracing)
        runner, port = await serve(service, LOOPBACK, 0)
        return engine, runner, port

    engine, runner, port = thread.start(start, timeout=120)
    loop = thread.loop
    assert loop is not None
    try:
        yield f"http://{LOOPBACK}:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        asyncio.run_coroutine_threadsafe(engine.shutdown(), loop).result(30)
        thread.stop()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def post_completion(port: int, headers: dict[str, str], model: str, max_tokens: int = 2) -> int:
    """POST a small completion to ``port``; the HTTP status."""
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=10)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps({"model": model, "prompt": "a b", "max_tokens": max_tokens}),
            headers={"content-type": "application/json", **headers},
        )
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()
