"""Residency series (``vllm:lora_adapter_loaded`` and its siblings) from the real tiny CPU engine:
they follow loads, evictions, pins and unloads per tier, and made-up model names add no series."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import Server, StartServer
from .test_engine_integration import ADAPTERS, PROMPT, QKVO, engine_for, model_files

__all__ = ["model_files"]  # the module-scoped fixture, shared with the integration tests

pytestmark = pytest.mark.slow

# The ranks make_adapter gave a0, a1, a2 in the integration tests' model files.
RANKS = {"a0": "4", "a1": "8", "a2": "12"}

Held = set[tuple[str, str, str, str]]


async def scrape(server: Server) -> dict:
    r = await server.client.get("/metrics")
    assert r.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def held(families: dict) -> Held:
    out: Held = set()
    for s in families["vllm:lora_adapter_loaded"].samples:
        assert s.value == 1.0
        labels = s.labels
        out.add((labels["adapter_name"], labels["level"], labels["pinned"], labels["rank"]))
    return out


def one(families: dict, name: str) -> float:
    return float(families[name].samples[0].value)


async def complete(server: Server, model: str) -> int:
    r = await server.client.post(
        "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 2}
    )
    return r.status_code


async def test_residency_follows_loads_evictions_pins_and_unloads(
    model_files: tuple[Path, Path], start_server: StartServer
) -> None:
    # A pool over exactly the adapters' modules: two slots' bytes never hold all three.
    engine = engine_for(model_files, max_num_seqs=2, max_loras=2, lora_target_modules=QKVO)
    s = await start_server(engine, admin_token="tok")
    admin = {"Authorization": "Bearer tok"}
    try:
        f = await scrape(s)
        assert held(f) == set()
        assert one(f, "vllm:num_gpu_loaded_lora_adapters") == 0
        # The most adapters the arena holds at once (of its smallest shape).
        assert one(f, "vllm:max_gpu_lora_adapters") == engine.pool.num_slots

        # Three adapters through two GPU slots: the first is evicted from the GPU and stays
        # in the CPU cache (the default budget holds all three).
        for name in ADAPTERS:
            assert await complete(s, name) == 200
        f = await scrape(s)
        gpu = {h for h in held(f) if h[1] == "gpu"}
        cpu = {h for h in held(f) if h[1] == "cpu"}
        assert cpu == {(name, "cpu", "false", RANKS[name]) for name in ADAPTERS}
        assert len(gpu) == 2
        assert ("a2", "gpu", "false", "12") in gpu
        assert one(f, "vllm:num_gpu_loaded_lora_adapters") == 2
        evicted = next(n for n in ADAPTERS if (n, "gpu", "false", RANKS[n]) not in gpu)
        loads = "vllm:lora_adapter_load_seconds_count"
        assert {x.name: x.value for x in f["vllm:lora_adapter_load_seconds"].samples}[loads] == 3

        # A pinned load is reported pinned in both tiers.
        r = await s.client.post(
            "/v1/load_lora_adapter",
            headers=admin,
            json={"lora_name": evicted, "lora_path": evicted, "pinned": True},
        )
        assert r.status_code == 200, r.text
        f = await scrape(s)
        assert (evicted, "gpu", "true", RANKS[evicted]) in held(f)
        assert (evicted, "cpu", "true", RANKS[evicted]) in held(f)
        assert (evicted, "gpu", "false", RANKS[evicted]) not in held(f)
        assert one(f, "vllm:num_gpu_loaded_lora_adapters") == 2

        # Unloading drops every sample of the adapter.
        r = await s.client.post(
            "/v1/unload_lora_adapter", headers=admin, json={"lora_name": evicted}
        )
        assert r.status_code == 200, r.text
        f = await scrape(s)
        assert not {h for h in held(f) if h[0] == evicted}
        assert one(f, "vllm:num_gpu_loaded_lora_adapters") == len(
            {h for h in held(f) if h[1] == "gpu"}
        )
    finally:
        await engine.shutdown()


async def test_without_a_cpu_budget_only_the_gpu_tier_holds_adapters(
    model_files: tuple[Path, Path], start_server: StartServer
) -> None:
    # A one-byte CPU cache keeps nothing that is not pinned: adapters live in GPU slots only.
    engine = engine_for(
        model_files, max_num_seqs=2, max_loras=2, cpu_cache_bytes=1, lora_target_modules=QKVO
    )
    s = await start_server(engine)
    try:
        for name in ADAPTERS:
            assert await complete(s, name) == 200
        f = await scrape(s)
        levels = {h[1] for h in held(f)}
        assert levels == {"gpu"}
        assert len(held(f)) == 2
    finally:
        await engine.shutdown()


async def test_made_up_model_names_add_no_series(
    model_files: tuple[Path, Path], start_server: StartServer
) -> None:
    engine = engine_for(model_files, max_num_seqs=2, max_loras=2)
    s = await start_server(engine)
    try:
        assert await complete(s, "a0") == 200
        before = await scrape(s)
        codes = await asyncio.gather(*(complete(s, f"made-up-{i}") for i in range(200)))
        assert set(codes) == {404}
        after = await scrape(s)
        assert held(after) == held(before)
        # Held adapters are bounded by the slots plus what the CPU cache keeps.
        assert len(held(after)) <= 2 + len(ADAPTERS)
        assert not any(
            "made-up" in str(x.labels)
            for family in after.values()
            for x in family.samples
            if family.name.startswith("vllm:")
        )
    finally:
        await engine.shutdown()
