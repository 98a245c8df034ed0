"""``GET /v1/ws``: WebSocket streaming on the worker, driven with the real ``websockets`` client.

The fake engine (tests/worker_service/fakes.py) gives tokens that are a pure function of the
request, and records every cancelled sequence; the tiny real engine checks that greedy tokens
over the socket are the HTTP API's and that a cancel frees the engine's sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from waiting import async_wait_until
from websockets.asyncio.client import ClientConnection, connect
from websockets.sync.client import connect as sync_connect
from worker_service.fakes import FakeEngine, expected_text
from worker_service.strategies import BODY_LEVEL_CODES, FIELDS, HOSTILE, encode

from adaptermesh.worker.cli import run_worker
from adaptermesh.worker.service import ServiceConfig, WorkerService, serve
from adaptermesh.worker.ws import WS_PATH, WebSocketLimits, mount_websocket

TIMEOUT = 30.0


@dataclass
class Server:
    url: str
    ws_url: str
    service: WorkerService
    engine: Any
    client: httpx.AsyncClient


StartServer = Callable[..., Awaitable[Server]]


@pytest.fixture
async def start_server() -> AsyncIterator[StartServer]:
    runners = []
    clients = []

    async def start(
        engine: Any = None, limits: WebSocketLimits | None = None, **config: Any
    ) -> Server:
        engine = engine if engine is not None else FakeEngine()
        service = WorkerService(engine, ServiceConfig(**config))
        mount_websocket(service, limits)
        runner, port = await serve(service, "127.0.0.1", 0)
        runners.append(runner)
        client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT)
        clients.append(client)
        return Server(
            f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}{WS_PATH}", service, engine, client
        )

    yield start
    for client in clients:
        await client.aclose()
    for runner in runners:
        await runner.cleanup()


async def recv(ws: ClientConnection) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))


async def run_one(ws: ClientConnection, cid: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The token messages and the final (done or error) message of request ``cid``."""
    tokens = []
    while True:
        msg = await recv(ws)
        assert msg["id"] == cid, msg
        if msg["type"] == "token":
            tokens.append(msg)
        else:
            return tokens, msg


async def drain(ws: ClientConnection) -> None:
    """Read until the socket closes."""
    while True:
        await asyncio.wait_for(ws.recv(), TIMEOUT)


def metric(service: WorkerService, name: str, **labels: str) -> float:
    value = service.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def sse_texts(server: Server, path: str, body: dict[str, Any]) -> tuple[list[str], dict]:
    """The text of each SSE chunk of a streamed HTTP request, and its usage."""
    texts: list[str] = []
    usage: dict = {}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with server.client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                if "text" in choice:
                    texts.append(choice["text"])
                elif "content" in choice["delta"]:
                    texts.append(choice["delta"]["content"])
    return texts, usage


# --------------------------------------------------------------------------- token streams
async def test_completion_tokens_and_usage_equal_the_sse_stream(start_server: StartServer) -> None:
    server = await start_server()
    body = {"model": "alpha", "prompt": "hello world", "max_tokens": 6}
    http_texts, http_usage = await sse_texts(server, "/v1/completions", body)
    async with connect(server.ws_url) as ws:
        await ws.send(json.dumps({"id": "a", "type": "completion", **body}))
        tokens, done = await run_one(ws, "a")
    assert [t["text"] for t in tokens] == http_texts
    assert "".join(http_texts) == expected_text(FakeEngine().tokenize("hello world"), "alpha", 6)
    assert done["type"] == "done"
    assert done["usage"] == http_usage
    assert done["finish_reasons"] == ["length"]
    assert tokens[-1]["finish_reason"] == "length"
    assert done["model"] == "alpha"
    assert done["request_id"].startswith("cmpl-")


async def test_chat_over_the_socket_equals_the_sse_stream(start_server: StartServer) -> None:
    server = await start_server()
    body = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4}
    http_texts, http_usage = await sse_texts(server, "/v1/chat/completions", body)
    async with connect(server.ws_url) as ws:
        await ws.send(json.dumps({"id": 7, "type": "chat", **body}))
        tokens, done = await run_one(ws, 7)
    # The SSE stream opens with a role chunk of empty content; the socket sends tokens only.
    assert [""] + [t["text"] for t in tokens] == http_texts
    assert done["usage"] == http_usage
    assert done["request_id"].startswith("chatcmpl-")


