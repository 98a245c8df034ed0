"""Listener guards against slow and hostile clients (adaptermesh.httpserve) on the worker
service, the control plane's and the agent's listeners: header and body deadlines, header
caps (431), the connection cap (evict a stalled connection, else 503), the fd limit, 1,000
stalled connections while /health keeps answering, and CPU-heavy bodies kept off the loop.
"""

from __future__ import annotations

import asyncio
import json
import resource
import time

import httpx
import pytest
from aiohttp import web

from adaptermesh.agent.http import build_app
from adaptermesh.agent.metrics import AgentMetrics
from adaptermesh.httpserve import ListenerLimits, raise_fd_limit, serve_app

from .conftest import StartServer

FAST = ListenerLimits(
    header_timeout_s=0.3, body_timeout_s=0.3, keepalive_timeout_s=5.0, lingering_time_s=0.2
)


async def raw_request(port: int, data: bytes, *, timeout: float = 5.0) -> tuple[int, dict]:
    """Send ``data`` on a fresh connection; return the status and JSON body the server sends."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(timeout):
            raw = await reader.read()  # until the server closes
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)


async def stalled(
    port: int, n: int, data: bytes = b"GET /health HTTP/1.1\r\nHost: x\r\n"
) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    conns = []
    for _ in range(n):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(data)
        conns.append((reader, writer))
    for _, writer in conns:
        await writer.drain()
    return conns


def close_all(conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]) -> None:
    for _, writer in conns:
        writer.transport.abort()


def port_of(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


# --------------------------------------------------------------------------------- deadlines
async def test_partial_headers_get_408_json_at_the_header_deadline(
    start_server: StartServer,
) -> None:
    server = await start_server(listener=FAST)
    started = time.monotonic()
    status, body = await raw_request(port_of(server), b"GET /health HTTP/1.1\r\nHost: x\r\n")
    assert status == 408
    assert body["error"]["code"] == "header_timeout"
    assert 0.25 < time.monotonic() - started < 3.0


async def test_slow_body_gets_408_json_at_the_body_deadline(start_server: StartServer) -> None:
    server = await start_server(listener=FAST)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"prompt":'
    )
    status, body = await raw_request(port_of(server), head)
    assert status == 408
    assert body["error"]["code"] == "body_timeout"
    assert (await server.client.get("/health")).status_code == 200


async def test_keepalive_connection_is_not_cut_by_the_header_deadline(
    start_server: StartServer,
) -> None:
    server = await start_server(listener=FAST)
    for _ in range(3):
        assert (await server.client.get("/health")).status_code == 200
        await asyncio.sleep(0.4)  # longer than the header deadline, shorter than keep-alive
    assert (await server.client.get("/health")).status_code == 200


# ------------------------------------------------------------------------------ header caps
@pytest.mark.parametrize(
    ("what", "headers"),
    [
        ("one long field", b"X-Big: " + b"a" * 9000 + b"\r\n"),
        ("too many fields", b"".join(b"X-%d: 1\r\n" % i for i in range(150))),
        ("too many bytes in all", b"".join(b"X-%d: %s\r\n" % (i, b"b" * 1000) for i in range(40))),
    ],
)
async def test_oversized_headers_get_431_json(
    start_server: StartServer, what: str, headers: bytes
) -> None:
    server = await start_server()
    status, body = await raw_request(
        port_of(server), b"GET /health HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n"
    )
    assert status == 431, what
    assert body["error"]["code"] == "headers_too_large"
    assert (await server.client.get("/health")).status_code == 200


async def test_long_request_line_gets_431_json(start_server: StartServer) -> None:
    server = await start_server()
    status, body = await raw_request(
        port_of(server), b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    assert status == 431
    assert body["error"]["type"] == "invalid_request_error"


async def test_garbage_gets_400_json(start_server: StartServer) -> None:
    server = await start_server()
    status, body = await raw_request(port_of(server), b"\x16\x03\x01 not http\r\n\r\n")
    assert status == 400
    assert body["error"]["code"] == "bad_request"


# -------------------------------------------------------------------------- connection cap
async def test_at_the_cap_a_stalled_connection_makes_room(start_server: StartServer) -> None:
    server = await start_server(listener=ListenerLimits(max_connections=16))
    conns = await stalled(port_of(server), 16)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as fresh:
            assert (await fresh.get("/health")).status_code == 200
        # The oldest stalled connection was the one evicted, with a JSON 408.
        reader = conns[0][0]
        async with asyncio.timeout(5):
            answer = await reader.read()
        assert b" 408 " in answer.split(b"\r\n", 1)[0]
    finally:
        close_all(conns)


async def test_at_the_cap_with_no_stalled_connection_new_ones_get_503(
    start_server: StartServer,
) -> None:
    server = await start_server(listener=ListenerLimits(max_connections=4))
    # Complete headers, body pending: busy requests, which are never evicted.
    busy = await stalled(
        port_of(server),
        4,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{",
    )
    try:
        await asyncio.sleep(0.1)
        started = time.monotonic()
        status, body = await raw_request(port_of(server), b"GET /health HTTP/1.1\r\n\r\n")
        assert status == 503
        assert body["error"]["code"] == "too_many_connections"
        assert time.monotonic() - started < 1.0
    finally:
        close_all(busy)
    await asyncio.sleep(0.1)
    async with httpx.AsyncClient(base_url=server.url, timeout=5) as fresh:
        assert (await fresh.get("/health")).status_code == 200


async def test_serving_raises_the_soft_fd_limit_to_the_hard_one(start_server: StartServer) -> None:
    await start_server()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == hard or hard == resource.RLIM_INFINITY
    assert raise_fd_limit() == soft


# ------------------------------------------------------------------------------- slowloris
@pytest.mark.slow
async def test_health_answers_under_1000_stalled_connections(start_server: StartServer) -> None:
    server = await start_server()
    port = port_of(server)
    conns = await stalled(port, 1000, b"GET /hea")
    try:
        # Every probe is answered, each within the client's timeout; how fast (p50/p99) is
        # bench/bench_http_hardening.py's figure, not a bound a loaded CI machine must meet.
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as fresh:
            for i in range(200):
                if i % 20 == 0:  # keep dribbling, as slowloris does
                    for _, writer in conns:
                        writer.write(b"l")
                r = await fresh.get("/health")
                assert r.status_code == 200
    finally:
        close_all(conns)


# ----------------------------------------------------------------------- other listeners
async def test_control_plane_metrics_listener_has_the_guards() -> None:
    from adaptermesh.control_plane.metrics import ControlPlaneMetrics, serve_metrics

    runner = await serve_metrics(ControlPlaneMetrics(), "127.0.0.1", 0)
    try:
        port = int(runner.addresses[0][1])
        status, body = await raw_request(
            port, b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n"
        )
        assert status == 431
        assert body["error"]["code"] == "headers_too_large"
    finally:
        await runner.cleanup()


async def test_agent_app_served_with_the_guards() -> None:
    app = build_app(AgentMetrics(), lambda: (True, {}), lambda: True, dict, lambda _s: {})
    runner, port = await serve_app(app, "127.0.0.1", 0, FAST)
    try:
        status, body = await raw_request(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        assert status == 408
        assert body["error"]["code"] == "header_timeout"
        async with httpx.AsyncClient(timeout=5) as client:
            assert (await client.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200
    finally:
        await runner.cleanup()


async def test_agent_app_keeps_its_header_caps_on_a_plain_runner() -> None:
    app = build_app(AgentMetrics(), lambda: (True, {}), lambda: True, dict, lambda _s: {})
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = int(runner.addresses[0][1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"GET /healthz HTTP/1.1\r\n"
            + b"".join(b"X-%d: 1\r\n" % i for i in range(150))
            + b"\r\n"
        )
        async with asyncio.timeout(5):
            answer = await reader.read()
        writer.close()
        assert answer.split(b" ", 2)[1] == b"400"
    finally:
        await runner.cleanup()


def test_worker_cli_listener_options_default_to_the_listener_limits() -> None:
    from adaptermesh.worker.cli import build_parser

    base = ["--model", "m", "--adapter-root", "r"]
    args = build_parser().parse_args(base)
    d = ListenerLimits()
    assert (
        args.max_connections,
        args.header_timeout,
        args.body_timeout,
        args.keepalive_timeout,
    ) == (d.max_connections, d.header_timeout_s, d.body_timeout_s, d.keepalive_timeout_s)
    args = build_parser().parse_args([*base, "--max-connections", "64", "--header-timeout", "3"])
    assert (args.max_connections, args.header_timeout) == (64, 3.0)


async def test_a_connection_that_sends_nothing_is_closed_without_an_answer(
    start_server: StartServer,
) -> None:
    server = await start_server(listener=FAST)
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(server))
    try:
        async with asyncio.timeout(3):
            assert await reader.read() == b""
    finally:
        writer.close()


async def test_evicting_an_idle_kept_alive_connection_sends_no_answer(
    start_server: StartServer,
) -> None:
    server = await start_server(listener=ListenerLimits(max_connections=2))
    port = port_of(server)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    async with asyncio.timeout(3):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(
                line.split(b":")[1]
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
        )
        await reader.readexactly(length)
    try:
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=5) as a,
            httpx.AsyncClient(base_url=server.url, timeout=5) as b,
        ):
            assert (await a.get("/health")).status_code == 200
            assert (await b.get("/health")).status_code == 200
        async with asyncio.timeout(3):
            assert await reader.read() == b""  # closed, with no unasked-for 408
    finally:
        writer.close()


async def test_refused_connections_are_counted_by_reason(start_server: StartServer) -> None:
    server = await start_server(listener=FAST)
    port = port_of(server)
    await raw_request(port, b"GET /health HTTP/1.1\r\nHost: x\r\n")
    await raw_request(port, b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n")
    await raw_request(port, b"\x16\x03\x01 not http\r\n\r\n")
    counter = server.service.metrics.listener_refused
    for reason in ("header_timeout", "headers_too_large", "bad_request"):
        assert counter.labels(reason=reason)._value.get() == 1, reason
    text = (await server.client.get("/metrics")).text
    assert 'adaptermesh_http_connections_refused_total{reason="header_timeout"} 1.0' in text


async def test_oversized_headers_in_one_read_never_reach_the_handler(
    start_server: StartServer,
) -> None:
    server = await start_server()
    body = b'{"prompt": "a b", "max_tokens": 2}'
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + b"".join(b"X-%d: %s\r\n" % (i, b"b" * 1000) for i in range(40))
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )
    status, answer = await raw_request(port_of(server), request)
    assert status == 431
    assert answer["error"]["code"] == "headers_too_large"
    assert server.engine.submitted == []
    assert (
        server.service.metrics.listener_refused.labels(reason="headers_too_large")._value.get() == 1
    )
