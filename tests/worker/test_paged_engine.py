"""Paged KV through the engine: blocks come back, prompt blocks are shared only between
requests of the same adapter (and never change an output), preempted requests resume with
unchanged output, and seeded sampling does not depend on the batch."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from adaptermesh.worker.kv_cache import KVCacheSpec, spec_bytes_per_token
from adaptermesh.worker.model import ModelConfig

from .conftest import PROMPTS, Tiny, collect, request, tokens

BS = 8


def _long_prompt(tiny: Tiny, n: int) -> tuple[int, ...]:
    ids = list(tiny.encode(" ".join(PROMPTS)))
    while len(ids) < n:
        ids += ids
    return tuple(ids[:n])


def _kv_bytes(tiny: Tiny, tokens_held: int) -> int:
    mc = ModelConfig.from_dir(tiny.model_dir)
    import torch

    spec = KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, BS, torch.float32)
    return spec_bytes_per_token(spec) * tokens_held


async def test_blocks_return_to_the_pool(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine(block_size=BS, enable_prefix_caching=False)
    free0 = eng.blocks.num_free()
    ids = _long_prompt(tiny, 37)
    outs = await asyncio.gather(
        *(collect(eng.submit(request(f"r{i}", ids, "alpha", max_tokens=9))) for i in range(5))
    )
    assert all(len(tokens(o)) == 9 for o in outs)
    assert eng.blocks.num_free() == free0 == eng.kv.num_blocks - 1
    assert eng.stats().kv_cache_usage == 0.0


async def test_prefix_blocks_are_shared_within_an_adapter_only(
    tiny: Tiny, make_engine: Any
) -> None:
    eng = make_engine(block_size=BS)
    ids = _long_prompt(tiny, 3 * BS + 5)
    want_alpha = tiny.ref.greedy(list(ids), "alpha", 6)
    want_beta = tiny.ref.greedy(list(ids), "beta", 6)
    first = tokens(await collect(eng.submit(request("a1", ids, "alpha", max_tokens=6))))
    hits0 = eng.describe()["prefix_hit_tokens"]
    second = tokens(await collect(eng.submit(request("a2", ids, "alpha", max_tokens=6))))
    hits1 = eng.describe()["prefix_hit_tokens"]
    other = tokens(await collect(eng.submit(request("b1", ids, "beta", max_tokens=6))))
    hits2 = eng.describe()["prefix_hit_tokens"]
    base = tokens(await collect(eng.submit(request("n1", ids, None, max_tokens=6))))
    hits3 = eng.describe()["prefix_hit_tokens"]
    assert first == second == want_alpha
    assert hits1 - hits0 == 3 * BS  # every full prompt block came from the cache
    assert other == want_beta
    assert hits2 == hits1  # same tokens, other adapter: nothing shared
    assert base == tiny.ref.greedy(list(ids), None, 6)
    assert hits3 == hits2


async def test_whole_prompt_cached_still_computes_its_last_token(
    tiny: Tiny, make_engine: Any
) -> None:
    eng = make_engine(block_size=BS)
    ids = _long_prompt(tiny, 2 * BS)  # an exact multiple of the block size
    a = tokens(await collect(eng.submit(request("a", ids, "gamma", max_tokens=5))))
    b = tokens(await collect(eng.submit(request("b", ids, "gamma", max_tokens=5))))
    assert a == b == tiny.ref.greedy(list(ids), "gamma", 5)


async def test_preempted_requests_resume_with_unchanged_output(
    tiny: Tiny, make_engine: Any
) -> None:
    n_req, prompt_len, new = 6, 20, 24
    # Room for about three sequences at full length: the others are preempted while decoding.
    eng = make_engine(
        block_size=BS,
        max_num_seqs=n_req,
        max_model_len=64,
        kv_cache_bytes=_kv_bytes(tiny, 3 * (prompt_len + new) + BS),
        enable_prefix_caching=False,
    )
    names = [None, "alpha", "beta", "gamma", "delta", "alpha"]
    prompts = [_long_prompt(tiny, prompt_len + i) for i in range(n_req)]
    greedy = [request(f"g{i}", prompts[i], names[i], max_tokens=new) for i in range(n_req)]
    seeded = [
        request(
            f"s{i}", prompts[i], names[i], max_tokens=new, temperature=0.9, top_p=0.95, seed=100 + i
        )
        for i in range(n_req)
    ]
    outs = await asyncio.gather(*(collect(eng.submit(r)) for r in greedy + seeded))
    assert eng.describe()["preemptions"] > 0
    for i in range(n_req):
        assert tokens(outs[i]) == tiny.ref.greedy(list(prompts[i]), names[i], new), i
    # The same seeded requests alone, with no memory pressure: the same tokens.
    calm = make_engine(block_size=BS, enable_prefix_caching=False)
    for i, r in enumerate(seeded):
        alone = tokens(await collect(calm.submit(r)))
        assert alone == tokens(outs[n_req + i]), i
    assert calm.describe()["preemptions"] == 0


async def test_seeded_tokens_do_not_depend_on_the_batch(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine(block_size=BS)
    ids = tiny.encode(PROMPTS[2])
    mine = request("mine", ids, "beta", max_tokens=10, temperature=1.0, top_k=20, seed=42)
    alone = tokens(await collect(eng.submit(mine)))
    noise = [
        request(
            f"n{i}",
            tiny.encode(PROMPTS[i % 3]),
            [None, "alpha", "delta"][i % 3],
            max_tokens=4 + i,
            temperature=0.7 * (i % 2),
            seed=i,
        )
        for i in range(5)
    ]
    outs = await asyncio.gather(*(collect(eng.submit(r)) for r in [*noise[:2], mine, *noise[2:]]))
    assert tokens(outs[2]) == alone


async def test_overlapped_steps_match_peft(tiny: Tiny, make_engine: Any) -> None:
    # Step N+1 is planned before step N's tokens reach the host: decode rows gather their input
    # from the device, and tokens of sequences that stopped meanwhile are dropped.
    eng = make_engine(
        block_size=BS,
        async_scheduling=True,
        max_num_seqs=4,
        max_prefill_chunk=5,
        max_num_batched_tokens=12,
    )
    names: list[str | None] = [None, "alpha", "beta", "gamma", "delta"]
    jobs = [
        (f"o{i}-{n}", tiny.encode(p), n, 5 + (i + j) % 4)
        for i, p in enumerate(PROMPTS)
        for j, n in enumerate(names)
    ]
    outs = await asyncio.gather(
        *(collect(eng.submit(request(r, ids, n, max_tokens=k))) for r, ids, n, k in jobs)
    )
    for (rid, ids, name, k), ev in zip(jobs, outs, strict=True):
        assert tokens(ev) == tiny.ref.greedy(list(ids), name, k), rid
        assert ev[-1].completion_tokens == k
    assert eng.describe()["async_scheduling"] is True
    assert eng.blocks.num_free() == eng.kv.num_blocks - 1


async def test_overlapped_stop_string_drops_the_extra_token(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine(block_size=BS, async_scheduling=True)
    ids = tiny.encode(PROMPTS[1])
    full = await collect(eng.submit(request("full", ids, "alpha", max_tokens=12)))
    text = "".join(e.text for e in full)
    assert len(text) >= 4, text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = await collect(eng.submit(request("cut", ids, "alpha", max_tokens=12, stop=(stop,))))
    assert cut[-1].finish_reason == "stop"
    assert "".join(e.text for e in cut) == text[: text.find(stop)]
    assert eng.stats().num_running == 0
    assert eng.blocks.num_free() == eng.kv.num_blocks - 1


def test_a_cache_smaller_than_one_context_is_refused(tiny: Tiny) -> None:
    from adaptermesh.worker.engine import Engine, EngineConfig

    cfg = EngineConfig(block_size=BS, max_model_len=64, kv_cache_bytes=_kv_bytes(tiny, 40))
    with pytest.raises(ValueError, match="max_model_len=64"):
        Engine(tiny.model_dir, tiny.root, config=cfg)