async def test_n_choices_stream_with_their_index(start_server: StartServer) -> None:
    server = await start_server()
    async with connect(server.ws_url) as ws:
        await ws.send(json.dumps({"id": "n", "prompt": "a b", "max_tokens": 3, "n": 2, "seed": 5}))
        tokens, done = await run_one(ws, "n")
    assert sorted({t["index"] for t in tokens}) == [0, 1]
    assert done["finish_reasons"] == ["length", "length"]
    assert done["usage"]["completion_tokens"] == 6


async def test_greedy_tokens_over_the_socket_equal_http_on_the_tiny_model(
    start_server: StartServer, make_engine: Callable[..., Any]
) -> None:
    server = await start_server(make_engine())
    for model in ("tiny", "alpha"):
        body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
        http_texts, http_usage = await sse_texts(server, "/v1/completions", body)
        plain = (await server.client.post("/v1/completions", json=body)).json()
        async with connect(server.ws_url) as ws:
            await ws.send(json.dumps({"id": model, **body}))
            tokens, done = await run_one(ws, model)
        assert [t["text"] for t in tokens] == http_texts
        assert "".join(http_texts) == plain["choices"][0]["text"]
        assert all(isinstance(t["token_id"], int) for t in tokens)
        assert done["usage"] == http_usage == plain["usage"]


async def test_cancel_frees_the_engine_sequence_on_the_tiny_model(
    start_server: StartServer, make_engine: Callable[..., Any]
) -> None:
    engine = make_engine()
    server = await start_server(engine)
    async with connect(server.ws_url) as ws:
        await ws.send(
            json.dumps({"id": "c", "prompt": "Hello world", "max_tokens": 200, "temperature": 0})
        )
        first = await recv(ws)
        assert first["type"] == "token", first
        await async_wait_until(lambda: engine.stats().num_running == 1, TIMEOUT)
        await ws.send(json.dumps({"type": "cancel", "id": "c"}))
        msg = first
        while msg["type"] == "token":
            msg = await recv(ws)
        assert msg == {
            "id": "c",
            "type": "done",
            "request_id": msg["request_id"],
            "model": "tiny",
            "finish_reasons": ["cancelled"],
            "usage": None,
        }
        await async_wait_until(
            lambda: engine.stats().num_running == 0 and server.service.inflight == 0, TIMEOUT
        )
        assert engine.stats().kv_cache_usage == 0.0
        # The socket stays open and the engine serves the next request.
        await ws.send(json.dumps({"id": "next", "prompt": "Hi", "max_tokens": 2}))
        _, done = await run_one(ws, "next")
        assert done["type"] == "done"
    assert metric(server.service, "adaptermesh_websocket_requests_total", outcome="cancelled") == 1


# ------------------------------------------------------------------- concurrency and bounds
async def test_concurrent_requests_on_one_socket_interleave(start_server: StartServer) -> None:
    server = await start_server(FakeEngine(token_delay=0.002))
    fake = FakeEngine()
    prompts = {f"r{i}": " ".join(["x"] * (i + 1)) for i in range(6)}
    async with connect(server.ws_url) as ws:
        for cid, prompt in prompts.items():
            await ws.send(json.dumps({"id": cid, "prompt": prompt, "max_tokens": 5}))
        texts: dict[str, str] = {cid: "" for cid in prompts}
        order: list[str] = []
        done: set[str] = set()
        while len(done) < len(prompts):
            msg = await recv(ws)
            order.append(msg["id"])
            if msg["type"] == "token":
                texts[msg["id"]] += msg["text"]
            else:
                assert msg["type"] == "done", msg
                done.add(msg["id"])
    for cid, prompt in prompts.items():
        assert texts[cid] == expected_text(fake.tokenize(prompt), None, 5)
    # Several requests were streaming at once, not one after another.
    first_done = next(i for i, cid in enumerate(order) if order[i:].count(cid) == 1)
    assert len(set(order[:first_done])) > 1


