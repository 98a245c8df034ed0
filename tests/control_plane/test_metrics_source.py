"""Scraping and the Prometheus source against local aiohttp servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from adaptermesh.control_plane.http_client import KeptClient
from adaptermesh.control_plane.metrics_source import (
    PrometheusSource,
    ScrapeSource,
    Target,
    parse_metrics,
)
from adaptermesh.control_plane.rollout import ScrapeAdapterSource

EXPOSITION = """\
# HELP vllm:num_requests_waiting waiting
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{model_name="m"}} {waiting}
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="m"}} 4
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{model_name="m"}} 0.25
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters="c"}} 1.7e9
# TYPE adaptermesh_time_to_first_token_seconds histogram
adaptermesh_time_to_first_token_seconds_bucket{{le="+Inf"}} {count}
adaptermesh_time_to_first_token_seconds_sum {ttft_sum}
adaptermesh_time_to_first_token_seconds_count {count}
# TYPE adaptermesh_generation_tokens counter
adaptermesh_generation_tokens_total {tokens}
# TYPE adaptermesh_free_gpu_memory_bytes gauge
adaptermesh_free_gpu_memory_bytes 8e9
"""


def test_parse_tolerates_missing_and_unknown_series() -> None:
    raw = parse_metrics(EXPOSITION.format(waiting=2, count=10, ttft_sum=1.0, tokens=500))
    assert raw.waiting == 2
    assert raw.running == 4
    assert raw.ttft_count == 10
    assert raw.tokens_total == 500
    assert raw.running_adapters == {"a", "b"}
    assert raw.waiting_adapters == {"c"}
    assert raw.resident_adapters >= {"a", "b"}
    assert raw.gpu_free_bytes == 8e9
    partial = parse_metrics("# TYPE other gauge\nother 1\nvllm:num_requests_running 3\n")
    assert partial.running == 3
    assert partial.waiting is None
    assert partial.tokens_total is None
    assert parse_metrics("").series == 0
    older = parse_metrics("adaptermesh_ttft_seconds_sum 2\nadaptermesh_ttft_seconds_count 4\n")
    assert (older.ttft_sum, older.ttft_count) == (2, 4)


@contextlib.asynccontextmanager
async def serving(
    path: str, handler: Callable[[web.Request], Awaitable[web.Response]]
) -> AsyncIterator[int]:
    """``handler`` at ``path`` on an ephemeral loopback port (bound to 0), yielding the port."""
    app = web.Application()
    app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


@pytest.fixture
async def worker() -> AsyncIterator[tuple[int, dict[str, object]]]:
    state: dict[str, object] = {
        "waiting": 0,
        "count": 0,
        "ttft_sum": 0.0,
        "tokens": 0,
        "delay": 0.0,
        "status": 200,
    }

    state["inflight"] = state["peak"] = 0

    async def metrics(request: web.Request) -> web.Response:
        state["inflight"] = int(state["inflight"]) + 1  # type: ignore[call-overload]
        state["peak"] = max(int(state["peak"]), int(state["inflight"]))  # type: ignore[call-overload]
        try:
            # A slow worker: the answer comes after ``delay`` seconds.
            await asyncio.sleep(float(state["delay"]))  # type: ignore[arg-type]
        finally:
            state["inflight"] = int(state["inflight"]) - 1  # type: ignore[call-overload]
        if state["status"] != 200:
            return web.Response(status=int(state["status"]))  # type: ignore[call-overload]
        return web.Response(
            text=EXPOSITION.format(
                **{k: state[k] for k in ("waiting", "count", "ttft_sum", "tokens")}
            )
        )

    async with serving("/metrics", metrics) as port:
        yield port, state


async def test_scrape_rates_timeouts_and_staleness(worker: tuple[int, dict[str, object]]) -> None:
    port, state = worker
    # A generous timeout while the worker answers at once (a busy machine can take longer
    # than a fraction of a second to serve loopback), a short one once it is made slow.
    src = ScrapeSource(interval_s=1.0, timeout_s=10.0)
    targets = [Target("s", "127.0.0.1", port), Target("s", "127.0.0.1", 1)]  # port 1: refused
    first = await src.collect(targets, now=100.0)
    good, dead = first[f"127.0.0.1:{port}"], first["127.0.0.1:1"]
    assert good.known
    assert good.latency_s is None  # one scrape gives no rate yet
    assert not dead.known  # never scraped: unknown, not idle
    state.update(count=20, ttft_sum=3.0, tokens=1000)
    second = (await src.collect(targets, now=102.0))[f"127.0.0.1:{port}"]
    assert second.age_s == 0, src.errors
    assert second.latency_s == pytest.approx(0.15)
    assert second.tokens_per_s == pytest.approx(500.0)
    assert second.requested_adapters == {"a", "b", "c"}
    # A slow worker times out; inside three intervals its last reading stands, then unknown.
    state["delay"] = 1.0
    src.timeout_s = 0.3
    third = (await src.collect(targets, now=104.0))[f"127.0.0.1:{port}"]
    assert third.known
    assert third.age_s == pytest.approx(2.0)
    fourth = (await src.collect(targets, now=105.5))[f"127.0.0.1:{port}"]
    assert not fourth.known
    assert (
        "Timeout" in src.errors[f"127.0.0.1:{port}"]
        or "timeout" in src.errors[f"127.0.0.1:{port}"].lower()
    )


async def test_scrapes_run_concurrently(worker: tuple[int, dict[str, object]]) -> None:
    port, state = worker
    state["delay"] = 0.2
    src = ScrapeSource(interval_s=1.0, timeout_s=1.0)
    # The same worker 20 times, each answer 0.2 s late: all twenty are in flight at once
    # (serial scraping would have one at a time), under the default concurrency cap of 64.
    many = [Target("s", "127.0.0.1", port) for _ in range(20)]
    out = await src.collect(many, now=1.0)
    assert all(o.known for o in out.values())
    assert state["peak"] == 20
    small = ScrapeSource(interval_s=1.0, timeout_s=2.0, max_concurrency=3)
    state["peak"] = 0
    out = await small.collect(many, now=2.0)
    assert all(o.known for o in out.values())
    assert state["peak"] == 3  # the cap holds


@pytest.fixture
async def prometheus() -> AsyncIterator[tuple[int, Callable[[str], list[dict[str, object]]]]]:
    def answer(query: str) -> list[dict[str, object]]:
        inst = {"instance": "10.0.0.1:8000"}
        if query.startswith("vllm:lora_requests_info"):
            return [
                {
                    "metric": inst | {"running_lora_adapters": "a", "waiting_lora_adapters": "b"},
                    "value": [1, "1"],
                }
            ]
        values = {
            "waiting": "3",
            "running": "5",
            "max by": "0.5",
            "rate(adaptermesh_time_to_first": "0.2",
            "rate(adaptermesh_generation": "800",
            "adaptermesh_free_gpu_memory_bytes": "1e9",
        }
        for key, v in values.items():
            if key in query:
                return [{"metric": inst, "value": [1, v]}]
        return []

    async def handler(request: web.Request) -> web.Response:
        q = request.query["query"]
        return web.json_response(
            {"status": "success", "data": {"resultType": "vector", "result": answer(q)}}
        )

    async with serving("/api/v1/query", handler) as port:
        yield port, answer


async def test_prometheus_source(prometheus: tuple[int, object]) -> None:
    port, _ = prometheus
    src = PrometheusSource(f"http://127.0.0.1:{port}", interval_s=1.0)
    out = await src.collect(
        [Target("s", "10.0.0.1", 8000), Target("s", "10.0.0.2", 8000)], now=10.0
    )
    w = out["10.0.0.1:8000"]
    assert w.known
    assert w.waiting == 3
    assert w.running == 5
    assert w.latency_s == pytest.approx(0.2)
    assert w.tokens_per_s == 800
    assert w.requested_adapters == {"a", "b"}
    assert not out["10.0.0.2:8000"].known


async def test_scrapes_keep_one_client_and_its_connections() -> None:
    """Round after round, both scrape sources use one kept client: no new client (and TLS
    context) per round, and the worker sees the same connection again (keep-alive)."""
    peers: list[object] = []

    async def seen_peer(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        return web.Response(text=EXPOSITION.format(waiting=0, count=0, ttft_sum=0.0, tokens=0))

    async with serving("/metrics", seen_peer) as own_port:
        own = [Target("s", "127.0.0.1", own_port)]
        src = ScrapeSource(interval_s=1.0, timeout_s=10.0)
        rollout_src = ScrapeAdapterSource(timeout_s=10.0)
        for i in range(4):
            assert (await src.collect(own, now=float(i)))[own[0].key].known
            assert own[0].key in await rollout_src.collect(own, ["a"])
        assert src._kept.built == 1
        assert rollout_src._kept.built == 1
        assert len(peers) == 8
        assert len(set(peers)) == 2  # one connection per source, reused every round
        await src.aclose()
        await rollout_src.aclose()
        # Closed: the next round builds a new client rather than failing.
        assert (await src.collect(own, now=10.0))[own[0].key].known
        assert src._kept.built == 2
        await src.aclose()


def test_a_kept_client_is_rebuilt_on_a_new_event_loop() -> None:
    """A client is bound to the loop it was built on: a source used from a second
    ``asyncio.run`` builds another instead of reusing one whose loop has closed."""
    kept = KeptClient()
    first = asyncio.run(_get(kept))
    second = asyncio.run(_get(kept))
    assert first is not second
    assert kept.built == 2


async def _get(kept: KeptClient) -> object:
    return kept.get()
