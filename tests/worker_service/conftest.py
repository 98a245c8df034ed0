"""Fixtures: a worker service on an ephemeral 127.0.0.1 port around a given engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from adaptermesh.worker.service import ServiceConfig, WorkerService, serve

from .fakes import FakeEngine


@dataclass
class Server:
    url: str
    service: WorkerService
    engine: Any
    client: httpx.AsyncClient


StartServer = Callable[..., Awaitable[Server]]


@pytest.fixture
async def start_server() -> AsyncIterator[StartServer]:
    runners = []
    clients = []

    async def start(engine: Any = None, **config: Any) -> Server:
        engine = engine if engine is not None else FakeEngine()
        service = WorkerService(engine, ServiceConfig(**config))
        runner, port = await serve(service, "127.0.0.1", 0)
        runners.append(runner)
        url = f"http://127.0.0.1:{port}"
        # A deadline, not a latency check: a queued request's first byte waits for the ones
        # ahead of it, which on a loaded two-core machine can take well over 30 s.
        client = httpx.AsyncClient(base_url=url, timeout=120)
        clients.append(client)
        return Server(url, service, engine, client)

    yield start
    for client in clients:
        await client.aclose()
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def server(start_server: StartServer) -> Server:
    return await start_server()