async def test_over_the_inflight_bound_is_an_error_and_the_socket_stays_open(
    start_server: StartServer,
) -> None:
    server = await start_server(FakeEngine(token_delay=0.05), WebSocketLimits(max_inflight=2))
    async with connect(server.ws_url) as ws:
        for cid in ("a", "b", "c"):
            await ws.send(json.dumps({"id": cid, "prompt": "hi", "max_tokens": 3}))
        seen: dict[str, list[dict[str, Any]]] = {"a": [], "b": [], "c": []}
        while not all(seen[c] and seen[c][-1]["type"] != "token" for c in seen):
            msg = await recv(ws)
            seen[msg["id"]].append(msg)
        assert seen["c"] == [
            {
                "id": "c",
                "type": "error",
                "status": 429,
                "error": {
                    "message": seen["c"][0]["error"]["message"],
                    "type": "rate_limit_error",
                    "param": "id",
                    "code": "too_many_inflight",
                },
            }
        ]
        assert seen["a"][-1]["type"] == seen["b"][-1]["type"] == "done"
        await ws.send(json.dumps({"id": "c", "prompt": "hi", "max_tokens": 1}))
        _, done = await run_one(ws, "c")
        assert done["type"] == "done"


async def test_duplicate_id_in_flight_is_refused(start_server: StartServer) -> None:
    server = await start_server(FakeEngine(token_delay=0.05))
    async with connect(server.ws_url) as ws:
        await ws.send(json.dumps({"id": "a", "prompt": "hi", "max_tokens": 3}))
        await ws.send(json.dumps({"id": "a", "prompt": "hi", "max_tokens": 3}))
        msgs = []
        while not msgs or msgs[-1]["type"] != "done":
            msgs.append(await recv(ws))
        errors = [m for m in msgs if m["type"] == "error"]
        assert [e["error"]["code"] for e in errors] == ["duplicate_id"]
        assert errors[0]["error"]["param"] == "id"


async def test_tenant_queue_applies_to_socket_requests(start_server: StartServer) -> None:
    server = await start_server(
        FakeEngine(token_delay=0.05), max_running=1, max_waiting_per_tenant=1
    )
    headers = {"x-tenant-id": "t1"}
    async with connect(server.ws_url, additional_headers=headers) as ws:
        for cid in ("a", "b", "c"):
            await ws.send(json.dumps({"id": cid, "prompt": "hi", "max_tokens": 2}))
        finals: dict[str, dict[str, Any]] = {}
        while len(finals) < 3:
            msg = await recv(ws)
            if msg["type"] != "token":
                finals[msg["id"]] = msg
    # One runs, one waits, the third is over the tenant's queue: the HTTP API's 429.
    assert finals["a"]["type"] == finals["b"]["type"] == "done"
    assert finals["c"]["status"] == 429
    assert finals["c"]["error"]["code"] == "queue_full"
    assert (
        metric(server.service, "adaptermesh_requests_rejected_total", reason="tenant_queue_full")
        == 1
    )


# ----------------------------------------------------------------------- going away
async def test_client_close_mid_stream_cancels_every_request(start_server: StartServer) -> None:
    server = await start_server(FakeEngine(token_delay=0.05))
    engine = server.engine
    async with connect(server.ws_url) as ws:
        for cid in ("a", "b"):
            await ws.send(json.dumps({"id": cid, "prompt": "hi", "max_tokens": 100}))
        await recv(ws)
        await async_wait_until(lambda: len(engine.running) == 2, TIMEOUT)
    await async_wait_until(
        lambda: len(engine.cancelled) == 2 and server.service.inflight == 0, TIMEOUT
    )
    assert not engine.running
    assert (
        metric(server.service, "adaptermesh_websocket_requests_total", outcome="disconnected") == 2
    )
    await async_wait_until(
        lambda: (
            metric(server.service, "adaptermesh_websocket_sessions_total", close="client_closed")
            == 1
        ),
        TIMEOUT,
    )
    assert metric(server.service, "adaptermesh_requests_total", outcome="disconnected") == 2


