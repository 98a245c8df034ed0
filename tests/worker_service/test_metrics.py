"""/metrics against the fake engine: parses with prometheus-client, has every documented series
with the right labels, and the values follow what happened."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from adaptermesh.worker.types import AdapterInfo

from .conftest import Server, StartServer
from .fakes import FakeEngine
from .test_service import wait_until

# Every series the service documents (docs/worker-service.md), with its type and label names.
EXPECTED = {
    "vllm:num_requests_waiting": ("gauge", {"model_name"}),
    "vllm:num_requests_running": ("gauge", {"model_name"}),
    "vllm:kv_cache_usage_perc": ("gauge", {"model_name"}),
    "vllm:lora_requests_info": (
        "gauge",
        {"running_lora_adapters", "waiting_lora_adapters", "max_lora"},
    ),
    "vllm:gpu_cache_usage_perc": ("gauge", {"model_name"}),
    "vllm:lora_adapter_loaded": ("gauge", {"adapter_name", "level", "pinned", "rank"}),
    "vllm:num_gpu_loaded_lora_adapters": ("gauge", {"model_name"}),
    "vllm:max_gpu_lora_adapters": ("gauge", {"model_name"}),
    "vllm:lora_adapter_load_seconds": ("histogram", {"model_name"}),
    "vllm:time_to_first_token_seconds": ("histogram", {"model_name"}),
    "vllm:time_per_output_token_seconds": ("histogram", {"model_name"}),
    "vllm:e2e_request_latency_seconds": ("histogram", {"model_name"}),
    "vllm:prompt_tokens": ("counter", {"model_name"}),
    "vllm:generation_tokens": ("counter", {"model_name"}),
    "vllm:request_success": ("counter", {"model_name", "finished_reason"}),
    "adaptermesh_adapter_resident": ("gauge", {"adapter", "pinned"}),
    "adaptermesh_queue_depth": ("gauge", {"tenant"}),
    "adaptermesh_tenant_requests_running": ("gauge", {"tenant"}),
    "adaptermesh_queue_depth_total": ("gauge", set()),
    "adaptermesh_requests_admitted": ("gauge", set()),
    "adaptermesh_time_to_first_token_seconds": ("histogram", set()),
    "adaptermesh_time_per_output_token_seconds": ("histogram", set()),
    "adaptermesh_request_latency_seconds": ("histogram", set()),
    "adaptermesh_queue_wait_seconds": ("histogram", set()),
    "adaptermesh_generation_tokens_per_second": ("gauge", set()),
    "adaptermesh_generation_tokens": ("counter", set()),
    "adaptermesh_prompt_tokens": ("counter", set()),
    "adaptermesh_adapter_cache_hits": ("counter", set()),
    "adaptermesh_adapter_cache_misses": ("counter", set()),
    "adaptermesh_adapter_cache_evictions": ("counter", set()),
    "adaptermesh_adapter_loads_started": ("counter", set()),
    "adaptermesh_adapter_evictions_wanted": ("counter", set()),
    "adaptermesh_admissions_waited_on_adapter_load": ("counter", set()),
    "adaptermesh_scheduler_idle_on_adapter_load": ("counter", set()),
    "adaptermesh_gpu_slots_used": ("gauge", set()),
    "adaptermesh_gpu_slots_total": ("gauge", set()),
    "adaptermesh_adapter_load_latency_seconds": ("histogram", set()),
    "adaptermesh_free_gpu_memory_bytes": ("gauge", set()),
    "adaptermesh_kv_cache_usage_ratio": ("gauge", set()),
    "adaptermesh_max_loras": ("gauge", set()),
    "adaptermesh_requests": ("counter", {"outcome"}),
    "adaptermesh_adapter_requests": ("counter", {"adapter", "outcome"}),
    "adaptermesh_adapter_time_to_first_token_seconds": ("histogram", {"adapter"}),
    "adaptermesh_requests_rejected": ("counter", {"reason"}),
    "adaptermesh_http_connections_refused": ("counter", {"reason"}),
    "adaptermesh_websocket_sessions_open": ("gauge", set()),
    "adaptermesh_websocket_sessions": ("counter", {"close"}),
    "adaptermesh_websocket_requests": ("counter", {"outcome"}),
}


async def scrape(server: Server) -> dict:
    r = await server.client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(families: dict, name: str, sample: str | None = None, **labels: str) -> float:
    family = families[name]
    for s in family.samples:
        if (sample is None or s.name == sample) and all(
            s.labels.get(k) == v for k, v in labels.items()
        ):
            return s.value
    raise KeyError((name, sample, labels))


async def test_every_series_is_present_with_its_type_and_labels(server: Server) -> None:
    # Exercise labelled series once so they have samples.
    await server.client.post(
        "/v1/completions", json={"model": "alpha", "prompt": "a b", "max_tokens": 3}
    )
    server.service.metrics.rejected.labels(reason="tenant_queue_full")
    families = await scrape(server)
    for name, (kind, labels) in EXPECTED.items():
        assert name in families, name
        family = families[name]
        assert family.type == kind, name
        assert family.documentation, name
        for s in family.samples:
            assert set(s.labels) - {"le"} == labels, (name, s)
    # No undocumented series sneak in.
    extra = {n for n in families if n.startswith(("adaptermesh_", "vllm:"))} - set(EXPECTED)
    assert not extra


async def test_values_follow_traffic(start_server: StartServer) -> None:
    engine = FakeEngine(token_delay=0.01, max_batch=1)
    s = await start_server(engine, max_running=2, max_waiting_per_tenant=4)
    body = {"model": "alpha", "prompt": "a b", "max_tokens": 20}
    tasks = [
        asyncio.create_task(
            s.client.post("/v1/completions", json=body, headers={"x-tenant-id": "acme"})
        )
        for _ in range(4)
    ]
    await wait_until(lambda: s.service.queue.num_waiting == 2 and len(engine.running) == 1)
    f = await scrape(s)
    assert value(f, "adaptermesh_queue_depth", tenant="id-acme") == 2
    assert value(f, "adaptermesh_tenant_requests_running", tenant="id-acme") == 2
    # Two in the tenant queue plus one in the engine's own queue (its batch holds one).
    assert value(f, "vllm:num_requests_waiting", model_name="tiny-base") == 3
    assert value(f, "vllm:num_requests_running", model_name="tiny-base") == 1
    assert value(f, "vllm:kv_cache_usage_perc", model_name="tiny-base") == 1.0
    info = f["vllm:lora_requests_info"].samples[0]
    assert info.labels == {
        "running_lora_adapters": "alpha",
        "waiting_lora_adapters": "alpha",
        "max_lora": "4",
    }
    assert info.value > 1e9  # a Unix timestamp, as vLLM sets it
    for t in tasks:
        assert (await t).status_code == 200
    s.service.metrics.poll()
    f = await scrape(s)
    assert value(f, "adaptermesh_queue_depth", tenant="id-acme") == 0
    assert value(f, "adaptermesh_generation_tokens", "adaptermesh_generation_tokens_total") == 80
    assert value(f, "adaptermesh_prompt_tokens", "adaptermesh_prompt_tokens_total") == 8
    assert value(f, "adaptermesh_generation_tokens_per_second") > 0
    assert (
        value(
            f,
            "adaptermesh_time_to_first_token_seconds",
            "adaptermesh_time_to_first_token_seconds_count",
        )
        == 4
    )
    assert (
        value(
            f,
            "adaptermesh_time_per_output_token_seconds",
            "adaptermesh_time_per_output_token_seconds_count",
        )
        == 4
    )
    tpot_sum = value(
        f,
        "adaptermesh_time_per_output_token_seconds",
        "adaptermesh_time_per_output_token_seconds_sum",
    )
    assert 0.005 < tpot_sum / 4 < 0.5
    assert value(f, "adaptermesh_requests", "adaptermesh_requests_total", outcome="length") == 4
    # The first request loaded "alpha" (a miss, one load latency); the other three hit.
    assert (
        value(f, "adaptermesh_adapter_cache_misses", "adaptermesh_adapter_cache_misses_total") == 1
    )
    assert value(f, "adaptermesh_adapter_cache_hits", "adaptermesh_adapter_cache_hits_total") == 3
    assert (
        value(
            f,
            "adaptermesh_adapter_load_latency_seconds",
            "adaptermesh_adapter_load_latency_seconds_count",
        )
        == 1
    )
    assert value(f, "adaptermesh_gpu_slots_used") == 1
    assert value(f, "adaptermesh_gpu_slots_total") == 4


async def test_residency_of_an_engine_without_tiers_is_its_gpu_resident_adapters(
    start_server: StartServer,
) -> None:
    # The fake engine does not tell tiers apart (EngineStats.adapter_residency is None): the
    # GPU tier is what list_adapters() says is resident, and there is no CPU tier.
    engine = FakeEngine()
    engine.adapters["sql"] = AdapterInfo("sql", "ok/sql", 16, True, True)
    engine.adapters["cold"] = AdapterInfo("cold", "ok/cold", 8, False, False)
    s = await start_server(engine)
    f = await scrape(s)
    assert [sample.labels for sample in f["vllm:lora_adapter_loaded"].samples] == [
        {"adapter_name": "sql", "level": "gpu", "pinned": "true", "rank": "16"}
    ]
    assert value(f, "vllm:num_gpu_loaded_lora_adapters", model_name="tiny-base") == 1
    assert value(f, "vllm:max_gpu_lora_adapters", model_name="tiny-base") == 4
    await s.client.post("/v1/completions", json={"model": "alpha", "prompt": "a", "max_tokens": 2})
    s.service.metrics.poll()
    f = await scrape(s)
    # One load latency, in both histograms.
    assert (
        value(
            f,
            "vllm:lora_adapter_load_seconds",
            "vllm:lora_adapter_load_seconds_count",
            model_name="tiny-base",
        )
        == value(
            f,
            "adaptermesh_adapter_load_latency_seconds",
            "adaptermesh_adapter_load_latency_seconds_count",
        )
        == 1
    )


async def test_rejections_are_counted(start_server: StartServer) -> None:
    s = await start_server(
        FakeEngine(token_delay=0.02), max_running=1, max_waiting_per_tenant=1, max_waiting_total=5
    )
    tasks = [
        asyncio.create_task(s.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}))
        for _ in range(4)
    ]
    codes = sorted(r.status_code for r in await asyncio.gather(*tasks))
    assert codes == [200, 200, 429, 429]
    f = await scrape(s)
    assert (
        value(
            f,
            "adaptermesh_requests_rejected",
            "adaptermesh_requests_rejected_total",
            reason="tenant_queue_full",
        )
        == 2
    )


async def test_two_services_in_one_process_do_not_share_series(
    start_server: StartServer,
) -> None:
    a = await start_server()
    b = await start_server()
    await a.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    fa, fb = await scrape(a), await scrape(b)
    count = "adaptermesh_time_to_first_token_seconds_count"
    assert value(fa, "adaptermesh_time_to_first_token_seconds", count) == 1
    assert value(fb, "adaptermesh_time_to_first_token_seconds", count) == 0


def test_every_series_is_documented_with_its_type_and_labels() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "worker-service.md").read_text()
    rows = {}
    for line in doc.splitlines():
        m = re.match(r"\| `((?:vllm:|adaptermesh_)[a-z0-9_:]+)` \| (\w+) \|([^|]*)\|", line)
        if m:
            labels = set(re.findall(r"`(\w+)`", m.group(3)))
            rows[m.group(1)] = (m.group(2), labels)
    for name, (kind, labels) in EXPECTED.items():
        documented = name + "_total" if kind == "counter" else name
        assert documented in rows, name
        assert rows[documented] == (kind, labels), name
    assert len(rows) == len(EXPECTED)


async def test_made_up_model_names_mint_no_series(start_server: StartServer) -> None:
    """600 unauthenticated requests naming 600 made-up models add one ``other`` series, not
    600: the ``adapter`` label takes only adapters the worker knows."""
    s = await start_server(FakeEngine())
    ok = await s.client.post(
        "/v1/completions", json={"model": "alpha", "prompt": "a", "max_tokens": 1}
    )
    assert ok.status_code == 200

    async def made_up(i: int) -> int:
        body = {"model": f"no-such-adapter-{i}", "prompt": "a", "max_tokens": 1}
        return (await s.client.post("/v1/completions", json=body)).status_code

    codes = await asyncio.gather(*(made_up(i) for i in range(600)))
    assert all(400 <= code < 500 for code in codes)
    f = await scrape(s)
    adapters = {
        sample.labels["adapter"]
        for name in (
            "adaptermesh_adapter_requests",
            "adaptermesh_adapter_time_to_first_token_seconds",
        )
        for sample in f[name].samples
    }
    assert adapters <= {"alpha", "other"}
    assert "alpha" in adapters


async def test_adapter_labels_are_capped(start_server: StartServer, monkeypatch) -> None:
    from adaptermesh.worker import metrics as worker_metrics

    monkeypatch.setattr(worker_metrics, "MAX_ADAPTER_LABELS", 2)
    engine = FakeEngine()
    engine.on_disk.add("delta")
    s = await start_server(engine)
    for model in ("alpha", "beta", "gamma", "delta"):
        body = {"model": model, "prompt": "a", "max_tokens": 1}
        assert (await s.client.post("/v1/completions", json=body)).status_code == 200
    labels = s.service.metrics.adapter_label
    assert (labels("alpha"), labels("beta"), labels("gamma")) == ("alpha", "beta", "other")
    f = await scrape(s)
    counted = {
        sample.labels["adapter"]: sample.value
        for sample in f["adaptermesh_adapter_requests"].samples
        if sample.name.endswith("_total")
    }
    assert counted == {"alpha": 1, "beta": 1, "other": 2}


def test_a_version_of_a_known_adapter_is_known() -> None:
    from adaptermesh.worker.fair_queue import FairQueue
    from adaptermesh.worker.metrics import ServiceMetrics

    engine = FakeEngine()
    engine.adapters["alpha"] = AdapterInfo("alpha", "ok", 8, True)
    metrics = ServiceMetrics(
        engine, FairQueue(max_running=1, max_waiting_per_tenant=1, max_waiting_total=1)
    )
    assert metrics.adapter_label("alpha@2.0.0") == "alpha@2.0.0"
    assert metrics.adapter_label("beta@2.0.0") == "other"
    assert metrics.adapter_label("beta") == "other"
