"""WebSocket streaming through a real Envoy: the worker's ``GET /v1/ws`` behind a shard
listener built by ``mesh/snapshot.py`` (upgrade enabled), with and without the agent's
ext_proc filter, driven by the real ``websockets`` client.

Tokens through Envoy equal the HTTP API's through the same Envoy; a cancel and a client that
drops its TCP connection both cancel the sequence in the worker's engine; a socket idle for
longer than the heartbeat stays open; several sockets and several requests per socket
stream at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect

sys.path.insert(0, str(Path(__file__).parent))

from conftest import TEST_OPTIONS
from mesh_support import LOOPBACK, free_port, wait_until
from waiting import async_wait_until
from worker_service.fakes import FakeEngine, expected_text

from adaptermesh.agent.extproc import ExtProcConfig, ExtProcServer
from adaptermesh.agent.picker import EndpointBook
from adaptermesh.mesh.bootstrap import EnvoyProcess, build_bootstrap
from adaptermesh.mesh.cache import SnapshotCache
from adaptermesh.mesh.server import XdsServer
from adaptermesh.mesh.snapshot import ExtProcOptions
from adaptermesh.proto import assignment_pb2 as ap
from adaptermesh.worker.service import ServiceConfig, WorkerService, serve
from adaptermesh.worker.ws import WS_PATH, WebSocketLimits, mount_websocket

TIMEOUT = 20.0


class Worker:
    """A worker service with ``/v1/ws`` around the fake engine, on its own loop in a thread."""

    def __init__(self, limits: WebSocketLimits) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="worker", daemon=True)
        self.thread.start()

        async def start() -> tuple[FakeEngine, WorkerService, Any, int]:
            engine = FakeEngine(token_delay=0.01)
            service = WorkerService(engine, ServiceConfig())
            mount_websocket(service, limits)
            runner, port = await serve(service, LOOPBACK, 0)
            return engine, service, runner, port

        self.engine, self.service, self._runner, self.port = self.call(start())

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self.call(self._runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclasses.dataclass
class Mesh:
    worker: Worker
    envoy: EnvoyProcess
    port: int

    @property
    def ws_url(self) -> str:
        return f"ws://{LOOPBACK}:{self.port}{WS_PATH}"

    @property
    def http_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


@pytest.fixture(params=["plain", "ext_proc", "body"])
def mesh(request: pytest.FixtureRequest) -> Iterator[Mesh]:
    # A short heartbeat, so the idle test outlives several pings in a few seconds.
    worker = Worker(WebSocketLimits(heartbeat_s=1.0))
    processor = None
    ext_port = None
    options = TEST_OPTIONS
    port = free_port()
    assignment = ap.Assignment(
        version=1,
        reason="test",
        shards=[
            ap.Shard(
                id="s0",
                index=0,
                weight=10_000,
                state=ap.SHARD_STATE_ACTIVE,
                service_address=LOOPBACK,
                service_port=port,
                endpoints=[ap.Endpoint(address=LOOPBACK, port=worker.port, weight=1)],
            )
        ],
    )
    if request.param == "ext_proc":
        book = EndpointBook()
        book.set_assignment(assignment)
        processor = ExtProcServer(book, ExtProcConfig(base_model=FakeEngine.model_name))
        ext_port = processor.start()
        options = dataclasses.replace(TEST_OPTIONS, ext_proc=ExtProcOptions())
    if request.param == "body":
        options = dataclasses.replace(TEST_OPTIONS, route_by_body=True)
    cache = SnapshotCache(options=options)
    xds = XdsServer(cache)
    xds_port = xds.start()
    cache.set_assignment("node-ws", assignment)
    envoy = EnvoyProcess(
        build_bootstrap("node-ws", xds_port, ext_proc_port=ext_port, initial_fetch_timeout_s=5.0)
    )
    try:
        envoy.start(ready_timeout=20.0)
        state = Mesh(worker, envoy, port)

        def routable() -> bool:
            try:
                return httpx.get(f"{state.http_url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(routable, 15, what="the worker routable through Envoy", interval=0.1)
        yield state
    finally:
        envoy.cleanup()
        xds.stop(grace=0.1)
        if processor is not None:
            processor.stop()
        worker.close()


async def recv(ws: ClientConnection) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))


async def run_one(ws: ClientConnection, cid: Any) -> tuple[list[str], dict[str, Any]]:
    texts: list[str] = []
    while True:
        msg = await recv(ws)
        assert msg["id"] == cid, msg
        if msg["type"] != "token":
            return texts, msg
        texts.append(msg["text"])


async def sse(url: str, body: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    texts: list[str] = []
    usage: dict[str, Any] = {}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with (
        httpx.AsyncClient(timeout=TIMEOUT) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                texts.extend(c["text"] for c in chunk["choices"])
    return texts, usage


def test_tokens_through_envoy_equal_the_sse_stream(mesh: Mesh) -> None:
    async def main() -> None:
        body = {"model": "alpha", "prompt": "hello world", "max_tokens": 6}
        http_texts, http_usage = await sse(mesh.http_url, body)
        async with connect(mesh.ws_url) as ws:
            await ws.send(json.dumps({"id": "a", **body}))
            texts, done = await run_one(ws, "a")
        assert texts == http_texts
        assert "".join(texts) == expected_text(FakeEngine().tokenize("hello world"), "alpha", 6)
        assert done["type"] == "done"
        assert done["usage"] == http_usage

    asyncio.run(main())
    # The upgrade went through Envoy's shard listener, not around it.
    stats = mesh.envoy.stats("downstream_cx_upgrades_total")
    assert stats.get("http.shard_s0.downstream_cx_upgrades_total", 0) >= 1, stats


def test_cancel_and_tcp_drop_through_envoy_cancel_in_the_engine(mesh: Mesh) -> None:
    engine = mesh.worker.engine

    async def main() -> None:
        async with connect(mesh.ws_url) as ws:
            await ws.send(json.dumps({"id": "c", "prompt": "hi", "max_tokens": 100}))
            assert (await recv(ws))["type"] == "token"
            await ws.send(json.dumps({"type": "cancel", "id": "c"}))
            msg = await recv(ws)
            while msg["type"] == "token":
                msg = await recv(ws)
            assert msg["finish_reasons"] == ["cancelled"]
        await async_wait_until(lambda: len(engine.cancelled) == 1, TIMEOUT)

        dropped = await connect(mesh.ws_url)
        await dropped.send(json.dumps({"id": "d", "prompt": "hi", "max_tokens": 100}))
        assert (await recv(dropped))["type"] == "token"
        dropped.transport.abort()  # the client's TCP connection to Envoy just goes away
        await async_wait_until(lambda: len(engine.cancelled) == 2, TIMEOUT)
        await async_wait_until(
            lambda: not engine.running and mesh.worker.service.inflight == 0, TIMEOUT
        )

    asyncio.run(main())


def test_idle_socket_outlives_heartbeats_and_many_stream_at_once(mesh: Mesh) -> None:
    fake = FakeEngine()

    async def client(i: int) -> None:
        async with connect(mesh.ws_url) as ws:
            for j in range(3):
                await ws.send(json.dumps({"id": j, "prompt": f"p{i} {j}", "max_tokens": 4}))
            texts: dict[int, str] = {0: "", 1: "", 2: ""}
            finished = 0
            while finished < 3:
                msg = await recv(ws)
                if msg["type"] == "token":
                    texts[msg["id"]] += msg["text"]
                else:
                    assert msg["type"] == "done", msg
                    finished += 1
            for j in range(3):
                assert texts[j] == expected_text(fake.tokenize(f"p{i} {j}"), None, 4)

    async def main() -> None:
        async with connect(mesh.ws_url) as idle:
            started = time.monotonic()
            # Idle for three worker heartbeats: Envoy's zero route and stream idle timeouts
            # keep the socket open.
            await asyncio.sleep(3.0)
            await asyncio.gather(*(client(i) for i in range(4)))
            await idle.send(json.dumps({"id": "late", "prompt": "hi", "max_tokens": 2}))
            _, done = await run_one(idle, "late")
            assert done["type"] == "done"
            assert time.monotonic() - started >= 3.0

    asyncio.run(main())