async def test_tcp_drop_mid_stream_cancels_in_the_engine(start_server: StartServer) -> None:
    server = await start_server(FakeEngine(token_delay=0.05))
    engine = server.engine
    ws = await connect(server.ws_url)
    await ws.send(json.dumps({"id": "a", "prompt": "hi", "max_tokens": 100}))
    await recv(ws)
    ws.transport.abort()  # no close frame: the connection just drops
    await async_wait_until(lambda: engine.cancelled == [engine.submitted[0].request_id], TIMEOUT)
    await async_wait_until(lambda: server.service.inflight == 0 and not engine.running, TIMEOUT)
    await async_wait_until(
        lambda: (
            metric(server.service, "adaptermesh_websocket_sessions_total", close="disconnected")
            == 1
        ),
        TIMEOUT,
    )
    assert metric(server.service, "adaptermesh_websocket_sessions_open") == 0


async def test_a_client_that_does_not_read_is_closed_and_others_are_served(
    start_server: StartServer,
) -> None:
    # Enough output to overflow the server's kernel send buffer (its ceiling is tcp_wmem's
    # maximum) twice over, in 12 streams of ~80-byte token messages.
    wmem_max = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    per_request = max(8000, 2 * wmem_max // 80 // 12)
    server = await start_server(
        FakeEngine(max_model_len=per_request + 16),
        WebSocketLimits(send_buffer_bytes=16 << 10, close_timeout_s=10),
    )
    engine = server.engine
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    port = int(server.url.rsplit(":", 1)[1])
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    # max_queue=1: the client stops reading from TCP once one message waits unread.
    slow = await connect(server.ws_url, sock=sock, max_queue=1)
    ids = [f"r{i}" for i in range(12)]
    for cid in ids:
        await slow.send(json.dumps({"id": cid, "prompt": "x", "max_tokens": per_request}))
    # Another client is served while the slow one's messages back up.
    async with connect(server.ws_url) as other:
        await other.send(json.dumps({"id": "o", "prompt": "hi", "max_tokens": 3}))
        _, done = await run_one(other, "o")
        assert done["type"] == "done"
    await async_wait_until(lambda: len(engine.cancelled) == len(ids), TIMEOUT)
    assert server.service.inflight == 0
    assert engine.generated < len(ids) * per_request + 3
    # Reading again, the slow client finds the close frame behind its backlog.
    with pytest.raises(websockets.ConnectionClosed) as info:
        await drain(slow)
    assert info.value.rcvd is not None
    assert info.value.rcvd.code == 1008
    assert "not reading" in info.value.rcvd.reason
    await async_wait_until(
        lambda: (
            metric(server.service, "adaptermesh_websocket_sessions_total", close="slow_client") == 1
        ),
        TIMEOUT,
    )
    assert metric(
        server.service, "adaptermesh_websocket_requests_total", outcome="disconnected"
    ) == len(ids)
    async with connect(server.ws_url) as again:
        await again.send(json.dumps({"id": 1, "prompt": "hi", "max_tokens": 2}))
        _, done = await run_one(again, 1)
        assert done["type"] == "done"


async def test_a_client_that_answers_no_ping_is_closed_and_its_requests_cancelled(
    start_server: StartServer,
) -> None:
    server = await start_server(FakeEngine(token_delay=0.05), WebSocketLimits(heartbeat_s=0.4))
    engine = server.engine
    async with connect(server.ws_url) as ws:
        await ws.send(json.dumps({"id": "a", "prompt": "hi", "max_tokens": 100}))
        await recv(ws)
        # Still connected, but reading nothing: the server's pings go unanswered.
        ws.transport.pause_reading()
        await async_wait_until(lambda: len(engine.cancelled) == 1, TIMEOUT)
        await async_wait_until(
            lambda: (
                metric(server.service, "adaptermesh_websocket_sessions_total", close="disconnected")
                == 1
            ),
            TIMEOUT,
        )
        assert server.service.inflight == 0
        ws.transport.resume_reading()


async def test_pings_keep_an_idle_socket_open(start_server: StartServer) -> None:
    server = await start_server(limits=WebSocketLimits(heartbeat_s=0.2))
    async with connect(server.ws_url) as ws:
        await asyncio.sleep(1.0)  # five heartbeats, each answered by the client
        await ws.send(json.dumps({"id": "a", "prompt": "hi", "max_tokens": 1}))
        _, done = await run_one(ws, "a")
        assert done["type"] == "done"
    assert metric(server.service, "adaptermesh_websocket_sessions_total", close="disconnected") == 0


async def test_drain_refuses_new_requests_and_new_sockets(start_server: StartServer) -> None:
    server = await start_server()
    async with connect(server.ws_url) as ws:
        server.service.draining = True
        await ws.send(json.dumps({"id": "a", "prompt": "hi"}))
        _, error = await run_one(ws, "a")
        assert error["status"] == 503
        assert error["error"]["code"] == "draining"
    with pytest.raises(websockets.InvalidStatus) as info:
        await connect(server.ws_url)
    assert info.value.response.status_code == 503


# ------------------------------------------------------------------------ limits and abuse
async def test_message_over_the_body_limit_closes_with_1009(start_server: StartServer) -> None:
    server = await start_server(max_body_bytes=1024)
    async with connect(server.ws_url, max_size=None) as ws:
        await ws.send(json.dumps({"id": "a", "prompt": "x" * 900, "max_tokens": 1}))
        _, done = await run_one(ws, "a")
        assert done["type"] == "done"  # under the limit: served
        await ws.send(json.dumps({"id": "b", "prompt": "x" * 2000}))
        with pytest.raises(websockets.ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), TIMEOUT)
    assert info.value.rcvd is not None
    assert info.value.rcvd.code == 1009
    assert "1024 bytes" in info.value.rcvd.reason
    await async_wait_until(
        lambda: (
            metric(server.service, "adaptermesh_websocket_sessions_total", close="message_too_big")
            == 1
        ),
        TIMEOUT,
    )


