"""A real WorkerService on a fake engine, served from an event loop thread of its own, for
tests whose own code is synchronous (a real Envoy in front of it, an OTLP receiver)."""

from __future__ import annotations

import asyncio
import http.client
import json
from typing import Any

from adaptermesh.loopthread import LoopThread
from adaptermesh.tracing import Tracing
from adaptermesh.worker.service import ServiceConfig, WorkerService, serve
from worker_service.fakes import FakeEngine

LOOPBACK = "127.0.0.1"


class ThreadedWorker:
    def __init__(self, tracing: Tracing) -> None:
        self._thread = LoopThread("test-worker")

        async def start() -> tuple[Any, int]:
            return await serve(WorkerService(FakeEngine(), ServiceConfig(), tracing), LOOPBACK, 0)

        self.runner, self.port = self._thread.start(start, timeout=30)

    def close(self) -> None:
        loop = self._thread.loop
        if loop is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), loop).result(30)
        self._thread.stop()


def post_completion(port: int, headers: dict[str, str], model: str, max_tokens: int = 2) -> int:
    """POST a small completion to ``port``; the HTTP status."""
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=10)
    try:
        conn.request("POST", "/v1/completions",
                     body=json.dumps({"model": model, "prompt": "a b", "max_tokens": max_tokens}),
                     headers={"content-type": "application/json", **headers})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()
