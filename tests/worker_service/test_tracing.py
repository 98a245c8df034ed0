"""Worker spans through a real OTLP/gRPC receiver: the client's W3C trace context is the
parent, and queueing, adapter resolution, prefill and decode are children with the adapter,
version, shard and tenant (and for resolution the tier that served the adapter and its load
time) as attributes. Off by default."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from otlp import OtlpReceiver
from waiting import async_wait_until

from adaptermesh.tracing import Tracing
from adaptermesh.worker.service import ServiceConfig, WorkerService, serve

from .fakes import FakeEngine

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.fixture
async def traced() -> AsyncIterator[tuple[httpx.AsyncClient, OtlpReceiver, FakeEngine]]:
    receiver = OtlpReceiver()
    port = receiver.start()
    tracing = Tracing.from_config(
        f"127.0.0.1:{port}", 1.0, "adaptermesh-worker", schedule_delay_millis=50
    )
    engine = FakeEngine()
    engine.on_disk.add("alpha@2.0.0")
    service = WorkerService(engine, ServiceConfig(), tracing)
    runner, wport = await serve(service, "127.0.0.1", 0)
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{wport}", timeout=30)
    try:
        yield client, receiver, engine
    finally:
        await client.aclose()
        await runner.cleanup()
        tracing.shutdown()
        receiver.stop()


async def test_spans_join_the_callers_trace_with_their_attributes(traced) -> None:  # type: ignore[no-untyped-def]
    client, receiver, _ = traced
    r = await client.post(
        "/v1/completions",
        json={"model": "alpha", "prompt": "a b c", "max_tokens": 4},
        headers={
            "traceparent": f"00-{TRACE}-{PARENT}-01",
            "x-adapter-version": "2.0.0",
            "x-tenant-id": "acme",
            "x-adaptermesh-shard": "s1",
        },
    )
    assert r.status_code == 200, r.text
    spans = await async_wait_until(
        lambda: (got := receiver.snapshot()) and len(got) >= 5 and got, 10, 0.05, what="five spans"
    )
    by = {s.name: s for s in spans}
    assert set(by) == {"worker completion", "queue", "adapter resolution", "prefill", "decode"}
    root = by["worker completion"]
    assert root.trace_id == TRACE
    assert root.parent_span_id == PARENT
    assert root.service == "adaptermesh-worker"
    for child in ("queue", "adapter resolution", "prefill", "decode"):
        assert by[child].trace_id == TRACE
        assert by[child].parent_span_id == root.span_id
        assert root.start_ns <= by[child].start_ns <= by[child].end_ns <= root.end_ns
    assert by["queue"].end_ns <= by["prefill"].start_ns
    assert by["prefill"].end_ns <= by["decode"].start_ns
    assert root.attributes["adaptermesh.adapter"] == "alpha"
    assert root.attributes["adaptermesh.adapter_version"] == "2.0.0"
    assert root.attributes["adaptermesh.shard"] == "s1"
    assert root.attributes["adaptermesh.tenant"] == "id-acme"  # the fair queue's tenant key
    assert root.attributes["adaptermesh.outcome"] == "length"
    assert by["prefill"].attributes["adaptermesh.prompt_tokens"] == 3
    # The fake engine reads a cold adapter "from disk", as the real scheduler reports it.
    resolution = by["adapter resolution"].attributes
    assert resolution["adaptermesh.adapter"] == "alpha@2.0.0"  # the version it served
    assert resolution["adaptermesh.adapter.tier"] == "disk"
    assert resolution["adaptermesh.adapter.cache_hit"] is False
    assert resolution["adaptermesh.adapter.load_ms"] == pytest.approx(3.0)
    assert by["queue"].end_ns <= by["adapter resolution"].start_ns


async def test_a_resident_adapter_resolves_as_a_gpu_hit(traced) -> None:  # type: ignore[no-untyped-def]
    client, receiver, _ = traced
    for _ in range(2):
        r = await client.post(
            "/v1/completions",
            json={"model": "beta", "prompt": "a", "max_tokens": 2},
            headers={"traceparent": f"00-{TRACE}-{PARENT}-01"},
        )
        assert r.status_code == 200, r.text
    got = await async_wait_until(
        lambda: (
            len(s := [x for x in receiver.snapshot() if x.name == "adapter resolution"]) >= 2 and s
        ),
        10,
        0.05,
        what="two resolution spans",
    )
    tiers = sorted(x.attributes["adaptermesh.adapter.tier"] for x in got)
    assert tiers == ["disk", "gpu"]
    hit = next(x for x in got if x.attributes["adaptermesh.adapter.tier"] == "gpu")
    assert hit.attributes["adaptermesh.adapter.cache_hit"] is True
    assert hit.attributes["adaptermesh.adapter.load_ms"] == 0.0


async def test_unsampled_parents_and_the_default_send_nothing(traced) -> None:  # type: ignore[no-untyped-def]
    client, receiver, _ = traced
    r = await client.post(
        "/v1/completions",
        json={"model": "alpha", "prompt": "a", "max_tokens": 2},
        headers={"traceparent": f"00-{TRACE}-{PARENT}-00"},
    )
    assert r.status_code == 200
    r = await client.post(
        "/v1/completions", json={"model": "alpha", "prompt": "a", "max_tokens": 2}
    )
    assert r.status_code == 200
    spans = await async_wait_until(
        lambda: receiver.snapshot() or None, 10, 0.05, what="the root trace's spans"
    )
    assert all(s.trace_id != TRACE for s in spans)  # the unsampled parent was followed
    assert Tracing.off().enabled is False
    assert WorkerService(FakeEngine()).tracing.enabled is False


def test_bad_ratios_are_refused() -> None:
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="trace_sample_ratio"):
            Tracing.from_config("127.0.0.1:1", bad)