async def test_binary_frame_closes_with_1003(start_server: StartServer) -> None:
    server = await start_server()
    async with connect(server.ws_url) as ws:
        await ws.send(b'{"id": "a", "prompt": "hi"}')
        with pytest.raises(websockets.ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), TIMEOUT)
    assert info.value.rcvd is not None
    assert info.value.rcvd.code == 1003
    assert "binary" in info.value.rcvd.reason


@pytest.mark.parametrize(
    ("message", "cid", "param", "code"),
    [
        ("not json", None, None, "invalid_json"),
        ("", None, None, "invalid_json"),
        ("[1, 2]", None, None, "invalid_json"),
        ('{"prompt": "hi"}', None, "id", "missing_field"),
        ('{"id": "", "prompt": "hi"}', None, "id", "invalid_value"),
        ('{"id": 1.5, "prompt": "hi"}', None, "id", "invalid_value"),
        ('{"id": "a", "type": "embedding", "prompt": "hi"}', "a", "type", "invalid_value"),
        ('{"id": "a", "prompt": "hi", "max_tokens": 0}', "a", "max_tokens", "invalid_value"),
        ('{"id": "a", "prompt": "hi", "temprature": 1}', "a", "temprature", "unknown_field"),
        ('{"id": "a"}', "a", "prompt", "missing_field"),
        ('{"id": "a", "type": "chat", "messages": []}', "a", "messages", None),
        ('{"id": "a", "model": "nope", "prompt": "hi"}', "a", "model", "model_not_found"),
        (
            '{"id": "a", "prompt": "x", "max_tokens": 500}',
            "a",
            "max_tokens",
            "context_length_exceeded",
        ),
        ('{"type": "cancel", "id": "zz"}', "zz", "id", "unknown_id"),
        ('{"type": "cancel", "id": "zz", "why": 1}', "zz", "why", "unknown_field"),
    ],
)
async def test_invalid_messages_answer_an_error_naming_the_field(
    start_server: StartServer, message: str, cid: Any, param: str | None, code: str | None
) -> None:
    server = await start_server()
    async with connect(server.ws_url) as ws:
        await ws.send(message)
        msg = await recv(ws)
        assert msg["type"] == "error", msg
        assert msg["id"] == cid
        error = msg["error"]
        assert error["param"] == param, error
        if code is not None:
            assert error["code"] == code, error
        if param is not None:
            assert param in error["message"], error
        assert 400 <= msg["status"] < 500
        # The socket stays open and serves the next request.
        await ws.send(json.dumps({"id": "ok", "prompt": "hi", "max_tokens": 1}))
        _, done = await run_one(ws, "ok")
        assert done["type"] == "done"
    assert server.service.inflight == 0


