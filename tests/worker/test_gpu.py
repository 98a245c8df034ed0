"""CUDA path: graph-captured decode with the Triton SGMM kernels gives peft's greedy tokens."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from adaptermesh.worker.engine import Engine, EngineConfig

from .conftest import ADAPTERS, PROMPTS, Tiny, collect, request, tokens

pytestmark = pytest.mark.gpu


def _run(tiny: Tiny, *, graphs: bool, dtype: str = "float32") -> tuple[dict[str, list[int]], dict[str, Any]]:
    async def go() -> tuple[dict[str, list[int]], dict[str, Any]]:
        cfg = EngineConfig(max_num_seqs=8, max_loras=4, max_lora_rank=16, max_prefill_chunk=7, use_cuda_graphs=graphs)
        eng = Engine(tiny.model_dir, tiny.root, device="cuda", dtype=dtype, config=cfg, model_name="tiny")
        jobs = {f"{i}-{n}": (tiny.encode(p), n) for i, p in enumerate(PROMPTS) for n in (None, *ADAPTERS)}
        streams = {rid: eng.submit(request(rid, ids, n, max_tokens=8)) for rid, (ids, n) in jobs.items()}
        outs = {rid: tokens(await collect(s)) for rid, s in streams.items()}
        info = eng.describe()
        await eng.shutdown()
        return outs, info

    return asyncio.run(go())


def test_cuda_graph_decode_matches_peft(tiny: Tiny) -> None:
    outs, info = _run(tiny, graphs=True)
    assert info["cuda_graphs"], info
    for rid, got in outs.items():
        i, name = rid.split("-", 1)
        adapter = None if name == "None" else name
        assert got == tiny.ref.greedy(list(tiny.encode(PROMPTS[int(i)])), adapter, 8), rid
    eager, _ = _run(tiny, graphs=False)
    assert eager == outs


def test_bf16_serves_mixed_batch(tiny: Tiny) -> None:
    outs, info = _run(tiny, graphs=True, dtype="bfloat16")
    assert info["cuda_graphs"], info
    assert all(len(v) == 8 for v in outs.values())