async def test_the_worker_process_serves_the_socket_and_closes_it_on_stop() -> None:
    stop = asyncio.Event()
    engine = FakeEngine(token_delay=0.05)
    closed: list[int] = []

    def ready(port: int) -> None:
        async def client() -> None:
            async with connect(f"ws://127.0.0.1:{port}{WS_PATH}") as ws:
                await ws.send(json.dumps({"id": "a", "prompt": "hi", "max_tokens": 2}))
                _, done = await run_one(ws, "a")
                assert done["type"] == "done"
                await ws.send(json.dumps({"id": "b", "prompt": "hi", "max_tokens": 100}))
                await recv(ws)
                stop.set()  # SIGTERM: drain, then the socket is closed with 1001
                with pytest.raises(websockets.ConnectionClosed) as info:
                    await drain(ws)
                assert info.value.rcvd is not None
                closed.append(info.value.rcvd.code)

        tasks.append(asyncio.create_task(client()))

    tasks: list[asyncio.Task[None]] = []
    config = ServiceConfig(drain_timeout_s=0.2)
    assert not await run_worker(engine, config, "127.0.0.1", 0, stop=stop, on_ready=ready)
    await asyncio.gather(*tasks)
    assert closed == [1001]
    assert len(engine.cancelled) == 1


async def test_plain_http_get_is_426(start_server: StartServer) -> None:
    server = await start_server()
    r = await server.client.get(WS_PATH)
    assert r.status_code == 426
    assert r.json()["error"]["code"] == "upgrade_required"


async def test_metrics_count_sessions_and_requests(start_server: StartServer) -> None:
    server = await start_server()
    async with connect(server.ws_url) as ws:
        await async_wait_until(
            lambda: metric(server.service, "adaptermesh_websocket_sessions_open") == 1, TIMEOUT
        )
        await ws.send(json.dumps({"id": "a", "prompt": "hi", "max_tokens": 2}))
        await run_one(ws, "a")
        await ws.send(json.dumps({"id": "b", "prompt": "hi", "max_tokens": 0}))
        await run_one(ws, "b")
    await async_wait_until(
        lambda: metric(server.service, "adaptermesh_websocket_sessions_open") == 0, TIMEOUT
    )
    assert metric(server.service, "adaptermesh_websocket_requests_total", outcome="length") == 1
    assert (
        metric(server.service, "adaptermesh_websocket_requests_total", outcome="invalid_value") == 1
    )
    assert (
        metric(server.service, "adaptermesh_websocket_sessions_total", close="client_closed") == 1
    )
    text = generate_latest(server.service.metrics.registry).decode()
    assert "# TYPE adaptermesh_websocket_sessions_total counter" in text
    assert "# TYPE adaptermesh_websocket_sessions_open gauge" in text


# ------------------------------------------------------------------- Hypothesis: hostile input
@contextlib.contextmanager
def threaded_ws_server(**config: Any) -> Iterator[tuple[str, WorkerService]]:
    """A worker with ``/v1/ws`` on its own loop in a thread, for the synchronous client."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="ws-worker", daemon=True)
    thread.start()

    async def start() -> tuple[WorkerService, Any, int]:
        service = WorkerService(FakeEngine(), ServiceConfig(**config))
        mount_websocket(service)
        runner, port = await serve(service, "127.0.0.1", 0)
        return service, runner, port

    service, runner, port = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    try:
        yield f"ws://127.0.0.1:{port}{WS_PATH}", service
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture(scope="module")
def ws_server() -> Iterator[tuple[str, WorkerService]]:
    with threaded_ws_server(max_body_bytes=64 << 10) as server:
        yield server


REQUEST_FIELDS = {**FIELDS["/v1/completions"], **FIELDS["/v1/chat/completions"]}
IDS = st.one_of(st.just("q"), st.integers(-5, 5), HOSTILE)


@st.composite
def messages(draw: st.DrawFn) -> str | bytes:
    """A socket message: mostly objects mixing good and hostile fields, ids and types."""
    kind = draw(st.sampled_from(["object"] * 8 + ["not_object", "broken"]))
    if kind == "not_object":
        return encode(draw(HOSTILE)).decode()
    if kind == "broken":
        raw = draw(
            st.sampled_from(
                [
                    b"",
                    b"{",
                    b'{"id": ',
                    b"\xff\xfe",
                    b"nul\x00l",
                    b"[" * 5000,
                    b'{"a":' * 5000,
                    b"x" * (70 << 10),
                ]
            )
        )
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return raw  # a binary frame
    body: dict[str, Any] = {}
    if draw(st.integers(0, 5)):
        body["id"] = draw(IDS)
    if draw(st.booleans()):
        body["type"] = draw(st.one_of(st.sampled_from(["completion", "chat", "cancel"]), HOSTILE))
    for name in draw(st.lists(st.sampled_from(sorted(REQUEST_FIELDS)), unique=True)):
        body[name] = draw(REQUEST_FIELDS[name]) if draw(st.booleans()) else draw(HOSTILE)
    for name in draw(st.lists(st.text(max_size=8), max_size=2)):
        body[name] = draw(HOSTILE)
    return encode(body).decode()


def check_error(msg: dict[str, Any], sent: str) -> None:
    """An error names a field the message had (or is about the message as a whole)."""
    assert 400 <= msg["status"] < 500, msg
    error = msg["error"]
    assert error["code"], error
    if error["code"] in BODY_LEVEL_CODES:
        return
    param = error["param"]
    assert param, error
    assert param in error["message"], error
    root = param.split("[", 1)[0].split(".", 1)[0]
    assert (
        root in REQUEST_FIELDS
        or root in ("id", "type", "prompt", "messages")
        or (json.dumps(root)[1:-1] in sent)
    ), error


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(message=messages())
def test_hostile_messages_never_crash_the_socket(
    ws_server: tuple[str, WorkerService], message: str | bytes
) -> None:
    url, _ = ws_server
    with sync_connect(url, max_size=None, open_timeout=TIMEOUT) as ws:
        ws.send(message)
        closed: websockets.ConnectionClosed | None = None
        try:
            while True:
                msg = json.loads(ws.recv(timeout=TIMEOUT))
                if msg["type"] == "error":
                    check_error(msg, message if isinstance(message, str) else "")
                    break
                if msg["type"] == "done":
                    break
                assert msg["type"] == "token", msg
        except websockets.ConnectionClosed as exc:
            closed = exc
        if closed is not None:
            # Only abuse of the protocol closes the socket, with the code that says which.
            assert closed.rcvd is not None
            expected = 1003 if isinstance(message, bytes) else 1009
            assert closed.rcvd.code == expected, (closed.rcvd, message[:80])
            assert closed.rcvd.reason
            return
        # Still open: it serves a good request.
        ws.send(json.dumps({"id": "after", "prompt": "hi", "max_tokens": 1}))
        while (msg := json.loads(ws.recv(timeout=TIMEOUT)))["type"] == "token" or (
            msg["id"] != "after"
        ):
            pass
        assert msg["type"] == "done", msg


async def test_echo_sends_the_prompt_first_and_best_of_is_refused(
    start_server: StartServer,
) -> None:
    server = await start_server()
    body = {"prompt": "hello world", "max_tokens": 3, "echo": True}
    http_texts, http_usage = await sse_texts(server, "/v1/completions", body)
    async with connect(server.ws_url) as ws:
        await ws.send(json.dumps({"id": "e", **body}))
        tokens, done = await run_one(ws, "e")
        assert [t["text"] for t in tokens] == http_texts
        assert tokens[0] == {
            "id": "e",
            "type": "token",
            "index": 0,
            "text": "hello world",
            "token_id": None,
            "finish_reason": None,
        }
        assert done["usage"] == http_usage
        await ws.send(json.dumps({"id": "b", "prompt": "x", "max_tokens": 1, "best_of": 2}))
        tokens, error = await run_one(ws, "b")
        assert tokens == []
        assert (error["type"], error["status"], error["error"]["param"]) == (
            "error",
            400,
            "best_of",
        )
    assert server.service.inflight == 0
